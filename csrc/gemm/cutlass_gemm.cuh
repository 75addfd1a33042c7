// What the sm90 and sm100 dense GEMMs share: the epilogue visitor tree, its arguments,
// and the run/workspace glue around a CUTLASS GemmUniversalAdapter.
//
// Epilogue, for every dtype:
//   D = beta_c * C + alpha * (scale_b[n] * (scale_a[m] * acc)) + beta_bias * bias[n]
// Scales are per-row/per-column vectors or single values (CUTLASS's dynamic broadcast), or
// absent (null pointer, read as 1); C is not loaded when absent, bias reads as 0.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>

#include "common/cutlass_types.cuh"
#include "common/status.h"
#include "gemm/gemm_problem.h"

namespace distgemm::gemm {

namespace fusion = cutlass::epilogue::fusion;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

template <class ElementD, class TileShape>
using ScaledBiasEpilogue = fusion::Sm90EVT<
    fusion::Sm90Compute<cutlass::homogeneous_multiply_add, ElementD, float, kRound>,  // beta_c*C + Z
    fusion::Sm90ScalarBroadcast<float>,                                               // beta_c
    fusion::Sm90SrcFetch<ElementD>,                                                   // C
    fusion::Sm90EVT<
        fusion::Sm90Compute<cutlass::homogeneous_multiply_add, float, float, kRound>,  // alpha*X + Y
        fusion::Sm90ScalarBroadcast<float>,                                            // alpha
        fusion::Sm90EVT<
            fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>,  // X = sb * (sa * acc)
            fusion::Sm90RowBroadcast<0, TileShape, float, float, cute::Stride<cute::_0, bool, int64_t>>,
            fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>,
                            fusion::Sm90ColBroadcast<0, TileShape, float, float, cute::Stride<bool, cute::_0, int64_t>>,
                            fusion::Sm90AccFetch>>,
        fusion::Sm90EVT<
            fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>,  // Y
            fusion::Sm90ScalarBroadcast<float>,                              // beta_bias
            fusion::Sm90RowBroadcast<0, TileShape, ElementD, float, cute::Stride<cute::_0, cute::_1, int64_t>>>>>;

// Arguments of ScaledBiasEpilogue, in the tree's order.
template <class EpilogueArgs, class ElementD>
EpilogueArgs scaled_bias_epilogue_args(const GemmProblem& p) {
  using cute::_0;
  EpilogueArgs args{};
  args.op_0.scalars[0] = p.c ? p.beta_c : 0.f;  // 0 also skips loading C
  auto& z = args.op_2;
  z.op_0.scalars[0] = p.alpha;
  z.op_1.op_0 = {p.scale_b, 1.f, {_0{}, p.scale_b_per_col, 0}};
  z.op_1.op_1.op_0 = {p.scale_a, 1.f, {p.scale_a_per_row, _0{}, 0}};
  z.op_2.op_0.scalars[0] = p.beta_bias;
  z.op_2.op_1 = {static_cast<ElementD const*>(p.bias), ElementD(0), {}};
  return args;
}

// GemmUniversal arguments for a GEMM type G (Sm90Gemm / Sm100Gemm) on problem p.
template <class G>
typename G::Adapter::Arguments gemm_arguments(const GemmProblem& p) {
  using Kernel = typename G::Kernel;
  using cute::get;
  typename Kernel::StrideA stride_a{};
  typename Kernel::StrideB stride_b{};
  typename Kernel::StrideD stride_d{};
  get<0>(stride_a) = p.lda;
  if constexpr (G::kBKMajor)
    get<0>(stride_b) = p.ldb;
  else
    get<1>(stride_b) = p.ldb;
  get<0>(stride_d) = p.ldd;
  typename Kernel::StrideC stride_c = stride_d;
  if (p.c) get<0>(stride_c) = p.ldc;

  cutlass::KernelHardwareInfo hw{p.device, p.sm_count};
  typename G::Adapter::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {p.m, p.n, p.k, 1},
      {static_cast<typename G::ElementA const*>(p.a), stride_a, static_cast<typename G::ElementB const*>(p.b),
       stride_b},
      {{}, static_cast<typename G::ElementD const*>(p.c), stride_c, static_cast<typename G::ElementD*>(p.d), stride_d},
      hw};
  args.epilogue.thread =
      scaled_bias_epilogue_args<typename G::CollectiveEpilogue::FusionCallbacks::Arguments, typename G::ElementD>(p);
  args.scheduler.max_swizzle_size = p.swizzle;
  if constexpr (G::kArch == 90) {
    args.scheduler.sync = p.sync;
    if (p.sync.num_chunks > 0 || p.sync.c_ready) {
      // Chunk order needs row-blocks walked one after another.
      args.scheduler.raster_order = decltype(args.scheduler.raster_order)::AlongN;
    }
  }
  return args;
}

template <class G>
dg_status run_gemm(const GemmProblem& p, cudaStream_t stream) {
  typename G::Adapter gemm;
  auto args = gemm_arguments<G>(p);
  if (gemm.can_implement(args) != cutlass::Status::kSuccess)
    return fail(DG_ERROR_INTERNAL,
                cat("CUTLASS sm", G::kArch, " GEMM cannot implement M=", p.m, " N=", p.n, " K=", p.k));
  if (gemm.initialize(args, p.workspace, stream) != cutlass::Status::kSuccess)
    return fail(DG_ERROR_INTERNAL, cat("CUTLASS sm", G::kArch, " GEMM initialization failed"));
  if (gemm.run(stream) != cutlass::Status::kSuccess)
    return fail(DG_ERROR_CUDA, cat("sm", G::kArch, " GEMM launch failed: ", cudaGetErrorString(cudaGetLastError())));
  return DG_SUCCESS;
}

template <class G>
size_t gemm_workspace(const GemmProblem& p) {
  return G::Adapter::get_workspace_size(gemm_arguments<G>(p));
}

}  // namespace distgemm::gemm

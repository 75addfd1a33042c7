// SM90 FP8 grouped GEMM for MoE: CUTLASS's ptr-array blockwise-scaled kernel. Partial sums
// are promoted to FP32 once per 128-deep K block into a split accumulator (CUTLASS >= 4.3),
// so 256 x 128 tiles fit in registers. Schedules: CUTLASS's cooperative or ping-pong kernel,
// each with CUTLASS's mainloop or the one of sm90_fp8_overlapped_promotion.cuh (*_overlap).
//   block scales: the promotion multiplies by scale_a * scale_b of the block;
//   row-wise scales (constant along K): the promotion multiplies by 1 and the epilogue by
//   scale_a[m] * scale_b[g][n], so the mainloop does no per-element scale work.
//
// The mainloop reads each group's block scales packed as (K blocks, rows) (MN-major, strides
// from the group's own shape), so a small kernel, run before the GEMM, writes per group: the
// problem shape, pointers and strides, and (block forward) the scales repacked from the
// caller's layout into the workspace. Nothing is read on the host.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>

#include "common/cutlass_types.cuh"
#include "common/status.h"
#include "grouped/grouped_problem.h"
#include "grouped/sm90_fp8_overlapped_promotion.cuh"
#include "grouped/sm90_grouped_common.cuh"

namespace distgemm::grouped::sm90 {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

// Row-wise scales in the epilogue: D = beta * C + scale_b[g][n] * (scale_a[m] * acc), the
// scale vectors one pointer per group.
template <class ElementD, class TileShape>
using RowScaledEpilogue = fusion::Sm90EVT<
    fusion::Sm90Compute<cutlass::homogeneous_multiply_add, ElementD, float, cutlass::FloatRoundStyle::round_to_nearest>,
    fusion::Sm90ScalarBroadcast<float>, fusion::Sm90SrcFetch<ElementD>,
    fusion::Sm90EVT<
        fusion::Sm90Compute<cutlass::multiplies, float, float, cutlass::FloatRoundStyle::round_to_nearest>,
        fusion::Sm90RowBroadcast<0, TileShape, float*, float, Stride<_0, _1, _0>>,
        fusion::Sm90EVT<
            fusion::Sm90Compute<cutlass::multiplies, float, float, cutlass::FloatRoundStyle::round_to_nearest>,
            fusion::Sm90ColBroadcast<0, TileShape, float*, float, Stride<_1, _0, _0>>, fusion::Sm90AccFetch>>>;

// Mode: DG_SCALE_ROW or DG_SCALE_BLOCK; Kind: forward (x (T, K) @ w[g]^T, w (G, N, K)) or
// wgrad (dy^T @ x over each group's tokens, both given transposed and padded per group). InA:
// A's dtype, e4m3, or e5m2 for a gradient (dy in a dgrad, dy^T in a wgrad); B is e4m3.
template <int Mode, dg_dtype Out, int Kind, int Schedule, int TileM, int TileN, int ClusterM, int ClusterN,
          dg_dtype InA>
struct Sm90Fp8Grouped {
  static constexpr int kKind = Kind;
  static constexpr int kMode = Mode;
  static constexpr int kBlockK = 128;  // scale granularity along K = one promotion
  static constexpr bool kRowScaled = Mode == DG_SCALE_ROW;
  // Block forward: w's scales cover 128 x 128, x's 1 x 128; wgrad: 1 x 128 for both. Row-wise:
  // the mainloop's scales are ones, one per tile.
  static constexpr int kScaleM = kRowScaled ? TileM : 1;
  static constexpr int kScaleN = kRowScaled ? TileN : Kind == DG_GROUPED_FORWARD ? 128 : 1;
  using ElementA = cutlass_type_t<InA>;
  using ElementB = cutlass::float_e4m3_t;
  using ElementD = cutlass_type_t<Out>;
  using LayoutA = cutlass::layout::RowMajor;     // (M, K), K-major
  using LayoutB = cutlass::layout::ColumnMajor;  // (N, K), K-major: FP8 WGMMA reads K-major only
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlign = 16;
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<kScaleM, kScaleN, kBlockK>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using TileShape = Shape<Int<TileM>, Int<TileN>, Int<kBlockK>>;
  using ClusterShape = Shape<Int<ClusterM>, Int<ClusterN>, _1>;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  // Ping-pong: each consumer warpgroup owns a tile, one's epilogue runs under the other's
  // mainloop. *_overlap: the mainloop of sm90_fp8_overlapped_promotion.cuh.
  static_assert(Schedule == gemm::kCooperative || Schedule == gemm::kCooperativeOverlapPromotion ||
                    Schedule == gemm::kPingpong || Schedule == gemm::kPingpongOverlapPromotion,
                "FP8 grouped schedules: coop, coop_overlap, pingpong, pingpong_overlap");
  static constexpr bool kPingpong = Schedule == gemm::kPingpong || Schedule == gemm::kPingpongOverlapPromotion;
  static constexpr bool kOverlapPromotion =
      Schedule == gemm::kCooperativeOverlapPromotion || Schedule == gemm::kPingpongOverlapPromotion;
  using KernelSchedule =
      std::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>;
  using EpilogueSchedule = std::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                              cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

  using Fusion = std::conditional_t<kRowScaled, RowScaledEpilogue<ElementD, TileShape>,
                                    fusion::LinearCombination<ElementD, float>>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementD, LayoutD*, kAlignD, ElementD, LayoutD*,
      kAlignD, EpilogueSchedule, Fusion>::CollectiveOp;

  using CutlassMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<LayoutA*, LayoutSFA*>, kAlign,
      ElementB, cute::tuple<LayoutB*, LayoutSFB*>, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using CollectiveMainloop =
      std::conditional_t<kOverlapPromotion, OverlappedPromotionMma<CutlassMainloop>, CutlassMainloop>;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;

  // Per-group argument arrays and repacked scales, carved out of the caller's workspace.
  struct Arrays {
    Shape3* shapes;
    ElementA const** ptr_a;
    ElementB const** ptr_b;
    ElementD const** ptr_c;
    ElementD** ptr_d;
    float const** ptr_sfa;
    float const** ptr_sfb;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideD* stride_d;
    LayoutSFA* layout_sfa;
    LayoutSFB* layout_sfb;
    float* packed_sfa;            // block forward: T * Kb scales, group g's (Kb, rows) at start_g * Kb
    float* ones;                  // row-wise: the mainloop's scales, enough for any group
    float const** ptr_row_scale;  // row-wise: scale_b + g * N
    float const** ptr_col_scale;  // row-wise: scale_a + start_g
    uint8_t* zeros;  // wgrad: 128 x max(N, K) zero bytes (0 in e4m3 and e5m2), the operands of empty groups
    void* cutlass_workspace;
  };

  CUTE_HOST_DEVICE static int64_t k_blocks(int64_t k) { return (k + kBlockK - 1) / kBlockK; }
  // Row-wise: ones for the mainloop's per-tile scales of the largest group, and of N.
  CUTE_HOST_DEVICE static int64_t ones_count(const GroupedProblem& p) {
    if (!kRowScaled) return 0;
    const int64_t m_tiles = (p.tokens + TileM - 1) / TileM, n_tiles = (p.n + TileN - 1) / TileN;
    return (m_tiles > n_tiles ? m_tiles : n_tiles) * k_blocks(p.k);
  }

  // Lays out the arrays (base == nullptr only measures); returns the bytes used.
  static size_t carve(const GroupedProblem& p, char* base, Arrays* out) {
    const size_t g = static_cast<size_t>(p.groups);
    WorkspaceCarver w{base};
    auto take = [&](auto** field, size_t count) { w.take(field, count); };
    const bool forward = Kind == DG_GROUPED_FORWARD;
    Arrays a{};
    take(&a.shapes, g);
    take(&a.ptr_a, g);
    take(&a.ptr_b, g);
    take(&a.ptr_c, g);
    take(&a.ptr_d, g);
    take(&a.ptr_sfa, g);
    take(&a.ptr_sfb, g);
    take(&a.stride_a, g);
    take(&a.stride_b, g);
    take(&a.stride_d, g);
    take(&a.layout_sfa, g);
    take(&a.layout_sfb, g);
    take(&a.packed_sfa, forward && !kRowScaled ? static_cast<size_t>(p.tokens * k_blocks(p.k)) : 0);
    take(&a.ones, static_cast<size_t>(ones_count(p)));
    take(&a.ptr_row_scale, kRowScaled ? g : 0);
    take(&a.ptr_col_scale, kRowScaled ? g : 0);
    take(&a.zeros, forward ? 0 : static_cast<size_t>(kBlockK * std::max(p.n, p.k)));
    if (base) a.cutlass_workspace = base + w.used;
    if (out) *out = a;
    return w.used;
  }

  static typename Adapter::Arguments arguments(const GroupedProblem& p, const Arrays& arr) {
    typename CollectiveEpilogue::FusionCallbacks::Arguments fusion{};
    if constexpr (kRowScaled) {
      fusion.op_0.scalars[0] = p.accumulate ? 1.f : 0.f;
      fusion.op_2.op_0 = {arr.ptr_row_scale, 1.f, {}};
      fusion.op_2.op_1.op_0 = {arr.ptr_col_scale, 1.f, {}};
    } else {
      fusion.alpha = 1.f;
      fusion.beta = p.accumulate ? 1.f : 0.f;
    }
    cutlass::KernelHardwareInfo hw{p.device, p.sm_count};
    return typename Adapter::Arguments{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {p.groups, arr.shapes, nullptr},
        {arr.ptr_a, arr.stride_a, arr.ptr_b, arr.stride_b, arr.ptr_sfa, arr.layout_sfa, arr.ptr_sfb, arr.layout_sfb},
        {fusion, p.accumulate ? arr.ptr_c : nullptr, arr.stride_d, arr.ptr_d, arr.stride_d},
        hw};
  }
};

template <class G>
__device__ void fill_fp8_group_arguments(typename G::Arrays& arr, const GroupedProblem& p, int g) {
  using ElementA = typename G::ElementA;
  using ElementB = typename G::ElementB;
  using ElementD = typename G::ElementD;
  const GroupRows r = group_rows(p.offs, p.tokens, g);
  auto const* a = static_cast<ElementA const*>(p.a);
  auto const* b = static_cast<ElementB const*>(p.b);
  auto* d = static_cast<ElementD*>(p.d);
  typename G::StrideA sa{};
  typename G::StrideB sb{};
  typename G::StrideD sd{};
  // k: read in one kind's branch only (the other instantiations would warn it unused).
  const int n = static_cast<int>(p.n);
  [[maybe_unused]] const int k = static_cast<int>(p.k);
  constexpr int kBlock = G::kBlockK;
  typename G::Shape3 shape;
  if constexpr (G::kKind == DG_GROUPED_WGRAD) {
    // out[g] (N, K) = dy_t[:, cols] (N x len) @ x_t[:, cols]^T, cols = the group's padded
    // token columns starting at 128 * (g + start / 128); the padding holds zeros.
    const int64_t block = g + r.start / kBlock;
    const int64_t depth = (r.rows + kBlock - 1) / kBlock * kBlock;
    get<0>(sa) = p.token_pitch;
    get<0>(sb) = p.token_pitch;
    get<0>(sd) = p.k;
    arr.ptr_d[g] = d + static_cast<int64_t>(g) * p.n * p.k;
    if (r.rows > 0) {
      shape = {n, k, static_cast<int>(depth)};
      arr.ptr_a[g] = a + block * kBlock;
      arr.ptr_b[g] = b + block * kBlock;
      arr.ptr_sfa[g] = p.scale_a + block * p.n;
      arr.ptr_sfb[g] = p.scale_b + block * p.k;
    } else {
      // No tokens: one zero-valued K block writes zeros (or, accumulating, nothing at all).
      shape = {p.accumulate ? 0 : n, k, kBlock};
      get<0>(sa) = kBlock;
      get<0>(sb) = kBlock;
      arr.ptr_a[g] = reinterpret_cast<ElementA const*>(arr.zeros);
      arr.ptr_b[g] = reinterpret_cast<ElementB const*>(arr.zeros);
      arr.ptr_sfa[g] = reinterpret_cast<float const*>(arr.zeros);
      arr.ptr_sfb[g] = reinterpret_cast<float const*>(arr.zeros);
    }
  } else {
    const int64_t kb = G::k_blocks(p.k);
    shape = {static_cast<int>(r.rows), n, k};
    arr.ptr_a[g] = a + r.start * p.k;
    arr.ptr_b[g] = b + static_cast<int64_t>(g) * p.n * p.k;
    arr.ptr_d[g] = d + r.start * p.n;
    get<0>(sa) = p.k;
    get<0>(sb) = p.k;
    get<0>(sd) = p.n;
    if constexpr (G::kRowScaled) {
      arr.ptr_sfa[g] = arr.ones;
      arr.ptr_sfb[g] = arr.ones;
      arr.ptr_col_scale[g] = p.scale_a + r.start;
      arr.ptr_row_scale[g] = p.scale_b + static_cast<int64_t>(g) * p.n;
    } else {
      arr.ptr_sfa[g] = arr.packed_sfa + r.start * kb;
      arr.ptr_sfb[g] = p.scale_b + static_cast<int64_t>(g) * kb * ((p.n + 127) / 128);
    }
  }
  arr.shapes[g] = shape;
  arr.ptr_c[g] = arr.ptr_d[g];
  arr.stride_a[g] = sa;
  arr.stride_b[g] = sb;
  arr.stride_d[g] = sd;
  arr.layout_sfa[g] =
      G::ScaleConfig::tile_atom_to_shape_SFA(make_shape(get<0>(shape), get<1>(shape), get<2>(shape), 1));
  arr.layout_sfb[g] =
      G::ScaleConfig::tile_atom_to_shape_SFB(make_shape(get<0>(shape), get<1>(shape), get<2>(shape), 1));
}

// blockIdx.y strides over the groups: block x == 0, thread 0 fills the group's arguments, and
// every block of the row repacks its share of the group's scales (forward only).
template <class G>
__global__ void build_fp8_grouped_arguments(typename G::Arrays arr, GroupedProblem p) {
  allow_dependent_gemm_launch();
  const int64_t threads = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (blockIdx.y == 0) {
    if constexpr (G::kKind == DG_GROUPED_WGRAD) {
      constexpr int64_t kBlock = G::kBlockK;
      const int64_t zeros = kBlock * (p.n > p.k ? p.n : p.k);
      for (int64_t i = tid; i < zeros; i += threads) arr.zeros[i] = 0;
    }
    const int64_t ones = G::ones_count(p);
    for (int64_t i = tid; i < ones; i += threads) arr.ones[i] = 1.f;
  }
  for (int64_t g = blockIdx.y; g < p.groups; g += gridDim.y) {
    if (tid == 0) fill_fp8_group_arguments<G>(arr, p, static_cast<int>(g));
    if constexpr (G::kKind == DG_GROUPED_FORWARD && !G::kRowScaled) {
      // x's scales, (t, kb) at scale_a[kb * ld + t], into the group's (Kb, rows) block.
      const GroupRows r = group_rows(p.offs, p.tokens, static_cast<int>(g));
      const int64_t kb = G::k_blocks(p.k);
      float* sfa = arr.packed_sfa + r.start * kb;
      for (int64_t i = tid; i < r.rows * kb; i += threads) {
        const int64_t blk = i / r.rows, row = i - blk * r.rows;
        sfa[i] = p.scale_a[blk * p.scale_a_ld + r.start + row];
      }
    }
  }
}

// Builds the per-group arguments on the device, then runs the kernel.
template <class G>
dg_status run_fp8_grouped(const GroupedProblem& p, cudaStream_t stream) {
  const dim3 grid(32, static_cast<unsigned>(std::min<int64_t>(p.groups, 65535)));
  return run_cutlass_grouped<G>(p, stream, "sm90 FP8 grouped GEMM", [&](typename G::Arrays& arr) {
    build_fp8_grouped_arguments<G><<<grid, 256, 0, stream>>>(arr, p);
  });
}

}  // namespace distgemm::grouped::sm90

namespace distgemm::grouped {

template <int Mode, dg_dtype Out, int Kind, int S, int TM, int TN, int CM, int CN, dg_dtype InA>
dg_status Sm90Fp8GroupedKernel<Mode, Out, Kind, S, TM, TN, CM, CN, InA>::run(const GroupedProblem& p,
                                                                             cudaStream_t stream) {
  return sm90::run_fp8_grouped<sm90::Sm90Fp8Grouped<Mode, Out, Kind, S, TM, TN, CM, CN, InA>>(p, stream);
}

template <int Mode, dg_dtype Out, int Kind, int S, int TM, int TN, int CM, int CN, dg_dtype InA>
size_t Sm90Fp8GroupedKernel<Mode, Out, Kind, S, TM, TN, CM, CN, InA>::workspace(const GroupedProblem& p) {
  return sm90::cutlass_grouped_workspace<sm90::Sm90Fp8Grouped<Mode, Out, Kind, S, TM, TN, CM, CN, InA>>(p);
}

}  // namespace distgemm::grouped

#define DG_INSTANTIATE_SM90_FP8_GROUPED(MODE, OUT, KIND, S, TM, TN, CM, CN)                                      \
  template struct distgemm::grouped::Sm90Fp8GroupedKernel<distgemm::grouped::MODE, OUT, distgemm::grouped::KIND, \
                                                          distgemm::grouped::S, TM, TN, CM, CN, DG_E4M3>;

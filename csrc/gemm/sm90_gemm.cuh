// SM90 dense GEMM: TMA + WGMMA warp-specialized persistent kernels (cooperative or
// ping-pong) from CUTLASS collective builders, with the shared ScaledBiasEpilogue.
#pragma once

#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "gemm/cutlass_gemm.cuh"
#include "gemm/sm90_tile_scheduler.cuh"

namespace distgemm::gemm::sm90 {

using namespace cute;

template <int Sched>
struct ScheduleTraits;
template <>
struct ScheduleTraits<kCooperative> {
  using Mainloop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
template <>
struct ScheduleTraits<kPingpong> {
  using Mainloop = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
};
template <>
struct ScheduleTraits<kCooperativeFastAccum> {
  using Mainloop = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
template <>
struct ScheduleTraits<kPingpongFastAccum> {
  using Mainloop = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
};

template <dg_dtype A, dg_dtype B, dg_dtype D, bool BKMajor, int Sched, int TileM, int TileN, int ClusterM, int ClusterN>
struct Sm90Gemm {
  static constexpr int kArch = 90;
  static constexpr bool kBKMajor = BKMajor;
  using ElementA = cutlass_type_t<A>;
  using ElementB = cutlass_type_t<B>;
  using ElementD = cutlass_type_t<D>;
  using LayoutA = cutlass::layout::RowMajor;  // K-major
  // CUTLASS sees B as (K, N): column-major is our K-major (N, K) row-major weight.
  using LayoutB = std::conditional_t<BKMajor, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignA = 16 / sizeof(ElementA);
  static constexpr int kAlignB = 16 / sizeof(ElementB);
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  // 128 bytes of K per stage: 64 elements in 16-bit, 128 in FP8.
  static constexpr int kTileK = 128 / sizeof(ElementA);
  using TileShape = Shape<Int<TileM>, Int<TileN>, Int<kTileK>>;
  using ClusterShape = Shape<Int<ClusterM>, Int<ClusterN>, _1>;
  using Traits = ScheduleTraits<Sched>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementD, LayoutD, kAlignD, ElementD, LayoutD,
      kAlignD, typename Traits::Epilogue, ScaledBiasEpilogue<ElementD, TileShape>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, kAlignA, ElementB, LayoutB, kAlignB,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Traits::Mainloop>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue,
                                                      SyncTileSchedulerTag>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

}  // namespace distgemm::gemm::sm90

namespace distgemm::gemm {

template <dg_dtype A, dg_dtype B, dg_dtype D, bool BK, int S, int TM, int TN, int CM, int CN>
dg_status Sm90GemmKernel<A, B, D, BK, S, TM, TN, CM, CN>::run(const GemmProblem& p, cudaStream_t stream) {
  return run_gemm<sm90::Sm90Gemm<A, B, D, BK, S, TM, TN, CM, CN>>(p, stream);
}

template <dg_dtype A, dg_dtype B, dg_dtype D, bool BK, int S, int TM, int TN, int CM, int CN>
size_t Sm90GemmKernel<A, B, D, BK, S, TM, TN, CM, CN>::workspace(const GemmProblem& p) {
  return gemm_workspace<sm90::Sm90Gemm<A, B, D, BK, S, TM, TN, CM, CN>>(p);
}

}  // namespace distgemm::gemm

// Explicit instantiation used by the files generated from gemm_instances.def.
#define DG_INSTANTIATE_SM90_GEMM(A, B, D, BK, S, TM, TN, CM, CN) \
  template struct distgemm::gemm::Sm90GemmKernel<A, B, D, BK, distgemm::gemm::S, TM, TN, CM, CN>;

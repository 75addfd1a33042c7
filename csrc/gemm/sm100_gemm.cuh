// SM100 dense GEMM: tcgen05 UMMA warp-specialized kernels (1-SM or 2-SM) from CUTLASS
// collective builders, with the shared ScaledBiasEpilogue. Built for sm_100a; not run here.
#pragma once

#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "gemm/cutlass_gemm.cuh"

namespace distgemm::gemm::sm100 {

using namespace cute;

template <int Sched>
struct ScheduleTraits;
template <>
struct ScheduleTraits<kOneSm> {
  using Mainloop = cutlass::gemm::KernelTmaWarpSpecialized1SmSm100;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized1Sm;
};
template <>
struct ScheduleTraits<kTwoSm> {
  using Mainloop = cutlass::gemm::KernelTmaWarpSpecialized2SmSm100;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized2Sm;
};

template <dg_dtype A, dg_dtype B, dg_dtype D, bool BKMajor, int Sched, int TileM, int TileN, int ClusterM, int ClusterN>
struct Sm100Gemm {
  static constexpr int kArch = 100;
  static constexpr bool kBKMajor = BKMajor;
  using ElementA = cutlass_type_t<A>;
  using ElementB = cutlass_type_t<B>;
  using ElementD = cutlass_type_t<D>;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = std::conditional_t<BKMajor, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignA = 16 / sizeof(ElementA);
  static constexpr int kAlignB = 16 / sizeof(ElementB);
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  static constexpr int kTileK = 128 / sizeof(ElementA);
  // TileM is the MMA tile: a 2-SM pair computes 256 rows, each SM half of them.
  using MmaTileShape = Shape<Int<TileM>, Int<TileN>, Int<kTileK>>;
  using ClusterShape = Shape<Int<ClusterM>, Int<ClusterN>, _1>;
  using Traits = ScheduleTraits<Sched>;
  using EpilogueTile = Shape<Int<(Sched == kTwoSm ? TileM / 2 : TileM)>, Int<TileN>, Int<kTileK>>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, MmaTileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementD, LayoutD, kAlignD, ElementD, LayoutD,
      kAlignD, typename Traits::Epilogue, ScaledBiasEpilogue<ElementD, EpilogueTile>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, kAlignA, ElementB, LayoutB, kAlignB,
      float, MmaTileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Traits::Mainloop>::CollectiveOp;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

}  // namespace distgemm::gemm::sm100

namespace distgemm::gemm {

template <dg_dtype A, dg_dtype B, dg_dtype D, bool BK, int S, int TM, int TN, int CM, int CN>
dg_status Sm100GemmKernel<A, B, D, BK, S, TM, TN, CM, CN>::run(const GemmProblem& p, cudaStream_t stream) {
  return run_gemm<sm100::Sm100Gemm<A, B, D, BK, S, TM, TN, CM, CN>>(p, stream);
}

template <dg_dtype A, dg_dtype B, dg_dtype D, bool BK, int S, int TM, int TN, int CM, int CN>
size_t Sm100GemmKernel<A, B, D, BK, S, TM, TN, CM, CN>::workspace(const GemmProblem& p) {
  return gemm_workspace<sm100::Sm100Gemm<A, B, D, BK, S, TM, TN, CM, CN>>(p);
}

}  // namespace distgemm::gemm

#define DG_INSTANTIATE_SM100_GEMM(A, B, D, BK, S, TM, TN, CM, CN) \
  template struct distgemm::gemm::Sm100GemmKernel<A, B, D, BK, distgemm::gemm::S, TM, TN, CM, CN>;

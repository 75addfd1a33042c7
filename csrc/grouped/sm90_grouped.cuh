// SM90 grouped GEMM: CUTLASS's ptr-array TMA + WGMMA persistent kernels over all groups in
// one launch. A small kernel turns the device-side offsets into the per-group problem shapes,
// pointers and strides, so the host never reads the group sizes.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "common/cutlass_types.cuh"
#include "common/status.h"
#include "grouped/grouped_problem.h"
#include "grouped/sm90_grouped_common.cuh"
#include "grouped/sm90_grouped_direct_store.cuh"

namespace distgemm::grouped::sm90 {

using namespace cute;

// A schedule id (gemm::Schedule) as CUTLASS's kernel and epilogue schedules.
template <class MainloopSchedule, class EpilogueSchedule>
struct Schedules {
  using Mainloop = MainloopSchedule;
  using Epilogue = EpilogueSchedule;
};
template <int Sched>
struct ScheduleTraits;
template <>
struct ScheduleTraits<gemm::kCooperative> : Schedules<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                                                      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative> {};
template <>
struct ScheduleTraits<gemm::kPingpong> : Schedules<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                                   cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong> {};
// Direct stores: each consumer thread writes its accumulators to global memory itself (no
// staging, no TMA store; the shared memory goes to mainloop stages), for few-token FP32 wgrads,
// whose stores outweigh their 2-4 step mainloops. CUTLASS's epilogue, with pair stores in place
// of its one-element ones (sm90_grouped_direct_store.cuh); sweep build only
// (grouped_instances_tuning.def).
template <>
struct ScheduleTraits<gemm::kCooperativeDirectStore>
    : Schedules<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                cutlass::epilogue::PtrArrayNoSmemWarpSpecialized> {};
template <>
struct ScheduleTraits<gemm::kPingpongDirectStore> : Schedules<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                                              cutlass::epilogue::PtrArrayNoSmemWarpSpecialized> {};

template <dg_dtype In, dg_dtype Out, int Kind, int Sched, int TileM, int TileN, int ClusterM, int ClusterN>
struct Sm90Grouped {
  static constexpr int kKind = Kind;
  using Element = cutlass_type_t<In>;
  using ElementD = cutlass_type_t<Out>;
  // forward: A (T, K) K-major, B (N, K) K-major; dgrad: B (K, N) N-major;
  // wgrad: A = dy^T M-major, B = x^T N-major, contraction over the group's tokens.
  using LayoutA = std::conditional_t<Kind == DG_GROUPED_WGRAD, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutB =
      std::conditional_t<Kind == DG_GROUPED_FORWARD, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlign = 16 / sizeof(Element);
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using TileShape = Shape<Int<TileM>, Int<TileN>, Int<128 / sizeof(Element)>>;
  using ClusterShape = Shape<Int<ClusterM>, Int<ClusterN>, _1>;
  using Traits = ScheduleTraits<Sched>;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;

  using CollectiveEpilogue = typename WithPairStores<typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementD, LayoutD*, kAlignD, ElementD, LayoutD*,
      kAlignD, typename Traits::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp>::type;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlign, Element, LayoutB*, kAlign, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Traits::Mainloop>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;

  // Per-group argument arrays, carved out of the caller's workspace.
  struct Arrays {
    Shape3* shapes;
    Element const** ptr_a;
    Element const** ptr_b;
    ElementD const** ptr_c;
    ElementD** ptr_d;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideC* stride_c;
    StrideD* stride_d;
    Element* zeros;  // max(N, K) zeros: the operands of empty wgrad groups
    void* cutlass_workspace;
  };

  // Lays out the arrays (base == nullptr only measures); returns the bytes used.
  static size_t carve(const GroupedProblem& p, char* base, Arrays* out) {
    const size_t g = static_cast<size_t>(p.groups);
    WorkspaceCarver w{base};
    auto take = [&](auto** field, size_t count) { w.take(field, count); };
    Arrays a{};
    take(&a.shapes, g);
    take(&a.ptr_a, g);
    take(&a.ptr_b, g);
    take(&a.ptr_c, g);
    take(&a.ptr_d, g);
    take(&a.stride_a, g);
    take(&a.stride_b, g);
    take(&a.stride_c, g);
    take(&a.stride_d, g);
    take(&a.zeros, static_cast<size_t>(std::max(p.n, p.k)));
    if (base) a.cutlass_workspace = base + w.used;
    if (out) *out = a;
    return w.used;
  }

  static typename Adapter::Arguments arguments(const GroupedProblem& p, const Arrays& arr) {
    // Both epilogues' arguments: {thread (alpha, beta), ptr_C, dC, ptr_D, dD}.
    typename CollectiveEpilogue::Arguments epilogue{};
    epilogue.thread.alpha = 1.f;
    epilogue.thread.beta = p.accumulate ? 1.f : 0.f;
    epilogue.ptr_C = p.accumulate ? arr.ptr_c : nullptr;
    epilogue.dC = arr.stride_c;
    epilogue.ptr_D = arr.ptr_d;
    epilogue.dD = arr.stride_d;
    cutlass::KernelHardwareInfo hw{p.device, p.sm_count};
    return typename Adapter::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                       {p.groups, arr.shapes, nullptr},
                                       {arr.ptr_a, arr.stride_a, arr.ptr_b, arr.stride_b},
                                       epilogue,
                                       hw};
  }
};

// Group g's problem shape, pointers and strides, from the device-side offsets.
template <class G>
__device__ void fill_group_arguments(typename G::Arrays& arr, const GroupedProblem& p, int g) {
  using Element = typename G::Element;
  using ElementD = typename G::ElementD;
  const GroupRows group = group_rows(p.offs, p.tokens, g);
  const int64_t start = group.start;
  const int rows = static_cast<int>(group.rows);
  auto const* a = static_cast<Element const*>(p.a);
  auto const* b = static_cast<Element const*>(p.b);
  auto* d = static_cast<ElementD*>(p.d);
  typename G::StrideA sa{};
  typename G::StrideB sb{};
  typename G::StrideD sd{};
  // k: read in one kind's branch only (the other instantiations would warn it unused).
  const int n = static_cast<int>(p.n);
  [[maybe_unused]] const int k = static_cast<int>(p.k);
  if constexpr (G::kKind == DG_GROUPED_WGRAD) {
    // out[g] (N, K) = a[rows]^T (N x rows) @ b[rows] (rows x K)
    get<1>(sa) = p.n;
    get<1>(sb) = p.k;
    get<0>(sd) = p.k;
    arr.ptr_d[g] = d + static_cast<int64_t>(g) * p.n * p.k;
    if (rows > 0) {
      arr.shapes[g] = {n, k, rows};
      arr.ptr_a[g] = a + start * p.n;
      arr.ptr_b[g] = b + start * p.k;
    } else {
      // No tokens: one zero-valued K step writes zeros (or, accumulating, nothing at all).
      arr.shapes[g] = {p.accumulate ? 0 : n, k, 1};
      arr.ptr_a[g] = arr.zeros;
      arr.ptr_b[g] = arr.zeros;
    }
  } else {
    arr.shapes[g] = {rows, n, k};
    arr.ptr_a[g] = a + start * p.k;
    get<0>(sa) = p.k;
    if constexpr (G::kKind == DG_GROUPED_FORWARD)
      get<0>(sb) = p.k;
    else
      get<1>(sb) = p.n;
    arr.ptr_b[g] = b + static_cast<int64_t>(g) * p.n * p.k;
    arr.ptr_d[g] = d + start * p.n;
    get<0>(sd) = p.n;
  }
  arr.ptr_c[g] = arr.ptr_d[g];
  arr.stride_a[g] = sa;
  arr.stride_b[g] = sb;
  arr.stride_c[g] = sd;
  arr.stride_d[g] = sd;
}

template <class G>
__global__ void build_grouped_arguments(typename G::Arrays arr, GroupedProblem p) {
  allow_dependent_gemm_launch();
  using Element = typename G::Element;
  const int64_t zeros = p.n > p.k ? p.n : p.k;
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < zeros; i += gridDim.x * blockDim.x)
    arr.zeros[i] = Element(0);
  // Grid-stride over the groups: any G, whatever the grid size.
  for (int64_t gi = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; gi < p.groups;
       gi += gridDim.x * int64_t(blockDim.x))
    fill_group_arguments<G>(arr, p, static_cast<int>(gi));
}

}  // namespace distgemm::grouped::sm90

namespace distgemm::grouped {

template <dg_dtype In, dg_dtype Out, int Kind, int S, int TM, int TN, int CM, int CN>
dg_status Sm90GroupedKernel<In, Out, Kind, S, TM, TN, CM, CN>::run(const GroupedProblem& p, cudaStream_t stream) {
  using G = sm90::Sm90Grouped<In, Out, Kind, S, TM, TN, CM, CN>;
  const int64_t work = std::max<int64_t>(p.groups, std::max(p.n, p.k));
  const int blocks = static_cast<int>(std::min<int64_t>((work + 255) / 256, 1024));
  return sm90::run_cutlass_grouped<G>(p, stream, "sm90 grouped GEMM", [&](typename G::Arrays& arr) {
    sm90::build_grouped_arguments<G><<<blocks, 256, 0, stream>>>(arr, p);
  });
}

template <dg_dtype In, dg_dtype Out, int Kind, int S, int TM, int TN, int CM, int CN>
size_t Sm90GroupedKernel<In, Out, Kind, S, TM, TN, CM, CN>::workspace(const GroupedProblem& p) {
  return sm90::cutlass_grouped_workspace<sm90::Sm90Grouped<In, Out, Kind, S, TM, TN, CM, CN>>(p);
}

}  // namespace distgemm::grouped

#define DG_INSTANTIATE_SM90_GROUPED(IN, OUT, KIND, S, TM, TN, CM, CN)                                                  \
  template struct distgemm::grouped::Sm90GroupedKernel<IN, OUT, distgemm::grouped::KIND, distgemm::grouped::S, TM, TN, \
                                                       CM, CN>;

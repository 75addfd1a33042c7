// What the sm90 grouped kernels (bf16/fp16 and FP8) share: carving their per-group argument
// arrays out of the caller's workspace, and the glue around a CUTLASS GemmUniversalAdapter.
#pragma once

#include <cstddef>
#include <cstring>

#include <cutlass/arch/grid_dependency_control.h>
#include <cutlass/cutlass.h>

#include "common/status.h"
#include "grouped/grouped_problem.h"

namespace distgemm::grouped::sm90 {

// The GEMM is launched as a programmatic dependent of the argument builder (PDL): its CTAs are
// scheduled and set up their pipelines while the builder runs, and wait for the builder's
// writes at CUTLASS's griddepcontrol.wait. Only where the kernels were compiled with that wait.
#if defined(CUTLASS_ENABLE_GDC_FOR_SM90)
constexpr bool kLaunchGemmAsDependent = true;
#else
constexpr bool kLaunchGemmAsDependent = false;
#endif

// Called first by every argument builder: lets the dependent GEMM launch now; it still waits
// for the builder to finish before reading what it wrote.
__device__ __forceinline__ void allow_dependent_gemm_launch() { cutlass::arch::launch_dependent_grids(); }

// Group g's rows [start, start + rows) of the token dimension, as every sm90 grouped kernel
// reads the device-side offsets: clamped to [0, T]; a group ending before it starts is empty.
struct GroupRows {
  int64_t start, rows;
};
__device__ inline GroupRows group_rows(const int32_t* offs, int64_t tokens, int g) {
  auto clamp_row = [&](int64_t r) { return r < 0 ? int64_t(0) : (r > tokens ? tokens : r); };
  const int64_t start = g == 0 ? 0 : clamp_row(offs[g - 1]);
  const int64_t end = clamp_row(offs[g]);
  return {start, end > start ? end - start : 0};
}

// Typed arrays, each 256-byte aligned, one after the other from `base` (nullptr: only counts).
struct WorkspaceCarver {
  char* base;
  size_t used = 0;
  template <class T>
  void take(T** field, size_t count) {
    if (base) *field = reinterpret_cast<T*>(base + used);
    used += (count * sizeof(T) + 255) / 256 * 256;
  }
};

// The kernel parameters CUTLASS made for this thread's last call of G, and what they were made
// from. Params are a function of the arguments alone, and those of the argument arrays' places
// (the workspace's carve), the group count, the accumulation flag, the device and its SM count:
// a call that repeats all of them reuses the parameters and skips CUTLASS's initialize (the TMA
// descriptors encoded on the host, the shared-memory attribute set, the scheduler's parameters),
// host time a small grouped GEMM's GPU waits for. One entry per thread: no lock, and a thread
// that moves to another device makes them anew there (the attribute is set per device).
template <class G>
struct LastParams {
  bool valid = false;
  typename G::Arrays arrays{};  // pointers only: compared bytewise
  int64_t groups = 0;
  int device = -1, sm_count = 0;
  bool accumulate = false;
  typename G::Kernel::Params params{};

  bool made_from(const typename G::Arrays& arr, const GroupedProblem& p) const {
    return valid && groups == p.groups && device == p.device && sm_count == p.sm_count && accumulate == p.accumulate &&
           std::memcmp(&arrays, &arr, sizeof(arr)) == 0;
  }
};

// G (a kernel description with Arrays, carve, arguments and Adapter) on problem p: carve the
// arrays, `launch_builder(arrays)` enqueues the kernel that fills them, then the GEMM.
template <class G, class LaunchBuilder>
dg_status run_cutlass_grouped(const GroupedProblem& p, cudaStream_t stream, const char* what,
                              LaunchBuilder launch_builder) {
  typename G::Arrays arr;
  G::carve(p, static_cast<char*>(p.workspace), &arr);
  launch_builder(arr);
  DG_CUDA_RETURN(cudaGetLastError());
  thread_local LastParams<G> last;
  const auto args = G::arguments(p, arr);
  if (last.made_from(arr, p)) {
    // What initialize does besides making the parameters (nothing for these kernels today).
    if (G::Kernel::initialize_workspace(args, arr.cutlass_workspace, stream) != cutlass::Status::kSuccess)
      return fail(DG_ERROR_INTERNAL, cat("CUTLASS ", what, " workspace initialization failed"));
  } else {
    last.valid = false;
    typename G::Adapter gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess)
      return fail(DG_ERROR_INTERNAL, cat("CUTLASS ", what, " cannot implement N=", p.n, " K=", p.k));
    if (gemm.initialize(args, arr.cutlass_workspace, stream) != cutlass::Status::kSuccess)
      return fail(DG_ERROR_INTERNAL, cat("CUTLASS ", what, " initialization failed"));
    last.params = gemm.params();
    last.arrays = arr;
    last.groups = p.groups;
    last.device = p.device;
    last.sm_count = p.sm_count;
    last.accumulate = p.accumulate;
    last.valid = true;
  }
  if (G::Adapter::run(last.params, stream, nullptr, kLaunchGemmAsDependent) != cutlass::Status::kSuccess)
    return fail(DG_ERROR_CUDA, cat(what, " launch failed: ", cudaGetErrorString(cudaGetLastError())));
  return DG_SUCCESS;
}

// The workspace G needs for p: its arrays, then CUTLASS's own.
template <class G>
size_t cutlass_grouped_workspace(const GroupedProblem& p) {
  typename G::Arrays arr{};
  const size_t arrays = G::carve(p, nullptr, nullptr);
  return arrays + G::Adapter::get_workspace_size(G::arguments(p, arr));
}

}  // namespace distgemm::grouped::sm90

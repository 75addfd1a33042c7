// What the sm90 grouped kernels (bf16/fp16 and FP8) share: carving their per-group argument
// arrays out of the caller's workspace, and the glue around a CUTLASS GemmUniversalAdapter.
#pragma once

#include <cstddef>

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

// G (a kernel description with Arrays, carve, arguments and Adapter) on problem p: carve the
// arrays, `launch_builder(arrays)` enqueues the kernel that fills them, then the GEMM.
template <class G, class LaunchBuilder>
dg_status run_cutlass_grouped(const GroupedProblem& p, cudaStream_t stream, const char* what,
                              LaunchBuilder launch_builder) {
  typename G::Arrays arr;
  G::carve(p, static_cast<char*>(p.workspace), &arr);
  launch_builder(arr);
  DG_CUDA_RETURN(cudaGetLastError());
  typename G::Adapter gemm;
  auto args = G::arguments(p, arr);
  if (gemm.can_implement(args) != cutlass::Status::kSuccess)
    return fail(DG_ERROR_INTERNAL, cat("CUTLASS ", what, " cannot implement N=", p.n, " K=", p.k));
  if (gemm.initialize(args, arr.cutlass_workspace, stream) != cutlass::Status::kSuccess)
    return fail(DG_ERROR_INTERNAL, cat("CUTLASS ", what, " initialization failed"));
  if (gemm.run(stream, nullptr, kLaunchGemmAsDependent) != cutlass::Status::kSuccess)
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

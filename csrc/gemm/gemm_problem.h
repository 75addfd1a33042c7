// The checked, normalized form of a dense GEMM that the kernels consume.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/sync.h"
#include <cuda_runtime_api.h>

#include "common/schedule.h"
#include "distgemm/types.h"

namespace distgemm::gemm {

// D (M, N) row-major = alpha * (sa[m] * sb[n] * sum_k A[m,k] B[n,k]) + beta_c * C[m,n]
//                      + beta_bias * bias[n].
struct GemmProblem {
  int m = 0, n = 0, k = 0;
  const void* a = nullptr;  // (M, K), K-major, leading dimension lda
  int64_t lda = 0;
  const void* b = nullptr;  // (N, K): K-major (ldb = row stride) or N-major (ldb = column stride)
  int64_t ldb = 0;
  bool b_k_major = true;
  const void* c = nullptr;  // (M, N) row-major or nullptr
  int64_t ldc = 0;
  const void* bias = nullptr;  // (N,) in the output dtype, or nullptr
  void* d = nullptr;
  int64_t ldd = 0;
  float alpha = 1.f, beta_c = 0.f, beta_bias = 0.f;
  const float* scale_a = nullptr;  // nullptr, one value, or M values
  bool scale_a_per_row = false;
  const float* scale_b = nullptr;  // nullptr, one value, or N values
  bool scale_b_per_col = false;
  int device = 0;
  int sm_count = 0;  // SMs the persistent grid may use
  int swizzle = 1;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  SyncParams sync{};  // cross-GPU waits (sm90 tensor-parallel GEMMs); empty for a plain GEMM
};

using GemmRunFn = dg_status (*)(const GemmProblem&, cudaStream_t);
using GemmWorkspaceFn = size_t (*)(const GemmProblem&);

// Entry points of one compiled kernel; defined in sm90_gemm.cuh / sm100_gemm.cuh and
// explicitly instantiated by the files CMake generates from gemm_instances.def.
template <dg_dtype A, dg_dtype B, dg_dtype D, bool BKMajor, int Sched, int TileM, int TileN, int ClusterM, int ClusterN>
struct Sm90GemmKernel {
  static dg_status run(const GemmProblem& problem, cudaStream_t stream);
  static size_t workspace(const GemmProblem& problem);
};

template <dg_dtype A, dg_dtype B, dg_dtype D, bool BKMajor, int Sched, int TileM, int TileN, int ClusterM, int ClusterN>
struct Sm100GemmKernel {
  static dg_status run(const GemmProblem& problem, cudaStream_t stream);
  static size_t workspace(const GemmProblem& problem);
};

}  // namespace distgemm::gemm

// The checked, normalized form of a dense GEMM that the kernels consume.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/sync.h"
#include <cuda_runtime_api.h>

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

// Kernel schedules; the numbers are part of the instance table (gemm_instances.def).
enum Schedule : int {
  kCooperative = 0,  // sm90: two consumer warpgroups share one tile
  kPingpong = 1,     // sm90: consumer warpgroups alternate tiles (small M, short K)
  kOneSm = 2,        // sm100: 1-SM UMMA
  kTwoSm = 3,        // sm100: 2-SM UMMA pair
  kCooperativeFastAccum = 4,  // sm90 FP8: no FP32 promotion of partial sums
  kPingpongFastAccum = 5,
  kContiguous = 6,  // sm90 grouped: cooperative over the contiguous tokens, one descriptor per operand
  // sm90 grouped: the ptr-array kernels with an epilogue that stores from registers (no shared
  // memory staging, no TMA store): many stores in flight, for store-bound FP32 wgrads
  kCooperativeDirectStore = 7,
  kPingpongDirectStore = 8,
  // sm90 FP8 grouped: two temporary accumulators, one K tile's promotion under the next one's
  // WGMMAs (sm90_fp8_overlapped_promotion.cuh)
  kCooperativeOverlapPromotion = 9,
  kPingpongOverlapPromotion = 10,
};
// Spellings used in the .def instance lists.
constexpr int coop = kCooperative;
constexpr int pingpong = kPingpong;
constexpr int sm1 = kOneSm;
constexpr int sm2 = kTwoSm;
constexpr int coop_fa = kCooperativeFastAccum;
constexpr int pingpong_fa = kPingpongFastAccum;
constexpr int coop_direct = kCooperativeDirectStore;
constexpr int pingpong_direct = kPingpongDirectStore;
constexpr int coop_overlap = kCooperativeOverlapPromotion;
constexpr int pingpong_overlap = kPingpongOverlapPromotion;

constexpr bool is_fast_accum(int schedule) {
  return schedule == kCooperativeFastAccum || schedule == kPingpongFastAccum;
}

// Entry points of one compiled kernel; defined in sm90_gemm.cuh / sm100_gemm.cuh and
// explicitly instantiated by the files CMake generates from gemm_instances.def.
template <dg_dtype A, dg_dtype B, dg_dtype D, bool BKMajor, int Sched, int TileM, int TileN,
          int ClusterM, int ClusterN>
struct Sm90GemmKernel {
  static dg_status run(const GemmProblem& problem, cudaStream_t stream);
  static size_t workspace(const GemmProblem& problem);
};

template <dg_dtype A, dg_dtype B, dg_dtype D, bool BKMajor, int Sched, int TileM, int TileN,
          int ClusterM, int ClusterN>
struct Sm100GemmKernel {
  static dg_status run(const GemmProblem& problem, cudaStream_t stream);
  static size_t workspace(const GemmProblem& problem);
};

}  // namespace distgemm::gemm

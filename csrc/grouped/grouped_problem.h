// The checked form of a grouped GEMM, and the table entries of its kernels.
#pragma once

#include <cstddef>
#include <cstdint>

#include "distgemm/types.h"
#include "gemm/gemm_problem.h"

namespace distgemm::grouped {

using gemm::Schedule;

struct GroupedProblem {
  dg_grouped_kind kind = DG_GROUPED_FORWARD;
  int groups = 0;
  const int32_t* offs = nullptr;
  int64_t tokens = 0, n = 0, k = 0;
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  bool accumulate = false;
  // FP8 (scale_mode != DG_SCALE_NONE): the scales as dg_grouped_desc documents them.
  dg_scale_mode scale_mode = DG_SCALE_NONE;
  const float* scale_a = nullptr;
  const float* scale_b = nullptr;
  int64_t scale_a_ld = 0;
  int64_t token_pitch = 0;  // FP8 wgrad: columns of the padded, transposed dy and x
  int device = 0;
  int sm_count = 0;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

using GroupedRunFn = dg_status (*)(const GroupedProblem&, cudaStream_t);
using GroupedWorkspaceFn = size_t (*)(const GroupedProblem&);

struct GroupedInstance {
  int arch;
  dg_dtype in, out;
  dg_grouped_kind kind;
  dg_scale_mode scale_mode;
  Schedule schedule;
  int tile_m, tile_n, cluster_m, cluster_n;
  const char* name;
  GroupedRunFn run;
  GroupedWorkspaceFn workspace;
};

// Defined in sm90_grouped.cuh, instantiated by files generated from grouped_instances.def.
template <dg_dtype In, dg_dtype Out, int Kind, int Sched, int TileM, int TileN, int ClusterM, int ClusterN>
struct Sm90GroupedKernel {
  static dg_status run(const GroupedProblem& problem, cudaStream_t stream);
  static size_t workspace(const GroupedProblem& problem);
};

// Defined in sm90_grouped_contiguous.cuh (forward and dgrad over the contiguous tokens, one
// descriptor per operand, no argument arrays), instantiated from grouped_instances.def.
template <dg_dtype In, dg_dtype Out, int Kind, int TileM, int TileN, int ClusterM>
struct Sm90GroupedContiguousKernel {
  static dg_status run(const GroupedProblem& problem, cudaStream_t stream);
  static size_t workspace(const GroupedProblem& problem);
};

// Defined in sm90_grouped_contiguous_wgrad.cuh (the wgrad over the contiguous tokens: dy (T, N)
// and x (T, K) read in place, one descriptor each), instantiated from grouped_instances.def.
template <dg_dtype In, dg_dtype Out, int TileM, int TileN>
struct Sm90GroupedContiguousWgradKernel {
  static dg_status run(const GroupedProblem& problem, cudaStream_t stream);
  static size_t workspace(const GroupedProblem& problem);
};

// Defined in sm90_fp8_grouped.cuh, instantiated from grouped_fp8_instances.def. InA: A's dtype,
// e4m3, or e5m2 for a gradient (dy in a dgrad, dy^T in a wgrad) against an e4m3 B.
template <int Mode, dg_dtype Out, int Kind, int Schedule, int TileM, int TileN, int ClusterM, int ClusterN,
          dg_dtype InA>
struct Sm90Fp8GroupedKernel {
  static dg_status run(const GroupedProblem& problem, cudaStream_t stream);
  static size_t workspace(const GroupedProblem& problem);
};

// Spellings used in grouped_instances.def and grouped_fp8_instances.def.
constexpr int row = DG_SCALE_ROW;
constexpr int block = DG_SCALE_BLOCK;
constexpr int fwd = DG_GROUPED_FORWARD;
constexpr int dgrad = DG_GROUPED_DGRAD;
constexpr int wgrad = DG_GROUPED_WGRAD;
using gemm::coop;
using gemm::coop_direct;
using gemm::coop_overlap;
using gemm::pingpong;
using gemm::pingpong_direct;
using gemm::pingpong_overlap;

}  // namespace distgemm::grouped

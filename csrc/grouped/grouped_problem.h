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
  Schedule schedule;
  int tile_m, tile_n, cluster_m, cluster_n;
  const char* name;
  GroupedRunFn run;
  GroupedWorkspaceFn workspace;
};

// Defined in sm90_grouped.cuh, instantiated by files generated from grouped_instances.def.
template <dg_dtype In, dg_dtype Out, int Kind, int Sched, int TileM, int TileN, int ClusterM,
          int ClusterN>
struct Sm90GroupedKernel {
  static dg_status run(const GroupedProblem& problem, cudaStream_t stream);
  static size_t workspace(const GroupedProblem& problem);
};

// Spellings used in grouped_instances.def.
constexpr int fwd = DG_GROUPED_FORWARD;
constexpr int dgrad = DG_GROUPED_DGRAD;
constexpr int wgrad = DG_GROUPED_WGRAD;
using gemm::coop;
using gemm::pingpong;

}  // namespace distgemm::grouped

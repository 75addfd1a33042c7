// The FP8 grouped kernels whose A operand is e5m2 (a gradient: dy in a dgrad, dy^T in a wgrad)
// against an e4m3 B. Declared apart from grouped_problem.h, which every grouped kernel instance
// includes, so that adding them rebuilt none of those. Defined in sm90_fp8_grouped.cuh,
// instantiated from the DG_SM90_FP8_E5M2_GROUPED lines of grouped_fp8_instances.def.
#pragma once

#include "grouped/grouped_problem.h"

namespace distgemm::grouped {

template <int Mode, dg_dtype Out, int Kind, int TileM, int TileN, int ClusterM, int ClusterN>
struct Sm90Fp8E5m2GroupedKernel {
  static dg_status run(const GroupedProblem& problem, cudaStream_t stream);
  static size_t workspace(const GroupedProblem& problem);
};

}  // namespace distgemm::grouped

// Tile-configuration choice for the dense GEMM: host-only, no CUDA.
#pragma once

#include <vector>

#include "gemm/gemm_problem.h"

namespace distgemm::gemm {

// Relative cost of running an M x N x K problem with `inst` on `sm_count` SMs: the waves
// of the persistent grid (tiles rounded up to whole clusters) times the work per tile over
// the tile's measured efficiency. Lower is faster.
double estimate_cost(const GemmInstance& inst, int m, int n, int k, int sm_count);

// The cheapest of `candidates` by estimate_cost (the first on ties); nullptr if empty.
const GemmInstance* select_instance(const std::vector<const GemmInstance*>& candidates, int m,
                                    int n, int k, int sm_count);

// Raster swizzle for the persistent scheduler: wider swizzles keep the operands of
// neighbouring tiles in L2 once the grid spans many tiles.
int select_swizzle(const GemmInstance& inst, int m, int n, int sm_count);

}  // namespace distgemm::gemm

// Tile-configuration choice shared by the dense and grouped GEMMs: host-only, no CUDA.
#pragma once

#include <cstdint>
#include <vector>

#include "gemm/gemm_problem.h"

namespace distgemm {

struct TileConfig {
  gemm::Schedule schedule;
  int tile_m, tile_n, cluster_m, cluster_n;
};

template <class Instance>
TileConfig tile_config(const Instance& inst) {
  return {inst.schedule, inst.tile_m, inst.tile_n, inst.cluster_m, inst.cluster_n};
}

// Relative time of `batches` independent M x N x K problems on `sm_count` SMs with tile
// config `c`: waves of the persistent grid (tiles rounded up to whole clusters) times the
// work per tile (mainloop + epilogue) over the tile's measured efficiency. Lower is faster.
// k is in 16-bit-element units: FP8 contributes k / 2 (its tensor cores run twice as fast).
double estimate_cost(const TileConfig& c, int64_t m, int64_t n, double k, int64_t batches,
                     int sm_count);

// The candidate with the lowest estimate_cost (the first on near-ties); nullptr if none.
template <class Instance>
const Instance* select_cheapest(const std::vector<const Instance*>& candidates, int64_t m,
                                int64_t n, double k, int64_t batches, int sm_count) {
  const Instance* best = nullptr;
  double best_cost = 0;
  for (const Instance* inst : candidates) {
    const double cost = estimate_cost(tile_config(*inst), m, n, k, batches, sm_count);
    if (!best || cost < best_cost * 0.999) {
      best = inst;
      best_cost = cost;
    }
  }
  return best;
}

}  // namespace distgemm

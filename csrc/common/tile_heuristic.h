// Tile-configuration choice shared by the dense and grouped GEMMs: host-only, no CUDA.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/schedule.h"

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
// epilogue_scale: the output's bytes per element over 2 (2 for FP32 out): the epilogue's cost
// is its writes.
double estimate_cost(const TileConfig& c, int64_t m, int64_t n, double k, int64_t batches, int sm_count,
                     double epilogue_scale = 1.0);

// Relative time of a grouped GEMM (forward or dgrad): `groups` problems of unknown row counts
// summing to `tokens` (the routing lives on the device), each n x k. CUTLASS's group scheduler
// rounds every group's rows up to whole clusters of tiles (tile_m * cluster_m rows), so the
// model charges each non-empty group half of that granule: the expected padding when group
// sizes are not multiples of it, which real routing makes the common case. The ptr-array
// kernels add a fixed set-up (argument builder, per-group descriptors) that the contiguous-token
// kernel (schedule kContiguous) does not pay.
double estimate_grouped_cost(const TileConfig& c, int64_t tokens, int64_t groups, int64_t n, double k, int sm_count,
                             double epilogue_scale = 1.0);

// The candidate of lowest `cost(TileConfig)`; nullptr if none. On near-ties (0.1%) the one of
// the larger cluster, whose multicast halves one operand's reads from L2 (the cost has no term
// for it: ping-pong 128x128 FP32 wgrads ran up to 19% faster in 2x1 clusters than in 1x1, on 3
// of 4 problems; bench/NOTES.md, grouped tile choice), else the first. The preference stops at clusters
// of kTieBreakMaxCluster CTAs: clusters of four ran 4-17% slower than pairs on every bf16 and
// FP8 row measured (h200_grouped_fp8_cluster4_configs.json), and the rule picked them as soon as they were compiled.
inline constexpr int kTieBreakMaxCluster = 2;

template <class Instance, class Cost>
const Instance* select_cheapest_by(const std::vector<const Instance*>& candidates, Cost cost) {
  const Instance* best = nullptr;
  double best_cost = 0;
  auto cluster = [](const Instance* i) { return std::min(i->cluster_m * i->cluster_n, kTieBreakMaxCluster); };
  for (const Instance* inst : candidates) {
    const double c = cost(tile_config(*inst));
    const bool near_tie = best && c <= best_cost * 1.001;  // lower costs: the first test below
    if (!best || c < best_cost * 0.999 || (near_tie && cluster(inst) > cluster(best))) {
      best = inst;
      best_cost = c;
    }
  }
  return best;
}

// The candidate with the lowest estimate_cost (select_cheapest_by's near-tie rule); nullptr if none.
template <class Instance>
const Instance* select_cheapest(const std::vector<const Instance*>& candidates, int64_t m, int64_t n, double k,
                                int64_t batches, int sm_count, double epilogue_scale = 1.0) {
  return select_cheapest_by(
      candidates, [&](const TileConfig& c) { return estimate_cost(c, m, n, k, batches, sm_count, epilogue_scale); });
}

}  // namespace distgemm

#include "gemm/gemm_heuristic.h"

#include <cstdint>

namespace distgemm::gemm {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Throughput of one SM on a tile of this shape and schedule, relative to the cooperative
// 128x256 tile; measured on the H200 (bench/results/h200_gemm_configs.json).
double tile_efficiency(const GemmInstance& inst) {
  const int area = inst.tile_m * inst.tile_n;
  if (inst.schedule == kPingpong) return area >= 128 * 128 ? 0.95 : 0.72;
  if (inst.schedule == kCooperative) return area >= 128 * 256 ? 1.0 : 0.88;
  return area >= 256 * 128 ? 1.0 : 0.9;  // sm100 1-SM / 2-SM tiles
}

}  // namespace

double estimate_cost(const GemmInstance& inst, int m, int n, int k, int sm_count) {
  const int cluster = inst.cluster_m * inst.cluster_n;
  const int64_t tiles_m = ceil_div(ceil_div(m, inst.tile_m), inst.cluster_m) * inst.cluster_m;
  const int64_t tiles_n = ceil_div(ceil_div(n, inst.tile_n), inst.cluster_n) * inst.cluster_n;
  const int64_t usable_sms = (sm_count / cluster) * cluster;
  if (usable_sms <= 0) return 1e300;
  const int64_t waves = ceil_div(tiles_m * tiles_n, usable_sms);
  return static_cast<double>(waves) * inst.tile_m * inst.tile_n * static_cast<double>(k) /
         tile_efficiency(inst);
}

const GemmInstance* select_instance(const std::vector<const GemmInstance*>& candidates, int m,
                                    int n, int k, int sm_count) {
  const GemmInstance* best = nullptr;
  double best_cost = 0;
  for (const GemmInstance* inst : candidates) {
    const double cost = estimate_cost(*inst, m, n, k, sm_count);
    if (!best || cost < best_cost * 0.999) {
      best = inst;
      best_cost = cost;
    }
  }
  return best;
}

int select_swizzle(const GemmInstance& inst, int m, int n, int sm_count) {
  const int64_t tiles = ceil_div(m, inst.tile_m) * ceil_div(n, inst.tile_n);
  return tiles >= 4 * static_cast<int64_t>(sm_count) ? 2 : 1;
}

}  // namespace distgemm::gemm

#include "common/tile_heuristic.h"

namespace distgemm {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Throughput of one SM on a tile of this shape and schedule, relative to the cooperative
// 128x256 tile; measured on the H200 (bench/results/h200_gemm_configs.json).
double tile_efficiency(const TileConfig& c) {
  const int area = c.tile_m * c.tile_n;
  switch (c.schedule) {
    case gemm::kPingpong:
    case gemm::kPingpongFastAccum: return area >= 128 * 128 ? 0.95 : 0.85;
    case gemm::kCooperative:
    case gemm::kCooperativeFastAccum: return area >= 128 * 256 ? 1.0 : 0.88;
    default: return area >= 256 * 128 ? 1.0 : 0.9;  // sm100 1-SM / 2-SM tiles
  }
}

}  // namespace

double estimate_cost(const TileConfig& c, int64_t m, int64_t n, int64_t k, int64_t batches,
                     int sm_count) {
  const int cluster = c.cluster_m * c.cluster_n;
  const int64_t tiles_m = ceil_div(ceil_div(m, c.tile_m), c.cluster_m) * c.cluster_m;
  const int64_t tiles_n = ceil_div(ceil_div(n, c.tile_n), c.cluster_n) * c.cluster_n;
  const int64_t usable_sms = (sm_count / cluster) * cluster;
  if (usable_sms <= 0) return 1e300;
  const int64_t waves = ceil_div(tiles_m * tiles_n * batches, usable_sms);
  return static_cast<double>(waves) * c.tile_m * c.tile_n * static_cast<double>(k) /
         tile_efficiency(c);
}

}  // namespace distgemm

#include "common/tile_heuristic.h"

#include <algorithm>
#include <cmath>

namespace distgemm {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }  // a >= 0, b > 0

// Throughput of one SM on a tile of this shape and schedule, relative to the cooperative
// 128x256 tile, and the epilogue's cost per tile in (16-bit) K elements: cooperative kernels
// stop the math for it, ping-pong ones hide it behind the other warpgroup's mainloop.
// Read off the H200 sweep (bench/results/h200_gemm_configs.json).
struct TileCost {
  double efficiency;
  double epilogue_k;
};

TileCost tile_cost(const TileConfig& c) {
  const int area = c.tile_m * c.tile_n;
  switch (c.schedule) {
    case gemm::kPingpong:
    case gemm::kPingpongFastAccum:
    case gemm::kPingpongDirectStore:
    case gemm::kPingpongOverlapPromotion:
      return {c.tile_m >= 128 ? 0.95 : 0.8, 64};
    case gemm::kCooperative:
    case gemm::kCooperativeFastAccum:
    case gemm::kCooperativeDirectStore:
    case gemm::kCooperativeOverlapPromotion:
      return {area >= 128 * 256 ? 1.0 : area >= 128 * 192 ? 0.93 : 0.88, 128};
    case gemm::kContiguous:
      // The contiguous-token grouped kernel: the cooperative mainloop, but its masked epilogue
      // stores synchronously (the ptr-array kernels' TMA stores drain under the next tile):
      // 0.87-0.94 of the ptr-array 128x256 tile's speed on large problems (h200_grouped_profile.json).
      // 64-row tiles (one consumer warpgroup, the math stopped for every epilogue): 0.5, read
      // off the same profile (64x128 beat 128x128 only on one-wave dgrads of long K: 4 x 256
      // tokens, K 2048, 0.65 vs 0.55x bmm; 0.61 vs 0.78x on that problem's forward).
      return {c.tile_m >= 128 ? 0.9 * (area >= 128 * 256 ? 1.0 : 0.88) : 0.5, 128};
    default:
      return {area >= 256 * 128 ? 1.0 : 0.9, 128};  // sm100 1-SM / 2-SM tiles
  }
}

// Whole clusters of tiles covering `extent` (CUTLASS's schedulers round every problem, or
// every group, up to them).
int64_t clustered_tiles(int64_t extent, int tile, int cluster) {
  return ceil_div(ceil_div(extent, tile), cluster) * cluster;
}

// SMs the persistent grid uses: whole clusters only; 0 where not one fits.
int64_t usable_sms(const TileConfig& c, int sm_count) {
  const int cluster = c.cluster_m * c.cluster_n;
  return (sm_count / cluster) * cluster;
}

// `tiles` tiles in whole waves over `sms` SMs, times the work per tile (mainloop + epilogue)
// over the tile's measured efficiency. In double: a checked problem's tile count fits int64,
// but the heuristic must not overflow on whatever it is asked about (exact below 2^53 tiles).
double waves_cost(const TileConfig& c, double tiles, double k, int64_t sms, double epilogue_scale) {
  const double waves = std::ceil(tiles / static_cast<double>(sms));
  const TileCost cost = tile_cost(c);
  return waves * c.tile_m * c.tile_n * (k + cost.epilogue_k * epilogue_scale) / cost.efficiency;
}

// What a ptr-array grouped kernel pays before its first tile's math and the contiguous one
// does not: the argument-builder kernel and each CTA's per-group descriptor set-up, in the
// cost's units (tile area x K). Fitted to the H200 profile (bench/results/h200_grouped_profile.json)
// in the model's own terms: 4 groups x 256 tokens, N 2048, K 768 ran 12.3 us in the
// contiguous 128x128 kernel and 16.6 us in the ptr-array ping-pong 128x128 one (1.35x; the
// model's expected padding makes it two waves); 32 x 128 tokens (six modelled waves) ran equal.
constexpr double kPtrArraySetup = 128.0 * 128.0 * 1300.0;

}  // namespace

double estimate_cost(const TileConfig& c, int64_t m, int64_t n, double k, int64_t batches, int sm_count,
                     double epilogue_scale) {
  const int64_t sms = usable_sms(c, sm_count);
  if (sms <= 0 || m <= 0 || n <= 0 || batches <= 0) return 1e300;
  const double tiles = static_cast<double>(clustered_tiles(m, c.tile_m, c.cluster_m)) *
                       static_cast<double>(clustered_tiles(n, c.tile_n, c.cluster_n)) * static_cast<double>(batches);
  return waves_cost(c, tiles, k, sms, epilogue_scale);
}

double estimate_grouped_cost(const TileConfig& c, int64_t tokens, int64_t groups, int64_t n, double k, int sm_count,
                             double epilogue_scale) {
  const int64_t sms = usable_sms(c, sm_count);
  if (sms <= 0 || tokens < 0 || groups <= 0 || n <= 0) return 1e300;
  const double granule = static_cast<double>(c.tile_m) * c.cluster_m;
  const double busy_groups = static_cast<double>(std::min(groups, tokens));  // others are empty
  const double rows = static_cast<double>(tokens) + busy_groups * granule / 2;
  const double tiles_m = std::ceil(rows / granule) * c.cluster_m;
  const double setup = c.schedule == gemm::kContiguous ? 0.0 : kPtrArraySetup;
  return setup + waves_cost(c, tiles_m * static_cast<double>(clustered_tiles(n, c.tile_n, c.cluster_n)), k, sms,
                            epilogue_scale);
}

}  // namespace distgemm

// The GEMM kernels' schedules as data: what the instance tables (gemm/*.def, grouped/*.def)
// name and what the tile heuristic (common/tile_heuristic.h) reasons about. No CUDA.
#pragma once

namespace distgemm::gemm {

// Kernel schedules; the numbers are part of the instance table (gemm_instances.def).
enum Schedule : int {
  kCooperative = 0,           // sm90: two consumer warpgroups share one tile
  kPingpong = 1,              // sm90: consumer warpgroups alternate tiles (small M, short K)
  kOneSm = 2,                 // sm100: 1-SM UMMA
  kTwoSm = 3,                 // sm100: 2-SM UMMA pair
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

}  // namespace distgemm::gemm

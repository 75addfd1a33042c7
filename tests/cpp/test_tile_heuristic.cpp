// The tile-choice cost model on the CPU: what it predicts for the grouped GEMM's padding, and
// which configuration it picks among candidates shaped like the compiled instances.
#include <gtest/gtest.h>

#include <vector>

#include "common/tile_heuristic.h"

using distgemm::estimate_cost;
using distgemm::estimate_grouped_cost;
using distgemm::select_cheapest_by;
using distgemm::TileConfig;
namespace gemm = distgemm::gemm;

namespace {

constexpr int kH200Sms = 132;

struct Candidate {
  gemm::Schedule schedule;
  int tile_m, tile_n, cluster_m, cluster_n;
};

const Candidate* pick_grouped(const std::vector<const Candidate*>& list, int64_t tokens, int64_t groups, int64_t n,
                              double k) {
  return select_cheapest_by(
      list, [&](const TileConfig& c) { return estimate_grouped_cost(c, tokens, groups, n, k, kH200Sms); });
}

const Candidate kFp8ClusterM{gemm::kCooperative, 256, 128, 2, 1};
const Candidate kFp8ClusterN{gemm::kCooperative, 256, 128, 1, 2};
const Candidate kFp8Small{gemm::kCooperative, 128, 128, 1, 1};

}  // namespace

TEST(GroupedCost, ChargesHalfAClusterGranuleOfPaddingPerGroup) {
  const TileConfig along_m{gemm::kCooperative, 256, 128, 2, 1};
  const TileConfig along_n{gemm::kCooperative, 256, 128, 1, 2};
  // Many small groups: 512-row granules pad far more than 256-row ones.
  EXPECT_GT(estimate_grouped_cost(along_m, 32768, 64, 4096, 3584, kH200Sms),
            1.15 * estimate_grouped_cost(along_n, 32768, 64, 4096, 3584, kH200Sms));
  // One group: the padding is a rounding error, both equal within a wave.
  EXPECT_NEAR(estimate_grouped_cost(along_m, 32768, 1, 4096, 3584, kH200Sms) /
                  estimate_grouped_cost(along_n, 32768, 1, 4096, 3584, kH200Sms),
              1.0, 0.05);
  // Empty groups add no padding: more groups than tokens costs what `tokens` groups cost.
  EXPECT_DOUBLE_EQ(estimate_grouped_cost(along_n, 8, 4096, 4096, 3584, kH200Sms),
                   estimate_grouped_cost(along_n, 8, 8, 4096, 3584, kH200Sms));
}

TEST(GroupedCost, ContiguousKernelSkipsThePtrArraySetUp) {
  const TileConfig contiguous{gemm::kContiguous, 128, 128, 1, 1};
  const TileConfig ptr_array{gemm::kPingpong, 128, 128, 1, 2};
  // One wave of short tiles (4 x 256 tokens, N 2048, K 768): the set-up decides.
  EXPECT_LT(estimate_grouped_cost(contiguous, 1024, 4, 2048, 768, kH200Sms),
            estimate_grouped_cost(ptr_array, 1024, 4, 2048, 768, kH200Sms));
  // Large problems: the set-up is a rounding error; the ptr-array tile's overlapped TMA stores
  // make it the faster (measured 0.99 vs 0.93 of bmm at 8 x 4096 tokens, N 4096, K 7168).
  const TileConfig big_contiguous{gemm::kContiguous, 128, 256, 2, 1};
  const TileConfig big_ptr_array{gemm::kCooperative, 128, 256, 2, 1};
  const double big = estimate_grouped_cost(big_ptr_array, 32768, 8, 4096, 7168, kH200Sms);
  EXPECT_LT(big, estimate_grouped_cost(big_contiguous, 32768, 8, 4096, 7168, kH200Sms));
  EXPECT_GT(big * 1.2, estimate_grouped_cost(big_contiguous, 32768, 8, 4096, 7168, kH200Sms));
}

TEST(GroupedCost, PicksTheContiguousTileOfTheProfiledSmallProblems) {
  // The bf16 forward / dgrad instances (grouped_instances.def), in table order.
  const std::vector<Candidate> table = {{gemm::kCooperative, 128, 256, 2, 1}, {gemm::kCooperative, 128, 256, 1, 2},
                                        {gemm::kPingpong, 64, 256, 1, 1},     {gemm::kPingpong, 64, 128, 1, 1},
                                        {gemm::kPingpong, 128, 128, 1, 2},    {gemm::kContiguous, 64, 128, 1, 1},
                                        {gemm::kContiguous, 128, 128, 1, 1},  {gemm::kContiguous, 128, 128, 2, 1}};
  std::vector<const Candidate*> list;
  for (const Candidate& c : table) list.push_back(&c);
  // 4 experts x 256 tokens: forward (N 2048, K 768) best in contiguous 128x128 (0.78x bmm alone,
  // 0.77x in 2x1 clusters; the model ties them and takes the cluster); dgrad (N 768, K 2048:
  // 48 tiles of 128 x 128) in contiguous 64x128 (0.65x).
  const Candidate* fwd = pick_grouped(list, 1024, 4, 2048, 768);
  EXPECT_TRUE(fwd == &table[6] || fwd == &table[7]);
  EXPECT_EQ(pick_grouped(list, 1024, 4, 768, 2048), &table[5]);
  // Large problems stay on the ptr-array 128x256 tiles (0.99x bmm against the contiguous 0.93x).
  EXPECT_EQ(pick_grouped(list, 32768, 8, 4096, 7168)->schedule, gemm::kCooperative);
}

TEST(GroupedCost, PadsNToWholeClustersToo) {
  // N = 384 is three 128-wide tiles: a cluster of two along N computes a fourth.
  const TileConfig along_m{gemm::kCooperative, 256, 128, 2, 1};
  const TileConfig along_n{gemm::kCooperative, 256, 128, 1, 2};
  EXPECT_LT(estimate_grouped_cost(along_m, 1 << 20, 1, 384, 3584, kH200Sms),
            estimate_grouped_cost(along_n, 1 << 20, 1, 384, 3584, kH200Sms));
}

TEST(GroupedCost, RefusesNothingAndNeverDividesByZero) {
  const TileConfig c{gemm::kCooperative, 256, 128, 2, 1};
  EXPECT_EQ(estimate_grouped_cost(c, 0, 8, 4096, 3584, kH200Sms),
            estimate_grouped_cost(c, 0, 8, 4096, 3584, kH200Sms));  // not NaN
  EXPECT_GE(estimate_grouped_cost(c, 1024, 0, 4096, 3584, kH200Sms), 1e299);
  EXPECT_GE(estimate_grouped_cost(c, 1024, 8, 4096, 3584, 1), 1e299);  // no whole cluster fits
  EXPECT_GE(estimate_grouped_cost(c, INT64_MAX / 2, 1 << 30, 1 << 30, 1e9, kH200Sms), 0.0);
}

TEST(GroupedCost, PicksTheClusterAlongNForManyExperts) {
  // DeepSeek-V3's MoE GEMMs (N 4096 or 7168, K 7168 or 2048) over 32768 tokens. The cluster
  // along M comes first, so only a lower cost makes the model pick the other.
  const std::vector<const Candidate*> fp8 = {&kFp8ClusterM, &kFp8ClusterN, &kFp8Small};
  for (int64_t groups : {32, 64}) {
    for (int64_t n : {4096, 7168}) {
      for (double k : {7168 / 2.0, 2048 / 2.0}) {
        EXPECT_EQ(pick_grouped(fp8, 32768, groups, n, k), &kFp8ClusterN) << groups << " groups, n " << n << ", k " << k;
      }
    }
  }
  // Few large experts: the padding is within a wave; either 256-row tile, never the small one.
  for (int64_t groups : {1, 4, 8}) EXPECT_NE(pick_grouped(fp8, 32768, groups, 4096, 3584), &kFp8Small) << groups;
}

TEST(GroupedCost, PicksTheSmallTileForFewTokensPerGroup) {
  // 64 groups of ~16 tokens: a 256-row tile is 94% padding; 128 rows waste half as much.
  const std::vector<const Candidate*> fp8 = {&kFp8ClusterM, &kFp8ClusterN, &kFp8Small};
  EXPECT_EQ(pick_grouped(fp8, 1024, 64, 4096, 3584), &kFp8Small);
}

TEST(DenseCost, RoundsTilesToWholeClusters) {
  const TileConfig c{gemm::kCooperative, 128, 256, 2, 1};
  // 129 rows are two tiles, and a cluster of two: the same cost as 256 rows.
  EXPECT_DOUBLE_EQ(estimate_cost(c, 129, 4096, 4096, 1, kH200Sms), estimate_cost(c, 256, 4096, 4096, 1, kH200Sms));
}

TEST(DenseCost, ChargesAnFp32EpilogueTwice) {
  // Same tiles, same waves: only the epilogue term doubles, so the mainloop-heavy cost grows
  // by less than 2x and the difference is the 16-bit epilogue's share.
  const TileConfig c{gemm::kCooperative, 128, 256, 2, 1};
  const double bf16 = estimate_cost(c, 4096, 4096, 256, 8, kH200Sms);
  const double fp32 = estimate_cost(c, 4096, 4096, 256, 8, kH200Sms, 2.0);
  const double no_epilogue = estimate_cost(c, 4096, 4096, 0, 8, kH200Sms);
  EXPECT_GT(fp32, bf16);
  EXPECT_DOUBLE_EQ(fp32 - bf16, no_epilogue);
  // A few-token FP32 wgrad (256 tokens deep): charging the FP32 epilogue moves the choice
  // toward the ping-pong tile, which hides its epilogue behind the other warpgroup's math.
  const TileConfig pingpong{gemm::kPingpong, 128, 128, 2, 1};
  EXPECT_LT(estimate_cost(pingpong, 1536, 2048, 256, 128, kH200Sms, 2.0) /
                estimate_cost(c, 1536, 2048, 256, 128, kH200Sms, 2.0),
            estimate_cost(pingpong, 1536, 2048, 256, 128, kH200Sms) / estimate_cost(c, 1536, 2048, 256, 128, kH200Sms));
}

TEST(SelectCheapest, BreaksNearTiesTowardTheLargerCluster) {
  // Equal modelled cost (a wgrad: its rows are N, never padded by a cluster): the multicast
  // of the 2x1 cluster decides, whichever comes first in the list.
  const Candidate c1x1{gemm::kPingpong, 128, 128, 1, 1};
  const Candidate c2x1{gemm::kPingpong, 128, 128, 2, 1};
  const Candidate cheaper{gemm::kCooperative, 128, 256, 1, 1};
  auto flat = [](const TileConfig&) { return 1.0; };
  EXPECT_EQ(select_cheapest_by(std::vector<const Candidate*>{&c1x1, &c2x1}, flat), &c2x1);
  EXPECT_EQ(select_cheapest_by(std::vector<const Candidate*>{&c2x1, &c1x1}, flat), &c2x1);
  // A real difference still wins over a larger cluster.
  auto cost = [](const TileConfig& c) { return c.tile_n == 256 ? 0.9 : 1.0; };
  EXPECT_EQ(select_cheapest_by(std::vector<const Candidate*>{&c2x1, &cheaper}, cost), &cheaper);
  EXPECT_EQ(select_cheapest_by(std::vector<const Candidate*>{}, flat), nullptr);
}

TEST(SelectCheapest, NearTiesPreferPairsNotClustersOfFour) {
  // Clusters of four measured slower than pairs (bench/results/h200_grouped_fp8_cluster4_configs.json): a near-tie
  // keeps the pair, whichever comes first; a clearly cheaper cluster of four still wins.
  const Candidate c2x1{gemm::kCooperative, 128, 128, 2, 1};
  const Candidate c1x4{gemm::kCooperative, 128, 128, 1, 4};
  const Candidate c2x2{gemm::kCooperative, 128, 128, 2, 2};
  auto flat = [](const TileConfig&) { return 1.0; };
  EXPECT_EQ(select_cheapest_by(std::vector<const Candidate*>{&c2x1, &c1x4, &c2x2}, flat), &c2x1);
  auto four_near = [](const TileConfig& c) { return c.cluster_m * c.cluster_n == 4 ? 0.9995 : 1.0; };
  EXPECT_EQ(select_cheapest_by(std::vector<const Candidate*>{&c2x1, &c1x4}, four_near), &c2x1);
  auto four_cheaper = [](const TileConfig& c) { return c.cluster_m * c.cluster_n == 4 ? 0.95 : 1.0; };
  EXPECT_EQ(select_cheapest_by(std::vector<const Candidate*>{&c2x1, &c1x4}, four_cheaper), &c1x4);
}

// The tensor-parallel plans on the CPU: for every rank of a group, both ops, both algorithms and
// every piece setting, the plans of all ranks together must form a valid exchange: every wait
// has exactly one signal, raised by the peer it names, after the copy whose rows the waiting
// GEMM reads; nothing is written into a peer before that peer agreed to the call; no two ranks
// write the same rows; every output row is computed once.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "tp/tp_call.h"
#include "tp/tp_heuristics.h"
#include "tp/tp_plan.h"

using namespace distgemm::tp;

namespace {

using FlagKey = std::tuple<int, int, int>;  // owner, region, index
FlagKey key(const FlagRef& f) { return {f.owner, static_cast<int>(f.region), f.index}; }

// What a signal publishes: the rows the copy just before it on its lane wrote (none for a
// signal that only says "begun").
struct Published {
  int rank = -1;
  bool has_rows = false;
  RowsRef rows;
};

std::string where(const TpShape& s) {
  return std::string(s.kind == DG_TP_ALL_GATHER_GEMM ? "all-gather" : "reduce-scatter") + " world " +
         std::to_string(s.world) + " m " + std::to_string(s.m) + (s.decomposed ? " decomposed" : " fused") +
         " pieces " + std::to_string(s.split.count) + (s.split.tapered ? "t" : "") +
         (s.gathered_out ? " gathered_out" : "") + (s.row_scales ? " row_scales" : "") +
         (s.scale_bias ? " scale_bias" : "");
}

// Whether [row0, row0 + rows) of region (owner, offset) is covered by the union of `parts`.
bool covered(const RowsRef& want, const std::vector<RowsRef>& parts) {
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (const RowsRef& p : parts)
    if (p.space == want.space && p.owner == want.owner && p.offset == want.offset)
      spans.push_back({p.row0, p.row0 + p.rows});
  std::sort(spans.begin(), spans.end());
  int64_t reached = want.row0;
  for (const auto& [lo, hi] : spans) {
    if (lo > reached) break;
    reached = std::max(reached, hi);
  }
  return reached >= want.row0 + want.rows;
}

// Checks the plans of every rank of `base`'s group; returns the number of waits matched.
int check_group(TpShape base) {
  const int world = base.world;
  std::vector<TpPlan> plans;
  for (int r = 0; r < world; ++r) {
    TpShape s = base;
    s.rank = r;
    plans.push_back(make_plan(s));
  }
  const std::string ctx = where(base);
  // Every signal of every rank: each flag raised exactly once per call.
  std::map<FlagKey, Published> signals;
  for (int r = 0; r < world; ++r) {
    std::map<Lane, RowsRef> last_copy;
    std::map<Lane, bool> has_copy;
    for (const Step& st : plans[r].steps) {
      if (st.kind == StepKind::kCopy) {
        last_copy[st.lane] = st.dst;
        has_copy[st.lane] = true;
      }
      for (const FlagRef& f : st.signals) {
        EXPECT_GE(f.owner, 0) << ctx;
        EXPECT_LT(f.owner, world) << ctx;
        EXPECT_LT(f.index, f.region == FlagRegion::kConsumed ? kMaxWorld : kMaxWorld * kMaxPieces) << ctx;
        Published p;
        p.rank = r;
        if (st.kind == StepKind::kSignal && has_copy[st.lane]) {
          p.has_rows = true;
          p.rows = last_copy[st.lane];
          EXPECT_EQ(p.rows.owner, f.owner) << ctx << ": rank " << r << " signals a rank it did not copy to";
        }
        EXPECT_TRUE(signals.emplace(key(f), p).second) << ctx << ": a flag raised twice";
      }
    }
  }
  int matched = 0;
  std::map<FlagKey, int> waited;
  for (int r = 0; r < world; ++r) {
    const TpPlan& plan = plans[r];
    bool agreed[2] = {false, false};  // per lane: the peers' agreement was checked
    bool forked = false;
    std::vector<RowsRef> published_main;  // rows the main lane has waited for so far
    std::vector<RowsRef> own_writes;      // rows this rank wrote into its own workspace (main lane)
    for (const Step& st : plan.steps) {
      const int lane = static_cast<int>(st.lane);
      if (st.kind == StepKind::kFork) forked = true;
      if (st.lane == Lane::kPush) {
        EXPECT_TRUE(forked) << ctx << ": a push before the fork";
      }
      if (st.kind == StepKind::kCheckPeers) {
        agreed[lane] = true;
        EXPECT_EQ(static_cast<int>(st.waits.size()), world - 1) << ctx;
      }
      // The begin and check steps mark a failed call in every peer (this rank's kFailed word
      // there), so that no peer reads what this rank's copies still write; nothing else does.
      if (st.kind == StepKind::kBeginCall || st.kind == StepKind::kCheckPeers || st.kind == StepKind::kPoison) {
        std::vector<FlagRef> want;
        for (int p = 0; p < world; ++p)
          if (p != r) want.push_back({p, FlagRegion::kFailed, r});
        EXPECT_EQ(st.failure_marks, want) << ctx << ": rank " << r << " " << plan.str();
      } else {
        EXPECT_TRUE(st.failure_marks.empty()) << ctx;
      }
      for (const FlagRef& f : st.signals) EXPECT_NE(f.region, FlagRegion::kFailed) << ctx << ": a mark as a signal";
      const bool writes_peer = (st.kind == StepKind::kCopy && st.dst.space == Space::kWorkspace && st.dst.owner != r) ||
                               (st.kind == StepKind::kScatterScales && st.peer != r);
      if (writes_peer) {
        EXPECT_TRUE(agreed[lane]) << ctx << ": rank " << r << " writes into a peer before it agreed";
      }
      if (st.kind == StepKind::kCopy && st.dst.space == Space::kWorkspace && st.dst.owner == r)
        own_writes.push_back(st.dst);
      std::vector<RowsRef> published = published_main;
      for (const PlannedWait& w : st.waits) {
        EXPECT_EQ(w.flag.owner, r) << ctx << ": a wait on another rank's flag";
        auto it = signals.find(key(w.flag));
        if (it == signals.end()) {
          ADD_FAILURE() << ctx << ": rank " << r << " waits for a flag nobody raises";
          continue;
        }
        EXPECT_EQ(it->second.rank, w.peer) << ctx << ": rank " << r << " waits on the wrong peer";
        ++waited[key(w.flag)];
        ++matched;
        if (it->second.has_rows) published.push_back(it->second.rows);
      }
      if (st.kind == StepKind::kWait) {
        EXPECT_EQ(st.lane, Lane::kMain) << ctx;
        published_main = published;
      }
      if (st.kind == StepKind::kGemm) {
        std::vector<RowsRef> readable = published;
        readable.insert(readable.end(), own_writes.begin(), own_writes.end());
        for (const RowsRef* read : {&st.src, &st.chain}) {
          if (read->rows == 0 || read->space != Space::kWorkspace) continue;
          EXPECT_EQ(read->owner, r) << ctx;
          EXPECT_TRUE(covered(*read, readable))
              << ctx << ": rank " << r << " reads rows " << read->row0 << "+" << read->rows << " no wait made ready";
        }
      }
    }
  }
  for (const auto& [flag, p] : signals)
    EXPECT_EQ(waited[flag], 1) << ctx << ": a flag of rank " << std::get<0>(flag) << " raised by rank " << p.rank
                               << " is waited on " << waited[flag] << " times";
  // Writes into workspaces by different ranks never overlap; outputs are computed once.
  std::map<std::pair<int, size_t>, std::vector<std::pair<int64_t, int64_t>>> into;
  for (int r = 0; r < world; ++r) {
    std::vector<std::pair<int64_t, int64_t>> out_rows;
    for (const Step& st : plans[r].steps) {
      if (st.kind == StepKind::kCopy && st.dst.space == Space::kWorkspace && st.dst.owner != r)
        into[{st.dst.owner, st.dst.offset}].push_back({st.dst.row0, st.dst.row0 + st.dst.rows});
      if (st.kind == StepKind::kGemm && st.dst.space == Space::kOut)
        out_rows.push_back({st.dst.row0, st.dst.row0 + st.dst.rows});
    }
    std::sort(out_rows.begin(), out_rows.end());
    const int64_t total = base.kind == DG_TP_ALL_GATHER_GEMM ? base.m * world : base.m;
    int64_t next = 0;
    for (const auto& [lo, hi] : out_rows) {
      EXPECT_EQ(lo, next) << ctx << ": rank " << r << " output rows computed twice or skipped";
      next = hi;
    }
    if (!base.agree_only) {
      EXPECT_EQ(next, total) << ctx;
    }
  }
  for (auto& [region, spans] : into) {
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i)
      EXPECT_LE(spans[i - 1].second, spans[i].first) << ctx << ": two ranks write the same rows";
  }
  return matched;
}

const std::vector<PieceSplit> kSplits = {{1, false}, {2, false}, {3, false}, {4, false},
                                         {2, true},  {3, true},  {4, true}};
const std::vector<int64_t> kRows = {1, 127, 128, 129, 300, 1000, 4096};

TEST(TpPlan, EveryWaitHasItsSignalAllGather) {
  int matched = 0;
  for (int world : {2, 3, 4, 8})
    for (bool decomposed : {false, true})
      for (const PieceSplit& split : kSplits)
        for (int64_t m : kRows)
          for (int extras = 0; extras < 4; ++extras) {
            TpShape s;
            s.kind = DG_TP_ALL_GATHER_GEMM;
            s.world = world;
            s.m = m;
            s.k = 256;
            s.n = 384;
            s.decomposed = decomposed;
            s.split = decomposed ? split : PieceSplit{};
            s.gathered_out = extras & 1;
            s.row_scales = !decomposed && (extras & 2);
            s.scale_bias = decomposed && (extras & 2);
            matched += check_group(s);
          }
  EXPECT_GT(matched, 0);
}

TEST(TpPlan, EveryWaitHasItsSignalReduceScatter) {
  int matched = 0;
  for (int world : {2, 3, 4, 8})
    for (bool decomposed : {false, true})
      for (const PieceSplit& split : kSplits)
        for (int64_t m : kRows)
          for (bool scale_bias : {false, true}) {
            if (!decomposed && (split.tapered || split.count > 2)) continue;  // the fused ring: whole or halves
            TpShape s;
            s.kind = DG_TP_GEMM_REDUCE_SCATTER;
            s.world = world;
            s.m = m;
            s.k = 512;
            s.n = 264;
            s.out_bytes = 4;
            s.decomposed = decomposed;
            s.split = split;
            s.scale_bias = decomposed && scale_bias;
            matched += check_group(s);
          }
  EXPECT_GT(matched, 0);
}

TpShape agreement_only(dg_tp_kind kind, bool elsewhere) {
  TpShape s;
  s.kind = kind;
  s.world = 4;
  s.m = 512;
  s.k = s.n = 256;
  s.agree_only = true;
  s.elsewhere = elsewhere;
  return s;
}

// Only the agreement: also for a rank that runs the call elsewhere (DG_TP_AGREE_ELSEWHERE).
TEST(TpPlan, AgreementOnlyPublishesAndChecks) {
  for (dg_tp_kind kind : {DG_TP_ALL_GATHER_GEMM, DG_TP_GEMM_REDUCE_SCATTER})
    for (bool elsewhere : {false, true}) {
      const TpShape s = agreement_only(kind, elsewhere);
      check_group(s);
      const TpPlan plan = make_plan(s);
      ASSERT_EQ(plan.steps.size(), 2u);
      EXPECT_EQ(plan.steps[0].kind, StepKind::kBeginCall);
      EXPECT_EQ(plan.steps[1].kind, StepKind::kCheckPeers);
      EXPECT_EQ(plan.str().find("run elsewhere") != std::string::npos, elsewhere) << plan.str();
    }
}

// A rank that runs the call elsewhere publishes a signature that differs from a rank's that runs
// the same call here in the plan word's elsewhere bit alone: the peers' check names that
// (reason 7) rather than another piece split.
TEST(TpPlan, ElsewhereIsMarkedInTheSignature) {
  for (dg_tp_kind kind : {DG_TP_ALL_GATHER_GEMM, DG_TP_GEMM_REDUCE_SCATTER}) {
    const CallSignature here = call_signature(make_plan(agreement_only(kind, false)), 5);
    const CallSignature elsewhere = call_signature(make_plan(agreement_only(kind, true)), 5);
    for (int w = 0; w < CallSignature::kFields; ++w)
      EXPECT_EQ(here.words[w] ^ elsewhere.words[w], w == CallSignature::kPlan ? CallSignature::kElsewhere : 0u) << w;
  }
}

// Ranks that run a call elsewhere compare how a's scales travel: none, one per tensor, one per
// row, or blocks along K (a multiple of the rows), besides both dtypes.
TEST(TpPlan, ElsewhereSignatureNamesTheScaleMode) {
  static const float scales[1] = {1.f};
  dg_gemm_desc g{};
  g.a.dtype = DG_E4M3;
  g.a.rows = 64;
  g.d.dtype = DG_BF16;
  std::vector<uint32_t> words;
  for (int64_t len : {int64_t{0}, int64_t{1}, int64_t{64}, int64_t{64 * 3}}) {
    g.scale_a = len ? scales : nullptr;
    g.scale_a_len = len;
    words.push_back(elsewhere_dtypes(g));
  }
  for (size_t i = 0; i < words.size(); ++i)
    for (size_t j = i + 1; j < words.size(); ++j) EXPECT_NE(words[i], words[j]) << i << " vs " << j;
  g.scale_a_len = 64 * 5;  // another number of K blocks: the same mode (K itself is compared)
  EXPECT_EQ(elsewhere_dtypes(g), words[3]);
  g.d.dtype = DG_F32;
  EXPECT_NE(elsewhere_dtypes(g), words[3]);
}

TEST(TpPlan, PiecesFollowTheSettingAndCoverTheRows) {
  for (const PieceSplit& split : kSplits)
    for (int64_t rows : kRows) {
      const RowPieces cut(rows, split);
      EXPECT_GE(cut.count, 1);
      EXPECT_LE(cut.count, split.count);
      EXPECT_EQ(cut.row0(0), 0);
      EXPECT_EQ(cut.bound[cut.count], rows);
      for (int j = 0; j < cut.count; ++j) {
        EXPECT_GT(cut.rows(j), 0) << rows << " rows, piece " << j;
        if (j > 0) {
          EXPECT_EQ(cut.row0(j) % kPieceRowAlign, 0);
        }
      }
      if (rows >= split.count * 2 * kPieceRowAlign) {
        EXPECT_EQ(cut.count, split.count) << rows;
      }
    }
  // tapered: the end pieces about half the inner ones (bounds on 128-row multiples)
  const RowPieces tapered(4096, {4, true});
  EXPECT_LT(tapered.rows(0), tapered.rows(1));
  EXPECT_LT(tapered.rows(3), tapered.rows(2));
  EXPECT_NEAR(static_cast<double>(tapered.rows(0) + tapered.rows(3)) / (tapered.rows(1) + tapered.rows(2)), 0.5, 0.15);
}

TEST(TpPlan, SettingsChooseTheSplit) {
  dg_tp_settings settings{};
  EXPECT_EQ(decomposed_split(settings, {2, false}).count, 2);  // automatic
  settings.pieces = 3;
  settings.tapered = 1;
  const PieceSplit named = decomposed_split(settings, {1, false});
  EXPECT_EQ(named.count, 3);
  EXPECT_TRUE(named.tapered);
  dg_tp_settings rs{};
  EXPECT_EQ(rs_fused_split(rs, 24e9).count, 1);  // the default: halves from 25 GFLOP
  EXPECT_EQ(rs_fused_split(rs, 26e9).count, 2);
  rs.rs_split_gflops = -1;  // every step
  EXPECT_EQ(rs_fused_split(rs, 1.0).count, 2);
  rs.rs_split_gflops = 100;
  EXPECT_EQ(rs_fused_split(rs, 50e9).count, 1);
}

TEST(TpPlan, PrintsOneLinePerStep) {
  TpShape s;
  s.kind = DG_TP_ALL_GATHER_GEMM;
  s.world = 2;
  s.rank = 1;
  s.m = 256;
  s.k = 128;
  s.n = 64;
  s.decomposed = true;
  s.split = {2, false};
  const TpPlan plan = make_plan(s);
  const std::string text = plan.str();
  EXPECT_NE(text.find("all-gather + GEMM, rank 1 of 2"), std::string::npos) << text;
  EXPECT_NE(text.find("push copy a[0:128) -> ws0.gathered[256:384)"), std::string::npos) << text;
  EXPECT_NE(text.find("main wait ?ws1.ready[0]<-0"), std::string::npos) << text;
  EXPECT_NE(text.find("main gemm out[0:128) = ws1.gathered[0:128) @ b^T + c"), std::string::npos) << text;
  EXPECT_EQ(static_cast<size_t>(std::count(text.begin(), text.end(), '\n')), plan.steps.size() + 1);
}

TEST(TpPlan, RegionsFitTheWorkspace) {
  for (dg_tp_kind kind : {DG_TP_ALL_GATHER_GEMM, DG_TP_GEMM_REDUCE_SCATTER})
    for (int world : {2, 3, 8}) {
      TpShape s;
      s.kind = kind;
      s.world = world;
      s.m = 1000;
      s.k = 256;
      s.n = 384;
      const TpRegions r = tp_regions(s);
      EXPECT_GE(r.bias,
                kind == DG_TP_ALL_GATHER_GEMM ? r.scales + 4 * 1000 * world : r.received + r.slot_bytes * (world - 1));
      EXPECT_GE(r.scratch, r.bias + 384 * 2);
      EXPECT_EQ(r.bytes, r.scratch + kGemmScratchBytes);
      EXPECT_EQ(r.scratch % 4096, 0u);
    }
}

}  // namespace

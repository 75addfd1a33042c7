// A tensor-parallel call as data: which copies, signals, waits and GEMMs each rank enqueues, on
// which of its two streams, in which order (after CUTLASS's distributed schedules). Built from
// the call's shape and settings alone, so it can be printed and checked on the CPU (every wait
// has its signal on the right peer, nothing is written into a peer before that peer agreed);
// tp_executor runs it. Pure host code: no CUDA call, no pointer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tp/tp_layout.h"
#include "distgemm/distgemm.h"

namespace distgemm::tp {

// How a chunk of rows is cut: `count` pieces, equal or, `tapered`, the first and last half as
// large as the others (the first push starts sooner and the last GEMM, which waits for the last
// push, is short).
struct PieceSplit {
  int count = 1;
  bool tapered = false;
};

// Rows [0, rows) of a chunk cut into pieces that travel and are multiplied one by one, at
// tile-row boundaries (fewer pieces, or equal ones, where the rows are too few).
constexpr int64_t kPieceRowAlign = 128;
struct RowPieces {
  int count = 1;
  int64_t bound[kMaxPieces + 1] = {};
  RowPieces() = default;
  RowPieces(int64_t rows, PieceSplit split);
  int64_t row0(int j) const { return bound[j]; }
  int64_t rows(int j) const { return bound[j + 1] - bound[j]; }
};

// A flag word in the header of `owner`'s workspace (TpHeader): kConsumed[index] (a peer began
// this call), kReady[index] (a piece of a gathered shard is in), kStepReady[index] (a piece of
// pushed partial sums is in), kFailed[index] (that peer's call failed).
enum class FlagRegion : uint8_t { kConsumed, kReady, kStepReady, kFailed };
struct FlagRef {
  int owner = -1;
  FlagRegion region = FlagRegion::kReady;
  int index = 0;
  bool operator==(const FlagRef& o) const { return owner == o.owner && region == o.region && index == o.index; }
};

// A bounded wait for `flag` to reach this call's epoch; `peer` is the rank that raises it (named
// in the error if the wait times out).
struct PlannedWait {
  FlagRef flag;
  int peer = -1;
};

// Rows [row0, row0 + rows) of a row-major matrix: the caller's a, out or gathered_out, or a
// region of `owner`'s workspace starting at byte `offset` (rows of the exchanged width,
// contiguous).
enum class Space : uint8_t { kA, kOut, kGatheredOut, kWorkspace };
struct RowsRef {
  Space space = Space::kA;
  int owner = -1;
  size_t offset = 0;
  int64_t row0 = 0;
  int64_t rows = 0;
};

enum class Lane : uint8_t {
  kMain,  // the caller's stream: GEMMs and what they wait for
  kPush,  // a side stream forked from it: copies into peers and their signals
};

enum class StepKind : uint8_t {
  kBeginCall,      // epoch += 1, then publish the signature and raise `signals` (peers' kConsumed)
  kCheckPeers,     // wait for `waits` (every peer began this call), read their failure marks and
                   // compare signatures
  kFork,           // the push lane waits for the main lane's work so far
  kJoin,           // the main lane waits for the push lane's work
  kScatterScales,  // this shard's FP8 row scales into `peer`'s gathered scales
  kScaleBias,      // beta * bias into this rank's workspace (the cuBLASLt pieces add it unscaled)
  kCopy,           // src rows -> dst rows
  kSignal,         // raise `signals` after the lane's earlier work, unless the call failed
  kWait,           // bounded wait on the lane for `waits` (one)
  kGemm,           // out rows (dst) = a rows (src) @ b^T (+ chain) (+ the caller's c if `bias`)
  kPoison,         // if the call failed or a peer marked its own as failed, fill dst rows with NaN
};

struct Step {
  StepKind kind = StepKind::kGemm;
  Lane lane = Lane::kMain;
  RowsRef src;
  RowsRef dst;
  RowsRef chain;                   // kGemm: partial sums added with coefficient 1 (rows 0: none)
  bool bias = false;               // kGemm: adds the caller's c (bias row, or full C rows of dst)
  bool waits_per_chunk = false;    // kGemm: tile rows of chunk q (of shape.m rows) wait for waits[q]
  int first_chunk = 0;             // kGemm with waits_per_chunk: the chunk its tiles start at
  int peer = -1;                   // kScatterScales: the destination rank
  std::vector<FlagRef> signals;    // kBeginCall, kSignal
  std::vector<PlannedWait> waits;  // kCheckPeers, kWait, kGemm (waited inside the kernel)
  // kBeginCall, kCheckPeers, kPoison: the peers' kFailed words for this rank, set to the epoch
  // when the call has failed (the begin step: an earlier call's failure stands; the check and
  // the poison steps: it failed by then).
  // A failed call writes nothing else that a peer could take for valid data: no signal.
  std::vector<FlagRef> failure_marks;
};

// What a plan is made from: one rank's view of the call.
struct TpShape {
  dg_tp_kind kind = DG_TP_ALL_GATHER_GEMM;
  int rank = 0;
  int world = 2;
  int64_t m = 0;  // rows of each rank's shard: a's (all-gather) or out's (reduce-scatter)
  int64_t k = 0;  // the GEMM's K (this rank's share of it for a reduce-scatter)
  int64_t n = 0;  // the GEMM's N
  int in_bytes = 2;
  int out_bytes = 2;
  bool decomposed = false;
  PieceSplit split;           // the pieces of a chunk (decomposed) or ring step (fused RS)
  bool row_scales = false;    // all-gather: FP8 row scales travel with the shard
  bool gathered_out = false;  // all-gather: a copy of the gathered a is returned
  bool scale_bias = false;    // decomposed: the bias is scaled by beta into the workspace
  bool agree_only = false;    // only the per-call agreement
  bool elsewhere = false;     // with agree_only: this rank runs the call without the workspaces
};

// The workspace regions of a call (byte offsets; every rank's workspace has the same layout).
struct TpRegions {
  size_t gathered = 0;  // all-gather: world * m rows of K
  size_t scales = 0;    // all-gather: world * m FP8 row scales
  size_t slots = 0;     // reduce-scatter: world - 1 slots of m x N partial sums computed here
  size_t received = 0;  // reduce-scatter: world - 1 slots pushed by the previous rank
  size_t slot_bytes = 0;
  size_t bias = 0;     // N output elements: the scaled bias
  size_t scratch = 0;  // the cuBLASLt pieces' scratch (kGemmScratchBytes)
  size_t bytes = 0;    // the whole workspace
};
TpRegions tp_regions(const TpShape& shape);

struct TpPlan {
  TpShape shape;
  TpRegions regions;
  RowPieces cut;  // of each chunk (all-gather) or ring step (reduce-scatter)
  std::vector<Step> steps;
  // One line per step, e.g. "push  copy a[0:128) -> ws1.gathered[128:256)".
  std::string str() const;
};

// The schedule of `shape`'s call on its rank.
TpPlan make_plan(const TpShape& shape);

// The ring neighbours of `rank`.
inline int next_rank(int rank, int world) { return (rank + 1) % world; }
inline int prev_rank(int rank, int world) { return (rank + world - 1) % world; }

}  // namespace distgemm::tp

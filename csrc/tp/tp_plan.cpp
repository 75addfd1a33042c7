#include "tp/tp_plan.h"

#include <algorithm>
#include <sstream>

namespace distgemm::tp {

RowPieces::RowPieces(int64_t rows, PieceSplit split) {
  count = std::clamp(split.count, 1, kMaxPieces);
  while (count > 1 && rows < count * kPieceRowAlign) --count;
  int weight[kMaxPieces];
  int total = 0;
  for (int j = 0; j < count; ++j) {
    weight[j] = split.tapered && count > 2 && j > 0 && j < count - 1 ? 2 : 1;
    total += weight[j];
  }
  if (rows < total * kPieceRowAlign) {  // a tapered end piece would round to nothing
    for (int j = 0; j < count; ++j) weight[j] = 1;
    total = count;
  }
  int64_t cumulative = 0;
  for (int j = 0; j < count; ++j) {
    bound[j] = (rows * cumulative / total + kPieceRowAlign - 1) / kPieceRowAlign * kPieceRowAlign;
    cumulative += weight[j];
  }
  bound[count] = rows;
}

TpRegions tp_regions(const TpShape& s) {
  TpRegions r;
  const size_t header = TpHeader::kBytes;
  size_t end = header;
  if (s.kind == DG_TP_ALL_GATHER_GEMM) {
    const int64_t rows = s.m * s.world;
    r.gathered = header;
    r.scales = align_up(r.gathered + static_cast<size_t>(rows * s.k) * s.in_bytes, 256);
    end = r.scales + static_cast<size_t>(rows) * sizeof(float);
  } else {
    r.slot_bytes = align_up(static_cast<size_t>(s.m * s.n) * s.out_bytes, 256);
    r.slots = header;
    r.received = r.slots + r.slot_bytes * static_cast<size_t>(s.world - 1);
    end = r.received + r.slot_bytes * static_cast<size_t>(s.world - 1);
  }
  r.bias = align_up(end, 256);
  r.scratch = align_up(r.bias + static_cast<size_t>(s.n) * s.out_bytes, 4096);
  r.bytes = r.scratch + kGemmScratchBytes;
  return r;
}

namespace {

// Steps of one rank's plan, appended in enqueue order.
class Builder {
 public:
  explicit Builder(TpPlan* plan) : plan_(*plan), s_(plan->shape) {}

  Step& add(StepKind kind, Lane lane) {
    plan_.steps.push_back(Step{});
    Step& st = plan_.steps.back();
    st.kind = kind;
    st.lane = lane;
    return st;
  }
  void begin_call() {
    Step& st = add(StepKind::kBeginCall, Lane::kMain);
    for (int p = 0; p < s_.world; ++p)
      if (p != s_.rank) st.signals.push_back({p, FlagRegion::kConsumed, s_.rank});
    mark_failure_in_peers(st);
  }
  // Nearest peers first: they are the first this rank exchanges with.
  void check_peers(Lane lane) {
    Step& st = add(StepKind::kCheckPeers, lane);
    for (int i = 1; i < s_.world; ++i) {
      const int p = (s_.rank + i) % s_.world;
      st.waits.push_back({{s_.rank, FlagRegion::kConsumed, p}, p});
    }
    mark_failure_in_peers(st);
  }
  void mark_failure_in_peers(Step& st) {
    for (int p = 0; p < s_.world; ++p)
      if (p != s_.rank) st.failure_marks.push_back({p, FlagRegion::kFailed, s_.rank});
  }
  void copy(Lane lane, RowsRef src, RowsRef dst) {
    Step& st = add(StepKind::kCopy, lane);
    st.src = src;
    st.dst = dst;
  }
  void signal(Lane lane, FlagRef flag) { add(StepKind::kSignal, lane).signals.push_back(flag); }
  void wait(FlagRef flag, int peer) { add(StepKind::kWait, Lane::kMain).waits.push_back({flag, peer}); }
  Step& gemm(RowsRef a, RowsRef out, bool bias) {
    Step& st = add(StepKind::kGemm, Lane::kMain);
    st.src = a;
    st.dst = out;
    st.bias = bias;
    return st;
  }
  void poison(RowsRef rows) {
    Step& st = add(StepKind::kPoison, Lane::kMain);
    st.dst = rows;
    mark_failure_in_peers(st);  // a failure found after the check (inside a GEMM's wait)
  }

 private:
  TpPlan& plan_;
  const TpShape& s_;
};

RowsRef caller(Space space, int64_t row0, int64_t rows) { return {space, -1, 0, row0, rows}; }
RowsRef workspace(int owner, size_t offset, int64_t row0, int64_t rows) {
  return {Space::kWorkspace, owner, offset, row0, rows};
}

// Rank r pushes its shard to every peer's gathered buffer on the push lane, in the order the
// peers' GEMMs need it (rank p's GEMMs walk chunks p, p + 1, ...: r is needed first by r - 1),
// raising that peer's ready flag per piece. Decomposed: one GEMM per chunk piece on the main
// lane, the own shard straight from `a` first, then each peer's piece after a wait for its flag.
// Fused: the own shard is copied into the gathered buffer first (a local copy needs SMs: under
// the GEMM it would crawl), then one persistent GEMM over every gathered row waits tile row by
// tile row for each chunk's flag.
void plan_all_gather(TpPlan& plan, Builder& b) {
  const TpShape& s = plan.shape;
  const int r = s.rank, world = s.world;
  const int64_t m = s.m, rows = m * world;
  const RowPieces& cut = plan.cut;
  const size_t gathered = plan.regions.gathered;
  if (s.row_scales) b.add(StepKind::kScatterScales, Lane::kMain).peer = r;
  if (s.scale_bias) b.add(StepKind::kScaleBias, Lane::kMain);
  b.add(StepKind::kFork, Lane::kMain);
  // Every peer must have begun this call (so it is done reading its buffer in earlier calls)
  // with the same signature before anything is written into it.
  b.check_peers(Lane::kPush);
  for (int i = 1; i < world; ++i) {
    const int p = (r - i + world) % world;
    if (s.row_scales) b.add(StepKind::kScatterScales, Lane::kPush).peer = p;
    for (int j = 0; j < cut.count; ++j) {
      b.copy(Lane::kPush, caller(Space::kA, cut.row0(j), cut.rows(j)),
             workspace(p, gathered, r * m + cut.row0(j), cut.rows(j)));
      b.signal(Lane::kPush, {p, FlagRegion::kReady, r * cut.count + j});
    }
  }
  if (s.decomposed) {
    b.gemm(caller(Space::kA, 0, m), caller(Space::kOut, r * m, m), true);
    for (int i = 1; i < world; ++i) {
      const int q = (r + i) % world;  // q's shard arrives after those of q - 1, ..., r + 1
      for (int j = 0; j < cut.count; ++j) {
        const int64_t row0 = q * m + cut.row0(j);
        b.wait({r, FlagRegion::kReady, q * cut.count + j}, q);
        b.gemm(workspace(r, gathered, row0, cut.rows(j)), caller(Space::kOut, row0, cut.rows(j)), true);
      }
    }
  } else {
    b.copy(Lane::kMain, caller(Space::kA, 0, m), workspace(r, gathered, r * m, m));
    b.signal(Lane::kMain, {r, FlagRegion::kReady, r});
    Step& g = b.gemm(workspace(r, gathered, 0, rows), caller(Space::kOut, 0, rows), true);
    g.waits_per_chunk = true;
    g.first_chunk = r;
    for (int q = 0; q < world; ++q) g.waits.push_back({{r, FlagRegion::kReady, q}, q});
  }
  if (s.gathered_out) {
    if (s.decomposed) {  // the own shard never entered the gathered buffer
      b.copy(Lane::kMain, caller(Space::kA, 0, m), caller(Space::kGatheredOut, r * m, m));
      if (r > 0) b.copy(Lane::kMain, workspace(r, gathered, 0, r * m), caller(Space::kGatheredOut, 0, r * m));
      if (r < world - 1)
        b.copy(Lane::kMain, workspace(r, gathered, (r + 1) * m, rows - (r + 1) * m),
               caller(Space::kGatheredOut, (r + 1) * m, rows - (r + 1) * m));
    } else {
      b.copy(Lane::kMain, workspace(r, gathered, 0, rows), caller(Space::kGatheredOut, 0, rows));
    }
  }
  b.add(StepKind::kJoin, Lane::kMain);
  // A failed call (a peer timed out or disagreed) hands back NaN, never a valid-looking result.
  b.poison(caller(Space::kOut, 0, rows));
  if (s.gathered_out) b.poison(caller(Space::kGatheredOut, 0, rows));
}

// At step s rank r computes the rows of chunk (r - s - 1) mod P, adding the partial sums rank
// r - 1 computed for the same rows at step s - 1, which r - 1 pushed into r's workspace on its
// push lane while r computed. The last step (chunk r) writes the output and adds the bias.
// Decomposed: each piece waits for its pushed partial sums on the main lane, then a cuBLASLt
// GEMM takes them as its C operand. Fused: the CUTLASS GEMM's epilogue waits for them.
void plan_reduce_scatter(TpPlan& plan, Builder& b) {
  const TpShape& s = plan.shape;
  const int r = s.rank, world = s.world;
  const int prev = prev_rank(r, world), next = next_rank(r, world);
  const int64_t m = s.m;
  const RowPieces& cut = plan.cut;
  const TpRegions& ws = plan.regions;
  if (s.scale_bias) b.add(StepKind::kScaleBias, Lane::kMain);
  for (int step = 0; step < world; ++step) {
    const int64_t chunk = (r - step - 1 + 2 * world) % world;
    const bool last = step == world - 1;
    for (int j = 0; j < cut.count; ++j) {
      const int64_t row0 = cut.row0(j), rows = cut.rows(j);
      const PlannedWait received{{r, FlagRegion::kStepReady, (step - 1) * cut.count + j}, prev};
      if (s.decomposed && step > 0) b.wait(received.flag, received.peer);
      const RowsRef out =
          last ? caller(Space::kOut, row0, rows) : workspace(r, ws.slots + step * ws.slot_bytes, row0, rows);
      Step& g = b.gemm(caller(Space::kA, chunk * m + row0, rows), out, last);
      if (step > 0) {
        g.chain = workspace(r, ws.received + (step - 1) * ws.slot_bytes, row0, rows);
        if (!s.decomposed) g.waits.push_back(received);
      }
      if (last) continue;
      b.add(StepKind::kFork, Lane::kMain);  // the push waits for this GEMM only
      // Before the first push: every peer must have begun this call (so the next rank is done
      // reading its received slots in earlier calls) with the same signature.
      if (step == 0 && j == 0) b.check_peers(Lane::kPush);
      b.copy(Lane::kPush, out, workspace(next, ws.received + step * ws.slot_bytes, row0, rows));
      b.signal(Lane::kPush, {next, FlagRegion::kStepReady, step * cut.count + j});
    }
  }
  b.add(StepKind::kJoin, Lane::kMain);
  b.poison(caller(Space::kOut, 0, m));
}

const char* region_name(FlagRegion r) {
  switch (r) {
    case FlagRegion::kConsumed:
      return "consumed";
    case FlagRegion::kReady:
      return "ready";
    case FlagRegion::kStepReady:
      return "step_ready";
    case FlagRegion::kFailed:
      return "failed";
  }
  return "?";
}

const char* kind_name(StepKind k) {
  switch (k) {
    case StepKind::kBeginCall:
      return "begin_call";
    case StepKind::kCheckPeers:
      return "check_peers";
    case StepKind::kFork:
      return "fork";
    case StepKind::kJoin:
      return "join";
    case StepKind::kScatterScales:
      return "scatter_scales";
    case StepKind::kScaleBias:
      return "scale_bias";
    case StepKind::kCopy:
      return "copy";
    case StepKind::kSignal:
      return "signal";
    case StepKind::kWait:
      return "wait";
    case StepKind::kGemm:
      return "gemm";
    case StepKind::kPoison:
      return "poison";
  }
  return "?";
}

std::string rows_str(const RowsRef& ref, const TpRegions& ws) {
  std::ostringstream o;
  switch (ref.space) {
    case Space::kA:
      o << "a";
      break;
    case Space::kOut:
      o << "out";
      break;
    case Space::kGatheredOut:
      o << "gathered_out";
      break;
    case Space::kWorkspace: {
      o << "ws" << ref.owner << '.';
      if (ref.offset == ws.gathered && ws.slot_bytes == 0)
        o << "gathered";
      else if (ws.slot_bytes && ref.offset >= ws.received)
        o << "received" << (ref.offset - ws.received) / ws.slot_bytes;
      else if (ws.slot_bytes)
        o << "slot" << (ref.offset - ws.slots) / ws.slot_bytes;
      else
        o << '@' << ref.offset;
      break;
    }
  }
  o << '[' << ref.row0 << ':' << ref.row0 + ref.rows << ')';
  return o.str();
}

std::string flag_str(const FlagRef& f) {
  std::ostringstream o;
  o << "ws" << f.owner << '.' << region_name(f.region) << '[' << f.index << ']';
  return o.str();
}

}  // namespace

TpPlan make_plan(const TpShape& shape) {
  TpPlan plan;
  plan.shape = shape;
  plan.regions = tp_regions(shape);
  plan.cut = RowPieces(shape.m, shape.split);
  Builder b(&plan);
  b.begin_call();
  if (shape.agree_only) {
    b.check_peers(Lane::kMain);
    return plan;
  }
  if (shape.kind == DG_TP_ALL_GATHER_GEMM)
    plan_all_gather(plan, b);
  else
    plan_reduce_scatter(plan, b);
  return plan;
}

std::string TpPlan::str() const {
  std::ostringstream o;
  o << (shape.kind == DG_TP_ALL_GATHER_GEMM ? "all-gather + GEMM" : "GEMM + reduce-scatter") << ", rank " << shape.rank
    << " of " << shape.world << ", m " << shape.m << ", k " << shape.k << ", n " << shape.n << ", "
    << (shape.decomposed ? "decomposed" : "fused") << ", " << cut.count << (shape.split.tapered ? " tapered" : "")
    << " piece(s)"
    << (shape.elsewhere    ? ", agreement only, run elsewhere"
        : shape.agree_only ? ", agreement only"
                           : "")
    << '\n';
  for (const Step& st : steps) {
    o << (st.lane == Lane::kMain ? "main " : "push ") << kind_name(st.kind);
    switch (st.kind) {
      case StepKind::kCopy:
        o << ' ' << rows_str(st.src, regions) << " -> " << rows_str(st.dst, regions);
        break;
      case StepKind::kGemm:
        o << ' ' << rows_str(st.dst, regions) << " = " << rows_str(st.src, regions) << " @ b^T";
        if (st.chain.rows) o << " + " << rows_str(st.chain, regions);
        if (st.bias) o << " + c";
        break;
      case StepKind::kPoison:
        o << ' ' << rows_str(st.dst, regions);
        break;
      case StepKind::kScatterScales:
        o << " -> ws" << st.peer << ".scales";
        break;
      default:
        break;
    }
    for (const FlagRef& f : st.signals) o << " !" << flag_str(f);
    if (!st.failure_marks.empty()) {
      o << " (failed: !";
      for (size_t i = 0; i < st.failure_marks.size(); ++i) o << (i ? " !" : "") << flag_str(st.failure_marks[i]);
      o << ')';
    }
    if (st.waits_per_chunk) o << " (per chunk)";
    for (const PlannedWait& w : st.waits) o << " ?" << flag_str(w.flag) << "<-" << w.peer;
    o << '\n';
  }
  return o.str();
}

}  // namespace distgemm::tp

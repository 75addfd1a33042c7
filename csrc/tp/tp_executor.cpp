#include "tp/tp_executor.h"

#include <string>

#include "common/device.h"
#include "common/dtype.h"
#include "common/error_state.h"
#include "common/status.h"
#include "common/stream_pool.h"
#include "tp/tp_kernels.cuh"

namespace distgemm::tp {

TpBuffers::Rows TpBuffers::rows(const RowsRef& ref) const {
  const dg_gemm_desc& g = d_.gemm;
  const TpShape& s = plan_.shape;
  Rows r;
  switch (ref.space) {
    case Space::kA:
      r = {static_cast<char*>(const_cast<void*>(g.a.data)), g.a.row_stride, g.a.cols, s.in_bytes};
      break;
    case Space::kOut:
      r = {static_cast<char*>(const_cast<void*>(g.d.data)), g.d.row_stride, g.d.cols, s.out_bytes};
      break;
    case Space::kGatheredOut:
      r = {static_cast<char*>(d_.gathered_out), s.k, s.k, s.in_bytes};
      break;
    case Space::kWorkspace: {
      const bool gathered = s.kind == DG_TP_ALL_GATHER_GEMM;  // else partial sums
      const int64_t width = gathered ? s.k : s.n;
      r = {peers_.base[ref.owner] + ref.offset, width, width, gathered ? s.in_bytes : s.out_bytes};
      break;
    }
  }
  if (r.data) r.data += static_cast<size_t>(ref.row0 * r.pitch) * r.elem_bytes;
  return r;
}

uint32_t* TpBuffers::flag(const FlagRef& f) const {
  const size_t region = f.region == FlagRegion::kConsumed ? TpHeader::kConsumed
                        : f.region == FlagRegion::kReady  ? TpHeader::kReady
                        : f.region == FlagRegion::kFailed ? TpHeader::kFailed
                                                          : TpHeader::kStepReady;
  return peers_.word(f.owner, region, f.index);
}

FailureMarks TpBuffers::failure_marks(const Step& st) const {
  FailureMarks marks{};
  for (const FlagRef& f : st.failure_marks) marks.in_peers[marks.count++] = flag(f);
  marks.seen = peers_.word(d_.rank, TpHeader::kFailed);
  marks.world = plan_.shape.world;
  return marks;
}

StepGemm TpBuffers::gemm(const Step& st) const {
  const dg_gemm_desc& g = d_.gemm;
  StepGemm out;
  dg_gemm_desc& s = out.desc;
  s = g;
  const Rows a = rows(st.src), o = rows(st.dst);
  s.a = {a.data, g.a.dtype, st.src.rows, a.cols, a.pitch, 1};
  s.d = {o.data, g.d.dtype, st.dst.rows, o.cols, o.pitch, 1};
  if (g.scale_a) {                            // FP8 row scales follow a's rows
    if (st.src.space == Space::kWorkspace) {  // gathered with the shards
      s.scale_a = reinterpret_cast<const float*>(peers_.base[d_.rank] + plan_.regions.scales) + st.src.row0;
      // A decomposed GEMM's rows come from one peer's shard: with one scale per shard (the ranks
      // agree on the mode), the gathered values repeat it, and the first of them is that scale.
      s.scale_a_len = g.scale_a_len == 1 && plan_.shape.decomposed ? 1 : st.src.rows;
    } else if (g.scale_a_len > 1) {
      s.scale_a = g.scale_a + st.src.row0;
      s.scale_a_len = st.src.rows;
    }
  }
  if (!st.bias || !g.c.data) {
    s.c = {};
  } else if (g.c.rows != 1) {  // a full C: the rows of out this step writes
    s.c.data =
        static_cast<const char*>(g.c.data) + static_cast<size_t>(st.dst.row0 * g.c.row_stride) * dtype_bytes(g.c.dtype);
    s.c.rows = st.dst.rows;
  } else if (plan_.shape.scale_bias) {
    s.c.data = peers_.base[d_.rank] + plan_.regions.bias;
    s.beta = 1.f;
  }
  if (st.chain.rows) {
    const Rows c = rows(st.chain);
    out.chain_c = c.data;
    out.chain_ldc = c.pitch;
  }
  return out;
}

const char* unsupported_gemm(const dg_tp_desc& d, const Peers& peers, const TpPlan& plan,
                             const GemmConsumer& consumer) {
  const TpBuffers buffers(d, peers, plan);
  for (const Step& st : plan.steps)
    if (st.kind == StepKind::kGemm)
      if (const char* why = consumer.unsupported(buffers.gemm(st))) return why;
  return nullptr;
}

namespace {

// The kernel-side waits of a fused GEMM step.
dg_status gemm_waits(const Step& st, const TpPlan& plan, const TpBuffers& buffers, const SyncParams& call,
                     SyncParams* out) {
  *out = call;
  if (st.waits_per_chunk) {  // tile rows of chunk q wait for waits[q]: consecutive ready flags
    for (size_t q = 0; q < st.waits.size(); ++q)
      if (!(st.waits[q].flag == FlagRef{plan.shape.rank, FlagRegion::kReady, static_cast<int>(q)}))
        return fail(DG_ERROR_INTERNAL, "a fused GEMM's chunk flags must be this rank's ready flags 0..world-1");
    out->chunk_ready = buffers.flag(st.waits[0].flag);
    out->chunk_rows = static_cast<int32_t>(plan.shape.m);
    out->num_chunks = static_cast<int32_t>(st.waits.size());
    out->first_chunk = st.first_chunk;
    return DG_SUCCESS;
  }
  if (st.waits.size() != 1) return fail(DG_ERROR_INTERNAL, "a fused GEMM waits for one C operand");
  out->c_ready = buffers.flag(st.waits[0].flag);
  out->c_peer = st.waits[0].peer;
  return DG_SUCCESS;
}

dg_status copy_rows(const TpBuffers& buffers, const Step& st, cudaStream_t on) {
  const TpBuffers::Rows src = buffers.rows(st.src), dst = buffers.rows(st.dst);
  const size_t width = static_cast<size_t>(src.cols) * src.elem_bytes;
  if (width != static_cast<size_t>(dst.cols) * dst.elem_bytes || st.src.rows != st.dst.rows)
    return fail(DG_ERROR_INTERNAL, "a planned copy's source and destination differ in shape");
  if (src.pitch == src.cols && dst.pitch == dst.cols) {  // one DMA: a 2-D copy of many short rows runs far slower
    DG_CUDA_RETURN(cudaMemcpyAsync(dst.data, src.data, width * st.src.rows, cudaMemcpyDeviceToDevice, on));
  } else {
    DG_CUDA_RETURN(cudaMemcpy2DAsync(dst.data, dst.pitch * dst.elem_bytes, src.data, src.pitch * src.elem_bytes, width,
                                     st.src.rows, cudaMemcpyDeviceToDevice, on));
  }
  return DG_SUCCESS;
}

// What a plan's run has enqueued so far, for the clean-up of a run that stops part-way.
struct RunState {
  cudaStream_t push = nullptr;  // the side stream, once forked
  bool joined = false;
};

dg_status run_steps(const dg_tp_desc& d, const Peers& peers, const TpPlan& plan, uint32_t dtypes, int tag,
                    const GemmConsumer& consumer, const TpBuffers& buffers, const ErrorState* err, StreamPool* pool,
                    cudaStream_t stream, RunState* run);

}  // namespace

dg_status execute(const dg_tp_desc& d, const Peers& peers, const TpPlan& plan, uint32_t dtypes, int tag,
                  const GemmConsumer& consumer, cudaStream_t stream) {
  const TpBuffers buffers(d, peers, plan);
  // Every GEMM is checked before anything is enqueued: a failure must not strand the peers.
  for (const Step& st : plan.steps)
    if (st.kind == StepKind::kGemm) DG_RETURN_IF_ERROR(consumer.check(buffers.gemm(st), !st.waits.empty()));

  const int device = peers.device;
  const ErrorState* err = error_state(device);
  StreamPool* pool = stream_pool(device);
  if (!err || !pool) return DG_ERROR_CUDA;
  RunState run;
  const dg_status status = run_steps(d, peers, plan, dtypes, tag, consumer, buffers, err, pool, stream, &run);
  if (status == DG_SUCCESS) return DG_SUCCESS;
  // A launch failed part-way (the plan's steps were checked, so this is the runtime refusing
  // one): the side stream is joined back, so that the caller's stream never runs ahead of
  // pushes still queued there, and the outputs are filled with NaN, so that whatever part of
  // them was computed never reads as a result. Best effort: on a broken context these fail too.
  // The peers' waits for this rank run out (bounded) and give them NaN and the error.
  const std::string message = dg_last_error();
  if (run.push && !run.joined) join_streams(*pool, stream, 1);
  const SyncParams unconditional{};  // no error word: the fill happens whatever it says
  for (const Step& st : plan.steps) {
    if (st.kind != StepKind::kPoison) continue;
    const TpBuffers::Rows rows = buffers.rows(st.dst);
    launch_poison_on_error(rows.data, st.dst.rows, rows.cols, rows.pitch, rows.elem_bytes, buffers.failure_marks(st),
                           unconditional, stream);
  }
  cudaGetLastError();  // the clean-up's own failures are not this call's error
  return fail(status, message);
}

namespace {

dg_status run_steps(const dg_tp_desc& d, const Peers& peers, const TpPlan& plan, uint32_t dtypes, int tag,
                    const GemmConsumer& consumer, const TpBuffers& buffers, const ErrorState* err, StreamPool* pool,
                    cudaStream_t stream, RunState* run) {
  const int rank = d.rank;
  SyncParams sync;
  sync.epoch = peers.word(rank, TpHeader::kEpoch);
  // The largest timeout a uint64 of nanoseconds holds (~584 years) bounds what the clock can count.
  sync.timeout_ns = d.timeout_s >= 1.8e10 ? UINT64_MAX : static_cast<uint64_t>(d.timeout_s * 1e9);
  sync.error = err->device_word;
  sync.error_host = err->host_word_device;
  sync.error_tag = tag;
  sync.failed_marks = peers.word(rank, TpHeader::kFailed);
  sync.peer_failed_code = (kReasonPeerFailed << kErrorReasonShift) | tag;
  const CallSignature sig = call_signature(plan, dtypes);
  const dg_gemm_desc& g = d.gemm;

  cudaStream_t& push = run->push;
  for (const Step& st : plan.steps) {
    cudaStream_t on = st.lane == Lane::kMain ? stream : push;
    if (!on && st.lane == Lane::kPush) return fail(DG_ERROR_INTERNAL, "a push step before the plan forks");
    switch (st.kind) {
      case StepKind::kBeginCall: {
        PeerTargets targets{};
        for (const FlagRef& f : st.signals) {
          targets.started[targets.count] = buffers.flag(f);
          targets.sig_slots[targets.count++] = peers.signature(f.owner, rank);
        }
        DG_CUDA_RETURN(launch_begin_call(peers.word(rank, TpHeader::kEpoch), targets, sig, buffers.failure_marks(st),
                                         sync.error, on));
        break;
      }
      case StepKind::kCheckPeers: {
        PeerChecks checks{};
        for (const PlannedWait& w : st.waits) {
          checks.started[checks.count] = buffers.flag(w.flag);
          checks.sig[checks.count] = peers.signature(rank, w.peer);
          checks.rank[checks.count++] = w.peer;
        }
        DG_CUDA_RETURN(launch_check_peers(checks, sig, buffers.failure_marks(st), sync, on));
        break;
      }
      case StepKind::kFork:
        DG_RETURN_IF_ERROR(fork_streams(*pool, stream, 1));
        push = pool->streams[0];
        break;
      case StepKind::kJoin:
        DG_RETURN_IF_ERROR(join_streams(*pool, stream, 1));
        run->joined = true;
        break;
      case StepKind::kScatterScales: {
        ScaleTargets targets{};
        targets.dst[targets.count++] =
            reinterpret_cast<float*>(peers.base[st.peer] + plan.regions.scales) + rank * plan.shape.m;
        // Into a peer only while the call stands (the own rows are written whatever happens).
        DG_CUDA_RETURN(launch_scatter_scales(g.scale_a, g.scale_a_len, plan.shape.m, targets,
                                             st.peer == rank ? nullptr : sync.error, on));
        break;
      }
      case StepKind::kScaleBias:
        DG_CUDA_RETURN(
            launch_scale_row(g.c.data, peers.base[rank] + plan.regions.bias, plan.shape.n, g.d.dtype, g.beta, on));
        break;
      case StepKind::kCopy:
        DG_RETURN_IF_ERROR(copy_rows(buffers, st, on));
        break;
      case StepKind::kSignal: {
        SignalTargets targets{};
        for (const FlagRef& f : st.signals) targets.flags[targets.count++] = buffers.flag(f);
        DG_CUDA_RETURN(launch_signal(targets, sync.epoch, sync.error, on));
        break;
      }
      case StepKind::kWait:
        for (const PlannedWait& w : st.waits)
          DG_CUDA_RETURN(launch_wait_flag(buffers.flag(w.flag), 0, sync, w.peer, on));
        break;
      case StepKind::kGemm: {
        SyncParams waits;
        if (!st.waits.empty()) DG_RETURN_IF_ERROR(gemm_waits(st, plan, buffers, sync, &waits));
        DG_RETURN_IF_ERROR(consumer.run(buffers.gemm(st), st.waits.empty() ? nullptr : &waits, on));
        break;
      }
      case StepKind::kPoison: {
        const TpBuffers::Rows rows = buffers.rows(st.dst);
        DG_CUDA_RETURN(launch_poison_on_error(rows.data, st.dst.rows, rows.cols, rows.pitch, rows.elem_bytes,
                                              buffers.failure_marks(st), sync, on));
        break;
      }
    }
  }
  return DG_SUCCESS;
}

}  // namespace

dg_status plan_and_execute(const dg_tp_desc& d, const Peers& peers, TpShape shape, const TpChoices& choices,
                           cudaStream_t stream) {
  const DeviceInfo& dev = device_info(peers.device);
  const CutlassRingGemm fused(dev.sm_count);
  if (shape.elsewhere)  // only the agreement
    return execute(d, peers, make_plan(shape), elsewhere_dtypes(d.gemm), choices.tag, fused, stream);
  // The decomposed plan first: its GEMMs tell whether cuBLASLt takes the call, and it is the
  // plan that runs when it does (the workspace regions are the same for either algorithm).
  TpShape candidate = shape;
  candidate.decomposed = true;
  candidate.split = decomposed_split(d.settings, choices.decomposed);
  candidate.scale_bias = needs_scaled_bias(d.gemm);
  candidate.agree_only = false;
  const TpPlan decomposed_plan = make_plan(candidate);
  const TpRegions& regions = decomposed_plan.regions;
  DG_REQUIRE(d.agree_only || d.workspace_bytes >= regions.bytes, "the workspace of ", d.workspace_bytes,
             " bytes is smaller than the ", regions.bytes, " needed");
  const CublasLtPieces pieces(dev.arch, peers.base[d.rank] + regions.scratch, kGemmScratchBytes);
  bool decomposed = false;
  DG_RETURN_IF_ERROR(
      use_decomposed(d, unsupported_gemm(d, peers, decomposed_plan, pieces), choices.auto_fused, &decomposed));
  if (decomposed && !shape.agree_only)
    return execute(d, peers, decomposed_plan, choices.dtypes, choices.tag, pieces, stream);
  if (decomposed) {
    candidate.agree_only = true;
    shape = candidate;
  } else {
    shape.split = choices.fused;
  }
  const GemmConsumer& consumer = decomposed ? static_cast<const GemmConsumer&>(pieces) : fused;
  return execute(d, peers, make_plan(shape), choices.dtypes, choices.tag, consumer, stream);
}

}  // namespace distgemm::tp

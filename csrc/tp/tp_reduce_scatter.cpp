// dg_gemm_reduce_scatter: the ring of GEMMs that hides the reduce-scatter of a tensor-parallel
// GEMM under its compute. Host-only.
//
// At step s rank r computes the rows of chunk (r - s - 1) mod P, adding the partial sums rank
// r - 1 computed for the same rows at step s - 1; r - 1 pushes those into r's workspace on the
// copy engine while r computes, so the addition reads local memory. The last step (chunk r)
// writes the output. Fused: each step is a CUTLASS GEMM whose epilogue waits for the pushed
// slot's flag (the GEMMs keep two SMs free for the copy streams' flag kernels). Decomposed: each
// piece of a step (halves by default) is a cuBLASLt GEMM whose C operand is the previous rank's
// pushed piece, after a bounded wait for it on the caller's stream. A call begins by telling
// r - 1 that r's earlier calls are done with the received slots; r - 1 waits for that before
// its first push.
#include <cstdint>

#include "common/device.h"
#include "common/dtype.h"
#include "common/status.h"
#include "common/stream_pool.h"
#include "tp/tp_call.h"
#include "tp/tp_heuristics.h"
#include "tp/tp_kernels.cuh"
#include "tp/tp_layout.h"
#include "distgemm/distgemm.h"
#include "gemm/cublaslt_gemm.h"
#include "gemm/gemm_internal.h"

using namespace distgemm;
using namespace distgemm::tp;

extern "C" dg_status dg_gemm_reduce_scatter(const dg_tp_desc* desc, cudaStream_t stream) {
  Peers peers;
  DG_RETURN_IF_ERROR(check_tp(desc, &peers));
  const int device = peers.device;
  const dg_tp_desc& d = *desc;
  const dg_gemm_desc& g = d.gemm;
  const int r = d.rank, world = d.world;
  const int prev = (r + world - 1) % world, next = (r + 1) % world;
  DG_RETURN_IF_ERROR(check_exchange_size(world, g.d.rows, g.d.cols, g.d.dtype, "out (this rank's shard)"));
  const int64_t m = g.d.rows, n = g.d.cols;
  const size_t in_elem = dtype_bytes(g.a.dtype), out_elem = dtype_bytes(g.d.dtype);
  const ReduceScatterLayout layout(world, m, n, out_elem);
  DG_REQUIRE(m >= 1, "out (this rank's shard) must have at least one row");
  DG_REQUIRE(g.a.rows == m * world, "a must have world * m = ", m * world, " rows, got ", g.a.rows);
  DG_REQUIRE(g.a.col_stride == 1, "a must be row-major");
  DG_REQUIRE(!g.c.data || g.c.rows == 1,
             "c must be a bias row for GEMM + reduce-scatter (add a full C to the output shard)");
  DG_REQUIRE(!g.scale_a || g.scale_a_len == 1 || g.scale_a_len == g.a.rows,
             "scale_a must hold 1 or M = ", g.a.rows, " values");
  DG_REQUIRE(d.agree_only || d.workspace_bytes >= layout.bytes, "the workspace of ", d.workspace_bytes,
             " bytes is smaller than the ", layout.bytes, " needed");

  // Step s computes chunk (r - s - 1) mod P into slot s (the last step into out), in pieces
  // of its rows (tp_heuristics), so that the first piece travels while the next is computed and
  // the next rank's GEMMs wait for a piece, not a whole step.
  const double flops = 2.0 * static_cast<double>(g.a.rows) * n * g.a.cols;
  PieceSplit fused_split, decomposed_split;
  DG_RETURN_IF_ERROR(rs_fused_split(flops / world / 2, &fused_split));
  const double pushed_bytes = static_cast<double>(world - 1) * m * n * out_elem;  // by each rank
  DG_RETURN_IF_ERROR(tp_pieces(rs_decomposed_split(flops, pushed_bytes, m), &decomposed_split));
  bool decomposed = true;  // settled below, once every piece's fit is known
  RowPieces cut(m, fused_split);
  auto plan_pieces = [&] { cut = RowPieces(m, decomposed ? decomposed_split : fused_split); };
  auto slot_at = [&](size_t region, int s, int64_t row) {
    return region + s * layout.slot_bytes + static_cast<size_t>(row * n) * out_elem;
  };
  auto step_desc = [&](int s, int part) {
    const int64_t chunk = (r - s - 1 + 2 * world) % world;
    const int64_t row0 = cut.row0(part), rows = cut.rows(part);
    dg_gemm_desc step = g;
    step.a.data = static_cast<const char*>(g.a.data) +
                  static_cast<size_t>((chunk * m + row0) * g.a.row_stride) * in_elem;
    step.a.rows = rows;
    if (g.scale_a && g.scale_a_len > 1) {
      step.scale_a = g.scale_a + chunk * m + row0;
      step.scale_a_len = rows;
    }
    if (s < world - 1) {
      step.d = {peers.base[r] + slot_at(layout.slots, s, row0), g.d.dtype, rows, n, n, 1};
      step.c = {};  // the bias is added once, at the last step
    } else {
      step.d.data =
          static_cast<const char*>(g.d.data) + static_cast<size_t>(row0 * g.d.row_stride) * out_elem;
      step.d.rows = rows;
    }
    return step;
  };
  // The partial sums step s > 0 adds: what the previous rank pushed for the same rows.
  auto received_at = [&](int s, int part) -> const void* {
    return s > 0 ? peers.base[r] + slot_at(layout.received, s - 1, cut.row0(part)) : nullptr;
  };
  const DeviceInfo& dev = device_info(device);
  plan_pieces();
  const char* why_not = nullptr;
  for (int s = 0; s < world && !why_not; ++s)
    for (int part = 0; part < cut.count && !why_not; ++part)
      why_not = gemm::cublaslt_unsupported(step_desc(s, part), s > 0);
  DG_RETURN_IF_ERROR(use_decomposed(d, why_not, rs_auto_prefers_fused(flops), &decomposed));
  plan_pieces();
  for (int s = 0; s < world; ++s) {
    for (int part = 0; part < cut.count; ++part) {
      const dg_gemm_desc step = step_desc(s, part);
      // Planned before anything is enqueued, as it will run: a failure must not strand the peers.
      if (decomposed) {
        DG_RETURN_IF_ERROR(dg_gemm_check(&step, dev.arch));  // shapes and layouts
        DG_RETURN_IF_ERROR(gemm::plan_cublaslt_gemm(step, received_at(s, part), n, kGemmScratchBytes));
      } else
        DG_RETURN_IF_ERROR(gemm::check_gemm_desc(step, s > 0));
    }
  }
  // What the peers must agree on: the rows and N of the partial sums they push, their dtype, the plan.
  const PieceSplit& split = decomposed ? decomposed_split : fused_split;
  const CallSignature sig = call_signature(DG_TP_GEMM_REDUCE_SCATTER, d, m, n, static_cast<uint32_t>(g.d.dtype),
                                           decomposed, {cut.count, split.tapered});
  CallStart call;
  DG_RETURN_IF_ERROR(start_call(d, peers, kTagReduceScatter, device, stream, sig, &call));
  if (d.agree_only) return check_peers(d, peers, call, stream);
  StreamPool* pool = call.pool;
  const SyncParams& sync = call.sync;
  for (int s = 0; s < world; ++s) {
    for (int part = 0; part < cut.count; ++part) {
      const int64_t row0 = cut.row0(part);
      // Step s > 0 adds what the previous rank computed at step s - 1 for the same rows.
      const uint32_t* received_ready =
          s > 0 ? peers.word(r, TpHeader::kStepReady, (s - 1) * cut.count + part) : nullptr;
      const void* received = received_at(s, part);
      if (decomposed) {
        if (s > 0) DG_CUDA_RETURN(launch_wait_flag(received_ready, 0, sync, prev, stream));
        void* scratch = peers.base[r] + layout.scratch;
        DG_RETURN_IF_ERROR(
            gemm::run_cublaslt_gemm(step_desc(s, part), received, n, scratch, kGemmScratchBytes, stream));
      } else {
        gemm::GemmExtras extras;
        if (s > 0) {
          extras.sync = sync;
          extras.sync.c_ready = received_ready;
          extras.sync.c_peer = prev;
          extras.chain_c = received;
          extras.chain_ldc = n;
          extras.sm_count = dev.sm_count - kFreeSms;  // earlier pushes signal meanwhile
        }
        DG_RETURN_IF_ERROR(gemm::run_gemm_desc(step_desc(s, part), extras, stream));
      }
      if (s == world - 1) continue;
      SignalTargets done{};
      done.flags[done.count++] = peers.word(next, TpHeader::kStepReady, s * cut.count + part);
      DG_RETURN_IF_ERROR(fork_streams(*pool, stream, 1));  // the push waits for this launch only
      // Before the first push: every peer must have begun this call (so the next rank is done
      // reading its received slots in earlier calls) with the same signature.
      if (s == 0 && part == 0) DG_RETURN_IF_ERROR(check_peers(d, peers, call, pool->streams[0]));
      DG_CUDA_RETURN(cudaMemcpyAsync(peers.base[next] + slot_at(layout.received, s, row0),
                                     peers.base[r] + slot_at(layout.slots, s, row0),
                                     static_cast<size_t>(cut.rows(part) * n) * out_elem,
                                     cudaMemcpyDeviceToDevice, pool->streams[0]));
      DG_CUDA_RETURN(launch_signal(done, sync.epoch, pool->streams[0]));
    }
  }
  DG_RETURN_IF_ERROR(join_streams(*pool, stream, 1));
  // A failed call (a peer timed out or disagreed) hands back NaN, never a valid-looking result.
  DG_CUDA_RETURN(launch_poison_on_error(const_cast<void*>(g.d.data), m, n, g.d.row_stride,
                                        static_cast<int>(out_elem), sync.error, stream));
  return DG_SUCCESS;
}

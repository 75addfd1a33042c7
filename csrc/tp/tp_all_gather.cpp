// dg_all_gather_gemm: the order of copies, flags and GEMMs that hides the all-gather of a
// tensor-parallel GEMM under its compute. Host-only.
//
// Rank r of P pushes its shard to every peer's gathered buffer on the copy engine (in the order
// the peers' GEMMs need it), raising that peer's ready flag. Fused: r copies its shard into its
// own gathered buffer before the GEMM (a local copy needs SMs: started under the GEMM it would
// crawl), then one persistent GEMM over the gathered rows starts on r's own shard and waits,
// tile row by tile row, for each peer's shard (Sm90SyncTileScheduler). Decomposed: one cuBLASLt
// GEMM per chunk, the own shard straight from `a` first, then each peer's after a bounded wait
// for its flag on the caller's stream (cuBLAS's kernels beat ours on large bf16 GEMMs). A call
// begins by telling every peer that r's earlier calls are done with r's buffer; a peer waits
// for that before its copies into it.
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

extern "C" dg_status dg_all_gather_gemm(const dg_tp_desc* desc, cudaStream_t stream) {
  Peers peers;
  DG_RETURN_IF_ERROR(check_tp(desc, &peers));
  const int device = peers.device;
  const dg_tp_desc& d = *desc;
  const dg_gemm_desc& g = d.gemm;
  const int r = d.rank, world = d.world;
  DG_RETURN_IF_ERROR(check_exchange_size(world, g.a.rows, g.a.cols, g.a.dtype, "a (this rank's shard)"));
  const int64_t m = g.a.rows, k = g.a.cols, rows = m * world;
  const size_t elem = dtype_bytes(g.a.dtype);
  const AllGatherLayout layout(rows, k, elem);
  DG_REQUIRE(m >= 1, "a (this rank's shard) must have at least one row");
  DG_REQUIRE(g.a.col_stride == 1 && g.a.row_stride >= k, "a must be row-major, got strides (",
             g.a.row_stride, ", ", g.a.col_stride, ")");
  DG_REQUIRE(g.d.rows == rows, "out must have world * m = ", rows, " rows, got ", g.d.rows);
  DG_REQUIRE(d.agree_only || d.workspace_bytes >= layout.bytes, "the workspace of ", d.workspace_bytes,
             " bytes is smaller than the ", layout.bytes, " needed");
  DG_REQUIRE(!g.scale_a || g.scale_a_len == 1 || g.scale_a_len == m,
             "scale_a must hold 1 or m = ", m, " values (this rank's shard)");

  // The GEMM over the gathered rows (fused), or over one chunk of them (decomposed: chunk q's
  // rows of `a` and `out`), checked before anything is enqueued.
  dg_gemm_desc gathered = g;
  gathered.a = {peers.base[r] + layout.gathered, g.a.dtype, rows, k, k, 1};
  if (g.scale_a) {
    gathered.scale_a = reinterpret_cast<const float*>(peers.base[r] + layout.scales);
    gathered.scale_a_len = rows;
  }
  // Rows [row0, row0 + rows) of chunk q: from `a` for the own shard, else from the gathered buffer.
  auto chunk_desc = [&](int q, int64_t row0, int64_t rows) {
    dg_gemm_desc chunk = g;
    if (q != r) {
      const char* shard = peers.base[r] + layout.gathered + static_cast<size_t>((q * m + row0) * k) * elem;
      chunk.a = {shard, g.a.dtype, rows, k, k, 1};
    } else {
      chunk.a.data = static_cast<const char*>(g.a.data) + static_cast<size_t>(row0 * g.a.row_stride) * elem;
      chunk.a.rows = rows;
    }
    chunk.d.data = static_cast<const char*>(g.d.data) +
                   static_cast<size_t>((q * m + row0) * g.d.row_stride) * dtype_bytes(g.d.dtype);
    chunk.d.rows = rows;
    if (g.c.data && g.c.rows != 1) {
      chunk.c.data = static_cast<const char*>(g.c.data) +
                     static_cast<size_t>((q * m + row0) * g.c.row_stride) * dtype_bytes(g.c.dtype);
      chunk.c.rows = rows;
    }
    return chunk;
  };
  const DeviceInfo& dev = device_info(device);
  // Decomposed: a peer's shard travels in pieces, each multiplied as soon as it is in, so that
  // the last GEMM waits for a piece, not a whole shard. Fused: one piece (the kernel waits per
  // tile row anyway).
  const double flops = 2.0 * static_cast<double>(rows) * g.b.rows * k;
  PieceSplit split;
  const double pushed_bytes = static_cast<double>(world - 1) * m * k * elem;  // into each rank
  DG_RETURN_IF_ERROR(tp_pieces(ag_decomposed_split(flops, pushed_bytes), &split));
  RowPieces cut(m, split);
  const int peer = (r + 1) % world;
  const char* why_not = gemm::cublaslt_unsupported(chunk_desc(r, 0, m), false);
  for (int j = 0; j < cut.count && !why_not; ++j)
    why_not = gemm::cublaslt_unsupported(chunk_desc(peer, cut.row0(j), cut.rows(j)), false);
  bool decomposed = false;
  DG_RETURN_IF_ERROR(use_decomposed(d, why_not, false, &decomposed));
  void* scratch = peers.base[r] + layout.scratch;
  if (decomposed) {  // plans made before anything is enqueued: a failure must not strand the peers
    DG_RETURN_IF_ERROR(gemm::plan_cublaslt_gemm(chunk_desc(r, 0, m), nullptr, 0, kGemmScratchBytes));
    for (int j = 0; j < cut.count; ++j)
      DG_RETURN_IF_ERROR(gemm::plan_cublaslt_gemm(chunk_desc(peer, cut.row0(j), cut.rows(j)), nullptr, 0,
                                                  kGemmScratchBytes));
  } else {
    cut = RowPieces(m, {1, false});
  }
  DG_RETURN_IF_ERROR(decomposed ? dg_gemm_check(&gathered, dev.arch) : gemm::check_gemm_desc(gathered, false));
  // What the peers must agree on: the rows and K they push, the dtype and scale mode, the plan.
  const uint32_t dtypes = static_cast<uint32_t>(g.a.dtype) | (g.scale_a ? 1u << 8 : 0u);
  const CallSignature sig = call_signature(DG_TP_ALL_GATHER_GEMM, d, m, k, dtypes, decomposed,
                                           {cut.count, decomposed && split.tapered});
  CallStart call;
  DG_RETURN_IF_ERROR(start_call(d, peers, kTagAllGather, device, stream, sig, &call));
  if (d.agree_only) return check_peers(d, peers, call, stream);
  StreamPool* pool = call.pool;
  const SyncParams& sync = call.sync;
  // FP8 row scales of this shard, into rank q's gathered scales (a peer's after it began).
  auto scatter_scales = [&](int q, cudaStream_t on) {
    ScaleTargets targets{};
    targets.dst[targets.count++] = reinterpret_cast<float*>(peers.base[q] + layout.scales) + r * m;
    return launch_scatter_scales(g.scale_a, g.scale_a_len, m, targets, on);
  };
  if (g.scale_a) DG_CUDA_RETURN(scatter_scales(r, stream));
  // Every peer gets the shard in the order they need it: the GEMMs of rank p walk chunks p,
  // p + 1, ..., so rank r is needed first by r - 1, then r - 2.
  const size_t shard_bytes = static_cast<size_t>(m * k) * elem;
  const size_t shard_offset = layout.gathered + static_cast<size_t>(r * m * k) * elem;
  // Rows [row0, row0 + rows) of the shard to dst (the shard's first row there).
  auto copy_rows = [&](char* dst, int64_t row0, int64_t rows, cudaStream_t on) {
    dst += static_cast<size_t>(row0 * k) * elem;
    const char* src = static_cast<const char*>(g.a.data) + static_cast<size_t>(row0 * g.a.row_stride) * elem;
    if (g.a.row_stride == k)  // one DMA: a 2-D copy of many short rows runs far slower
      return cudaMemcpyAsync(dst, src, static_cast<size_t>(rows * k) * elem, cudaMemcpyDeviceToDevice, on);
    return cudaMemcpy2DAsync(dst, k * elem, src, g.a.row_stride * elem, k * elem, rows,
                             cudaMemcpyDeviceToDevice, on);
  };
  const int streams = 1;
  DG_RETURN_IF_ERROR(fork_streams(*pool, stream, streams));
  cudaStream_t push = pool->streams[0];
  // Every peer must have begun this call (so it is done reading its buffer in earlier calls) with
  // the same signature before anything is written into it.
  DG_RETURN_IF_ERROR(check_peers(d, peers, call, push));
  for (int i = 1; i < world; ++i) {
    const int p = (r - i + world) % world;
    if (g.scale_a) DG_CUDA_RETURN(scatter_scales(p, push));
    for (int j = 0; j < cut.count; ++j) {
      DG_CUDA_RETURN(copy_rows(peers.base[p] + shard_offset, cut.row0(j), cut.rows(j), push));
      SignalTargets ready{};
      ready.flags[ready.count++] = peers.word(p, TpHeader::kReady, r * cut.count + j);
      DG_CUDA_RETURN(launch_signal(ready, sync.epoch, push));
    }
  }
  if (decomposed) {
    DG_RETURN_IF_ERROR(
        gemm::run_cublaslt_gemm(chunk_desc(r, 0, m), nullptr, 0, scratch, kGemmScratchBytes, stream));
    for (int i = 1; i < world; ++i) {
      const int q = (r + i) % world;  // q's shard arrives after those of q - 1, ..., r + 1
      for (int j = 0; j < cut.count; ++j) {
        DG_CUDA_RETURN(
            launch_wait_flag(peers.word(r, TpHeader::kReady, q * cut.count + j), 0, sync, q, stream));
        DG_RETURN_IF_ERROR(gemm::run_cublaslt_gemm(chunk_desc(q, cut.row0(j), cut.rows(j)), nullptr, 0,
                                                   scratch, kGemmScratchBytes, stream));
      }
    }
  } else {
    // The own shard on the caller's stream: started under the GEMM, a local copy would crawl.
    DG_CUDA_RETURN(copy_rows(peers.base[r] + shard_offset, 0, m, stream));
    SignalTargets own_ready{};
    own_ready.flags[own_ready.count++] = peers.word(r, TpHeader::kReady, r);
    DG_CUDA_RETURN(launch_signal(own_ready, sync.epoch, stream));
    gemm::GemmExtras extras;
    extras.sync = sync;
    extras.sync.chunk_ready = peers.word(r, TpHeader::kReady);
    extras.sync.chunk_rows = static_cast<int32_t>(m);
    extras.sync.num_chunks = world;
    extras.sync.first_chunk = r;
    extras.sm_count = dev.sm_count - kFreeSms;
    DG_RETURN_IF_ERROR(gemm::run_gemm_desc(gathered, extras, stream));
  }
  if (d.gathered_out) {
    char* out = static_cast<char*>(d.gathered_out);
    if (decomposed) {  // the own shard never entered the gathered buffer
      DG_CUDA_RETURN(copy_rows(out + static_cast<size_t>(r * m * k) * elem, 0, m, stream));
      const size_t before = static_cast<size_t>(r * m * k) * elem,
                   after = static_cast<size_t>((rows - (r + 1) * m) * k) * elem;
      if (before)
        DG_CUDA_RETURN(cudaMemcpyAsync(out, gathered.a.data, before, cudaMemcpyDeviceToDevice, stream));
      if (after)
        DG_CUDA_RETURN(cudaMemcpyAsync(out + before + shard_bytes,
                                       static_cast<const char*>(gathered.a.data) + before + shard_bytes,
                                       after, cudaMemcpyDeviceToDevice, stream));
    } else {
      DG_CUDA_RETURN(cudaMemcpyAsync(out, gathered.a.data, static_cast<size_t>(rows * k) * elem,
                                     cudaMemcpyDeviceToDevice, stream));
    }
  }
  DG_RETURN_IF_ERROR(join_streams(*pool, stream, streams));
  // A failed call (a peer timed out or disagreed) hands back NaN, never a valid-looking result.
  DG_CUDA_RETURN(launch_poison_on_error(g.d.data ? const_cast<void*>(g.d.data) : nullptr, rows, g.d.cols,
                                        g.d.row_stride, static_cast<int>(dtype_bytes(g.d.dtype)), sync.error,
                                        stream));
  if (d.gathered_out)
    DG_CUDA_RETURN(launch_poison_on_error(d.gathered_out, rows, k, k, static_cast<int>(elem), sync.error, stream));
  return DG_SUCCESS;
}


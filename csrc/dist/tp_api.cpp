// dg_all_gather_gemm / dg_gemm_reduce_scatter: the order of copies, flags and GEMMs that hides
// a tensor-parallel GEMM's communication under its compute. Host-only.
//
// All-gather + GEMM (rank r of P): r copies its shard into its own gathered buffer before the
// GEMM (a local copy needs SMs: started under the GEMM it would crawl) and pushes it to every
// peer's buffer on the copy engine, raising that peer's ready flag. One persistent GEMM over the
// gathered rows starts on r's own shard and waits, tile row by tile row, for each peer's shard
// (Sm90SyncTileScheduler). After the GEMM, r tells every peer that its buffer is free again; a
// peer waits for that before its next copy into it.
//
// GEMM + reduce-scatter (ring): at step s rank r computes the rows of chunk (r - s - 1) mod P,
// adding (in the epilogue) the partial sums rank r - 1 computed for the same rows at step s - 1;
// r - 1 pushes those into r's workspace on the copy engine while r computes step s, so the
// epilogue reads local memory. The last step (chunk r) writes the output. Steps are separate
// launches; a step's epilogue waits for the pushed slot's flag.
//
// The fused GEMMs keep two SMs free for the copy streams' flag kernels, which must run while
// they spin.
//
// The decomposed algorithm (dg_tp_algo) keeps the copies, flags and ring order, but runs one
// cuBLASLt GEMM per chunk (all-gather: the own shard straight from `a` first, then each peer's
// after a bounded wait for its flag on the caller's stream) or per half ring step
// (reduce-scatter: the wait for the previous rank's half precedes the GEMM that adds it; the
// other half's GEMM runs meanwhile). cuBLAS's kernels are faster than ours on large bf16 GEMMs,
// and the caller's stream only waits where the data is not there yet.
#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "common/device.h"
#include "common/dtype.h"
#include "common/error_state.h"
#include "common/status.h"
#include "common/stream_pool.h"
#include "dist/tp_kernels.cuh"
#include "dist/tp_layout.h"
#include "distgemm/distgemm.h"
#include "gemm/cublaslt_gemm.h"
#include "gemm/gemm_internal.h"

namespace distgemm::dist {
namespace {

constexpr int kTagAllGather = DG_TP_ALL_GATHER_GEMM << kErrorPeerBits;
constexpr int kTagReduceScatter = DG_TP_GEMM_REDUCE_SCATTER << kErrorPeerBits;
constexpr int kFreeSms = 2;  // left to the copy streams' flag kernels while a GEMM spins
constexpr int64_t kPartRowAlign = 128;  // reduce-scatter steps split at a tile-row boundary
constexpr double kDecomposedMinRsFlops = 100e9;  // smaller reduce-scatters run fused by default

// Every rank's workspace as mapped in this process.
struct Peers {
  char* base[kMaxWorld] = {};
  uint32_t* word(int rank, size_t offset, int index = 0) const {
    return reinterpret_cast<uint32_t*>(base[rank] + offset) + index;
  }
};

dg_status check_tp(const dg_tp_desc* d, Peers* peers) {
  DG_REQUIRE(d != nullptr, "desc must not be NULL");
  DG_REQUIRE(d->world >= 2 && d->world <= kMaxWorld, "world size must be in [2, ", kMaxWorld,
             "], got ", d->world);
  DG_REQUIRE(d->rank >= 0 && d->rank < d->world, "rank ", d->rank, " is out of range for world size ",
             d->world);
  DG_REQUIRE(d->peer_workspaces != nullptr, "peer_workspaces must not be NULL");
  DG_REQUIRE(d->timeout_s > 0, "timeout_s must be positive, got ", d->timeout_s);
  for (int r = 0; r < d->world; ++r) {
    DG_REQUIRE(d->peer_workspaces[r] != nullptr &&
                   (reinterpret_cast<uintptr_t>(d->peer_workspaces[r]) & 255u) == 0,
               "the workspace of rank ", r, " must be a 256-byte aligned device pointer");
    peers->base[r] = static_cast<char*>(d->peer_workspaces[r]);
  }
  return DG_SUCCESS;
}

// What every call needs once its arguments are checked: the device's side streams and the
// parameters of its bounded waits; the call's epoch is bumped first on `stream`.
struct CallStart {
  StreamPool* pool = nullptr;
  SyncParams sync;
};

dg_status start_call(const dg_tp_desc& d, const Peers& peers, int tag, int device, cudaStream_t stream,
                     CallStart* out) {
  const ErrorState* err = error_state(device);
  out->pool = stream_pool(device);
  if (!err || !out->pool) return DG_ERROR_CUDA;
  SyncParams& s = out->sync;
  s.epoch = peers.word(d.rank, TpHeader::kEpoch);
  s.timeout_ns = static_cast<uint64_t>(d.timeout_s * 1e9);
  s.error = err->device_word;
  s.error_host = err->host_word_device;
  s.error_tag = tag;
  DG_CUDA_RETURN(launch_bump_epoch(peers.word(d.rank, TpHeader::kEpoch), stream));
  return DG_SUCCESS;
}

// The smallest half of a reduce-scatter step worth its own launch, in FLOPs (see
// dg_gemm_reduce_scatter); DISTGEMM_RS_SPLIT_GFLOPS overrides it (the tests force halves).
dg_status split_min_flops(double* flops) {
  const char* v = std::getenv("DISTGEMM_RS_SPLIT_GFLOPS");
  double gflops = 25.0;
  if (v && *v) {
    char* end = nullptr;
    gflops = std::strtod(v, &end);
    DG_REQUIRE(*end == '\0' && gflops >= 0.0,
               "DISTGEMM_RS_SPLIT_GFLOPS must be a non-negative number of GFLOP, got '", v, "'");
  }
  *flops = gflops * 1e9;
  return DG_SUCCESS;
}

// Whether to run the decomposed algorithm: `why_not` is why cuBLASLt cannot run a piece of
// this call (nullptr if it can); `auto_fused`: the automatic choice is the fused algorithm
// even though the decomposed one could run.
dg_status use_decomposed(const dg_tp_desc& d, const char* why_not, bool auto_fused, bool* decomposed) {
  DG_REQUIRE(d.algo == DG_TP_ALGO_AUTO || d.algo == DG_TP_ALGO_FUSED || d.algo == DG_TP_ALGO_DECOMPOSED,
             "algo must be DG_TP_ALGO_AUTO, _FUSED or _DECOMPOSED, got ", static_cast<int>(d.algo));
  if (d.algo == DG_TP_ALGO_DECOMPOSED && why_not)
    return fail(DG_ERROR_NOT_SUPPORTED, cat("the decomposed algorithm does not take ", why_not));
  *decomposed = !why_not && (d.algo == DG_TP_ALGO_DECOMPOSED || (d.algo == DG_TP_ALGO_AUTO && !auto_fused));
  return DG_SUCCESS;
}

size_t all_gather_bytes(const dg_tp_desc& d) {
  return AllGatherLayout(d.gemm.a.rows * d.world, d.gemm.a.cols, dtype_bytes(d.gemm.a.dtype)).bytes;
}

size_t reduce_scatter_bytes(const dg_tp_desc& d) {
  return ReduceScatterLayout(d.world, d.gemm.d.rows, d.gemm.d.cols, dtype_bytes(d.gemm.d.dtype)).bytes;
}

}  // namespace
}  // namespace distgemm::dist

using namespace distgemm;
using namespace distgemm::dist;

extern "C" dg_status dg_tp_workspace_size(dg_tp_kind kind, const dg_tp_desc* desc, size_t* bytes) {
  DG_REQUIRE(desc != nullptr && bytes != nullptr, "desc and bytes must not be NULL");
  DG_REQUIRE(kind == DG_TP_ALL_GATHER_GEMM || kind == DG_TP_GEMM_REDUCE_SCATTER,
             "kind must be DG_TP_ALL_GATHER_GEMM or DG_TP_GEMM_REDUCE_SCATTER");
  DG_REQUIRE(desc->world >= 2 && desc->world <= kMaxWorld, "world size must be in [2, ", kMaxWorld, "]");
  *bytes = kind == DG_TP_ALL_GATHER_GEMM ? all_gather_bytes(*desc) : reduce_scatter_bytes(*desc);
  return DG_SUCCESS;
}

extern "C" dg_status dg_all_gather_gemm(const dg_tp_desc* desc, cudaStream_t stream) {
  Peers peers;
  DG_RETURN_IF_ERROR(check_tp(desc, &peers));
  const dg_tp_desc& d = *desc;
  const dg_gemm_desc& g = d.gemm;
  const int r = d.rank, world = d.world;
  const int64_t m = g.a.rows, k = g.a.cols, rows = m * world;
  const size_t elem = dtype_bytes(g.a.dtype);
  const AllGatherLayout layout(rows, k, elem);
  DG_REQUIRE(m >= 1, "a (this rank's shard) must have at least one row");
  DG_REQUIRE(g.a.col_stride == 1 && g.a.row_stride >= k, "a must be row-major, got strides (",
             g.a.row_stride, ", ", g.a.col_stride, ")");
  DG_REQUIRE(g.d.rows == rows, "out must have world * m = ", rows, " rows, got ", g.d.rows);
  DG_REQUIRE(d.workspace_bytes >= layout.bytes, "the workspace of ", d.workspace_bytes,
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
  auto chunk_desc = [&](int q) {
    dg_gemm_desc chunk = g;
    if (q != r) chunk.a = {peers.base[r] + layout.gathered + static_cast<size_t>(q * m * k) * elem, g.a.dtype, m, k, k, 1};
    chunk.d.data = static_cast<const char*>(g.d.data) + static_cast<size_t>(q * m * g.d.row_stride) * dtype_bytes(g.d.dtype);
    chunk.d.rows = m;
    if (g.c.data && g.c.rows != 1) {
      chunk.c.data = static_cast<const char*>(g.c.data) + static_cast<size_t>(q * m * g.c.row_stride) * dtype_bytes(g.c.dtype);
      chunk.c.rows = m;
    }
    return chunk;
  };
  const int device = current_device();
  const DeviceInfo& dev = device_info(device);
  bool decomposed = false;
  const char* why_not = gemm::cublaslt_unsupported(chunk_desc(r), false);
  if (!why_not) why_not = gemm::cublaslt_unsupported(chunk_desc((r + 1) % world), false);
  DG_RETURN_IF_ERROR(use_decomposed(d, why_not, false, &decomposed));
  DG_RETURN_IF_ERROR(dg_gemm_check(&gathered, dev.arch));
  CallStart call;
  DG_RETURN_IF_ERROR(start_call(d, peers, kTagAllGather, device, stream, &call));
  StreamPool* pool = call.pool;
  const SyncParams& sync = call.sync;
  if (g.scale_a) {
    ScaleTargets targets{};
    for (int q = 0; q < world; ++q)
      targets.dst[targets.count++] = reinterpret_cast<float*>(peers.base[q] + layout.scales) + r * m;
    DG_CUDA_RETURN(launch_scatter_scales(g.scale_a, g.scale_a_len, m, targets, stream));
  }
  // Every peer gets the shard in the order they need it: the GEMMs of rank p walk chunks p,
  // p + 1, ..., so rank r is needed first by r - 1, then r - 2.
  const size_t shard_bytes = static_cast<size_t>(m * k) * elem;
  const size_t shard_offset = layout.gathered + static_cast<size_t>(r * m * k) * elem;
  auto copy_shard = [&](char* dst, cudaStream_t on) {
    if (g.a.row_stride == k)  // one DMA: a 2-D copy of many short rows runs far slower
      return cudaMemcpyAsync(dst, g.a.data, shard_bytes, cudaMemcpyDeviceToDevice, on);
    return cudaMemcpy2DAsync(dst, k * elem, g.a.data, g.a.row_stride * elem, k * elem, m,
                             cudaMemcpyDeviceToDevice, on);
  };
  const int streams = 1;
  DG_RETURN_IF_ERROR(fork_streams(*pool, stream, streams));
  cudaStream_t push = pool->streams[0];
  for (int i = 1; i < world; ++i) {
    const int p = (r - i + world) % world;
    // p must be done reading its buffer from the previous call.
    DG_CUDA_RETURN(launch_wait_flag(peers.word(r, TpHeader::kConsumed, p), -1, sync, p, push));
    DG_CUDA_RETURN(copy_shard(peers.base[p] + shard_offset, push));
    SignalTargets ready{};
    ready.flags[ready.count++] = peers.word(p, TpHeader::kReady, r);
    DG_CUDA_RETURN(launch_signal(ready, sync.epoch, push));
  }
  if (decomposed) {
    void* scratch = peers.base[r] + layout.scratch;
    for (int i = 0; i < world; ++i) {
      const int q = (r + i) % world;  // q's shard arrives after those of q - 1, ..., r + 1
      if (i > 0) DG_CUDA_RETURN(launch_wait_flag(peers.word(r, TpHeader::kReady, q), 0, sync, q, stream));
      DG_RETURN_IF_ERROR(gemm::run_cublaslt_gemm(chunk_desc(q), nullptr, 0, scratch, kGemmScratchBytes, stream));
    }
  } else {
    // The own shard on the caller's stream: started under the GEMM, a local copy would crawl.
    DG_CUDA_RETURN(copy_shard(peers.base[r] + shard_offset, stream));
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
      DG_CUDA_RETURN(copy_shard(out + static_cast<size_t>(r * m * k) * elem, stream));
      const size_t before = static_cast<size_t>(r * m * k) * elem, after = static_cast<size_t>((rows - (r + 1) * m) * k) * elem;
      if (before)
        DG_CUDA_RETURN(cudaMemcpyAsync(out, gathered.a.data, before, cudaMemcpyDeviceToDevice, stream));
      if (after)
        DG_CUDA_RETURN(cudaMemcpyAsync(out + before + shard_bytes, static_cast<const char*>(gathered.a.data) + before + shard_bytes,
                                       after, cudaMemcpyDeviceToDevice, stream));
    } else {
      DG_CUDA_RETURN(cudaMemcpyAsync(out, gathered.a.data, static_cast<size_t>(rows * k) * elem,
                                     cudaMemcpyDeviceToDevice, stream));
    }
  }
  SignalTargets consumed{};
  for (int p = 0; p < world; ++p)
    if (p != r) consumed.flags[consumed.count++] = peers.word(p, TpHeader::kConsumed, r);
  DG_CUDA_RETURN(launch_signal(consumed, sync.epoch, stream));
  return join_streams(*pool, stream, streams);
}

extern "C" dg_status dg_gemm_reduce_scatter(const dg_tp_desc* desc, cudaStream_t stream) {
  Peers peers;
  DG_RETURN_IF_ERROR(check_tp(desc, &peers));
  const dg_tp_desc& d = *desc;
  const dg_gemm_desc& g = d.gemm;
  const int r = d.rank, world = d.world;
  const int prev = (r + world - 1) % world, next = (r + 1) % world;
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
  DG_REQUIRE(d.workspace_bytes >= layout.bytes, "the workspace of ", d.workspace_bytes,
             " bytes is smaller than the ", layout.bytes, " needed");

  // Step s computes chunk (r - s - 1) mod P into slot s (the last step into out). A large step
  // runs as two launches over the halves of its rows, so the first half travels while the
  // second is computed and the next rank's first epilogues wait for half the bytes, not all of
  // them; a small one stays whole, where the extra launches would cost more host time than the
  // wait they save (measured on H200: halves of under ~25 GFLOP lose). The decomposed
  // algorithm always splits: its GEMMs wait for their whole C operand before they start.
  const double half_flops = static_cast<double>(m) * static_cast<double>(n) * g.a.cols;
  double min_half_flops = 0.0;
  DG_RETURN_IF_ERROR(split_min_flops(&min_half_flops));
  bool decomposed = true;  // settled below, once every piece's fit is known
  int parts = 1;
  int64_t split = m;
  auto plan_parts = [&] {
    const bool halves = m >= 2 * kPartRowAlign && (decomposed || half_flops >= min_half_flops) &&
                        (world - 1) * 2 <= kMaxWorld;
    parts = halves ? 2 : 1;
    split = halves ? (m / 2 + kPartRowAlign - 1) / kPartRowAlign * kPartRowAlign : m;
  };
  auto part_row0 = [&](int part) { return part == 0 ? int64_t{0} : split; };
  auto part_rows = [&](int part) { return part == 0 ? split : m - split; };
  auto slot_at = [&](size_t region, int s, int64_t row) {
    return region + s * layout.slot_bytes + static_cast<size_t>(row * n) * out_elem;
  };
  auto step_desc = [&](int s, int part) {
    const int64_t chunk = (r - s - 1 + 2 * world) % world;
    const int64_t row0 = part_row0(part), rows = part_rows(part);
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
      step.d.data = static_cast<const char*>(g.d.data) + static_cast<size_t>(row0 * g.d.row_stride) * out_elem;
      step.d.rows = rows;
    }
    return step;
  };
  const int device = current_device();
  const DeviceInfo& dev = device_info(device);
  plan_parts();
  const char* why_not = nullptr;
  for (int s = 0; s < world && !why_not; ++s)
    for (int part = 0; part < parts && !why_not; ++part) why_not = gemm::cublaslt_unsupported(step_desc(s, part), s > 0);
  // Below ~100 GFLOP per rank, the decomposed ring's four launches and waits cost more than the
  // fused ring's tile-level overlap saves (measured on H200 x2: 8B attn-out, 4096 tokens, 0.21 vs
  // 0.16 ms; from 137 GFLOP on, decomposed is as fast or faster).
  const bool small = 2.0 * static_cast<double>(g.a.rows) * n * g.a.cols < kDecomposedMinRsFlops;
  DG_RETURN_IF_ERROR(use_decomposed(d, why_not, small, &decomposed));
  plan_parts();
  for (int s = 0; s < world; ++s) {
    for (int part = 0; part < parts; ++part) {
      const dg_gemm_desc step = step_desc(s, part);
      DG_RETURN_IF_ERROR(dg_gemm_check(&step, dev.arch));
    }
  }
  CallStart call;
  DG_RETURN_IF_ERROR(start_call(d, peers, kTagReduceScatter, device, stream, &call));
  StreamPool* pool = call.pool;
  const SyncParams& sync = call.sync;
  // The next rank must be done reading the partial sums of our previous call.
  DG_CUDA_RETURN(launch_wait_flag(peers.word(r, TpHeader::kConsumed, next), -1, sync, next, stream));
  for (int s = 0; s < world; ++s) {
    for (int part = 0; part < parts; ++part) {
      const int64_t row0 = part_row0(part);
      // Step s > 0 adds what the previous rank computed at step s - 1 for the same rows.
      const uint32_t* received_ready = s > 0 ? peers.word(r, TpHeader::kStepReady, (s - 1) * parts + part) : nullptr;
      const void* received = s > 0 ? peers.base[r] + slot_at(layout.received, s - 1, row0) : nullptr;
      if (decomposed) {
        if (s > 0) DG_CUDA_RETURN(launch_wait_flag(received_ready, 0, sync, prev, stream));
        DG_RETURN_IF_ERROR(gemm::run_cublaslt_gemm(step_desc(s, part), received, n,
                                                   peers.base[r] + layout.scratch, kGemmScratchBytes, stream));
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
      done.flags[done.count++] = peers.word(next, TpHeader::kStepReady, s * parts + part);
      DG_RETURN_IF_ERROR(fork_streams(*pool, stream, 1));  // the push waits for this launch only
      DG_CUDA_RETURN(cudaMemcpyAsync(peers.base[next] + slot_at(layout.received, s, row0),
                                     peers.base[r] + slot_at(layout.slots, s, row0),
                                     static_cast<size_t>(part_rows(part) * n) * out_elem,
                                     cudaMemcpyDeviceToDevice, pool->streams[0]));
      DG_CUDA_RETURN(launch_signal(done, sync.epoch, pool->streams[0]));
    }
  }
  DG_RETURN_IF_ERROR(join_streams(*pool, stream, 1));
  SignalTargets consumed{};
  consumed.flags[consumed.count++] = peers.word(prev, TpHeader::kConsumed, r);
  DG_CUDA_RETURN(launch_signal(consumed, sync.epoch, stream));
  return DG_SUCCESS;
}

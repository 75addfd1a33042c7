#include "dist/tp_call.h"

#include <algorithm>
#include <cstdlib>
#include <string_view>

#include "common/dtype.h"
#include "common/status.h"
#include "dist/tp_kernels.cuh"

namespace distgemm::dist {

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

dg_status start_call(const dg_tp_desc& d, const Peers& peers, int tag, int device, cudaStream_t stream,
                     const SignalTargets& started, CallStart* out) {
  const ErrorState* err = error_state(device);
  out->pool = stream_pool(device);
  if (!err || !out->pool) return DG_ERROR_CUDA;
  SyncParams& s = out->sync;
  s.epoch = peers.word(d.rank, TpHeader::kEpoch);
  s.timeout_ns = static_cast<uint64_t>(d.timeout_s * 1e9);
  s.error = err->device_word;
  s.error_host = err->host_word_device;
  s.error_tag = tag;
  DG_CUDA_RETURN(launch_begin_call(peers.word(d.rank, TpHeader::kEpoch), started, stream));
  return DG_SUCCESS;
}

dg_status use_decomposed(const dg_tp_desc& d, const char* why_not, bool auto_fused, bool* decomposed) {
  DG_REQUIRE(d.algo == DG_TP_ALGO_AUTO || d.algo == DG_TP_ALGO_FUSED || d.algo == DG_TP_ALGO_DECOMPOSED,
             "algo must be DG_TP_ALGO_AUTO, _FUSED or _DECOMPOSED, got ", static_cast<int>(d.algo));
  if (d.algo == DG_TP_ALGO_DECOMPOSED && why_not)
    return fail(DG_ERROR_NOT_SUPPORTED, cat("the decomposed algorithm does not take ", why_not));
  *decomposed = !why_not && (d.algo == DG_TP_ALGO_DECOMPOSED || (d.algo == DG_TP_ALGO_AUTO && !auto_fused));
  return DG_SUCCESS;
}

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

dg_status tp_pieces(PieceSplit automatic, PieceSplit* split) {
  *split = automatic;
  const char* v = std::getenv("DISTGEMM_TP_PIECES");
  if (!v || !*v || std::string_view(v) == "auto") return DG_SUCCESS;
  char* end = nullptr;
  const long count = std::strtol(v, &end, 10);
  const bool tapered = *end == 't';
  DG_REQUIRE(end != v && (*end == '\0' || (tapered && end[1] == '\0')) && count >= 1 && count <= kMaxPieces,
             "DISTGEMM_TP_PIECES must be 'auto', N or Nt (tapered) with N in [1, ", kMaxPieces, "], got '", v,
             "'");
  *split = {static_cast<int>(count), tapered};
  return DG_SUCCESS;
}

}  // namespace distgemm::dist

using namespace distgemm;
using namespace distgemm::dist;

namespace {

size_t all_gather_bytes(const dg_tp_desc& d) {
  return AllGatherLayout(d.gemm.a.rows * d.world, d.gemm.a.cols, dtype_bytes(d.gemm.a.dtype)).bytes;
}

size_t reduce_scatter_bytes(const dg_tp_desc& d) {
  return ReduceScatterLayout(d.world, d.gemm.d.rows, d.gemm.d.cols, dtype_bytes(d.gemm.d.dtype)).bytes;
}

}  // namespace

extern "C" dg_status dg_tp_workspace_size(dg_tp_kind kind, const dg_tp_desc* desc, size_t* bytes) {
  DG_REQUIRE(desc != nullptr && bytes != nullptr, "desc and bytes must not be NULL");
  DG_REQUIRE(kind == DG_TP_ALL_GATHER_GEMM || kind == DG_TP_GEMM_REDUCE_SCATTER,
             "kind must be DG_TP_ALL_GATHER_GEMM or DG_TP_GEMM_REDUCE_SCATTER");
  DG_REQUIRE(desc->world >= 2 && desc->world <= kMaxWorld, "world size must be in [2, ", kMaxWorld, "]");
  *bytes = kind == DG_TP_ALL_GATHER_GEMM ? all_gather_bytes(*desc) : reduce_scatter_bytes(*desc);
  return DG_SUCCESS;
}

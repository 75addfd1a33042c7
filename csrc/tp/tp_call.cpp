#include "tp/tp_call.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string_view>

#include "common/checked_math.h"
#include "common/device.h"
#include "common/dtype.h"
#include "common/status.h"
#include "tp/tp_kernels.cuh"

namespace distgemm::tp {

dg_status check_tp(const dg_tp_desc* d, Peers* peers) {
  DG_REQUIRE(d != nullptr, "desc must not be NULL");
  DG_REQUIRE(d->world >= 2 && d->world <= kMaxWorld, "world size must be in [2, ", kMaxWorld,
             "], got ", d->world);
  DG_REQUIRE(d->rank >= 0 && d->rank < d->world, "rank ", d->rank, " is out of range for world size ",
             d->world);
  DG_REQUIRE(d->peer_workspaces != nullptr, "peer_workspaces must not be NULL");
  DG_REQUIRE(std::isfinite(d->timeout_s) && d->timeout_s > 0,
             "timeout_s must be a finite positive number of seconds, got ", d->timeout_s);
  for (int r = 0; r < d->world; ++r) {
    DG_REQUIRE(d->peer_workspaces[r] != nullptr &&
                   (reinterpret_cast<uintptr_t>(d->peer_workspaces[r]) & 255u) == 0,
               "the workspace of rank ", r, " must be a 256-byte aligned device pointer");
    peers->base[r] = static_cast<char*>(d->peer_workspaces[r]);
  }
  peers->device = current_device();
  return check_no_earlier_failure(peers->device);
}

namespace {

const char* op_name(int tag) {
  return tag == kTagAllGather ? "all-gather + GEMM" : tag == kTagReduceScatter ? "GEMM + reduce-scatter"
                                                                               : "tensor-parallel call";
}

const char* reason_text(int reason) {
  switch (reason) {
    case kReasonOutOfStep: return "is at another call (the ranks' call counts differ: an earlier call failed or "
                                  "was skipped on one side)";
    case kReasonPlan: return "runs another op, algorithm or piece split (DISTGEMM_TP_ALGO, DISTGEMM_TP_PIECES "
                             "and DISTGEMM_RS_SPLIT_GFLOPS must match on every rank)";
    case kReasonRows: return "passed another number of rows";
    case kReasonWidth: return "passed another K (all-gather) or N (reduce-scatter)";
    case kReasonDtypes: return "passed other dtypes or FP8 scale modes";
    case kReasonWorld: return "has another group size";
  }
  return "disagrees";
}

}  // namespace

dg_status check_no_earlier_failure(int device) {
  const ErrorState* err = error_state(device);
  if (!err) return DG_ERROR_CUDA;
  const int code = *reinterpret_cast<const volatile int*>(err->host_word);
  if (code == 0) return DG_SUCCESS;
  const int reason = code >> kErrorReasonShift;
  const int tag = code & (0xff << kErrorPeerBits);
  const int peer = (code & ((1 << kErrorPeerBits) - 1)) - 1;
  if (reason == kReasonTimeout)
    return fail(DG_ERROR_TIMEOUT, cat("a ", op_name(tag), " on device ", device, " waited past its timeout for rank ",
                                      peer, ", which never arrived (died, hung, or was not in the call); the "
                                      "outputs of that call were filled with NaN. The group must be re-synchronised "
                                      "(dg_tp_clear_error on every rank, and new workspaces) before the next call"));
  return fail(DG_ERROR_PEER_MISMATCH,
              cat("the ranks disagree: in a ", op_name(tag), " on device ", device, " rank ", peer, " ",
                  reason_text(reason), "; the outputs of that call were filled with NaN. The group must be "
                  "re-synchronised (dg_tp_clear_error on every rank, and new workspaces) before the next call"));
}

dg_status start_call(const dg_tp_desc& d, const Peers& peers, int tag, int device, cudaStream_t stream,
                     const CallSignature& sig, CallStart* out) {
  const ErrorState* err = error_state(device);
  out->pool = stream_pool(device);
  if (!err || !out->pool) return DG_ERROR_CUDA;
  SyncParams& s = out->sync;
  s.epoch = peers.word(d.rank, TpHeader::kEpoch);
  // The largest timeout a uint64 of nanoseconds holds (~584 years) bounds what the clock can count.
  s.timeout_ns = d.timeout_s >= 1.8e10 ? UINT64_MAX : static_cast<uint64_t>(d.timeout_s * 1e9);
  s.error = err->device_word;
  s.error_host = err->host_word_device;
  s.error_tag = tag;
  out->sig = sig;
  PeerTargets targets{};
  for (int p = 0; p < d.world; ++p) {
    if (p == d.rank) continue;
    targets.started[targets.count] = peers.word(p, TpHeader::kConsumed, d.rank);
    targets.sig_slots[targets.count++] = peers.signature(p, d.rank);
  }
  DG_CUDA_RETURN(launch_begin_call(peers.word(d.rank, TpHeader::kEpoch), targets, sig, stream));
  return DG_SUCCESS;
}

dg_status check_peers(const dg_tp_desc& d, const Peers& peers, const CallStart& call, cudaStream_t stream) {
  PeerChecks checks{};
  // Nearest peers first: they are the first this rank exchanges with.
  for (int i = 1; i < d.world; ++i) {
    const int p = (d.rank + i) % d.world;
    checks.started[checks.count] = peers.word(d.rank, TpHeader::kConsumed, p);
    checks.sig[checks.count] = peers.signature(d.rank, p);
    checks.rank[checks.count++] = p;
  }
  DG_CUDA_RETURN(launch_check_peers(checks, call.sig, call.sync, stream));
  return DG_SUCCESS;
}

CallSignature call_signature(dg_tp_kind kind, const dg_tp_desc& d, int64_t rows, int64_t width,
                             uint32_t dtypes, bool decomposed, const PieceSplit& split) {
  CallSignature sig;
  sig.words[CallSignature::kPlan] = static_cast<uint32_t>(kind) | (decomposed ? 1u << 4 : 0u) |
                                    static_cast<uint32_t>(split.count) << 8 | (split.tapered ? 1u << 12 : 0u);
  sig.words[CallSignature::kRows] = static_cast<uint32_t>(rows);
  sig.words[CallSignature::kRowsHigh] = static_cast<uint32_t>(static_cast<uint64_t>(rows) >> 32);
  sig.words[CallSignature::kWidth] = static_cast<uint32_t>(width);
  sig.words[CallSignature::kDtypes] = dtypes;
  sig.words[CallSignature::kWorld] = static_cast<uint32_t>(d.world);
  return sig;
}

dg_status use_decomposed(const dg_tp_desc& d, const char* why_not, bool auto_fused, bool* decomposed) {
  DG_REQUIRE(d.algo == DG_TP_ALGO_AUTO || d.algo == DG_TP_ALGO_FUSED || d.algo == DG_TP_ALGO_DECOMPOSED,
             "algo must be DG_TP_ALGO_AUTO, _FUSED or _DECOMPOSED, got ", static_cast<int>(d.algo));
  if (d.algo == DG_TP_ALGO_DECOMPOSED && why_not)
    return fail(DG_ERROR_NOT_SUPPORTED, cat("the decomposed algorithm does not take ", why_not));
  *decomposed = !why_not && (d.algo == DG_TP_ALGO_DECOMPOSED || (d.algo == DG_TP_ALGO_AUTO && !auto_fused));
  return DG_SUCCESS;
}

dg_status check_exchange_size(int world, int64_t rows, int64_t cols, const dg_dtype& dtype,
                              const char* what) {
  const int code = raw_enum(dtype);
  DG_REQUIRE(code >= DG_F32 && code <= DG_E5M2, what, " has an unknown dtype (", code, ")");
  DG_REQUIRE(rows >= 1 && cols >= 1, what, " must have at least one row and column, got (", rows, ", ", cols,
             ")");
  int64_t bytes = 0;
  DG_REQUIRE(checked_product({world, rows, cols, dtype_bytes(dtype)}, &bytes) && bytes < (int64_t{1} << 48),
             what, " of (", rows, ", ", cols, ") ", dtype_name(dtype), " on ", world,
             " ranks needs a workspace beyond 256 TiB");
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

}  // namespace distgemm::tp

using namespace distgemm;
using namespace distgemm::tp;

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
  if (kind == DG_TP_ALL_GATHER_GEMM)
    DG_RETURN_IF_ERROR(check_exchange_size(desc->world, desc->gemm.a.rows, desc->gemm.a.cols, desc->gemm.a.dtype,
                                           "a (this rank's shard)"));
  else
    DG_RETURN_IF_ERROR(check_exchange_size(desc->world, desc->gemm.d.rows, desc->gemm.d.cols, desc->gemm.d.dtype,
                                           "out (this rank's shard)"));
  *bytes = kind == DG_TP_ALL_GATHER_GEMM ? all_gather_bytes(*desc) : reduce_scatter_bytes(*desc);
  return DG_SUCCESS;
}

// What both tensor-parallel ops share before their plan runs: the ranks' mapped workspaces,
// the checks of a dg_tp_desc and its settings, and the signature the ranks compare on every
// call. Host-only.
#pragma once

#include <cstdint>

#include "common/sync.h"
#include "tp/tp_layout.h"
#include "tp/tp_plan.h"
#include "distgemm/distgemm.h"

namespace distgemm::tp {

constexpr int kTagAllGather = DG_TP_ALL_GATHER_GEMM << kErrorPeerBits;
constexpr int kTagReduceScatter = DG_TP_GEMM_REDUCE_SCATTER << kErrorPeerBits;

// Every rank's workspace as mapped in this process, and the device this call runs on.
struct Peers {
  char* base[kMaxWorld] = {};
  int device = -1;
  uint32_t* word(int rank, size_t offset, int index = 0) const {
    return reinterpret_cast<uint32_t*>(base[rank] + offset) + index;
  }
  // In `rank`'s workspace, the signature slot (parity 0; parity 1 is kMaxWorld entries on) of `writer`.
  CallSignature* signature(int rank, int writer) const {
    return reinterpret_cast<CallSignature*>(base[rank] + TpHeader::kSignatures) + writer;
  }
};

// Refuses a shard of (rows, cols) `dtype` that is empty or whose exchange over `world` ranks
// would not fit the workspace arithmetic (no int64 overflow anywhere in the layouts). `dtype`
// by reference: it is read as a raw int until checked (a C caller may store any value).
dg_status check_exchange_size(int world, int64_t rows, int64_t cols, const dg_dtype& dtype, const char* what);

// Checks what every op needs of `d` (world, rank, workspaces, timeout, settings), maps the
// workspaces, binds the current device and refuses the call while an earlier one's failure
// stands.
dg_status check_tp(const dg_tp_desc* d, Peers* peers);

// Refuses a call while the device's error word is set (an earlier call timed out or its ranks
// disagreed): DG_ERROR_TIMEOUT or DG_ERROR_PEER_MISMATCH naming the op and the peer, until
// dg_tp_clear_error.
dg_status check_no_earlier_failure(int device);

// The signature of a plan: what the ranks must agree on for the exchange to be valid (op,
// algorithm and pieces, the rows and width each rank exchanges, `dtypes`, the group size).
CallSignature call_signature(const TpPlan& plan, uint32_t dtypes);

// Whether to run the decomposed algorithm: `why_not` is why cuBLASLt cannot run a piece of
// this call (nullptr if it can); `auto_fused`: the automatic choice is the fused algorithm
// even though the decomposed one could run.
dg_status use_decomposed(const dg_tp_desc& d, const char* why_not, bool auto_fused, bool* decomposed);

// Whether the cuBLASLt pieces need g's bias scaled by beta first (they add it unscaled).
bool needs_scaled_bias(const dg_gemm_desc& g);

// Whether the caller runs this call elsewhere (DG_TP_AGREE_ELSEWHERE): only its agreement here.
inline bool elsewhere(const dg_tp_desc& d) { return d.agree_only == DG_TP_AGREE_ELSEWHERE; }

// scale_a holds 1 value (per tensor) or one per row of a's `rows`; for a call run elsewhere
// also a multiple of them (blocks along K: only the collectives that run it read them).
// `rows_name` names the rows in the error.
dg_status check_scale_a(const dg_tp_desc& d, int64_t rows, const char* rows_name);

// What ranks that run a call elsewhere must share besides its shape, for the data collectives
// they run instead: a's and out's dtypes, and how a's scales travel with its rows (none, one per
// tensor, one per row, or several per row: blocks along K).
uint32_t elsewhere_dtypes(const dg_gemm_desc& g);

// The shape both ops fill in first: rank, world, dtypes' sizes, agree_only.
TpShape base_shape(dg_tp_kind kind, const dg_tp_desc& d);

}  // namespace distgemm::tp

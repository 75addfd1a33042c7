// What both tensor-parallel ops share once their arguments are read: the ranks' mapped
// workspaces, the checks of a dg_tp_desc, the start of a call (epoch, side streams, wait
// parameters) and the choice between the fused and the decomposed algorithm. Host-only.
#pragma once

#include <cstdint>

#include "common/error_state.h"
#include "common/stream_pool.h"
#include "common/sync.h"
#include "tp/tp_kernels.cuh"
#include "tp/tp_layout.h"
#include "distgemm/distgemm.h"

namespace distgemm::tp {

constexpr int kTagAllGather = DG_TP_ALL_GATHER_GEMM << kErrorPeerBits;
constexpr int kTagReduceScatter = DG_TP_GEMM_REDUCE_SCATTER << kErrorPeerBits;
constexpr int kFreeSms = 2;  // left to the copy streams' flag kernels while a fused GEMM spins

// How a chunk of the decomposed algorithm is cut: `count` pieces, equal or, `tapered`, the
// first and last half as large as the others (the first push starts sooner and the last GEMM,
// which waits for the last push, is short: what a chunk whose copy takes long needs).
struct PieceSplit {
  int count = 1;
  bool tapered = false;
};

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
dg_status check_exchange_size(int world, int64_t rows, int64_t cols, const dg_dtype& dtype,
                              const char* what);

// Checks what every op needs of `d` (world, rank, workspaces, timeout), maps the workspaces,
// binds the current device and refuses the call while an earlier one's failure stands.
dg_status check_tp(const dg_tp_desc* d, Peers* peers);

// Refuses a call while the device's error word is set (an earlier call timed out or its ranks
// disagreed): DG_ERROR_TIMEOUT or DG_ERROR_PEER_MISMATCH naming the op and the peer, until
// dg_tp_clear_error.
dg_status check_no_earlier_failure(int device);

// What every call needs once its arguments are checked: the device's side streams and the
// parameters of its bounded waits. The call's first kernel bumps its epoch on `stream` and
// publishes `sig` and the new epoch to every peer (PeerTargets).
struct CallStart {
  StreamPool* pool = nullptr;
  SyncParams sync;
  CallSignature sig;
};
dg_status start_call(const dg_tp_desc& d, const Peers& peers, int tag, int device, cudaStream_t stream,
                     const CallSignature& sig, CallStart* out);

// On `stream`: a bounded wait for every peer to begin this call, checking its signature (the
// per-call agreement); nothing that writes into a peer or reads what a peer wrote may be
// enqueued on `stream` before it.
dg_status check_peers(const dg_tp_desc& d, const Peers& peers, const CallStart& call, cudaStream_t stream);

// The signature of a call: what the ranks must agree on for the exchange to be valid.
CallSignature call_signature(dg_tp_kind kind, const dg_tp_desc& d, int64_t rows, int64_t width,
                             uint32_t dtypes, bool decomposed, const PieceSplit& split);

// Whether to run the decomposed algorithm: `why_not` is why cuBLASLt cannot run a piece of
// this call (nullptr if it can); `auto_fused`: the automatic choice is the fused algorithm
// even though the decomposed one could run.
dg_status use_decomposed(const dg_tp_desc& d, const char* why_not, bool auto_fused, bool* decomposed);


// Rows [0, rows) of a chunk cut into pieces that travel and are multiplied one by one, at
// tile-row boundaries (fewer pieces, or equal ones, where the rows are too few).
constexpr int64_t kPieceRowAlign = 128;
struct RowPieces {
  int count = 1;
  int64_t bound[kMaxPieces + 1] = {};
  RowPieces(int64_t rows, PieceSplit split);
  int64_t row0(int j) const { return bound[j]; }
  int64_t rows(int j) const { return bound[j + 1] - bound[j]; }
};

// The split of a decomposed call: `automatic` unless DISTGEMM_TP_PIECES names one ("N" or
// "Nt", tapered, N in [1, kMaxPieces]). Every rank must see the same value.
dg_status tp_pieces(PieceSplit automatic, PieceSplit* split);

}  // namespace distgemm::tp

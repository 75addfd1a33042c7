// Launchers of the small kernels that order the tensor-parallel GEMMs across GPUs. Each runs
// on a stream the caller names, so the whole sequence stays stream-ordered and capturable.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/sync.h"
#include "tp/tp_layout.h"
#include "distgemm/types.h"

namespace distgemm::tp {

// The flags `signal` writes: each gets *epoch (release, system scope).
struct SignalTargets {
  uint32_t* flags[kMaxWorld];
  int count;
};

// A failed call's marks: in every peer's workspace, this rank's kFailed word (`in_peers`, set to
// the epoch), and in this rank's workspace, the peers' (`seen`, [world] words; its own is 0).
struct FailureMarks {
  uint32_t* in_peers[kMaxWorld];
  int count;
  const uint32_t* seen;
  int world;
};

// Error word: bits 24.. the reason (below), 16..23 the op tag, 0..15 the peer rank + 1.
constexpr int kErrorReasonShift = 24;
enum ErrorReason : int {
  kReasonTimeout = 0,     // a wait on the peer ran past its bound
  kReasonOutOfStep = 1,   // the peer is at another call (earlier calls failed on one side)
  kReasonPlan = 2,        // op, algorithm or pieces differ (DISTGEMM_TP_* settings)
  kReasonRows = 3,        // this rank's rows differ
  kReasonWidth = 4,       // all-gather: K; reduce-scatter: N
  kReasonDtypes = 5,      // dtypes or FP8 scale modes differ
  kReasonWorld = 6,       // group sizes differ
  kReasonElsewhere = 7,   // one rank runs the call elsewhere (collectives), the other here
  kReasonPeerFailed = 8,  // the peer's call failed (it gave up waiting for this rank, or an
                          // earlier failure stood): what it wrote here is not read
};

// The first kernel of a call: *epoch += 1 (every later kernel of the call reads the new value);
// then, into every peer's workspace, this call's signature (its epoch filled in) and the new
// epoch in the peer's `started` flag (kConsumed[rank]). That tells each peer what this call is
// and that this rank's earlier calls are done with its workspace (stream order), so no call
// ends with a signal of its own. sig_slots[q]: peer q's kSignatures base.
struct PeerTargets {
  uint32_t* started[kMaxWorld];
  CallSignature* sig_slots[kMaxWorld];  // [2] slots each, this rank's entry
  int count;
};
// When *error is set (an earlier call failed and the host has not seen it yet), the peers'
// failure marks are written first, so that a peer sees them no later than this call's start.
cudaError_t launch_begin_call(uint32_t* epoch, const PeerTargets& peers, const CallSignature& sig,
                              const FailureMarks& marks, const int* error, cudaStream_t stream);

// Bounded wait until every peer p (peers[i]) has begun this call (its kConsumed flag in this
// rank's workspace reaches the epoch), then checks the signature p published against `own`:
// a peer that marked its call as failed, at another epoch or with another signature records
// the reason and p in the error word (so every later wait of the call gives up at once)
// instead of a timeout. When the call has failed by the end (here or before), marks it as
// failed in every peer, before this lane's copies into them.
struct PeerChecks {
  const uint32_t* started[kMaxWorld];
  const CallSignature* sig[kMaxWorld];  // [2] slots each, peer's entry in this workspace
  int rank[kMaxWorld];
  int count;
};
cudaError_t launch_check_peers(const PeerChecks& peers, const CallSignature& own, const FailureMarks& marks,
                               const SyncParams& s, cudaStream_t stream);

// If the error word is set (this call, or an earlier one, failed) or a peer marked a call of its
// own as failed (recorded in the error word then), fills `rows` x `cols` elements of
// `elem_bytes` at `data` (row pitch `ld` elements) with NaN, so that no output of a failed call,
// nor one that a failed peer's late copies may have touched, reads as valid. s.error NULL: fills
// them whatever the word says (a call the host saw fail).
cudaError_t launch_poison_on_error(void* data, int64_t rows, int64_t cols, int64_t ld, int elem_bytes,
                                   const FailureMarks& marks, const SyncParams& s, cudaStream_t stream);

// Bounded wait until *flag >= *s.epoch + offset; a timeout records s.error_tag | (peer + 1).
cudaError_t launch_wait_flag(const uint32_t* flag, int32_t offset, const SyncParams& s, int peer, cudaStream_t stream);

// Writes *epoch to every target flag after the stream's earlier work, unless *error is set: a
// failed call raises no flag, so no peer takes what it wrote for this call's data.
cudaError_t launch_signal(const SignalTargets& targets, const uint32_t* epoch, const int* error, cudaStream_t stream);

// Writes this shard's FP8 row scales (`count` values, or one value repeated) into rows
// [0, rows) of every rank's gathered-scales region (dst[q], already offset to this shard);
// nothing when `error` (given for writes into peers) is set.
struct ScaleTargets {
  float* dst[kMaxWorld];
  int count;
};
cudaError_t launch_scatter_scales(const float* src, int64_t count, int64_t rows, const ScaleTargets& targets,
                                  const int* error, cudaStream_t stream);

// dst[i] = beta * src[i] for a row of n values of `dtype` (float32, float16 or bfloat16): the
// bias the cuBLASLt pieces add unscaled, scaled once per call.
cudaError_t launch_scale_row(const void* src, void* dst, int64_t n, dg_dtype dtype, float beta, cudaStream_t stream);

}  // namespace distgemm::tp

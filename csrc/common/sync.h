// Cross-GPU readiness flags that a kernel waits on, bounded in time. Host-visible layout.
#pragma once

#include <cstdint>

namespace distgemm {

// Waits a kernel performs before reading peer-written data. All-zero means none.
// Flags are monotonic epochs: a flag is satisfied once (int32)(flag - target) >= 0, the target
// being this rank's current epoch, read from device memory (so a replayed CUDA graph waits
// for the new call's flags, not the captured one's).
struct SyncParams {
  const uint32_t* chunk_ready = nullptr;  // [num_chunks]: A rows of chunk c are in place
  const uint32_t* c_ready = nullptr;      // the C operand (peer partial sums) is complete
  const uint32_t* epoch = nullptr;
  int32_t chunk_rows = 0;  // rows of A per chunk (the last chunk may be shorter)
  int32_t num_chunks = 0;
  int32_t first_chunk = 0;  // tiles start at this chunk's rows and wrap around
  uint64_t timeout_ns = 0;
  // The first timeout writes error_tag | (peer + 1) to *error (device memory, so that other
  // waiters stop early) and then to *error_host (mapped pinned memory the host polls).
  int* error = nullptr;
  int* error_host = nullptr;
  int error_tag = 0;
  int32_t c_peer = 0;  // rank that writes the C operand, for the error word
  // [world] the failure marks the peers wrote into this rank's workspace: a wait on peer p gives
  // up once p's is set (p's call failed, so what it would raise never comes), recording
  // peer_failed_code | (p + 1) rather than waiting out the timeout. nullptr: none.
  const uint32_t* failed_marks = nullptr;
  int peer_failed_code = 0;
};

// Error word layout: bits 16.. hold the op tag, bits 0..15 the peer rank + 1.
constexpr int kErrorPeerBits = 16;

}  // namespace distgemm

// Layout of the symmetric workspace of a tensor-parallel GEMM: every rank allocates the same
// bytes (PyTorch symmetric memory, or any peer-mapped allocation) and passes the mapped base
// address of each rank's copy. Host-only arithmetic, shared by the size query and the ops.
#pragma once

#include <cstddef>
#include <cstdint>

namespace distgemm::tp {

constexpr int kMaxWorld = 64;
// The most pieces one rank's chunk travels in (each piece: its own copy, flag and GEMM).
constexpr int kMaxPieces = 4;

// Header: monotonic epoch flags, one 32-bit word each, written by the rank named in the
// comment and read by the owner of the workspace.
struct TpHeader {
  static constexpr size_t kEpoch = 0;                            // this rank's call counter
  // [world] peer p has begun its call of this epoch, so it is done reading what earlier calls
  // wrote into its workspace: the writer may overwrite it
  static constexpr size_t kConsumed = 256;
  // [world * kMaxPieces] piece j of peer p's shard is in this buffer (p * pieces + j)
  static constexpr size_t kReady = kConsumed + 4 * kMaxWorld;
  // [world * kMaxPieces] piece j of the partial sums of ring slot s are in (s * pieces + j)
  static constexpr size_t kStepReady = kReady + 4 * kMaxWorld * kMaxPieces;
  // [2][world] CallSignature of peer p's call (slot epoch & 1), written before its kConsumed
  // flag: what every rank checks its call against (two slots: a peer may begin the next call
  // before this rank has read the current one)
  static constexpr size_t kSignatures = kStepReady + 4 * kMaxWorld * kMaxPieces;
  static constexpr size_t kBytes = 8192;
};

// What the ranks of a call must agree on, published by each rank at the start of every call
// and compared by every peer before it reads or writes anything that depends on it.
struct CallSignature {
  enum Field { kEpoch, kPlan, kRows, kRowsHigh, kWidth, kDtypes, kWorld, kFields = 8 };
  uint32_t words[kFields] = {};
};
static_assert(TpHeader::kSignatures + 2 * kMaxWorld * sizeof(CallSignature) <= TpHeader::kBytes,
              "header overflow");

inline size_t align_up(size_t bytes, size_t to) { return (bytes + to - 1) / to * to; }

// Device scratch of the cuBLASLt GEMMs of the decomposed algorithm (local use only).
constexpr size_t kGemmScratchBytes = size_t{32} << 20;

// All-gather + GEMM: the gathered operand (M = world * m_local rows of K), for FP8 with
// per-row scales the gathered scales (M floats), and the GEMMs' scratch.
struct AllGatherLayout {
  size_t gathered = TpHeader::kBytes;
  size_t scales = 0;
  size_t scratch = 0;
  size_t bytes = 0;
  AllGatherLayout(int64_t m, int64_t k, size_t elem_bytes) {
    scales = align_up(gathered + static_cast<size_t>(m * k) * elem_bytes, 256);
    scratch = align_up(scales + static_cast<size_t>(m) * sizeof(float), 4096);
    bytes = scratch + kGemmScratchBytes;
  }
};

// GEMM + reduce-scatter: per ring step before the last, a slot of partial sums this rank
// computed (m_local x N in the output dtype), a slot the previous rank pushes its own into,
// and the GEMMs' scratch.
struct ReduceScatterLayout {
  size_t slots = TpHeader::kBytes;
  size_t received = 0;
  size_t slot_bytes = 0;
  size_t scratch = 0;
  size_t bytes = 0;
  ReduceScatterLayout(int world, int64_t m_local, int64_t n, size_t out_bytes) {
    slot_bytes = align_up(static_cast<size_t>(m_local * n) * out_bytes, 256);
    received = slots + slot_bytes * static_cast<size_t>(world - 1);
    scratch = align_up(received + slot_bytes * static_cast<size_t>(world - 1), 4096);
    bytes = scratch + kGemmScratchBytes;
  }
};

}  // namespace distgemm::tp

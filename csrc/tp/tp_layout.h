// The header of the symmetric workspace of a tensor-parallel GEMM: every rank allocates the same
// bytes (PyTorch symmetric memory, distgemm_nccl, or any peer-mapped allocation) and passes the
// mapped base address of each rank's copy. The regions after the header: tp_plan.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include "distgemm/distgemm.h"

namespace distgemm::tp {

constexpr int kMaxWorld = 64;
// The most pieces one rank's chunk travels in (each piece: its own copy, flag and GEMM).
constexpr int kMaxPieces = DG_TP_MAX_PIECES;

// Header: monotonic epoch flags, one 32-bit word each, written by the rank named in the
// comment and read by the owner of the workspace.
struct TpHeader {
  static constexpr size_t kEpoch = 0;  // this rank's call counter
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
  // [world] peer p's call of epoch kFailed[p] failed (a wait timed out, the ranks disagreed, or
  // an earlier call's failure stood): written by p, 0 until the group recovers. The copy-engine
  // copies p had enqueued still land in this workspace, unguarded, so every call of this rank
  // that sees a mark fails too instead of reading what they wrote.
  static constexpr size_t kFailed = kSignatures + 2 * kMaxWorld * 32;
  static constexpr size_t kBytes = 8192;
};

// What the ranks of a call must agree on, published by each rank at the start of every call
// and compared by every peer before it reads or writes anything that depends on it.
struct CallSignature {
  enum Field { kEpoch, kPlan, kRows, kRowsHigh, kWidth, kDtypes, kWorld, kFields = 8 };
  // In kPlan: the rank runs the call elsewhere (DG_TP_AGREE_ELSEWHERE), not on the workspaces.
  static constexpr uint32_t kElsewhere = 1u << 13;
  uint32_t words[kFields] = {};
};
static_assert(sizeof(CallSignature) == 32, "TpHeader::kFailed follows the signature slots");
static_assert(TpHeader::kFailed + 4 * kMaxWorld <= TpHeader::kBytes, "header overflow");

inline size_t align_up(size_t bytes, size_t to) { return (bytes + to - 1) / to * to; }

// Device scratch of the cuBLASLt GEMMs of the decomposed algorithm (local use only).
constexpr size_t kGemmScratchBytes = size_t{32} << 20;

}  // namespace distgemm::tp

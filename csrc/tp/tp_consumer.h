// The two GEMMs a tensor-parallel plan's kGemm steps can run on, behind one interface: the
// persistent CUTLASS GEMM that waits on cross-GPU flags inside the kernel (every dtype), and
// cuBLASLt pieces that the plan precedes with explicit waits (bf16/fp16, and FP8 with per-tensor
// or outer-vector scales; cuBLAS's kernels beat ours on large GEMMs, FP8 most). Host-only.
#pragma once

#include <cstdint>

#include "common/sync.h"
#include "distgemm/distgemm.h"

namespace distgemm::tp {

// One GEMM of a plan, bound to this process's pointers: desc, plus partial sums added with
// coefficient 1 ((M, N), row pitch chain_ldc; desc.c is then a bias row or nothing).
struct StepGemm {
  dg_gemm_desc desc{};
  const void* chain_c = nullptr;
  int64_t chain_ldc = 0;
};

class GemmConsumer {
 public:
  virtual ~GemmConsumer() = default;
  // Why this consumer cannot take `gemm` at all (nullptr if it can): host-only (the cuBLASLt
  // pieces ask cuBLASLt's heuristics).
  virtual const char* unsupported(const StepGemm& gemm) const = 0;
  // Every check run() makes, made before anything of the call is enqueued: a failure after the
  // first launch would strand the peers. `waits`: the kernel waits on flags (fused only).
  virtual dg_status check(const StepGemm& gemm, bool waits) const = 0;
  // Enqueues the GEMM; `waits` (or nullptr) the flags its kernel waits on.
  virtual dg_status run(const StepGemm& gemm, const SyncParams* waits, cudaStream_t stream) const = 0;
};

// The persistent CUTLASS GEMM; a GEMM that waits leaves kFreeSms SMs to the copy streams' flag
// kernels while it spins.
class CutlassRingGemm final : public GemmConsumer {
 public:
  explicit CutlassRingGemm(int sm_count) : sm_count_(sm_count) {}
  const char* unsupported(const StepGemm&) const override { return nullptr; }
  dg_status check(const StepGemm& gemm, bool waits) const override;
  dg_status run(const StepGemm& gemm, const SyncParams* waits, cudaStream_t stream) const override;

 private:
  int sm_count_;
};

// cuBLASLt, with `scratch_bytes` of scratch at `scratch` (local use only).
class CublasLtPieces final : public GemmConsumer {
 public:
  CublasLtPieces(int arch, void* scratch, size_t scratch_bytes)
      : arch_(arch), scratch_(scratch), scratch_bytes_(scratch_bytes) {}
  const char* unsupported(const StepGemm& gemm) const override;
  dg_status check(const StepGemm& gemm, bool waits) const override;
  dg_status run(const StepGemm& gemm, const SyncParams* waits, cudaStream_t stream) const override;

 private:
  int arch_;
  void* scratch_;
  size_t scratch_bytes_;
};

// SMs a waiting fused GEMM leaves free.
constexpr int kFreeSms = 2;

}  // namespace distgemm::tp

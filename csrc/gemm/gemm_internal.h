// The dense GEMM as the tensor-parallel ops drive it: the public descriptor plus what only
// they need (cross-GPU waits, a chained partial-sum operand, fewer SMs).
#pragma once

#include "common/sync.h"
#include "distgemm/distgemm.h"

namespace distgemm::gemm {

struct GemmExtras {
  SyncParams sync{};
  const void* chain_c = nullptr;  // (M, N) partial sums added with coefficient 1 (desc.c: bias only)
  int64_t chain_ldc = 0;
  int sm_count = 0;  // persistent grid size; 0: every SM
};

// Checks and runs `desc` without a workspace (true of every sm90 dense instance: an instance
// that needed one is refused with an error).
dg_status run_gemm_desc(const dg_gemm_desc& desc, const GemmExtras& extras, cudaStream_t stream);

// Checks, without launching, that run_gemm_desc would run `desc` on the current device;
// waits_for_c: a reduce-scatter ring step that waits for its chained C operand (needs a
// kernel that calls the scheduler's epilogue hook).
dg_status check_gemm_desc(const dg_gemm_desc& desc, bool waits_for_c);

}  // namespace distgemm::gemm

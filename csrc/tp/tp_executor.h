// Runs a tensor-parallel plan: binds its references to this process's pointers (the caller's
// matrices, the ranks' mapped workspaces) and enqueues its steps on the caller's stream and a
// side stream, the GEMM steps through a GemmConsumer. Host-only.
#pragma once

#include <cstdint>

#include "tp/tp_call.h"
#include "tp/tp_heuristics.h"
#include "tp/tp_consumer.h"
#include "tp/tp_kernels.cuh"
#include "tp/tp_plan.h"
#include "distgemm/distgemm.h"

namespace distgemm::tp {

// A plan's references bound to pointers: pure host arithmetic, nothing dereferenced.
class TpBuffers {
 public:
  TpBuffers(const dg_tp_desc& d, const Peers& peers, const TpPlan& plan) : d_(d), peers_(peers), plan_(plan) {}

  // Rows of a row-major matrix: the first row's address, the row pitch and width (elements).
  struct Rows {
    char* data = nullptr;
    int64_t pitch = 0;
    int64_t cols = 0;
    int elem_bytes = 0;
  };
  Rows rows(const RowsRef& ref) const;
  uint32_t* flag(const FlagRef& f) const;
  // The failure marks a step writes into the peers (its failure_marks) and this rank's own.
  FailureMarks failure_marks(const Step& step) const;
  // A kGemm step's GEMM: the caller's desc on the step's rows (FP8 row scales and full C rows
  // follow them; the bias only where the step adds it, scaled in the workspace where planned).
  StepGemm gemm(const Step& step) const;

 private:
  const dg_tp_desc& d_;
  const Peers& peers_;
  const TpPlan& plan_;
};

// Why `consumer` cannot take one of `plan`'s GEMMs (nullptr if it takes them all).
const char* unsupported_gemm(const dg_tp_desc& d, const Peers& peers, const TpPlan& plan, const GemmConsumer& consumer);

// Checks every GEMM of `plan` with `consumer`, then enqueues the plan on `stream` (kMain) and a
// pool stream forked from it (kPush). `dtypes` and the plan make the call's signature; `tag`
// names the op in the error word.
dg_status execute(const dg_tp_desc& d, const Peers& peers, const TpPlan& plan, uint32_t dtypes, int tag,
                  const GemmConsumer& consumer, cudaStream_t stream);

// How a call may be cut, as its op works it out from the shape and the settings.
struct TpChoices {
  PieceSplit decomposed;    // the pieces of the decomposed algorithm
  PieceSplit fused;         // the pieces of the fused one
  bool auto_fused = false;  // DG_TP_ALGO_AUTO picks the fused algorithm even where cuBLASLt could run
  uint32_t dtypes = 0;      // what the ranks must agree on besides the plan (dtypes, scale modes)
  int tag = 0;              // the op, in the error word
};

// The rest of every TP call once its op has checked its arguments and filled `shape` (m, k, n,
// what travels): the workspace size check, the algorithm (decomposed where cuBLASLt takes every
// piece of the decomposed plan and the settings allow), the plan, and its execution.
dg_status plan_and_execute(const dg_tp_desc& d, const Peers& peers, TpShape shape, const TpChoices& choices,
                           cudaStream_t stream);

}  // namespace distgemm::tp

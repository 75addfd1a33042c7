// How a tensor-parallel call is cut up, decided from its shape alone so that every rank reaches
// the same answer: which algorithm `auto` takes and how many pieces a chunk travels in. The
// constants come from H200 x2 runs (bench/results/h200x2_tp.json). Host-only.
#pragma once

#include <cstdint>

#include "tp/tp_call.h"
#include "distgemm/distgemm.h"

namespace distgemm::tp {

// Whether `auto` runs a bf16/fp16 GEMM + reduce-scatter of `flops` (per rank) fused: below
// ~50 GFLOP the decomposed ring's extra launches cost more than cuBLAS's kernels gain.
bool rs_auto_prefers_fused(double flops);

// The fused reduce-scatter's steps: halves where half a step is worth its own launch (at least
// DISTGEMM_RS_SPLIT_GFLOPS, default 25; the tests set 0 to force them), else whole.
dg_status rs_fused_split(double half_step_flops, PieceSplit* split);

// The decomposed reduce-scatter's steps, before DISTGEMM_TP_PIECES: halves; from ~100 GFLOP
// where the pushes take 0.4 of the GEMM's time or more (attention-out projections), or the
// steps are long (8192+ rows), three tapered pieces, so that the first push starts sooner and
// the last GEMM, which waits for the last push, is short.
PieceSplit rs_decomposed_split(double flops, double pushed_bytes, int64_t step_rows);

// The decomposed all-gather's peer shards, before DISTGEMM_TP_PIECES: whole; in halves from
// ~200 GFLOP where the pushes take 0.3 of the GEMM's time or more (the 8B QKV projection), so
// that the first peer GEMM starts before the whole shard is in.
PieceSplit ag_decomposed_split(double flops, double pushed_bytes);

}  // namespace distgemm::tp

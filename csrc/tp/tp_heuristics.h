// How a tensor-parallel call is cut up, decided from its shape alone so that every rank reaches
// the same answer: which algorithm `auto` takes and how many pieces a chunk travels in. The
// constants come from H200 x2 runs (bench/results/h200x2_tp.json). Host-only.
#pragma once

#include <cstdint>

#include "tp/tp_plan.h"
#include "distgemm/distgemm.h"

namespace distgemm::tp {

// The constants below are in bf16 GEMM work: `flops` of an FP8 GEMM count half (the H200's FP8
// tensor cores run twice as fast), so that the same push/GEMM balance cuts it alike.
double bf16_equivalent_flops(double flops, dg_dtype in);

// Whether `auto` runs a bf16/fp16 GEMM + reduce-scatter of `flops` (per rank) fused: below
// ~50 GFLOP the decomposed ring's extra launches cost more than cuBLAS's kernels gain.
bool rs_auto_prefers_fused(double flops);

// The fused reduce-scatter's steps: halves where half a step is worth its own launch (at least
// settings.rs_split_gflops, default 25; negative: always), else whole.
PieceSplit rs_fused_split(const dg_tp_settings& settings, double half_step_flops);

// The decomposed reduce-scatter's steps, unless settings.pieces names them: halves; from ~100 GFLOP
// where the pushes take 0.4 of the GEMM's time or more (attention-out projections), or the
// steps are long (8192+ rows), three tapered pieces, so that the first push starts sooner and
// the last GEMM, which waits for the last push, is short.
PieceSplit rs_decomposed_split(double flops, double pushed_bytes, int64_t step_rows);

// The decomposed all-gather's peer shards, unless settings.pieces names them: whole; in halves from
// ~200 GFLOP where the pushes take 0.3 of the GEMM's time or more (the 8B QKV projection), so
// that the first peer GEMM starts before the whole shard is in.
PieceSplit ag_decomposed_split(double flops, double pushed_bytes);

// settings.pieces / tapered where set, else `automatic`.
PieceSplit decomposed_split(const dg_tp_settings& settings, PieceSplit automatic);

}  // namespace distgemm::tp

// The MoE expert MLP's memory-bound kernels, as the host checks (moe/moe_api.cpp) hand them to
// the launchers (moe/moe_act_quantize.cu): an activation (or its derivative) applied to a GEMM's
// output and written in every form the next GEMMs read (bf16, FP8 per 1 x 128, FP8 transposed
// and padded per expert) from one read, and a weight's FP8 copy and transposed FP8 copy from
// one read. Plain types only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "distgemm/types.h"

namespace distgemm::moe {

// dg_moe_act's values (distgemm.h), as the kernels see them.
enum Act : int { kIdentity = 0, kSwiglu = 1, kGelu = 2, kSwigluBackward = 3, kGeluBackward = 4 };

struct ActProblem {
  int act = kIdentity;
  const void* x = nullptr;  // bf16 (tokens, x_cols) row-major: x_cols = 2 inner for SwiGLU ops
  int64_t x_cols = 0;
  // The identity's gather (dg_moe_permute): row r reads x row x_rows[r] of x_tokens (< 0:
  // zeros, >= x_tokens: NaN); NULL reads row r.
  const int64_t* x_rows = nullptr;
  int64_t x_tokens = 0;
  const void* dy = nullptr;  // backward ops: bf16 (tokens, inner)
  int64_t tokens = 0;
  int64_t inner = 0;              // the activation's width
  int planes = 1;                 // 2 for the SwiGLU backward (gate and up gradients), else 1
  int64_t y_cols = 0;             // planes * inner
  void* y = nullptr;              // bf16 (tokens, y_cols) or NULL
  void* y_fp8 = nullptr;          // FP8 (tokens, y_cols) per 1 x 128, or NULL
  float* y_scale = nullptr;       // (ceil(y_cols / 128), tokens)
  void* yt_fp8 = nullptr;         // FP8 (y_cols, yt_ld) transposed and padded per group, or NULL
  float* yt_scale = nullptr;      // (row_blocks, y_cols)
  int64_t yt_ld = 0;              // 128 * row_blocks
  int64_t row_blocks = 0;         // blocks of 128 rows the grid covers (padded per group with offs)
  const int32_t* offs = nullptr;  // with yt_fp8: `groups` cumulative group ends on the device
  int64_t groups = 0;
  int32_t* ends = nullptr;  // workspace: 4 * groups bytes
  dg_dtype fp8_dtype = DG_E4M3;
  int sm_count = 0;
};

// A batch of matrices (groups, rows, cols) quantized per 128 x 128 block: the FP8 copy
// (groups, rows, cols) and its transpose (groups, cols, rows), which share the blocks' scales
// (groups, ceil(rows / 128), ceil(cols / 128)).
struct WeightProblem {
  const void* w = nullptr;
  dg_dtype w_dtype = DG_BF16;
  int64_t groups = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  void* out = nullptr;    // or NULL
  void* out_t = nullptr;  // or NULL
  float* scale = nullptr;
  float* scale_t = nullptr;  // or NULL: the scales as (groups, ceil(cols / 128), ceil(rows / 128))
  dg_dtype fp8_dtype = DG_E4M3;
  // One scale per row of each copy (DG_QUANT_ROW): scale (groups, rows) with out, scale_t
  // (groups, cols) with out_t; else per 128 x 128 block, as above.
  bool row_scales = false;
  int sm_count = 0;
};

cudaError_t launch_act(const ActProblem& p, cudaStream_t stream);
cudaError_t launch_weight_quantize(const WeightProblem& p, cudaStream_t stream);

}  // namespace distgemm::moe

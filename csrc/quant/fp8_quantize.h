// The FP8 quantization kernels' problem, as the host checks (quant/quantize_api.cpp) hand it to
// the launchers (quant/fp8_quantize.cu). Plain types only: the kernel source does not rebuild
// when the C API grows.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "distgemm/types.h"

namespace distgemm::quant {

// dg_quant_granularity's values (distgemm.h), as the kernels see them.
enum Granularity : int { kTensor = 0, kRow = 1, k1x128 = 2, k128x128 = 3 };

constexpr int kBlock = 128;  // the side of a scale block

struct QuantizeProblem {
  const void* x = nullptr;     // (batch, rows, cols) row-major, contiguous
  dg_dtype x_dtype = DG_BF16;  // DG_BF16, DG_F16 or DG_F32
  int64_t batch = 1;
  int64_t rows = 0;
  int64_t cols = 0;
  int granularity = kTensor;
  bool transpose = false;         // k1x128 only: blocks of 128 rows of x for one column
  const int32_t* offs = nullptr;  // transpose only: `groups` cumulative group ends, or NULL
  int64_t groups = 0;
  void* out = nullptr;  // FP8 data, row-major
  dg_dtype out_dtype = DG_E4M3;
  float* scale = nullptr;
  void* workspace = nullptr;  // tensor: 4 bytes (amax); grouped transpose: 4 * groups bytes
  int64_t out_ld = 0;         // transpose: the row pitch of out (rows, or 128 * row_blocks)
  int64_t row_blocks = 0;     // transpose: blocks of 128 along out's rows (padded with offs)
  int sm_count = 0;           // sizes the grids (0: a default)
};

// Enqueues the kernels of a checked problem on `stream`: cudaSuccess or the launch's error.
cudaError_t launch_quantize_fp8(const QuantizeProblem& p, cudaStream_t stream);

}  // namespace distgemm::quant

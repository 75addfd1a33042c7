// The FP8 wgrad's check of its operands' layout on the device (offs lives on the GPU): dy and x
// must be the per-expert padded layout of quantize_fp8(..., transpose=True, offs=offs), whose
// Tp - 128 G columns hold at least offs[G-1] tokens. Operands quantized without offs, (N, T)
// with T a multiple of 128 and T >= 128 G, pass every shape check but hold T tokens in Tp = T
// columns; the kernel would read the wrong columns for every expert. Plain CUDA, every arch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace distgemm::grouped {

// After the wgrad on `stream`: when offs[groups - 1] > tokens (= Tp - 128 G), fills out[0, count)
// with NaN. Otherwise every CTA reads one int and exits (~2 us).
cudaError_t launch_fp8_wgrad_layout_check(const int32_t* offs, int groups, int64_t tokens, float* out, int64_t count,
                                          int sm_count, cudaStream_t stream);

}  // namespace distgemm::grouped

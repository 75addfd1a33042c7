// The MoE layer's token routing kernels, as the host checks (moe/moe_api.cpp) hand them to the
// launchers (moe/moe_routing.cu): each token's weighted sum of its k rows (the combine, and the
// backward of the gather into expert order), and the combine's backward. Plain types only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "distgemm/types.h"

namespace distgemm::moe {

// dg_moe_combine and dg_moe_combine_backward, after their checks (distgemm.h says what each
// field holds). The forward reads y and writes out; the backward reads dy (and y for dweights)
// and writes dy_rows (and dweights).
struct CombineProblem {
  dg_dtype dtype = DG_BF16;
  const void* y = nullptr;
  int64_t num_rows = 0;
  const int64_t* rows = nullptr;
  const float* weights = nullptr;
  int64_t tokens = 0;
  int64_t k = 1;
  int64_t hidden = 0;
  void* out = nullptr;
  const void* dy = nullptr;
  void* dy_rows = nullptr;
  float* dweights = nullptr;
  int sm_count = 0;
};

cudaError_t launch_combine(const CombineProblem& p, cudaStream_t stream);
cudaError_t launch_combine_backward(const CombineProblem& p, cudaStream_t stream);

}  // namespace distgemm::moe

#include "grouped/fp8_wgrad_layout_check.h"

#include <algorithm>

namespace distgemm::grouped {
namespace {

__global__ void fp8_wgrad_layout_check(const int32_t* offs, int groups, int64_t tokens, float* out, int64_t count) {
  if (static_cast<int64_t>(offs[groups - 1]) <= tokens) return;  // the padded layout holds them
  const float nan = __int_as_float(0x7fffffff);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) out[i] = nan;
}

}  // namespace

cudaError_t launch_fp8_wgrad_layout_check(const int32_t* offs, int groups, int64_t tokens, float* out, int64_t count,
                                          int sm_count, cudaStream_t stream) {
  if (groups <= 0 || count <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  // Enough CTAs to fill a large out in a few passes, few enough that their launch is cheap.
  const int64_t wanted = (count + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(std::min<int64_t>(wanted, std::max(sm_count, 1) * int64_t{2}));
  fp8_wgrad_layout_check<<<blocks, kThreads, 0, stream>>>(offs, groups, tokens, out, count);
  return cudaGetLastError();
}

}  // namespace distgemm::grouped

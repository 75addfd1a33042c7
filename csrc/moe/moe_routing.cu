// The MoE layer's token routing kernels (plain CUDA, every arch the build compiles).
//
// combine_kernel: a warp per token; each lane sums 8 columns of the token's k rows at a time
// (16-byte loads of a row's contiguous run across the warp), in FP32 in the order of the slots,
// and rounds once. A slot's row index is the same for every lane (one broadcast load), so a
// dropped or out-of-range slot is skipped by the whole warp.
//
// combine_backward_kernel: a warp per token, the slots one after another: the slot's row of
// dy_rows = weight * dy[t] (dy re-read from L1/L2 per slot), and with dweights the dot product
// of dy[t] and y[row], reduced across the warp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "moe/moe_routing.h"

namespace distgemm::moe {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kLaneCols = 8;
constexpr int kWarpCols = 32 * kLaneCols;
constexpr unsigned kFullMask = 0xffffffffu;

template <class T>
__device__ __forceinline__ float to_float(T v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __bfloat162float(v);
  else if constexpr (std::is_same_v<T, __half>)
    return __half2float(v);
  else
    return v;
}

template <class T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16_rn(v);
  else if constexpr (std::is_same_v<T, __half>)
    return __float2half_rn(v);
  else
    return v;
}

// Elements [c, c + 8) of a row of `cols` as float; zeros past the end. vec: 16-byte aligned
// rows of a multiple of 8 elements.
template <class T>
__device__ __forceinline__ void load8(const T* __restrict__ row, int64_t c, int64_t cols, bool vec, float (&v)[8]) {
  if (vec) {
    if constexpr (sizeof(T) == 2) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(row + c));
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = to_float(e[i]);
    } else {
      const float4 a = __ldg(reinterpret_cast<const float4*>(row + c));
      const float4 b = __ldg(reinterpret_cast<const float4*>(row + c + 4));
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = c + i < cols ? to_float(row[c + i]) : 0.f;
}

// v rounded to T at [c, c + 8) of a row of `cols`, those before the end.
template <class T>
__device__ __forceinline__ void store8(T* __restrict__ row, int64_t c, int64_t cols, bool vec, const float (&v)[8]) {
  if (vec) {
    if constexpr (sizeof(T) == 2) {
      uint4 raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int i = 0; i < 8; ++i) e[i] = from_float<T>(v[i]);
      *reinterpret_cast<uint4*>(row + c) = raw;
    } else {
      *reinterpret_cast<float4*>(row + c) = make_float4(v[0], v[1], v[2], v[3]);
      *reinterpret_cast<float4*>(row + c + 4) = make_float4(v[4], v[5], v[6], v[7]);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i)
    if (c + i < cols) row[c + i] = from_float<T>(v[i]);
}

template <class T>
__global__ void __launch_bounds__(kThreads) combine_kernel(CombineProblem p, bool vec) {
  const auto* y = static_cast<const T*>(p.y);
  auto* out = static_cast<T*>(p.out);
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  for (int64_t t = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; t < p.tokens; t += warps) {
    const int64_t* rows = p.rows + t * p.k;
    const float* weights = p.weights != nullptr ? p.weights + t * p.k : nullptr;
#pragma unroll 2  // two column steps' loads in flight (k of them each)
    for (int64_t c = lane * kLaneCols; c < p.hidden; c += kWarpCols) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int64_t j = 0; j < p.k; ++j) {
        const int64_t r = __ldg(rows + j);  // the same for the whole warp
        if (r < 0 || r >= p.num_rows) continue;
        const float w = weights != nullptr ? __ldg(weights + j) : 1.f;
        float v[8];
        load8(y + r * p.hidden, c, p.hidden, vec, v);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], __fmul_rn(w, v[e]));  // as mul, then sum
      }
      store8(out + t * p.hidden, c, p.hidden, vec, acc);
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) combine_backward_kernel(CombineProblem p, bool vec) {
  const auto* dy = static_cast<const T*>(p.dy);
  const auto* y = static_cast<const T*>(p.y);
  auto* dy_rows = static_cast<T*>(p.dy_rows);
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  for (int64_t t = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; t < p.tokens; t += warps) {
    for (int64_t j = 0; j < p.k; ++j) {
      const int64_t i = t * p.k + j;
      const int64_t r = __ldg(p.rows + i);  // the same for the whole warp
      const bool dropped = r < 0;
      const int64_t row = dropped ? ~r : r;  // ~r = -1 - r, without overflow
      float dot = 0.f;
      if (row < p.num_rows) {
        const float w = p.weights != nullptr ? __ldg(p.weights + i) : 1.f;
        T* dst = dy_rows + row * p.hidden;
#pragma unroll 4  // the loads of four column steps in flight
        for (int64_t c = lane * kLaneCols; c < p.hidden; c += kWarpCols) {
          float v[8];
          if (dropped) {
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = 0.f;
            store8(dst, c, p.hidden, vec, v);
            continue;
          }
          float g[8];
          load8(dy + t * p.hidden, c, p.hidden, vec, g);
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = __fmul_rn(w, g[e]);
          store8(dst, c, p.hidden, vec, v);
          if (p.dweights != nullptr) {
            float x[8];
            load8(y + row * p.hidden, c, p.hidden, vec, x);
#pragma unroll
            for (int e = 0; e < 8; ++e) dot = fmaf(g[e], x[e], dot);
          }
        }
      }
      if (p.dweights == nullptr) continue;  // uniform
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(kFullMask, dot, o);
      if (lane == 0) p.dweights[i] = dropped || row >= p.num_rows ? 0.f : dot;
    }
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

unsigned grid_for(const CombineProblem& p) {
  const int64_t sms = p.sm_count > 0 ? p.sm_count : 132;
  const int64_t ctas = (p.tokens + kWarps - 1) / kWarps;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(ctas, sms * 16)));
}

template <class T>
cudaError_t launch_combine_typed(const CombineProblem& p, cudaStream_t stream) {
  const bool vec = p.hidden % kLaneCols == 0 && aligned16(p.y) && aligned16(p.out);
  combine_kernel<T><<<grid_for(p), kThreads, 0, stream>>>(p, vec);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_combine_backward_typed(const CombineProblem& p, cudaStream_t stream) {
  const bool vec =
      p.hidden % kLaneCols == 0 && aligned16(p.dy) && aligned16(p.dy_rows) && (p.y == nullptr || aligned16(p.y));
  combine_backward_kernel<T><<<grid_for(p), kThreads, 0, stream>>>(p, vec);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_combine(const CombineProblem& p, cudaStream_t stream) {
  if (p.tokens == 0 || p.hidden == 0) return cudaSuccess;
  switch (p.dtype) {
    case DG_BF16:
      return launch_combine_typed<__nv_bfloat16>(p, stream);
    case DG_F16:
      return launch_combine_typed<__half>(p, stream);
    case DG_F32:
      return launch_combine_typed<float>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t launch_combine_backward(const CombineProblem& p, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  switch (p.dtype) {
    case DG_BF16:
      return launch_combine_backward_typed<__nv_bfloat16>(p, stream);
    case DG_F16:
      return launch_combine_backward_typed<__half>(p, stream);
    case DG_F32:
      return launch_combine_backward_typed<float>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace distgemm::moe

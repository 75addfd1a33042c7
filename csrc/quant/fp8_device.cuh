// Device helpers of the FP8 quantization kernels (quant/fp8_quantize.cu) and of the MoE kernels
// that quantize what they compute (moe/moe_act_quantize.cu): loads by element bits, the
// amax-to-scale rule, FP8 stores, and the per-group padded layout's group search. One
// definition of the rounding and scale rules, so every kernel gives the same bits.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "quant/exact_quotient.h"
#include "quant/fp8_quantize.h"

namespace distgemm::quant {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kFullMask = 0xffffffffu;

// Input element types, loaded by their bits.
struct Bf16 {
  using Storage = uint16_t;
  static __device__ __forceinline__ float to_float(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }
};
struct F16 {
  using Storage = uint16_t;
  static __device__ __forceinline__ float to_float(uint16_t b) { return __half2float(__ushort_as_half(b)); }
};
struct F32 {
  using Storage = float;
  static __device__ __forceinline__ float to_float(float v) { return v; }
};

template <__nv_fp8_interpretation_t I>
struct Fp8Max;
template <>
struct Fp8Max<__NV_E4M3> {
  static constexpr float value = 448.f;
};
template <>
struct Fp8Max<__NV_E5M2> {
  static constexpr float value = 57344.f;
};

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

// |v| as bits, ordered as unsigned integers (NaN of either sign above +inf).
__device__ __forceinline__ uint32_t abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// The scale of a block of amax `amax_bits`: amax / fp8_max as the division gives it
// (quant/exact_quotient.h), or 1 where that is 0 (an all-zero block, or an amax so small that
// the quotient underflows). NaN and inf stay.
template <__nv_fp8_interpretation_t I>
__device__ __forceinline__ float scale_of(uint32_t amax_bits) {
  const float a = __uint_as_float(amax_bits);
  constexpr float m = Fp8Max<I>::value, r = 1.f / Fp8Max<I>::value;
  const float s = amax_bits >= kExactAmaxMinBits && amax_bits < 0x7f800000u ? corrected_quotient(a, m, r) : a / m;
  return s == 0.f ? 1.f : s;
}

// x / scale for a scale the corrected product divides exactly (Divisor::fast): no branch.
struct FastQuotient {
  float scale, recip;
  __device__ __forceinline__ float operator()(float x) const {
    return copysignf(corrected_quotient(x, scale, recip), x);  // x = -0 gives -0
  }
};

// x / scale by the division (scales outside the fast form's range; it gives the same bits).
struct DivideQuotient {
  float scale;
  __device__ __forceinline__ float operator()(float x) const { return x / scale; }
};

// x / scale for one block's scale, rounded as the division rounds it: the reciprocal once, then
// per value its corrected product (quant/exact_quotient.h) where the scale allows, half the
// instructions of the division. Kernels choose the form once for all of a block's values they
// hold (with_quotient): a test per value or per four cost as much as the division saved (the
// compiler re-evaluated it and spilled the predicates).
struct Divisor {
  float scale, recip;
  bool fast;
  __device__ __forceinline__ explicit Divisor(float s) : scale(s), recip(1.f / s), fast(exact_by_reciprocal(s)) {}
  __device__ __forceinline__ FastQuotient fast_form() const { return {scale, recip}; }
  __device__ __forceinline__ DivideQuotient divide_form() const { return {scale}; }
  __device__ __forceinline__ float operator()(float x) const { return fast ? fast_form()(x) : x / scale; }
};

// body(q) with q the quotient form for d's scale: FastQuotient (the common case) or the division.
template <class Body>
__device__ __forceinline__ void with_quotient(const Divisor& d, Body&& body) {
  if (d.fast) {
    body(d.fast_form());
  } else {
    body(d.divide_form());
  }
}

// The same for two scales, one test for both.
template <class Body>
__device__ __forceinline__ void with_quotients(const Divisor& d0, const Divisor& d1, Body&& body) {
  if (d0.fast && d1.fast) {
    body(d0.fast_form(), d1.fast_form());
  } else {
    body(d0.divide_form(), d1.divide_form());
  }
}

template <__nv_fp8_interpretation_t I, class Q>
__device__ __forceinline__ uint8_t to_fp8(float v, const Q& q) {
  return __nv_cvt_float_to_fp8(q(v), __NV_SATFINITE, I);
}

// Four values / scale as FP8, the first in the lowest byte.
template <__nv_fp8_interpretation_t I, class Q>
__device__ __forceinline__ uint32_t to_fp8x4(float a, float b, float c, float e, const Q& q) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(q(a), q(b)), __NV_SATFINITE, I);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(q(c), q(e)), __NV_SATFINITE, I);
  return lo | (hi << 16);
}

// Elements [c, c + 8) of a row of `cols` elements as float, zeros past the row's end. vec: the
// row starts 16-byte aligned and c is a multiple of 8, so a full group loads as 16-byte vectors.
template <class In>
__device__ __forceinline__ void load8(const typename In::Storage* __restrict__ row, int64_t c, int64_t cols, bool vec,
                                      float (&v)[8]) {
  if (vec && c + 8 <= cols) {
    if constexpr (sizeof(typename In::Storage) == 2) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(row + c));
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[2 * i] = In::to_float(static_cast<uint16_t>(w[i] & 0xffffu));
        v[2 * i + 1] = In::to_float(static_cast<uint16_t>(w[i] >> 16));
      }
    } else {
      const float4 a = __ldg(reinterpret_cast<const float4*>(row + c));
      const float4 b = __ldg(reinterpret_cast<const float4*>(row + c + 4));
      v[0] = a.x;
      v[1] = a.y;
      v[2] = a.z;
      v[3] = a.w;
      v[4] = b.x;
      v[5] = b.y;
      v[6] = b.z;
      v[7] = b.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = c + i < cols ? In::to_float(row[c + i]) : 0.f;
  }
}

// Elements [c, c + 8) of an FP8 row of `cols` bytes: v / scale, those before the row's end.
// vec: the row starts 8-byte aligned and c is a multiple of 8. q: a quotient form (a Divisor
// picks its form here, once for the eight).
template <__nv_fp8_interpretation_t I, class Q>
__device__ __forceinline__ void store8(uint8_t* __restrict__ row, int64_t c, int64_t cols, bool vec,
                                       const float (&v)[8], const Q& q) {
  if constexpr (std::is_same_v<Q, Divisor>) {
    with_quotient(q, [&](const auto& form) { store8<I>(row, c, cols, vec, v, form); });
  } else if (vec && c + 8 <= cols) {
    uint2 w;
    w.x = to_fp8x4<I>(v[0], v[1], v[2], v[3], q);
    w.y = to_fp8x4<I>(v[4], v[5], v[6], v[7], q);
    *reinterpret_cast<uint2*>(row + c) = w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (c + i < cols) row[c + i] = to_fp8<I>(v[i], q);
  }
}

// Amax of bf16 pairs (two bf16 in a word) with one 16 x 2 max a word: m holds the running
// maxima of |low| and |high| halves; as_amax gives the larger as the bits of its float (the order
// of abs_bits, NaN above inf).
__device__ __forceinline__ uint32_t max_abs_bf16x2(uint32_t m, uint32_t pair) {
  return __vmaxu2(m, pair & 0x7fff7fffu);
}
__device__ __forceinline__ uint32_t bf16x2_low_amax(uint32_t m) { return (m & 0xffffu) << 16; }
__device__ __forceinline__ uint32_t bf16x2_high_amax(uint32_t m) { return m & 0xffff0000u; }
__device__ __forceinline__ uint32_t bf16x2_amax(uint32_t m) { return max(bf16x2_low_amax(m), bf16x2_high_amax(m)); }

__device__ __forceinline__ uint32_t max8(uint32_t m, const float (&v)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) m = max(m, abs_bits(v[i]));
  return m;
}

// The max of m over the CTA (kThreads threads, every one of which calls it).
__device__ __forceinline__ uint32_t block_max(uint32_t m, uint32_t* red) {
  m = __reduce_max_sync(kFullMask, m);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = __reduce_max_sync(kFullMask, lane < kThreads / 32 ? red[lane] : 0u);
  __syncthreads();  // red is rewritten by the next call
  return m;
}

// ---------------------------------------------------------------- per-group padded layout

// ends[g] = min(rows, max(0, offs[0], ..., offs[g])): the groups' clamped, non-decreasing ends
// (a decreasing offset gives an empty group). One CTA of 1024 threads, a max-scan per 1024.
__global__ void __launch_bounds__(1024)
    group_ends_kernel(const int32_t* __restrict__ offs, int64_t groups, int64_t rows, int32_t* __restrict__ ends) {
  __shared__ int32_t warp_scan[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int32_t limit = static_cast<int32_t>(rows);  // rows < 2^31 with offs
  int32_t carry = 0;
  for (int64_t base = 0; base < groups; base += 1024) {
    const int64_t g = base + threadIdx.x;
    int32_t v = g < groups ? min(max(offs[g], 0), limit) : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t u = __shfl_up_sync(kFullMask, v, o);
      if (lane >= o) v = max(v, u);
    }
    if (lane == 31) warp_scan[warp] = v;
    __syncthreads();
    if (warp == 0) {
      int32_t w = warp_scan[lane];
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int32_t u = __shfl_up_sync(kFullMask, w, o);
        if (lane >= o) w = max(w, u);
      }
      warp_scan[lane] = w;
    }
    __syncthreads();
    if (warp > 0) v = max(v, warp_scan[warp - 1]);
    v = max(v, carry);
    if (g < groups) ends[g] = v;
    carry = max(carry, warp_scan[31]);
    __syncthreads();  // warp_scan is rewritten by the next chunk
  }
}

// The group whose padded blocks hold block p: the largest g with first_block(g) <= p, where
// first_block(g) = g + ends[g - 1] / 128 (0 for g = 0) strictly increases with g. A 32-way
// search by one warp (every lane calls it and gets the answer).
__device__ __forceinline__ int64_t find_group(const int32_t* __restrict__ ends, int64_t groups, int64_t p) {
  const int lane = threadIdx.x & 31;
  int64_t lo = 0, hi = groups;  // first_block(lo) <= p; the answer is in [lo, hi)
  while (hi - lo > 1) {
    const int64_t step = (hi - lo + 31) / 32;
    const int64_t g = lo + lane * step;
    const bool below = g < hi && g + (g == 0 ? 0 : ends[g - 1]) / kBlock <= p;
    const unsigned ballot = __ballot_sync(kFullMask, below);  // lanes 0..k: lane 0 (g = lo) always
    lo += int64_t(31 - __clz(ballot)) * step;
    hi = min64(hi, lo + step);
  }
  return lo;
}

// f(In{}) with In the input type of `dtype` (Bf16, F16 or F32): the quantizers' one switch over
// their input dtype; cudaErrorInvalidValue for another.
template <class F>
cudaError_t with_input_type(dg_dtype dtype, F&& f) {
  switch (dtype) {
    case DG_BF16:
      return f(Bf16{});
    case DG_F16:
      return f(F16{});
    case DG_F32:
      return f(F32{});
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace
}  // namespace distgemm::quant

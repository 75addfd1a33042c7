// x / s rounded as the IEEE division rounds it, from s's correctly rounded reciprocal: a
// product and two FMA residual corrections, the steps CUDA's division runs after its
// reciprocal, without its range check and branch. The first correction leaves the quotient
// within an ulp (faithful); with that, the second gives the correctly rounded one (Markstein's
// theorem). One correction matched the division on every case tried (1.7e10 bf16 and 4e9 FP32
// dividends), but nothing proves it for every scale, so both stay (two FMAs a value). Plain C++
// as well as CUDA, so that the host tests check the very code the FP8 kernels run
// (tests/cpp/test_exact_quotient.cpp).
//
// Exact while no intermediate underflows: for the FP8 scales, s in [2^-60, 2^100] with
// |x| <= 448 s or 57344 s (x within its block's amax), apart from quotients below 2^-19 (no FP8
// format resolves them); for the scales themselves, amax / fp8_max for every finite amax from
// 2^-100 up (all of them checked).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define DG_QUOTIENT_FN __host__ __device__ __forceinline__
#else
#define DG_QUOTIENT_FN inline
#endif

namespace distgemm::quant {

// The scales whose quotients the corrected product gives exactly (the others divide).
constexpr float kExactScaleMin = 0x1p-60f;
constexpr float kExactScaleMax = 0x1p100f;
// The smallest amax whose scale amax / fp8_max the corrected product gives exactly: 2^-100.
constexpr uint32_t kExactAmaxMinBits = 0x0d800000u;

DG_QUOTIENT_FN bool exact_by_reciprocal(float s) { return s >= kExactScaleMin && s <= kExactScaleMax; }

// x / s from recip = 1 / s (correctly rounded); the sign of a zero quotient is not kept.
DG_QUOTIENT_FN float corrected_quotient(float x, float s, float recip) {
  float q = x * recip;
  float e = fmaf(-s, q, x);
  q = fmaf(e, recip, q);
  e = fmaf(-s, q, x);
  q = fmaf(e, recip, q);
  return q;
}

}  // namespace distgemm::quant

#undef DG_QUOTIENT_FN

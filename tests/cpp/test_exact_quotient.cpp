// quant/exact_quotient.h, the quotient every FP8 kernel uses in place of the division, against
// the division itself on the CPU: the same header the kernels include, so a change that breaks
// the bit-for-bit contract with the PyTorch reference (x / scale) fails here, without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "quant/exact_quotient.h"

using distgemm::quant::corrected_quotient;
using distgemm::quant::exact_by_reciprocal;
using distgemm::quant::kExactAmaxMinBits;

namespace {

float from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

uint32_t bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// What the kernels compute for x in a block of scale s (Divisor's fast path).
float kernel_quotient(float x, float s) { return std::copysign(corrected_quotient(x, s, 1.f / s), x); }

// Every finite bf16 x within the block's amax (|x| <= fp8_max s, and a little over: s is rounded)
// against x / s: the same bits, or both below 2^-19 with x's sign (no FP8 format resolves them).
int64_t mismatches_over_bf16(float s, float fp8_max) {
  int64_t bad = 0;
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const float x = from_bits(b << 16);
    if (!std::isfinite(x) || std::fabs(x) > 1.01f * fp8_max * s) continue;
    const float want = x / s, got = kernel_quotient(x, s);
    if (bits(want) == bits(got)) continue;
    const bool tiny = std::fabs(want) < 0x1p-19f && std::fabs(got) < 0x1p-19f;
    if (!tiny || std::signbit(want) != std::signbit(got)) ++bad;
  }
  return bad;
}

}  // namespace

TEST(ExactQuotient, MatchesTheDivisionOnEveryBf16ValueOverScales) {
  std::mt19937 gen(20261204);
  int checked = 0;
  // Scales as the kernels make them (amax / 448 and amax / 57344, amax a random float), random
  // scales over the whole range the fast path takes, and the edge cases: a significand of all
  // ones, powers of two, the range's ends.
  std::vector<float> scales = {1.f, from_bits(0x3f7fffffu), 0x1p-60f, 0x1p100f, 0x1p-20f, 0x1p20f, 3.f, 448.f};
  for (int i = 0; i < 150; ++i) {
    const float amax = std::fabs(from_bits(gen() & 0x7fffffffu));
    if (std::isfinite(amax) && amax > 0) scales.push_back(amax / (i % 2 ? 448.f : 57344.f));
    const int e = static_cast<int>(gen() % 161) - 60;
    scales.push_back(std::ldexp(from_bits(0x3f800000u | (gen() & 0x7fffffu)), e));
  }
  for (const float s : scales) {
    if (!exact_by_reciprocal(s)) continue;
    for (const float fp8_max : {448.f, 57344.f}) {
      EXPECT_EQ(mismatches_over_bf16(s, fp8_max), 0) << "scale " << s << " (bits 0x" << std::hex << bits(s) << ")";
      ++checked;
    }
  }
  EXPECT_GT(checked, 500);
}

TEST(ExactQuotient, ScalesFromEveryAmaxMatchTheDivision) {
  // scale_of's amax / fp8_max for amax from 2^-100 to the largest float, every 61st float
  // (about 18 million; the full sweep of every float passed when the kernels took this path).
  for (const float m : {448.f, 57344.f}) {
    const float r = 1.f / m;
    int64_t bad = 0;
    for (uint64_t b = kExactAmaxMinBits; b < 0x7f800000u; b += 61) {
      const float a = from_bits(static_cast<uint32_t>(b));
      if (bits(corrected_quotient(a, m, r)) != bits(a / m)) ++bad;
    }
    EXPECT_EQ(bad, 0) << "fp8_max " << m;
  }
}

TEST(ExactQuotient, NegativeZeroKeepsItsSign) {
  EXPECT_TRUE(std::signbit(kernel_quotient(-0.f, 3.f)));
  EXPECT_FALSE(std::signbit(kernel_quotient(0.f, 3.f)));
}

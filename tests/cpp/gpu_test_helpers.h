// Helpers of the C++ GPU tests (GoogleTest): device buffers of bf16/fp32/e4m3 values, bf16-exact
// random inputs, and the error measure the tests compare with their host references.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <distgemm/distgemm.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace dgtest {

inline bool have_sm90() {
  int devices = 0, major = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0 &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) == cudaSuccess && major == 9;
}

#define REQUIRE_SM90() \
  if (!::dgtest::have_sm90()) GTEST_SKIP() << "needs an sm_90 GPU"

inline std::vector<float> random_values(size_t count, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, scale);
  std::vector<float> v(count);
  for (auto& x : v) x = __bfloat162float(__float2bfloat16(normal(rng)));  // exactly representable
  return v;
}

// A device buffer of bf16 or fp32 values.
struct Buffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  Buffer() = default;
  explicit Buffer(size_t n) : bytes(n) { EXPECT_EQ(cudaMalloc(&ptr, n), cudaSuccess); }
  ~Buffer() { cudaFree(ptr); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

inline void upload_bf16(Buffer& dst, const std::vector<float>& v) {
  std::vector<__nv_bfloat16> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = __float2bfloat16(v[i]);
  ASSERT_EQ(cudaMemcpy(dst.ptr, h.data(), h.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
}

// `v` rounded to e4m3 (the values the GPU will see), uploaded as e4m3 bytes.
inline std::vector<float> upload_e4m3(Buffer& dst, const std::vector<float>& v) {
  std::vector<__nv_fp8_e4m3> h(v.size());
  std::vector<float> rounded(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    h[i] = __nv_fp8_e4m3(v[i]);
    rounded[i] = static_cast<float>(h[i]);
  }
  EXPECT_EQ(cudaMemcpy(dst.ptr, h.data(), h.size(), cudaMemcpyHostToDevice), cudaSuccess);
  return rounded;
}

inline void upload_f32(Buffer& dst, const std::vector<float>& v) {
  ASSERT_EQ(cudaMemcpy(dst.ptr, v.data(), v.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
}

inline std::vector<float> download(const Buffer& src, size_t count, dg_dtype dtype) {
  std::vector<float> out(count);
  if (dtype == DG_F32) {
    EXPECT_EQ(cudaMemcpy(out.data(), src.ptr, count * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  } else {
    std::vector<__nv_bfloat16> h(count);
    EXPECT_EQ(cudaMemcpy(h.data(), src.ptr, count * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    for (size_t i = 0; i < count; ++i) out[i] = __bfloat162float(h[i]);
  }
  return out;
}

inline dg_matrix matrix(const void* data, dg_dtype dtype, int64_t rows, int64_t cols) {
  return {data, dtype, rows, cols, cols, 1};
}

// Largest |got - want| over the largest |want|.
inline double rel_error(const std::vector<float>& got, const std::vector<double>& want) {
  double err = 0, ref = 1e-30;
  for (size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::fabs(static_cast<double>(got[i]) - want[i]));
    ref = std::max(ref, std::fabs(want[i]));
  }
  return err / ref;
}

}  // namespace dgtest

// An MoE layer's expert GEMMs in one launch through distgemm's C API: x (T, K) with its rows
// grouped by expert, w (G, N, K), the group ends `offs` on the GPU (they never come back to the
// host), y (T, N) = x_g @ w_g^T per expert. Checked against a host reference; prints TFLOP/s.
// Without an sm_90 GPU it says so and exits 0 (it still shows the build against distgemm::core).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <distgemm/distgemm.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "example_checks.h"

int main() {
  if (!has_sm90_gpu()) return 0;
  const int groups = 8, n = 2048, k = 1024;
  // Uneven routing, one expert without tokens.
  const std::vector<int32_t> counts = {700, 0, 1300, 511, 1024, 257, 2048, 349};
  std::vector<int32_t> offs(groups);
  int32_t tokens = 0;
  for (int g = 0; g < groups; ++g) offs[g] = tokens += counts[g];

  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<__nv_bfloat16> x(size_t(tokens) * k), w(size_t(groups) * n * k);
  for (auto& v : x) v = __float2bfloat16(normal(rng));
  for (auto& v : w) v = __float2bfloat16(0.05f * normal(rng));

  __nv_bfloat16 *dx = nullptr, *dw = nullptr, *dy = nullptr;
  int32_t* doffs = nullptr;
  CHECK_CUDA(cudaMalloc(&dx, x.size() * sizeof(x[0])));
  CHECK_CUDA(cudaMalloc(&dw, w.size() * sizeof(w[0])));
  CHECK_CUDA(cudaMalloc(&dy, size_t(tokens) * n * sizeof(x[0])));
  CHECK_CUDA(cudaMalloc(&doffs, offs.size() * sizeof(offs[0])));
  CHECK_CUDA(cudaMemcpy(dx, x.data(), x.size() * sizeof(x[0]), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dw, w.data(), w.size() * sizeof(w[0]), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(doffs, offs.data(), offs.size() * sizeof(offs[0]), cudaMemcpyHostToDevice));

  dg_grouped_desc desc{};
  desc.kind = DG_GROUPED_FORWARD;
  desc.num_groups = groups;
  desc.offs = doffs;
  desc.a = dx;
  desc.a_shape = {2, {tokens, k, 0}};
  desc.b = dw;
  desc.b_shape = {3, {groups, n, k}};
  desc.out = dy;
  desc.out_shape = {2, {tokens, n, 0}};
  desc.in_dtype = DG_BF16;
  desc.out_dtype = DG_BF16;
  desc.config = -1;
  size_t bytes = 0;
  CHECK_DG(dg_grouped_gemm_workspace_size(&desc, &bytes));
  void* workspace = nullptr;
  CHECK_CUDA(cudaMalloc(&workspace, bytes ? bytes : 1));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  CHECK_DG(dg_grouped_gemm(&desc, workspace, bytes, stream));  // warm-up

  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  const int iters = 20;
  CHECK_CUDA(cudaEventRecord(start, stream));
  for (int i = 0; i < iters; ++i) CHECK_DG(dg_grouped_gemm(&desc, workspace, bytes, stream));
  CHECK_CUDA(cudaEventRecord(stop, stream));
  CHECK_CUDA(cudaEventSynchronize(stop));
  float ms = 0.f;
  CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
  const double tflops = 2.0 * tokens * n * k / (ms / iters * 1e-3) / 1e12;

  std::vector<__nv_bfloat16> y(size_t(tokens) * n);
  CHECK_CUDA(cudaMemcpy(y.data(), dy, y.size() * sizeof(y[0]), cudaMemcpyDeviceToHost));
  // Host reference on a sample of rows of every expert (FP32 accumulation).
  double err2 = 0.0, ref2 = 0.0;
  for (int g = 0, row0 = 0; g < groups; row0 = offs[g++]) {
    for (int r = row0; r < offs[g]; r += 37) {
      for (int c = 0; c < n; c += 13) {
        float acc = 0.f;
        for (int i = 0; i < k; ++i)
          acc += __bfloat162float(x[size_t(r) * k + i]) * __bfloat162float(w[(size_t(g) * n + c) * k + i]);
        const double d = __bfloat162float(y[size_t(r) * n + c]) - acc;
        err2 += d * d;
        ref2 += double(acc) * acc;
      }
    }
  }
  const double rel = std::sqrt(err2 / (ref2 > 0 ? ref2 : 1.0));
  std::printf("grouped GEMM: %d experts, %d tokens, N=%d K=%d: %.3f ms, %.0f TFLOP/s, relative error %.2e\n", groups,
              tokens, n, k, ms / iters, tflops, rel);
  cudaFree(dx);
  cudaFree(dw);
  cudaFree(dy);
  cudaFree(doffs);
  cudaFree(workspace);
  return rel < 1e-2 ? 0 : 2;
}

// An MoE layer's expert MLP in FP8 through distgemm's C API, without Python: every expert's
// fc1 -> SwiGLU -> fc2 with DeepSeek-V3's block scales (1 x 128 activations, 128 x 128 weights).
//   dg_quantize_fp8_weight: each weight's FP8 copy and its scales, in the layout the GEMM reads;
//   dg_moe_permute:         the tokens gathered into expert order (the rows a router's choice
//                           gives) and quantized per 1 x 128 in the same pass;
//   dg_moe_activation:      the SwiGLU of fc1's output quantized for fc2 in the pass that computes it;
//   dg_grouped_gemm:        each projection for every expert in one launch, the group ends on the GPU.
// Checked against a host reference on a sample of rows; prints the forward's time.
// Without an sm_90 GPU it says so and exits 0 (it still shows the build against distgemm::core).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <distgemm/distgemm.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <tuple>
#include <vector>

#include "example_checks.h"

namespace {

int64_t blocks(int64_t n) { return (n + 127) / 128; }

template <class T>
T* device_alloc(size_t count) {
  void* p = nullptr;
  const size_t bytes = count * sizeof(T);
  return cudaMalloc(&p, bytes > 0 ? bytes : 1) == cudaSuccess ? static_cast<T*>(p) : nullptr;
}

// One FP8 block-scaled grouped forward: out (T, N) = x8 (T, K) @ w8[g] (N, K)^T per expert.
dg_grouped_desc fp8_forward(const int32_t* offs, int groups, int64_t tokens, int64_t n, int64_t k, const void* x8,
                            const float* sx, const void* w8, const float* sw_kn, void* out) {
  dg_grouped_desc d{};
  d.kind = DG_GROUPED_FORWARD;
  d.num_groups = groups;
  d.offs = offs;
  d.a = x8;
  d.a_shape = {2, {tokens, k, 0}};
  d.b = w8;
  d.b_shape = {3, {groups, n, k}};
  d.out = out;
  d.out_shape = {2, {tokens, n, 0}};
  d.in_dtype = DG_E4M3;
  d.out_dtype = DG_BF16;
  d.config = -1;
  d.scale_mode = DG_SCALE_BLOCK;
  d.scale_a = sx;  // (T, Kb), T-major: scale of (t, kb) at sx[kb * T + t]
  d.scale_a_shape = {2, {tokens, blocks(k), 0}};
  d.scale_a_ld = tokens;
  d.scale_b = sw_kn;  // (G, Kb, Nb)
  d.scale_b_shape = {3, {groups, blocks(k), blocks(n)}};
  return d;
}

float silu(float v) { return v / (1.f + std::exp(-v)); }

}  // namespace

int main() {
  if (!has_sm90_gpu()) return 0;
  const int groups = 8;
  const int64_t hidden = 1024, ffn = 512;
  const std::vector<int32_t> counts = {700, 0, 1300, 511, 1024, 257, 2048, 349};  // one expert idle
  std::vector<int32_t> offs(groups);
  int32_t tokens = 0;
  for (int g = 0; g < groups; ++g) offs[g] = tokens += counts[g];

  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.f, 1.f);
  // The tokens in their own order; row r of the layer reads token source[r] (a router's choice,
  // here a shuffle).
  std::vector<int64_t> source(tokens);
  for (int32_t r = 0; r < tokens; ++r) source[r] = r;
  std::shuffle(source.begin(), source.end(), std::mt19937(1));
  std::vector<__nv_bfloat16> x(size_t(tokens) * hidden), w1(size_t(groups) * 2 * ffn * hidden),
      w2(size_t(groups) * hidden * ffn);
  for (auto& v : x) v = __float2bfloat16(normal(rng));
  for (auto& v : w1) v = __float2bfloat16(0.03f * normal(rng));
  for (auto& v : w2) v = __float2bfloat16(0.05f * normal(rng));

  auto* dx = device_alloc<__nv_bfloat16>(x.size());
  auto* dw1 = device_alloc<__nv_bfloat16>(w1.size());
  auto* dw2 = device_alloc<__nv_bfloat16>(w2.size());
  auto* doffs = device_alloc<int32_t>(groups);
  auto* dsource = device_alloc<int64_t>(tokens);
  auto* w1_8 = device_alloc<uint8_t>(w1.size());
  auto* w2_8 = device_alloc<uint8_t>(w2.size());
  auto* s1 = device_alloc<float>(groups * blocks(2 * ffn) * blocks(hidden));
  auto* s1_kn = device_alloc<float>(groups * blocks(2 * ffn) * blocks(hidden));
  auto* s2 = device_alloc<float>(groups * blocks(hidden) * blocks(ffn));
  auto* s2_kn = device_alloc<float>(groups * blocks(hidden) * blocks(ffn));
  auto* x8 = device_alloc<uint8_t>(x.size());
  auto* sx = device_alloc<float>(blocks(hidden) * tokens);
  auto* h = device_alloc<__nv_bfloat16>(size_t(tokens) * 2 * ffn);
  auto* a8 = device_alloc<uint8_t>(size_t(tokens) * ffn);
  auto* sa = device_alloc<float>(blocks(ffn) * tokens);
  auto* y = device_alloc<__nv_bfloat16>(size_t(tokens) * hidden);
  if (!dx || !dw1 || !dw2 || !doffs || !dsource || !w1_8 || !w2_8 || !s1 || !s1_kn || !s2 || !s2_kn || !x8 || !sx ||
      !h || !a8 || !sa || !y) {
    std::fprintf(stderr, "cudaMalloc failed\n");
    return 1;
  }
  CHECK_CUDA(cudaMemcpy(dx, x.data(), x.size() * sizeof(x[0]), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dw1, w1.data(), w1.size() * sizeof(w1[0]), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dw2, w2.data(), w2.size() * sizeof(w2[0]), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(doffs, offs.data(), offs.size() * sizeof(offs[0]), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dsource, source.data(), source.size() * sizeof(source[0]), cudaMemcpyHostToDevice));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));

  // The weights' FP8 copies, once per optimizer step: fc1 (G, 2F, H), fc2 (G, H, F).
  for (auto [w, w8, s, s_kn, rows, cols] :
       {std::tuple{dw1, w1_8, s1, s1_kn, 2 * ffn, hidden}, std::tuple{dw2, w2_8, s2, s2_kn, hidden, ffn}}) {
    dg_quantize_weight_desc q{};
    q.w = w;
    q.w_dtype = DG_BF16;
    q.groups = groups;
    q.rows = rows;
    q.cols = cols;
    q.out = w8;
    q.scale = s;
    q.scale_t = s_kn;  // (G, Kb, Nb): what the forward GEMM reads
    q.out_dtype = DG_E4M3;
    q.granularity = DG_QUANT_128X128;
    CHECK_DG(dg_quantize_fp8_weight(&q, stream));
  }

  dg_moe_permute_desc permute{};  // the tokens -> FP8 rows in expert order, per 1 x 128
  permute.x = dx;
  permute.x_rows = tokens;
  permute.rows = dsource;
  permute.num_rows = tokens;
  permute.hidden = hidden;
  permute.y_fp8 = x8;
  permute.y_scale = sx;
  permute.fp8_dtype = DG_E4M3;
  dg_moe_act_desc swiglu{};  // fc1's output -> silu(gate) * up -> FP8 rows for fc2
  swiglu.act = DG_MOE_SWIGLU;
  swiglu.x = h;
  swiglu.tokens = tokens;
  swiglu.inner = ffn;
  swiglu.y_fp8 = a8;
  swiglu.y_scale = sa;
  swiglu.fp8_dtype = DG_E4M3;
  const dg_grouped_desc fc1 = fp8_forward(doffs, groups, tokens, 2 * ffn, hidden, x8, sx, w1_8, s1_kn, h);
  const dg_grouped_desc fc2 = fp8_forward(doffs, groups, tokens, hidden, ffn, a8, sa, w2_8, s2_kn, y);
  size_t bytes1 = 0, bytes2 = 0;
  CHECK_DG(dg_grouped_gemm_workspace_size(&fc1, &bytes1));
  CHECK_DG(dg_grouped_gemm_workspace_size(&fc2, &bytes2));
  void* workspace = device_alloc<uint8_t>(bytes1 > bytes2 ? bytes1 : bytes2);
  if (!workspace) return 1;
  auto forward = [&]() -> int {
    CHECK_DG(dg_moe_permute(&permute, stream));
    CHECK_DG(dg_grouped_gemm(&fc1, workspace, bytes1, stream));
    CHECK_DG(dg_moe_activation(&swiglu, stream));
    CHECK_DG(dg_grouped_gemm(&fc2, workspace, bytes2, stream));
    return 0;
  };
  if (forward()) return 1;  // warm-up
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  const int iters = 20;
  CHECK_CUDA(cudaEventRecord(start, stream));
  for (int i = 0; i < iters; ++i)
    if (forward()) return 1;
  CHECK_CUDA(cudaEventRecord(stop, stream));
  CHECK_CUDA(cudaEventSynchronize(stop));
  float ms = 0.f;
  CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
  const double tflops = 2.0 * tokens * hidden * ffn * 3 / (ms / iters * 1e-3) / 1e12;

  std::vector<__nv_bfloat16> out(size_t(tokens) * hidden);
  CHECK_CUDA(cudaMemcpy(out.data(), y, out.size() * sizeof(out[0]), cudaMemcpyDeviceToHost));
  // Host reference (FP32 from the bf16 inputs) on a sample of rows of every expert.
  double err2 = 0.0, ref2 = 0.0;
  std::vector<float> act(ffn);
  for (int g = 0, row0 = 0; g < groups; row0 = offs[g++]) {
    for (int r = row0; r < offs[g]; r += 97) {
      for (int64_t f = 0; f < ffn; ++f) {
        float gate = 0.f, up = 0.f;
        for (int64_t i = 0; i < hidden; ++i) {
          const float xv = __bfloat162float(x[size_t(source[r]) * hidden + i]);
          gate += xv * __bfloat162float(w1[(size_t(g) * 2 * ffn + f) * hidden + i]);
          up += xv * __bfloat162float(w1[(size_t(g) * 2 * ffn + ffn + f) * hidden + i]);
        }
        act[f] = silu(gate) * up;
      }
      for (int64_t c = 0; c < hidden; c += 7) {
        float acc = 0.f;
        for (int64_t f = 0; f < ffn; ++f) acc += act[f] * __bfloat162float(w2[(size_t(g) * hidden + c) * ffn + f]);
        const double d = __bfloat162float(out[size_t(r) * hidden + c]) - acc;
        err2 += d * d;
        ref2 += double(acc) * acc;
      }
    }
  }
  const double rel = std::sqrt(err2 / (ref2 > 0 ? ref2 : 1.0));
  // FP8 e4m3 keeps 3 mantissa bits: four quantized operands give ~7% (tests/gpu/test_moe_gpu.py).
  std::printf(
      "FP8 expert MLP forward: %d experts, %d tokens, hidden %lld, ffn %lld: %.3f ms (%.0f TFLOP/s), "
      "relative error %.3f against FP32\n",
      groups, tokens, static_cast<long long>(hidden), static_cast<long long>(ffn), ms / iters, tflops, rel);
  for (void* p : {static_cast<void*>(dx), static_cast<void*>(dw1), static_cast<void*>(dw2), static_cast<void*>(doffs),
                  static_cast<void*>(dsource), static_cast<void*>(w1_8), static_cast<void*>(w2_8),
                  static_cast<void*>(s1), static_cast<void*>(s1_kn), static_cast<void*>(s2), static_cast<void*>(s2_kn),
                  static_cast<void*>(x8), static_cast<void*>(sx), static_cast<void*>(h), static_cast<void*>(a8),
                  static_cast<void*>(sa), static_cast<void*>(y), workspace})
    cudaFree(p);
  return rel < 0.1 ? 0 : 2;
}

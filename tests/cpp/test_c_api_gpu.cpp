// The C API's GEMMs on the GPU, as a C++ user calls them (the installed headers and library
// only), against host references in double: the dense GEMM with alpha, a bias and beta, and the
// grouped GEMM's forward and variable-K wgrad with a zero-token expert. Skips without an sm_90 GPU.
#include <cuda_runtime.h>
#include <distgemm/distgemm.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "gpu_test_helpers.h"

using namespace dgtest;

namespace {

// Runs `run` on `desc` with the workspace `size` asks for (the buffer's free waits for the device).
template <class Desc>
void run_with_workspace(const Desc& desc, dg_status (*size)(const Desc*, size_t*),
                        dg_status (*run)(const Desc*, void*, size_t, cudaStream_t)) {
  size_t bytes = 0;
  ASSERT_EQ(size(&desc, &bytes), DG_SUCCESS) << dg_last_error();
  Buffer workspace(bytes ? bytes : 16);
  ASSERT_EQ(run(&desc, workspace.ptr, bytes, nullptr), DG_SUCCESS) << dg_last_error();
}

TEST(CApiGpu, DenseGemmWithBiasMatchesTheReference) {
  REQUIRE_SM90();
  const int64_t m = 257, n = 384, k = 520;  // odd M, K not a multiple of the tile
  const float alpha = 2.f, beta = 0.5f;
  const std::vector<float> a = random_values(m * k, 1, 1.f), b = random_values(n * k, 2, 0.05f),
                           bias = random_values(n, 3, 1.f);
  Buffer da(m * k * 2), db(n * k * 2), dbias(n * 2), dout(m * n * 2);
  upload_bf16(da, a);
  upload_bf16(db, b);
  upload_bf16(dbias, bias);
  dg_gemm_desc d{};
  d.a = matrix(da.ptr, DG_BF16, m, k);
  d.b = matrix(db.ptr, DG_BF16, n, k);
  d.c = matrix(dbias.ptr, DG_BF16, 1, n);
  d.d = matrix(dout.ptr, DG_BF16, m, n);
  d.alpha = alpha;
  d.beta = beta;
  d.config = -1;
  ASSERT_NO_FATAL_FAILURE(run_with_workspace(d, dg_gemm_workspace_size, dg_gemm));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<double> want(m * n);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < k; ++p) acc += double(a[i * k + p]) * b[j * k + p];
      want[i * n + j] = alpha * acc + beta * bias[j];
    }
  EXPECT_LT(rel_error(download(dout, m * n, DG_BF16), want), 1e-2);
}

// Experts' token counts (one without tokens) and their cumulative ends.
struct Routing {
  std::vector<int32_t> counts{100, 0, 300, 1, 211};
  std::vector<int32_t> ends;
  int64_t tokens = 0;
  Routing() {
    for (int32_t c : counts) ends.push_back(static_cast<int32_t>(tokens += c));
  }
  int64_t groups() const { return static_cast<int64_t>(counts.size()); }
  int64_t start(int64_t g) const { return g == 0 ? 0 : ends[g - 1]; }
};

TEST(CApiGpu, GroupedForwardAndWgradMatchTheReference) {
  REQUIRE_SM90();
  const Routing route;
  const int64_t groups = route.groups(), t = route.tokens, n = 256, k = 384;
  const std::vector<float> x = random_values(t * k, 4, 1.f), w = random_values(groups * n * k, 5, 0.05f),
                           dy = random_values(t * n, 6, 1.f);
  Buffer dx(t * k * 2), dw(groups * n * k * 2), ddy(t * n * 2), dout(t * n * 2), dgrad_w(groups * n * k * 4),
      doffs(groups * 4);
  upload_bf16(dx, x);
  upload_bf16(dw, w);
  upload_bf16(ddy, dy);
  ASSERT_EQ(cudaMemcpy(doffs.ptr, route.ends.data(), groups * 4, cudaMemcpyHostToDevice), cudaSuccess);

  // forward: out[rows of g] = x[rows of g] @ w[g]^T
  dg_grouped_desc f{};
  f.kind = DG_GROUPED_FORWARD;
  f.num_groups = groups;
  f.offs = static_cast<const int32_t*>(doffs.ptr);
  f.a = dx.ptr;
  f.a_shape = {2, {t, k, 0}};
  f.b = dw.ptr;
  f.b_shape = {3, {groups, n, k}};
  f.out = dout.ptr;
  f.out_shape = {2, {t, n, 0}};
  f.in_dtype = DG_BF16;
  f.out_dtype = DG_BF16;
  f.config = -1;
  ASSERT_NO_FATAL_FAILURE(run_with_workspace(f, dg_grouped_gemm_workspace_size, dg_grouped_gemm));

  // wgrad: grad_w[g] (N, K) = dy[rows of g]^T @ x[rows of g], float32; zeros for the empty expert
  dg_grouped_desc wg{};
  wg.kind = DG_GROUPED_WGRAD;
  wg.num_groups = groups;
  wg.offs = static_cast<const int32_t*>(doffs.ptr);
  wg.a = ddy.ptr;
  wg.a_shape = {2, {t, n, 0}};
  wg.b = dx.ptr;
  wg.b_shape = {2, {t, k, 0}};
  wg.out = dgrad_w.ptr;
  wg.out_shape = {3, {groups, n, k}};
  wg.in_dtype = DG_BF16;
  wg.out_dtype = DG_F32;
  wg.config = -1;
  ASSERT_EQ(cudaMemset(dgrad_w.ptr, 0x7f, groups * n * k * 4), cudaSuccess);  // garbage: all must be written
  ASSERT_NO_FATAL_FAILURE(run_with_workspace(wg, dg_grouped_gemm_workspace_size, dg_grouped_gemm));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  std::vector<double> want_out(t * n), want_w(groups * n * k, 0.0);
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t i = route.start(g); i < route.ends[g]; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double acc = 0;
        for (int64_t p = 0; p < k; ++p) acc += double(x[i * k + p]) * w[(g * n + j) * k + p];
        want_out[i * n + j] = acc;
      }
    for (int64_t j = 0; j < n; ++j)
      for (int64_t p = 0; p < k; ++p) {
        double acc = 0;
        for (int64_t i = route.start(g); i < route.ends[g]; ++i) acc += double(dy[i * n + j]) * x[i * k + p];
        want_w[(g * n + j) * k + p] = acc;
      }
  }
  EXPECT_LT(rel_error(download(dout, t * n, DG_BF16), want_out), 1e-2) << "forward";
  const std::vector<float> got_w = download(dgrad_w, groups * n * k, DG_F32);
  EXPECT_LT(rel_error(got_w, want_w), 1e-4) << "wgrad";
  for (int64_t e = n * k; e < 2 * n * k; ++e)  // expert 1 has no tokens: its gradient is zero
    ASSERT_EQ(got_w[e], 0.f) << "expert 1, element " << e - n * k;
}

}  // namespace

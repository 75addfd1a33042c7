// The C API's GEMMs on the GPU, as a C++ user calls them (the installed headers and library
// only), against host references in double: the dense GEMM with alpha, a bias and beta, and the
// grouped GEMM's forward and variable-K wgrad with a zero-token expert. Skips without an sm_90 GPU.
#include <cuda_runtime.h>
#include <distgemm/distgemm.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
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

std::vector<uint8_t> bytes_of(const Buffer& b, size_t n) {
  std::vector<uint8_t> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), b.ptr, n, cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

// dg_quantize_fp8 of a bf16 (rows, cols) device tensor, 1 x 128 (transposed with offs when
// groups > 0): the FP8 bytes and scales, as the MoE activation must reproduce them.
void quantize_reference(const Buffer& x, int64_t rows, int64_t cols, const Buffer* offs, int64_t groups,
                        std::vector<uint8_t>* data, std::vector<uint8_t>* scale) {
  dg_quantize_desc q{};
  q.x = x.ptr;
  q.x_dtype = DG_BF16;
  q.batch = 1;
  q.rows = rows;
  q.cols = cols;
  q.granularity = DG_QUANT_1X128;
  q.transpose = groups > 0;
  q.offs = groups > 0 ? static_cast<const int32_t*>(offs->ptr) : nullptr;
  q.num_groups = groups;
  q.out_dtype = DG_E4M3;
  dg_quantize_sizes sz{};
  ASSERT_EQ(dg_quantize_fp8_sizes(&q, &sz), DG_SUCCESS) << dg_last_error();
  Buffer out(size_t(sz.data_rows * sz.data_cols) + 16), sc(size_t(sz.scale_rows * sz.scale_cols) * 4 + 16),
      ws(sz.workspace_bytes + 16);
  q.out = out.ptr;
  q.scale = static_cast<float*>(sc.ptr);
  q.workspace = ws.ptr;
  q.workspace_bytes = sz.workspace_bytes;
  ASSERT_EQ(dg_quantize_fp8(&q, nullptr), DG_SUCCESS) << dg_last_error();
  *data = bytes_of(out, size_t(sz.data_rows * sz.data_cols));
  *scale = bytes_of(sc, size_t(sz.scale_rows * sz.scale_cols) * 4);
}

TEST(CApiGpu, MoeActivationWritesWhatQuantizeFp8Writes) {
  REQUIRE_SM90();
  const std::vector<int32_t> ends = {130, 130, 300};  // an expert without tokens, odd counts
  const int64_t tokens = 300, inner = 256, groups = 3;
  const int64_t tp = 128 * ((tokens + 127) / 128 + groups);
  const std::vector<float> xv = random_values(size_t(tokens) * 2 * inner, 5, 3.f);
  Buffer x(xv.size() * 2), offs(groups * 4), y(size_t(tokens) * inner * 2), y8(size_t(tokens) * inner),
      ys(size_t(tokens) * 2 * 4), yt8(size_t(inner) * tp), yts(size_t(inner) * (tp / 128) * 4), ws(groups * 4);
  upload_bf16(x, xv);
  ASSERT_EQ(cudaMemcpy(offs.ptr, ends.data(), groups * 4, cudaMemcpyHostToDevice), cudaSuccess);
  dg_moe_act_desc d{};
  d.act = DG_MOE_SWIGLU;
  d.x = x.ptr;
  d.tokens = tokens;
  d.inner = inner;
  d.y = y.ptr;
  d.y_fp8 = y8.ptr;
  d.y_scale = static_cast<float*>(ys.ptr);
  d.yt_fp8 = yt8.ptr;
  d.yt_scale = static_cast<float*>(yts.ptr);
  d.offs = static_cast<const int32_t*>(offs.ptr);
  d.num_groups = groups;
  d.fp8_dtype = DG_E4M3;
  d.workspace = ws.ptr;
  d.workspace_bytes = groups * 4;
  ASSERT_EQ(dg_moe_activation(&d, nullptr), DG_SUCCESS) << dg_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // The bf16 values: silu(gate) * up in FP32, rounded once.
  const std::vector<float> got = download(y, size_t(tokens) * inner, DG_BF16);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < inner; ++c) {
      const double g = xv[t * 2 * inner + c], u = xv[t * 2 * inner + inner + c];
      const double want = g / (1.0 + std::exp(-g)) * u;
      ASSERT_LE(std::fabs(got[t * inner + c] - want), std::fabs(want) * 1.0 / 128 + 1e-6) << t << ", " << c;
    }
  }
  std::vector<uint8_t> data, scale;
  quantize_reference(y, tokens, inner, nullptr, 0, &data, &scale);
  EXPECT_EQ(bytes_of(y8, data.size()), data) << "FP8 rows";
  EXPECT_EQ(bytes_of(ys, scale.size()), scale) << "1 x 128 scales";
  quantize_reference(y, tokens, inner, &offs, groups, &data, &scale);
  EXPECT_EQ(bytes_of(yt8, data.size()), data) << "FP8 padded transpose";
  EXPECT_EQ(bytes_of(yts, scale.size()), scale) << "its scales";
}

TEST(CApiGpu, MoePermuteWritesTheGatheredRowsInEveryForm) {
  REQUIRE_SM90();
  const int64_t x_rows = 100, hidden = 256, num_rows = 300, groups = 3;
  const std::vector<int32_t> ends = {130, 130, 290};  // an expert without rows; 10 dropped rows past the last
  const int64_t tp = 128 * ((num_rows + 127) / 128 + groups);
  const std::vector<float> xv = random_values(size_t(x_rows) * hidden, 6, 3.f);
  std::vector<int64_t> source(num_rows);
  for (int64_t r = 0; r < num_rows; ++r) source[r] = r >= 290 || r % 17 == 3 ? -1 : (r * 37) % x_rows;
  Buffer x(xv.size() * 2), rows(num_rows * 8), offs(groups * 4), y(size_t(num_rows) * hidden * 2),
      y8(size_t(num_rows) * hidden), ys(size_t(num_rows) * 2 * 4), yt8(size_t(hidden) * tp),
      yts(size_t(hidden) * (tp / 128) * 4), ws(groups * 4);
  upload_bf16(x, xv);
  ASSERT_EQ(cudaMemcpy(rows.ptr, source.data(), num_rows * 8, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(offs.ptr, ends.data(), groups * 4, cudaMemcpyHostToDevice), cudaSuccess);
  dg_moe_permute_desc d{};
  d.x = x.ptr;
  d.x_rows = x_rows;
  d.rows = static_cast<const int64_t*>(rows.ptr);
  d.num_rows = num_rows;
  d.hidden = hidden;
  d.y = y.ptr;
  d.y_fp8 = y8.ptr;
  d.y_scale = static_cast<float*>(ys.ptr);
  d.yt_fp8 = yt8.ptr;
  d.yt_scale = static_cast<float*>(yts.ptr);
  d.offs = static_cast<const int32_t*>(offs.ptr);
  d.num_groups = groups;
  d.fp8_dtype = DG_E4M3;
  d.workspace = ws.ptr;
  d.workspace_bytes = groups * 4;
  size_t bytes = 0;
  // Every row is written, the dropped ones past the last end included: no output keeps its 0xff.
  for (Buffer* b : {&y, &y8, &ys}) ASSERT_EQ(cudaMemset(b->ptr, 0xff, b->bytes), cudaSuccess);
  ASSERT_EQ(dg_moe_permute_workspace_size(&d, &bytes), DG_SUCCESS) << dg_last_error();
  ASSERT_EQ(bytes, size_t(groups * 4));
  ASSERT_EQ(dg_moe_permute(&d, nullptr), DG_SUCCESS) << dg_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // The bf16 rows are x's rows as they are (the identity), zeros for the dropped ones.
  const std::vector<float> got = download(y, size_t(num_rows) * hidden, DG_BF16);
  const std::vector<float> xs = download(x, size_t(x_rows) * hidden, DG_BF16);
  for (int64_t r = 0; r < num_rows; ++r) {
    for (int64_t c = 0; c < hidden; ++c) {
      const float want = source[r] < 0 ? 0.f : xs[source[r] * hidden + c];
      ASSERT_EQ(got[r * hidden + c], want) << r << ", " << c;
    }
  }
  std::vector<uint8_t> data, scale;
  quantize_reference(y, num_rows, hidden, nullptr, 0, &data, &scale);
  EXPECT_EQ(bytes_of(y8, data.size()), data) << "FP8 rows";
  EXPECT_EQ(bytes_of(ys, scale.size()), scale) << "1 x 128 scales";
  quantize_reference(y, num_rows, hidden, &offs, groups, &data, &scale);
  EXPECT_EQ(bytes_of(yt8, data.size()), data) << "FP8 padded transpose";
  EXPECT_EQ(bytes_of(yts, scale.size()), scale) << "its scales";
}

// dg_quantize_fp8_weight's desc for a bf16 w (groups, rows, cols) into both e4m3 copies.
dg_quantize_weight_desc bf16_weight_desc(const Buffer& w, int64_t groups, int64_t rows, int64_t cols, const Buffer& out,
                                         const Buffer& out_t, const Buffer& sc, const Buffer& sc_t,
                                         dg_quant_granularity granularity) {
  dg_quantize_weight_desc d{};
  d.w = w.ptr;
  d.w_dtype = DG_BF16;
  d.groups = groups;
  d.rows = rows;
  d.cols = cols;
  d.out = out.ptr;
  d.out_t = out_t.ptr;
  d.scale = static_cast<float*>(sc.ptr);
  d.scale_t = static_cast<float*>(sc_t.ptr);
  d.out_dtype = DG_E4M3;
  d.granularity = granularity;
  return d;
}

TEST(CApiGpu, WeightCopiesMatchQuantizeFp8) {
  REQUIRE_SM90();
  const int64_t groups = 2, rows = 200, cols = 136, rb = 2, cb = 2;
  const std::vector<float> wv = random_values(size_t(groups * rows * cols), 6, 1.f);
  Buffer w(wv.size() * 2), out(wv.size()), out_t(wv.size()), sc(groups * rb * cb * 4), sc_t(groups * rb * cb * 4);
  upload_bf16(w, wv);
  const dg_quantize_weight_desc d = bf16_weight_desc(w, groups, rows, cols, out, out_t, sc, sc_t, DG_QUANT_128X128);
  ASSERT_EQ(dg_quantize_fp8_weight(&d, nullptr), DG_SUCCESS) << dg_last_error();
  dg_quantize_desc q{};
  q.x = w.ptr;
  q.x_dtype = DG_BF16;
  q.batch = groups;
  q.rows = rows;
  q.cols = cols;
  q.granularity = DG_QUANT_128X128;
  q.out_dtype = DG_E4M3;
  Buffer ref(wv.size()), ref_sc(groups * rb * cb * 4);
  q.out = ref.ptr;
  q.scale = static_cast<float*>(ref_sc.ptr);
  ASSERT_EQ(dg_quantize_fp8(&q, nullptr), DG_SUCCESS) << dg_last_error();
  const std::vector<uint8_t> want = bytes_of(ref, wv.size()), got_t = bytes_of(out_t, wv.size());
  EXPECT_EQ(bytes_of(out, wv.size()), want);
  const std::vector<uint8_t> s = bytes_of(sc, groups * rb * cb * 4), st = bytes_of(sc_t, groups * rb * cb * 4);
  EXPECT_EQ(s, bytes_of(ref_sc, groups * rb * cb * 4));
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        ASSERT_EQ(got_t[(g * cols + c) * rows + r], want[(g * rows + r) * cols + c]) << g << ", " << r << ", " << c;
    for (int64_t i = 0; i < rb; ++i)
      for (int64_t j = 0; j < cb; ++j)
        EXPECT_EQ(std::memcmp(&st[((g * cb + j) * rb + i) * 4], &s[((g * rb + i) * cb + j) * 4], 4), 0);
  }
}

// The row recipe's copies: out per row of w, out_t per row of w's transpose (a column of w),
// each bit for bit dg_quantize_fp8 DG_QUANT_ROW of w and of a transposed copy made on the host.
TEST(CApiGpu, WeightRowCopiesMatchQuantizeFp8) {
  REQUIRE_SM90();
  const int64_t groups = 3, rows = 200, cols = 136;
  const std::vector<float> wv = random_values(size_t(groups * rows * cols), 7, 3.f);
  std::vector<float> wt(wv.size());
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) wt[(g * cols + c) * rows + r] = wv[(g * rows + r) * cols + c];
  Buffer w(wv.size() * 2), w_t(wv.size() * 2), out(wv.size()), out_t(wv.size()), sc(groups * rows * 4),
      sc_t(groups * cols * 4);
  upload_bf16(w, wv);
  upload_bf16(w_t, wt);
  const dg_quantize_weight_desc d = bf16_weight_desc(w, groups, rows, cols, out, out_t, sc, sc_t, DG_QUANT_ROW);
  ASSERT_EQ(dg_quantize_fp8_weight(&d, nullptr), DG_SUCCESS) << dg_last_error();
  for (const bool transposed : {false, true}) {
    dg_quantize_desc q{};
    q.x = transposed ? w_t.ptr : w.ptr;
    q.x_dtype = DG_BF16;
    q.batch = 1;
    q.rows = groups * (transposed ? cols : rows);
    q.cols = transposed ? rows : cols;
    q.granularity = DG_QUANT_ROW;
    q.out_dtype = DG_E4M3;
    Buffer ref(wv.size()), ref_sc(size_t(q.rows) * 4);
    q.out = ref.ptr;
    q.scale = static_cast<float*>(ref_sc.ptr);
    ASSERT_EQ(dg_quantize_fp8(&q, nullptr), DG_SUCCESS) << dg_last_error();
    EXPECT_EQ(bytes_of(transposed ? out_t : out, wv.size()), bytes_of(ref, wv.size())) << transposed;
    EXPECT_EQ(bytes_of(transposed ? sc_t : sc, size_t(q.rows) * 4), bytes_of(ref_sc, size_t(q.rows) * 4)) << transposed;
  }
}

}  // namespace

TEST(CApiGpu, MoeCombineAndItsBackwardMatchTheReference) {
  REQUIRE_SM90();
  // 5 tokens, top-3, 15 rows of 200 (not a multiple of 8: the scalar path) and of 256; slot rows
  // with a dropped copy (-1 - p), one out of range, and a token whose every slot is dropped.
  const int64_t tokens = 5, k = 3, rows = 15;
  const std::vector<int64_t> slot = {0, 7, -1 - 3, 14, 2, 1, -1 - 4, -1 - 5, -1 - 6, 9, 99, 8, 10, 11, 12};
  std::vector<float> w(tokens * k);
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.25f + 0.125f * float(i % 5);
  for (int64_t hidden : {int64_t(200), int64_t(256)}) {
    const std::vector<float> yv = random_values(size_t(rows * hidden), 7, 1.f);
    const std::vector<float> dyv = random_values(size_t(tokens * hidden), 8, 1.f);
    Buffer y(yv.size() * 2), dy(dyv.size() * 2), out(size_t(tokens * hidden) * 2), slots(slot.size() * 8),
        wb(w.size() * 4), dy_rows(yv.size() * 2), dw(w.size() * 4);
    upload_bf16(y, yv);
    upload_bf16(dy, dyv);
    upload_f32(wb, w);
    ASSERT_EQ(cudaMemcpy(slots.ptr, slot.data(), slot.size() * 8, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemset(dy_rows.ptr, 0, dy_rows.bytes), cudaSuccess);
    dg_moe_combine_desc c{};
    c.y = y.ptr;
    c.dtype = DG_BF16;
    c.num_rows = rows;
    c.rows = static_cast<const int64_t*>(slots.ptr);
    c.weights = static_cast<const float*>(wb.ptr);
    c.tokens = tokens;
    c.k = k;
    c.hidden = hidden;
    c.out = out.ptr;
    ASSERT_EQ(dg_moe_combine(&c, nullptr), DG_SUCCESS) << dg_last_error();
    dg_moe_combine_backward_desc b{};
    b.dy = dy.ptr;
    b.y = y.ptr;
    b.dtype = DG_BF16;
    b.num_rows = rows;
    b.rows = c.rows;
    b.weights = c.weights;
    b.tokens = tokens;
    b.k = k;
    b.hidden = hidden;
    b.dy_rows = dy_rows.ptr;
    b.dweights = static_cast<float*>(dw.ptr);
    ASSERT_EQ(dg_moe_combine_backward(&b, nullptr), DG_SUCCESS) << dg_last_error();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<double> want(size_t(tokens * hidden), 0.0), want_rows(yv.size(), 0.0), want_dw(w.size(), 0.0);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        const int64_t i = t * k + j, r = slot[i];
        if (r >= rows) continue;  // out of range: nothing read or written
        if (r < 0) continue;      // dropped: row -1 - r stays zero in dy_rows, its weight's gradient 0
        for (int64_t h = 0; h < hidden; ++h) {
          want[t * hidden + h] += double(w[i]) * yv[r * hidden + h];
          want_rows[r * hidden + h] = double(__bfloat162float(__float2bfloat16(w[i] * dyv[t * hidden + h])));
          want_dw[i] += double(dyv[t * hidden + h]) * yv[r * hidden + h];
        }
      }
    }
    EXPECT_LE(rel_error(download(out, want.size(), DG_BF16), want), 1.0 / 128) << hidden;
    const std::vector<float> got_rows = download(dy_rows, want_rows.size(), DG_BF16);
    for (size_t i = 0; i < want_rows.size(); ++i) ASSERT_EQ(double(got_rows[i]), want_rows[i]) << hidden << " " << i;
    EXPECT_LE(rel_error(download(dw, want_dw.size(), DG_F32), want_dw), 1e-5) << hidden;
    const std::vector<float> got_out = download(out, want.size(), DG_BF16);
    for (int64_t h = 0; h < hidden; ++h) ASSERT_EQ(got_out[2 * hidden + h], 0.f) << "every slot of token 2 dropped";
  }
}

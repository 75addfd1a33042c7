// The tensor-parallel C API on one GPU: two ranks of one process, each with its own workspace
// and stream on the same device (every rank's workspace is then mapped in the process by
// construction). It runs the plan executor, both GEMM consumers, the bias the cuBLASLt pieces
// scale, and the per-call agreement for real, against a host reference in double. Skips
// without an sm_90 GPU; the NCCL path across GPUs is test_nccl_tp.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <distgemm/distgemm.h>
#include <gtest/gtest.h>

#include "gpu_test_helpers.h"

#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace dgtest;

namespace {

constexpr int kWorld = 2;

// One process plays both ranks, so before CUDA starts: load every kernel up front (with lazy
// loading, a kernel's first launch waits for the device to go idle, which never happens while
// rank 0 spins waiting for rank 1's launches behind it on the host), and give every stream its
// own hardware queue (shared queues would serialize the ranks' streams).
const bool kOneProcessEnvironment = [] {
  setenv("CUDA_MODULE_LOADING", "EAGER", 1);
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  return true;
}();

// Two ranks' workspaces (zeroed) and streams on device 0.
struct LoopbackGroup {
  Buffer ws[kWorld];
  void* ptrs[kWorld] = {};
  size_t bytes = 0;
  cudaStream_t streams[kWorld] = {};
  explicit LoopbackGroup(size_t need) : bytes(need) {
    for (int r = 0; r < kWorld; ++r) {
      new (&ws[r]) Buffer(need);
      EXPECT_EQ(cudaMemset(ws[r].ptr, 0, need), cudaSuccess);
      ptrs[r] = ws[r].ptr;
      EXPECT_EQ(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking), cudaSuccess);
    }
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  ~LoopbackGroup() {
    for (auto s : streams) cudaStreamDestroy(s);
  }
  dg_tp_desc desc(int rank, const dg_gemm_desc& gemm, const dg_tp_settings& settings) const {
    dg_tp_desc d{};
    d.gemm = gemm;
    d.rank = rank;
    d.world = kWorld;
    d.peer_workspaces = ptrs;
    d.workspace_bytes = bytes;
    d.timeout_s = 30.0;
    d.settings = settings;
    return d;
  }
};

using TpOp = dg_status (*)(const dg_tp_desc*, cudaStream_t);

// Each rank's call once alone first, on its own fresh workspaces, running 1 s past its timeout
// (its peer never calls): so that every kernel and cuBLASLt algorithm the call launches is
// loaded before the ranks run together. Loading one from the host while the other rank's
// kernels spin on the same GPU would block this one host thread until they time out (separate
// processes on separate GPUs, as in use, never wait on each other that way).
template <class MakeDesc>
void load_each_rank_alone(size_t need, TpOp op, MakeDesc make_desc) {
  for (int r = 0; r < kWorld; ++r) {
    LoopbackGroup lone(need);
    dg_tp_desc d = make_desc(lone, r);
    d.timeout_s = 1.0;
    EXPECT_EQ(op(&d, lone.streams[r]), DG_SUCCESS) << dg_last_error();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(dg_tp_error(0) >> 24, 0) << "rank " << r << " alone must time out";
    EXPECT_EQ(dg_tp_clear_error(0), DG_SUCCESS) << dg_last_error();
  }
}

// Both ranks' calls on `group`, each enqueued without error, then the device drained.
template <class MakeDesc>
void call_both(const LoopbackGroup& group, TpOp op, MakeDesc make_desc) {
  for (int r = 0; r < kWorld; ++r) {
    const dg_tp_desc d = make_desc(group, r);
    ASSERT_EQ(op(&d, group.streams[r]), DG_SUCCESS) << dg_last_error();
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// Both ranks' calls on fresh workspaces (each rank's kernels loaded alone first), and no error
// recorded.
template <class MakeDesc>
void run_together(size_t need, TpOp op, MakeDesc make_desc) {
  load_each_rank_alone(need, op, make_desc);
  LoopbackGroup group(need);
  ASSERT_NO_FATAL_FAILURE(call_both(group, op, make_desc));
  ASSERT_EQ(dg_tp_error(0), 0);
}

// The workspace bytes of a bf16 all-gather + GEMM of (m, k) shards into N columns.
size_t all_gather_workspace(const void* a, int64_t m, int64_t k, int64_t n) {
  dg_tp_desc probe{};
  probe.gemm.a = matrix(a, DG_BF16, m, k);
  probe.gemm.d = matrix(nullptr, DG_BF16, kWorld * m, n);
  probe.world = kWorld;
  size_t need = 0;
  EXPECT_EQ(dg_tp_workspace_size(DG_TP_ALL_GATHER_GEMM, &probe, &need), DG_SUCCESS) << dg_last_error();
  return need;
}

struct AllGatherCase {
  const char* name;
  dg_tp_settings settings;
  float beta;
};

// all-gather + GEMM: out (2m, N) = allgather(a) @ b^T + beta * bias, b different per rank.
TEST(TpLoopback, AllGatherGemmMatchesTheReference) {
  REQUIRE_SM90();
  const int64_t m = 300, k = 512, n = 384;
  const std::vector<AllGatherCase> cases = {
      {"fused", {DG_TP_ALGO_FUSED, 0, 0, 0.0}, 1.0f},
      {"decomposed, 2 pieces, bias scaled by the core", {DG_TP_ALGO_DECOMPOSED, 2, 0, 0.0}, 0.5f},
      {"auto", {DG_TP_ALGO_AUTO, 0, 0, 0.0}, -2.0f},
  };
  const std::vector<float> a_all = random_values(kWorld * m * k, 1, 1.f);
  const std::vector<float> bias = random_values(n, 2, 1.f);
  std::vector<std::vector<float>> b(kWorld);
  for (int r = 0; r < kWorld; ++r) b[r] = random_values(n * k, 10 + r, 0.05f);
  for (const AllGatherCase& c : cases) {
    SCOPED_TRACE(c.name);
    Buffer a[kWorld], bw[kWorld], out[kWorld], gathered[kWorld], bias_d(n * 2);
    upload_bf16(bias_d, bias);
    size_t need = 0;
    dg_gemm_desc gemms[kWorld];
    for (int r = 0; r < kWorld; ++r) {
      new (&a[r]) Buffer(m * k * 2);
      new (&bw[r]) Buffer(n * k * 2);
      new (&out[r]) Buffer(kWorld * m * n * 2);
      new (&gathered[r]) Buffer(kWorld * m * k * 2);
      upload_bf16(a[r], std::vector<float>(a_all.begin() + r * m * k, a_all.begin() + (r + 1) * m * k));
      upload_bf16(bw[r], b[r]);
      dg_gemm_desc& g = gemms[r];
      g = {};
      g.a = matrix(a[r].ptr, DG_BF16, m, k);
      g.b = matrix(bw[r].ptr, DG_BF16, n, k);
      g.c = matrix(bias_d.ptr, DG_BF16, 1, n);
      g.d = matrix(out[r].ptr, DG_BF16, kWorld * m, n);
      g.alpha = 1.f;
      g.beta = c.beta;
      g.config = -1;
      dg_tp_desc d{};
      d.gemm = g;
      d.world = kWorld;
      size_t bytes = 0;
      ASSERT_EQ(dg_tp_workspace_size(DG_TP_ALL_GATHER_GEMM, &d, &bytes), DG_SUCCESS) << dg_last_error();
      need = std::max(need, bytes);
    }
    auto make_desc = [&](const LoopbackGroup& group, int r) {
      dg_tp_desc d = group.desc(r, gemms[r], c.settings);
      d.gathered_out = gathered[r].ptr;
      return d;
    };
    ASSERT_NO_FATAL_FAILURE(run_together(need, dg_all_gather_gemm, make_desc));
    for (int r = 0; r < kWorld; ++r) {
      std::vector<double> want(kWorld * m * n);
      for (int64_t i = 0; i < kWorld * m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double acc = 0;
          for (int64_t p = 0; p < k; ++p) acc += double(a_all[i * k + p]) * b[r][j * k + p];
          want[i * n + j] = acc + double(c.beta) * bias[j];
        }
      EXPECT_LT(rel_error(download(out[r], want.size(), DG_BF16), want), 1e-2) << "rank " << r;
      const std::vector<float> got_a = download(gathered[r], a_all.size(), DG_BF16);
      EXPECT_EQ(got_a, a_all) << "rank " << r << ": gathered_out";
    }
  }
}

// GEMM + reduce-scatter: out (m, N) = rows of rank r of sum_q a_q @ b_q^T, + beta * bias.
TEST(TpLoopback, GemmReduceScatterMatchesTheReference) {
  REQUIRE_SM90();
  const int64_t m = 200, k = 256, n = 264;
  struct Case {
    const char* name;
    dg_tp_settings settings;
    dg_dtype out;
  };
  const std::vector<Case> cases = {
      {"fused, every step in halves", {DG_TP_ALGO_FUSED, 0, 0, -1.0}, DG_F32},
      {"fused", {DG_TP_ALGO_FUSED, 0, 0, 0.0}, DG_BF16},
      {"decomposed, 3 tapered pieces", {DG_TP_ALGO_DECOMPOSED, 3, 1, 0.0}, DG_F32},
      {"decomposed", {DG_TP_ALGO_DECOMPOSED, 0, 0, 0.0}, DG_BF16},
  };
  const float beta = -1.5f;
  std::vector<std::vector<float>> a(kWorld), b(kWorld);
  for (int q = 0; q < kWorld; ++q) {
    a[q] = random_values(kWorld * m * k, 20 + q, 1.f);
    b[q] = random_values(n * k, 30 + q, 0.05f);
  }
  const std::vector<float> bias = random_values(n, 3, 1.f);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const int out_bytes = c.out == DG_F32 ? 4 : 2;
    Buffer ad[kWorld], bd[kWorld], out[kWorld], bias_d(n * out_bytes);
    if (c.out == DG_F32)
      ASSERT_EQ(cudaMemcpy(bias_d.ptr, bias.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
    else
      upload_bf16(bias_d, bias);
    dg_gemm_desc gemms[kWorld];
    size_t need = 0;
    for (int r = 0; r < kWorld; ++r) {
      new (&ad[r]) Buffer(kWorld * m * k * 2);
      new (&bd[r]) Buffer(n * k * 2);
      new (&out[r]) Buffer(m * n * out_bytes);
      upload_bf16(ad[r], a[r]);
      upload_bf16(bd[r], b[r]);
      dg_gemm_desc& g = gemms[r];
      g = {};
      g.a = matrix(ad[r].ptr, DG_BF16, kWorld * m, k);
      g.b = matrix(bd[r].ptr, DG_BF16, n, k);
      g.c = matrix(bias_d.ptr, c.out, 1, n);
      g.d = matrix(out[r].ptr, c.out, m, n);
      g.alpha = 1.f;
      g.beta = beta;
      g.config = -1;
      dg_tp_desc d{};
      d.gemm = g;
      d.world = kWorld;
      size_t bytes = 0;
      ASSERT_EQ(dg_tp_workspace_size(DG_TP_GEMM_REDUCE_SCATTER, &d, &bytes), DG_SUCCESS) << dg_last_error();
      need = std::max(need, bytes);
    }
    auto make_desc = [&](const LoopbackGroup& group, int r) { return group.desc(r, gemms[r], c.settings); };
    ASSERT_NO_FATAL_FAILURE(run_together(need, dg_gemm_reduce_scatter, make_desc));
    for (int r = 0; r < kWorld; ++r) {
      std::vector<double> want(m * n);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double acc = 0;
          for (int q = 0; q < kWorld; ++q)
            for (int64_t p = 0; p < k; ++p) acc += double(a[q][(r * m + i) * k + p]) * b[q][j * k + p];
          want[i * n + j] = acc + double(beta) * bias[j];
        }
      EXPECT_LT(rel_error(download(out[r], want.size(), c.out), want), c.out == DG_F32 ? 1e-4 : 1e-2) << "rank " << r;
    }
  }
}

// gemm.config is an index into dg_gemm_config_name's list in every step of the ring: a chained
// step (which waits for its C inside the kernel) refuses a non-cooperative config by name, and
// takes a cooperative one as the index says (not the index into a list of cooperative kernels).
TEST(TpLoopback, ReduceScatterConfigIndexesDgGemmConfigName) {
  REQUIRE_SM90();
  const int64_t m = 256, k = 256, n = 256;
  Buffer a(kWorld * m * k * 2), b(n * k * 2), out(m * n * 2);
  upload_bf16(a, random_values(kWorld * m * k, 40, 1.f));
  upload_bf16(b, random_values(n * k, 41, 0.05f));
  dg_gemm_desc g{};
  g.a = matrix(a.ptr, DG_BF16, kWorld * m, k);
  g.b = matrix(b.ptr, DG_BF16, n, k);
  g.d = matrix(out.ptr, DG_BF16, m, n);
  g.alpha = 1.f;
  g.config = -1;
  dg_tp_desc probe{};
  probe.gemm = g;
  probe.world = kWorld;
  size_t need = 0;
  ASSERT_EQ(dg_tp_workspace_size(DG_TP_GEMM_REDUCE_SCATTER, &probe, &need), DG_SUCCESS) << dg_last_error();
  const dg_tp_settings fused{DG_TP_ALGO_FUSED, 0, 0, 0.0};
  const int count = dg_gemm_config_count(&g, 90);
  int cooperative = 0, other = 0;
  for (int i = 0; i < count; ++i) {
    const std::string name = dg_gemm_config_name(&g, 90, i);
    SCOPED_TRACE(name);
    g.config = i;
    LoopbackGroup lone(need);
    dg_tp_desc d = lone.desc(0, g, fused);
    d.timeout_s = 1.0;  // no peer calls: a call that runs times out
    const dg_status st = dg_gemm_reduce_scatter(&d, lone.streams[0]);
    if (name.rfind("coop", 0) == 0) {
      ++cooperative;
      EXPECT_EQ(st, DG_SUCCESS) << dg_last_error();
    } else {
      ++other;
      EXPECT_EQ(st, DG_ERROR_INVALID_ARGUMENT);
      EXPECT_NE(std::string(dg_last_error()).find("config " + std::to_string(i) + " (" + name + ")"), std::string::npos)
          << dg_last_error();
      EXPECT_NE(std::string(dg_last_error()).find("cooperative"), std::string::npos) << dg_last_error();
    }
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(dg_tp_clear_error(0), DG_SUCCESS) << dg_last_error();
  }
  EXPECT_GT(cooperative, 0);
  EXPECT_GT(other, 0) << "the bf16 list has ping-pong configs";
}

// FP8 scales of each rank's operands: one value per tensor, or one per row of a and of b; they
// differ by rank, so that a GEMM over a peer's gathered rows must use that peer's scales.
struct Fp8Scales {
  std::vector<float> a, b;
  float at(bool of_a, int64_t row) const {
    const std::vector<float>& v = of_a ? a : b;
    return v.size() == 1 ? v[0] : v[row];
  }
};

Fp8Scales rank_scales(int rank, bool row_wise, int64_t a_rows, int64_t b_rows) {
  Fp8Scales s;
  std::mt19937 rng(60 + rank);
  std::uniform_real_distribution<float> spread(0.5f, 2.f);
  s.a.resize(row_wise ? a_rows : 1);
  s.b.resize(row_wise ? b_rows : 1);
  for (auto& x : s.a) x = (rank + 1) * spread(rng);
  for (auto& x : s.b) x = 0.01f * spread(rng);
  return s;
}

struct Fp8Case {
  const char* name;
  dg_tp_settings settings;
  bool row_wise;
  float beta;
};

// One rank's FP8 operands on the device.
struct Fp8Operands {
  Buffer a, b, scale_a, scale_b;
  std::vector<float> a_values, b_values;  // as rounded to e4m3
  Fp8Scales scales;
  void upload(const std::vector<float>& a_host, const std::vector<float>& b_host, const Fp8Scales& s) {
    new (&a) Buffer(a_host.size());
    new (&b) Buffer(b_host.size());
    new (&scale_a) Buffer(s.a.size() * 4);
    new (&scale_b) Buffer(s.b.size() * 4);
    a_values = upload_e4m3(a, a_host);
    b_values = upload_e4m3(b, b_host);
    upload_f32(scale_a, s.a);
    upload_f32(scale_b, s.b);
    scales = s;
  }
  dg_gemm_desc gemm(int64_t a_rows, int64_t k, int64_t n) const {
    dg_gemm_desc g{};
    g.a = matrix(a.ptr, DG_E4M3, a_rows, k);
    g.b = matrix(b.ptr, DG_E4M3, n, k);
    g.scale_a = static_cast<const float*>(scale_a.ptr);
    g.scale_a_len = static_cast<int64_t>(scales.a.size());
    g.scale_b = static_cast<const float*>(scale_b.ptr);
    g.scale_b_len = static_cast<int64_t>(scales.b.size());
    g.alpha = 1.f;
    g.config = -1;
    return g;
  }
};

// Whether the decomposed algorithm takes this call: it is refused by name (nothing enqueued)
// where cuBLASLt has no algorithm for its pieces (outer-vector FP8 scales need a recent
// cuBLASLt), which only a row-wise case may meet.
template <class MakeDesc>
bool decomposed_runs(size_t need, TpOp op, MakeDesc make_desc, bool may_refuse) {
  LoopbackGroup lone(need);
  dg_tp_desc d = make_desc(lone, 0);
  d.timeout_s = 1.0;  // rank 1 never calls
  const dg_status st = op(&d, lone.streams[0]);
  if (st == DG_ERROR_NOT_SUPPORTED && may_refuse) {
    EXPECT_NE(std::string(dg_last_error()).find("no algorithm"), std::string::npos) << dg_last_error();
    std::printf("[ note ] the decomposed algorithm refused row-wise FP8 scales: %s\n", dg_last_error());
    return false;
  }
  EXPECT_EQ(st, DG_SUCCESS) << dg_last_error();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(dg_tp_clear_error(0), DG_SUCCESS) << dg_last_error();
  return st == DG_SUCCESS;
}

// Both ranks' FP8 GEMMs of a case: each rank's operands (a_rows x k, b n x k, seeds by rank),
// the shared bias, out (out_rows x n, bf16), and the workspace the op needs.
struct Fp8Ranks {
  Fp8Operands ops[kWorld];
  Buffer out[kWorld], bias;
  dg_gemm_desc gemms[kWorld];
  size_t need = 0;
};

void make_fp8_ranks(Fp8Ranks& x, dg_tp_kind kind, int64_t a_rows, int64_t out_rows, int64_t k, int64_t n,
                    const Fp8Case& c, const std::vector<float>& bias, uint32_t seed) {
  new (&x.bias) Buffer(n * 2);
  upload_bf16(x.bias, bias);
  for (int r = 0; r < kWorld; ++r) {
    x.ops[r].upload(random_values(a_rows * k, seed + r, 1.f), random_values(n * k, seed + 10 + r, 1.f),
                    rank_scales(r, c.row_wise, a_rows, n));
    new (&x.out[r]) Buffer(out_rows * n * 2);
    dg_gemm_desc& g = x.gemms[r];
    g = x.ops[r].gemm(a_rows, k, n);
    g.c = matrix(x.bias.ptr, DG_BF16, 1, n);
    g.d = matrix(x.out[r].ptr, DG_BF16, out_rows, n);
    g.beta = c.beta;
    dg_tp_desc d{};
    d.gemm = g;
    d.world = kWorld;
    size_t bytes = 0;
    ASSERT_EQ(dg_tp_workspace_size(kind, &d, &bytes), DG_SUCCESS) << dg_last_error();
    x.need = std::max(x.need, bytes);
  }
}

// Runs a case's calls on both ranks; false where the decomposed algorithm refused it by name.
bool run_fp8_case(const Fp8Ranks& x, TpOp op, const Fp8Case& c) {
  auto make_desc = [&](const LoopbackGroup& group, int r) { return group.desc(r, x.gemms[r], c.settings); };
  if (c.settings.algo == DG_TP_ALGO_DECOMPOSED && !decomposed_runs(x.need, op, make_desc, c.row_wise)) return false;
  run_together(x.need, op, make_desc);
  return !::testing::Test::HasFatalFailure();
}

// FP8 all-gather + GEMM (e4m3, bf16 out, bias): each rank's a shard and weight scaled by its own
// scales, per tensor or per row; the decomposed algorithm runs cuBLASLt FP8 pieces.
TEST(TpLoopback, Fp8AllGatherGemmMatchesTheReference) {
  REQUIRE_SM90();
  const int64_t m = 256, k = 256, n = 384;
  const std::vector<Fp8Case> cases = {
      {"decomposed, per-tensor scales, 2 pieces", {DG_TP_ALGO_DECOMPOSED, 2, 0, 0.0}, false, 1.f},
      {"decomposed, per-tensor scales, bias scaled by the core", {DG_TP_ALGO_DECOMPOSED, 0, 0, 0.0}, false, 0.5f},
      {"fused, per-tensor scales", {DG_TP_ALGO_FUSED, 0, 0, 0.0}, false, 1.f},
      {"auto, row-wise scales", {DG_TP_ALGO_AUTO, 0, 0, 0.0}, true, 1.f},
      {"decomposed, row-wise scales", {DG_TP_ALGO_DECOMPOSED, 0, 0, 0.0}, true, 1.f},
  };
  const std::vector<float> bias = random_values(n, 4, 1.f);
  for (const Fp8Case& c : cases) {
    SCOPED_TRACE(c.name);
    Fp8Ranks x;
    ASSERT_NO_FATAL_FAILURE(make_fp8_ranks(x, DG_TP_ALL_GATHER_GEMM, m, kWorld * m, k, n, c, bias, 40));
    if (!run_fp8_case(x, dg_all_gather_gemm, c)) {
      ASSERT_FALSE(HasFatalFailure());
      continue;
    }
    for (int r = 0; r < kWorld; ++r) {
      std::vector<double> want(kWorld * m * n);
      for (int64_t i = 0; i < kWorld * m; ++i) {
        const int q = static_cast<int>(i / m);  // the rank whose shard row i is
        for (int64_t j = 0; j < n; ++j) {
          double acc = 0;
          for (int64_t p = 0; p < k; ++p)
            acc += double(x.ops[q].a_values[(i % m) * k + p]) * x.ops[r].b_values[j * k + p];
          want[i * n + j] =
              acc * x.ops[q].scales.at(true, i % m) * x.ops[r].scales.at(false, j) + double(c.beta) * bias[j];
        }
      }
      EXPECT_LT(rel_error(download(x.out[r], want.size(), DG_BF16), want), 1e-2) << "rank " << r;
    }
  }
}

// FP8 GEMM + reduce-scatter (e4m3, bf16 partial sums and out, bias scaled by beta): the
// decomposed ring's cuBLASLt FP8 pieces add the pushed partial sums as their C operand.
TEST(TpLoopback, Fp8GemmReduceScatterMatchesTheReference) {
  REQUIRE_SM90();
  const int64_t m = 384, k = 128, n = 256;
  const std::vector<Fp8Case> cases = {
      {"decomposed, per-tensor scales, 3 tapered pieces", {DG_TP_ALGO_DECOMPOSED, 3, 1, 0.0}, false, -1.5f},
      {"decomposed, per-tensor scales", {DG_TP_ALGO_DECOMPOSED, 0, 0, 0.0}, false, 1.f},
      {"fused, per-tensor scales", {DG_TP_ALGO_FUSED, 0, 0, 0.0}, false, -1.5f},
      {"decomposed, row-wise scales", {DG_TP_ALGO_DECOMPOSED, 0, 0, 0.0}, true, 1.f},
  };
  const std::vector<float> bias = random_values(n, 5, 1.f);
  for (const Fp8Case& c : cases) {
    SCOPED_TRACE(c.name);
    Fp8Ranks x;
    ASSERT_NO_FATAL_FAILURE(make_fp8_ranks(x, DG_TP_GEMM_REDUCE_SCATTER, kWorld * m, m, k, n, c, bias, 70));
    if (!run_fp8_case(x, dg_gemm_reduce_scatter, c)) {
      ASSERT_FALSE(HasFatalFailure());
      continue;
    }
    for (int r = 0; r < kWorld; ++r) {
      std::vector<double> want(m * n);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double sum = 0;
          for (int q = 0; q < kWorld; ++q) {
            const int64_t row = r * m + i;
            double acc = 0;
            for (int64_t p = 0; p < k; ++p)
              acc += double(x.ops[q].a_values[row * k + p]) * x.ops[q].b_values[j * k + p];
            sum += acc * x.ops[q].scales.at(true, row) * x.ops[q].scales.at(false, j);
          }
          want[i * n + j] = sum + double(c.beta) * bias[j];
        }
      // bf16 partial sums travel between the ranks: one more rounding than the all-gather
      EXPECT_LT(rel_error(download(x.out[r], want.size(), DG_BF16), want), 2e-2) << "rank " << r;
    }
  }
}

// Ranks whose settings differ: the call's outputs are NaN, the error word names the
// disagreement, the next call is refused until dg_tp_clear_error; a rank whose peer never
// calls times out within its bound.
TEST(TpLoopback, DisagreementAndTimeoutAreReported) {
  REQUIRE_SM90();
  const int64_t m = 512, k = 128, n = 128;
  Buffer a(m * k * 2), b(n * k * 2), out[kWorld];
  upload_bf16(a, random_values(m * k, 5, 1.f));
  upload_bf16(b, random_values(n * k, 6, 0.1f));
  dg_gemm_desc g{};
  g.a = matrix(a.ptr, DG_BF16, m, k);
  g.b = matrix(b.ptr, DG_BF16, n, k);
  g.alpha = 1.f;
  g.config = -1;
  dg_tp_desc probe{};
  probe.gemm = g;
  probe.gemm.d = matrix(nullptr, DG_BF16, kWorld * m, n);
  probe.world = kWorld;
  size_t need = 0;
  ASSERT_EQ(dg_tp_workspace_size(DG_TP_ALL_GATHER_GEMM, &probe, &need), DG_SUCCESS) << dg_last_error();
  for (int r = 0; r < kWorld; ++r) new (&out[r]) Buffer(kWorld * m * n * 2);
  auto make_desc = [&](const LoopbackGroup& group, int r) {
    dg_gemm_desc gr = g;
    gr.d = matrix(out[r].ptr, DG_BF16, kWorld * m, n);
    return group.desc(r, gr, {DG_TP_ALGO_DECOMPOSED, r == 0 ? 2 : 3, 0, 0.0});
  };
  load_each_rank_alone(need, dg_all_gather_gemm, make_desc);
  {
    LoopbackGroup group(need);
    ASSERT_NO_FATAL_FAILURE(call_both(group, dg_all_gather_gemm, make_desc));
    const int word = dg_tp_error(0);
    EXPECT_EQ(word >> 24, 2) << "expected 'another op, algorithm or piece split', error word " << word;
    const std::vector<float> got = download(out[0], kWorld * m * n, DG_BF16);
    EXPECT_TRUE(std::isnan(got[0]) && std::isnan(got.back())) << "a failed call's output must be NaN";
    dg_tp_desc again = group.desc(0, g, {});
    again.gemm.d = matrix(out[0].ptr, DG_BF16, kWorld * m, n);
    EXPECT_EQ(dg_all_gather_gemm(&again, group.streams[0]), DG_ERROR_PEER_MISMATCH);
    EXPECT_NE(std::string(dg_last_error()).find("settings"), std::string::npos) << dg_last_error();
    ASSERT_EQ(dg_tp_clear_error(0), DG_SUCCESS) << dg_last_error();
  }
  {
    LoopbackGroup group(need);  // fresh workspaces, as the recovery contract asks
    dg_gemm_desc g0 = g;
    g0.d = matrix(out[0].ptr, DG_BF16, kWorld * m, n);
    dg_tp_desc d = group.desc(0, g0, {});
    d.timeout_s = 1.0;  // rank 1 never calls
    ASSERT_EQ(dg_all_gather_gemm(&d, group.streams[0]), DG_SUCCESS) << dg_last_error();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(dg_tp_error(0) >> 24, 0) << "expected a timeout, error word " << dg_tp_error(0);
    EXPECT_EQ(dg_all_gather_gemm(&d, group.streams[0]), DG_ERROR_TIMEOUT);
    ASSERT_EQ(dg_tp_clear_error(0), DG_SUCCESS) << dg_last_error();
  }
}

// A peer that arrives after the timeout: rank 0 gives up on its call (and runs the next one it
// had enqueued, with another shard, before its host sees the failure); rank 1 calls only then.
// Rank 1 must fail with a clear error and NaN, never pair its call with the shard of rank 0's
// next call (its flags had moved past this call) or with the copies rank 0 still made. Then
// both continue on the same workspaces zeroed, as recover() leaves a captured one.
TEST(TpLoopback, LatePeerFailsClearlyThenBothContinue) {
  REQUIRE_SM90();
  const int64_t m = 256, k = 128, n = 128;
  const std::vector<float> first = random_values(m * k, 21, 1.f), next = random_values(m * k, 22, 1.f),
                           own = random_values(m * k, 23, 1.f), weights = random_values(n * k, 24, 0.1f);
  Buffer a0_first(m * k * 2), a0_next(m * k * 2), a1(m * k * 2), b(n * k * 2), out[kWorld];
  upload_bf16(a0_first, first);
  upload_bf16(a0_next, next);
  upload_bf16(a1, own);
  upload_bf16(b, weights);
  for (int r = 0; r < kWorld; ++r) new (&out[r]) Buffer(kWorld * m * n * 2);
  const size_t need = all_gather_workspace(a1.ptr, m, k, n);
  ASSERT_GT(need, 0u);
  // Rows [0, m) come from rank 0's first shard, [m, 2m) from rank 1's.
  std::vector<double> want(kWorld * m * n);
  for (int64_t i = 0; i < kWorld * m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const float* row = (i < m ? first.data() + i * k : own.data() + (i - m) * k);
      double acc = 0;
      for (int64_t p = 0; p < k; ++p) acc += double(row[p]) * weights[j * k + p];
      want[i * n + j] = acc;
    }
  for (dg_tp_algo algo : {DG_TP_ALGO_FUSED, DG_TP_ALGO_DECOMPOSED}) {
    SCOPED_TRACE(algo == DG_TP_ALGO_FUSED ? "fused" : "decomposed");
    auto make_desc = [&](const LoopbackGroup& group, int r, const Buffer& a) {
      dg_gemm_desc g{};
      g.a = matrix(a.ptr, DG_BF16, m, k);
      g.b = matrix(b.ptr, DG_BF16, n, k);
      g.d = matrix(out[r].ptr, DG_BF16, kWorld * m, n);
      g.alpha = 1.f;
      g.config = -1;
      dg_tp_desc d = group.desc(r, g, {algo, 1, 0, 0.0});
      d.timeout_s = 1.0;
      return d;
    };
    auto shard = [&](int r) -> const Buffer& { return r == 0 ? a0_first : a1; };
    load_each_rank_alone(need, dg_all_gather_gemm,
                         [&](const LoopbackGroup& group, int r) { return make_desc(group, r, shard(r)); });
    LoopbackGroup group(need);
    const dg_tp_desc d0 = make_desc(group, 0, a0_first), d0_next = make_desc(group, 0, a0_next);
    ASSERT_EQ(dg_all_gather_gemm(&d0, group.streams[0]), DG_SUCCESS) << dg_last_error();
    ASSERT_EQ(dg_all_gather_gemm(&d0_next, group.streams[0]), DG_SUCCESS) << dg_last_error();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(dg_tp_error(0), (0 << 24) | (dg_tp_error(0) & 0xff0000) | 2) << "rank 0 times out waiting for rank 1";
    // One device plays both ranks, so its one error word is rank 1's too: cleared, as rank 1's
    // own GPU would have it.
    ASSERT_EQ(dg_tp_clear_error(0), DG_SUCCESS) << dg_last_error();
    const dg_tp_desc d1 = make_desc(group, 1, a1);
    ASSERT_EQ(dg_all_gather_gemm(&d1, group.streams[1]), DG_SUCCESS) << dg_last_error();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const int word = dg_tp_error(0);
    EXPECT_EQ(word >> 24, 8) << "rank 1 must see that rank 0 gave up on the call, error word " << word;
    EXPECT_EQ(word & 0xffff, 1) << "naming rank 0";
    const std::vector<float> got = download(out[1], kWorld * m * n, DG_BF16);
    int64_t finite = 0;
    for (float v : got) finite += std::isfinite(v);
    EXPECT_EQ(finite, 0) << "the late rank's output must be all NaN (rel error to the right answer "
                         << rel_error(got, want) << ")";
    EXPECT_EQ(dg_all_gather_gemm(&d1, group.streams[1]), DG_ERROR_TIMEOUT);
    EXPECT_NE(std::string(dg_last_error()).find("given up"), std::string::npos) << dg_last_error();

    // Recovered: the error cleared, the workspaces zeroed; both ranks call again.
    ASSERT_EQ(dg_tp_clear_error(0), DG_SUCCESS) << dg_last_error();
    for (int r = 0; r < kWorld; ++r) ASSERT_EQ(cudaMemset(group.ws[r].ptr, 0, need), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_NO_FATAL_FAILURE(call_both(group, dg_all_gather_gemm, [&](const LoopbackGroup& g, int r) {
      dg_tp_desc d = make_desc(g, r, shard(r));
      d.timeout_s = 30.0;
      return d;
    }));
    EXPECT_EQ(dg_tp_error(0), 0);
    for (int r = 0; r < kWorld; ++r)
      EXPECT_LT(rel_error(download(out[r], want.size(), DG_BF16), want), 1e-2) << "rank " << r << " after recovery";
    ASSERT_EQ(dg_tp_clear_error(0), DG_SUCCESS);
  }
}

// A rank that runs the call elsewhere (the collectives fallback) announces it with
// DG_TP_AGREE_ELSEWHERE: ranks that all do so agree on the shape as usual; one rank here and one
// elsewhere both record reason 7 at once (the one here hands back NaN) instead of a timeout.
TEST(TpLoopback, RankRunningElsewhereIsNamed) {
  REQUIRE_SM90();
  const int64_t m = 512, k = 128, n = 128;
  Buffer a(m * k * 2), b(n * k * 2), out[kWorld];
  upload_bf16(a, random_values(m * k, 7, 1.f));
  upload_bf16(b, random_values(n * k, 8, 0.1f));
  for (int r = 0; r < kWorld; ++r) new (&out[r]) Buffer(kWorld * m * n * 2);
  const size_t need = all_gather_workspace(a.ptr, m, k, n);
  ASSERT_GT(need, 0u);
  // rows: this rank's shard rows; mode: 0 (the call) or DG_TP_AGREE_ELSEWHERE
  auto desc = [&](const LoopbackGroup& group, int r, int64_t rows, int mode) {
    dg_gemm_desc g{};
    g.a = matrix(a.ptr, DG_BF16, rows, k);
    g.b = matrix(b.ptr, DG_BF16, n, k);
    g.d = matrix(mode ? nullptr : out[r].ptr, DG_BF16, kWorld * rows, n);
    g.alpha = 1.f;
    g.config = -1;
    dg_tp_desc d = group.desc(r, g, {});
    d.agree_only = mode;
    return d;
  };
  load_each_rank_alone(need, dg_all_gather_gemm,
                       [&](const LoopbackGroup& group, int r) { return desc(group, r, m, 0); });
  auto run = [&](const LoopbackGroup& group, int64_t rows1, int mode0, int mode1) {
    const dg_tp_desc d0 = desc(group, 0, m, mode0), d1 = desc(group, 1, rows1, mode1);
    ASSERT_EQ(dg_all_gather_gemm(&d0, group.streams[0]), DG_SUCCESS) << dg_last_error();
    ASSERT_EQ(dg_all_gather_gemm(&d1, group.streams[1]), DG_SUCCESS) << dg_last_error();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  };
  {
    LoopbackGroup group(need);
    ASSERT_NO_FATAL_FAILURE(run(group, m, DG_TP_AGREE_ELSEWHERE, DG_TP_AGREE_ELSEWHERE));
    EXPECT_EQ(dg_tp_error(0), 0) << "ranks that all run the call elsewhere agree";
    ASSERT_NO_FATAL_FAILURE(run(group, m / 2, DG_TP_AGREE_ELSEWHERE, DG_TP_AGREE_ELSEWHERE));
    EXPECT_EQ(dg_tp_error(0) >> 24, 3) << "rows that differ, error word " << dg_tp_error(0);
    ASSERT_EQ(dg_tp_clear_error(0), DG_SUCCESS) << dg_last_error();
  }
  {
    LoopbackGroup group(need);
    ASSERT_NO_FATAL_FAILURE(run(group, m, 0, DG_TP_AGREE_ELSEWHERE));
    EXPECT_EQ(dg_tp_error(0) >> 24, 7) << "one rank here, one elsewhere, error word " << dg_tp_error(0);
    const std::vector<float> got = download(out[0], kWorld * m * n, DG_BF16);
    EXPECT_TRUE(std::isnan(got[0]) && std::isnan(got.back())) << "the rank here must hand back NaN";
    const dg_tp_desc again = desc(group, 0, m, 0);
    EXPECT_EQ(dg_all_gather_gemm(&again, group.streams[0]), DG_ERROR_PEER_MISMATCH);
    EXPECT_NE(std::string(dg_last_error()).find("elsewhere"), std::string::npos) << dg_last_error();
    ASSERT_EQ(dg_tp_clear_error(0), DG_SUCCESS) << dg_last_error();
  }
}

// Two host threads, one per rank, calling at once on one device: both forks and joins go through
// the device's shared side stream and its fork event. Each iteration a rank's shard is written on
// its stream (behind a large copy, so that it lands late) right before the call; the gathered
// copy must hold every rank's new shard. When one thread recorded the shared fork event between
// the other's record and wait, that rank's pushes waited for the wrong stream and sent the shard
// before it was written (a stress test: the interleaving is a matter of timing).
TEST(TpLoopback, TwoThreadsCallingAtOnceEachPushTheirOwnNewShard) {
  REQUIRE_SM90();
  const int64_t m = 256, k = 128, n = 128;
  const int iterations = 300;
  const size_t delay_bytes = size_t{128} << 20;
  Buffer a[kWorld], b(n * k * 2), out[kWorld], gathered[kWorld], delay_src(delay_bytes), delay_dst[kWorld];
  upload_bf16(b, random_values(n * k, 9, 0.1f));
  for (int r = 0; r < kWorld; ++r) {
    new (&a[r]) Buffer(m * k * 2);
    new (&out[r]) Buffer(kWorld * m * n * 2);
    new (&gathered[r]) Buffer(kWorld * m * k * 2);
    new (&delay_dst[r]) Buffer(delay_bytes);
  }
  const size_t need = all_gather_workspace(a[0].ptr, m, k, n);
  ASSERT_GT(need, 0u);
  auto make_desc = [&](const LoopbackGroup& group, int r) {
    dg_gemm_desc g{};
    g.a = matrix(a[r].ptr, DG_BF16, m, k);
    g.b = matrix(b.ptr, DG_BF16, n, k);
    g.d = matrix(out[r].ptr, DG_BF16, kWorld * m, n);
    g.alpha = 1.f;
    g.config = -1;
    dg_tp_desc d = group.desc(r, g, {DG_TP_ALGO_DECOMPOSED, 1, 0, 0.0});
    d.gathered_out = gathered[r].ptr;
    return d;
  };
  load_each_rank_alone(need, dg_all_gather_gemm, make_desc);
  LoopbackGroup group(need);
  auto pattern = [](int i, int r) { return 1 + (2 * i + r) % 250; };

  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0, generation = 0;
  auto barrier = [&] {
    std::unique_lock<std::mutex> lock(mu);
    const int gen = generation;
    if (++arrived == kWorld) {
      arrived = 0;
      ++generation;
      cv.notify_all();
    } else {
      cv.wait(lock, [&] { return generation != gen; });
    }
  };
  std::atomic<int> stale{0}, failures{0};
  std::string first_problem;
  auto rank_thread = [&](int r) {
    cudaSetDevice(0);
    std::vector<uint16_t> host(kWorld * m * k);
    for (int i = 0; i < iterations; ++i) {
      barrier();  // both threads start the iteration together
      cudaStream_t s = group.streams[r];
      bool ok =
          cudaMemcpyAsync(delay_dst[r].ptr, delay_src.ptr, delay_bytes, cudaMemcpyDeviceToDevice, s) == cudaSuccess &&
          cudaMemsetAsync(a[r].ptr, pattern(i, r), m * k * 2, s) == cudaSuccess;
      const dg_tp_desc d = make_desc(group, r);
      ok = ok && dg_all_gather_gemm(&d, s) == DG_SUCCESS && cudaStreamSynchronize(s) == cudaSuccess &&
           cudaMemcpy(host.data(), gathered[r].ptr, host.size() * 2, cudaMemcpyDeviceToHost) == cudaSuccess;
      if (!ok) {
        std::lock_guard<std::mutex> lock(mu);
        if (failures++ == 0) first_problem = std::string("rank ") + std::to_string(r) + ": " + dg_last_error();
      }
      for (int q = 0; ok && q < kWorld; ++q) {
        const uint16_t want = static_cast<uint16_t>(pattern(i, q) * 0x0101);
        for (int64_t e = 0; e < m * k; ++e)
          if (host[q * m * k + e] != want) {
            ++stale;
            break;
          }
      }
      barrier();  // neither rank rewrites its shard while the other still reads the last one
    }
  };
  std::thread t0(rank_thread, 0), t1(rank_thread, 1);
  t0.join();
  t1.join();
  ASSERT_EQ(failures.load(), 0) << first_problem;
  EXPECT_EQ(stale.load(), 0) << "gathered shards that were pushed before they were written";
  EXPECT_EQ(dg_tp_error(0), 0);
}

}  // namespace

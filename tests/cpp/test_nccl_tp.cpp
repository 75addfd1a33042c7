// distgemm::nccl: the tensor-parallel GEMMs with workspaces set up over NCCL, two ranks as two
// forked processes (one GPU each), against NCCL + cuBLAS run one after the other; a shape that
// differs across ranks is reported as a mismatch (not a timeout); dg_nccl_workspace_create's
// argument checks. The GPU test skips without two sm_90 GPUs; the argument checks run anywhere.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "distgemm/distgemm.h"
#include "distgemm/nccl.h"
#include "nccl_test_helpers.h"

namespace {

// ---------------------------------------------------------------- argument checks (no GPU)

bool last_error_has(const char* text) { return std::string(dg_last_error()).find(text) != std::string::npos; }

TEST(NcclWorkspaceArgs, RefusedBeforeAnyCudaOrNcclCall) {
  // Never dereferenced: every case fails its checks before using it.
  ncclComm_t fake_comm = reinterpret_cast<ncclComm_t>(uintptr_t{0x1000});
  auto* fake_ws = reinterpret_cast<const dg_nccl_workspace*>(uintptr_t{0x2000});
  dg_nccl_workspace* ws = reinterpret_cast<dg_nccl_workspace*>(uintptr_t{0x3000});

  EXPECT_EQ(dg_nccl_workspace_create(nullptr, 1 << 20, 10.0, nullptr, &ws), DG_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(ws, nullptr) << "*out is reset on failure";
  EXPECT_TRUE(last_error_has("comm must not be NULL")) << dg_last_error();

  EXPECT_EQ(dg_nccl_workspace_create(fake_comm, 1 << 20, 10.0, nullptr, nullptr), DG_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("out must not be NULL")) << dg_last_error();

  EXPECT_EQ(dg_nccl_workspace_create(fake_comm, 0, 10.0, nullptr, &ws), DG_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("bytes must be positive")) << dg_last_error();

  for (double t : {0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    EXPECT_EQ(dg_nccl_workspace_create(fake_comm, 1 << 20, t, nullptr, &ws), DG_ERROR_INVALID_ARGUMENT) << t;
    EXPECT_TRUE(last_error_has("timeout_s")) << dg_last_error();
  }

  dg_tp_desc desc{};
  EXPECT_EQ(dg_nccl_tp_bind(nullptr, &desc), DG_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("ws must not be NULL")) << dg_last_error();
  EXPECT_EQ(dg_nccl_tp_bind(fake_ws, nullptr), DG_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("desc must not be NULL")) << dg_last_error();
  EXPECT_EQ(dg_nccl_workspace_bytes(nullptr), 0u);
  EXPECT_EQ(dg_nccl_workspace_destroy(nullptr, nullptr), DG_SUCCESS);
}

// ---------------------------------------------------------------- two ranks

constexpr int kWorld = 2;
constexpr double kTimeoutS = 20.0;               // every wait on the peer
constexpr int64_t kM = 200, kK = 512, kN = 384;  // per-rank rows, K, N: odd tile counts
constexpr int64_t kMismatchRows[kWorld] = {256, 128};

// Prints "[rank r] ..." and returns `code` (the child's exit code names the failing step).
int child_fail(int rank, int code, const char* fmt, ...) {
  std::fprintf(stderr, "[rank %d] ", rank);
  va_list args;
  va_start(args, fmt);
  std::vfprintf(stderr, fmt, args);
  va_end(args);
  std::fprintf(stderr, " (dg_last_error: %s)\n", dg_last_error());
  return code;
}

struct Device {  // device buffers of one rank, freed at exit of the child anyway
  void* alloc(size_t bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) return nullptr;
    ptrs.push_back(p);
    return p;
  }
  ~Device() {
    for (void* p : ptrs) cudaFree(p);
  }
  std::vector<void*> ptrs;
};

dg_tp_desc make_desc(const void* a, int64_t a_rows, int64_t a_cols, const void* b, int64_t n, void* d, int64_t d_rows,
                     dg_tp_algo algo) {
  dg_tp_desc desc{};
  desc.gemm.a = dgtest::bf16_matrix(a, a_rows, a_cols);
  desc.gemm.b = dgtest::bf16_matrix(b, n, a_cols);
  desc.gemm.d = dgtest::bf16_matrix(d, d_rows, n);
  desc.gemm.c = {nullptr, DG_BF16, 0, 0, 0, 0};
  desc.gemm.alpha = 1.f;
  desc.gemm.config = -1;
  desc.world = kWorld;
  desc.timeout_s = kTimeoutS;
  desc.settings.algo = algo;
  return desc;
}

// One rank: returns 0, or the failing step's code.
int rank_main(int rank, const ncclUniqueId& id) {
  if (cudaSetDevice(rank) != cudaSuccess) return child_fail(rank, 10, "cudaSetDevice");
  ncclComm_t comm = nullptr;
  if (ncclCommInitRank(&comm, kWorld, id, rank) != ncclSuccess) return child_fail(rank, 11, "ncclCommInitRank");
  cudaStream_t stream;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess)
    return child_fail(rank, 12, "cudaStreamCreate");
  cublasHandle_t cublas;
  if (cublasCreate(&cublas) != CUBLAS_STATUS_SUCCESS || cublasSetStream(cublas, stream) != CUBLAS_STATUS_SUCCESS)
    return child_fail(rank, 13, "cublasCreate");

  dg_nccl_workspace* ws = nullptr;
  if (dg_nccl_workspace_create(nullptr, 1 << 20, kTimeoutS, stream, &ws) != DG_ERROR_INVALID_ARGUMENT || ws)
    return child_fail(rank, 14, "NULL comm was not refused");

  // Inputs: all-gather + GEMM (a: this rank's rows; sized for the mismatch's 256 rows too),
  // GEMM + reduce-scatter (a: every rank's rows, this rank's K shard).
  const int64_t m_max = kMismatchRows[0];
  Device dev;
  auto* ag_a = dev.alloc(m_max * kK * 2);
  auto* ag_b = dev.alloc(kN * kK * 2);
  auto* ag_d = dev.alloc(kWorld * m_max * kN * 2);
  auto* ag_gathered = dev.alloc(kWorld * kM * kK * 2);
  auto* ag_ref = dev.alloc(kWorld * kM * kN * 2);
  auto* rs_a = dev.alloc(kWorld * kM * kK * 2);
  auto* rs_b = dev.alloc(kN * kK * 2);
  auto* rs_d = dev.alloc(kM * kN * 2);
  auto* rs_partial = dev.alloc(kWorld * kM * kN * 2);
  auto* rs_ref = dev.alloc(kM * kN * 2);
  if (dev.ptrs.size() != 10) return child_fail(rank, 15, "cudaMalloc");
  const uint64_t seed = 77 + 10 * uint64_t(rank);
  auto upload = [](void* d, const std::vector<__nv_bfloat16>& h) {
    return cudaMemcpy(d, h.data(), h.size() * 2, cudaMemcpyHostToDevice) == cudaSuccess;
  };
  if (!upload(ag_a, dgtest::random_bf16(m_max * kK, seed, 1.f)) ||
      !upload(ag_b, dgtest::random_bf16(kN * kK, seed + 1, 0.05f)) ||
      !upload(rs_a, dgtest::random_bf16(kWorld * kM * kK, seed + 2, 1.f)) ||
      !upload(rs_b, dgtest::random_bf16(kN * kK, seed + 3, 0.05f)))
    return child_fail(rank, 16, "upload");

  // One workspace for every call below (the same size on both ranks).
  size_t need = 0;
  for (int64_t rows : {kM, m_max}) {
    size_t bytes = 0;
    dg_tp_desc ag = make_desc(ag_a, rows, kK, ag_b, kN, ag_d, kWorld * rows, DG_TP_ALGO_AUTO);
    if (dg_tp_workspace_size(DG_TP_ALL_GATHER_GEMM, &ag, &bytes) != DG_SUCCESS)
      return child_fail(rank, 17, "dg_tp_workspace_size (all-gather)");
    need = std::max(need, bytes);
  }
  {
    size_t bytes = 0;
    dg_tp_desc rs = make_desc(rs_a, kWorld * kM, kK, rs_b, kN, rs_d, kM, DG_TP_ALGO_AUTO);
    if (dg_tp_workspace_size(DG_TP_GEMM_REDUCE_SCATTER, &rs, &bytes) != DG_SUCCESS)
      return child_fail(rank, 18, "dg_tp_workspace_size (reduce-scatter)");
    need = std::max(need, bytes);
  }
  if (dg_nccl_workspace_create(comm, need, kTimeoutS, stream, &ws) != DG_SUCCESS || !ws)
    return child_fail(rank, 19, "dg_nccl_workspace_create");
  if (dg_nccl_workspace_bytes(ws) < need) return child_fail(rank, 20, "workspace smaller than asked");

  // The references, once.
  if (ncclAllGather(ag_a, ag_gathered, kM * kK, ncclBfloat16, comm, stream) != ncclSuccess ||
      dgtest::reference_gemm(cublas, ag_gathered, ag_b, ag_ref, kWorld * kM, kN, kK) != CUBLAS_STATUS_SUCCESS ||
      dgtest::reference_gemm(cublas, rs_a, rs_b, rs_partial, kWorld * kM, kN, kK) != CUBLAS_STATUS_SUCCESS ||
      ncclReduceScatter(rs_partial, rs_ref, kM * kN, ncclBfloat16, ncclSum, comm, stream) != ncclSuccess ||
      dgtest::wait_stream(stream, 60) != cudaSuccess)
    return child_fail(rank, 21, "reference");

  int code = 30;
  for (dg_tp_algo algo : {DG_TP_ALGO_FUSED, DG_TP_ALGO_DECOMPOSED}) {
    const char* name = algo == DG_TP_ALGO_FUSED ? "fused" : "decomposed";
    dg_tp_desc ag = make_desc(ag_a, kM, kK, ag_b, kN, ag_d, kWorld * kM, algo);
    dg_tp_desc rs = make_desc(rs_a, kWorld * kM, kK, rs_b, kN, rs_d, kM, algo);
    if (dg_nccl_tp_bind(ws, &ag) != DG_SUCCESS || dg_nccl_tp_bind(ws, &rs) != DG_SUCCESS)
      return child_fail(rank, code, "dg_nccl_tp_bind");
    if (ag.rank != rank || ag.world != kWorld || ag.peer_workspaces == nullptr ||
        ag.workspace_bytes != dg_nccl_workspace_bytes(ws))
      return child_fail(rank, code + 1, "dg_nccl_tp_bind filled rank %d world %d", ag.rank, ag.world);
    if (cudaMemsetAsync(ag_d, 0xff, kWorld * kM * kN * 2, stream) != cudaSuccess ||
        cudaMemsetAsync(rs_d, 0xff, kM * kN * 2, stream) != cudaSuccess)  // NaN: every element written
      return child_fail(rank, code + 2, "cudaMemset");
    if (dg_all_gather_gemm(&ag, stream) != DG_SUCCESS) return child_fail(rank, code + 3, "%s all-gather", name);
    if (dg_gemm_reduce_scatter(&rs, stream) != DG_SUCCESS) return child_fail(rank, code + 4, "%s reduce-scatter", name);
    if (dgtest::wait_stream(stream, 3 * kTimeoutS) != cudaSuccess)
      return child_fail(rank, code + 5, "%s: stream did not finish", name);
    if (const int err = dg_tp_error(rank)) return child_fail(rank, code + 6, "%s: dg_tp_error 0x%x", name, err);
    const double ag_err = dgtest::max_rel_error(ag_d, ag_ref, kWorld * kM * kN);
    const double rs_err = dgtest::max_rel_error(rs_d, rs_ref, kM * kN);
    if (!(ag_err >= 0 && ag_err < 2e-2)) return child_fail(rank, code + 7, "%s all-gather rel err %g", name, ag_err);
    if (!(rs_err >= 0 && rs_err < 2e-2))
      return child_fail(rank, code + 8, "%s reduce-scatter rel err %g", name, rs_err);
    code += 10;
  }

  // Rows that differ across ranks (after agreeing calls): a mismatch on both ranks, found by the
  // comparison well before the timeout; later calls are refused until the error is cleared.
  {
    const int64_t rows = kMismatchRows[rank];
    dg_tp_desc ag = make_desc(ag_a, rows, kK, ag_b, kN, ag_d, kWorld * rows, DG_TP_ALGO_AUTO);
    dg_nccl_tp_bind(ws, &ag);
    const auto start = std::chrono::steady_clock::now();
    const dg_status st = dg_all_gather_gemm(&ag, stream);
    if (st != DG_SUCCESS && st != DG_ERROR_PEER_MISMATCH)
      return child_fail(rank, 50, "mismatched call returned %s", dg_status_name(st));
    if (dgtest::wait_stream(stream, 3 * kTimeoutS) != cudaSuccess) return child_fail(rank, 51, "stream after mismatch");
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const int err = dg_tp_error(rank);
    if (err == 0) return child_fail(rank, 52, "dg_tp_error is 0 after a mismatched call");
    if ((err >> 24) == 0) return child_fail(rank, 53, "dg_tp_error 0x%x: a timeout, not a mismatch", err);
    if (seconds >= kTimeoutS) return child_fail(rank, 54, "mismatch found only after %.1f s", seconds);
    dg_tp_desc again = make_desc(ag_a, kM, kK, ag_b, kN, ag_d, kWorld * kM, DG_TP_ALGO_AUTO);
    dg_nccl_tp_bind(ws, &again);
    const dg_status next = dg_all_gather_gemm(&again, stream);
    if (next != DG_ERROR_PEER_MISMATCH)
      return child_fail(rank, 55, "the call after a mismatch returned %s, not DG_ERROR_PEER_MISMATCH",
                        dg_status_name(next));
    if (dg_tp_clear_error(rank) != DG_SUCCESS) return child_fail(rank, 56, "dg_tp_clear_error");
  }

  if (dg_nccl_workspace_destroy(ws, stream) != DG_SUCCESS) return child_fail(rank, 60, "dg_nccl_workspace_destroy");
  cublasDestroy(cublas);
  cudaStreamDestroy(stream);
  if (ncclCommDestroy(comm) != ncclSuccess) return child_fail(rank, 61, "ncclCommDestroy");
  return 0;
}

TEST(NcclTp, TwoRanksMatchNcclCublasAndReportMismatchedShapes) {
  // Counted in a child: this process forks the ranks and must not start CUDA itself.
  const int gpus = dgtest::count_sm90_gpus_in_child();
  if (gpus < kWorld) GTEST_SKIP() << "needs " << kWorld << " sm_90 GPUs, found " << gpus;
  setenv("NCCL_NVLS_ENABLE", "0", 0);  // no NVLink multicast
  unsetenv("NCCL_COMM_ID");            // the id below (its bootstrap root lives in this process)
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  const auto outcomes = dgtest::run_ranks(kWorld, 120.0, [&](int rank) { return rank_main(rank, id); });
  for (int r = 0; r < kWorld; ++r) EXPECT_TRUE(outcomes[r].ok) << "rank " << r << ": " << outcomes[r].what;
}

}  // namespace

// Tensor-parallel GEMMs from C++ over NCCL (distgemm::nccl): an MLP's two GEMMs at TP = world,
//   fc1, all-gather + GEMM:     y (M, F/world)    = all_gather(x shard (M/world, H)) @ w1 shard^T
//   fc2, GEMM + reduce-scatter: z (M/world, H)    = reduce_scatter(y (M, F/world) @ w2 shard^T)
// (M tokens, hidden H, FFN width F; default Llama-3 70B: M = 8192, H = 8192, F = 28672), each
// checked against NCCL + cuBLAS run one after the other, and timed against them.
//
// One process per GPU. Launched by torchrun / mpirun / srun (RANK and WORLD_SIZE,
// OMPI_COMM_WORLD_RANK/SIZE or SLURM_PROCID/NTASKS set) it is one rank: NCCL_COMM_ID=host:port
// names the bootstrap (every rank's ncclGetUniqueId then returns the same id and rank 0 serves
// it; without it, MASTER_ADDR:MASTER_PORT+1). Started alone, it forks one rank per visible GPU
// (--world N for fewer). Without two sm_90 GPUs it says so and exits 0.
//
//   tp_gemm [--world N] [--m M] [--k H] [--n F] [--algo auto|fused|decomposed] [--timeout S]
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <distgemm/distgemm.h>
#include <distgemm/nccl.h>
#include <nccl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

int g_rank = -1;  // for messages

#define CHECK_CUDA(expr)                                                                   \
  do {                                                                                     \
    cudaError_t err_ = (expr);                                                             \
    if (err_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "[rank %d] %s: %s\n", g_rank, #expr, cudaGetErrorString(err_)); \
      return 1;                                                                            \
    }                                                                                      \
  } while (0)
#define CHECK_NCCL(expr)                                                                   \
  do {                                                                                     \
    ncclResult_t res_ = (expr);                                                            \
    if (res_ != ncclSuccess) {                                                             \
      std::fprintf(stderr, "[rank %d] %s: %s\n", g_rank, #expr, ncclGetErrorString(res_)); \
      return 1;                                                                            \
    }                                                                                      \
  } while (0)
#define CHECK_CUBLAS(expr)                                                               \
  do {                                                                                   \
    cublasStatus_t st_ = (expr);                                                         \
    if (st_ != CUBLAS_STATUS_SUCCESS) {                                                  \
      std::fprintf(stderr, "[rank %d] %s: cuBLAS status %d\n", g_rank, #expr, int(st_)); \
      return 1;                                                                          \
    }                                                                                    \
  } while (0)
#define CHECK_DG(expr)                                                                                  \
  do {                                                                                                  \
    dg_status st_ = (expr);                                                                             \
    if (st_ != DG_SUCCESS) {                                                                            \
      int dev_ = 0;                                                                                     \
      cudaGetDevice(&dev_);                                                                             \
      std::fprintf(stderr, "[rank %d] %s: %s (%s; dg_tp_error 0x%x)\n", g_rank, #expr, dg_last_error(), \
                   dg_status_name(st_), unsigned(dg_tp_error(dev_)));                                   \
      return 1;                                                                                         \
    }                                                                                                   \
  } while (0)

struct Options {
  int world = 0;          // self-launch: ranks to fork (0: every visible GPU)
  int64_t tokens = 8192;  // M
  int64_t hidden = 8192;  // H
  int64_t ffn = 28672;    // F
  dg_tp_algo algo = DG_TP_ALGO_AUTO;
  double timeout_s = 600;
};

bool parse(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const char* val = i + 1 < argc ? argv[i + 1] : nullptr;
    auto need = [&]() {
      if (!val) std::fprintf(stderr, "%s needs a value\n", arg.c_str());
      return val != nullptr;
    };
    if (arg == "--world" && need())
      o->world = std::atoi(val), ++i;
    else if (arg == "--m" && need())
      o->tokens = std::atoll(val), ++i;
    else if (arg == "--k" && need())
      o->hidden = std::atoll(val), ++i;
    else if (arg == "--n" && need())
      o->ffn = std::atoll(val), ++i;
    else if (arg == "--timeout" && need())
      o->timeout_s = std::atof(val), ++i;
    else if (arg == "--algo" && need()) {
      const std::string a = val;
      ++i;
      if (a == "auto")
        o->algo = DG_TP_ALGO_AUTO;
      else if (a == "fused")
        o->algo = DG_TP_ALGO_FUSED;
      else if (a == "decomposed")
        o->algo = DG_TP_ALGO_DECOMPOSED;
      else
        return std::fprintf(stderr, "--algo: auto, fused or decomposed, not %s\n", val), false;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--world N] [--m tokens] [--k hidden] [--n ffn] "
                   "[--algo auto|fused|decomposed] [--timeout seconds]\n",
                   argv[0]);
      return false;
    }
  }
  if (o->tokens <= 0 || o->hidden <= 0 || o->ffn <= 0 || !(o->timeout_s > 0) || !std::isfinite(o->timeout_s)) {
    std::fprintf(stderr, "--m, --k, --n and --timeout must be positive\n");
    return false;
  }
  return true;
}

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

// Deterministic bf16 values in [-scale, scale) (splitmix64 of seed and index).
std::vector<__nv_bfloat16> random_bf16(size_t count, uint64_t seed, float scale) {
  std::vector<__nv_bfloat16> v(count);
  for (size_t i = 0; i < count; ++i) {
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + i + 1;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    v[i] = __float2bfloat16(scale * (float(z >> 40) / float(1 << 23) - 1.f));
  }
  return v;
}

// A device buffer of `count` bf16 (freed on scope exit).
struct DeviceBuffer {
  __nv_bfloat16* ptr = nullptr;
  size_t count = 0;
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  cudaError_t alloc(size_t n) {
    count = n;
    return cudaMalloc(&ptr, n * sizeof(__nv_bfloat16));
  }
  cudaError_t upload(const std::vector<__nv_bfloat16>& h) {
    return cudaMemcpy(ptr, h.data(), h.size() * sizeof(h[0]), cudaMemcpyHostToDevice);
  }
};

dg_matrix mat(const void* p, int64_t rows, int64_t cols) { return {p, DG_BF16, rows, cols, cols, 1}; }

// Row-major D (rows, n) = A (rows, k) @ B (n, k)^T in bf16 with fp32 accumulation: column-major,
// D^T (n, rows) = B^T^T A^T.
cublasStatus_t reference_gemm(cublasHandle_t h, const void* a, const void* b, void* d, int64_t rows, int64_t n,
                              int64_t k) {
  const float one = 1.f, zero = 0.f;
  return cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(rows), int(k), &one, b, CUDA_R_16BF, int(k), a,
                      CUDA_R_16BF, int(k), &zero, d, CUDA_R_16BF, int(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

// max |out - ref| / max |ref| over two device buffers of `count` bf16.
int max_rel_error(const DeviceBuffer& out, const DeviceBuffer& ref, double* rel) {
  std::vector<__nv_bfloat16> o(out.count), r(ref.count);
  CHECK_CUDA(cudaMemcpy(o.data(), out.ptr, o.size() * sizeof(o[0]), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(r.data(), ref.ptr, r.size() * sizeof(r[0]), cudaMemcpyDeviceToHost));
  double err = 0, mag = 0;
  for (size_t i = 0; i < o.size(); ++i) {
    const double x = __bfloat162float(o[i]), y = __bfloat162float(r[i]);
    err = std::isnan(x) ? INFINITY : std::max(err, std::fabs(x - y));
    mag = std::max(mag, std::fabs(y));
  }
  *rel = err / (mag > 0 ? mag : 1.0);
  return 0;
}

// Every rank has reached this point on `stream` (and the host waited for it).
int barrier(ncclComm_t comm, cudaStream_t stream, int* flag) {
  CHECK_NCCL(ncclAllReduce(flag, flag, 1, ncclInt32, ncclSum, comm, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  return 0;
}

// Milliseconds per call of `op` (5 warm-up calls, then 20 timed), the slowest rank's.
template <class Op>
int time_op(ncclComm_t comm, cudaStream_t stream, int* flag, float* scratch, Op op, double* ms) {
  for (int i = 0; i < 5; ++i)
    if (op()) return 1;
  if (barrier(comm, stream, flag)) return 1;
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  const int iters = 20;
  CHECK_CUDA(cudaEventRecord(start, stream));
  for (int i = 0; i < iters; ++i)
    if (op()) return 1;
  CHECK_CUDA(cudaEventRecord(stop, stream));
  CHECK_CUDA(cudaEventSynchronize(stop));
  float total = 0.f;
  CHECK_CUDA(cudaEventElapsedTime(&total, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  float per_call = total / iters;
  CHECK_CUDA(cudaMemcpy(scratch, &per_call, sizeof(float), cudaMemcpyHostToDevice));
  CHECK_NCCL(ncclAllReduce(scratch, scratch, 1, ncclFloat32, ncclMax, comm, stream));
  CHECK_CUDA(cudaMemcpyAsync(&per_call, scratch, sizeof(float), cudaMemcpyDeviceToHost, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  *ms = per_call;
  return barrier(comm, stream, flag);
}

void report(int rank, const char* name, int64_t m, int64_t n, int64_t k, double ours_ms, double seq_ms, double rel) {
  if (rank != 0) return;
  const double tflops = 2.0 * double(m) * double(n) * double(k) / (ours_ms * 1e-3) / 1e12;
  std::printf(
      "%-22s M=%-6lld N=%-6lld K=%-6lld  distgemm %8.3f ms %6.0f TFLOP/s | NCCL + cuBLAS %8.3f ms | "
      "x%.2f | max rel err %.1e\n",
      name, (long long)m, (long long)n, (long long)k, ours_ms, tflops, seq_ms, seq_ms / ours_ms, rel);
}

// One rank: fc1 (all-gather + GEMM) and fc2 (GEMM + reduce-scatter), checked and timed.
int run_rank(int rank, int world, int device, const ncclUniqueId& id, const Options& o) {
  g_rank = rank;
  if (o.tokens % world || o.ffn % world) {
    std::fprintf(stderr, "[rank %d] --m (%lld) and --n (%lld) must be multiples of the world size %d\n", rank,
                 (long long)o.tokens, (long long)o.ffn, world);
    return 1;
  }
  CHECK_CUDA(cudaSetDevice(device));
  ncclComm_t comm = nullptr;
  CHECK_NCCL(ncclCommInitRank(&comm, world, id, rank));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasHandle_t cublas;
  CHECK_CUBLAS(cublasCreate(&cublas));
  CHECK_CUBLAS(cublasSetStream(cublas, stream));
  int* flag = nullptr;
  float* scratch = nullptr;
  CHECK_CUDA(cudaMalloc(&flag, sizeof(int)));
  CHECK_CUDA(cudaMemset(flag, 0, sizeof(int)));
  CHECK_CUDA(cudaMalloc(&scratch, sizeof(float)));

  const int64_t M = o.tokens, m = M / world, H = o.hidden, Fs = o.ffn / world;
  const uint64_t seed = 1000 + uint64_t(rank);
  // fc1: x shard (m, H), w1 shard (Fs, H) -> y (M, Fs). fc2: y (M, Fs), w2 shard (H, Fs) -> z (m, H).
  DeviceBuffer x, w1, y, y_ref, x_all, w2, z, z_ref, partial;
  CHECK_CUDA(x.alloc(size_t(m) * H));
  CHECK_CUDA(w1.alloc(size_t(Fs) * H));
  CHECK_CUDA(y.alloc(size_t(M) * Fs));
  CHECK_CUDA(y_ref.alloc(size_t(M) * Fs));
  CHECK_CUDA(x_all.alloc(size_t(M) * H));
  CHECK_CUDA(w2.alloc(size_t(H) * Fs));
  CHECK_CUDA(z.alloc(size_t(m) * H));
  CHECK_CUDA(z_ref.alloc(size_t(m) * H));
  CHECK_CUDA(partial.alloc(size_t(M) * H));
  CHECK_CUDA(x.upload(random_bf16(x.count, seed, 1.f)));
  CHECK_CUDA(w1.upload(random_bf16(w1.count, seed + 100, 1.f / std::sqrt(float(H)))));
  CHECK_CUDA(w2.upload(random_bf16(w2.count, seed + 200, 1.f / std::sqrt(float(Fs)))));

  dg_tp_desc ag{};
  ag.gemm.a = mat(x.ptr, m, H);
  ag.gemm.b = mat(w1.ptr, Fs, H);
  ag.gemm.d = mat(y.ptr, M, Fs);
  ag.gemm.c = {nullptr, DG_BF16, 0, 0, 0, 0};
  ag.gemm.alpha = 1.f;
  ag.gemm.beta = 0.f;
  ag.gemm.config = -1;
  ag.world = world;
  ag.timeout_s = o.timeout_s;
  ag.settings.algo = o.algo;
  dg_tp_desc rs{};
  rs.gemm.a = mat(y_ref.ptr, M, Fs);  // the reference fc1 output: both paths reduce the same input
  rs.gemm.b = mat(w2.ptr, H, Fs);
  rs.gemm.d = mat(z.ptr, m, H);
  rs.gemm.c = {nullptr, DG_BF16, 0, 0, 0, 0};
  rs.gemm.alpha = 1.f;
  rs.gemm.beta = 0.f;
  rs.gemm.config = -1;
  rs.world = world;
  rs.timeout_s = o.timeout_s;
  rs.settings.algo = o.algo;

  size_t ag_bytes = 0, rs_bytes = 0;
  CHECK_DG(dg_tp_workspace_size(DG_TP_ALL_GATHER_GEMM, &ag, &ag_bytes));
  CHECK_DG(dg_tp_workspace_size(DG_TP_GEMM_REDUCE_SCATTER, &rs, &rs_bytes));
  dg_nccl_workspace* ws = nullptr;
  CHECK_DG(dg_nccl_workspace_create(comm, std::max(ag_bytes, rs_bytes), o.timeout_s, stream, &ws));
  CHECK_DG(dg_nccl_tp_bind(ws, &ag));
  CHECK_DG(dg_nccl_tp_bind(ws, &rs));
  if (rank == 0)
    std::printf("distgemm %s, %d ranks, workspace %.1f MiB per rank, algo %s\n", dg_get_version(), world,
                dg_nccl_workspace_bytes(ws) / 1048576.0,
                o.algo == DG_TP_ALGO_FUSED        ? "fused"
                : o.algo == DG_TP_ALGO_DECOMPOSED ? "decomposed"
                                                  : "auto");

  // The sequential references: NCCL, then cuBLAS (or cuBLAS, then NCCL).
  auto seq_ag = [&]() -> int {
    CHECK_NCCL(ncclAllGather(x.ptr, x_all.ptr, x.count, ncclBfloat16, comm, stream));
    CHECK_CUBLAS(reference_gemm(cublas, x_all.ptr, w1.ptr, y_ref.ptr, M, Fs, H));
    return 0;
  };
  auto seq_rs = [&]() -> int {
    CHECK_CUBLAS(reference_gemm(cublas, y_ref.ptr, w2.ptr, partial.ptr, M, H, Fs));
    CHECK_NCCL(ncclReduceScatter(partial.ptr, z_ref.ptr, z_ref.count, ncclBfloat16, ncclSum, comm, stream));
    return 0;
  };
  auto ours_ag = [&]() -> int {
    CHECK_DG(dg_all_gather_gemm(&ag, stream));
    return 0;
  };
  auto ours_rs = [&]() -> int {
    CHECK_DG(dg_gemm_reduce_scatter(&rs, stream));
    return 0;
  };

  // Correctness first (one call each), then timing.
  if (seq_ag() || ours_ag() || seq_rs() || ours_rs()) return 1;
  CHECK_CUDA(cudaStreamSynchronize(stream));
  if (const int e = dg_tp_error(device)) {
    std::fprintf(stderr, "[rank %d] dg_tp_error 0x%x after the first calls\n", rank, unsigned(e));
    return 1;
  }
  double ag_err = 0, rs_err = 0;
  if (max_rel_error(y, y_ref, &ag_err) || max_rel_error(z, z_ref, &rs_err)) return 1;
  // Every rank's worst error, so that all agree on the outcome.
  {
    float errs[2] = {float(ag_err), float(rs_err)};
    float* d_errs = nullptr;
    CHECK_CUDA(cudaMalloc(&d_errs, sizeof(errs)));
    CHECK_CUDA(cudaMemcpy(d_errs, errs, sizeof(errs), cudaMemcpyHostToDevice));
    CHECK_NCCL(ncclAllReduce(d_errs, d_errs, 2, ncclFloat32, ncclMax, comm, stream));
    CHECK_CUDA(cudaMemcpyAsync(errs, d_errs, sizeof(errs), cudaMemcpyDeviceToHost, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    cudaFree(d_errs);
    ag_err = std::isnan(errs[0]) ? INFINITY : errs[0];
    rs_err = std::isnan(errs[1]) ? INFINITY : errs[1];
  }

  double ag_ms = 0, ag_seq_ms = 0, rs_ms = 0, rs_seq_ms = 0;
  if (time_op(comm, stream, flag, scratch, ours_ag, &ag_ms) ||
      time_op(comm, stream, flag, scratch, seq_ag, &ag_seq_ms) ||
      time_op(comm, stream, flag, scratch, ours_rs, &rs_ms) || time_op(comm, stream, flag, scratch, seq_rs, &rs_seq_ms))
    return 1;
  report(rank, "fc1 all-gather + GEMM", M, Fs, H, ag_ms, ag_seq_ms, ag_err);
  report(rank, "fc2 GEMM + red.-scat.", M, H, Fs, rs_ms, rs_seq_ms, rs_err);
  std::fflush(stdout);

  CHECK_DG(dg_nccl_workspace_destroy(ws, stream));
  cudaFree(flag);
  cudaFree(scratch);
  cublasDestroy(cublas);
  cudaStreamDestroy(stream);
  CHECK_NCCL(ncclCommDestroy(comm));
  const double tol = 2e-2;
  if (ag_err > tol || rs_err > tol) {
    std::fprintf(stderr,
                 "[rank %d] max relative error above %.0e: all-gather + GEMM %.2e, GEMM + "
                 "reduce-scatter %.2e\n",
                 rank, tol, ag_err, rs_err);
    return 2;
  }
  return 0;
}

// How many of this process's first GPUs are sm_90 (0 when CUDA cannot start): ranks take
// GPUs 0, 1, ... in order.
int count_sm90(int* visible) {
  int devices = 0;
  *visible = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) return 0;
  *visible = devices;
  int n = 0;
  for (int major = 0; n < devices; ++n)
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, n) != cudaSuccess || major != 9) break;
  return n;
}

// The sm_90 GPUs counted in a child process, so that this one forks before CUDA starts.
int count_sm90_in_child() {
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return 0;
  if (pid == 0) {
    int visible = 0;
    _exit(std::min(count_sm90(&visible), 100));
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return 0;
  return WEXITSTATUS(status);
}

// Launched by torchrun / mpirun / srun: this process is one rank.
int run_launched(int rank, int world, int local_rank, const Options& o) {
  g_rank = rank;
  int visible = 0;
  const int sm90 = count_sm90(&visible);
  if (world < 2 || sm90 < 1 || local_rank >= visible) {
    std::printf(
        "[rank %d] needs a world of >= 2 ranks with one sm_90 GPU each (world %d, %d GPUs visible, "
        "%d sm_90): nothing to run\n",
        rank, world, visible, sm90);
    return 0;
  }
  const int device = local_rank % visible;
  int major = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major != 9) {
    std::printf("[rank %d] GPU %d is not sm_90: nothing to run\n", rank, device);
    return 0;
  }
  std::string comm_id;
  if (!env("NCCL_COMM_ID")) {
    const char* addr = env("MASTER_ADDR");
    const char* port = env("MASTER_PORT");
    if (!addr || !port) {
      std::fprintf(stderr,
                   "[rank %d] set NCCL_COMM_ID=host:port (a free port on rank 0's host) for the NCCL "
                   "bootstrap\n",
                   rank);
      return 1;
    }
    comm_id = std::string(addr) + ":" + std::to_string(std::atoi(port) + 1);
    setenv("NCCL_COMM_ID", comm_id.c_str(), 1);
    if (rank == 0) std::printf("NCCL_COMM_ID=%s (MASTER_ADDR:MASTER_PORT+1)\n", comm_id.c_str());
  }
  // With NCCL_COMM_ID set, ncclGetUniqueId encodes that address: every rank gets the same id.
  ncclUniqueId id;
  CHECK_NCCL(ncclGetUniqueId(&id));
  return run_rank(rank, world, device, id, o);
}

// Started alone: one forked rank per GPU; the parent collects their exit statuses (bounded).
int run_forked(const Options& o) {
  const int gpus = count_sm90_in_child();  // before anything here starts CUDA
  if (gpus < 2) {
    std::printf("needs >= 2 sm_90 GPUs, found %d: nothing to run\n", gpus);
    return 0;
  }
  const int world = o.world ? o.world : gpus;
  if (world < 2 || world > gpus) {
    std::fprintf(stderr, "--world %d: between 2 and the %d sm_90 GPUs\n", world, gpus);
    return 2;
  }
  ncclUniqueId id;  // the bootstrap root lives in this process: it waits for the ranks below
  {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) {
      std::fprintf(stderr, "ncclGetUniqueId: %s\n", ncclGetErrorString(r));
      return 1;
    }
  }
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("fork");
      for (pid_t p : pids) kill(p, SIGKILL);
      for (pid_t p : pids) waitpid(p, nullptr, 0);
      return 1;
    }
    if (pid == 0) {
      const int code = run_rank(r, world, r, id, o);
      std::fflush(nullptr);
      _exit(code);
    }
    pids.push_back(pid);
  }
  // Bounded: the TP timeout, plus set-up and timing; a failed rank gives the others 30 s.
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration<double>(o.timeout_s + 600);
  auto failed_at = clock::time_point::max();
  int result = 0;
  size_t running = pids.size();
  while (running) {
    for (size_t r = 0; r < pids.size(); ++r) {
      if (pids[r] <= 0) continue;
      int status = 0;
      const pid_t got = waitpid(pids[r], &status, WNOHANG);
      if (got == 0) continue;
      if (got < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        if (got < 0)
          std::fprintf(stderr, "waitpid(rank %zu) failed\n", r);
        else if (WIFSIGNALED(status))
          std::fprintf(stderr, "rank %zu died of signal %d\n", r, WTERMSIG(status));
        else
          std::fprintf(stderr, "rank %zu exited with status %d\n", r, WEXITSTATUS(status));
        result = 1;
        failed_at = std::min(failed_at, clock::now());
      }
      pids[r] = 0;
      --running;
    }
    if (!running) break;
    const auto now = clock::now();
    if (now > deadline || (failed_at != clock::time_point::max() && now - failed_at > std::chrono::seconds(30))) {
      std::fprintf(stderr, "%s: killing the %zu ranks still running\n", now > deadline ? "timed out" : "a rank failed",
                   running);
      for (pid_t p : pids)
        if (p > 0) kill(p, SIGKILL);
      for (pid_t p : pids)
        if (p > 0) waitpid(p, nullptr, 0);
      return 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return result;
}

int env_int(const char* a, const char* b, const char* c, int fallback) {
  for (const char* name : {a, b, c})
    if (const char* v = env(name)) return std::atoi(v);
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, &o)) return 2;
  setenv("NCCL_NVLS_ENABLE", "0", 0);  // no NVLink multicast objects (unless the caller chose)
  std::printf("distgemm %s (headers %s)\n", dg_get_version(), DG_VERSION_STRING);
  const int rank = env_int("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", -1);
  const int world = env_int("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", -1);
  if (rank >= 0 && world >= 1) {
    if (rank >= world) {
      std::fprintf(stderr, "rank %d out of range for world size %d\n", rank, world);
      return 2;
    }
    const int local = env_int("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", rank);
    return run_launched(rank, world, local, o);
  }
  return run_forked(o);
}

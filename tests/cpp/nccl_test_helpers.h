// Helpers of the multi-process C++ tests (distgemm::nccl): ranks as forked child processes that
// report through their exit codes, a GPU count taken without starting CUDA in the parent, and
// the sequential NCCL + cuBLAS references of the tensor-parallel GEMMs.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "distgemm/distgemm.h"

namespace dgtest {

// How many of the first GPUs are sm_90, counted in a forked child: the caller (which forks the
// ranks later) must not start CUDA itself. 0 when CUDA cannot start.
inline int count_sm90_gpus_in_child() {
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return 0;
  if (pid == 0) {
    int devices = 0, n = 0;
    if (cudaGetDeviceCount(&devices) == cudaSuccess) {
      for (int major = 0; n < devices && n < 100; ++n)
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, n) != cudaSuccess || major != 9) break;
    }
    _exit(n);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return 0;
  return WEXITSTATUS(status);
}

// What each rank's process ended with: its exit code, or a description.
struct RankOutcome {
  bool ok = false;
  std::string what;
};

// Forks `world` processes running rank_main(rank) (its return value is the exit code) and waits
// for them, at most timeout_s: then the ones still running are killed.
inline std::vector<RankOutcome> run_ranks(int world, double timeout_s, const std::function<int(int)>& rank_main) {
  std::vector<RankOutcome> out(world);
  std::vector<pid_t> pids(world, 0);
  std::fflush(nullptr);
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      int code = 1;
      try {
        code = rank_main(r);
      } catch (...) {
        std::fprintf(stderr, "[rank %d] exception\n", r);
      }
      std::fflush(nullptr);
      _exit(code);
    }
    if (pid < 0) {
      out[r].what = "fork failed";
      continue;
    }
    pids[r] = pid;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    bool running = false;
    for (int r = 0; r < world; ++r) {
      if (pids[r] <= 0) continue;
      int status = 0;
      const pid_t got = waitpid(pids[r], &status, WNOHANG);
      if (got == 0) {
        running = true;
        continue;
      }
      pids[r] = 0;
      if (got < 0)
        out[r].what = "waitpid failed";
      else if (WIFSIGNALED(status))
        out[r].what = "killed by signal " + std::to_string(WTERMSIG(status));
      else if (WEXITSTATUS(status) != 0)
        out[r].what = "exit code " + std::to_string(WEXITSTATUS(status));
      else
        out[r].ok = true;
    }
    if (!running) return out;
    if (std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < world; ++r) {
        if (pids[r] <= 0) continue;
        kill(pids[r], SIGKILL);
        waitpid(pids[r], nullptr, 0);
        out[r].what = "still running after " + std::to_string(int(timeout_s)) + " s: killed";
      }
      return out;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// Deterministic bf16 values in [-scale, scale).
inline std::vector<__nv_bfloat16> random_bf16(size_t count, uint64_t seed, float scale) {
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

// Row-major D (rows, n) = A (rows, k) @ B (n, k)^T: bf16 in and out, fp32 accumulation.
inline cublasStatus_t reference_gemm(cublasHandle_t h, const void* a, const void* b, void* d, int64_t rows, int64_t n,
                                     int64_t k) {
  const float one = 1.f, zero = 0.f;
  return cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(rows), int(k), &one, b, CUDA_R_16BF, int(k), a,
                      CUDA_R_16BF, int(k), &zero, d, CUDA_R_16BF, int(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

// max |out - ref| / max |ref| of two device buffers of `count` bf16 (infinite for a NaN in
// out; negative when the copies fail).
inline double max_rel_error(const void* out, const void* ref, size_t count) {
  std::vector<__nv_bfloat16> o(count), r(count);
  if (cudaMemcpy(o.data(), out, count * 2, cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemcpy(r.data(), ref, count * 2, cudaMemcpyDeviceToHost) != cudaSuccess)
    return -1;
  double err = 0, mag = 0;
  for (size_t i = 0; i < count; ++i) {
    const double x = __bfloat162float(o[i]), y = __bfloat162float(r[i]);
    if (std::isnan(x)) return INFINITY;
    err = std::max(err, std::fabs(x - y));
    mag = std::max(mag, std::fabs(y));
  }
  return err / (mag > 0 ? mag : 1.0);
}

// A row-major packed bf16 matrix view.
inline dg_matrix bf16_matrix(const void* p, int64_t rows, int64_t cols) { return {p, DG_BF16, rows, cols, cols, 1}; }

// Waits for `stream` at most timeout_s: cudaSuccess, cudaErrorNotReady past the bound, or the error.
inline cudaError_t wait_stream(cudaStream_t stream, double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    const cudaError_t e = cudaStreamQuery(stream);
    if (e != cudaErrorNotReady || std::chrono::steady_clock::now() > deadline) return e;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace dgtest

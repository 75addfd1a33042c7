#include <algorithm>

#include "common/sync.cuh"
#include "dist/tp_kernels.cuh"

namespace distgemm::dist {
namespace {

__global__ void begin_call_kernel(uint32_t* epoch, SignalTargets started) {
  const uint32_t value = *epoch + 1;
  *epoch = value;
  // No fence: what "started" vouches for (the earlier calls' reads of this workspace) finished
  // before this kernel began; the release keeps the flag after the epoch store.
  for (int i = 0; i < started.count; ++i)
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(started.flags[i]), "r"(value) : "memory");
}

__global__ void wait_flag_kernel(const uint32_t* flag, int32_t offset, SyncParams s, int peer) {
  wait_flag(flag, *s.epoch + offset, s, peer);
}

__global__ void signal_kernel(SignalTargets targets, const uint32_t* epoch) {
  const uint32_t value = *epoch;
  __threadfence_system();  // the stream's earlier writes (copies, GEMM stores) come first
  for (int i = threadIdx.x; i < targets.count; i += blockDim.x) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(targets.flags[i]), "r"(value) : "memory");
  }
}

__global__ void scatter_scales_kernel(const float* src, int64_t count, int64_t rows,
                                      ScaleTargets targets) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows; i += gridDim.x * int64_t(blockDim.x)) {
    const float v = src[count == 1 ? 0 : i];
    for (int q = 0; q < targets.count; ++q) targets.dst[q][i] = v;
  }
  __threadfence_system();
}

}  // namespace

cudaError_t launch_scatter_scales(const float* src, int64_t count, int64_t rows,
                                  const ScaleTargets& targets, cudaStream_t stream) {
  const int blocks = static_cast<int>(std::min<int64_t>((rows + 255) / 256, 256));
  scatter_scales_kernel<<<blocks, 256, 0, stream>>>(src, count, rows, targets);
  return cudaGetLastError();
}

cudaError_t launch_begin_call(uint32_t* epoch, const SignalTargets& started, cudaStream_t stream) {
  begin_call_kernel<<<1, 1, 0, stream>>>(epoch, started);
  return cudaGetLastError();
}

cudaError_t launch_wait_flag(const uint32_t* flag, int32_t offset, const SyncParams& s, int peer,
                             cudaStream_t stream) {
  wait_flag_kernel<<<1, 1, 0, stream>>>(flag, offset, s, peer);
  return cudaGetLastError();
}

cudaError_t launch_signal(const SignalTargets& targets, const uint32_t* epoch, cudaStream_t stream) {
  if (targets.count == 0) return cudaSuccess;
  signal_kernel<<<1, 64, 0, stream>>>(targets, epoch);
  return cudaGetLastError();
}

}  // namespace distgemm::dist

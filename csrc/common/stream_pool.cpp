#include "common/stream_pool.h"

#include <array>
#include <mutex>

#include "common/status.h"

namespace distgemm {

StreamPool* stream_pool(int device) {
  constexpr int kMaxDevices = 64;
  static std::array<StreamPool, kMaxDevices> pools;
  static std::array<std::once_flag, kMaxDevices> once;
  static std::array<bool, kMaxDevices> ok{};
  if (device < 0 || device >= kMaxDevices) {
    fail(DG_ERROR_INVALID_ARGUMENT, cat("device ", device, " out of range"));
    return nullptr;
  }
  std::call_once(once[device], [device] {
    StreamPool& p = pools[device];
    int least = 0, greatest = 0;
    bool good = cudaDeviceGetStreamPriorityRange(&least, &greatest) == cudaSuccess &&
                cudaEventCreateWithFlags(&p.fork, cudaEventDisableTiming) == cudaSuccess;
    for (int i = 0; i < kPoolStreams && good; ++i)
      good = cudaStreamCreateWithPriority(&p.streams[i], cudaStreamNonBlocking, greatest) == cudaSuccess &&
             cudaEventCreateWithFlags(&p.joined[i], cudaEventDisableTiming) == cudaSuccess;
    ok[device] = good;
  });
  if (!ok[device]) {
    fail(DG_ERROR_CUDA, cat("creating the side streams of device ", device, " failed"));
    return nullptr;
  }
  return &pools[device];
}

dg_status fork_streams(StreamPool& pool, cudaStream_t stream, int count) {
  DG_CUDA_RETURN(cudaEventRecord(pool.fork, stream));
  for (int i = 0; i < count; ++i) DG_CUDA_RETURN(cudaStreamWaitEvent(pool.streams[i], pool.fork, 0));
  return DG_SUCCESS;
}

dg_status join_streams(StreamPool& pool, cudaStream_t stream, int count) {
  for (int i = 0; i < count; ++i) {
    DG_CUDA_RETURN(cudaEventRecord(pool.joined[i], pool.streams[i]));
    DG_CUDA_RETURN(cudaStreamWaitEvent(stream, pool.joined[i], 0));
  }
  return DG_SUCCESS;
}

}  // namespace distgemm

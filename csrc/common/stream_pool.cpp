#include "common/stream_pool.h"

#include "common/per_device.h"
#include "common/status.h"

namespace distgemm {

namespace {

// Destroys what a failed creation of `p` made.
void release(StreamPool& p) {
  for (int i = 0; i < kPoolStreams; ++i) {
    if (p.streams[i]) cudaStreamDestroy(p.streams[i]);
    if (p.joined[i]) cudaEventDestroy(p.joined[i]);
  }
  if (p.fork) cudaEventDestroy(p.fork);
  p = StreamPool{};
}

// The pool of the current device (per_device.h makes `device` current).
dg_status create_pool(int device, StreamPool* p) {
  int least = 0, greatest = 0;
  cudaError_t err = cudaDeviceGetStreamPriorityRange(&least, &greatest);
  if (err == cudaSuccess) err = cudaEventCreateWithFlags(&p->fork, cudaEventDisableTiming);
  for (int i = 0; i < kPoolStreams && err == cudaSuccess; ++i) {
    err = cudaStreamCreateWithPriority(&p->streams[i], cudaStreamNonBlocking, greatest);
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&p->joined[i], cudaEventDisableTiming);
  }
  if (err == cudaSuccess) p->lock = new std::mutex();  // kept with the pool, for the process
  if (err != cudaSuccess) {
    release(*p);
    return fail(DG_ERROR_CUDA,
                cat("creating the side streams of device ", device, " failed: ", cudaGetErrorString(err)));
  }
  return DG_SUCCESS;
}

}  // namespace

StreamPool* stream_pool(int device) {
  static PerDevice<StreamPool> pools;
  return pools.get(device, "the side streams", create_pool);
}

dg_status fork_streams(StreamPool& pool, cudaStream_t stream, int count) {
  const std::lock_guard<std::mutex> hold(*pool.lock);
  DG_CUDA_RETURN(cudaEventRecord(pool.fork, stream));
  for (int i = 0; i < count; ++i) DG_CUDA_RETURN(cudaStreamWaitEvent(pool.streams[i], pool.fork, 0));
  return DG_SUCCESS;
}

dg_status join_streams(StreamPool& pool, cudaStream_t stream, int count) {
  const std::lock_guard<std::mutex> hold(*pool.lock);
  for (int i = 0; i < count; ++i) {
    DG_CUDA_RETURN(cudaEventRecord(pool.joined[i], pool.streams[i]));
    DG_CUDA_RETURN(cudaStreamWaitEvent(stream, pool.joined[i], 0));
  }
  return DG_SUCCESS;
}

}  // namespace distgemm

// Side streams forked from and joined back to a caller's stream (stream-ordered, so the
// fork/join is captured by CUDA graphs like any other work).
#pragma once

#include <cuda_runtime_api.h>

#include "distgemm/distgemm.h"

namespace distgemm {

constexpr int kPoolStreams = 8;

struct StreamPool {
  cudaStream_t streams[kPoolStreams] = {};  // highest priority: their small kernels go first
  cudaEvent_t joined[kPoolStreams] = {};
  cudaEvent_t fork = nullptr;
};

// The pool of `device`, created on first use and kept for the process; nullptr on failure
// (with the error recorded).
StreamPool* stream_pool(int device);

// Makes the first `count` pool streams wait for the work queued so far on `stream`.
dg_status fork_streams(StreamPool& pool, cudaStream_t stream, int count);

// Makes `stream` wait for the work queued so far on the first `count` pool streams.
dg_status join_streams(StreamPool& pool, cudaStream_t stream, int count);

}  // namespace distgemm

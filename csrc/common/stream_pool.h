// Side streams forked from and joined back to a caller's stream (stream-ordered, so the
// fork/join is captured by CUDA graphs like any other work).
#pragma once

#include <cuda_runtime_api.h>

#include <mutex>

#include "distgemm/distgemm.h"

namespace distgemm {

constexpr int kPoolStreams = 8;

struct StreamPool {
  cudaStream_t streams[kPoolStreams] = {};  // highest priority: their small kernels go first
  cudaEvent_t joined[kPoolStreams] = {};
  cudaEvent_t fork = nullptr;
  // Held from an event's record to the waits on it: two host threads forking (or joining) on
  // one device would otherwise re-record the shared event between the other's record and wait,
  // and a side stream would wait for the wrong stream's work (a GEMM reading inputs not yet
  // written). The pool is per device and lives for the process, as does its mutex.
  std::mutex* lock = nullptr;
};

// The pool of `device`, created on first use and kept for the process; nullptr on failure
// (with the error recorded).
StreamPool* stream_pool(int device);

// Makes the first `count` pool streams wait for the work queued so far on `stream`.
dg_status fork_streams(StreamPool& pool, cudaStream_t stream, int count);

// Makes `stream` wait for the work queued so far on the first `count` pool streams.
dg_status join_streams(StreamPool& pool, cudaStream_t stream, int count);

}  // namespace distgemm

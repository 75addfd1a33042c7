// Launchers of the small kernels that order the tensor-parallel GEMMs across GPUs. Each runs
// on a stream the caller names, so the whole sequence stays stream-ordered and capturable.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/sync.h"
#include "dist/tp_layout.h"

namespace distgemm::dist {

// The flags `signal` writes: each gets *epoch (release, system scope).
struct SignalTargets {
  uint32_t* flags[kMaxWorld];
  int count;
};

// The first kernel of a call: *epoch += 1 (every later kernel of the call reads the new value),
// then the new value to every `started` flag. That tells the peers writing into this rank's
// workspace that its earlier calls are done with it (stream order), so no call ends with a
// signal of its own.
cudaError_t launch_begin_call(uint32_t* epoch, const SignalTargets& started, cudaStream_t stream);

// Bounded wait until *flag >= *s.epoch + offset; a timeout records s.error_tag | (peer + 1).
cudaError_t launch_wait_flag(const uint32_t* flag, int32_t offset, const SyncParams& s, int peer,
                             cudaStream_t stream);

// Writes *epoch to every target flag after the stream's earlier work.
cudaError_t launch_signal(const SignalTargets& targets, const uint32_t* epoch, cudaStream_t stream);

// Writes this shard's FP8 row scales (`count` values, or one value repeated) into rows
// [0, rows) of every rank's gathered-scales region (dst[q], already offset to this shard).
struct ScaleTargets {
  float* dst[kMaxWorld];
  int count;
};
cudaError_t launch_scatter_scales(const float* src, int64_t count, int64_t rows,
                                  const ScaleTargets& targets, cudaStream_t stream);

}  // namespace distgemm::dist

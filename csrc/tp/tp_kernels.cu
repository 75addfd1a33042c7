#include <algorithm>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/sync.cuh"
#include "tp/tp_kernels.cuh"

namespace distgemm::tp {
namespace {

__device__ __forceinline__ void store_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ bool call_failed(const int* error) {
  return error != nullptr && *reinterpret_cast<const volatile int*>(error) != 0;
}

// Tells every peer that this rank's call `epoch` failed; the fence makes the marks visible
// system-wide before this kernel completes, so before any copy the stream runs after it.
__device__ void mark_failed_in_peers(const FailureMarks& marks, uint32_t epoch) {
  const uint32_t mark = epoch != 0 ? epoch : 1u;  // nonzero: the epoch wraps after 2^32 calls
  for (int i = 0; i < marks.count; ++i) store_release_sys(marks.in_peers[i], mark);
  __threadfence_system();
}

__global__ void begin_call_kernel(uint32_t* epoch, PeerTargets peers, CallSignature sig, FailureMarks marks,
                                  const int* error) {
  const uint32_t value = *epoch + 1;
  *epoch = value;
  if (call_failed(error)) mark_failed_in_peers(marks, value);
  sig.words[CallSignature::kEpoch] = value;
  // No fence: what "started" vouches for (the earlier calls' reads of this workspace) finished
  // before this kernel began; the release orders the signature and the epoch before the flag.
  for (int i = 0; i < peers.count; ++i) {
    CallSignature* slot = peers.sig_slots[i] + (value & 1u) * kMaxWorld;
    for (int w = 0; w < CallSignature::kFields; ++w)
      reinterpret_cast<volatile uint32_t*>(slot->words)[w] = sig.words[w];
    store_release_sys(peers.started[i], value);
  }
}

__device__ void check_each_peer(const PeerChecks& peers, const CallSignature& own, const FailureMarks& marks,
                                const SyncParams& s, uint32_t epoch) {
  for (int i = 0; i < peers.count; ++i) {
    const int p = peers.rank[i];
    if (!wait_flag(peers.started[i], epoch, s, p)) return;  // timed out (recorded) or failed
    const auto* slot = reinterpret_cast<const volatile uint32_t*>((peers.sig[i] + (epoch & 1u) * kMaxWorld)->words);
    // What the peer's call is comes first: a disagreement is named as such on both ranks, though
    // the rank that found it first has marked its own call as failed by the time the other looks.
    // A mark is the reason only for a peer at this call that agrees, or at another call.
    const bool failed = load_acquire_sys(marks.seen + p) != 0;
    int reason = -1;
    if (slot[CallSignature::kEpoch] != epoch) {
      reason = failed ? kReasonPeerFailed : kReasonOutOfStep;
    } else {
      for (int w = 1; w < CallSignature::kFields && reason < 0; ++w) {
        if (slot[w] == own.words[w]) continue;
        reason = w == CallSignature::kPlan && ((slot[w] ^ own.words[w]) & CallSignature::kElsewhere) ? kReasonElsewhere
                 : w == CallSignature::kPlan                                                         ? kReasonPlan
                 : w == CallSignature::kRows || w == CallSignature::kRowsHigh                        ? kReasonRows
                 : w == CallSignature::kWidth                                                        ? kReasonWidth
                 : w == CallSignature::kDtypes                                                       ? kReasonDtypes
                                                                                                     : kReasonWorld;
      }
      if (reason < 0 && failed) reason = kReasonPeerFailed;
    }
    if (reason >= 0) {
      record_wait_error(s, (reason << kErrorReasonShift) | s.error_tag | (p + 1));
      return;
    }
  }
}

__global__ void check_peers_kernel(PeerChecks peers, CallSignature own, FailureMarks marks, SyncParams s) {
  const uint32_t epoch = *s.epoch;
  check_each_peer(peers, own, marks, s, epoch);
  if (call_failed(s.error)) mark_failed_in_peers(marks, epoch);
}

template <class Word>
__global__ void poison_kernel(Word* data, int64_t rows, int64_t cols, int64_t ld, Word nan, FailureMarks marks,
                              SyncParams s) {
  if (s.error != nullptr && !call_failed(s.error)) {
    int peer = -1;
    for (int q = 0; q < marks.world && peer < 0; ++q)
      if (load_acquire_sys(marks.seen + q) != 0) peer = q;
    if (peer < 0) return;
    if (blockIdx.x == 0 && threadIdx.x == 0) record_wait_error(s, s.peer_failed_code | (peer + 1));
  }
  // A call that failed after its check (a wait inside a GEMM) marks itself here too, so that
  // peers still waiting for its flags give up at once and its peers' next calls fail.
  if (s.epoch != nullptr && blockIdx.x == 0 && threadIdx.x == 0) mark_failed_in_peers(marks, *s.epoch);
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += gridDim.x * int64_t(blockDim.x))
    data[(i / cols) * ld + i % cols] = nan;
}

__global__ void wait_flag_kernel(const uint32_t* flag, int32_t offset, SyncParams s, int peer) {
  wait_flag(flag, *s.epoch + offset, s, peer);
}

__global__ void signal_kernel(SignalTargets targets, const uint32_t* epoch, const int* error) {
  if (call_failed(error)) return;
  const uint32_t value = *epoch;
  __threadfence_system();  // the stream's earlier writes (copies, GEMM stores) come first
  for (int i = threadIdx.x; i < targets.count; i += blockDim.x) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(targets.flags[i]), "r"(value) : "memory");
  }
}

__global__ void scatter_scales_kernel(const float* src, int64_t count, int64_t rows, ScaleTargets targets,
                                      const int* error) {
  if (call_failed(error)) return;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows; i += gridDim.x * int64_t(blockDim.x)) {
    const float v = src[count == 1 ? 0 : i];
    for (int q = 0; q < targets.count; ++q) targets.dst[q][i] = v;
  }
  __threadfence_system();
}

template <class T>
__global__ void scale_row_kernel(const T* src, T* dst, int64_t n, float beta) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += gridDim.x * int64_t(blockDim.x))
    dst[i] = static_cast<T>(beta * static_cast<float>(src[i]));
}

}  // namespace

cudaError_t launch_scale_row(const void* src, void* dst, int64_t n, dg_dtype dtype, float beta, cudaStream_t stream) {
  const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 256));
  switch (dtype) {
    case DG_F32:
      scale_row_kernel<<<blocks, 256, 0, stream>>>(static_cast<const float*>(src), static_cast<float*>(dst), n, beta);
      break;
    case DG_F16:
      scale_row_kernel<<<blocks, 256, 0, stream>>>(static_cast<const __half*>(src), static_cast<__half*>(dst), n, beta);
      break;
    case DG_BF16:
      scale_row_kernel<<<blocks, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(src),
                                                   static_cast<__nv_bfloat16*>(dst), n, beta);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t launch_scatter_scales(const float* src, int64_t count, int64_t rows, const ScaleTargets& targets,
                                  const int* error, cudaStream_t stream) {
  const int blocks = static_cast<int>(std::min<int64_t>((rows + 255) / 256, 256));
  scatter_scales_kernel<<<blocks, 256, 0, stream>>>(src, count, rows, targets, error);
  return cudaGetLastError();
}

cudaError_t launch_begin_call(uint32_t* epoch, const PeerTargets& peers, const CallSignature& sig,
                              const FailureMarks& marks, const int* error, cudaStream_t stream) {
  begin_call_kernel<<<1, 1, 0, stream>>>(epoch, peers, sig, marks, error);
  return cudaGetLastError();
}

cudaError_t launch_check_peers(const PeerChecks& peers, const CallSignature& own, const FailureMarks& marks,
                               const SyncParams& s, cudaStream_t stream) {
  check_peers_kernel<<<1, 1, 0, stream>>>(peers, own, marks, s);
  return cudaGetLastError();
}

cudaError_t launch_poison_on_error(void* data, int64_t rows, int64_t cols, int64_t ld, int elem_bytes,
                                   const FailureMarks& marks, const SyncParams& s, cudaStream_t stream) {
  if (!data || rows <= 0 || cols <= 0) return cudaSuccess;
  constexpr int kBlocks = 32, kThreads = 256;  // the common case returns at once
  switch (elem_bytes) {
    case 2:  // bf16 and fp16 NaN share no pattern: 0x7fff is NaN in both
      poison_kernel<uint16_t>
          <<<kBlocks, kThreads, 0, stream>>>(static_cast<uint16_t*>(data), rows, cols, ld, uint16_t{0x7fff}, marks, s);
      break;
    case 4:
      poison_kernel<uint32_t>
          <<<kBlocks, kThreads, 0, stream>>>(static_cast<uint32_t*>(data), rows, cols, ld, 0x7fffffffu, marks, s);
      break;
    default:  // 1-byte (FP8) data: 0x7f is NaN in e4m3fn and e5m2
      poison_kernel<uint8_t>
          <<<kBlocks, kThreads, 0, stream>>>(static_cast<uint8_t*>(data), rows, cols, ld, uint8_t{0x7f}, marks, s);
  }
  return cudaGetLastError();
}

cudaError_t launch_wait_flag(const uint32_t* flag, int32_t offset, const SyncParams& s, int peer, cudaStream_t stream) {
  wait_flag_kernel<<<1, 1, 0, stream>>>(flag, offset, s, peer);
  return cudaGetLastError();
}

cudaError_t launch_signal(const SignalTargets& targets, const uint32_t* epoch, const int* error, cudaStream_t stream) {
  if (targets.count == 0) return cudaSuccess;
  signal_kernel<<<1, 64, 0, stream>>>(targets, epoch, error);
  return cudaGetLastError();
}

}  // namespace distgemm::tp

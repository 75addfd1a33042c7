// Device side of SyncParams: bounded spin-waits on flags other GPUs (or copy engines) set.
#pragma once

#include <cstdint>

#include "common/sync.h"

namespace distgemm {

__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// Orders the acquired flag before later TMA (async-proxy) reads of the data it guards.
__device__ __forceinline__ void fence_generic_to_async_global() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.global;" ::: "memory");
#endif
}

// The first failure's code into the device's error word, then into the host's mapped copy.
__device__ __forceinline__ void record_wait_error(const SyncParams& s, int code) {
  if (atomicCAS(s.error, 0, code) == 0 && s.error_host) {
    *reinterpret_cast<volatile int*>(s.error_host) = code;
    __threadfence_system();
  }
}

// Spins until *flag reaches target (s.error must be set whenever a wait is requested). On
// timeout, or once the peer marked its call as failed, records the error and returns false
// (at once when another wait already failed); the caller proceeds so the kernel always finishes.
__device__ __forceinline__ bool wait_flag(const uint32_t* flag, uint32_t target, const SyncParams& s, int peer) {
  if (static_cast<int32_t>(load_acquire_sys(flag) - target) >= 0) {
    fence_generic_to_async_global();
    return true;
  }
  const uint64_t start = global_timer_ns();
  for (uint32_t spin = 1;; ++spin) {
    __nanosleep(128);
    if (static_cast<int32_t>(load_acquire_sys(flag) - target) >= 0) break;
    if ((spin & 63u) == 0) {
      if (*reinterpret_cast<volatile int*>(s.error) != 0) return false;
      if (s.failed_marks != nullptr && load_acquire_sys(s.failed_marks + peer) != 0) {
        record_wait_error(s, s.peer_failed_code | (peer + 1));
        return false;
      }
      if (global_timer_ns() - start > s.timeout_ns) {
        record_wait_error(s, s.error_tag | (peer + 1));
        return false;
      }
    }
  }
  fence_generic_to_async_global();
  return true;
}

}  // namespace distgemm

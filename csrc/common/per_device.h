// One value per CUDA device, created lazily and kept for the process: the device properties,
// the error words, the side-stream pools and the cuBLAS / cuBLASLt handles. Host-only.
//
// PerDevice<T>::get(device, what, create):
//  - refuses a device index outside [0, kMaxDevices) (DG_ERROR_INVALID_ARGUMENT) and one the
//    runtime cannot select (DG_ERROR_CUDA);
//  - creates the value under a mutex, with `device` made current and the previous device
//    restored afterwards, so that streams, allocations and handles belong to `device` whichever
//    device the calling thread had selected;
//  - runs `create` in relaxed stream-capture mode, so that a first call while this thread
//    captures a CUDA graph may still allocate (create must not enqueue work on the caller's
//    streams);
//  - caches successes only: after a failure (recorded by `create` with fail(), the value
//    discarded) the next call tries again, so a transient failure (e.g. during graph capture)
//    does not poison the device for the rest of the process.
// The fast path is one atomic load. Values are never destroyed (the CUDA driver may be gone by
// the time static destructors run).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "common/status.h"

namespace distgemm {

constexpr int kMaxDevices = 64;

// How PerDevice selects devices: the CUDA runtime's current device. (Tests substitute a fake.)
struct CudaDeviceContext {
  // The calling thread's current device; false (*why set) without one.
  static bool current(int* device, std::string* why) {
    const cudaError_t err = cudaGetDevice(device);
    if (err == cudaSuccess) return true;
    *why = cudaGetErrorString(err);
    cudaGetLastError();  // a failed query must not linger as the thread's last error
    return false;
  }
  static bool select(int device, std::string* why) {
    const cudaError_t err = cudaSetDevice(device);
    if (err == cudaSuccess) return true;
    *why = cudaGetErrorString(err);
    cudaGetLastError();
    return false;
  }
  // Brackets a creation: relaxed stream-capture mode for this thread, then the mode it had.
  // After a failed creation the thread's last CUDA error is cleared, so that the caller's next
  // launch check (e.g. PyTorch's) does not report it.
  static int begin_create() {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    return cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess ? static_cast<int>(mode) : -1;
  }
  static void end_create(int state, bool failed) {
    if (state >= 0) {
      cudaStreamCaptureMode mode = static_cast<cudaStreamCaptureMode>(state);
      cudaThreadExchangeStreamCaptureMode(&mode);
    }
    if (failed) cudaGetLastError();
  }
};

template <class T, class Context = CudaDeviceContext>
class PerDevice {
 public:
  PerDevice() = default;
  PerDevice(const PerDevice&) = delete;
  PerDevice& operator=(const PerDevice&) = delete;

  // The value of `device`, made by `create(device, T* value) -> dg_status` on first use (value
  // starts value-initialized); nullptr, with the thread's last error set, if the index is out
  // of range or the creation failed. `what` names the value in errors ("the side streams").
  template <class Create>
  T* get(int device, const char* what, Create&& create) {
    if (device < 0 || device >= kMaxDevices) {
      fail(DG_ERROR_INVALID_ARGUMENT, cat(what, ": device ", device, " is out of range [0, ", kMaxDevices, ")"));
      return nullptr;
    }
    if (T* value = values_[device].load(std::memory_order_acquire)) return value;
    std::lock_guard<std::mutex> lock(mutex_);
    if (T* value = values_[device].load(std::memory_order_acquire)) return value;
    auto fresh = std::make_unique<T>();
    if (create_on(device, what, create, fresh.get()) != DG_SUCCESS) return nullptr;
    T* value = fresh.release();
    values_[device].store(value, std::memory_order_release);
    return value;
  }

  // The value of `device` if it was made, else nullptr; creates nothing.
  T* peek(int device) const {
    return device >= 0 && device < kMaxDevices ? values_[device].load(std::memory_order_acquire) : nullptr;
  }

 private:
  template <class Create>
  static dg_status create_on(int device, const char* what, Create& create, T* value) {
    int previous = -1;
    std::string why;
    if (!Context::current(&previous, &why) || (previous != device && !Context::select(device, &why)))
      return fail(DG_ERROR_CUDA, cat(what, " of device ", device, ": cannot select the device: ", why));
    const int state = Context::begin_create();
    const dg_status status = create(device, value);
    Context::end_create(state, status != DG_SUCCESS);
    if (previous != device) Context::select(previous, &why);
    return status;
  }

  std::mutex mutex_;
  std::array<std::atomic<T*>, kMaxDevices> values_{};
};

}  // namespace distgemm

#include "common/error_state.h"

#include <cuda_runtime_api.h>

#include <array>
#include <mutex>

#include "common/status.h"
#include "distgemm/distgemm.h"

namespace distgemm {

ErrorState* error_state(int device) {
  constexpr int kMaxDevices = 64;
  static std::array<ErrorState, kMaxDevices> states;
  static std::array<std::once_flag, kMaxDevices> once;
  static std::array<bool, kMaxDevices> ok{};
  if (device < 0 || device >= kMaxDevices) return nullptr;
  std::call_once(once[device], [device] {
    ErrorState& s = states[device];
    void* host = nullptr;
    ok[device] = cudaMalloc(reinterpret_cast<void**>(&s.device_word), sizeof(int)) == cudaSuccess &&
                 cudaMemset(s.device_word, 0, sizeof(int)) == cudaSuccess &&
                 cudaHostAlloc(&host, sizeof(int), cudaHostAllocMapped) == cudaSuccess &&
                 cudaHostGetDevicePointer(reinterpret_cast<void**>(&s.host_word_device), host, 0) ==
                     cudaSuccess &&
                 cudaDeviceSynchronize() == cudaSuccess;
    s.host_word = static_cast<int*>(host);
    if (ok[device]) *s.host_word = 0;
  });
  if (!ok[device]) {
    fail(DG_ERROR_CUDA, cat("allocating the error word of device ", device, " failed"));
    return nullptr;
  }
  return &states[device];
}

}  // namespace distgemm

using namespace distgemm;

extern "C" int dg_tp_error(int device) {
  ErrorState* s = error_state(device);
  return s ? *reinterpret_cast<volatile int*>(s->host_word) : 0;
}

extern "C" dg_status dg_tp_clear_error(int device) {
  ErrorState* s = error_state(device);
  if (!s) return DG_ERROR_CUDA;
  DG_CUDA_RETURN(cudaDeviceSynchronize());
  DG_CUDA_RETURN(cudaMemset(s->device_word, 0, sizeof(int)));
  DG_CUDA_RETURN(cudaDeviceSynchronize());
  *reinterpret_cast<volatile int*>(s->host_word) = 0;
  return DG_SUCCESS;
}

#include "common/error_state.h"

#include <cuda_runtime_api.h>

#include "common/per_device.h"
#include "common/status.h"
#include "distgemm/distgemm.h"

namespace distgemm {

namespace {

// Frees what a failed creation of `s` allocated.
void release(ErrorState& s) {
  if (s.device_word) cudaFree(s.device_word);
  if (s.host_word) cudaFreeHost(s.host_word);
  s = ErrorState{};
}

// Allocates and zeroes the error words of the current device (per_device.h makes `device`
// current). The device word is zeroed on a private non-blocking stream, so that nothing here
// waits on (or is captured into) the caller's streams.
dg_status create_error_state(int device, ErrorState* s) {
  void* host = nullptr;
  cudaStream_t zeroing = nullptr;
  cudaError_t err = cudaMalloc(reinterpret_cast<void**>(&s->device_word), sizeof(int));
  if (err == cudaSuccess) err = cudaHostAlloc(&host, sizeof(int), cudaHostAllocMapped);
  s->host_word = static_cast<int*>(host);
  if (err == cudaSuccess) err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&s->host_word_device), host, 0);
  if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&zeroing, cudaStreamNonBlocking);
  if (err == cudaSuccess) err = cudaMemsetAsync(s->device_word, 0, sizeof(int), zeroing);
  if (err == cudaSuccess) err = cudaStreamSynchronize(zeroing);
  if (zeroing) cudaStreamDestroy(zeroing);
  if (err != cudaSuccess) {
    release(*s);
    return fail(DG_ERROR_CUDA,
                cat("allocating the error word of device ", device, " failed: ", cudaGetErrorString(err)));
  }
  *s->host_word = 0;
  return DG_SUCCESS;
}

}  // namespace

ErrorState* error_state(int device) {
  static PerDevice<ErrorState> states;
  return states.get(device, "the error word", create_error_state);
}

}  // namespace distgemm

using namespace distgemm;

extern "C" int dg_tp_error(int device) {
  ErrorState* s = error_state(device);
  return s ? *reinterpret_cast<volatile int*>(s->host_word) : 0;
}

extern "C" dg_status dg_tp_clear_error(int device) {
  DG_REQUIRE(device >= 0 && device < kMaxDevices, "the error word: device ", device, " is out of range [0, ",
             kMaxDevices, ")");
  ErrorState* s = error_state(device);
  if (!s) return DG_ERROR_CUDA;
  // On `device`, whichever device this thread had selected (restored afterwards).
  int previous = -1;
  DG_CUDA_RETURN(cudaGetDevice(&previous));
  DG_CUDA_RETURN(cudaSetDevice(device));
  cudaError_t err = cudaDeviceSynchronize();
  if (err == cudaSuccess) err = cudaMemset(s->device_word, 0, sizeof(int));
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  cudaSetDevice(previous);
  if (err != cudaSuccess)
    return fail(DG_ERROR_CUDA, cat("clearing the error word of device ", device, ": ", cudaGetErrorString(err)));
  *reinterpret_cast<volatile int*>(s->host_word) = 0;
  return DG_SUCCESS;
}

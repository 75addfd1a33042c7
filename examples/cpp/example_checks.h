// What the single-GPU examples share: return 1 from main with the failing call and its message,
// and whether this machine has the sm_90 GPU they run on.
#pragma once

#include <cuda_runtime.h>
#include <distgemm/distgemm.h>

#include <cstdio>

#define CHECK_CUDA(expr)                                                 \
  do {                                                                   \
    cudaError_t err_ = (expr);                                           \
    if (err_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(err_)); \
      return 1;                                                          \
    }                                                                    \
  } while (0)
#define CHECK_DG(expr)                                                                    \
  do {                                                                                    \
    dg_status st_ = (expr);                                                               \
    if (st_ != DG_SUCCESS) {                                                              \
      std::fprintf(stderr, "%s: %s (%s)\n", #expr, dg_last_error(), dg_status_name(st_)); \
      return 1;                                                                           \
    }                                                                                     \
  } while (0)

// Prints the library's version; false (saying so) where device 0 is not an sm_90 GPU.
inline bool has_sm90_gpu() {
  std::printf("distgemm %s (headers %s)\n", dg_get_version(), DG_VERSION_STRING);
  int devices = 0, major = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0 ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess || major != 9) {
    std::printf("no sm_90 GPU: nothing to run\n");
    return false;
  }
  return true;
}

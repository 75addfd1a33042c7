#include "common/device.h"

#include <cuda_runtime_api.h>

#include "common/per_device.h"
#include "common/status.h"

namespace distgemm {
namespace {
const DeviceInfo no_device;
}  // namespace

int current_device() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  // Binds the device's primary context to this thread: CUTLASS encodes TMA descriptors with
  // the driver API, which fails (CUDA_ERROR_INVALID_CONTEXT) on a thread that has made no
  // runtime call yet, e.g. the autograd engine's backward thread.
  if (cudaSetDevice(device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return device;
}

const DeviceInfo& device_info(int device) {
  static PerDevice<DeviceInfo> infos;
  if (device < 0) device = current_device();
  if (device < 0) return no_device;
  const DeviceInfo* info = infos.get(device, "the properties", [](int d, DeviceInfo* out) {
    int major = 0, minor = 0, sms = 0;
    DG_CUDA_RETURN(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d));
    DG_CUDA_RETURN(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d));
    DG_CUDA_RETURN(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, d));
    out->arch = major * 10 + minor;
    out->sm_count = sms;
    return DG_SUCCESS;
  });
  return info ? *info : no_device;
}

dg_status portable_kernel_device(const char* what, DeviceInfo* info) {
  const DeviceInfo& dev = device_info(current_device());
  if (dev.arch <= 0)
    return fail(DG_ERROR_NOT_SUPPORTED, cat("no usable CUDA device (device arch ", dev.arch, "): distgemm's ", what,
                                            " runs on sm_90 and sm_100"));
  bool compiled = false;
#if defined(DISTGEMM_WITH_SM90)
  compiled = compiled || dev.arch == 90;
#endif
#if defined(DISTGEMM_WITH_SM100)
  compiled = compiled || (dev.arch >= 100 && dev.arch < 110);
#endif
  if (!compiled)
    return fail(DG_ERROR_NOT_SUPPORTED, cat("distgemm's ", what, " kernels are not built for sm_", dev.arch));
  *info = dev;
  return DG_SUCCESS;
}

}  // namespace distgemm

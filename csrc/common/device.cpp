#include "common/device.h"

#include <cuda_runtime_api.h>

#include <array>
#include <mutex>

namespace distgemm {
namespace {
constexpr int kMaxDevices = 64;
std::array<DeviceInfo, kMaxDevices> infos;
std::array<std::once_flag, kMaxDevices> once;
DeviceInfo no_device;
}  // namespace

int current_device() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return -1;
  // Binds the device's primary context to this thread: CUTLASS encodes TMA descriptors with
  // the driver API, which fails (CUDA_ERROR_INVALID_CONTEXT) on a thread that has made no
  // runtime call yet, e.g. the autograd engine's backward thread.
  if (cudaSetDevice(device) != cudaSuccess) return -1;
  return device;
}

const DeviceInfo& device_info(int device) {
  if (device < 0) device = current_device();
  if (device < 0 || device >= kMaxDevices) return no_device;
  std::call_once(once[device], [device] {
    int major = 0, minor = 0, sms = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    infos[device].arch = major * 10 + minor;
    infos[device].sm_count = sms;
  });
  return infos[device];
}

}  // namespace distgemm

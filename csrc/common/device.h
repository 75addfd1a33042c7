// Cached per-device properties; the core asks for them on every launch.
#pragma once

#include "common/status.h"
#include "distgemm/types.h"

namespace distgemm {

struct DeviceInfo {
  int arch = 0;  // 90 for sm_90, 100 for sm_100
  int sm_count = 0;
};

// Properties of `device` (the current device when negative), cached after the first successful
// query (common/per_device.h). Without a usable device (none, out of range, a failed query) the
// result has arch 0 and sm_count 0, and the thread's last error says why.
const DeviceInfo& device_info(int device = -1);
// The current device, with its primary context made current on this thread; -1 on failure.
int current_device();
// The current device's properties when this build compiled the plain-CUDA kernels (FP8
// quantization, the MoE activations) for its arch; otherwise DG_ERROR_NOT_SUPPORTED, the
// thread's last error naming `what`.
dg_status portable_kernel_device(const char* what, DeviceInfo* info);

// A plain-CUDA C API entry named `what`: desc checked into a Problem by lower(desc, &problem)
// (a dg_status), then, once portable_kernel_device found the kernels built for the current
// device, launch(problem, stream) (a cudaError_t) with the device's SM count in
// problem.sm_count; a failed launch is DG_ERROR_CUDA "<what> launch: <error>".
template <class Problem, class Desc, class Lower, class Launch>
dg_status check_and_launch_portable(const char* what, const Desc* desc, Lower&& lower, Launch&& launch,
                                    cudaStream_t stream) {
  Problem p;
  DG_RETURN_IF_ERROR(lower(desc, &p));
  DeviceInfo dev;
  DG_RETURN_IF_ERROR(portable_kernel_device(what, &dev));
  p.sm_count = dev.sm_count;
  const cudaError_t err = launch(p, stream);
  if (err != cudaSuccess) return fail(DG_ERROR_CUDA, cat(what, " launch: ", cudaGetErrorString(err)));
  return DG_SUCCESS;
}

}  // namespace distgemm

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

// Enqueues the plain-CUDA kernels named `what` through `launch(sm_count)` (a cudaError_t) once
// portable_kernel_device found them built for the current device; a failed launch is
// DG_ERROR_CUDA "<what> launch: <error>".
template <class Launch>
dg_status launch_portable(const char* what, Launch&& launch) {
  DeviceInfo dev;
  DG_RETURN_IF_ERROR(portable_kernel_device(what, &dev));
  const cudaError_t err = launch(dev.sm_count);
  if (err != cudaSuccess) return fail(DG_ERROR_CUDA, cat(what, " launch: ", cudaGetErrorString(err)));
  return DG_SUCCESS;
}

// A plain-CUDA C API entry: desc checked into a Problem by lower(desc, &problem) (a dg_status),
// then launch(problem, stream) (a cudaError_t) through launch_portable, with the device's SM count
// in problem.sm_count.
template <class Problem, class Desc, class Lower, class Launch>
dg_status check_and_launch_portable(const char* what, const Desc* desc, Lower&& lower, Launch&& launch,
                                    cudaStream_t stream) {
  Problem p;
  DG_RETURN_IF_ERROR(lower(desc, &p));
  return launch_portable(what, [&](int sm_count) {
    p.sm_count = sm_count;
    return launch(p, stream);
  });
}

}  // namespace distgemm

// Cached per-device properties; the core asks for them on every launch.
#pragma once

#include "distgemm/types.h"

namespace distgemm {

struct DeviceInfo {
  int arch = 0;      // 90 for sm_90, 100 for sm_100
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

}  // namespace distgemm

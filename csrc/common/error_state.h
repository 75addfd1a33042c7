// Where bounded cross-GPU waits report a timeout: a device word (so other waiters stop early)
// mirrored to mapped pinned host memory (so the host reads it without synchronizing).
#pragma once

namespace distgemm {

struct ErrorState {
  int* device_word = nullptr;
  int* host_word = nullptr;         // host address
  int* host_word_device = nullptr;  // the same memory as the device sees it
};

// The error state of `device`, created on first use; nullptr on failure (error recorded).
ErrorState* error_state(int device);

}  // namespace distgemm

#include "common/status.h"
#if __has_include("distgemm_build_id.h")
#include "distgemm_build_id.h"
#else
#define DISTGEMM_BUILD_ID "unversioned"  // builds of the host code alone (no package)
#endif
#include "distgemm/distgemm.h"

#include <cstring>

namespace {
// A fixed thread-local buffer, not a std::string: the pointer dg_last_error returns stays valid
// for the thread's lifetime (a later failure overwrites the text, never frees it; a string's
// reallocation freed what callers still held), and it has no destructor, so a failure reported
// while the thread's other thread_local objects are destroyed writes into live memory.
constexpr size_t kMaxMessage = 4096;
thread_local char last_error[kMaxMessage] = "";
}  // namespace

namespace distgemm {

// Exported (the attribute on the definition; status.h, which every kernel instance includes,
// stays as it is) so that distgemm's other libraries (distgemm_nccl) report through the same
// dg_last_error.
DG_API dg_status fail(dg_status status, const std::string& message) {
  static constexpr char kCut[] = " ...";
  size_t n = message.size();
  if (n < kMaxMessage) {
    std::memcpy(last_error, message.data(), n);
  } else {  // keep the head, which names the argument
    n = kMaxMessage - sizeof kCut;
    std::memcpy(last_error, message.data(), n);
    std::memcpy(last_error + n, kCut, sizeof kCut - 1);
    n += sizeof kCut - 1;
  }
  last_error[n] = '\0';
  return status;
}

}  // namespace distgemm

extern "C" const char* dg_last_error(void) { return last_error; }

extern "C" const char* dg_status_name(dg_status status) {
  switch (status) {
    case DG_SUCCESS:
      return "success";
    case DG_ERROR_INVALID_ARGUMENT:
      return "invalid argument";
    case DG_ERROR_NOT_SUPPORTED:
      return "not supported";
    case DG_ERROR_CUDA:
      return "CUDA error";
    case DG_ERROR_INTERNAL:
      return "internal error";
    case DG_ERROR_TIMEOUT:
      return "timeout";
    case DG_ERROR_PEER_MISMATCH:
      return "ranks disagree";
  }
  return "unknown status";
}

extern "C" const char* dg_build_id(void) { return DISTGEMM_BUILD_ID; }

extern "C" const char* dg_get_version(void) { return DG_VERSION_STRING; }

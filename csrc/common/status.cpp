#include "common/status.h"
#if __has_include("distgemm_build_id.h")
#include "distgemm_build_id.h"
#else
#define DISTGEMM_BUILD_ID "unversioned"  // builds of the host code alone (no package)
#endif
#include "distgemm/distgemm.h"

namespace {
thread_local std::string last_error;
}

namespace distgemm {

// Exported (the attribute on the definition; status.h, which every kernel instance includes,
// stays as it is) so that distgemm's other libraries (distgemm_nccl) report through the same
// dg_last_error.
DG_API dg_status fail(dg_status status, const std::string& message) {
  last_error = message;
  return status;
}

}  // namespace distgemm

extern "C" const char* dg_last_error(void) { return last_error.c_str(); }

extern "C" const char* dg_status_name(dg_status status) {
  switch (status) {
    case DG_SUCCESS: return "success";
    case DG_ERROR_INVALID_ARGUMENT: return "invalid argument";
    case DG_ERROR_NOT_SUPPORTED: return "not supported";
    case DG_ERROR_CUDA: return "CUDA error";
    case DG_ERROR_INTERNAL: return "internal error";
    case DG_ERROR_TIMEOUT: return "timeout";
    case DG_ERROR_PEER_MISMATCH: return "ranks disagree";
  }
  return "unknown status";
}

extern "C" const char* dg_build_id(void) { return DISTGEMM_BUILD_ID; }

extern "C" const char* dg_get_version(void) { return DG_VERSION_STRING; }

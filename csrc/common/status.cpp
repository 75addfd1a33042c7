#include "common/status.h"
#include "distgemm/distgemm.h"

namespace {
thread_local std::string last_error;
}

namespace distgemm {

dg_status fail(dg_status status, const std::string& message) {
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
  }
  return "unknown status";
}

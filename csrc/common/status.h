// Error reporting shared by the core: a thread-local message beside each dg_status.
#pragma once

#include <sstream>
#include <string>
#include <utility>

#include <cuda_runtime_api.h>

#include "distgemm/types.h"

namespace distgemm {

// Records `message` as the thread's last error and returns `status`.
dg_status fail(dg_status status, const std::string& message);

template <class... Args>
std::string cat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

}  // namespace distgemm

// Returns DG_ERROR_INVALID_ARGUMENT with a message built from the remaining arguments.
#define DG_REQUIRE(cond, ...)                                                                      \
  do {                                                                                             \
    if (!(cond)) return ::distgemm::fail(DG_ERROR_INVALID_ARGUMENT, ::distgemm::cat(__VA_ARGS__)); \
  } while (0)

// Propagates a non-success dg_status.
#define DG_RETURN_IF_ERROR(expr)                     \
  do {                                               \
    dg_status dg_status_ = (expr);                   \
    if (dg_status_ != DG_SUCCESS) return dg_status_; \
  } while (0)

// Turns a failed CUDA runtime call into DG_ERROR_CUDA naming the call.
#define DG_CUDA_RETURN(expr)                                                                             \
  do {                                                                                                   \
    cudaError_t dg_err_ = (expr);                                                                        \
    if (dg_err_ != cudaSuccess)                                                                          \
      return ::distgemm::fail(DG_ERROR_CUDA, ::distgemm::cat(#expr, ": ", cudaGetErrorString(dg_err_))); \
  } while (0)

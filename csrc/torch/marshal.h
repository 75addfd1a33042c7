// Tensor <-> C API marshalling shared by the op bindings. No logic beyond translation.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>
#include <string>

#include "distgemm/distgemm.h"

namespace distgemm::torch_binding {

dg_dtype to_dg_dtype(at::ScalarType t, const char* arg);

// An op's int64 argument `arg` as the C API's int: a ValueError naming it (and `op`) when it does
// not fit, never a silent truncation (2^32 + 90 read as arch 90).
int to_int(int64_t value, const char* op, const char* arg);

// The same, stored into a C enum field as a C caller would store any int (the core names a value
// outside the enumeration; a C++ cast to the enum type would be undefined for it).
template <class Enum>
Enum to_enum(int64_t value, const char* op, const char* arg) {
  static_assert(sizeof(Enum) == sizeof(int), "C enums are int-sized");
  const int raw = to_int(value, op, arg);
  Enum e;
  std::memcpy(&e, &raw, sizeof raw);
  return e;
}

// A 2-D view of `t`; a 1-D tensor becomes one row. An undefined tensor gives a NULL matrix.
dg_matrix to_matrix(const at::Tensor& t, const char* arg);

// A float32 scale's pointer and length (none if `scale` is absent), checked to be contiguous
// and on a's device.
void set_scale(const char* op, const c10::optional<at::Tensor>& scale, const at::Tensor& a, const char* arg,
               const float** ptr, int64_t* len);

// dg_gemm_desc of alpha * (scale_a * scale_b * (a @ b.T)) + beta * c into `out`; `op` names
// the caller in errors about mismatched devices or scale dtypes.
dg_gemm_desc gemm_desc(const char* op, const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& c,
                       const at::Tensor& out, double alpha, double beta, const c10::optional<at::Tensor>& scale_a,
                       const c10::optional<at::Tensor>& scale_b, bool fast_accum);

// Raises the Python exception matching `status` (ValueError for bad arguments and ranks that
// disagree, NotImplementedError, else RuntimeError naming the status, e.g. "(timeout)", which
// distgemm.tp turns into TimeoutError) with the core's message, prefixed by `op`.
void check(dg_status status, const char* op);

// A device workspace of `bytes` from the caching allocator (graph-safe); empty if 0.
at::Tensor workspace(size_t bytes, const at::Device& device);

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

}  // namespace distgemm::torch_binding

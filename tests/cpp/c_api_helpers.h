// Descriptors for the host tests of the C API: valid ones to start from, at fake device
// addresses (the checks never dereference a data pointer, and nothing launches without a GPU).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "distgemm/distgemm.h"

namespace dgtest {

// A 16-byte aligned address that is never dereferenced, well inside the address space; slots
// (below 64) are 2^48 bytes apart, so the buffers of a desc never overlap (the checks refuse an
// output that overlaps another buffer).
inline void* fake_ptr(uint64_t slot) {
  return reinterpret_cast<void*>(uintptr_t{0x7f0000000000} + slot * (uintptr_t{1} << 48));
}

inline int dtype_bytes(dg_dtype t) {
  switch (t) {
    case DG_F32:
    case DG_I32:
      return 4;
    case DG_F16:
    case DG_BF16:
      return 2;
    case DG_E4M3:
    case DG_E5M2:
      return 1;
  }
  return 0;
}

// D (m, n) = A (m, k) @ B (n, k)^T, packed row-major, K-major b.
inline dg_gemm_desc gemm_desc(int64_t m, int64_t n, int64_t k, dg_dtype in = DG_BF16, dg_dtype out = DG_BF16) {
  dg_gemm_desc d{};
  d.a = {fake_ptr(1), in, m, k, k, 1};
  d.b = {fake_ptr(2), in, n, k, k, 1};
  d.d = {fake_ptr(3), out, m, n, n, 1};
  d.c = {nullptr, out, 0, 0, 0, 0};
  d.alpha = 1.f;
  d.config = -1;
  return d;
}

inline dg_grouped_shape shape2(int64_t a, int64_t b) { return {2, {a, b, 0}}; }
inline dg_grouped_shape shape3(int64_t a, int64_t b, int64_t c) { return {3, {a, b, c}}; }

// A grouped GEMM of `kind` with G groups, T tokens, N and K.
inline dg_grouped_desc grouped_desc(dg_grouped_kind kind, int64_t g, int64_t t, int64_t n, int64_t k,
                                    dg_dtype in = DG_BF16, dg_dtype out = DG_BF16) {
  dg_grouped_desc d{};
  d.kind = kind;
  d.num_groups = g;
  d.offs = static_cast<const int32_t*>(fake_ptr(4));
  d.a = fake_ptr(5);
  d.b = fake_ptr(6);
  d.out = fake_ptr(7);
  d.in_dtype = in;
  d.out_dtype = out;
  d.config = -1;
  switch (kind) {
    case DG_GROUPED_FORWARD:
      d.a_shape = shape2(t, k);
      d.b_shape = shape3(g, n, k);
      d.out_shape = shape2(t, n);
      break;
    case DG_GROUPED_DGRAD:
      d.a_shape = shape2(t, k);
      d.b_shape = shape3(g, k, n);
      d.out_shape = shape2(t, n);
      break;
    case DG_GROUPED_WGRAD:
      d.a_shape = shape2(t, n);
      d.b_shape = shape2(t, k);
      d.out_shape = shape3(g, n, k);
      break;
  }
  return d;
}

// FP8 quantization of x (rows, cols) at `g`, with a workspace large enough for any desc.
inline dg_quantize_desc quantize_desc(dg_quant_granularity g, int64_t rows, int64_t cols, dg_dtype in = DG_BF16,
                                      dg_dtype out = DG_E4M3) {
  dg_quantize_desc d{};
  d.x = fake_ptr(8);
  d.x_dtype = in;
  d.batch = 1;
  d.rows = rows;
  d.cols = cols;
  d.granularity = g;
  d.out = fake_ptr(9);
  d.out_dtype = out;
  d.scale = static_cast<float*>(fake_ptr(10));
  d.workspace = fake_ptr(11);
  d.workspace_bytes = size_t{1} << 40;
  return d;
}

// A weight w (groups, rows, cols) quantized 128 x 128 into both FP8 copies (out, out_t), the
// scales shared (scale_t NULL).
inline dg_quantize_weight_desc quantize_weight_desc(int64_t groups, int64_t rows, int64_t cols, dg_dtype in = DG_BF16,
                                                    dg_dtype out = DG_E4M3) {
  dg_quantize_weight_desc d{};
  d.w = fake_ptr(30);
  d.w_dtype = in;
  d.groups = groups;
  d.rows = rows;
  d.cols = cols;
  d.out = fake_ptr(31);
  d.out_t = fake_ptr(32);
  d.scale = static_cast<float*>(fake_ptr(33));
  d.out_dtype = out;
  d.granularity = DG_QUANT_128X128;
  return d;
}

// Stores any int into a C enum field, as a C caller may (no C++ enum conversion involved).
template <class Enum>
void set_raw(Enum* field, int value) {
  static_assert(sizeof(Enum) == sizeof(int), "C enums are int-sized");
  std::memcpy(field, &value, sizeof value);
}

// The status is one the API defines (dg_status_name knows it).
inline bool is_valid_status(dg_status s) {
  int raw;
  std::memcpy(&raw, &s, sizeof raw);
  return raw >= 0 && raw < 8 && std::string(dg_status_name(s)) != "unknown status";
}

// The checks passed: success, or refused only for want of a kernel / device (this build has
// no kernels and the CI machine no GPU).
inline bool passes_checks(dg_status s) { return s == DG_SUCCESS || s == DG_ERROR_NOT_SUPPORTED; }

}  // namespace dgtest

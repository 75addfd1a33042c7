// A deterministic random fuzzer of the C API's argument checks (built with ASan + UBSan by
// DISTGEMM_HOST_CHECKS; run by ctest). Each iteration starts from a valid dense, grouped,
// tensor-parallel or FP8 quantization descriptor and mutates a few fields to extreme int64/int
// values, NULL, misaligned or end-of-address-space pointers and arbitrary enum values, then
// calls every entry point that only checks (and, without a GPU, the launching ones, which stop
// at their checks). It asserts that each returns a status the API defines with a message, and that
// whatever passes the checks is in bounds by an independent oracle (128-bit arithmetic): a
// check that lets an out-of-bounds descriptor through fails here, a crash or an overflow trips
// the sanitizers.
//
//   distgemm_fuzz_checks [iterations=200000] [seed=1] [families=gemm,grouped,tp,quant,moe,routing,weight]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

#include "c_api_helpers.h"
#include "distgemm/distgemm.h"

using namespace dgtest;

namespace {

using i128 = __int128;

std::mt19937_64 rng;
uint64_t below(uint64_t n) { return rng() % n; }
bool coin(int one_in) { return below(one_in) == 0; }

const int64_t kExtremes[] = {0,
                             1,
                             -1,
                             2,
                             7,
                             8,
                             15,
                             16,
                             64,
                             127,
                             128,
                             (int64_t(1) << 31) - 1,
                             int64_t(1) << 31,
                             (int64_t(1) << 31) + 1,
                             int64_t(1) << 32,
                             int64_t(1) << 40,
                             int64_t(1) << 61,
                             int64_t(1) << 62,
                             INT64_MAX,
                             INT64_MAX - 1,
                             INT64_MAX / 2,
                             INT64_MAX / 3,
                             INT64_MIN,
                             INT64_MIN + 1,
                             -(int64_t(1) << 31)};

int64_t any_int64() {
  switch (below(4)) {
    case 0:
      return kExtremes[below(std::size(kExtremes))];
    case 1:
      return static_cast<int64_t>(rng());
    case 2:
      return static_cast<int64_t>(below(1 << 20)) - 16;
    default:
      return int64_t(1) << below(63);
  }
}

int any_int() {
  switch (below(3)) {
    case 0:
      return static_cast<int>(kExtremes[below(std::size(kExtremes))]);
    case 1:
      return static_cast<int>(rng());
    default:
      return static_cast<int>(below(12)) - 2;
  }
}

const void* any_ptr(const void* valid) {
  switch (below(7)) {
    case 6:  // at or near another buffer of the test's descriptors
      return static_cast<const char*>(fake_ptr(below(60))) + 16 * below(4);
    case 0:
      return nullptr;
    case 1:
      return reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(valid) + 1 + below(15));  // misaligned
    case 2:
      return reinterpret_cast<const void*>(UINTPTR_MAX & ~uintptr_t{15});
    case 3:
      return reinterpret_cast<const void*>((UINTPTR_MAX - (uintptr_t{1} << below(48))) & ~uintptr_t{15});
    case 4:
      return reinterpret_cast<const void*>(uintptr_t{16});
    default:
      return reinterpret_cast<const void*>(rng());
  }
}

template <class Enum>
void mutate_enum(Enum* e) {
  set_raw(e, below(2) ? static_cast<int>(below(10)) - 1 : any_int());
}

template <class Enum>
int raw(const Enum& e) {
  int v;
  std::memcpy(&v, &e, sizeof v);
  return v;
}

long failures = 0;
long gemm_calls = 0, gemm_passed = 0, grouped_calls = 0, grouped_passed = 0, grouped_fp8_passed = 0, tp_calls = 0,
     tp_passed = 0;

void report(const char* what, const std::string& detail) {
  if (++failures <= 20) std::fprintf(stderr, "FAIL: %s: %s\n", what, detail.c_str());
}

// The status is defined and comes with a message (for a failure).
void expect_status(dg_status s, const char* fn) {
  if (!is_valid_status(s)) {
    report(fn, "returned an undefined status " + std::to_string(raw(s)));
    return;
  }
  const char* msg = dg_last_error();
  if (msg == nullptr || (s != DG_SUCCESS && *msg == '\0')) report(fn, "failed without a message");
}

// ---------------------------------------------------------------- dense GEMM

dg_dtype pick(std::initializer_list<dg_dtype> ts) { return ts.begin()[below(ts.size())]; }

dg_gemm_desc random_valid_gemm() {
  const bool fp8 = coin(3);
  const dg_dtype in = fp8 ? pick({DG_E4M3, DG_E5M2}) : pick({DG_BF16, DG_F16});
  const dg_dtype in_b = fp8 ? (in == DG_E5M2 ? DG_E4M3 : pick({DG_E4M3, DG_E5M2})) : in;
  const dg_dtype out = fp8 ? pick({DG_BF16, DG_F16, DG_F32}) : pick({in, DG_F32});
  const int64_t align = fp8 ? 16 : 8;
  const int64_t m = coin(4) ? 1 : 1 + static_cast<int64_t>(below(4096));
  const int64_t n = align * (1 + static_cast<int64_t>(below(256)));
  const int64_t k = align * (1 + static_cast<int64_t>(below(256)));
  dg_gemm_desc d = gemm_desc(m, n, k, in, out);
  d.b.dtype = in_b;
  if (coin(4)) d.a.row_stride = k + align * static_cast<int64_t>(below(8));
  if (!fp8 && coin(4)) {  // N-major b
    d.b.row_stride = 1;
    d.b.col_stride = n + align * static_cast<int64_t>(below(4));
  }
  if (coin(3)) {
    const bool bias = coin(2);
    d.c = {fake_ptr(9), out, bias ? 1 : m, n, n, 1};
    d.beta = 1.f;
  }
  alignas(16) static float scales[16];
  if (fp8 && coin(2)) {
    d.scale_a = scales;
    d.scale_a_len = coin(2) ? 1 : m;
    d.scale_b = scales;
    d.scale_b_len = coin(2) ? 1 : n;
  }
  d.fast_accum = static_cast<int>(below(2));
  d.config = -1;  // an index is valid below dg_gemm_config_count (none in a build without kernels)
  static const int swizzles[] = {0, 1, 2, 4, 8};
  d.swizzle = coin(4) ? swizzles[below(std::size(swizzles))] : 0;
  return d;
}

void mutate_matrix(dg_matrix* m) {
  switch (below(6)) {
    case 0:
      m->data = any_ptr(m->data ? m->data : fake_ptr(10));
      break;
    case 1:
      mutate_enum(&m->dtype);
      break;
    case 2:
      m->rows = any_int64();
      break;
    case 3:
      m->cols = any_int64();
      break;
    case 4:
      m->row_stride = any_int64();
      break;
    default:
      m->col_stride = any_int64();
      break;
  }
}

void mutate_gemm(dg_gemm_desc* d) {
  const int count = 1 + static_cast<int>(below(3));
  for (int i = 0; i < count; ++i) {
    switch (below(10)) {
      case 0:
        mutate_matrix(&d->a);
        break;
      case 1:
        mutate_matrix(&d->b);
        break;
      case 2:
        mutate_matrix(&d->c);
        break;
      case 3:
      case 4:
        mutate_matrix(&d->d);
        break;
      case 5:
        d->scale_a = static_cast<const float*>(any_ptr(fake_ptr(11)));
        d->scale_a_len = any_int64();
        break;
      case 6:
        d->scale_b = static_cast<const float*>(any_ptr(fake_ptr(11)));
        d->scale_b_len = any_int64();
        break;
      case 7:
        d->config = any_int();
        d->swizzle = any_int();
        break;
      case 8:
        d->fast_accum = any_int();
        break;
      default: {  // one size changed consistently: shape checks pass, size checks are hit
        const int64_t v = any_int64();
        d->a.rows = d->d.rows = v;
        if (coin(2)) d->a.row_stride = any_int64();
        break;
      }
    }
  }
}

bool known_dtype(int t) { return t >= DG_F32 && t <= DG_I32; }

// The oracle: a matrix that passed the checks is in bounds.
bool in_bounds(const dg_matrix& m, int64_t rows, int64_t cols, std::string* why) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(m.data);
  const int t = raw(m.dtype);
  if (!known_dtype(t)) return *why = "unknown dtype", false;
  const int bytes = dtype_bytes(m.dtype);
  if (m.rows != rows || m.cols != cols) return *why = "shape", false;
  if (p == 0 || p % 16) return *why = "NULL or misaligned", false;
  if (cols > 1 && m.col_stride != 1) return *why = "column stride", false;
  if (m.row_stride < 0) return *why = "negative row stride", false;
  if ((i128)m.row_stride * bytes > INT64_MAX) return *why = "row pitch overflows", false;
  i128 extent = (i128)cols * bytes;
  if (rows > 1) {
    if (m.row_stride < cols || (m.row_stride * bytes) % 16) return *why = "row pitch", false;
    extent += (i128)(rows - 1) * m.row_stride * bytes;
  }
  if (extent > INT64_MAX || (i128)p + extent > (i128)UINTPTR_MAX) return *why = "extent", false;
  return true;
}

void check_gemm_oracle(const dg_gemm_desc& d, int arch) {
  std::string why;
  const int64_t m = d.a.rows, k = d.a.cols, n = d.b.rows;
  const int64_t lim = int64_t(1) << 31;
  if (!(m >= 1 && n >= 1 && k >= 1 && m < lim && n < lim && k < lim)) return report("gemm oracle", "M/N/K range");
  if (!in_bounds(d.a, m, k, &why)) return report("gemm oracle a", why);
  if (d.b.col_stride == 1) {
    if (!in_bounds(d.b, n, k, &why)) return report("gemm oracle b", why);
  } else {
    dg_matrix bt{d.b.data, d.b.dtype, k, n, d.b.col_stride, 1};
    if (d.b.row_stride != 1 || !in_bounds(bt, k, n, &why)) return report("gemm oracle b (N-major)", why);
  }
  if (!in_bounds(d.d, m, n, &why)) return report("gemm oracle out", why);
  if (d.c.data && !in_bounds(d.c, d.c.rows == 1 ? 1 : m, n, &why)) return report("gemm oracle c", why);
  if (d.scale_a && d.scale_a_len != 1 && d.scale_a_len != m) return report("gemm oracle", "scale_a_len");
  if (d.scale_b && d.scale_b_len != 1 && d.scale_b_len != n) return report("gemm oracle", "scale_b_len");
  if (d.swizzle != 0 && d.swizzle != 1 && d.swizzle != 2 && d.swizzle != 4 && d.swizzle != 8)
    return report("gemm oracle", "swizzle");
  // The config's upper bound is known only where kernels exist (else NOT_SUPPORTED comes first).
  const int count = dg_gemm_config_count(&d, arch);
  if (d.config < -1 || (count > 0 && d.config >= count)) return report("gemm oracle", "config");
}

void fuzz_gemm(bool launch) {
  dg_gemm_desc d = random_valid_gemm();
  const bool mutated = !coin(8);
  if (mutated) mutate_gemm(&d);
  static const int archs[] = {90, 100, 0, -1, 80, 89, 120, INT_MAX, INT_MIN};
  const int arch = archs[below(std::size(archs))];
  const dg_status s = dg_gemm_check(&d, arch);
  expect_status(s, "dg_gemm_check");
  ++gemm_calls;
  gemm_passed += s != DG_ERROR_INVALID_ARGUMENT;
  if (s != DG_ERROR_INVALID_ARGUMENT) check_gemm_oracle(d, arch);
  if (!mutated && !passes_checks(s)) report("dg_gemm_check", std::string("refused a valid desc: ") + dg_last_error());

  const int sm = coin(2) ? 132 : any_int();
  const int chosen = dg_gemm_select_config(&d, arch, sm);
  const int count = dg_gemm_config_count(&d, arch);
  if (count < 0 || chosen < -1 || chosen >= (count > 0 ? count : 1)) report("dg_gemm_select_config", "out of range");
  const int config = coin(2) ? static_cast<int>(below(4)) : any_int();
  const char* name = dg_gemm_config_name(&d, arch, config);
  if ((name != nullptr) != (config >= 0 && config < count))
    report("dg_gemm_config_name", "inconsistent with the count");
  size_t bytes = 0;
  expect_status(dg_gemm_workspace_size(&d, coin(16) ? nullptr : &bytes), "dg_gemm_workspace_size");
  if (launch) expect_status(dg_gemm(&d, nullptr, 0, nullptr), "dg_gemm");
}

// ---------------------------------------------------------------- grouped GEMM

// An FP8 grouped desc: a forward with row or block scales, or a wgrad on the padded layout.
dg_grouped_desc random_valid_grouped_fp8() {
  const bool wgrad = coin(3);
  const dg_dtype in = pick({DG_E4M3, DG_E5M2});
  const int64_t g = coin(8) ? 1 + static_cast<int64_t>(below(1 << 16)) : 1 + static_cast<int64_t>(below(64));
  const int64_t t = coin(8) ? 0 : static_cast<int64_t>(below(1 << 16));
  const int64_t n = (wgrad ? 1 : 8) * (1 + static_cast<int64_t>(below(512)));
  const int64_t k = (wgrad ? 4 : 16) * (1 + static_cast<int64_t>(below(512)));
  const int64_t kb = (k + 127) / 128, nb = (n + 127) / 128;
  dg_grouped_desc d =
      grouped_desc(wgrad ? DG_GROUPED_WGRAD : DG_GROUPED_FORWARD, g, t, n, k, in, wgrad ? DG_F32 : DG_BF16);
  d.scale_a = static_cast<const float*>(fake_ptr(8));
  d.scale_b = static_cast<const float*>(fake_ptr(9));
  if (wgrad) {
    const int64_t tp = 128 * ((t + 127) / 128 + g);
    d.scale_mode = DG_SCALE_BLOCK;
    d.a_shape = shape2(n, tp);
    d.b_shape = shape2(k, tp);
    d.scale_a_shape = shape2(tp / 128, n);
    d.scale_b_shape = shape2(tp / 128, k);
  } else if (coin(2)) {
    d.scale_mode = DG_SCALE_ROW;
    d.scale_a_shape = {1, {t, 0, 0}};
    d.scale_b_shape = shape2(g, n);
  } else {
    d.scale_mode = DG_SCALE_BLOCK;
    d.scale_a_shape = shape2(t, kb);
    d.scale_a_ld = std::max<int64_t>(t, 1) + (coin(2) ? 0 : static_cast<int64_t>(below(64)));
    d.scale_b_shape = shape3(g, kb, nb);
  }
  d.accumulate = static_cast<int>(below(2));
  d.config = -1;
  return d;
}

dg_grouped_desc random_valid_grouped() {
  if (coin(3)) return random_valid_grouped_fp8();
  const dg_grouped_kind kind = static_cast<dg_grouped_kind>(below(3));
  const dg_dtype in = pick({DG_BF16, DG_F16});
  const dg_dtype out = pick({in, DG_F32});
  const int64_t g = coin(8) ? 1 + static_cast<int64_t>(below(1 << 20)) : 1 + static_cast<int64_t>(below(64));
  const int64_t t = coin(8) ? 0 : static_cast<int64_t>(below(1 << 16));
  const int64_t n = 8 * (1 + static_cast<int64_t>(below(512)));
  const int64_t k = 8 * (1 + static_cast<int64_t>(below(512)));
  dg_grouped_desc d = grouped_desc(kind, g, t, n, k, in, out);
  d.accumulate = static_cast<int>(below(2));
  d.config = -1;
  return d;
}

void mutate_shape(dg_grouped_shape* s) {
  if (coin(5))
    s->ndim = coin(2) ? static_cast<int>(below(6)) - 1 : any_int();
  else if (coin(3))
    s->size[below(3)] = static_cast<int64_t>(static_cast<uint64_t>(s->size[below(3)]) + below(3) - 1);
  else
    s->size[below(3)] = any_int64();
}

void mutate_grouped(dg_grouped_desc* d) {
  const int count = 1 + static_cast<int>(below(3));
  for (int i = 0; i < count; ++i) {
    switch (below(13)) {
      case 12:  // the FP8 fields
        switch (below(6)) {
          case 0:
            mutate_enum(&d->scale_mode);
            break;
          case 1:
            d->scale_a = static_cast<const float*>(any_ptr(fake_ptr(8)));
            break;
          case 2:
            d->scale_b = static_cast<const float*>(any_ptr(fake_ptr(9)));
            break;
          case 3:
            mutate_shape(&d->scale_a_shape);
            break;
          case 4:
            mutate_shape(&d->scale_b_shape);
            break;
          default:
            d->scale_a_ld =
                coin(2) ? static_cast<int64_t>(static_cast<uint64_t>(d->scale_a_ld) + below(5) - 2) : any_int64();
            break;
        }
        break;
      case 11:
        if (coin(2)) {
          d->config = any_int();
        } else {  // out at or near an input
          const void* in = coin(3) ? d->a : coin(2) ? d->b : static_cast<const void*>(d->offs);
          d->out = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(in) + 16 * (below(64) - 32));
        }
        break;
      case 0:
        mutate_enum(&d->kind);
        break;
      case 1:
        mutate_enum(&d->in_dtype);
        break;
      case 2:
        mutate_enum(&d->out_dtype);
        break;
      case 3:
        d->num_groups = any_int64();
        break;
      case 4:
        d->offs = static_cast<const int32_t*>(any_ptr(d->offs));
        break;
      case 5:
        d->a = any_ptr(fake_ptr(5));
        break;
      case 6:
        d->b = any_ptr(fake_ptr(6));
        break;
      case 7:
        d->out = const_cast<void*>(any_ptr(fake_ptr(7)));
        break;
      case 8:
        mutate_shape(&d->a_shape);
        break;
      case 9:
        mutate_shape(&d->b_shape);
        break;
      default:
        mutate_shape(&d->out_shape);
        break;
    }
  }
  if (coin(6)) {  // consistent extreme sizes: the overflow checks, not the shape checks, refuse
    const int64_t g = any_int64(), t = any_int64(), n = any_int64(), k = any_int64();
    const dg_grouped_desc was = *d;  // its dtypes may hold any int: copied as bytes
    *d = grouped_desc(static_cast<dg_grouped_kind>(below(3)), g, t, n, k);
    std::memcpy(&d->in_dtype, &was.in_dtype, sizeof d->in_dtype);
    std::memcpy(&d->out_dtype, &was.out_dtype, sizeof d->out_dtype);
  }
}

bool same(const dg_grouped_shape& s, std::initializer_list<int64_t> sizes) {
  if (s.ndim != static_cast<int>(sizes.size())) return false;
  for (size_t i = 0; i < sizes.size(); ++i)
    if (s.size[i] != sizes.begin()[i]) return false;
  return true;
}

bool extent_ok(const void* p, std::initializer_list<int64_t> sizes, int bytes, unsigned align) {
  i128 e = bytes;
  for (int64_t s : sizes) {
    if (s < 0) return false;
    e *= s;
    if (e > INT64_MAX) return false;
  }
  const uintptr_t u = reinterpret_cast<uintptr_t>(p);
  return (u != 0 || e == 0) && u % align == 0 && (i128)u + e <= (i128)UINTPTR_MAX;
}

// Whether [p, p + bytes) and [q, q + q_bytes) share a byte (empty ranges share none).
bool overlap(const void* p, i128 bytes, const void* q, i128 q_bytes) {
  const i128 a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(q);
  return bytes > 0 && q_bytes > 0 && a < b + q_bytes && b < a + bytes;
}

// An FP8 desc that passed: the modes, shapes, extents and scales dg_grouped_desc lays out.
void check_grouped_fp8_oracle(const dg_grouped_desc& d, int kind, int out) {
  const int mode = raw(d.scale_mode);
  const int64_t lim = int64_t(1) << 31, g = d.num_groups;
  if (kind == DG_GROUPED_DGRAD || (mode != DG_SCALE_ROW && mode != DG_SCALE_BLOCK))
    return report("grouped fp8 oracle", "kind or scale mode");
  if (g < 1 || g >= lim) return report("grouped fp8 oracle", "groups");
  if (d.a_shape.ndim != 2 || d.b_shape.ndim != (kind == DG_GROUPED_WGRAD ? 2 : 3))
    return report("grouped fp8 oracle", "ndim");
  i128 a_bytes = 0, b_bytes = 0, out_bytes = 0, sa = 0, sb = 0;
  bool ok = extent_ok(d.offs, {g}, 4, 4);
  if (kind == DG_GROUPED_WGRAD) {
    const int64_t n = d.a_shape.size[0], tp = d.a_shape.size[1], k = d.b_shape.size[0], t = tp - 128 * g;
    if (mode != DG_SCALE_BLOCK || out != DG_F32) return report("grouped fp8 oracle", "wgrad mode or out dtype");
    if (tp % 128 || t < 0 || tp >= lim || n < 1 || n >= lim || k < 1 || k >= lim || k % 4)
      return report("grouped fp8 oracle", "wgrad N, K or Tp");
    ok = ok && same(d.b_shape, {k, tp}) && same(d.out_shape, {g, n, k}) && same(d.scale_a_shape, {tp / 128, n}) &&
         same(d.scale_b_shape, {tp / 128, k}) && extent_ok(d.a, {n, tp}, 1, 16) && extent_ok(d.b, {k, tp}, 1, 16) &&
         extent_ok(d.out, {g, n, k}, 4, 16) && extent_ok(d.scale_a, {tp / 128, n}, 4, 4) &&
         extent_ok(d.scale_b, {tp / 128, k}, 4, 4);
    a_bytes = (i128)n * tp, b_bytes = (i128)k * tp, out_bytes = (i128)g * n * k * 4;
    sa = (i128)(tp / 128) * n * 4, sb = (i128)(tp / 128) * k * 4;
  } else {
    const int64_t t = d.a_shape.size[0], k = d.a_shape.size[1], n = d.b_shape.size[1];
    if (out != DG_BF16) return report("grouped fp8 oracle", "forward out dtype");
    if (t < 0 || t >= lim || n < 1 || n >= lim || k < 1 || k >= lim || k % 16 || n % 8)
      return report("grouped fp8 oracle", "forward T, N or K");
    const int64_t kb = (k + 127) / 128, nb = (n + 127) / 128;
    ok = ok && same(d.b_shape, {g, n, k}) && same(d.out_shape, {t, n}) && extent_ok(d.a, {t, k}, 1, 16) &&
         extent_ok(d.b, {g, n, k}, 1, 16) && extent_ok(d.out, {t, n}, 2, 16);
    a_bytes = (i128)t * k, b_bytes = (i128)g * n * k, out_bytes = (i128)t * n * 2;
    if (mode == DG_SCALE_ROW) {
      ok = ok && same(d.scale_a_shape, {t}) && same(d.scale_b_shape, {g, n}) && extent_ok(d.scale_a, {t}, 4, 4) &&
           extent_ok(d.scale_b, {g, n}, 4, 4);
      sa = (i128)t * 4, sb = (i128)g * n * 4;
    } else {
      const i128 span = (i128)(kb - 1) * d.scale_a_ld + t;
      ok = ok && same(d.scale_a_shape, {t, kb}) && same(d.scale_b_shape, {g, kb, nb}) &&
           d.scale_a_ld >= std::max<int64_t>(t, 1) && span <= INT64_MAX / 4 &&
           extent_ok(d.scale_a, {static_cast<int64_t>(span)}, 4, 4) && extent_ok(d.scale_b, {g, kb, nb}, 4, 4);
      sa = span * 4, sb = (i128)g * kb * nb * 4;
    }
  }
  if (!ok) return report("grouped fp8 oracle", "shapes, pointers or extents");
  if (overlap(d.out, out_bytes, d.a, a_bytes) || overlap(d.out, out_bytes, d.b, b_bytes) ||
      overlap(d.out, out_bytes, d.offs, 4 * (i128)g) || overlap(d.out, out_bytes, d.scale_a, sa) ||
      overlap(d.out, out_bytes, d.scale_b, sb))
    report("grouped fp8 oracle", "out overlaps an input");
}

void check_grouped_oracle(const dg_grouped_desc& d) {
  const int kind = raw(d.kind), in = raw(d.in_dtype), out = raw(d.out_dtype);
  if (kind < 0 || kind > 2) return report("grouped oracle", "kind");
  if (d.config < -1) return report("grouped oracle", "config");
  if (in == DG_E4M3 || in == DG_E5M2) return check_grouped_fp8_oracle(d, kind, out);
  if (!(in == DG_BF16 || in == DG_F16) || !(out == in || out == DG_F32)) return report("grouped oracle", "dtypes");
  const int64_t lim = int64_t(1) << 31, g = d.num_groups;
  if (g < 1 || g >= lim) return report("grouped oracle", "groups");
  if (d.a_shape.ndim != 2) return report("grouped oracle", "a ndim");
  const bool wgrad = kind == DG_GROUPED_WGRAD;
  const int64_t t = d.a_shape.size[0];
  const int64_t n = wgrad ? d.a_shape.size[1] : kind == DG_GROUPED_FORWARD ? d.b_shape.size[1] : d.b_shape.size[2];
  const int64_t k = wgrad ? d.b_shape.size[1] : d.a_shape.size[1];
  if (t < 0 || t >= lim || n < 1 || n >= lim || k < 1 || k >= lim || n % 8 || k % 8)
    return report("grouped oracle", "T/N/K");
  const int ib = in == DG_F32 ? 4 : 2, ob = out == DG_F32 ? 4 : 2;
  bool ok = extent_ok(d.offs, {g}, 4, 4);
  if (wgrad) {
    ok = ok && same(d.b_shape, {t, k}) && same(d.out_shape, {g, n, k}) && extent_ok(d.a, {t, n}, ib, 16) &&
         extent_ok(d.b, {t, k}, ib, 16) && extent_ok(d.out, {g, n, k}, ob, 16);
  } else {
    const bool fwd = kind == DG_GROUPED_FORWARD;
    ok = ok && same(d.b_shape, {g, fwd ? n : k, fwd ? k : n}) && same(d.out_shape, {t, n}) &&
         extent_ok(d.a, {t, k}, ib, 16) && extent_ok(d.b, {g, n, k}, ib, 16) && extent_ok(d.out, {t, n}, ob, 16);
  }
  if (!ok) return report("grouped oracle", "shapes, pointers or extents");
  // out shares no byte with the buffers the kernels read.
  const i128 out_bytes = wgrad ? (i128)g * n * k * ob : (i128)t * n * ob;
  const i128 a_bytes = (i128)t * (wgrad ? n : k) * ib, b_bytes = wgrad ? (i128)t * k * ib : (i128)g * n * k * ib;
  auto apart = [&](const void* p, i128 bytes) {
    const i128 o = reinterpret_cast<uintptr_t>(d.out), q = reinterpret_cast<uintptr_t>(p);
    return out_bytes == 0 || bytes == 0 || o + out_bytes <= q || q + bytes <= o;
  };
  if (!apart(d.a, a_bytes) || !apart(d.b, b_bytes) || !apart(d.offs, 4 * (i128)g))
    report("grouped oracle", "out overlaps an input");
}

void fuzz_grouped(bool launch) {
  dg_grouped_desc d = random_valid_grouped();
  const bool mutated = !coin(8);
  if (mutated) mutate_grouped(&d);
  size_t bytes = 0;
  const dg_status s = dg_grouped_gemm_workspace_size(&d, &bytes);
  expect_status(s, "dg_grouped_gemm_workspace_size");
  // DISTGEMM_FUZZ_DUMP=FILE: every answer, to compare two builds' checks (a refactor's diff).
  static FILE* dump = std::getenv("DISTGEMM_FUZZ_DUMP") ? std::fopen(std::getenv("DISTGEMM_FUZZ_DUMP"), "w") : nullptr;
  if (dump) std::fprintf(dump, "%d %s\n", raw(s), s == DG_SUCCESS ? "" : dg_last_error());
  ++grouped_calls;
  grouped_passed += s != DG_ERROR_INVALID_ARGUMENT;
  grouped_fp8_passed += s != DG_ERROR_INVALID_ARGUMENT && (raw(d.in_dtype) == DG_E4M3 || raw(d.in_dtype) == DG_E5M2);
  if (s != DG_ERROR_INVALID_ARGUMENT) check_grouped_oracle(d);
  if (!mutated && !passes_checks(s))
    report("dg_grouped_gemm_workspace_size", std::string("refused a valid desc: ") + dg_last_error());
  static const int archs[] = {90, 100, 0, -1, 80, INT_MAX, INT_MIN};
  const int arch = archs[below(std::size(archs))];
  const int count = dg_grouped_gemm_config_count(&d, arch);
  const int config = coin(2) ? static_cast<int>(below(4)) : any_int();
  const char* name = dg_grouped_gemm_config_name(&d, arch, config);
  if (count < 0 || (name != nullptr) != (config >= 0 && config < count))
    report("dg_grouped_gemm_config_name", "inconsistent");
  expect_status(dg_grouped_gemm_cublas(&d, nullptr, nullptr), "dg_grouped_gemm_cublas");
  if (launch) expect_status(dg_grouped_gemm(&d, nullptr, 0, nullptr), "dg_grouped_gemm");
}

// ---------------------------------------------------------------- tensor-parallel sizes

void fuzz_tp() {
  dg_tp_desc d{};
  d.gemm = random_valid_gemm();
  d.world = coin(2) ? 2 + static_cast<int>(below(7)) : any_int();
  static void* workspaces[64];
  d.peer_workspaces = workspaces;
  d.timeout_s = 1.0;
  if (!coin(4)) mutate_gemm(&d.gemm);
  dg_tp_kind kind = static_cast<dg_tp_kind>(1 + below(2));
  if (coin(8)) set_raw(&kind, static_cast<int>(below(4)));  // within the enum's range: 0..3
  size_t bytes = 0;
  const dg_status s = dg_tp_workspace_size(kind, &d, &bytes);
  expect_status(s, "dg_tp_workspace_size");
  ++tp_calls;
  tp_passed += s == DG_SUCCESS;
}

// ---------------------------------------------------------------- FP8 quantization

long quant_calls = 0, quant_passed = 0;

dg_quantize_desc random_valid_quantize() {
  const auto g = static_cast<dg_quant_granularity>(below(4));
  const int64_t rows = coin(8) ? 0 : static_cast<int64_t>(below(1 << 16));
  const int64_t cols = coin(8) ? 0 : static_cast<int64_t>(below(1 << 14));
  dg_quantize_desc d = quantize_desc(g, rows, cols, pick({DG_BF16, DG_F16, DG_F32}), pick({DG_E4M3, DG_E5M2}));
  if (g == DG_QUANT_128X128 && coin(2)) d.batch = static_cast<int64_t>(below(64));
  if (g == DG_QUANT_1X128 && coin(2)) {
    d.transpose = 1;
    if (coin(2)) {
      d.num_groups = 1 + static_cast<int64_t>(below(coin(8) ? 1 << 20 : 64));
      d.offs = static_cast<const int32_t*>(fake_ptr(12));
    }
  }
  dg_quantize_sizes s{};
  if (dg_quantize_fp8_sizes(&d, &s) != DG_SUCCESS) report("dg_quantize_fp8_sizes", dg_last_error());
  d.workspace_bytes = s.workspace_bytes;
  return d;
}

void mutate_quantize(dg_quantize_desc* d) {
  const int count = 1 + static_cast<int>(below(3));
  for (int i = 0; i < count; ++i) {
    switch (below(14)) {
      case 0:
        mutate_enum(&d->x_dtype);
        break;
      case 1:
        mutate_enum(&d->out_dtype);
        break;
      case 2:
        mutate_enum(&d->granularity);
        break;
      case 3:
        d->rows = any_int64();
        break;
      case 4:
        d->cols = any_int64();
        break;
      case 5:
        d->batch = any_int64();
        break;
      case 6:
        d->transpose = coin(2) ? static_cast<int>(below(2)) : any_int();
        break;
      case 7:
        d->num_groups = any_int64();
        break;
      case 8:
        d->x = any_ptr(d->x);
        break;
      case 9:
        d->out = const_cast<void*>(any_ptr(d->out));
        break;
      case 10:
        d->scale = static_cast<float*>(const_cast<void*>(any_ptr(d->scale)));
        break;
      case 11:
        d->offs = static_cast<const int32_t*>(any_ptr(d->offs));
        break;
      case 12:
        d->workspace = const_cast<void*>(any_ptr(d->workspace));
        break;
      default:
        d->workspace_bytes = static_cast<size_t>(any_int64());
        break;
    }
  }
}

// The layout of a desc by 128-bit arithmetic: false (and why) where it is not one the API takes.
struct QuantLayout {
  i128 x_bytes, data, scale, workspace, data_rows, data_cols, scale_rows, scale_cols;
};

bool quant_layout(const dg_quantize_desc& d, QuantLayout* l, std::string* why) {
  const int g = raw(d.granularity), in = raw(d.x_dtype), out = raw(d.out_dtype);
  const i128 lim64 = INT64_MAX, lim31 = i128(1) << 31;
  if (g < 0 || g > 3) return *why = "granularity", false;
  if (in != DG_BF16 && in != DG_F16 && in != DG_F32) return *why = "x dtype", false;
  if (out != DG_E4M3 && out != DG_E5M2) return *why = "out dtype", false;
  if (d.rows < 0 || d.cols < 0 || d.batch < 0 || (g != DG_QUANT_128X128 && d.batch != 1)) return *why = "sizes", false;
  if (d.transpose && g != DG_QUANT_1X128) return *why = "transpose", false;
  const i128 groups = d.num_groups;
  if (groups < 0 || groups >= lim31 || (groups && !d.transpose) || (groups && d.rows >= lim31))
    return *why = "num_groups", false;
  const i128 batch = d.batch, rows = d.rows, cols = d.cols;
  auto nb = [](i128 n) { return (n + 127) / 128; };
  // a * b * c within int64, multiplied left to right as the checks do (so (2^62, 2^62, 0)
  // overflows); each partial product of non-negative values below 2^63 fits in 128 bits.
  auto fits = [&](i128 a, i128 b, i128 c, i128* p) {
    *p = a * b;
    if (*p > lim64) return false;
    *p *= c;
    return *p <= lim64;
  };
  i128 x = 0;
  if (!fits(batch, rows, cols, &x) || x * (in == DG_F32 ? 4 : 2) > lim64) return *why = "x extent", false;
  l->x_bytes = x * (in == DG_F32 ? 4 : 2);
  l->workspace = 0;
  l->data_rows = rows;
  l->data_cols = cols;
  switch (g) {
    case DG_QUANT_TENSOR:
      l->scale_rows = 1;
      l->scale_cols = 1;
      l->workspace = 4;
      break;
    case DG_QUANT_ROW:
      l->scale_rows = rows;
      l->scale_cols = 1;
      break;
    case DG_QUANT_128X128:
      l->scale_rows = nb(rows);
      l->scale_cols = nb(cols);
      break;
    default:
      if (!d.transpose) {
        l->scale_rows = nb(cols);
        l->scale_cols = rows;
      } else {
        l->data_rows = cols;
        l->data_cols = groups ? 128 * (nb(rows) + groups) : rows;
        l->scale_rows = groups ? nb(rows) + groups : nb(rows);
        l->scale_cols = cols;
        l->workspace = 4 * groups;
      }
  }
  const i128 mats = g == DG_QUANT_128X128 ? batch : 1;
  if (!fits(mats, l->data_rows, l->data_cols, &l->data)) return *why = "data extent", false;
  if (!fits(mats, l->scale_rows, l->scale_cols, &l->scale) || l->scale * 4 > lim64) return *why = "scale extent", false;
  return true;
}

bool quant_buffer(const void* p, i128 bytes, unsigned align) {
  const auto a = static_cast<i128>(reinterpret_cast<uintptr_t>(p));
  return (bytes == 0 || p != nullptr) && a % align == 0 && a + bytes <= (i128)UINTPTR_MAX;
}

// A buffer of a call, for the oracle: `bytes` from p, and whether the call writes it.
struct Buf {
  const void* p;
  i128 bytes;
  bool written;
};

// No written buffer shares a byte with another one (empty buffers share none).
bool apart(std::initializer_list<Buf> bufs) {
  for (const Buf& w : bufs) {
    if (!w.written || w.bytes <= 0) continue;
    const i128 w0 = reinterpret_cast<uintptr_t>(w.p);
    for (const Buf& o : bufs) {
      const i128 o0 = reinterpret_cast<uintptr_t>(o.p);
      if (&o != &w && o.bytes > 0 && w0 < o0 + o.bytes && o0 < w0 + w.bytes) return false;
    }
  }
  return true;
}

void fuzz_quant(bool launch) {
  dg_quantize_desc d = random_valid_quantize();
  const bool mutated = !coin(8);
  if (mutated) mutate_quantize(&d);
  QuantLayout l{};
  std::string why;
  const bool valid_shape = quant_layout(d, &l, &why);
  dg_quantize_sizes s{};
  const bool null_sizes = coin(16);
  const dg_status ss = dg_quantize_fp8_sizes(&d, null_sizes ? nullptr : &s);
  expect_status(ss, "dg_quantize_fp8_sizes");
  if (ss == DG_SUCCESS && !valid_shape) report("dg_quantize_fp8_sizes oracle", why);
  if (ss == DG_SUCCESS && (s.data_rows != l.data_rows || s.data_cols != l.data_cols || s.scale_rows != l.scale_rows ||
                           s.scale_cols != l.scale_cols || (i128)s.workspace_bytes != l.workspace))
    report("dg_quantize_fp8_sizes", "sizes differ from the oracle's");
  if (ss != DG_SUCCESS && valid_shape && !null_sizes)
    report("dg_quantize_fp8_sizes", std::string("refused a valid shape: ") + dg_last_error());
  if (!launch) return;
  const dg_status st = dg_quantize_fp8(&d, nullptr);
  expect_status(st, "dg_quantize_fp8");
  ++quant_calls;
  quant_passed += st != DG_ERROR_INVALID_ARGUMENT;
  if (st != DG_ERROR_INVALID_ARGUMENT) {
    const int eb = raw(d.x_dtype) == DG_F32 ? 4 : 2;
    if (!valid_shape)
      report("dg_quantize_fp8 oracle", why);
    else if (!quant_buffer(d.x, l.x_bytes, eb))
      report("dg_quantize_fp8 oracle", "x");
    else if (!quant_buffer(d.out, l.data, 1))
      report("dg_quantize_fp8 oracle", "out");
    else if (!quant_buffer(d.scale, 4 * l.scale, 4))
      report("dg_quantize_fp8 oracle", "scale");
    else if (d.num_groups > 0 && !quant_buffer(d.offs, 4 * (i128)d.num_groups, 4))
      report("dg_quantize_fp8 oracle", "offs");
    else if ((i128)d.workspace_bytes < l.workspace || (l.workspace > 0 && !quant_buffer(d.workspace, l.workspace, 4)))
      report("dg_quantize_fp8 oracle", "workspace");
    else if (!apart({{d.out, l.data, true},
                     {d.scale, 4 * l.scale, true},
                     {d.workspace, l.workspace, true},
                     {d.x, l.x_bytes, false},
                     {d.offs, 4 * (i128)d.num_groups, false}}))
      report("dg_quantize_fp8 oracle", "an output overlaps another buffer");
  }
  if (!mutated && !passes_checks(st))
    report("dg_quantize_fp8", std::string("refused a valid desc: ") + dg_last_error());
}

// ---------------------------------------------------------------- MoE activation

long moe_calls = 0, moe_passed = 0;

dg_moe_act_desc random_valid_moe() {
  dg_moe_act_desc d{};
  const int act = static_cast<int>(below(5));
  set_raw(&d.act, act);
  const bool backward = act == DG_MOE_SWIGLU_BACKWARD || act == DG_MOE_GELU_BACKWARD;
  d.tokens = coin(8) ? 0 : static_cast<int64_t>(below(1 << 16));
  d.inner = 128 * static_cast<int64_t>(below(64)) + (coin(2) ? 0 : static_cast<int64_t>(below(128)));
  d.x = fake_ptr(40);
  d.dy = backward ? fake_ptr(41) : nullptr;
  d.fp8_dtype = pick({DG_E4M3, DG_E5M2});
  const bool rows_ok = act != DG_MOE_SWIGLU_BACKWARD || d.inner % 128 == 0;
  do {
    d.y = coin(2) ? fake_ptr(42) : nullptr;
    d.y_fp8 = rows_ok && coin(2) ? fake_ptr(43) : nullptr;
    d.yt_fp8 = coin(2) ? fake_ptr(45) : nullptr;
  } while (!d.y && !d.y_fp8 && !d.yt_fp8);
  if (d.y_fp8) d.y_scale = static_cast<float*>(fake_ptr(44));
  if (d.yt_fp8) {
    d.yt_scale = static_cast<float*>(fake_ptr(46));
    d.offs = static_cast<const int32_t*>(fake_ptr(47));
    d.num_groups = 1 + static_cast<int64_t>(below(coin(8) ? 1 << 20 : 300));
    d.workspace = fake_ptr(48);
    d.workspace_bytes = 4 * static_cast<size_t>(d.num_groups);
  }
  return d;
}

void mutate_moe(dg_moe_act_desc* d) {
  const int count = 1 + static_cast<int>(below(3));
  for (int i = 0; i < count; ++i) {
    switch (below(12)) {
      case 0:
        mutate_enum(&d->act);
        break;
      case 1:
        mutate_enum(&d->fp8_dtype);
        break;
      case 2:
        d->tokens = any_int64();
        break;
      case 3:
        d->inner = any_int64();
        break;
      case 4:
        d->x = any_ptr(fake_ptr(40));
        break;
      case 5:
        d->dy = any_ptr(fake_ptr(41));
        break;
      case 6:
        d->y = const_cast<void*>(any_ptr(fake_ptr(42)));
        break;
      case 7:
        d->y_scale = static_cast<float*>(const_cast<void*>(any_ptr(fake_ptr(44))));
        break;
      case 8:
        d->yt_scale = static_cast<float*>(const_cast<void*>(any_ptr(fake_ptr(46))));
        break;
      case 9:
        d->num_groups = any_int64();
        break;
      case 10:
        d->workspace_bytes = static_cast<size_t>(any_int64());
        break;
      default:
        d->offs = static_cast<const int32_t*>(any_ptr(fake_ptr(47)));
        break;
    }
  }
}

// A descriptor the checks let through: every buffer it names spans its layout's bytes.
void fuzz_moe(bool launch) {
  dg_moe_act_desc d = random_valid_moe();
  const bool mutated = !coin(8);
  if (mutated) mutate_moe(&d);
  size_t ws = 0;
  const dg_status ss = dg_moe_activation_workspace_size(&d, &ws);
  expect_status(ss, "dg_moe_activation_workspace_size");
  if (!launch) return;
  const dg_status st = dg_moe_activation(&d, nullptr);
  expect_status(st, "dg_moe_activation");
  ++moe_calls;
  moe_passed += st != DG_ERROR_INVALID_ARGUMENT;
  if (st != DG_ERROR_INVALID_ARGUMENT) {
    const int act = raw(d.act);
    const bool swiglu = act == DG_MOE_SWIGLU || act == DG_MOE_SWIGLU_BACKWARD;
    const i128 t = d.tokens, c = d.inner, y_cols = act == DG_MOE_SWIGLU_BACKWARD ? 2 * c : c;
    const i128 tp = 128 * ((t + 127) / 128 + d.num_groups);
    if (act < 0 || act > 4 || t < 0 || c < 0)
      report("dg_moe_activation oracle", "act or sizes");
    else if (!quant_buffer(d.x, t * (swiglu ? 2 * c : c) * 2, 2))
      report("dg_moe_activation oracle", "x");
    else if ((act == DG_MOE_SWIGLU_BACKWARD || act == DG_MOE_GELU_BACKWARD) && !quant_buffer(d.dy, t * c * 2, 2))
      report("dg_moe_activation oracle", "dy");
    else if (d.y && !quant_buffer(d.y, t * y_cols * 2, 2))
      report("dg_moe_activation oracle", "y");
    else if (d.y_fp8 && !quant_buffer(d.y_scale, 4 * t * ((y_cols + 127) / 128), 4))
      report("dg_moe_activation oracle", "y_scale");
    else if (d.yt_fp8 &&
             (d.num_groups < 1 || !quant_buffer(d.yt_scale, 4 * y_cols * (tp / 128), 4) ||
              !quant_buffer(d.offs, 4 * (i128)d.num_groups, 4) || (i128)d.workspace_bytes < 4 * (i128)d.num_groups))
      report("dg_moe_activation oracle", "transposed copy, offs or workspace");
    else if (!apart({{d.y, d.y ? 2 * t * y_cols : 0, true},
                     {d.y_fp8, d.y_fp8 ? t * y_cols : 0, true},
                     {d.y_scale, d.y_fp8 ? 4 * t * ((y_cols + 127) / 128) : 0, true},
                     {d.yt_fp8, d.yt_fp8 ? y_cols * tp : 0, true},
                     {d.yt_scale, d.yt_fp8 ? 4 * y_cols * (tp / 128) : 0, true},
                     {d.workspace, d.yt_fp8 ? 4 * (i128)d.num_groups : 0, true},
                     {d.x, 2 * t * (swiglu ? 2 * c : c), false},
                     {d.dy, act == DG_MOE_SWIGLU_BACKWARD || act == DG_MOE_GELU_BACKWARD ? 2 * t * c : 0, false},
                     {d.offs, d.yt_fp8 ? 4 * (i128)d.num_groups : 0, false}}))
      report("dg_moe_activation oracle", "an output overlaps another buffer");
    else if (ss != DG_SUCCESS)
      report("dg_moe_activation", "accepted a desc its workspace query refused");
  }
  if (!mutated && !passes_checks(st))
    report("dg_moe_activation", std::string("refused a valid desc: ") + dg_last_error());
}

// dg_moe_permute: an identity desc's outputs, with the gather's own fields, mutated either way.
long permute_calls = 0, permute_passed = 0;

void fuzz_permute(bool launch) {
  dg_moe_act_desc a = random_valid_moe();
  set_raw(&a.act, DG_MOE_IDENTITY);
  a.dy = nullptr;
  const bool mutated = !coin(8);
  if (mutated && coin(2)) mutate_moe(&a);
  dg_moe_permute_desc d{};
  d.x = a.x;
  d.x_rows = coin(8) ? 0 : static_cast<int64_t>(below(1 << 16));
  d.rows = static_cast<const int64_t*>(fake_ptr(49));
  d.num_rows = a.tokens;
  d.hidden = a.inner;
  d.y = a.y;
  d.y_fp8 = a.y_fp8;
  d.y_scale = a.y_scale;
  d.yt_fp8 = a.yt_fp8;
  d.yt_scale = a.yt_scale;
  d.offs = a.offs;
  d.num_groups = a.num_groups;
  std::memcpy(&d.fp8_dtype, &a.fp8_dtype, sizeof d.fp8_dtype);
  d.workspace = a.workspace;
  d.workspace_bytes = a.workspace_bytes;
  if (mutated) {
    switch (below(5)) {
      case 0:
        d.x_rows = any_int64();
        break;
      case 1:
        d.num_rows = any_int64();
        break;
      case 2:
        d.hidden = any_int64();
        break;
      case 3:
        d.rows = static_cast<const int64_t*>(any_ptr(fake_ptr(49)));
        break;
      default:
        d.x = any_ptr(fake_ptr(40));
        break;
    }
  }
  size_t ws = 0;
  const dg_status ss = dg_moe_permute_workspace_size(&d, &ws);
  expect_status(ss, "dg_moe_permute_workspace_size");
  if (!launch) return;
  const dg_status st = dg_moe_permute(&d, nullptr);
  expect_status(st, "dg_moe_permute");
  ++permute_calls;
  permute_passed += st != DG_ERROR_INVALID_ARGUMENT;
  if (st != DG_ERROR_INVALID_ARGUMENT) {
    const i128 r = d.num_rows, c = d.hidden, tp = 128 * ((r + 127) / 128 + d.num_groups);
    if (r < 0 || c < 0 || d.x_rows < 0 || r >= ((i128)1 << 31))
      report("dg_moe_permute oracle", "sizes");
    else if (!quant_buffer(d.x, (i128)d.x_rows * c * 2, 2) || !quant_buffer(d.rows, 8 * r, 8))
      report("dg_moe_permute oracle", "x or rows");
    else if ((d.y && !quant_buffer(d.y, r * c * 2, 2)) || (d.y_fp8 && !quant_buffer(d.y_fp8, r * c, 1)) ||
             (d.y_fp8 && !quant_buffer(d.y_scale, 4 * r * ((c + 127) / 128), 4)))
      report("dg_moe_permute oracle", "y, y_fp8 or y_scale");
    else if (d.yt_fp8 &&
             (d.num_groups < 1 || !quant_buffer(d.yt_fp8, c * tp, 1) ||
              !quant_buffer(d.yt_scale, 4 * c * (tp / 128), 4) || !quant_buffer(d.offs, 4 * (i128)d.num_groups, 4) ||
              (i128)d.workspace_bytes < 4 * (i128)d.num_groups))
      report("dg_moe_permute oracle", "transposed copy, offs or workspace");
    else if (!apart({{d.y, d.y ? 2 * r * c : 0, true},
                     {d.y_fp8, d.y_fp8 ? r * c : 0, true},
                     {d.y_scale, d.y_fp8 ? 4 * r * ((c + 127) / 128) : 0, true},
                     {d.yt_fp8, d.yt_fp8 ? c * tp : 0, true},
                     {d.yt_scale, d.yt_fp8 ? 4 * c * (tp / 128) : 0, true},
                     {d.workspace, d.yt_fp8 ? 4 * (i128)d.num_groups : 0, true},
                     {d.x, 2 * (i128)d.x_rows * c, false},
                     {d.rows, 8 * r, false},
                     {d.offs, d.yt_fp8 ? 4 * (i128)d.num_groups : 0, false}}))
      report("dg_moe_permute oracle", "an output overlaps another buffer");
    else if (ss != DG_SUCCESS)
      report("dg_moe_permute", "accepted a desc its workspace query refused");
  }
  if (!mutated && !passes_checks(st)) report("dg_moe_permute", std::string("refused a valid desc: ") + dg_last_error());
}

// ---------------------------------------------------------------- FP8 weight quantization

long weight_calls = 0, weight_passed = 0;

// dg_quantize_fp8_weight: w (groups, rows, cols) into out and / or out_t, scale and scale_t.
void fuzz_weight(bool launch) {
  const dg_dtype in = pick({DG_BF16, DG_F16, DG_F32});
  const int64_t groups = coin(8) ? 0 : static_cast<int64_t>(below(64));
  const int64_t rows = coin(8) ? 0 : static_cast<int64_t>(below(1 << 13));
  const int64_t cols = coin(8) ? 0 : static_cast<int64_t>(below(1 << 13));
  dg_quantize_weight_desc d = quantize_weight_desc(groups, rows, cols, in);
  do {
    d.out = coin(2) ? fake_ptr(31) : nullptr;
    d.out_t = coin(2) ? fake_ptr(32) : nullptr;
  } while (!d.out && !d.out_t);
  d.granularity = coin(2) ? DG_QUANT_128X128 : DG_QUANT_ROW;
  // 128 x 128: scale_t optional; row: scale_t with out_t, scale with out (or none: it is unread).
  const bool rows_scaled = d.granularity == DG_QUANT_ROW;
  d.scale_t = (rows_scaled ? d.out_t != nullptr : coin(2)) ? static_cast<float*>(fake_ptr(34)) : nullptr;
  if (rows_scaled && !d.out && coin(2)) d.scale = nullptr;
  d.out_dtype = pick({DG_E4M3, DG_E5M2});
  const bool mutated = !coin(8);
  const int count = mutated ? 1 + static_cast<int>(below(3)) : 0;
  for (int i = 0; i < count; ++i) {
    switch (below(11)) {
      case 0:
        mutate_enum(&d.w_dtype);
        break;
      case 10:
        mutate_enum(&d.granularity);
        break;
      case 1:
        mutate_enum(&d.out_dtype);
        break;
      case 2:
        d.groups = any_int64();
        break;
      case 3:
        d.rows = any_int64();
        break;
      case 4:
        d.cols = any_int64();
        break;
      case 5:
        d.w = any_ptr(fake_ptr(30));
        break;
      case 6:
        d.out = const_cast<void*>(any_ptr(fake_ptr(31)));
        break;
      case 7:
        d.out_t = const_cast<void*>(any_ptr(fake_ptr(32)));
        break;
      case 8:
        d.scale = static_cast<float*>(const_cast<void*>(any_ptr(fake_ptr(33))));
        break;
      default:
        d.scale_t = static_cast<float*>(const_cast<void*>(any_ptr(fake_ptr(34))));
        break;
    }
  }
  if (!launch) return;
  const dg_status st = dg_quantize_fp8_weight(&d, nullptr);
  expect_status(st, "dg_quantize_fp8_weight");
  ++weight_calls;
  weight_passed += st != DG_ERROR_INVALID_ARGUMENT;
  if (st != DG_ERROR_INVALID_ARGUMENT) {
    const int in = raw(d.w_dtype), out = raw(d.out_dtype), gran = raw(d.granularity);
    const bool row = gran == DG_QUANT_ROW;
    const i128 g = d.groups, r = d.rows, c = d.cols, elems = g * r * c;
    const i128 scales = row ? g * r : g * ((r + 127) / 128) * ((c + 127) / 128), eb = in == DG_F32 ? 4 : 2;
    const i128 scales_t = row ? g * c : scales;
    // The scales each granularity writes: 128 x 128 scale always and scale_t where given; row
    // each with its copy.
    const bool has_scale = !row || d.out, has_scale_t = row ? d.out_t != nullptr : d.scale_t != nullptr;
    if ((in != DG_BF16 && in != DG_F16 && in != DG_F32) || (out != DG_E4M3 && out != DG_E5M2) ||
        (gran != DG_QUANT_128X128 && !row))
      report("dg_quantize_fp8_weight oracle", "dtypes or granularity");
    else if (g < 0 || r < 0 || c < 0 || elems * eb > INT64_MAX || (has_scale && scales * 4 > INT64_MAX) ||
             (has_scale_t && scales_t * 4 > INT64_MAX))
      report("dg_quantize_fp8_weight oracle", "sizes");
    else if ((!d.out && !d.out_t) || !quant_buffer(d.w, elems * eb, (unsigned)eb) ||
             (d.out && !quant_buffer(d.out, elems, 1)) || (d.out_t && !quant_buffer(d.out_t, elems, 1)) ||
             (has_scale && !quant_buffer(d.scale, 4 * scales, 4)) ||
             (has_scale_t && !quant_buffer(d.scale_t, 4 * scales_t, 4)))
      report("dg_quantize_fp8_weight oracle", "w, out, out_t, scale or scale_t");
    else if (!apart({{d.out, d.out ? elems : 0, true},
                     {d.out_t, d.out_t ? elems : 0, true},
                     {d.scale, has_scale ? 4 * scales : 0, true},
                     {d.scale_t, has_scale_t ? 4 * scales_t : 0, true},
                     {d.w, elems * eb, false}}))
      report("dg_quantize_fp8_weight oracle", "an output overlaps another buffer");
  }
  if (!mutated && !passes_checks(st))
    report("dg_quantize_fp8_weight", std::string("refused a valid desc: ") + dg_last_error());
}

// ---------------------------------------------------------------- MoE routing (combine)

long routing_calls = 0, routing_passed = 0;

dg_moe_combine_backward_desc random_valid_routing() {
  dg_moe_combine_backward_desc d{};
  d.dtype = pick({DG_BF16, DG_F16, DG_F32});
  d.tokens = coin(8) ? 0 : static_cast<int64_t>(below(1 << 16));
  d.k = 1 + static_cast<int64_t>(below(8));
  d.num_rows = d.tokens * d.k;
  d.hidden = coin(8) ? 0 : static_cast<int64_t>(below(8192));
  d.rows = static_cast<const int64_t*>(fake_ptr(50));
  d.weights = coin(4) ? nullptr : static_cast<const float*>(fake_ptr(51));
  d.dy = fake_ptr(52);
  d.dy_rows = fake_ptr(53);
  d.dweights = coin(2) ? nullptr : static_cast<float*>(fake_ptr(54));
  d.y = d.dweights ? fake_ptr(55) : nullptr;
  return d;
}

void mutate_routing(dg_moe_combine_backward_desc* d) {
  const int count = 1 + static_cast<int>(below(3));
  for (int i = 0; i < count; ++i) {
    switch (below(10)) {
      case 0:
        mutate_enum(&d->dtype);
        break;
      case 1:
        d->tokens = any_int64();
        break;
      case 2:
        d->k = any_int64();
        break;
      case 3:
        d->num_rows = any_int64();
        break;
      case 4:
        d->hidden = any_int64();
        break;
      case 5:
        d->rows = static_cast<const int64_t*>(any_ptr(fake_ptr(50)));
        break;
      case 6:
        d->weights = static_cast<const float*>(any_ptr(fake_ptr(51)));
        break;
      case 7:
        d->dy = any_ptr(fake_ptr(52));
        break;
      case 8:
        d->y = any_ptr(fake_ptr(55));
        break;
      default:
        d->dy_rows = const_cast<void*>(any_ptr(fake_ptr(53)));
        break;
    }
  }
}

// Both entry points on one random descriptor (the forward reads dy as its y and writes dy_rows
// as its out): every buffer a desc the checks let through names spans its bytes.
void fuzz_routing(bool launch) {
  dg_moe_combine_backward_desc b = random_valid_routing();
  const bool mutated = !coin(8);
  if (mutated) mutate_routing(&b);
  if (!launch) return;
  const int dtype = raw(b.dtype);
  const i128 eb = dtype == DG_F32 ? 4 : 2, slots = (i128)b.tokens * b.k;
  const i128 big = (i128)1 << 62;  // past this the checks' int64 extents overflow (and so would the oracle's)
  const bool sizes_ok = (dtype == DG_BF16 || dtype == DG_F16 || dtype == DG_F32) && b.tokens >= 0 && b.k >= 1 &&
                        b.num_rows >= 0 && b.hidden >= 0 && slots < big && (i128)b.num_rows * b.hidden < big &&
                        (i128)b.tokens * b.hidden < big;
  const bool common_ok =
      sizes_ok && quant_buffer(b.rows, 8 * slots, 8) && (b.weights == nullptr || quant_buffer(b.weights, 4 * slots, 4));
  dg_moe_combine_desc f{};
  f.y = b.dy;
  std::memcpy(&f.dtype, &b.dtype, sizeof f.dtype);  // possibly not a valid dg_dtype: copied as bits
  f.num_rows = b.num_rows;
  f.rows = b.rows;
  f.weights = b.weights;
  f.tokens = b.tokens;
  f.k = b.k;
  f.hidden = b.hidden;
  f.out = b.dy_rows;
  const dg_status sf = dg_moe_combine(&f, nullptr);
  expect_status(sf, "dg_moe_combine");
  const dg_status sb = dg_moe_combine_backward(&b, nullptr);
  expect_status(sb, "dg_moe_combine_backward");
  routing_calls += 2;
  routing_passed += (sf != DG_ERROR_INVALID_ARGUMENT) + (sb != DG_ERROR_INVALID_ARGUMENT);
  if (sf != DG_ERROR_INVALID_ARGUMENT &&
      (!common_ok || !quant_buffer(f.y, (i128)f.num_rows * f.hidden * eb, (unsigned)eb) ||
       !quant_buffer(f.out, (i128)f.tokens * f.hidden * eb, (unsigned)eb)))
    report("dg_moe_combine oracle", "sizes, rows, weights, y or out");
  else if (sf != DG_ERROR_INVALID_ARGUMENT && !apart({{f.out, (i128)f.tokens * f.hidden * eb, true},
                                                      {f.y, (i128)f.num_rows * f.hidden * eb, false},
                                                      {f.rows, 8 * slots, false},
                                                      {f.weights, f.weights ? 4 * slots : 0, false}}))
    report("dg_moe_combine oracle", "out overlaps another buffer");
  if (sb != DG_ERROR_INVALID_ARGUMENT &&
      (!common_ok || !quant_buffer(b.dy, (i128)b.tokens * b.hidden * eb, (unsigned)eb) ||
       !quant_buffer(b.dy_rows, (i128)b.num_rows * b.hidden * eb, (unsigned)eb) ||
       (b.dweights != nullptr && (!quant_buffer(b.dweights, 4 * slots, 4) ||
                                  !quant_buffer(b.y, (i128)b.num_rows * b.hidden * eb, (unsigned)eb)))))
    report("dg_moe_combine_backward oracle", "sizes, rows, weights, dy, dy_rows, dweights or y");
  else if (sb != DG_ERROR_INVALID_ARGUMENT && !apart({{b.dy_rows, (i128)b.num_rows * b.hidden * eb, true},
                                                      {b.dweights, b.dweights ? 4 * slots : 0, true},
                                                      {b.dy, (i128)b.tokens * b.hidden * eb, false},
                                                      {b.y, b.dweights ? (i128)b.num_rows * b.hidden * eb : 0, false},
                                                      {b.rows, 8 * slots, false},
                                                      {b.weights, b.weights ? 4 * slots : 0, false}}))
    report("dg_moe_combine_backward oracle", "an output overlaps another buffer");
  if (!mutated && !passes_checks(sb))
    report("dg_moe_combine_backward", std::string("refused a valid desc: ") + dg_last_error());
}

}  // namespace

int main(int argc, char** argv) {
  const long iterations = argc > 1 ? std::strtol(argv[1], nullptr, 10) : 200000;
  const unsigned long long seed = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1;
  const std::string families = argc > 3 ? argv[3] : "gemm,grouped,tp,quant,moe,routing,weight";
  const bool gemm = families.find("gemm") != std::string::npos;
  const bool grouped = families.find("grouped") != std::string::npos;
  const bool tp = families.find("tp") != std::string::npos;
  const bool quant = families.find("quant") != std::string::npos;
  const bool moe = families.find("moe") != std::string::npos;
  const bool routing = families.find("routing") != std::string::npos;
  const bool weight = families.find("weight") != std::string::npos;
  rng.seed(seed);
  // The launching entry points stop at their checks only where no GPU can run a descriptor
  // that passed them (its pointers are fake).
  int devices = 0;
  const bool launch = cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0;
  cudaGetLastError();
  for (long i = 0; i < iterations; ++i) {
    switch (i % 4) {
      case 0:
      case 1:
        if (gemm) fuzz_gemm(launch);
        break;
      case 2:
        if (grouped) fuzz_grouped(launch);
        break;
      default:
        if (tp) fuzz_tp();
        break;
    }
    if (quant && i % 4 == 3) fuzz_quant(launch);
    if (moe && i % 4 == 1) fuzz_moe(launch);
    if (moe && i % 4 == 2) fuzz_permute(launch);
    if (routing && i % 4 == 3) fuzz_routing(launch);
    if (weight && i % 4 == 0) fuzz_weight(launch);
    dg_status s;
    set_raw(&s, static_cast<int>(below(8)));  // within the enum's range (C++)
    if (dg_status_name(s) == nullptr) report("dg_status_name", "NULL");
  }
  std::printf(
      "%ld iterations over %s (seed %llu, launching entry points %s)\n"
      "passed the checks: gemm %ld of %ld, grouped %ld of %ld (FP8 %ld), tp %ld of %ld, quant %ld of %ld, moe %ld of "
      "%ld, "
      "permute %ld of %ld, routing %ld of %ld, weight %ld of %ld\n"
      "%ld failures\n",
      iterations, families.c_str(), seed, launch ? "included" : "skipped: a GPU is present", gemm_passed, gemm_calls,
      grouped_passed, grouped_calls, grouped_fp8_passed, tp_passed, tp_calls, quant_passed, quant_calls, moe_passed,
      moe_calls, permute_passed, permute_calls, routing_passed, routing_calls, weight_passed, weight_calls, failures);
  return failures == 0 ? 0 : 1;
}

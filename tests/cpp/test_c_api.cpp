// The C API's argument checks on the CPU (built with ASan + UBSan: DISTGEMM_HOST_CHECKS).
// Every bad argument is refused with DG_ERROR_INVALID_ARGUMENT and a message naming it; valid
// descriptors pass the checks and stop at DG_ERROR_NOT_SUPPORTED (this build has no kernels,
// the machine may have no GPU). Nothing here needs a device.
#include <gtest/gtest.h>

#include <atomic>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "c_api_helpers.h"
#include "common/error_state.h"
#include "common/per_device.h"
#include "common/status.h"
#include "common/stream_pool.h"
#include "distgemm/distgemm.h"
#include "tp/tp_settings.h"

using namespace dgtest;

namespace {

constexpr int64_t kBig = int64_t(1) << 31;

// Refused as an invalid argument, with a message containing `needle`.
::testing::AssertionResult refused(dg_status s, const std::string& needle) {
  const std::string msg = dg_last_error();
  if (s != DG_ERROR_INVALID_ARGUMENT)
    return ::testing::AssertionFailure() << "status " << dg_status_name(s) << " (" << msg
                                         << "), expected invalid argument mentioning '" << needle << "'";
  if (msg.find(needle) == std::string::npos)
    return ::testing::AssertionFailure() << "message '" << msg << "' does not mention '" << needle << "'";
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult accepted(dg_status s) {
  if (passes_checks(s)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "status " << dg_status_name(s) << ": " << dg_last_error();
}

dg_status gemm_check(const dg_gemm_desc& d) { return dg_gemm_check(&d, 90); }

// ---------------------------------------------------------------- status / errors

TEST(Status, NamesEveryStatusAndUnknown) {
  EXPECT_STREQ(dg_status_name(DG_SUCCESS), "success");
  EXPECT_STREQ(dg_status_name(DG_ERROR_INVALID_ARGUMENT), "invalid argument");
  EXPECT_STREQ(dg_status_name(DG_ERROR_NOT_SUPPORTED), "not supported");
  EXPECT_STREQ(dg_status_name(DG_ERROR_CUDA), "CUDA error");
  EXPECT_STREQ(dg_status_name(DG_ERROR_INTERNAL), "internal error");
  EXPECT_STREQ(dg_status_name(DG_ERROR_TIMEOUT), "timeout");
  dg_status unknown;
  set_raw(&unknown, 7);  // within the enum's range, no status
  EXPECT_STREQ(dg_status_name(unknown), "unknown status");
}

TEST(Status, LastErrorIsThreadLocal) {
  ASSERT_TRUE(refused(dg_gemm_check(nullptr, 90), "desc must not be NULL"));
  std::string other;
  std::thread([&] { other = dg_last_error(); }).join();
  EXPECT_EQ(other, "");
  EXPECT_NE(std::string(dg_last_error()), "");
}

// A pointer from dg_last_error stays readable after later failures on the thread (a longer
// message reallocated the string it pointed into: heap-use-after-free under ASan); it then reads
// the latest message.
TEST(Status, AnEarlierMessagePointerStaysValidAfterALongerMessage) {
  ASSERT_TRUE(refused(dg_gemm_check(nullptr, 90), "desc must not be NULL"));
  const char* first = dg_last_error();
  const std::string long_message(300, 'x');
  EXPECT_EQ(distgemm::fail(DG_ERROR_INVALID_ARGUMENT, "argument " + long_message), DG_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(first), "argument " + long_message);  // read through the earlier pointer
  EXPECT_EQ(first, dg_last_error());
  ASSERT_TRUE(refused(dg_gemm_check(nullptr, 90), "desc must not be NULL"));
  EXPECT_STREQ(first, "desc must not be NULL");
}

TEST(Status, AnOverlongMessageKeepsItsHead) {
  const std::string message = "argument x: " + std::string(100000, 'y');
  distgemm::fail(DG_ERROR_INVALID_ARGUMENT, message);
  const std::string got = dg_last_error();
  EXPECT_LT(got.size(), size_t{4096});
  EXPECT_EQ(got.rfind("argument x: yyy", 0), 0u);
  EXPECT_EQ(got.substr(got.size() - 4), " ...");
}

// ---------------------------------------------------------------- dense GEMM checks

TEST(GemmCheck, ValidDescsPassTheChecks) {
  EXPECT_TRUE(accepted(gemm_check(gemm_desc(128, 256, 64))));
  EXPECT_TRUE(accepted(gemm_check(gemm_desc(1, 8, 8, DG_F16, DG_F32))));
  EXPECT_TRUE(accepted(gemm_check(gemm_desc(64, 64, 16, DG_E4M3, DG_BF16))));
  dg_gemm_desc nmajor = gemm_desc(64, 128, 64);
  nmajor.b.row_stride = 1;
  nmajor.b.col_stride = 128;  // (N, K) stored as its (K, N) transpose
  EXPECT_TRUE(accepted(gemm_check(nmajor)));
  dg_gemm_desc padded = gemm_desc(64, 64, 64);
  padded.a.row_stride = 72;
  padded.d.row_stride = 128;
  EXPECT_TRUE(accepted(gemm_check(padded)));
}

TEST(GemmCheck, ValidDescWithoutKernelsIsNotSupported) {
  const dg_gemm_desc d = gemm_desc(128, 128, 128);
  EXPECT_EQ(dg_gemm_check(&d, 90), DG_ERROR_NOT_SUPPORTED);
  EXPECT_EQ(dg_gemm_check(&d, 80), DG_ERROR_NOT_SUPPORTED);
  EXPECT_NE(std::string(dg_last_error()).find("sm_90 and sm_100"), std::string::npos);
  EXPECT_EQ(dg_gemm_check(&d, 0), DG_ERROR_NOT_SUPPORTED);
  EXPECT_EQ(dg_gemm_check(&d, INT_MIN), DG_ERROR_NOT_SUPPORTED);
}

TEST(GemmCheck, Shapes) {
  EXPECT_TRUE(refused(dg_gemm_check(nullptr, 90), "desc must not be NULL"));
  dg_gemm_desc d = gemm_desc(64, 64, 64);
  d.b.cols = 32;
  EXPECT_TRUE(refused(gemm_check(d), "b must have shape (N, K) with K=64"));
  d = gemm_desc(64, 64, 64);
  d.d.rows = 63;
  EXPECT_TRUE(refused(gemm_check(d), "out must have shape (64, 64)"));
  d = gemm_desc(64, 64, 64);
  d.d.cols = 65;
  EXPECT_TRUE(refused(gemm_check(d), "out must have shape"));
  for (int64_t bad : {int64_t{0}, int64_t{-1}, INT64_MIN}) {
    d = gemm_desc(64, 64, 64);
    d.a.rows = bad;
    EXPECT_TRUE(refused(gemm_check(d), "M, N and K must be positive"));
  }
  d = gemm_desc(kBig, 64, 64);
  EXPECT_TRUE(refused(gemm_check(d), "below 2^31"));
  d = gemm_desc(64, 64, INT64_MAX);
  EXPECT_TRUE(refused(gemm_check(d), "below 2^31"));
}

TEST(GemmCheck, Strides) {
  dg_gemm_desc d = gemm_desc(64, 64, 64);
  d.a.row_stride = 32;
  EXPECT_TRUE(refused(gemm_check(d), "a row stride 32 is smaller than its 64 columns"));
  d.a.row_stride = -64;
  EXPECT_TRUE(refused(gemm_check(d), "a row stride -64 must be non-negative"));
  d.a.row_stride = INT64_MIN;
  EXPECT_TRUE(refused(gemm_check(d), "must be non-negative"));
  d.a.row_stride = INT64_MAX;  // its byte pitch overflows
  EXPECT_TRUE(refused(gemm_check(d), "byte pitch that fits in int64"));
  d.a.row_stride = 68;  // 136 bytes
  EXPECT_TRUE(refused(gemm_check(d), "not a multiple of 16 bytes"));
  d = gemm_desc(64, 64, 64);
  d.a.col_stride = 2;
  EXPECT_TRUE(refused(gemm_check(d), "a must be row-major"));
  d = gemm_desc(64, 64, 64);
  d.b.row_stride = 2;
  d.b.col_stride = 64;
  EXPECT_TRUE(refused(gemm_check(d), "b must be K-major (unit column stride) or N-major"));
  d = gemm_desc(64, 64, 64, DG_E4M3, DG_BF16);
  d.b.row_stride = 1;
  d.b.col_stride = 64;
  EXPECT_TRUE(refused(gemm_check(d), "float8 b must be K-major"));
  d = gemm_desc(64, 64, 64);
  d.d.row_stride = -1;
  EXPECT_TRUE(refused(gemm_check(d), "out row stride -1 must be non-negative"));
}

TEST(GemmCheck, OverflowingExtents) {
  // (rows - 1) * pitch overflows int64 though each factor is fine.
  dg_gemm_desc d = gemm_desc(kBig - 1, 64, 64);
  d.a.row_stride = int64_t(1) << 40;
  EXPECT_TRUE(refused(gemm_check(d), "a spans more than 2^63 bytes"));
  d = gemm_desc(64, 64, 64);
  d.d.row_stride = int64_t(1) << 62;  // pitch 2^63: overflows
  EXPECT_TRUE(refused(gemm_check(d), "out row stride"));
  d = gemm_desc(3, 64, 64);
  d.a.row_stride = (int64_t(1) << 61) + 64;  // pitch fits, 2 * pitch does not
  EXPECT_TRUE(refused(gemm_check(d), "spans more than 2^63 bytes"));
  // In int64 but past the end of the address space.
  d = gemm_desc(64, 64, 64);
  d.a.data = reinterpret_cast<void*>(UINTPTR_MAX & ~uintptr_t{15});
  EXPECT_TRUE(refused(gemm_check(d), "a runs past the end of the address space"));
}

TEST(GemmCheck, OneRowMatrices) {
  // A 1-row matrix's row stride addresses nothing: any non-negative one is taken (PyTorch
  // gives (1, K) views strides such as (1, 1) or (0, 1)).
  for (int64_t stride : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{64}, int64_t(1) << 40}) {
    dg_gemm_desc d = gemm_desc(1, 64, 64);
    d.a.row_stride = stride;
    d.d.row_stride = stride;
    EXPECT_TRUE(accepted(gemm_check(d))) << "row stride " << stride;
  }
  // ... but never a negative one or one whose byte pitch overflows.
  dg_gemm_desc d = gemm_desc(1, 64, 64);
  d.a.row_stride = -1;
  EXPECT_TRUE(refused(gemm_check(d), "a row stride -1 must be non-negative"));
  d.a.row_stride = INT64_MAX;
  EXPECT_TRUE(refused(gemm_check(d), "byte pitch that fits in int64"));
  d = gemm_desc(1, 64, 64);
  d.d.row_stride = INT64_MIN;
  EXPECT_TRUE(refused(gemm_check(d), "out row stride"));
  // The row itself must still fit before the end of the address space.
  d = gemm_desc(1, 64, 64);
  d.d.data = reinterpret_cast<void*>(UINTPTR_MAX & ~uintptr_t{15});
  EXPECT_TRUE(refused(gemm_check(d), "out runs past the end of the address space"));
}

TEST(GemmCheck, BiasAndC) {
  dg_gemm_desc d = gemm_desc(64, 64, 64);
  d.c = {fake_ptr(8), DG_BF16, 1, 64, 64, 1};
  d.beta = 1.f;
  EXPECT_TRUE(accepted(gemm_check(d)));
  d.c.row_stride = -5;  // a bias row: its stride is irrelevant, but never negative
  EXPECT_TRUE(refused(gemm_check(d), "c (bias) row stride -5"));
  d.c = {fake_ptr(8), DG_BF16, 64, 64, 64, 1};
  EXPECT_TRUE(accepted(gemm_check(d)));
  d.c.rows = 32;
  EXPECT_TRUE(refused(gemm_check(d), "c must have shape (64, 64)"));
  d.c = {fake_ptr(8), DG_F32, 64, 64, 64, 1};
  EXPECT_TRUE(refused(gemm_check(d), "c must have the output dtype bfloat16"));
  set_raw(&d.c.dtype, 4242);
  EXPECT_TRUE(refused(gemm_check(d), "c has an unknown dtype (4242)"));
}

TEST(GemmCheck, Dtypes) {
  dg_gemm_desc d = gemm_desc(64, 64, 64);
  d.b.dtype = DG_F16;
  EXPECT_TRUE(refused(gemm_check(d), "a and b must have the same dtype"));
  d = gemm_desc(64, 64, 64, DG_F32, DG_F32);
  EXPECT_TRUE(refused(gemm_check(d), "a must be bfloat16, float16, float8_e4m3fn or float8_e5m2"));
  d = gemm_desc(64, 64, 64, DG_E5M2, DG_BF16);
  EXPECT_TRUE(refused(gemm_check(d), "float8_e5m2 x float8_e5m2 is not supported"));
  d = gemm_desc(64, 64, 64, DG_E4M3, DG_E4M3);
  EXPECT_TRUE(refused(gemm_check(d), "out dtype for float8 inputs"));
  d = gemm_desc(64, 64, 64, DG_BF16, DG_F16);
  EXPECT_TRUE(refused(gemm_check(d), "out dtype must be bfloat16 or float32"));
  for (int raw : {-1, 6, 7, 8, 255, INT_MAX, INT_MIN}) {
    d = gemm_desc(64, 64, 64);
    set_raw(&d.a.dtype, raw);
    EXPECT_TRUE(refused(gemm_check(d), "a has an unknown dtype")) << raw;
    d = gemm_desc(64, 64, 64);
    set_raw(&d.b.dtype, raw);
    EXPECT_TRUE(refused(gemm_check(d), "b has an unknown dtype")) << raw;
    d = gemm_desc(64, 64, 64);
    set_raw(&d.d.dtype, raw);
    EXPECT_TRUE(refused(gemm_check(d), "out has an unknown dtype")) << raw;
  }
}

TEST(GemmCheck, Scales) {
  alignas(16) static float scales[4];
  dg_gemm_desc d = gemm_desc(64, 32, 64);
  d.scale_a = scales;
  d.scale_a_len = 1;
  EXPECT_TRUE(refused(gemm_check(d), "scale_a / scale_b apply to float8 inputs only"));
  d = gemm_desc(64, 32, 64, DG_E4M3, DG_BF16);
  d.scale_a = scales;
  d.scale_a_len = 64;
  d.scale_b = scales;
  d.scale_b_len = 32;
  EXPECT_TRUE(accepted(gemm_check(d)));
  d.scale_a_len = 32;
  EXPECT_TRUE(refused(gemm_check(d), "scale_a must hold 1 or M=64 values, got 32"));
  d.scale_a_len = 1;
  d.scale_b_len = -1;
  EXPECT_TRUE(refused(gemm_check(d), "scale_b must hold 1 or N=32 values"));
  d.scale_b_len = 1;
  d.scale_b = scales + 1;
  EXPECT_TRUE(refused(gemm_check(d), "scale_b must be 16-byte aligned"));
}

TEST(GemmCheck, PointersAndAlignment) {
  dg_gemm_desc d = gemm_desc(64, 64, 64);
  d.a.data = nullptr;
  EXPECT_TRUE(refused(gemm_check(d), "a data pointer must not be NULL"));
  d = gemm_desc(64, 64, 64);
  d.b.data = static_cast<char*>(fake_ptr(2)) + 2;
  EXPECT_TRUE(refused(gemm_check(d), "b data pointer must be 16-byte aligned"));
  d = gemm_desc(64, 64, 64);
  d.d.data = nullptr;
  EXPECT_TRUE(refused(gemm_check(d), "out data pointer must not be NULL"));
  d = gemm_desc(64, 64, 60);  // 120 bytes of bf16 per row
  EXPECT_TRUE(refused(gemm_check(d), "must be a multiple of 8 elements (16 bytes)"));
  d = gemm_desc(64, 64, 24, DG_E4M3, DG_BF16);  // 24 bytes of fp8 per row
  EXPECT_TRUE(refused(gemm_check(d), "multiple of 16 elements"));
}

TEST(GemmCheck, LaunchSettings) {
  // dg_gemm_check refuses the swizzle and config values dg_gemm refuses, before it looks for a
  // kernel; a negative value is not taken for the heuristic's choice (0 and -1 are).
  for (int swizzle : {0, 1, 2, 4, 8}) {
    dg_gemm_desc d = gemm_desc(64, 64, 64);
    d.swizzle = swizzle;
    EXPECT_TRUE(accepted(gemm_check(d))) << swizzle;
  }
  for (int swizzle : {-1, 3, 5, 16, INT_MAX, INT_MIN}) {
    dg_gemm_desc d = gemm_desc(64, 64, 64);
    d.swizzle = swizzle;
    EXPECT_TRUE(refused(gemm_check(d),
                        "swizzle must be 0 (the heuristic's choice), 1, 2, 4 or 8, got " + std::to_string(swizzle)));
    EXPECT_TRUE(refused(dg_gemm(&d, nullptr, 0, nullptr), "swizzle must be"));
  }
  for (int config : {-2, -100, INT_MIN}) {
    dg_gemm_desc d = gemm_desc(64, 64, 64);
    d.config = config;
    EXPECT_TRUE(refused(gemm_check(d),
                        "config must be -1 (the heuristic's choice) or a kernel index, got " + std::to_string(config)));
    dg_grouped_desc g = grouped_desc(DG_GROUPED_FORWARD, 4, 64, 64, 64);
    g.config = config;
    size_t bytes = 0;
    EXPECT_TRUE(refused(dg_grouped_gemm_workspace_size(&g, &bytes), "config must be -1"));
  }
}

TEST(GemmQueries, UnsupportedArchsAndBadDescsGiveMinusOne) {
  const dg_gemm_desc d = gemm_desc(256, 256, 256);
  for (int arch : {0, -1, 70, 80, 89, 120, INT_MAX, INT_MIN}) {
    EXPECT_EQ(dg_gemm_select_config(&d, arch, 132), -1) << arch;
    EXPECT_EQ(dg_gemm_config_count(&d, arch), 0) << arch;
    EXPECT_EQ(dg_gemm_config_name(&d, arch, 0), nullptr) << arch;
  }
  // No kernels in this build: no config on the supported archs either, and no crash.
  for (int arch : {90, 100}) {
    EXPECT_EQ(dg_gemm_select_config(&d, arch, 132), -1);
    EXPECT_EQ(dg_gemm_select_config(&d, arch, 0), -1);
    EXPECT_EQ(dg_gemm_select_config(&d, arch, INT_MIN), -1);
    EXPECT_EQ(dg_gemm_config_name(&d, arch, -1), nullptr);
    EXPECT_EQ(dg_gemm_config_name(&d, arch, INT_MAX), nullptr);
  }
  EXPECT_EQ(dg_gemm_select_config(nullptr, 90, 132), -1);
  EXPECT_EQ(dg_gemm_config_count(nullptr, 90), 0);
  EXPECT_EQ(dg_gemm_config_name(nullptr, 90, 0), nullptr);
  dg_gemm_desc bad = d;
  set_raw(&bad.a.dtype, -7);
  EXPECT_EQ(dg_gemm_config_count(&bad, 90), 0);
  EXPECT_EQ(dg_gemm_select_config(&bad, 90, 132), -1);
}

TEST(GemmRun, ChecksComeFirstAndNothingRunsWithoutADevice) {
  size_t bytes = 123;
  const dg_gemm_desc d = gemm_desc(64, 64, 64);
  EXPECT_TRUE(refused(dg_gemm_workspace_size(&d, nullptr), "bytes must not be NULL"));
  EXPECT_TRUE(refused(dg_gemm_workspace_size(nullptr, &bytes), "desc must not be NULL"));
  dg_gemm_desc bad = d;
  bad.a.row_stride = -1;
  EXPECT_TRUE(refused(dg_gemm_workspace_size(&bad, &bytes), "a row stride -1"));
  EXPECT_TRUE(refused(dg_gemm(&bad, nullptr, 0, nullptr), "a row stride -1"));
  EXPECT_TRUE(refused(dg_gemm(nullptr, nullptr, 0, nullptr), "desc must not be NULL"));
  EXPECT_EQ(bytes, 123u);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    EXPECT_EQ(dg_gemm_workspace_size(&d, &bytes), DG_ERROR_NOT_SUPPORTED);
    EXPECT_EQ(dg_gemm(&d, nullptr, 0, nullptr), DG_ERROR_NOT_SUPPORTED);
  }
}

// ---------------------------------------------------------------- grouped GEMM checks

dg_status grouped_check(const dg_grouped_desc& d) {
  size_t bytes = 0;
  return dg_grouped_gemm_workspace_size(&d, &bytes);
}

TEST(GroupedCheck, ValidDescsPassTheChecks) {
  for (dg_grouped_kind kind : {DG_GROUPED_FORWARD, DG_GROUPED_DGRAD, DG_GROUPED_WGRAD}) {
    EXPECT_TRUE(accepted(grouped_check(grouped_desc(kind, 8, 1000, 256, 128)))) << kind;
    EXPECT_TRUE(accepted(grouped_check(grouped_desc(kind, 1, 0, 8, 8, DG_F16, DG_F32)))) << kind;
    EXPECT_TRUE(accepted(grouped_check(grouped_desc(kind, 300000, 4096, 64, 64)))) << kind;
  }
  // No tokens: a and the (T, N) output hold no elements and may be NULL.
  dg_grouped_desc d = grouped_desc(DG_GROUPED_FORWARD, 4, 0, 64, 64);
  d.a = nullptr;
  d.out = nullptr;
  EXPECT_TRUE(accepted(grouped_check(d)));
  d = grouped_desc(DG_GROUPED_WGRAD, 4, 0, 64, 64);
  d.a = nullptr;
  d.b = nullptr;
  EXPECT_TRUE(accepted(grouped_check(d)));
}

TEST(GroupedCheck, NamesTheMismatchedTensor) {
  // w with fewer groups than offs
  dg_grouped_desc d = grouped_desc(DG_GROUPED_FORWARD, 8, 100, 64, 32);
  d.b_shape = shape3(7, 64, 32);
  EXPECT_TRUE(refused(grouped_check(d), "w (b) must have shape (G, N, K) = (8, N, 32)"));
  // x and w with different K
  d = grouped_desc(DG_GROUPED_FORWARD, 8, 100, 64, 32);
  d.b_shape = shape3(8, 64, 40);
  EXPECT_TRUE(refused(grouped_check(d), "w (b) must have shape"));
  d = grouped_desc(DG_GROUPED_DGRAD, 8, 100, 64, 32);
  d.b_shape = shape3(8, 64, 64);  // (G, K, N) expected, K = 32
  EXPECT_TRUE(refused(grouped_check(d), "w (b) must have shape (G, K, N) = (8, 32, N)"));
  // out with too few rows / the wrong N
  d = grouped_desc(DG_GROUPED_FORWARD, 8, 100, 64, 32);
  d.out_shape = shape2(99, 64);
  EXPECT_TRUE(refused(grouped_check(d), "out (out) must have shape (T, N) = (100, 64)"));
  d.out_shape = shape3(100, 64, 1);
  EXPECT_TRUE(refused(grouped_check(d), "out (out) must have shape"));
  // dy and x with different token counts
  d = grouped_desc(DG_GROUPED_WGRAD, 8, 100, 64, 32);
  d.b_shape = shape2(99, 32);
  EXPECT_TRUE(refused(grouped_check(d), "x (b) must have shape (T, K) with dy's T = 100 rows"));
  // wgrad out with other groups
  d = grouped_desc(DG_GROUPED_WGRAD, 8, 100, 64, 32);
  d.out_shape = shape3(9, 64, 32);
  EXPECT_TRUE(refused(grouped_check(d), "out (out) must have shape (G, N, K) = (8, 64, 32)"));
  // dimensions
  d = grouped_desc(DG_GROUPED_FORWARD, 8, 100, 64, 32);
  d.b_shape = shape2(64, 32);
  EXPECT_TRUE(refused(grouped_check(d), "w (b) must be 3-D (G, N, K), got (64, 32)"));
  d = grouped_desc(DG_GROUPED_FORWARD, 8, 100, 64, 32);
  d.a_shape = shape3(1, 100, 32);
  EXPECT_TRUE(refused(grouped_check(d), "x (a) must be 2-D (T, K)"));
  d = grouped_desc(DG_GROUPED_WGRAD, 8, 100, 64, 32);
  d.a_shape.ndim = 4;
  EXPECT_TRUE(refused(grouped_check(d), "dy (a) must be 2-D (T, N), got a 4-D tensor"));
  for (int ndim : {-1, 0, 1, INT_MIN, INT_MAX}) {
    d = grouped_desc(DG_GROUPED_WGRAD, 8, 100, 64, 32);
    d.out_shape.ndim = ndim;
    EXPECT_TRUE(refused(grouped_check(d), "out (out) must have shape")) << ndim;
  }
}

TEST(GroupedCheck, Sizes) {
  dg_grouped_desc d = grouped_desc(DG_GROUPED_FORWARD, 8, kBig, 64, 32);
  EXPECT_TRUE(refused(grouped_check(d), "x must have between 0 and 2^31 - 1 rows"));
  d = grouped_desc(DG_GROUPED_FORWARD, 8, -1, 64, 32);
  EXPECT_TRUE(refused(grouped_check(d), "x must have between 0 and 2^31 - 1 rows"));
  d = grouped_desc(DG_GROUPED_FORWARD, 8, 100, 0, 32);
  EXPECT_TRUE(refused(grouped_check(d), "N and K must be in [1, 2^31)"));
  d = grouped_desc(DG_GROUPED_WGRAD, 8, 100, 64, INT64_MIN);
  EXPECT_TRUE(refused(grouped_check(d), "N and K must be in [1, 2^31)"));
  d = grouped_desc(DG_GROUPED_FORWARD, 8, 100, 60, 32);
  EXPECT_TRUE(refused(grouped_check(d), "N=60 and K=32 must be multiples of 8"));
  // Each size fits, the bytes do not: G * N * K * 2 > 2^63.
  d = grouped_desc(DG_GROUPED_FORWARD, kBig - 1, 100, int64_t(1) << 30, int64_t(1) << 30);
  EXPECT_TRUE(refused(grouped_check(d), "w spans more than 2^63 bytes"));
  d = grouped_desc(DG_GROUPED_WGRAD, kBig - 1, 100, int64_t(1) << 30, int64_t(1) << 30, DG_BF16, DG_F32);
  EXPECT_TRUE(refused(grouped_check(d), "out spans more than 2^63 bytes"));
  // In int64 but past the end of the address space.
  d = grouped_desc(DG_GROUPED_FORWARD, 8, 100, 64, 32);
  d.b = reinterpret_cast<void*>(UINTPTR_MAX & ~uintptr_t{15});
  EXPECT_TRUE(refused(grouped_check(d), "w runs past the end of the address space"));
}

TEST(GroupedCheck, Groups) {
  for (int64_t g : {int64_t{0}, int64_t{-1}, kBig, INT64_MAX, INT64_MIN}) {
    dg_grouped_desc d = grouped_desc(DG_GROUPED_WGRAD, 8, 100, 64, 32);
    d.num_groups = g;
    EXPECT_TRUE(refused(grouped_check(d), "offs must hold between 1 and 2^31 - 1 group ends")) << g;
  }
  dg_grouped_desc d = grouped_desc(DG_GROUPED_FORWARD, kBig - 1, 100, 8, 8);
  EXPECT_TRUE(accepted(grouped_check(d)));  // the builder kernel grid-strides over any G
  d = grouped_desc(DG_GROUPED_FORWARD, 8, 100, 64, 32);
  d.offs = nullptr;
  EXPECT_TRUE(refused(grouped_check(d), "offs must not be NULL"));
  d.offs = reinterpret_cast<const int32_t*>(static_cast<char*>(fake_ptr(4)) + 2);
  EXPECT_TRUE(refused(grouped_check(d), "offs must be a 4-byte aligned device pointer"));
  d.offs = reinterpret_cast<const int32_t*>(static_cast<char*>(fake_ptr(4)) + 4);
  EXPECT_TRUE(accepted(grouped_check(d)));  // a slice of an int32 tensor
}

TEST(GroupedCheck, PointersKindsDtypes) {
  dg_grouped_desc d = grouped_desc(DG_GROUPED_FORWARD, 8, 100, 64, 32);
  d.a = nullptr;
  EXPECT_TRUE(refused(grouped_check(d), "x must not be NULL"));
  d = grouped_desc(DG_GROUPED_WGRAD, 8, 100, 64, 32);
  d.b = static_cast<char*>(fake_ptr(6)) + 8;
  EXPECT_TRUE(refused(grouped_check(d), "x must be a 16-byte aligned device pointer"));
  d = grouped_desc(DG_GROUPED_WGRAD, 8, 100, 64, 32);
  d.out = nullptr;
  EXPECT_TRUE(refused(grouped_check(d), "out must not be NULL"));
  for (int raw : {-1, 3, 4, 1000, INT_MIN}) {
    d = grouped_desc(DG_GROUPED_FORWARD, 8, 100, 64, 32);
    set_raw(&d.kind, raw);
    EXPECT_TRUE(refused(grouped_check(d), "kind must be forward, dgrad or wgrad")) << raw;
    EXPECT_EQ(dg_grouped_gemm_config_count(&d, 90), 0);
  }
  d = grouped_desc(DG_GROUPED_FORWARD, 8, 100, 64, 32, DG_E4M3, DG_BF16);
  EXPECT_TRUE(refused(grouped_check(d), "scale_mode must be ROW or BLOCK for FP8 inputs"));
  d = grouped_desc(DG_GROUPED_FORWARD, 8, 100, 64, 32);
  set_raw(&d.in_dtype, 99);
  EXPECT_TRUE(refused(grouped_check(d), "inputs must be bfloat16, float16 or float8_e4m3fn, got dtype 99"));
  d = grouped_desc(DG_GROUPED_FORWARD, 8, 100, 64, 32);
  d.scale_mode = DG_SCALE_ROW;
  EXPECT_TRUE(refused(grouped_check(d), "scale_mode must be NONE for bfloat16/float16 inputs"));
  d = grouped_desc(DG_GROUPED_FORWARD, 8, 100, 64, 32, DG_BF16, DG_F16);
  EXPECT_TRUE(refused(grouped_check(d), "out dtype must be bfloat16 or float32, got float16"));
  d = grouped_desc(DG_GROUPED_FORWARD, 8, 100, 64, 32);
  set_raw(&d.out_dtype, -3);
  EXPECT_TRUE(refused(grouped_check(d), "got dtype -3"));
}

// An FP8 forward with block scales over G experts, T tokens: (T, K) x (G, N, K).
dg_grouped_desc fp8_forward(int64_t g, int64_t t, int64_t n, int64_t k) {
  dg_grouped_desc d = grouped_desc(DG_GROUPED_FORWARD, g, t, n, k, DG_E4M3, DG_BF16);
  d.scale_mode = DG_SCALE_BLOCK;
  d.scale_a = static_cast<const float*>(fake_ptr(8));
  d.scale_a_shape = shape2(t, (k + 127) / 128);
  d.scale_a_ld = t;
  d.scale_b = static_cast<const float*>(fake_ptr(9));
  d.scale_b_shape = shape3(g, (k + 127) / 128, (n + 127) / 128);
  return d;
}

TEST(GroupedCheck, Fp8ModesAndScales) {
  EXPECT_TRUE(accepted(grouped_check(fp8_forward(8, 1000, 256, 384))));
  dg_grouped_desc d = fp8_forward(8, 1000, 256, 384);
  d.in_dtype = DG_E5M2;  // an e5m2 gradient against e4m3 (b's dtype is implied)
  EXPECT_TRUE(accepted(grouped_check(d)));
  d.in_dtype = DG_I32;
  d.scale_mode = DG_SCALE_BLOCK;
  EXPECT_FALSE(accepted(grouped_check(d)));
  d = fp8_forward(8, 1000, 256, 384);
  d.kind = DG_GROUPED_DGRAD;
  EXPECT_TRUE(refused(grouped_check(d), "run a dgrad as FORWARD on w transposed"));
  d = fp8_forward(8, 1000, 256, 384);
  d.out_dtype = DG_F32;
  EXPECT_TRUE(refused(grouped_check(d), "FP8 grouped forward writes bfloat16"));
  d = fp8_forward(8, 1000, 256, 384);
  d.scale_a_shape = shape2(1000, 2);
  EXPECT_TRUE(refused(grouped_check(d), "scale_a (x's 1 x 128 scales) must have shape (T, ceil(K / 128)) = (1000, 3)"));
  d = fp8_forward(8, 1000, 256, 384);
  d.scale_b_shape = shape3(8, 2, 3);
  EXPECT_TRUE(refused(grouped_check(d), "scale_b (w's 128 x 128 scales) must have shape"));
  d = fp8_forward(8, 1000, 256, 384);
  d.scale_a_ld = 999;
  EXPECT_TRUE(refused(grouped_check(d), "scale_a_ld"));
  d = fp8_forward(8, 1000, 256, 384);
  d.scale_b = static_cast<const float*>(static_cast<const void*>(static_cast<const char*>(fake_ptr(9)) + 2));
  EXPECT_TRUE(refused(grouped_check(d), "scale_b must be a 4-byte aligned device pointer"));
  d = fp8_forward(8, 1000, 256, 384);
  d.scale_mode = DG_SCALE_ROW;
  EXPECT_TRUE(refused(grouped_check(d), "scale_a (x's row scales) must have shape (T,) = (1000,)"));
  d.scale_a_shape = {1, {1000, 0, 0}};
  d.scale_b_shape = shape2(8, 256);
  EXPECT_TRUE(accepted(grouped_check(d)));
  // wgrad: dy^T (N, Tp) and x^T (K, Tp), Tp = 128 (ceil(T / 128) + G).
  d = grouped_desc(DG_GROUPED_WGRAD, 4, 0, 256, 384, DG_E4M3, DG_F32);
  d.scale_mode = DG_SCALE_BLOCK;
  d.a_shape = shape2(256, 128 * 12);
  d.b_shape = shape2(384, 128 * 12);
  d.scale_a = static_cast<const float*>(fake_ptr(8));
  d.scale_b = static_cast<const float*>(fake_ptr(9));
  d.scale_a_shape = shape2(12, 256);
  d.scale_b_shape = shape2(12, 384);
  EXPECT_TRUE(accepted(grouped_check(d)));
  dg_grouped_desc bad = d;
  bad.a_shape = shape2(256, 100);
  EXPECT_TRUE(refused(grouped_check(bad), "padded layout of quantize_fp8"));
  bad = d;
  bad.scale_b_shape = shape2(12, 383);
  EXPECT_TRUE(refused(grouped_check(bad), "scale_b (x's scales) must have shape (Tp / 128, K)"));
  bad = d;
  bad.scale_mode = DG_SCALE_ROW;
  EXPECT_TRUE(refused(grouped_check(bad), "FP8 wgrad takes BLOCK scales"));
}

TEST(GroupedCheck, OutMustNotOverlapAnotherBuffer) {
  // The kernels read x, w, offs and the scales while they write out: out sharing a byte with any
  // of them is refused (distgemm.grouped_mm's out= refuses it too), by every entry point.
  char* const x = static_cast<char*>(fake_ptr(5));  // grouped_desc's x: (100, 32) bf16, 6400 bytes
  dg_grouped_desc d = grouped_desc(DG_GROUPED_FORWARD, 8, 100, 64, 32);
  EXPECT_TRUE(accepted(grouped_check(d)));
  for (char* out : {x, x + 6400 - 16, x - 12800 + 16}) {  // out (100, 64) bf16: 12800 bytes
    d.out = out;
    EXPECT_TRUE(refused(grouped_check(d), "out must not overlap x")) << static_cast<void*>(out);
    EXPECT_TRUE(refused(dg_grouped_gemm(&d, nullptr, 0, nullptr), "out must not overlap x"));
    const int32_t host_offs[8] = {};
    EXPECT_TRUE(refused(dg_grouped_gemm_cublas(&d, host_offs, nullptr), "out must not overlap x"));
  }
  for (char* out : {x + 6400, x - 12800}) {  // adjacent: no byte shared
    d.out = out;
    EXPECT_TRUE(accepted(grouped_check(d))) << static_cast<void*>(out);
  }
  d = grouped_desc(DG_GROUPED_FORWARD, 8, 100, 64, 32);
  d.out = const_cast<void*>(d.b);
  EXPECT_TRUE(refused(grouped_check(d), "out must not overlap w"));
  d = grouped_desc(DG_GROUPED_FORWARD, 8, 100, 64, 32);
  d.offs = static_cast<const int32_t*>(d.out) + 100;
  EXPECT_TRUE(refused(grouped_check(d), "out must not overlap offs"));
  d = grouped_desc(DG_GROUPED_WGRAD, 8, 100, 64, 32, DG_BF16, DG_F32);
  d.out = static_cast<char*>(const_cast<void*>(d.a)) + 64;
  EXPECT_TRUE(refused(grouped_check(d), "out must not overlap dy"));
  d.out = const_cast<void*>(d.b);
  EXPECT_TRUE(refused(grouped_check(d), "out must not overlap x"));
  d = fp8_forward(8, 1000, 256, 384);
  d.out = const_cast<float*>(d.scale_a) + 4;
  EXPECT_TRUE(refused(grouped_check(d), "out must not overlap scale_a"));
  d = fp8_forward(8, 1000, 256, 384);
  d.scale_b = static_cast<const float*>(d.out) + 1000;
  EXPECT_TRUE(refused(grouped_check(d), "out must not overlap scale_b"));
  // Inputs may share bytes (w read as both operands, say): only writes conflict.
  d = grouped_desc(DG_GROUPED_WGRAD, 8, 100, 64, 64);
  d.b = d.a;
  EXPECT_TRUE(accepted(grouped_check(d)));
}

TEST(GroupedQueries, EntryPointsCheckFirst) {
  size_t bytes = 0;
  const dg_grouped_desc good = grouped_desc(DG_GROUPED_FORWARD, 8, 100, 64, 32);
  EXPECT_TRUE(refused(dg_grouped_gemm_workspace_size(&good, nullptr), "bytes must not be NULL"));
  EXPECT_TRUE(refused(dg_grouped_gemm_workspace_size(nullptr, &bytes), "desc must not be NULL"));
  EXPECT_TRUE(refused(dg_grouped_gemm(nullptr, nullptr, 0, nullptr), "desc must not be NULL"));
  EXPECT_TRUE(refused(dg_grouped_gemm_cublas(nullptr, nullptr, nullptr), "desc must not be NULL"));
  EXPECT_TRUE(refused(dg_grouped_gemm_cublas(&good, nullptr, nullptr), "host_offs must not be NULL"));
  dg_grouped_desc bad = good;
  bad.out_shape = shape2(1, 64);
  EXPECT_TRUE(refused(dg_grouped_gemm(&bad, nullptr, 0, nullptr), "out (out) must have shape"));
  const int32_t host_offs[8] = {};
  EXPECT_TRUE(refused(dg_grouped_gemm_cublas(&bad, host_offs, nullptr), "out (out) must have shape"));
  EXPECT_EQ(dg_grouped_gemm_config_count(nullptr, 90), 0);
  EXPECT_EQ(dg_grouped_gemm_config_name(nullptr, 90, 0), nullptr);
  for (int arch : {0, -1, 80, 90, 100, INT_MAX}) EXPECT_EQ(dg_grouped_gemm_config_name(&good, arch, 0), nullptr);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    EXPECT_EQ(dg_grouped_gemm(&good, nullptr, 0, nullptr), DG_ERROR_NOT_SUPPORTED);
    EXPECT_NE(std::string(dg_last_error()).find("no usable CUDA device"), std::string::npos);
    EXPECT_NE(dg_grouped_gemm_cublas(&good, host_offs, nullptr), DG_SUCCESS);
  }
}

// The cuBLAS loop applies no scales and reads none of the FP8 layouts: FP8 descriptors (valid for
// dg_grouped_gemm) are refused by name instead of multiplied unscaled.
TEST(GroupedCublas, RefusesFp8Descriptors) {
  const int32_t host_offs[8] = {100, 200, 300, 400, 500, 600, 700, 1000};
  dg_grouped_desc d = fp8_forward(8, 1000, 256, 384);
  ASSERT_TRUE(accepted(grouped_check(d)));
  for (dg_dtype in : {DG_E4M3, DG_E5M2}) {
    d.in_dtype = in;
    EXPECT_EQ(dg_grouped_gemm_cublas(&d, host_offs, nullptr), DG_ERROR_NOT_SUPPORTED);
    EXPECT_NE(std::string(dg_last_error()).find("dg_grouped_gemm_cublas takes bfloat16/float16 inputs without scales"),
              std::string::npos)
        << dg_last_error();
    EXPECT_NE(std::string(dg_last_error()).find("dg_grouped_gemm"), std::string::npos);
  }
  d = grouped_desc(DG_GROUPED_WGRAD, 4, 0, 256, 384, DG_E4M3, DG_F32);
  d.scale_mode = DG_SCALE_BLOCK;
  d.a_shape = shape2(256, 128 * 12);
  d.b_shape = shape2(384, 128 * 12);
  d.scale_a = static_cast<const float*>(fake_ptr(8));
  d.scale_b = static_cast<const float*>(fake_ptr(9));
  d.scale_a_shape = shape2(12, 256);
  d.scale_b_shape = shape2(12, 384);
  ASSERT_TRUE(accepted(grouped_check(d)));
  EXPECT_EQ(dg_grouped_gemm_cublas(&d, host_offs, nullptr), DG_ERROR_NOT_SUPPORTED);
  EXPECT_NE(std::string(dg_last_error()).find("float8_e4m3fn"), std::string::npos) << dg_last_error();
}

// ---------------------------------------------------------------- FP8 quantization

dg_quantize_sizes quantize_sizes(const dg_quantize_desc& d) {
  dg_quantize_sizes s{};
  EXPECT_EQ(dg_quantize_fp8_sizes(&d, &s), DG_SUCCESS) << dg_last_error();
  return s;
}

TEST(QuantizeCheck, ValidDescsPassTheChecks) {
  for (dg_quant_granularity g : {DG_QUANT_TENSOR, DG_QUANT_ROW, DG_QUANT_1X128, DG_QUANT_128X128})
    for (dg_dtype in : {DG_BF16, DG_F16, DG_F32})
      for (dg_dtype out : {DG_E4M3, DG_E5M2}) {
        const dg_quantize_desc big = quantize_desc(g, 300, 1000, in, out);
        const dg_quantize_desc one = quantize_desc(g, 1, 1, in, out);
        EXPECT_TRUE(accepted(dg_quantize_fp8(&big, nullptr))) << g;
        EXPECT_TRUE(accepted(dg_quantize_fp8(&one, nullptr))) << g;
      }
  dg_quantize_desc d = quantize_desc(DG_QUANT_1X128, 4096, 136);
  d.transpose = 1;
  EXPECT_TRUE(accepted(dg_quantize_fp8(&d, nullptr)));
  d.offs = static_cast<const int32_t*>(fake_ptr(12));
  d.num_groups = 300;
  EXPECT_TRUE(accepted(dg_quantize_fp8(&d, nullptr)));
  d = quantize_desc(DG_QUANT_128X128, 300, 260);
  d.batch = 64;
  EXPECT_TRUE(accepted(dg_quantize_fp8(&d, nullptr)));
  // Nothing to read or write: the empty buffers may be NULL (the per-tensor scale is written).
  for (dg_quant_granularity g : {DG_QUANT_TENSOR, DG_QUANT_ROW, DG_QUANT_1X128, DG_QUANT_128X128}) {
    d = quantize_desc(g, 0, 64);
    d.x = nullptr;
    d.out = nullptr;
    if (g != DG_QUANT_TENSOR) d.scale = nullptr;
    EXPECT_TRUE(accepted(dg_quantize_fp8(&d, nullptr))) << g;
  }
}

TEST(QuantizeCheck, SizesOfEveryLayout) {
  dg_quantize_sizes s = quantize_sizes(quantize_desc(DG_QUANT_TENSOR, 300, 1000));
  EXPECT_EQ(std::vector<int64_t>({s.data_rows, s.data_cols, s.scale_rows, s.scale_cols}),
            std::vector<int64_t>({300, 1000, 1, 1}));
  EXPECT_EQ(s.workspace_bytes, 4u);
  s = quantize_sizes(quantize_desc(DG_QUANT_ROW, 300, 1000));
  EXPECT_EQ(std::vector<int64_t>({s.scale_rows, s.scale_cols}), std::vector<int64_t>({300, 1}));
  EXPECT_EQ(s.workspace_bytes, 0u);
  s = quantize_sizes(quantize_desc(DG_QUANT_1X128, 300, 1000));  // stored (ceil(C/128), R)
  EXPECT_EQ(std::vector<int64_t>({s.data_rows, s.data_cols, s.scale_rows, s.scale_cols}),
            std::vector<int64_t>({300, 1000, 8, 300}));
  s = quantize_sizes(quantize_desc(DG_QUANT_128X128, 300, 1000));
  EXPECT_EQ(std::vector<int64_t>({s.scale_rows, s.scale_cols}), std::vector<int64_t>({3, 8}));
  dg_quantize_desc d = quantize_desc(DG_QUANT_1X128, 1000, 72);
  d.transpose = 1;
  s = quantize_sizes(d);  // data (C, R); scale (ceil(R/128), C)
  EXPECT_EQ(std::vector<int64_t>({s.data_rows, s.data_cols, s.scale_rows, s.scale_cols}),
            std::vector<int64_t>({72, 1000, 8, 72}));
  d.num_groups = 8;  // Rp = 128 * (ceil(1000/128) + 8) = 2048
  s = quantize_sizes(d);
  EXPECT_EQ(std::vector<int64_t>({s.data_rows, s.data_cols, s.scale_rows, s.scale_cols}),
            std::vector<int64_t>({72, 2048, 16, 72}));
  EXPECT_EQ(s.workspace_bytes, 32u);
  d.rows = 0;
  s = quantize_sizes(d);
  EXPECT_EQ(s.data_cols, 1024);
  // The sizes read no pointer.
  d = quantize_desc(DG_QUANT_ROW, 5, 5);
  d.x = d.out = nullptr;
  d.scale = nullptr;
  d.workspace_bytes = 0;
  EXPECT_EQ(quantize_sizes(d).scale_rows, 5);
}

TEST(QuantizeCheck, RefusesBadShapes) {
  dg_quantize_sizes s{};
  auto both = [&](const dg_quantize_desc& d, const std::string& needle) {
    return refused(dg_quantize_fp8_sizes(&d, &s), needle) && refused(dg_quantize_fp8(&d, nullptr), needle);
  };
  dg_quantize_desc d = quantize_desc(DG_QUANT_1X128, 64, 64);
  set_raw(&d.x_dtype, DG_E4M3);
  EXPECT_TRUE(both(d, "x must be bfloat16, float16 or float32, got float8_e4m3fn"));
  set_raw(&d.x_dtype, 99);
  EXPECT_TRUE(both(d, "got dtype 99"));
  d = quantize_desc(DG_QUANT_1X128, 64, 64, DG_BF16, DG_BF16);
  EXPECT_TRUE(both(d, "out dtype must be float8_e4m3fn or float8_e5m2, got bfloat16"));
  d = quantize_desc(DG_QUANT_1X128, 64, 64);
  for (int g : {-1, 4, INT_MAX}) {
    set_raw(&d.granularity, g);
    EXPECT_TRUE(both(d, "granularity must be DG_QUANT_TENSOR"));
  }
  d = quantize_desc(DG_QUANT_ROW, -1, 64);
  EXPECT_TRUE(both(d, "non-negative rows and cols, got (-1, 64)"));
  d = quantize_desc(DG_QUANT_ROW, 64, INT64_MIN);
  EXPECT_TRUE(both(d, "non-negative rows and cols"));
  d = quantize_desc(DG_QUANT_1X128, 64, 64);
  d.batch = 2;
  EXPECT_TRUE(both(d, "batch must be 1 for 1 x 128 scales"));
  d = quantize_desc(DG_QUANT_128X128, 64, 64);
  d.batch = -1;
  EXPECT_TRUE(both(d, "batch must be non-negative"));
  d = quantize_desc(DG_QUANT_ROW, 64, 64);
  d.transpose = 1;
  EXPECT_TRUE(both(d, "transpose needs 1 x 128 blocks"));
  d = quantize_desc(DG_QUANT_1X128, 64, 64);
  d.num_groups = 4;
  d.offs = static_cast<const int32_t*>(fake_ptr(12));
  EXPECT_TRUE(both(d, "apply to the transposed 1 x 128 quantization only"));
  d.transpose = 1;
  for (int64_t g : {int64_t{-1}, kBig, INT64_MAX}) {
    d.num_groups = g;
    EXPECT_TRUE(both(d, "num_groups must be 0 (no offs) or in [1, 2^31)"));
  }
  d.num_groups = 4;
  d.rows = kBig;
  EXPECT_TRUE(both(d, "fewer than 2^31 rows with offs"));
  // Sizes whose elements or bytes overflow int64 are refused, never wrapped.
  d = quantize_desc(DG_QUANT_128X128, int64_t{1} << 31, int64_t{1} << 31);
  d.batch = int64_t{1} << 31;
  EXPECT_TRUE(both(d, "overflows int64"));
  d = quantize_desc(DG_QUANT_ROW, int64_t{1} << 31, int64_t{1} << 31, DG_F32);
  EXPECT_TRUE(both(d, "spans more than 2^63 bytes"));
  d = quantize_desc(DG_QUANT_1X128, 1, int64_t{1} << 30);  // data (C, 128 * (1 + G)): 2^68 bytes
  d.transpose = 1;
  d.num_groups = kBig - 1;
  d.offs = static_cast<const int32_t*>(fake_ptr(12));
  EXPECT_TRUE(both(d, "the FP8 data of"));
  EXPECT_TRUE(refused(dg_quantize_fp8_sizes(nullptr, &s), "desc must not be NULL"));
  EXPECT_TRUE(refused(dg_quantize_fp8_sizes(&d, nullptr), "sizes must not be NULL"));
  EXPECT_TRUE(refused(dg_quantize_fp8(nullptr, nullptr), "desc must not be NULL"));
}

TEST(QuantizeCheck, RefusesBadPointers) {
  const dg_quantize_desc good = quantize_desc(DG_QUANT_TENSOR, 64, 64, DG_F32);
  dg_quantize_desc d = good;
  d.x = nullptr;
  EXPECT_TRUE(refused(dg_quantize_fp8(&d, nullptr), "x must not be NULL"));
  d.x = static_cast<const char*>(good.x) + 2;  // 2-byte aligned float32
  EXPECT_TRUE(refused(dg_quantize_fp8(&d, nullptr), "x must be a 4-byte aligned device pointer"));
  d = quantize_desc(DG_QUANT_TENSOR, 64, 64);
  d.x = static_cast<const char*>(good.x) + 2;  // bfloat16: element-aligned is enough
  EXPECT_TRUE(accepted(dg_quantize_fp8(&d, nullptr)));
  d.x = reinterpret_cast<const void*>(UINTPTR_MAX - 63);
  EXPECT_TRUE(refused(dg_quantize_fp8(&d, nullptr), "x runs past the end of the address space"));
  d = good;
  d.out = nullptr;
  EXPECT_TRUE(refused(dg_quantize_fp8(&d, nullptr), "out must not be NULL"));
  d.out = static_cast<char*>(good.out) + 1;  // bytes: any address
  EXPECT_TRUE(accepted(dg_quantize_fp8(&d, nullptr)));
  d = good;
  d.scale = nullptr;
  EXPECT_TRUE(refused(dg_quantize_fp8(&d, nullptr), "scale must not be NULL"));
  d.scale = reinterpret_cast<float*>(static_cast<char*>(fake_ptr(10)) + 2);
  EXPECT_TRUE(refused(dg_quantize_fp8(&d, nullptr), "scale must be a 4-byte aligned"));
  d = good;
  d.workspace_bytes = 3;
  EXPECT_TRUE(refused(dg_quantize_fp8(&d, nullptr), "workspace of 3 bytes is smaller than the 4 needed"));
  d.workspace_bytes = 4;
  d.workspace = nullptr;
  EXPECT_TRUE(refused(dg_quantize_fp8(&d, nullptr), "workspace must not be NULL"));
  d = quantize_desc(DG_QUANT_ROW, 64, 64);
  d.workspace = nullptr;  // none needed
  d.workspace_bytes = 0;
  EXPECT_TRUE(accepted(dg_quantize_fp8(&d, nullptr)));
  d = quantize_desc(DG_QUANT_1X128, 64, 64);
  d.transpose = 1;
  d.num_groups = 3;
  EXPECT_TRUE(refused(dg_quantize_fp8(&d, nullptr), "offs must not be NULL"));
  d.offs = reinterpret_cast<const int32_t*>(static_cast<char*>(fake_ptr(12)) + 2);
  EXPECT_TRUE(refused(dg_quantize_fp8(&d, nullptr), "offs must be a 4-byte aligned"));
  d.offs = static_cast<const int32_t*>(fake_ptr(12));
  d.workspace_bytes = 11;
  EXPECT_TRUE(refused(dg_quantize_fp8(&d, nullptr), "smaller than the 12 needed"));
}

TEST(QuantizeRun, NothingRunsWithoutKernelsOrADevice) {
  const dg_quantize_desc d = quantize_desc(DG_QUANT_1X128, 64, 64);
  const dg_status s = dg_quantize_fp8(&d, nullptr);
  EXPECT_EQ(s, DG_ERROR_NOT_SUPPORTED);  // this build compiles no arch (DISTGEMM_WITH_SM90/SM100)
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    EXPECT_NE(std::string(dg_last_error()).find("no usable CUDA device"), std::string::npos);
  } else {
    EXPECT_NE(std::string(dg_last_error()).find("not built for sm_"), std::string::npos);
  }
}

// ---------------------------------------------------------------- MoE activation, weight copies

dg_moe_act_desc moe_desc(dg_moe_act act, int64_t tokens, int64_t inner, bool rows = true, bool transposed = true,
                         int64_t groups = 3) {
  dg_moe_act_desc d{};
  d.act = act;
  d.x = fake_ptr(20);
  if (act == DG_MOE_SWIGLU_BACKWARD || act == DG_MOE_GELU_BACKWARD) d.dy = fake_ptr(21);
  d.tokens = tokens;
  d.inner = inner;
  d.y = fake_ptr(22);
  if (rows) {
    d.y_fp8 = fake_ptr(23);
    d.y_scale = static_cast<float*>(fake_ptr(24));
  }
  if (transposed) {
    d.yt_fp8 = fake_ptr(25);
    d.yt_scale = static_cast<float*>(fake_ptr(26));
    d.offs = static_cast<const int32_t*>(fake_ptr(27));
    d.num_groups = groups;
    d.workspace = fake_ptr(28);
    d.workspace_bytes = 4 * static_cast<size_t>(groups);
  }
  d.fp8_dtype = DG_E4M3;
  return d;
}

TEST(MoeActivationCheck, ValidDescsPassTheChecks) {
  for (dg_moe_act act : {DG_MOE_IDENTITY, DG_MOE_SWIGLU, DG_MOE_GELU, DG_MOE_SWIGLU_BACKWARD, DG_MOE_GELU_BACKWARD}) {
    for (int64_t tokens : {int64_t(0), int64_t(1), int64_t(1000)}) {
      dg_moe_act_desc d = moe_desc(act, tokens, 256);
      EXPECT_TRUE(accepted(dg_moe_activation(&d, nullptr))) << act << " " << tokens;
      size_t bytes = 0;
      ASSERT_EQ(dg_moe_activation_workspace_size(&d, &bytes), DG_SUCCESS) << dg_last_error();
      EXPECT_EQ(bytes, 12u);
      d = moe_desc(act, tokens, 200, /*rows=*/false, /*transposed=*/false);  // bf16 only, no groups
      EXPECT_TRUE(accepted(dg_moe_activation(&d, nullptr))) << act;
      ASSERT_EQ(dg_moe_activation_workspace_size(&d, &bytes), DG_SUCCESS) << dg_last_error();
      EXPECT_EQ(bytes, 0u);
    }
  }
  dg_moe_act_desc d = moe_desc(DG_MOE_SWIGLU_BACKWARD, 64, 200, /*rows=*/false);  // transposes: any width
  EXPECT_TRUE(accepted(dg_moe_activation(&d, nullptr)));
  d = moe_desc(DG_MOE_GELU, 64, 256);
  d.fp8_dtype = DG_E5M2;
  EXPECT_TRUE(accepted(dg_moe_activation(&d, nullptr)));
}

TEST(MoeActivationCheck, RefusesBadArguments) {
  EXPECT_TRUE(refused(dg_moe_activation(nullptr, nullptr), "desc must not be NULL"));
  size_t bytes = 0;
  dg_moe_act_desc d = moe_desc(DG_MOE_SWIGLU, 64, 256);
  EXPECT_TRUE(refused(dg_moe_activation_workspace_size(&d, nullptr), "bytes must not be NULL"));
  const int bad_act = 7;
  std::memcpy(&d.act, &bad_act, sizeof bad_act);
  EXPECT_TRUE(refused(dg_moe_activation(&d, nullptr), "act must be DG_MOE_IDENTITY"));
  EXPECT_TRUE(refused(dg_moe_activation_workspace_size(&d, &bytes), "act must be"));
  d = moe_desc(DG_MOE_SWIGLU, -1, 256);
  EXPECT_TRUE(refused(dg_moe_activation(&d, nullptr), "tokens and inner must be non-negative"));
  d = moe_desc(DG_MOE_SWIGLU, 64, 256, false, false);
  d.y = nullptr;
  EXPECT_TRUE(refused(dg_moe_activation(&d, nullptr), "no output"));
  d = moe_desc(DG_MOE_GELU, 64, 256);
  d.fp8_dtype = DG_BF16;
  EXPECT_TRUE(refused(dg_moe_activation(&d, nullptr), "fp8_dtype must be DG_E4M3 or DG_E5M2"));
  d = moe_desc(DG_MOE_GELU, 64, 256);
  d.dy = fake_ptr(21);
  EXPECT_TRUE(refused(dg_moe_activation(&d, nullptr), "dy applies to the backward activations only"));
  d = moe_desc(DG_MOE_GELU_BACKWARD, 64, 256);
  d.dy = nullptr;
  EXPECT_TRUE(refused(dg_moe_activation(&d, nullptr), "dy must not be NULL"));
  d = moe_desc(DG_MOE_SWIGLU_BACKWARD, 64, 200);
  EXPECT_TRUE(refused(dg_moe_activation(&d, nullptr), "multiple of 128"));
  d = moe_desc(DG_MOE_SWIGLU, 64, 256, true, true, 0);
  EXPECT_TRUE(refused(dg_moe_activation(&d, nullptr), "needs num_groups in [1, 2^31)"));
  d = moe_desc(DG_MOE_SWIGLU, 64, 256, true, false);
  d.num_groups = 2;
  EXPECT_TRUE(refused(dg_moe_activation(&d, nullptr), "num_groups applies to yt_fp8 only"));
  d = moe_desc(DG_MOE_SWIGLU, kBig, 256);
  EXPECT_TRUE(refused(dg_moe_activation(&d, nullptr), "fewer than 2^31 tokens"));
  d = moe_desc(DG_MOE_SWIGLU, 64, 256);
  d.workspace_bytes = 11;
  EXPECT_TRUE(refused(dg_moe_activation(&d, nullptr), "smaller than the 12 needed"));
  d = moe_desc(DG_MOE_SWIGLU, 64, 256);
  d.x = static_cast<const char*>(d.x) + 1;
  EXPECT_TRUE(refused(dg_moe_activation(&d, nullptr), "x must be a 2-byte aligned"));
  d = moe_desc(DG_MOE_SWIGLU, 64, 256);
  d.y_scale = nullptr;
  EXPECT_TRUE(refused(dg_moe_activation(&d, nullptr), "y_scale must not be NULL"));
  d = moe_desc(DG_MOE_SWIGLU, 64, 256);
  d.offs = nullptr;
  EXPECT_TRUE(refused(dg_moe_activation(&d, nullptr), "offs must not be NULL"));
}

TEST(QuantizeWeightCheck, ChecksItsArguments) {
  const dg_quantize_weight_desc good = quantize_weight_desc(4, 300, 260);
  EXPECT_TRUE(accepted(dg_quantize_fp8_weight(&good, nullptr)));
  dg_quantize_weight_desc d = good;
  d.out = nullptr;  // the dgrad's copy alone
  EXPECT_TRUE(accepted(dg_quantize_fp8_weight(&d, nullptr)));
  d.out_t = nullptr;
  EXPECT_TRUE(refused(dg_quantize_fp8_weight(&d, nullptr), "no output"));
  EXPECT_TRUE(refused(dg_quantize_fp8_weight(nullptr, nullptr), "desc must not be NULL"));
  d = good;
  d.w_dtype = DG_E4M3;
  EXPECT_TRUE(refused(dg_quantize_fp8_weight(&d, nullptr), "w must be bfloat16, float16 or float32"));
  d = good;
  d.out_dtype = DG_F16;
  EXPECT_TRUE(refused(dg_quantize_fp8_weight(&d, nullptr), "out dtype must be DG_E4M3 or DG_E5M2"));
  d = good;
  d.rows = -1;
  EXPECT_TRUE(refused(dg_quantize_fp8_weight(&d, nullptr), "non-negative"));
  d = good;
  d.groups = kBig;
  d.rows = kBig;
  d.cols = kBig;
  EXPECT_TRUE(refused(dg_quantize_fp8_weight(&d, nullptr), "overflows int64"));
  d = good;
  d.scale = nullptr;
  EXPECT_TRUE(refused(dg_quantize_fp8_weight(&d, nullptr), "scale must not be NULL"));
  d = good;
  d.scale_t = static_cast<float*>(fake_ptr(34));
  EXPECT_TRUE(accepted(dg_quantize_fp8_weight(&d, nullptr)));
  d.scale_t = reinterpret_cast<float*>(static_cast<char*>(fake_ptr(34)) + 2);
  EXPECT_TRUE(refused(dg_quantize_fp8_weight(&d, nullptr), "scale_t must be a 4-byte aligned"));
  d = good;
  d.w_dtype = DG_F32;
  d.w = static_cast<const char*>(good.w) + 2;
  EXPECT_TRUE(refused(dg_quantize_fp8_weight(&d, nullptr), "w must be a 4-byte aligned"));
  d = good;
  d.granularity = DG_QUANT_1X128;
  EXPECT_TRUE(refused(dg_quantize_fp8_weight(&d, nullptr), "granularity must be DG_QUANT_128X128 or DG_QUANT_ROW"));
  set_raw(&d.granularity, 0);  // a zeroed desc: the granularity is not guessed
  EXPECT_TRUE(refused(dg_quantize_fp8_weight(&d, nullptr), "granularity must be"));
}

TEST(QuantizeWeightCheck, RowScalesGoWithTheirCopies) {
  dg_quantize_weight_desc d = quantize_weight_desc(4, 300, 260);
  d.granularity = DG_QUANT_ROW;
  EXPECT_TRUE(refused(dg_quantize_fp8_weight(&d, nullptr), "scale_t must not be NULL"));  // out_t without it
  d.scale_t = static_cast<float*>(fake_ptr(34));
  EXPECT_TRUE(accepted(dg_quantize_fp8_weight(&d, nullptr)));
  d.out = nullptr;
  d.scale = nullptr;  // the dgrad copy alone: scale is not read
  EXPECT_TRUE(accepted(dg_quantize_fp8_weight(&d, nullptr)));
  d = quantize_weight_desc(4, 300, 260);
  d.granularity = DG_QUANT_ROW;
  d.out_t = nullptr;  // the forward copy alone: scale_t is not read
  EXPECT_TRUE(accepted(dg_quantize_fp8_weight(&d, nullptr)));
  d.scale = nullptr;
  EXPECT_TRUE(refused(dg_quantize_fp8_weight(&d, nullptr), "scale must not be NULL"));
  // Row scales are (groups, rows) and (groups, cols): scale_t of 4 * 260 floats overlapping out
  // at its last byte is refused, one past it accepted.
  d = quantize_weight_desc(4, 300, 260);
  d.granularity = DG_QUANT_ROW;
  d.out = nullptr;
  d.scale_t = reinterpret_cast<float*>(static_cast<char*>(fake_ptr(32)) - 4 * 4 * 260 + 4);
  EXPECT_TRUE(refused(dg_quantize_fp8_weight(&d, nullptr), "out_t must not overlap scale_t"));
  d.scale_t = reinterpret_cast<float*>(static_cast<char*>(fake_ptr(32)) - 4 * 4 * 260);
  EXPECT_TRUE(accepted(dg_quantize_fp8_weight(&d, nullptr)));
}

TEST(MoeRun, NothingRunsWithoutKernelsOrADevice) {
  const dg_moe_act_desc d = moe_desc(DG_MOE_SWIGLU, 64, 256);
  EXPECT_EQ(dg_moe_activation(&d, nullptr), DG_ERROR_NOT_SUPPORTED);  // no arch compiled here
  int devices = 0;
  const bool none = cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0;
  cudaGetLastError();
  EXPECT_NE(std::string(dg_last_error()).find(none ? "no usable CUDA device" : "not built for sm_"), std::string::npos)
      << dg_last_error();
}

// ---------------------------------------------------------------- MoE permute (gather + FP8 forms)

dg_moe_permute_desc permute_desc(int64_t x_rows, int64_t num_rows, int64_t hidden, bool transposed = true) {
  dg_moe_permute_desc d{};
  d.x = fake_ptr(50);
  d.x_rows = x_rows;
  d.rows = static_cast<const int64_t*>(fake_ptr(51));
  d.num_rows = num_rows;
  d.hidden = hidden;
  d.y_fp8 = fake_ptr(52);
  d.y_scale = static_cast<float*>(fake_ptr(53));
  if (transposed) {
    d.yt_fp8 = fake_ptr(54);
    d.yt_scale = static_cast<float*>(fake_ptr(55));
    d.offs = static_cast<const int32_t*>(fake_ptr(56));
    d.num_groups = 8;
    d.workspace = fake_ptr(57);
    d.workspace_bytes = 32;
  }
  d.fp8_dtype = DG_E4M3;
  return d;
}

TEST(MoePermuteCheck, ValidDescsPassTheChecks) {
  for (int64_t num_rows : {int64_t(0), int64_t(1), int64_t(4000)}) {
    for (int64_t x_rows : {int64_t(0), int64_t(1), int64_t(1000)}) {
      dg_moe_permute_desc d = permute_desc(x_rows, num_rows, 4096);
      EXPECT_TRUE(accepted(dg_moe_permute(&d, nullptr))) << x_rows << " " << num_rows;
      size_t bytes = 0;
      ASSERT_EQ(dg_moe_permute_workspace_size(&d, &bytes), DG_SUCCESS) << dg_last_error();
      EXPECT_EQ(bytes, 32u);
      d = permute_desc(x_rows, num_rows, 200, /*transposed=*/false);
      d.y = fake_ptr(58);  // bf16 rows too
      EXPECT_TRUE(accepted(dg_moe_permute(&d, nullptr)));
      ASSERT_EQ(dg_moe_permute_workspace_size(&d, &bytes), DG_SUCCESS) << dg_last_error();
      EXPECT_EQ(bytes, 0u);
    }
  }
  dg_moe_permute_desc d = permute_desc(0, 10, 256);
  d.x = nullptr;  // nothing to read: every row is dropped or past x
  EXPECT_TRUE(accepted(dg_moe_permute(&d, nullptr)));
}

TEST(MoePermuteCheck, RefusesBadArguments) {
  EXPECT_TRUE(refused(dg_moe_permute(nullptr, nullptr), "desc must not be NULL"));
  dg_moe_permute_desc d = permute_desc(100, 300, 256);
  size_t bytes = 0;
  EXPECT_TRUE(refused(dg_moe_permute_workspace_size(nullptr, &bytes), "desc must not be NULL"));
  EXPECT_TRUE(refused(dg_moe_permute_workspace_size(&d, nullptr), "bytes must not be NULL"));
  for (int field = 0; field < 3; ++field) {
    d = permute_desc(100, 300, 256);
    (field == 0 ? d.x_rows : field == 1 ? d.num_rows : d.hidden) = -1;
    EXPECT_TRUE(refused(dg_moe_permute(&d, nullptr), "x_rows, num_rows and hidden must be non-negative"));
    EXPECT_TRUE(refused(dg_moe_permute_workspace_size(&d, &bytes), "x_rows, num_rows and hidden"));
  }
  d = permute_desc(100, int64_t(1) << 31, 256);
  EXPECT_TRUE(refused(dg_moe_permute(&d, nullptr), "num_rows must be below 2^31"));
  d = permute_desc(100, 300, 128 * 65536);
  EXPECT_TRUE(refused(dg_moe_permute(&d, nullptr), "hidden of 8388608 columns is more than 65535 blocks"));
  d = permute_desc(100, 300, 256);
  d.rows = nullptr;
  EXPECT_TRUE(refused(dg_moe_permute(&d, nullptr), "rows must not be NULL"));
  d = permute_desc(100, 300, 256);
  d.rows = reinterpret_cast<const int64_t*>(reinterpret_cast<const char*>(d.rows) + 4);
  EXPECT_TRUE(refused(dg_moe_permute(&d, nullptr), "rows must be a 8-byte aligned"));
  d = permute_desc(100, 300, 256);
  d.x = nullptr;
  EXPECT_TRUE(refused(dg_moe_permute(&d, nullptr), "x must not be NULL"));
  d = permute_desc(100, 300, 256, false);
  d.y_fp8 = nullptr;
  EXPECT_TRUE(refused(dg_moe_permute(&d, nullptr), "no output"));
  d = permute_desc(100, 300, 256);
  d.workspace_bytes = 31;
  EXPECT_TRUE(refused(dg_moe_permute(&d, nullptr), "smaller than the 32 needed"));
  d = permute_desc(100, 300, 256);
  d.fp8_dtype = DG_BF16;
  EXPECT_TRUE(refused(dg_moe_permute(&d, nullptr), "fp8_dtype must be DG_E4M3 or DG_E5M2"));
  d = permute_desc(100, 300, 256);
  d.y_scale = nullptr;
  EXPECT_TRUE(refused(dg_moe_permute(&d, nullptr), "y_scale must not be NULL"));
}

TEST(MoePermuteRun, NothingRunsWithoutKernelsOrADevice) {
  const dg_moe_permute_desc d = permute_desc(100, 300, 256);
  EXPECT_EQ(dg_moe_permute(&d, nullptr), DG_ERROR_NOT_SUPPORTED);  // no arch compiled here
}

// ---------------------------------------------------------------- MoE routing (combine)

dg_moe_combine_desc combine_desc(int64_t tokens, int64_t k, int64_t hidden, dg_dtype dtype = DG_BF16) {
  dg_moe_combine_desc d{};
  d.y = fake_ptr(40);
  d.dtype = dtype;
  d.num_rows = tokens * k;
  d.rows = static_cast<const int64_t*>(fake_ptr(41));
  d.weights = static_cast<const float*>(fake_ptr(42));
  d.tokens = tokens;
  d.k = k;
  d.hidden = hidden;
  d.out = fake_ptr(43);
  return d;
}

dg_moe_combine_backward_desc combine_backward_desc(int64_t tokens, int64_t k, int64_t hidden) {
  dg_moe_combine_backward_desc d{};
  d.dy = fake_ptr(44);
  d.y = fake_ptr(45);
  d.dtype = DG_BF16;
  d.num_rows = tokens * k;
  d.rows = static_cast<const int64_t*>(fake_ptr(46));
  d.weights = static_cast<const float*>(fake_ptr(47));
  d.tokens = tokens;
  d.k = k;
  d.hidden = hidden;
  d.dy_rows = fake_ptr(48);
  d.dweights = static_cast<float*>(fake_ptr(49));
  return d;
}

TEST(MoeCombineCheck, ValidDescsPassTheChecks) {
  for (dg_dtype dtype : {DG_BF16, DG_F16, DG_F32}) {
    for (int64_t tokens : {int64_t(0), int64_t(1), int64_t(1000)}) {
      dg_moe_combine_desc d = combine_desc(tokens, 4, 200, dtype);
      EXPECT_TRUE(accepted(dg_moe_combine(&d, nullptr))) << dtype << " " << tokens;
      d.weights = nullptr;  // the gather's backward: every weight 1
      EXPECT_TRUE(accepted(dg_moe_combine(&d, nullptr)));
    }
  }
  dg_moe_combine_backward_desc b = combine_backward_desc(100, 8, 4096);
  EXPECT_TRUE(accepted(dg_moe_combine_backward(&b, nullptr)));
  b.dweights = nullptr;
  b.y = nullptr;  // y is read for dweights only
  EXPECT_TRUE(accepted(dg_moe_combine_backward(&b, nullptr)));
}

TEST(MoeCombineCheck, RefusesBadArguments) {
  EXPECT_TRUE(refused(dg_moe_combine(nullptr, nullptr), "desc must not be NULL"));
  EXPECT_TRUE(refused(dg_moe_combine_backward(nullptr, nullptr), "desc must not be NULL"));
  dg_moe_combine_desc d = combine_desc(64, 2, 128, DG_E4M3);
  EXPECT_TRUE(refused(dg_moe_combine(&d, nullptr), "dtype must be DG_BF16, DG_F16 or DG_F32"));
  d = combine_desc(64, 0, 128);
  EXPECT_TRUE(refused(dg_moe_combine(&d, nullptr), "k must be at least 1"));
  d = combine_desc(-1, 2, 128);
  EXPECT_TRUE(refused(dg_moe_combine(&d, nullptr), "must be non-negative"));
  d = combine_desc(64, 2, 128);
  d.tokens = int64_t(1) << 62;
  d.k = 4;
  EXPECT_TRUE(refused(dg_moe_combine(&d, nullptr), "tokens * k overflows int64"));
  d = combine_desc(64, 2, 128);
  d.rows = nullptr;
  EXPECT_TRUE(refused(dg_moe_combine(&d, nullptr), "rows must not be NULL"));
  d = combine_desc(64, 2, 128);
  d.rows = reinterpret_cast<const int64_t*>(static_cast<const char*>(fake_ptr(41)) + 4);
  EXPECT_TRUE(refused(dg_moe_combine(&d, nullptr), "rows must be a 8-byte aligned"));
  d = combine_desc(64, 2, 128);
  d.weights = reinterpret_cast<const float*>(static_cast<const char*>(fake_ptr(42)) + 2);
  EXPECT_TRUE(refused(dg_moe_combine(&d, nullptr), "weights must be a 4-byte aligned"));
  d = combine_desc(64, 2, 128);
  d.out = nullptr;
  EXPECT_TRUE(refused(dg_moe_combine(&d, nullptr), "out must not be NULL"));
  d = combine_desc(64, 2, 128, DG_F32);
  d.y = static_cast<const char*>(d.y) + 2;
  EXPECT_TRUE(refused(dg_moe_combine(&d, nullptr), "y must be a 4-byte aligned"));

  dg_moe_combine_backward_desc b = combine_backward_desc(64, 2, 128);
  b.y = nullptr;
  EXPECT_TRUE(refused(dg_moe_combine_backward(&b, nullptr), "dweights needs y"));
  b = combine_backward_desc(64, 2, 128);
  b.dy_rows = nullptr;
  EXPECT_TRUE(refused(dg_moe_combine_backward(&b, nullptr), "dy_rows must not be NULL"));
  b = combine_backward_desc(64, 2, 128);
  b.dy = nullptr;
  EXPECT_TRUE(refused(dg_moe_combine_backward(&b, nullptr), "dy must not be NULL"));
  b = combine_backward_desc(64, 2, 128);
  b.dweights = reinterpret_cast<float*>(static_cast<char*>(fake_ptr(49)) + 1);
  EXPECT_TRUE(refused(dg_moe_combine_backward(&b, nullptr), "dweights must be a 4-byte aligned"));
}

// `p` moved by `bytes` (negative: back), as an address only.
template <class T>
T* moved(T* p, int64_t bytes) {
  return reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes));
}

TEST(OutputsApart, EveryEntryPointRefusesAnOutputOverAnotherBuffer) {
  // The kernels read their inputs while they write their outputs: an output sharing a byte with
  // any other buffer of the call is refused, naming both; adjacent buffers are fine.
  dg_quantize_desc q = quantize_desc(DG_QUANT_TENSOR, 64, 256);  // x: 32768 bytes of bf16
  EXPECT_TRUE(accepted(dg_quantize_fp8(&q, nullptr)));
  q.out = moved(const_cast<void*>(q.x), 32768 - 1);
  EXPECT_TRUE(refused(dg_quantize_fp8(&q, nullptr), "out must not overlap x"));
  q.out = moved(const_cast<void*>(q.x), 32768);
  EXPECT_TRUE(accepted(dg_quantize_fp8(&q, nullptr)));
  q = quantize_desc(DG_QUANT_TENSOR, 64, 256);
  q.scale = static_cast<float*>(q.workspace);
  EXPECT_TRUE(refused(dg_quantize_fp8(&q, nullptr), "scale must not overlap workspace"));
  q = quantize_desc(DG_QUANT_1X128, 300, 256);
  q.transpose = 1;
  q.num_groups = 4;
  q.offs = static_cast<const int32_t*>(fake_ptr(12));
  q.scale = moved(static_cast<float*>(fake_ptr(12)), 12);
  EXPECT_TRUE(refused(dg_quantize_fp8(&q, nullptr), "scale must not overlap offs"));

  dg_moe_act_desc a = moe_desc(DG_MOE_SWIGLU_BACKWARD, 64, 256);  // x (64, 512), y (64, 512) bf16
  EXPECT_TRUE(accepted(dg_moe_activation(&a, nullptr)));
  a.y = const_cast<void*>(a.x);  // in place
  EXPECT_TRUE(refused(dg_moe_activation(&a, nullptr), "y must not overlap x"));
  a = moe_desc(DG_MOE_SWIGLU_BACKWARD, 64, 256);
  a.y_fp8 = moved(const_cast<void*>(a.dy), 64 * 256 * 2 - 16);
  EXPECT_TRUE(refused(dg_moe_activation(&a, nullptr), "y_fp8 must not overlap dy"));
  a = moe_desc(DG_MOE_GELU, 64, 256);
  a.yt_scale = static_cast<float*>(moved(a.y, 64));
  EXPECT_TRUE(refused(dg_moe_activation(&a, nullptr), "y must not overlap yt_scale"));
  a = moe_desc(DG_MOE_GELU, 64, 256);
  a.workspace = moved(a.yt_fp8, 128);
  EXPECT_TRUE(refused(dg_moe_activation(&a, nullptr), "yt_fp8 must not overlap workspace"));

  dg_moe_permute_desc m = permute_desc(100, 64, 256);
  EXPECT_TRUE(accepted(dg_moe_permute(&m, nullptr)));
  m.y_scale = static_cast<float*>(const_cast<void*>(static_cast<const void*>(m.rows)));
  EXPECT_TRUE(refused(dg_moe_permute(&m, nullptr), "y_scale must not overlap rows"));
  m = permute_desc(100, 64, 256);
  m.yt_fp8 = moved(const_cast<void*>(m.x), 100 * 256 * 2 - 1);
  EXPECT_TRUE(refused(dg_moe_permute(&m, nullptr), "yt_fp8 must not overlap x"));

  dg_quantize_weight_desc w = quantize_weight_desc(2, 128, 128, DG_F32);
  w.out_t = moved(fake_ptr(31), 2 * 128 * 128 - 1);
  EXPECT_TRUE(refused(dg_quantize_fp8_weight(&w, nullptr), "out must not overlap out_t"));
  w.out_t = const_cast<void*>(w.w);
  EXPECT_TRUE(refused(dg_quantize_fp8_weight(&w, nullptr), "out_t must not overlap w"));
  w.out_t = moved(fake_ptr(31), 2 * 128 * 128);
  w.scale_t = w.scale;
  EXPECT_TRUE(refused(dg_quantize_fp8_weight(&w, nullptr), "scale must not overlap scale_t"));

  dg_moe_combine_desc c = combine_desc(64, 2, 256);
  EXPECT_TRUE(accepted(dg_moe_combine(&c, nullptr)));
  c.out = const_cast<void*>(c.y);
  EXPECT_TRUE(refused(dg_moe_combine(&c, nullptr), "out must not overlap y"));
  c = combine_desc(64, 2, 256);
  c.out = moved(const_cast<float*>(c.weights), 4 * 128 - 2);
  EXPECT_TRUE(refused(dg_moe_combine(&c, nullptr), "out must not overlap weights"));

  dg_moe_combine_backward_desc b = combine_backward_desc(64, 2, 256);
  EXPECT_TRUE(accepted(dg_moe_combine_backward(&b, nullptr)));
  b.dy_rows = const_cast<void*>(b.y);
  EXPECT_TRUE(refused(dg_moe_combine_backward(&b, nullptr), "dy_rows must not overlap y"));
  b.dweights = nullptr;  // y is not read without dweights
  EXPECT_TRUE(accepted(dg_moe_combine_backward(&b, nullptr)));
  b = combine_backward_desc(64, 2, 256);
  b.dweights = reinterpret_cast<float*>(moved(const_cast<int64_t*>(b.rows), 8));
  EXPECT_TRUE(refused(dg_moe_combine_backward(&b, nullptr), "dweights must not overlap rows"));
  b = combine_backward_desc(64, 2, 256);
  b.dweights = static_cast<float*>(moved(b.dy_rows, 128 * 256 * 2 - 4));
  EXPECT_TRUE(refused(dg_moe_combine_backward(&b, nullptr), "dy_rows must not overlap dweights"));
}

TEST(MoeCombineRun, NothingRunsWithoutADevice) {
  int devices = 0;
  const bool none = cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0;
  cudaGetLastError();
  if (!none) GTEST_SKIP() << "a device is present: tests/cpp/test_c_api_gpu.cpp runs the kernels";
  const dg_moe_combine_desc d = combine_desc(64, 2, 128);
  EXPECT_NE(dg_moe_combine(&d, nullptr), DG_SUCCESS);
  EXPECT_NE(std::string(dg_last_error()).find("no usable CUDA device"), std::string::npos) << dg_last_error();
}

// ---------------------------------------------------------------- tensor-parallel sizes

dg_tp_desc tp_desc(int world, int64_t m, int64_t n, int64_t k) {
  dg_tp_desc d{};
  d.gemm = gemm_desc(m, n, k);
  d.world = world;
  d.timeout_s = 1.0;
  return d;
}

TEST(TpWorkspace, RefusesBadArguments) {
  size_t bytes = 0;
  dg_tp_desc d = tp_desc(2, 128, 256, 64);
  EXPECT_TRUE(refused(dg_tp_workspace_size(DG_TP_ALL_GATHER_GEMM, nullptr, &bytes), "must not be NULL"));
  EXPECT_TRUE(refused(dg_tp_workspace_size(DG_TP_ALL_GATHER_GEMM, &d, nullptr), "must not be NULL"));
  for (int raw : {0, 3}) {
    dg_tp_kind kind;
    set_raw(&kind, raw);
    EXPECT_TRUE(refused(dg_tp_workspace_size(kind, &d, &bytes), "kind")) << raw;
  }
  for (int world : {1, 0, -1, 65, INT_MAX, INT_MIN}) {
    d.world = world;
    EXPECT_TRUE(refused(dg_tp_workspace_size(DG_TP_ALL_GATHER_GEMM, &d, &bytes), "world")) << world;
    EXPECT_TRUE(refused(dg_tp_workspace_size(DG_TP_GEMM_REDUCE_SCATTER, &d, &bytes), "world")) << world;
  }
}

// The op's own fields, refused by name before any device is touched.
TEST(TpCall, RefusesAnUnknownAgreementMode) {
  dg_tp_desc d = tp_desc(2, 128, 256, 64);
  void* workspaces[2] = {reinterpret_cast<void*>(uintptr_t{1} << 20), reinterpret_cast<void*>(uintptr_t{2} << 20)};
  d.peer_workspaces = workspaces;
  for (int mode : {-1, 3, INT_MAX}) {
    d.agree_only = mode;
    EXPECT_TRUE(refused(dg_all_gather_gemm(&d, nullptr), "agree_only")) << mode;
    EXPECT_TRUE(refused(dg_gemm_reduce_scatter(&d, nullptr), "agree_only")) << mode;
  }
}

// out is written row by row at its row_stride: a column stride other than 1 (0 wrote N-1
// elements past the view) or rows that overlap are refused by name.
TEST(TpCall, RefusesAnOutputThatIsNotRowMajor) {
  dg_tp_desc d = tp_desc(2, 128, 256, 64);
  void* workspaces[2] = {reinterpret_cast<void*>(uintptr_t{1} << 20), reinterpret_cast<void*>(uintptr_t{2} << 20)};
  d.peer_workspaces = workspaces;
  d.gemm.d.rows = 256;  // world * m for the all-gather
  for (int64_t col_stride : {int64_t{0}, int64_t{2}, int64_t{-1}, int64_t{256}}) {
    d.gemm.d.col_stride = col_stride;
    EXPECT_TRUE(refused(dg_all_gather_gemm(&d, nullptr), "col_stride 1")) << col_stride;
    EXPECT_TRUE(refused(dg_gemm_reduce_scatter(&d, nullptr), "col_stride 1")) << col_stride;
  }
  d.gemm.d.col_stride = 1;
  d.gemm.d.row_stride = 255;
  EXPECT_TRUE(refused(dg_all_gather_gemm(&d, nullptr), "row_stride >= cols = 256"));
  d.gemm.d.row_stride = 256;
  d.agree_only = DG_TP_AGREE_ONLY;  // the agreement alone takes the same descriptor
  d.gemm.d.col_stride = 0;
  EXPECT_TRUE(refused(dg_all_gather_gemm(&d, nullptr), "gemm.d (out) must be row-major"));
}

// The PyTorch op's float[] settings: every value is checked before its cast to int (NaN,
// infinities and values past int's range convert with undefined behaviour).
TEST(TpSettings, FloatsAreCheckedBeforeTheirCastToInt) {
  using distgemm::tp::settings_from_doubles;
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  dg_tp_settings s{};
  std::string why;
  const double good[4] = {2, 3, 1, 12.5};
  ASSERT_TRUE(settings_from_doubles(good, 4, &s, &why)) << why;
  EXPECT_EQ(s.algo, DG_TP_ALGO_DECOMPOSED);
  EXPECT_EQ(s.pieces, 3);
  EXPECT_EQ(s.tapered, 1);
  EXPECT_EQ(s.rs_split_gflops, 12.5);
  const double defaults[4] = {0, 0, 0, -1};
  EXPECT_TRUE(settings_from_doubles(defaults, 4, &s, &why)) << why;

  struct Case {
    int index;
    double value;
    const char* name;
  };
  const Case cases[] = {{0, nan, "algo"},
                        {0, inf, "algo"},
                        {0, 1e300, "algo"},
                        {0, -1, "algo"},
                        {0, 3, "algo"},
                        {0, 1.5, "algo"},
                        {1, nan, "pieces"},
                        {1, -inf, "pieces"},
                        {1, 4.5, "pieces"},
                        {1, 5, "pieces"},
                        {1, 3e9, "pieces"},
                        {1, -3e9, "pieces"},
                        {2, nan, "tapered"},
                        {2, 2, "tapered"},
                        {2, inf, "tapered"},
                        {3, nan, "rs_split_gflops"},
                        {3, inf, "rs_split_gflops"},
                        {3, -inf, "rs_split_gflops"}};
  for (const Case& c : cases) {
    double v[4] = {0, 0, 0, 0};
    v[c.index] = c.value;
    why.clear();
    EXPECT_FALSE(settings_from_doubles(v, 4, &s, &why)) << c.name << " = " << c.value;
    EXPECT_NE(why.find(std::string("tp setting ") + c.name), std::string::npos) << why;
  }
  EXPECT_FALSE(settings_from_doubles(good, 3, &s, &why));
  EXPECT_NE(why.find("must be 4 values"), std::string::npos) << why;
  EXPECT_FALSE(settings_from_doubles(nullptr, 4, &s, &why));
}

TEST(TpWorkspace, ValidSizesGrowWithTheShape) {
  size_t small = 0, large = 0;
  dg_tp_desc d = tp_desc(2, 128, 256, 64);
  ASSERT_EQ(dg_tp_workspace_size(DG_TP_ALL_GATHER_GEMM, &d, &small), DG_SUCCESS) << dg_last_error();
  d = tp_desc(8, 128, 256, 64);
  ASSERT_EQ(dg_tp_workspace_size(DG_TP_ALL_GATHER_GEMM, &d, &large), DG_SUCCESS) << dg_last_error();
  EXPECT_GT(large, small);
  ASSERT_EQ(dg_tp_workspace_size(DG_TP_GEMM_REDUCE_SCATTER, &d, &small), DG_SUCCESS) << dg_last_error();
  EXPECT_GT(small, size_t{32} << 20);  // includes the cuBLASLt scratch
}

// Sizes whose layout arithmetic would overflow int64 (or that are empty) are refused by name.
TEST(TpWorkspace, RefusesOverflowingSizes) {
  size_t bytes = 0;
  for (int64_t rows : {INT64_MAX, INT64_MAX / 2, int64_t(1) << 40, int64_t{-1}, INT64_MIN}) {
    dg_tp_desc d = tp_desc(8, 128, 256, 64);
    d.gemm.a.rows = rows;
    d.gemm.d.rows = rows;
    const dg_status ag = dg_tp_workspace_size(DG_TP_ALL_GATHER_GEMM, &d, &bytes);
    EXPECT_EQ(ag, DG_ERROR_INVALID_ARGUMENT) << rows << ": " << dg_last_error();
    const dg_status rs = dg_tp_workspace_size(DG_TP_GEMM_REDUCE_SCATTER, &d, &bytes);
    EXPECT_EQ(rs, DG_ERROR_INVALID_ARGUMENT) << rows << ": " << dg_last_error();
  }
  dg_tp_desc d = tp_desc(64, kBig - 1, kBig - 1, kBig - 1);  // 64 * 2^31 * 2^31 * 2 bytes
  EXPECT_EQ(dg_tp_workspace_size(DG_TP_ALL_GATHER_GEMM, &d, &bytes), DG_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(dg_tp_workspace_size(DG_TP_GEMM_REDUCE_SCATTER, &d, &bytes), DG_ERROR_INVALID_ARGUMENT);
}

TEST(TpErrorWord, OutOfRangeDevicesFailCleanly) {
  for (int device : {-1, 64, 1000, INT_MIN}) {
    EXPECT_EQ(dg_tp_error(device), 0) << device;
    // A bad argument, not a CUDA failure.
    EXPECT_TRUE(refused(dg_tp_clear_error(device), "device " + std::to_string(device) + " is out of range"));
  }
}

// ---------------------------------------------------------------- per-device values

// A fake device context: `devices` devices, a per-thread current device, counters.
struct FakeDevices {
  static inline int devices = 4;
  static inline thread_local int current_device = 0;
  static inline std::atomic<int> selects{0};
  static bool current(int* device, std::string* why) {
    if (devices == 0) {
      *why = "no device";
      return false;
    }
    *device = current_device;
    return true;
  }
  static bool select(int device, std::string* why) {
    if (device >= devices) {
      *why = "invalid device ordinal";
      return false;
    }
    ++selects;
    current_device = device;
    return true;
  }
  static int begin_create() { return 7; }
  static void end_create(int state, bool) { EXPECT_EQ(state, 7); }
};

TEST(PerDevice, CreatesOnTheTargetDeviceAndRestoresTheCurrentOne) {
  static distgemm::PerDevice<int, FakeDevices> values;  // static: its values live for the process
  FakeDevices::current_device = 1;
  int created_on = -1;
  int* v = values.get(3, "the value", [&](int d, int* out) {
    created_on = FakeDevices::current_device;
    *out = 100 + d;
    return DG_SUCCESS;
  });
  ASSERT_NE(v, nullptr);
  EXPECT_EQ(*v, 103);
  EXPECT_EQ(created_on, 3);
  EXPECT_EQ(FakeDevices::current_device, 1);
  // Cached: the second call neither creates nor selects.
  const int selects = FakeDevices::selects;
  EXPECT_EQ(values.get(3, "the value",
                       [](int, int*) {
                         ADD_FAILURE() << "created twice";
                         return DG_SUCCESS;
                       }),
            v);
  EXPECT_EQ(FakeDevices::selects, selects);
}

TEST(PerDevice, FailuresAreNotCached) {
  static distgemm::PerDevice<int, FakeDevices> values;  // static: its values live for the process
  int attempts = 0;
  auto flaky = [&](int, int* out) {
    if (++attempts == 1) return distgemm::fail(DG_ERROR_CUDA, "first attempt fails (graph capture)");
    *out = 42;
    return DG_SUCCESS;
  };
  EXPECT_EQ(values.get(0, "the value", flaky), nullptr);
  EXPECT_NE(std::string(dg_last_error()).find("first attempt fails"), std::string::npos);
  EXPECT_EQ(values.peek(0), nullptr);
  int* v = values.get(0, "the value", flaky);
  ASSERT_NE(v, nullptr);
  EXPECT_EQ(*v, 42);
  EXPECT_EQ(attempts, 2);
}

TEST(PerDevice, RefusesDevicesOutOfRange) {
  static distgemm::PerDevice<int, FakeDevices> values;  // static: its values live for the process
  auto never = [](int, int*) {
    ADD_FAILURE() << "created";
    return DG_SUCCESS;
  };
  for (int device : {-1, distgemm::kMaxDevices, INT_MAX, INT_MIN}) {
    EXPECT_EQ(values.get(device, "the value", never), nullptr);
    EXPECT_TRUE(refused(DG_ERROR_INVALID_ARGUMENT, "out of range"));
    EXPECT_EQ(values.peek(device), nullptr);
  }
  // In range of the table but not a device the runtime knows.
  EXPECT_EQ(values.get(FakeDevices::devices, "the value", never), nullptr);
  EXPECT_NE(std::string(dg_last_error()).find("cannot select the device: invalid device ordinal"), std::string::npos);
  FakeDevices::devices = 0;
  EXPECT_EQ(values.get(0, "the value", never), nullptr);
  FakeDevices::devices = 4;
}

TEST(PerDevice, ConcurrentFirstCallsCreateOnce) {
  static distgemm::PerDevice<int, FakeDevices> values;  // static: its values live for the process
  std::atomic<int> creations{0};
  std::vector<std::thread> threads;
  std::vector<int*> seen(8, nullptr);
  for (int i = 0; i < 8; ++i)
    threads.emplace_back([&, i] {
      seen[i] = values.get(2, "the value", [&](int, int* out) {
        ++creations;
        *out = 7;
        return DG_SUCCESS;
      });
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(creations, 1);
  for (int* p : seen) EXPECT_EQ(p, seen[0]);
}

TEST(PerDevice, CoreCachesFailCleanlyWithoutADevice) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) GTEST_SKIP() << "a GPU is present";
  cudaGetLastError();
  for (int device : {0, 1, 63}) {
    EXPECT_EQ(distgemm::error_state(device), nullptr);
    EXPECT_NE(std::string(dg_last_error()).find("cannot select the device"), std::string::npos);
    EXPECT_EQ(distgemm::stream_pool(device), nullptr);
  }
  EXPECT_EQ(distgemm::error_state(64), nullptr);
  EXPECT_NE(std::string(dg_last_error()).find("out of range"), std::string::npos);
  EXPECT_EQ(distgemm::stream_pool(-1), nullptr);
}

}  // namespace

// ---------------------------------------------------------------- ABI

// The C structs' layouts as of this soversion (0.2): a change to any of them must come with a new
// soversion (project VERSION's minor while the major is 0), and then new figures here.
TEST(Abi, StructLayoutsBelongToTheSoversion) {
  ASSERT_EQ(DG_VERSION_MAJOR, 0);
  ASSERT_EQ(DG_VERSION_MINOR, 2) << "a new soversion: record its struct layouts below";
  EXPECT_EQ(sizeof(dg_matrix), 48u);
  EXPECT_EQ(sizeof(dg_gemm_desc), 248u);
  EXPECT_EQ(offsetof(dg_gemm_desc, swizzle), 240u);
  EXPECT_EQ(sizeof(dg_grouped_shape), 32u);
  EXPECT_EQ(sizeof(dg_grouped_desc), 256u);
  EXPECT_EQ(offsetof(dg_grouped_desc, scale_b_shape), 224u);
  EXPECT_EQ(sizeof(dg_tp_settings), 24u);
  EXPECT_EQ(sizeof(dg_tp_desc), 320u);
  EXPECT_EQ(offsetof(dg_tp_desc, settings), 288u);
  EXPECT_EQ(offsetof(dg_tp_desc, agree_only), 312u);
  EXPECT_EQ(sizeof(dg_quantize_desc), 104u);
  EXPECT_EQ(offsetof(dg_quantize_desc, workspace_bytes), 96u);
  EXPECT_EQ(sizeof(dg_moe_act_desc), 120u);
  EXPECT_EQ(offsetof(dg_moe_act_desc, workspace_bytes), 112u);
  EXPECT_EQ(sizeof(dg_moe_permute_desc), 120u);
  EXPECT_EQ(offsetof(dg_moe_permute_desc, fp8_dtype), 96u);
  EXPECT_EQ(sizeof(dg_quantize_weight_desc), 88u);
  EXPECT_EQ(offsetof(dg_quantize_weight_desc, out_dtype), 64u);
  EXPECT_EQ(offsetof(dg_quantize_weight_desc, granularity), 80u);
}

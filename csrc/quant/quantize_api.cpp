// dg_quantize_fp8: argument checks, the sizes callers allocate, and the launch. Host-only.
#include <cstdint>
#include <string>

#include "common/buffer_check.h"
#include "common/checked_math.h"
#include "common/device.h"
#include "common/dtype.h"
#include "common/status.h"
#include "distgemm/distgemm.h"
#include "quant/fp8_quantize.h"

namespace distgemm::quant {
namespace {

constexpr int64_t kInt32Limit = int64_t(1) << 31;

std::string dtype_str(int raw) {
  return raw >= DG_F32 && raw <= DG_I32 ? dtype_name(static_cast<dg_dtype>(raw)) : cat("dtype ", raw);
}

const char* granularity_name(int g) {
  switch (g) {
    case kTensor:
      return "tensor";
    case kRow:
      return "row";
    case k1x128:
      return "1 x 128";
    case k128x128:
      return "128 x 128";
  }
  return "unknown";
}

int64_t blocks_of(int64_t n) { return n / kBlock + (n % kBlock != 0); }

// What dg_quantize_fp8_sizes reports, plus the element counts the pointer checks need.
struct Layout {
  dg_quantize_sizes sizes{};
  int64_t x_elems = 0;
  int64_t data_elems = 0;
  int64_t scale_elems = 0;
  int64_t row_blocks = 0;  // transpose: out's blocks of 128 columns
};

// The shape fields of d (no pointer is read): dtypes, granularity, sizes and their products.
dg_status check_shape(const dg_quantize_desc& d, Layout* l) {
  const int in = raw_enum(d.x_dtype), out = raw_enum(d.out_dtype), g = raw_enum(d.granularity);
  DG_REQUIRE(in == DG_BF16 || in == DG_F16 || in == DG_F32, "x must be bfloat16, float16 or float32, got ",
             dtype_str(in));
  DG_REQUIRE(out == DG_E4M3 || out == DG_E5M2, "out dtype must be float8_e4m3fn or float8_e5m2, got ", dtype_str(out));
  DG_REQUIRE(g >= kTensor && g <= k128x128,
             "granularity must be DG_QUANT_TENSOR, DG_QUANT_ROW, DG_QUANT_1X128 or DG_QUANT_128X128, got ", g);
  DG_REQUIRE(d.rows >= 0 && d.cols >= 0, "x must have non-negative rows and cols, got (", d.rows, ", ", d.cols, ")");
  if (g == k128x128) {
    DG_REQUIRE(d.batch >= 0, "batch must be non-negative, got ", d.batch);
  } else {
    DG_REQUIRE(d.batch == 1, "batch must be 1 for ", granularity_name(g),
               " scales (only 128 x 128 blocks take a batch of matrices), got ", d.batch);
  }
  DG_REQUIRE(!d.transpose || g == k1x128, "transpose needs 1 x 128 blocks (DG_QUANT_1X128), got ", granularity_name(g),
             " scales");
  DG_REQUIRE(d.num_groups >= 0 && d.num_groups < kInt32Limit, "num_groups must be 0 (no offs) or in [1, 2^31), got ",
             d.num_groups);
  DG_REQUIRE(d.num_groups == 0 || d.transpose, "offs (num_groups = ", d.num_groups,
             ") apply to the transposed 1 x 128 quantization only");
  DG_REQUIRE(d.num_groups == 0 || d.rows < kInt32Limit,
             "x must have fewer than 2^31 rows with offs (int32 "
             "group ends), got ",
             d.rows);
  DG_REQUIRE(checked_product({d.batch, d.rows, d.cols}, &l->x_elems), "x of (", d.batch, ", ", d.rows, ", ", d.cols,
             ") elements overflows int64");

  dg_quantize_sizes& s = l->sizes;
  switch (g) {
    case kTensor:
      s = {d.rows, d.cols, 1, 1, sizeof(uint32_t)};
      break;
    case kRow:
      s = {d.rows, d.cols, d.rows, 1, 0};
      break;
    case k1x128:
      if (!d.transpose) {
        s = {d.rows, d.cols, blocks_of(d.cols), d.rows, 0};
      } else if (d.num_groups == 0) {
        l->row_blocks = blocks_of(d.rows);
        s = {d.cols, d.rows, l->row_blocks, d.cols, 0};
      } else {
        l->row_blocks = blocks_of(d.rows) + d.num_groups;  // < 2^31 + 2^24: no overflow
        s = {d.cols, l->row_blocks * kBlock, l->row_blocks, d.cols,
             static_cast<size_t>(d.num_groups) * sizeof(int32_t)};
      }
      break;
    case k128x128:
      s = {d.rows, d.cols, blocks_of(d.rows), blocks_of(d.cols), 0};
      break;
  }
  // Every buffer's bytes fit in int64 (x's elements are at most 4 bytes, the scales 4).
  const int64_t batch = g == k128x128 ? d.batch : 1;
  int64_t bytes = 0;
  DG_REQUIRE(checked_mul(l->x_elems, dtype_bytes(d.x_dtype), &bytes), "x of (", d.batch, ", ", d.rows, ", ", d.cols,
             ") elements spans more than 2^63 bytes");
  DG_REQUIRE(checked_product({batch, s.data_rows, s.data_cols}, &l->data_elems), "the FP8 data of (", s.data_rows, ", ",
             s.data_cols, ") elements spans more than 2^63 bytes");
  DG_REQUIRE(checked_product({batch, s.scale_rows, s.scale_cols, 4}, &bytes), "the scales of (", s.scale_rows, ", ",
             s.scale_cols, ") values span more than 2^63 bytes");
  l->scale_elems = bytes / 4;
  return DG_SUCCESS;
}

dg_status lower(const dg_quantize_desc* desc, QuantizeProblem* p) {
  DG_REQUIRE(desc != nullptr, "desc must not be NULL");
  const dg_quantize_desc& d = *desc;
  Layout l;
  DG_RETURN_IF_ERROR(check_shape(d, &l));
  const int in_bytes = dtype_bytes(d.x_dtype);
  DG_RETURN_IF_ERROR(check_extent(d.x, "x", {l.x_elems}, in_bytes, static_cast<unsigned>(in_bytes)));
  DG_RETURN_IF_ERROR(check_extent(d.out, "out", {l.data_elems}, 1, 1));
  DG_RETURN_IF_ERROR(check_extent(d.scale, "scale", {l.scale_elems}, 4, 4));
  if (d.num_groups > 0) DG_RETURN_IF_ERROR(check_extent(d.offs, "offs", {d.num_groups}, 4, 4));
  const size_t needed = l.sizes.workspace_bytes;
  DG_REQUIRE(d.workspace_bytes >= needed, "workspace of ", d.workspace_bytes, " bytes is smaller than the ", needed,
             " needed");
  if (needed > 0) DG_RETURN_IF_ERROR(check_extent(d.workspace, "workspace", {static_cast<int64_t>(needed)}, 1, 4));
  DG_RETURN_IF_ERROR(check_no_overlap({{"out", d.out, l.data_elems, true},
                                       {"scale", d.scale, 4 * l.scale_elems, true},
                                       {"workspace", d.workspace, static_cast<int64_t>(needed), true},
                                       {"x", d.x, l.x_elems * in_bytes, false},
                                       {"offs", d.offs, 4 * d.num_groups, false}}));

  p->x = d.x;
  p->x_dtype = d.x_dtype;
  p->batch = d.batch;
  p->rows = d.rows;
  p->cols = d.cols;
  p->granularity = raw_enum(d.granularity);
  p->transpose = d.transpose != 0;
  p->offs = d.num_groups > 0 ? d.offs : nullptr;
  p->groups = d.num_groups;
  p->out = d.out;
  p->out_dtype = d.out_dtype;
  p->scale = d.scale;
  p->workspace = d.workspace;
  p->out_ld = l.sizes.data_cols;
  p->row_blocks = l.row_blocks;
  return DG_SUCCESS;
}

}  // namespace
}  // namespace distgemm::quant

using namespace distgemm;
using namespace distgemm::quant;

extern "C" dg_status dg_quantize_fp8_sizes(const dg_quantize_desc* desc, dg_quantize_sizes* sizes) {
  DG_REQUIRE(desc != nullptr, "desc must not be NULL");
  DG_REQUIRE(sizes != nullptr, "sizes must not be NULL");
  Layout l;
  DG_RETURN_IF_ERROR(check_shape(*desc, &l));
  *sizes = l.sizes;
  return DG_SUCCESS;
}

extern "C" dg_status dg_quantize_fp8(const dg_quantize_desc* desc, cudaStream_t stream) {
  return check_and_launch_portable<QuantizeProblem>("FP8 quantization", desc, lower, launch_quantize_fp8, stream);
}

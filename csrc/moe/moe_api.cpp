// dg_moe_activation, dg_moe_permute, dg_quantize_fp8_weight, dg_moe_combine and
// dg_moe_combine_backward: argument checks and the launch. Host-only.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/buffer_check.h"
#include "common/checked_math.h"
#include "common/device.h"
#include "common/dtype.h"
#include "common/status.h"
#include "distgemm/distgemm.h"
#include "moe/moe_act_quantize.h"
#include "moe/moe_routing.h"

namespace distgemm::moe {
namespace {

constexpr int64_t kBlock = 128;
constexpr int64_t kInt32Limit = int64_t(1) << 31;

int64_t blocks_of(int64_t n) { return n / kBlock + (n % kBlock != 0); }

// The workspace dg_moe_activation needs: the groups' clamped ends, for the padded transpose only.
size_t act_workspace_bytes(const dg_moe_act_desc& d) {
  return d.yt_fp8 != nullptr ? static_cast<size_t>(d.num_groups) * sizeof(int32_t) : 0;
}

bool is_backward(int act) { return act == kSwigluBackward || act == kGeluBackward; }
bool is_swiglu(int act) { return act == kSwiglu || act == kSwigluBackward; }

const char* act_name(int act) {
  switch (act) {
    case kIdentity:
      return "DG_MOE_IDENTITY";
    case kSwiglu:
      return "DG_MOE_SWIGLU";
    case kGelu:
      return "DG_MOE_GELU";
    case kSwigluBackward:
      return "DG_MOE_SWIGLU_BACKWARD";
    case kGeluBackward:
      return "DG_MOE_GELU_BACKWARD";
  }
  return "unknown";
}

// The shape fields of d (no pointer is read) into p's sizes.
dg_status check_act_shape(const dg_moe_act_desc& d, ActProblem* p) {
  const int act = raw_enum(d.act);
  DG_REQUIRE(act >= kIdentity && act <= kGeluBackward,
             "act must be DG_MOE_IDENTITY, DG_MOE_SWIGLU, DG_MOE_GELU, DG_MOE_SWIGLU_BACKWARD or "
             "DG_MOE_GELU_BACKWARD, got ",
             act);
  DG_REQUIRE(d.tokens >= 0 && d.inner >= 0, "tokens and inner must be non-negative, got ", d.tokens, " and ", d.inner);
  DG_REQUIRE(d.y != nullptr || d.y_fp8 != nullptr || d.yt_fp8 != nullptr,
             "no output: set at least one of y, y_fp8 and yt_fp8");
  const bool fp8 = d.y_fp8 != nullptr || d.yt_fp8 != nullptr;
  const int out = raw_enum(d.fp8_dtype);
  DG_REQUIRE(!fp8 || out == DG_E4M3 || out == DG_E5M2, "fp8_dtype must be DG_E4M3 or DG_E5M2, got ", out);
  DG_REQUIRE(is_backward(act) || d.dy == nullptr, "dy applies to the backward activations only, not ", act_name(act));
  p->act = act;
  p->planes = act == kSwigluBackward ? 2 : 1;
  p->tokens = d.tokens;
  p->inner = d.inner;
  DG_REQUIRE(d.inner < (int64_t(1) << 40), "inner must be below 2^40, got ", d.inner);
  p->x_cols = is_swiglu(act) ? 2 * d.inner : d.inner;
  p->y_cols = p->planes * d.inner;
  DG_REQUIRE(blocks_of(d.inner) <= 65535, "inner of ", d.inner, " columns is more than 65535 blocks of 128");
  DG_REQUIRE(act != kSwigluBackward || d.y_fp8 == nullptr || d.inner % kBlock == 0,
             "DG_MOE_SWIGLU_BACKWARD with y_fp8 needs inner to be a multiple of 128 (a 1 x 128 block "
             "must not span the gate and up halves), got ",
             d.inner);
  if (d.yt_fp8 != nullptr) {
    DG_REQUIRE(d.num_groups >= 1 && d.num_groups < kInt32Limit,
               "yt_fp8 (the per-group padded transpose) needs num_groups in [1, 2^31), got ", d.num_groups);
    DG_REQUIRE(d.tokens < kInt32Limit, "yt_fp8 needs fewer than 2^31 tokens (int32 group ends), got ", d.tokens);
    p->groups = d.num_groups;
    p->row_blocks = blocks_of(d.tokens) + d.num_groups;
    p->yt_ld = p->row_blocks * kBlock;
  } else {
    DG_REQUIRE(d.num_groups == 0, "num_groups applies to yt_fp8 only, got ", d.num_groups);
    p->row_blocks = blocks_of(d.tokens);
  }
  DG_REQUIRE(p->row_blocks < kInt32Limit, "tokens of ", d.tokens, " are more than 2^31 - 1 blocks of 128");
  return DG_SUCCESS;
}

// Every check of d, with x_rows rows of x (d.tokens without a gather); with a gather (rows not
// NULL), *rows holds its num_rows row indices, checked last.
dg_status lower_act_reading(const dg_moe_act_desc& d, int64_t x_rows, const int64_t* const* rows, int64_t num_rows,
                            ActProblem* p) {
  DG_RETURN_IF_ERROR(check_act_shape(d, p));
  DG_RETURN_IF_ERROR(check_extent(d.x, "x", {x_rows, p->x_cols}, 2, 2));
  if (is_backward(p->act)) DG_RETURN_IF_ERROR(check_extent(d.dy, "dy", {d.tokens, d.inner}, 2, 2));
  if (d.y != nullptr) DG_RETURN_IF_ERROR(check_extent(d.y, "y", {d.tokens, p->y_cols}, 2, 2));
  if (d.y_fp8 != nullptr) {
    DG_RETURN_IF_ERROR(check_extent(d.y_fp8, "y_fp8", {d.tokens, p->y_cols}, 1, 1));
    DG_RETURN_IF_ERROR(check_extent(d.y_scale, "y_scale", {blocks_of(p->y_cols), d.tokens}, 4, 4));
  }
  const size_t need = act_workspace_bytes(d);
  if (d.yt_fp8 != nullptr) {
    DG_RETURN_IF_ERROR(check_extent(d.yt_fp8, "yt_fp8", {p->y_cols, p->yt_ld}, 1, 1));
    DG_RETURN_IF_ERROR(check_extent(d.yt_scale, "yt_scale", {p->row_blocks, p->y_cols}, 4, 4));
    DG_RETURN_IF_ERROR(check_extent(d.offs, "offs", {d.num_groups}, 4, 4));
    DG_REQUIRE(d.workspace_bytes >= need, "workspace of ", d.workspace_bytes, " bytes is smaller than the ", need,
               " needed");
    DG_RETURN_IF_ERROR(check_extent(d.workspace, "workspace", {static_cast<int64_t>(need)}, 1, 4));
  }
  if (rows != nullptr) DG_RETURN_IF_ERROR(check_extent(*rows, "rows", {num_rows}, 8, 8));
  // Every size below was checked within int64 by check_extent.
  const int64_t t = d.tokens, y = p->y_cols, fp8 = d.y_fp8 != nullptr, yt = d.yt_fp8 != nullptr;
  DG_RETURN_IF_ERROR(check_no_overlap({{"y", d.y, d.y != nullptr ? 2 * t * y : 0, true},
                                       {"y_fp8", d.y_fp8, fp8 * t * y, true},
                                       {"y_scale", d.y_scale, fp8 * 4 * blocks_of(y) * t, true},
                                       {"yt_fp8", d.yt_fp8, yt * y * p->yt_ld, true},
                                       {"yt_scale", d.yt_scale, yt * 4 * p->row_blocks * y, true},
                                       {"workspace", d.workspace, static_cast<int64_t>(need), true},
                                       {"x", d.x, 2 * x_rows * p->x_cols, false},
                                       {"dy", d.dy, is_backward(p->act) ? 2 * t * d.inner : 0, false},
                                       {"offs", d.offs, yt * 4 * d.num_groups, false},
                                       {"rows", rows != nullptr ? *rows : nullptr, 8 * num_rows, false}}));
  p->x = d.x;
  p->dy = d.dy;
  p->y = d.y;
  p->y_fp8 = d.y_fp8;
  p->y_scale = d.y_scale;
  p->yt_fp8 = d.yt_fp8;
  p->yt_scale = d.yt_scale;
  p->offs = d.offs;
  p->ends = need ? static_cast<int32_t*>(d.workspace) : nullptr;
  if (d.y_fp8 != nullptr || d.yt_fp8 != nullptr) p->fp8_dtype = d.fp8_dtype;  // checked only then
  return DG_SUCCESS;
}

dg_status lower_act(const dg_moe_act_desc* desc, ActProblem* p) {
  DG_REQUIRE(desc != nullptr, "desc must not be NULL");
  return lower_act_reading(*desc, desc->tokens, nullptr, 0, p);
}

// dg_moe_permute is the identity activation with its rows gathered: its own fields are checked
// under their names, the rest as dg_moe_activation checks them.
dg_moe_act_desc identity_of(const dg_moe_permute_desc& d) {
  dg_moe_act_desc a{};
  a.act = DG_MOE_IDENTITY;
  a.x = d.x;
  a.tokens = d.num_rows;
  a.inner = d.hidden;
  a.y = d.y;
  a.y_fp8 = d.y_fp8;
  a.y_scale = d.y_scale;
  a.yt_fp8 = d.yt_fp8;
  a.yt_scale = d.yt_scale;
  a.offs = d.offs;
  a.num_groups = d.num_groups;
  std::memcpy(&a.fp8_dtype, &d.fp8_dtype, sizeof a.fp8_dtype);  // as bits: it may not be a valid dg_dtype yet
  a.workspace = d.workspace;
  a.workspace_bytes = d.workspace_bytes;
  return a;
}

dg_status check_permute_shape(const dg_moe_permute_desc& d) {
  DG_REQUIRE(d.x_rows >= 0 && d.num_rows >= 0 && d.hidden >= 0,
             "x_rows, num_rows and hidden must be non-negative, got ", d.x_rows, ", ", d.num_rows, " and ", d.hidden);
  DG_REQUIRE(d.num_rows < kInt32Limit, "num_rows must be below 2^31, got ", d.num_rows);
  DG_REQUIRE(blocks_of(d.hidden) <= 65535, "hidden of ", d.hidden, " columns is more than 65535 blocks of 128");
  return DG_SUCCESS;
}

dg_status lower_permute(const dg_moe_permute_desc* desc, ActProblem* p) {
  DG_REQUIRE(desc != nullptr, "desc must not be NULL");
  const dg_moe_permute_desc& d = *desc;
  DG_RETURN_IF_ERROR(check_permute_shape(d));
  DG_RETURN_IF_ERROR(lower_act_reading(identity_of(d), d.x_rows, &d.rows, d.num_rows, p));
  p->x_rows = d.rows;
  p->x_tokens = d.x_rows;
  return DG_SUCCESS;
}

dg_status lower_weight(const dg_quantize_weight_desc* desc, WeightProblem* p) {
  DG_REQUIRE(desc != nullptr, "desc must not be NULL");
  const dg_quantize_weight_desc& d = *desc;
  const int in = raw_enum(d.w_dtype), out = raw_enum(d.out_dtype), granularity = raw_enum(d.granularity);
  DG_REQUIRE(in == DG_BF16 || in == DG_F16 || in == DG_F32, "w must be bfloat16, float16 or float32, got dtype ", in);
  DG_REQUIRE(out == DG_E4M3 || out == DG_E5M2, "out dtype must be DG_E4M3 or DG_E5M2, got ", out);
  DG_REQUIRE(granularity == DG_QUANT_128X128 || granularity == DG_QUANT_ROW,
             "granularity must be DG_QUANT_128X128 or DG_QUANT_ROW, got ", granularity);
  DG_REQUIRE(d.groups >= 0 && d.rows >= 0 && d.cols >= 0, "w must have non-negative (groups, rows, cols), got (",
             d.groups, ", ", d.rows, ", ", d.cols, ")");
  DG_REQUIRE(d.out != nullptr || d.out_t != nullptr, "no output: set out, out_t or both");
  const bool per_row = granularity == DG_QUANT_ROW;
  int64_t elems = 0, scales = 0, scales_t = 0;
  DG_REQUIRE(checked_product({d.groups, d.rows, d.cols}, &elems), "w of (", d.groups, ", ", d.rows, ", ", d.cols,
             ") elements overflows int64");
  if (per_row) {
    DG_REQUIRE(checked_product({d.groups, d.rows}, &scales) && checked_product({d.groups, d.cols}, &scales_t),
               "w's scales overflow int64");
  } else {
    DG_REQUIRE(checked_product({d.groups, blocks_of(d.rows), blocks_of(d.cols)}, &scales), "w's scales overflow int64");
    scales_t = scales;
  }
  // 128 x 128: scale always (both copies share it), scale_t where given; row: each with its copy.
  const bool want_scale = !per_row || d.out != nullptr;
  const bool want_scale_t = per_row ? d.out_t != nullptr : d.scale_t != nullptr;
  const int bytes = dtype_bytes(d.w_dtype);
  DG_RETURN_IF_ERROR(check_extent(d.w, "w", {elems}, bytes, static_cast<unsigned>(bytes)));
  if (d.out != nullptr) DG_RETURN_IF_ERROR(check_extent(d.out, "out", {elems}, 1, 1));
  if (d.out_t != nullptr) DG_RETURN_IF_ERROR(check_extent(d.out_t, "out_t", {elems}, 1, 1));
  if (want_scale) DG_RETURN_IF_ERROR(check_extent(d.scale, "scale", {scales}, 4, 4));
  if (want_scale_t) DG_RETURN_IF_ERROR(check_extent(d.scale_t, "scale_t", {scales_t}, 4, 4));
  DG_RETURN_IF_ERROR(check_no_overlap({{"out", d.out, d.out != nullptr ? elems : 0, true},
                                       {"out_t", d.out_t, d.out_t != nullptr ? elems : 0, true},
                                       {"scale", d.scale, want_scale ? 4 * scales : 0, true},
                                       {"scale_t", d.scale_t, want_scale_t ? 4 * scales_t : 0, true},
                                       {"w", d.w, elems * bytes, false}}));
  p->w = d.w;
  p->w_dtype = d.w_dtype;
  p->groups = d.groups;
  p->rows = d.rows;
  p->cols = d.cols;
  p->out = d.out;
  p->out_t = d.out_t;
  p->scale = want_scale ? d.scale : nullptr;
  p->scale_t = want_scale_t ? d.scale_t : nullptr;
  p->fp8_dtype = d.out_dtype;
  p->row_scales = per_row;
  return DG_SUCCESS;
}

// The fields dg_moe_combine and its backward share: dtype, sizes, the slots' rows and weights.
dg_status check_routing_common(const dg_dtype& dtype_field, int64_t num_rows, const int64_t* rows, const float* weights,
                               int64_t tokens, int64_t k, int64_t hidden, CombineProblem* p) {
  const int dtype = raw_enum(dtype_field);
  DG_REQUIRE(dtype == DG_BF16 || dtype == DG_F16 || dtype == DG_F32, "dtype must be DG_BF16, DG_F16 or DG_F32, got ",
             dtype);
  DG_REQUIRE(num_rows >= 0 && tokens >= 0 && hidden >= 0, "num_rows, tokens and hidden must be non-negative, got ",
             num_rows, ", ", tokens, " and ", hidden);
  DG_REQUIRE(k >= 1, "k must be at least 1, got ", k);
  int64_t slots = 0, elems = 0;
  DG_REQUIRE(checked_product({tokens, k}, &slots), "tokens * k overflows int64: ", tokens, " x ", k);
  DG_REQUIRE(checked_product({std::max(num_rows, tokens), hidden}, &elems), "rows of ", hidden,
             " elements overflow int64");
  DG_RETURN_IF_ERROR(check_extent(rows, "rows", {slots}, 8, 8));
  if (weights != nullptr) DG_RETURN_IF_ERROR(check_extent(weights, "weights", {slots}, 4, 4));
  p->dtype = dtype_field;
  p->num_rows = num_rows;
  p->rows = rows;
  p->weights = weights;
  p->tokens = tokens;
  p->k = k;
  p->hidden = hidden;
  return DG_SUCCESS;
}

dg_status lower_combine(const dg_moe_combine_desc* desc, CombineProblem* p) {
  DG_REQUIRE(desc != nullptr, "desc must not be NULL");
  const dg_moe_combine_desc& d = *desc;
  DG_RETURN_IF_ERROR(check_routing_common(d.dtype, d.num_rows, d.rows, d.weights, d.tokens, d.k, d.hidden, p));
  const int bytes = dtype_bytes(d.dtype);
  DG_RETURN_IF_ERROR(check_extent(d.y, "y", {d.num_rows, d.hidden}, bytes, static_cast<unsigned>(bytes)));
  DG_RETURN_IF_ERROR(check_extent(d.out, "out", {d.tokens, d.hidden}, bytes, static_cast<unsigned>(bytes)));
  const int64_t slots = d.tokens * d.k;  // checked in int64
  DG_RETURN_IF_ERROR(check_no_overlap({{"out", d.out, d.tokens * d.hidden * bytes, true},
                                       {"y", d.y, d.num_rows * d.hidden * bytes, false},
                                       {"rows", d.rows, 8 * slots, false},
                                       {"weights", d.weights, d.weights != nullptr ? 4 * slots : 0, false}}));
  p->y = d.y;
  p->out = d.out;
  return DG_SUCCESS;
}

dg_status lower_combine_backward(const dg_moe_combine_backward_desc* desc, CombineProblem* p) {
  DG_REQUIRE(desc != nullptr, "desc must not be NULL");
  const dg_moe_combine_backward_desc& d = *desc;
  DG_RETURN_IF_ERROR(check_routing_common(d.dtype, d.num_rows, d.rows, d.weights, d.tokens, d.k, d.hidden, p));
  const int bytes = dtype_bytes(d.dtype);
  const auto align = static_cast<unsigned>(bytes);
  DG_RETURN_IF_ERROR(check_extent(d.dy, "dy", {d.tokens, d.hidden}, bytes, align));
  DG_RETURN_IF_ERROR(check_extent(d.dy_rows, "dy_rows", {d.num_rows, d.hidden}, bytes, align));
  if (d.dweights != nullptr) {
    DG_RETURN_IF_ERROR(check_extent(d.dweights, "dweights", {d.tokens * d.k}, 4, 4));
    DG_REQUIRE(d.y != nullptr || d.num_rows == 0 || d.hidden == 0, "dweights needs y (the forward's rows)");
    DG_RETURN_IF_ERROR(check_extent(d.y, "y", {d.num_rows, d.hidden}, bytes, align));
  }
  const int64_t slots = d.tokens * d.k, with_dw = d.dweights != nullptr;  // checked in int64
  DG_RETURN_IF_ERROR(check_no_overlap({{"dy_rows", d.dy_rows, d.num_rows * d.hidden * bytes, true},
                                       {"dweights", d.dweights, with_dw * 4 * slots, true},
                                       {"dy", d.dy, d.tokens * d.hidden * bytes, false},
                                       {"y", d.y, with_dw * d.num_rows * d.hidden * bytes, false},
                                       {"rows", d.rows, 8 * slots, false},
                                       {"weights", d.weights, d.weights != nullptr ? 4 * slots : 0, false}}));
  p->dy = d.dy;
  p->y = d.dweights != nullptr ? d.y : nullptr;
  p->dy_rows = d.dy_rows;
  p->dweights = d.dweights;
  return DG_SUCCESS;
}

}  // namespace
}  // namespace distgemm::moe

using namespace distgemm;
using namespace distgemm::moe;

extern "C" dg_status dg_moe_activation_workspace_size(const dg_moe_act_desc* desc, size_t* bytes) {
  DG_REQUIRE(desc != nullptr, "desc must not be NULL");
  DG_REQUIRE(bytes != nullptr, "bytes must not be NULL");
  ActProblem p;
  DG_RETURN_IF_ERROR(check_act_shape(*desc, &p));
  *bytes = act_workspace_bytes(*desc);
  return DG_SUCCESS;
}

extern "C" dg_status dg_moe_activation(const dg_moe_act_desc* desc, cudaStream_t stream) {
  return check_and_launch_portable<ActProblem>("MoE activation", desc, lower_act, launch_act, stream);
}

extern "C" dg_status dg_moe_permute_workspace_size(const dg_moe_permute_desc* desc, size_t* bytes) {
  DG_REQUIRE(desc != nullptr, "desc must not be NULL");
  DG_REQUIRE(bytes != nullptr, "bytes must not be NULL");
  DG_RETURN_IF_ERROR(check_permute_shape(*desc));
  const dg_moe_act_desc identity = identity_of(*desc);
  ActProblem p;
  DG_RETURN_IF_ERROR(check_act_shape(identity, &p));
  *bytes = act_workspace_bytes(identity);
  return DG_SUCCESS;
}

extern "C" dg_status dg_moe_permute(const dg_moe_permute_desc* desc, cudaStream_t stream) {
  return check_and_launch_portable<ActProblem>("MoE permute", desc, lower_permute, launch_act, stream);
}

extern "C" dg_status dg_quantize_fp8_weight(const dg_quantize_weight_desc* desc, cudaStream_t stream) {
  return check_and_launch_portable<WeightProblem>("FP8 weight quantization", desc, lower_weight, launch_weight_quantize,
                                                  stream);
}

extern "C" dg_status dg_moe_combine(const dg_moe_combine_desc* desc, cudaStream_t stream) {
  return check_and_launch_portable<CombineProblem>("MoE combine", desc, lower_combine, launch_combine, stream);
}

extern "C" dg_status dg_moe_combine_backward(const dg_moe_combine_backward_desc* desc, cudaStream_t stream) {
  return check_and_launch_portable<CombineProblem>("MoE combine backward", desc, lower_combine_backward,
                                                   launch_combine_backward, stream);
}

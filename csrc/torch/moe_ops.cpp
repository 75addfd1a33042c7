// distgemm::moe_act (and its gather, dg_moe_permute), distgemm::quantize_fp8_weight(_rows),
// distgemm::moe_combine and distgemm::moe_combine_backward: tensors -> C API descriptors.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstring>
#include <tuple>

#include "torch/marshal.h"

namespace distgemm::torch_binding {
namespace {

int64_t blocks_of(int64_t n) { return (n + 127) / 128; }

// The outputs dg_moe_activation and dg_moe_permute write for `tokens` rows of y_cols columns,
// as quantize_fp8 returns them: y_scale (T, ceil(Y/128)) with strides (1, T), yt_scale (Y, Tp/128)
// with strides (1, Y); a form not asked for is an empty tensor (its descriptor field NULL).
struct ActOutputs {
  at::Tensor y, y8, sy, yt8, syt;

  template <class Desc>
  ActOutputs(Desc* desc, const at::TensorOptions& x_options, int64_t tokens, int64_t y_cols, const at::Tensor& offs,
             bool want_y, bool want_fp8, bool want_t, at::ScalarType fp8_dtype) {
    const auto f8 = x_options.dtype(fp8_dtype), f32 = x_options.dtype(at::kFloat);
    desc->fp8_dtype = to_dg_dtype(fp8_dtype, "fp8_dtype");
    y = want_y ? at::empty({tokens, y_cols}, x_options) : at::empty({0}, x_options);
    y8 = want_fp8 ? at::empty({tokens, y_cols}, f8) : at::empty({0}, f8);
    sy = want_fp8 ? at::empty_strided({tokens, blocks_of(y_cols)}, {1, tokens}, f32) : at::empty({0}, f32);
    desc->y = want_y ? y.data_ptr() : nullptr;
    desc->y_fp8 = want_fp8 ? y8.data_ptr() : nullptr;
    desc->y_scale = want_fp8 ? sy.data_ptr<float>() : nullptr;
    yt8 = at::empty({0}, f8);
    syt = at::empty({0}, f32);
    if (want_t) {
      desc->offs = offs.data_ptr<int32_t>();
      desc->num_groups = offs.numel();
      const int64_t row_blocks = blocks_of(tokens) + desc->num_groups;
      yt8 = at::empty({y_cols, 128 * row_blocks}, f8);
      syt = at::empty_strided({y_cols, row_blocks}, {1, y_cols}, f32);
      desc->yt_fp8 = yt8.data_ptr();
      desc->yt_scale = syt.data_ptr<float>();
    }
  }
};

// Asks `size` for the workspace desc needs, hands it one, and runs `run` on the current stream.
template <class Desc>
void run_with_workspace(Desc* desc, dg_status (*size)(const Desc*, size_t*),
                        dg_status (*run)(const Desc*, cudaStream_t), const at::Device& device, const char* op) {
  size_t bytes = 0;
  check(size(desc, &bytes), op);
  const at::Tensor ws = workspace(bytes, device);
  desc->workspace = bytes ? ws.data_ptr() : nullptr;
  desc->workspace_bytes = bytes;
  check(run(desc, current_stream()), op);
}

// x (T, C or 2C) bf16 [, dy (T, C)] -> (y, y_fp8, y_scale, yt_fp8, yt_scale) (see ActOutputs).
// With rows (int64 (R,), the identity only): the permute, row r of the outputs reading x row
// rows[r] (dg_moe_permute).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_act(
    const at::Tensor& x_in, const c10::optional<at::Tensor>& dy_in, int64_t act, int64_t inner,
    const c10::optional<at::Tensor>& offs_in, bool want_y, bool want_fp8, bool want_t, at::ScalarType fp8_dtype,
    const c10::optional<at::Tensor>& rows_in) {
  constexpr const char* kOp = "distgemm.moe_act";
  TORCH_CHECK_VALUE(act >= DG_MOE_IDENTITY && act <= DG_MOE_GELU_BACKWARD, kOp, ": act must be 0..4, got ", act);
  TORCH_CHECK_VALUE(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, kOp,
                    ": x must be a 2-D bfloat16 tensor, got ", x_in.scalar_type(), " of shape ", x_in.sizes());
  const bool backward = act == DG_MOE_SWIGLU_BACKWARD || act == DG_MOE_GELU_BACKWARD;
  const bool swiglu = act == DG_MOE_SWIGLU || act == DG_MOE_SWIGLU_BACKWARD;
  TORCH_CHECK_VALUE(inner >= 0 && x_in.size(1) == (swiglu ? 2 * inner : inner), kOp, ": x must have ",
                    swiglu ? "2 * inner" : "inner", " columns (inner = ", inner, "), got ", x_in.size(1));
  TORCH_CHECK_VALUE(backward == dy_in.has_value(), kOp, ": dy is needed by (and only by) the backward activations");
  if (dy_in) {
    TORCH_CHECK_VALUE(dy_in->device() == x_in.device() && dy_in->scalar_type() == at::kBFloat16 && dy_in->dim() == 2 &&
                          dy_in->size(0) == x_in.size(0) && dy_in->size(1) == inner,
                      kOp, ": dy must be a bfloat16 (T, inner) = (", x_in.size(0), ", ", inner, ") tensor on ",
                      x_in.device(), ", got ", dy_in->scalar_type(), " ", dy_in->sizes(), " on ", dy_in->device());
  }
  if (rows_in) {
    TORCH_CHECK_VALUE(act == DG_MOE_IDENTITY, kOp, ": rows (a gather) applies to the identity only, got act ", act);
    TORCH_CHECK_VALUE(rows_in->device() == x_in.device() && rows_in->scalar_type() == at::kLong && rows_in->dim() == 1,
                      kOp, ": rows must be a 1-D int64 tensor on ", x_in.device(), ", got ", rows_in->scalar_type(),
                      " of shape ", rows_in->sizes(), " on ", rows_in->device());
  }
  TORCH_CHECK_VALUE(!want_t || offs_in.has_value(), kOp, ": the transposed copy needs offs");
  if (offs_in) {
    TORCH_CHECK_VALUE(offs_in->device() == x_in.device(), kOp, ": offs is on ", offs_in->device(), " but x is on ",
                      x_in.device());
    TORCH_CHECK_VALUE(offs_in->scalar_type() == at::kInt && offs_in->dim() == 1 && offs_in->numel() >= 1, kOp,
                      ": offs must be a 1-D int32 tensor of at least one group end, got ", offs_in->scalar_type(),
                      " of shape ", offs_in->sizes());
  }
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor offs = offs_in && want_t ? offs_in->contiguous() : at::Tensor();
  const int64_t y_cols = act == DG_MOE_SWIGLU_BACKWARD ? 2 * inner : inner;
  const int64_t out_rows = rows_in ? rows_in->numel() : x.size(0);
  if (!want_t && (out_rows == 0 || y_cols == 0)) {  // nothing to write (and no buffer to name)
    dg_moe_act_desc none{};
    ActOutputs out(&none, x.options(), out_rows, y_cols, offs, want_y, want_fp8, false, fp8_dtype);
    return {out.y, out.y8, out.sy, out.yt8, out.syt};
  }
  if (rows_in) {
    const at::Tensor rows = rows_in->contiguous();
    dg_moe_permute_desc desc{};
    desc.x = x.data_ptr();
    desc.x_rows = x.size(0);
    desc.rows = rows.data_ptr<int64_t>();
    desc.num_rows = rows.numel();
    desc.hidden = inner;
    ActOutputs out(&desc, x.options(), rows.numel(), y_cols, offs, want_y, want_fp8, want_t, fp8_dtype);
    run_with_workspace(&desc, dg_moe_permute_workspace_size, dg_moe_permute, x.device(), kOp);
    return {out.y, out.y8, out.sy, out.yt8, out.syt};
  }
  const at::Tensor dy = dy_in ? dy_in->contiguous() : at::Tensor();
  dg_moe_act_desc desc{};
  const int code = static_cast<int>(act);
  std::memcpy(&desc.act, &code, sizeof code);
  desc.x = x.data_ptr();
  desc.dy = dy.defined() ? dy.data_ptr() : nullptr;
  desc.tokens = x.size(0);
  desc.inner = inner;
  ActOutputs out(&desc, x.options(), x.size(0), y_cols, offs, want_y, want_fp8, want_t, fp8_dtype);
  run_with_workspace(&desc, dg_moe_activation_workspace_size, dg_moe_activation, x.device(), kOp);
  return {out.y, out.y8, out.sy, out.yt8, out.syt};
}

// A wanted output's address for the C API, which reads NULL as "not wanted": one without
// elements has no storage (a NULL data pointer), so it gets a stand-in for its zero bytes (its
// scales may still have rows to write: a weight with no columns has a scale of 1 per row).
void* wanted_output(const at::Tensor& t) {
  static char no_bytes;
  return t.numel() > 0 ? t.data_ptr() : &no_bytes;
}

// The weight quantization desc of w (G, R, C) at `granularity`, its copies allocated where asked
// (empty otherwise); scale and scale_t are left to the caller.
struct WeightCopies {
  at::Tensor w, out, out_t;
  dg_quantize_weight_desc desc{};
};
WeightCopies weight_copies(const at::Tensor& w_in, at::ScalarType dtype, bool want_out, bool want_t,
                           dg_quant_granularity granularity, const char* op) {
  TORCH_CHECK_VALUE(w_in.dim() == 3, op, ": w must be 3-D (G, R, C), got shape ", w_in.sizes());
  WeightCopies c;
  c.w = w_in.contiguous();
  const int64_t g = c.w.size(0), r = c.w.size(1), cols = c.w.size(2);
  const auto f8 = c.w.options().dtype(dtype);
  c.out = want_out ? at::empty({g, r, cols}, f8) : at::empty({0}, f8);
  c.out_t = want_t ? at::empty({g, cols, r}, f8) : at::empty({0}, f8);
  dg_quantize_weight_desc& d = c.desc;
  d.w = c.w.data_ptr();
  d.w_dtype = to_dg_dtype(c.w.scalar_type(), "w");
  d.groups = g;
  d.rows = r;
  d.cols = cols;
  d.out_dtype = to_dg_dtype(dtype, "dtype");
  d.out = want_out ? wanted_output(c.out) : nullptr;
  d.out_t = want_t ? wanted_output(c.out_t) : nullptr;
  d.granularity = granularity;
  return c;
}

// w (G, R, C) -> (w_fp8 (G, R, C) or empty, w_fp8_t (G, C, R) or empty, scale (G, ceil(R/128), ceil(C/128))).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_fp8_weight(const at::Tensor& w_in, at::ScalarType dtype,
                                                                   bool want_out, bool want_t) {
  constexpr const char* kOp = "distgemm.quantize_fp8_weight";
  const c10::cuda::CUDAGuard guard(w_in.device());
  WeightCopies c = weight_copies(w_in, dtype, want_out, want_t, DG_QUANT_128X128, kOp);
  at::Tensor scale =
      at::empty({c.desc.groups, blocks_of(c.desc.rows), blocks_of(c.desc.cols)}, c.w.options().dtype(at::kFloat));
  c.desc.scale = scale.data_ptr<float>();
  check(dg_quantize_fp8_weight(&c.desc, current_stream()), kOp);
  return {c.out, c.out_t, scale};
}

// w (G, R, C) -> (w_fp8 (G, R, C), scale (G, R); w_fp8_t (G, C, R), scale_t (G, C)): one scale per
// row of each copy, each pair empty unless asked for.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_fp8_weight_rows(const at::Tensor& w_in,
                                                                                    at::ScalarType dtype, bool want_out,
                                                                                    bool want_t) {
  constexpr const char* kOp = "distgemm.quantize_fp8_weight_rows";
  const c10::cuda::CUDAGuard guard(w_in.device());
  WeightCopies c = weight_copies(w_in, dtype, want_out, want_t, DG_QUANT_ROW, kOp);
  const auto f32 = c.w.options().dtype(at::kFloat);
  at::Tensor scale = want_out ? at::empty({c.desc.groups, c.desc.rows}, f32) : at::empty({0}, f32);
  at::Tensor scale_t = want_t ? at::empty({c.desc.groups, c.desc.cols}, f32) : at::empty({0}, f32);
  c.desc.scale = want_out ? scale.data_ptr<float>() : nullptr;
  c.desc.scale_t = want_t ? scale_t.data_ptr<float>() : nullptr;
  check(dg_quantize_fp8_weight(&c.desc, current_stream()), kOp);
  return {c.out, scale, c.out_t, scale_t};
}

// The routing ops' common checks: a 2-D float tensor, int64 rows of tokens * k on its device, and
// FP32 weights of the same length (or none).
void check_routing_args(const char* op, const char* name, const at::Tensor& t, const at::Tensor& rows,
                        const c10::optional<at::Tensor>& weights, int64_t tokens, int64_t k) {
  TORCH_CHECK_VALUE(t.dim() == 2, op, ": ", name, " must be 2-D, got shape ", t.sizes());
  TORCH_CHECK_VALUE(k >= 1 && tokens >= 0, op, ": tokens must be >= 0 and k >= 1, got ", tokens, " and ", k);
  TORCH_CHECK_VALUE(
      rows.device() == t.device() && rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.numel() == tokens * k,
      op, ": rows must be a 1-D int64 tensor of tokens * k = ", tokens * k, " on ", t.device(), ", got ",
      rows.scalar_type(), " of shape ", rows.sizes(), " on ", rows.device());
  if (weights) {
    TORCH_CHECK_VALUE(
        weights->device() == t.device() && weights->scalar_type() == at::kFloat && weights->numel() == tokens * k, op,
        ": weights must be a float32 tensor of tokens * k = ", tokens * k, " values on ", t.device(), ", got ",
        weights->scalar_type(), " of ", weights->numel(), " on ", weights->device());
  }
}

// The routing fields both descriptors share.
template <class Desc>
void set_routing(Desc* desc, const at::Tensor& rows, const at::Tensor& w, int64_t tokens, int64_t k, int64_t hidden) {
  desc->rows = rows.data_ptr<int64_t>();
  desc->weights = w.defined() ? w.data_ptr<float>() : nullptr;
  desc->tokens = tokens;
  desc->k = k;
  desc->hidden = hidden;
}

// out[t] = sum_j weights[t, j] * y[rows[t, j]] (rows < 0 skipped), FP32, in y's dtype.
at::Tensor moe_combine(const at::Tensor& y_in, const at::Tensor& rows_in, const c10::optional<at::Tensor>& w_in,
                       int64_t tokens, int64_t k) {
  constexpr const char* kOp = "distgemm.moe_combine";
  check_routing_args(kOp, "y", y_in, rows_in, w_in, tokens, k);
  const c10::cuda::CUDAGuard guard(y_in.device());
  const at::Tensor y = y_in.contiguous(), rows = rows_in.contiguous();
  const at::Tensor w = w_in ? w_in->contiguous() : at::Tensor();
  at::Tensor out = at::empty({tokens, y.size(1)}, y.options());
  dg_moe_combine_desc desc{};
  desc.y = y.data_ptr();
  desc.dtype = to_dg_dtype(y.scalar_type(), "y");
  desc.num_rows = y.size(0);
  set_routing(&desc, rows, w, tokens, k, y.size(1));
  desc.out = out.data_ptr();
  check(dg_moe_combine(&desc, current_stream()), kOp);
  return out;
}

// (dy_rows (num_rows, H) in dy's dtype, dweights (tokens * k) FP32 or empty): the combine's backward.
std::tuple<at::Tensor, at::Tensor> moe_combine_backward(const at::Tensor& dy_in, const c10::optional<at::Tensor>& y_in,
                                                        const at::Tensor& rows_in,
                                                        const c10::optional<at::Tensor>& w_in, int64_t num_rows,
                                                        int64_t tokens, int64_t k, bool want_dweights) {
  constexpr const char* kOp = "distgemm.moe_combine_backward";
  check_routing_args(kOp, "dy", dy_in, rows_in, w_in, tokens, k);
  TORCH_CHECK_VALUE(dy_in.size(0) == tokens, kOp, ": dy must have tokens = ", tokens, " rows, got ", dy_in.size(0));
  TORCH_CHECK_VALUE(!want_dweights || y_in.has_value(), kOp, ": dweights need y");
  if (y_in) {
    TORCH_CHECK_VALUE(y_in->device() == dy_in.device() && y_in->scalar_type() == dy_in.scalar_type() &&
                          y_in->dim() == 2 && y_in->size(0) == num_rows && y_in->size(1) == dy_in.size(1),
                      kOp, ": y must be a (", num_rows, ", ", dy_in.size(1), ") ", dy_in.scalar_type(), " tensor on ",
                      dy_in.device(), ", got ", y_in->scalar_type(), " ", y_in->sizes(), " on ", y_in->device());
  }
  const c10::cuda::CUDAGuard guard(dy_in.device());
  const at::Tensor dy = dy_in.contiguous(), rows = rows_in.contiguous();
  const at::Tensor y = want_dweights ? y_in->contiguous() : at::Tensor();
  const at::Tensor w = w_in ? w_in->contiguous() : at::Tensor();
  // Every row is written when rows names each once (permute's row map: a dropped copy's row gets
  // zeros); rows no slot names are unspecified (a malformed row map, moe.unpermute's contract).
  at::Tensor dy_rows = at::empty({num_rows, dy.size(1)}, dy.options());
  at::Tensor dweights = want_dweights ? at::empty({tokens * k}, dy.options().dtype(at::kFloat))
                                      : at::empty({0}, dy.options().dtype(at::kFloat));
  dg_moe_combine_backward_desc desc{};
  desc.dy = dy.data_ptr();
  desc.y = y.defined() ? y.data_ptr() : nullptr;
  desc.dtype = to_dg_dtype(dy.scalar_type(), "dy");
  desc.num_rows = num_rows;
  set_routing(&desc, rows, w, tokens, k, dy.size(1));
  desc.dy_rows = dy_rows.data_ptr();
  desc.dweights = want_dweights ? dweights.data_ptr<float>() : nullptr;
  check(dg_moe_combine_backward(&desc, current_stream()), kOp);
  return {dy_rows, dweights};
}

}  // namespace
}  // namespace distgemm::torch_binding

TORCH_LIBRARY_FRAGMENT(distgemm, m) {
  // act: 0 identity, 1 SwiGLU, 2 GELU, 3 SwiGLU backward, 4 GELU backward (dg_moe_act); see
  // distgemm/moe.py.
  m.def(
      "moe_act(Tensor x, Tensor? dy, int act, int inner, Tensor? offs, bool want_y, bool want_fp8, "
      "bool want_t, ScalarType fp8_dtype, Tensor? rows=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("quantize_fp8_weight(Tensor w, ScalarType dtype, bool want_out, bool want_t) -> (Tensor, Tensor, Tensor)");
  m.def(
      "quantize_fp8_weight_rows(Tensor w, ScalarType dtype, bool want_out, bool want_t) -> (Tensor, Tensor, Tensor, "
      "Tensor)");
  // The MoE combine (distgemm/moe.py's unpermute, and permute's backward) and its backward.
  m.def("moe_combine(Tensor y, Tensor rows, Tensor? weights, int tokens, int k) -> Tensor");
  m.def(
      "moe_combine_backward(Tensor dy, Tensor? y, Tensor rows, Tensor? weights, int num_rows, int tokens, int k, "
      "bool want_dweights) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(distgemm, CUDA, m) {
  m.impl("moe_act", &distgemm::torch_binding::moe_act);
  m.impl("quantize_fp8_weight", &distgemm::torch_binding::quantize_fp8_weight);
  m.impl("quantize_fp8_weight_rows", &distgemm::torch_binding::quantize_fp8_weight_rows);
  m.impl("moe_combine", &distgemm::torch_binding::moe_combine);
  m.impl("moe_combine_backward", &distgemm::torch_binding::moe_combine_backward);
}

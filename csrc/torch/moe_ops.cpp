// distgemm::moe_act and distgemm::quantize_fp8_weight: tensors -> C API descriptors.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstring>
#include <tuple>

#include "torch/marshal.h"

namespace distgemm::torch_binding {
namespace {

int64_t blocks_of(int64_t n) { return (n + 127) / 128; }

// x (T, C or 2C) bf16 [, dy (T, C)] -> (y, y_fp8, y_scale, yt_fp8, yt_scale); a form not asked
// for comes back as an empty tensor. Scales as quantize_fp8 returns them: y_scale (T, ceil(Y/128))
// with strides (1, T), yt_scale (Y, Tp/128) with strides (1, Y).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_act(
    const at::Tensor& x_in, const c10::optional<at::Tensor>& dy_in, int64_t act, int64_t inner,
    const c10::optional<at::Tensor>& offs_in, bool want_y, bool want_fp8, bool want_t, at::ScalarType fp8_dtype) {
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
  const at::Tensor dy = dy_in ? dy_in->contiguous() : at::Tensor();
  const at::Tensor offs = offs_in && want_t ? offs_in->contiguous() : at::Tensor();
  const int64_t tokens = x.size(0);
  const int64_t y_cols = act == DG_MOE_SWIGLU_BACKWARD ? 2 * inner : inner;
  const auto none = x.options().dtype(at::kFloat);

  dg_moe_act_desc desc{};
  const int code = static_cast<int>(act);
  std::memcpy(&desc.act, &code, sizeof code);
  desc.x = x.data_ptr();
  desc.dy = dy.defined() ? dy.data_ptr() : nullptr;
  desc.tokens = tokens;
  desc.inner = inner;
  desc.fp8_dtype = to_dg_dtype(fp8_dtype, "fp8_dtype");
  at::Tensor y = at::empty({0}, x.options()), y8 = at::empty({0}, x.options().dtype(fp8_dtype)),
             sy = at::empty({0}, none);
  at::Tensor yt8 = at::empty({0}, x.options().dtype(fp8_dtype)), syt = at::empty({0}, none);
  if (want_y) {
    y = at::empty({tokens, y_cols}, x.options());
    desc.y = y.data_ptr();
  }
  if (want_fp8) {
    y8 = at::empty({tokens, y_cols}, x.options().dtype(fp8_dtype));
    sy = at::empty_strided({tokens, blocks_of(y_cols)}, {1, tokens}, none);
    desc.y_fp8 = y8.data_ptr();
    desc.y_scale = sy.data_ptr<float>();
  }
  if (want_t) {
    desc.offs = offs.data_ptr<int32_t>();
    desc.num_groups = offs.numel();
    const int64_t row_blocks = blocks_of(tokens) + desc.num_groups;
    yt8 = at::empty({y_cols, 128 * row_blocks}, x.options().dtype(fp8_dtype));
    syt = at::empty_strided({y_cols, row_blocks}, {1, y_cols}, none);
    desc.yt_fp8 = yt8.data_ptr();
    desc.yt_scale = syt.data_ptr<float>();
  }
  size_t bytes = 0;
  check(dg_moe_activation_workspace_size(&desc, &bytes), kOp);
  at::Tensor ws = workspace(bytes, x.device());
  desc.workspace = bytes ? ws.data_ptr() : nullptr;
  desc.workspace_bytes = bytes;
  check(dg_moe_activation(&desc, current_stream()), kOp);
  return {y, y8, sy, yt8, syt};
}

// w (G, R, C) -> (w_fp8 (G, R, C) or empty, w_fp8_t (G, C, R) or empty, scale (G, ceil(R/128), ceil(C/128))).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_fp8_weight(const at::Tensor& w_in, at::ScalarType dtype,
                                                                   bool want_out, bool want_t) {
  constexpr const char* kOp = "distgemm.quantize_fp8_weight";
  TORCH_CHECK_VALUE(w_in.dim() == 3, kOp, ": w must be 3-D (G, R, C), got shape ", w_in.sizes());
  const c10::cuda::CUDAGuard guard(w_in.device());
  const at::Tensor w = w_in.contiguous();
  const int64_t g = w.size(0), r = w.size(1), c = w.size(2);
  dg_quantize_weight_desc desc{};
  desc.w = w.data_ptr();
  desc.w_dtype = to_dg_dtype(w.scalar_type(), "w");
  desc.groups = g;
  desc.rows = r;
  desc.cols = c;
  desc.out_dtype = to_dg_dtype(dtype, "dtype");
  const auto f8 = w.options().dtype(dtype);
  at::Tensor out = want_out ? at::empty({g, r, c}, f8) : at::empty({0}, f8);
  at::Tensor out_t = want_t ? at::empty({g, c, r}, f8) : at::empty({0}, f8);
  at::Tensor scale = at::empty({g, blocks_of(r), blocks_of(c)}, w.options().dtype(at::kFloat));
  desc.out = want_out ? out.data_ptr() : nullptr;
  desc.out_t = want_t ? out_t.data_ptr() : nullptr;
  desc.scale = scale.data_ptr<float>();
  check(dg_quantize_fp8_weight(&desc, current_stream()), kOp);
  return {out, out_t, scale};
}

}  // namespace
}  // namespace distgemm::torch_binding

TORCH_LIBRARY_FRAGMENT(distgemm, m) {
  // act: 0 identity, 1 SwiGLU, 2 GELU, 3 SwiGLU backward, 4 GELU backward (dg_moe_act); see
  // distgemm/moe.py.
  m.def(
      "moe_act(Tensor x, Tensor? dy, int act, int inner, Tensor? offs, bool want_y, bool want_fp8, "
      "bool want_t, ScalarType fp8_dtype) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("quantize_fp8_weight(Tensor w, ScalarType dtype, bool want_out, bool want_t) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(distgemm, CUDA, m) {
  m.impl("moe_act", &distgemm::torch_binding::moe_act);
  m.impl("quantize_fp8_weight", &distgemm::torch_binding::quantize_fp8_weight);
}

// distgemm::quantize_fp8: tensors -> dg_quantize_desc -> dg_quantize_fp8.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstring>
#include <tuple>

#include "torch/marshal.h"

namespace distgemm::torch_binding {
namespace {

constexpr const char* kOp = "distgemm.quantize_fp8";

// x (R, C), or (B, R, C) with 128 x 128 blocks -> (FP8 data, float32 scales) in the layouts of
// distgemm.h. Checked here only what the desc cannot carry: x's rank, the granularity code as a
// C enum value, and offs as a flat int32 array on x's device; the core checks the rest.
std::tuple<at::Tensor, at::Tensor> quantize_fp8(const at::Tensor& x_in, int64_t granularity, at::ScalarType dtype,
                                                bool transpose, const c10::optional<at::Tensor>& offs) {
  TORCH_CHECK_VALUE(granularity >= DG_QUANT_TENSOR && granularity <= DG_QUANT_128X128, kOp,
                    ": granularity must be 0 (tensor), 1 (row), 2 (1 x 128) or 3 (128 x 128), got ", granularity);
  TORCH_CHECK_VALUE(x_in.dim() == 2 || (x_in.dim() == 3 && granularity == DG_QUANT_128X128), kOp,
                    ": x must be 2-D (R, C), or 3-D (B, R, C) with 128 x 128 blocks, got shape ", x_in.sizes());
  if (offs) {
    TORCH_CHECK_VALUE(offs->device() == x_in.device(), kOp, ": offs is on ", offs->device(), " but x is on ",
                      x_in.device());
    TORCH_CHECK_VALUE(offs->scalar_type() == at::kInt && offs->dim() == 1 && offs->numel() >= 1, kOp,
                      ": offs must be a 1-D int32 tensor of at least one group end, got ", offs->scalar_type(),
                      " of shape ", offs->sizes());
  }
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor ends = offs ? offs->contiguous() : at::Tensor();

  dg_quantize_desc desc{};
  desc.x = x.data_ptr();
  desc.x_dtype = to_dg_dtype(x.scalar_type(), "x");
  desc.batch = x.dim() == 3 ? x.size(0) : 1;
  desc.rows = x.size(-2);
  desc.cols = x.size(-1);
  const int code = static_cast<int>(granularity);
  std::memcpy(&desc.granularity, &code, sizeof code);
  desc.transpose = transpose;
  desc.offs = offs ? ends.data_ptr<int32_t>() : nullptr;
  desc.num_groups = offs ? ends.numel() : 0;
  desc.out_dtype = to_dg_dtype(dtype, "dtype");
  dg_quantize_sizes sizes{};
  check(dg_quantize_fp8_sizes(&desc, &sizes), kOp);

  at::Tensor data = x.dim() == 3 ? at::empty({desc.batch, sizes.data_rows, sizes.data_cols}, x.options().dtype(dtype))
                                 : at::empty({sizes.data_rows, sizes.data_cols}, x.options().dtype(dtype));
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor scale;
  switch (granularity) {
    case DG_QUANT_TENSOR:
      scale = at::empty({}, f32);
      break;
    case DG_QUANT_ROW:
      scale = at::empty({sizes.scale_rows}, f32);
      break;
    case DG_QUANT_1X128:  // stored (blocks, n), returned as its transpose: (n, blocks), strides (1, n)
      scale = at::empty_strided({sizes.scale_cols, sizes.scale_rows}, {1, sizes.scale_cols}, f32);
      break;
    default:
      scale = x.dim() == 3 ? at::empty({desc.batch, sizes.scale_rows, sizes.scale_cols}, f32)
                           : at::empty({sizes.scale_rows, sizes.scale_cols}, f32);
  }
  at::Tensor ws = workspace(sizes.workspace_bytes, x.device());
  desc.out = data.data_ptr();
  desc.scale = scale.data_ptr<float>();
  desc.workspace = sizes.workspace_bytes ? ws.data_ptr() : nullptr;
  desc.workspace_bytes = sizes.workspace_bytes;
  check(dg_quantize_fp8(&desc, current_stream()), kOp);
  return {data, scale};
}

}  // namespace
}  // namespace distgemm::torch_binding

TORCH_LIBRARY_FRAGMENT(distgemm, m) {
  // granularity: 0 tensor, 1 row, 2 1 x 128, 3 128 x 128 (dg_quant_granularity); see
  // distgemm/quantize.py.
  m.def(
      "quantize_fp8(Tensor x, int granularity, ScalarType dtype, bool transpose=False, "
      "Tensor? offs=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(distgemm, CUDA, m) { m.impl("quantize_fp8", &distgemm::torch_binding::quantize_fp8); }

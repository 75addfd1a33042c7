// distgemm grouped GEMM ops: tensors -> dg_grouped_desc -> dg_grouped_gemm (CUTLASS) or
// dg_grouped_gemm_cublas (multi-stream cuBLAS, which reads the offsets on the host).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <utility>

#include "torch/marshal.h"

namespace distgemm::torch_binding {
namespace {

enum Backend : int64_t { kCutlass = 0, kCublas = 1 };

// t's sizes as the C API takes them (its ndim, and at most 3 sizes: the core refuses the rest).
dg_grouped_shape shape_of(const at::Tensor& t) {
  dg_grouped_shape s{};
  s.ndim = static_cast<int>(t.dim());
  for (int i = 0; i < s.ndim && i < 3; ++i) s.size[i] = t.size(i);
  return s;
}

// FP8 scales as the desc carries them: float32 on a's device, the shape, and (for x's 1 x 128
// scales, (T, Kb) with T the unit stride) the stride between K blocks.
struct Scales {
  dg_scale_mode mode = DG_SCALE_NONE;
  const at::Tensor* a = nullptr;
  const at::Tensor* b = nullptr;
};

void marshal_scales(const char* op, const Scales& s, const at::Tensor& a, dg_grouped_desc* desc) {
  if (s.mode == DG_SCALE_NONE) return;
  const std::pair<const at::Tensor*, const char*> scales[] = {{s.a, "scale_a"}, {s.b, "scale_b"}};
  for (const auto& [t, name] : scales) {
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t->scalar_type());
    TORCH_CHECK_VALUE(t->device() == a.device(), op, ": ", name, " is on ", t->device(), " but the inputs are on ",
                      a.device());
  }
  desc->scale_mode = s.mode;
  desc->scale_a = s.a->data_ptr<float>();
  desc->scale_b = s.b->data_ptr<float>();
  desc->scale_a_shape = shape_of(*s.a);
  desc->scale_b_shape = shape_of(*s.b);
  TORCH_CHECK_VALUE(s.b->is_contiguous(), op, ": scale_b must be contiguous");
  const bool strided_a = s.mode == DG_SCALE_BLOCK && desc->kind == DG_GROUPED_FORWARD;
  if (!strided_a) {
    TORCH_CHECK_VALUE(s.a->is_contiguous(), op, ": scale_a must be contiguous");
    return;
  }
  TORCH_CHECK_VALUE(s.a->dim() == 2 && (s.a->stride(0) == 1 || s.a->size(0) <= 1), op,
                    ": x's 1 x 128 scales must be (T, ceil(K / 128)) with unit stride along T "
                    "(PyTorch's BlockWise1x128 layout), got strides ",
                    s.a->strides());
  desc->scale_a_ld = s.a->size(1) > 1 ? s.a->stride(1) : std::max<int64_t>(s.a->size(0), 1);
}

// Marshals the tensors into a dg_grouped_desc and runs it; the core checks every shape.
// Checked here only what the desc cannot carry: devices, contiguity, offs as a flat int32
// array (a strided offs is copied: G values), and b's dtype (the desc holds a's: b has the
// same, or is e4m3 against an e5m2 a).
void run_grouped(dg_grouped_kind kind, const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs_in,
                 const at::Tensor& out, bool accumulate, int64_t backend, int64_t config, const Scales& scales = {}) {
  const at::Tensor offs = offs_in.contiguous();
  const bool wgrad = kind == DG_GROUPED_WGRAD;
  const char* op = wgrad ? "distgemm.grouped_mm_wgrad" : "distgemm.grouped_mm";
  const char* a_name = wgrad ? "dy" : "x";
  const char* b_name = wgrad ? "x" : "w";
  const std::pair<const at::Tensor*, const char*> args[] = {{&a, a_name}, {&b, b_name}, {&offs, "offs"}, {&out, "out"}};
  for (const auto& [t, name] : args) {
    TORCH_CHECK_VALUE(t->device() == a.device(), op, ": ", name, " is on ", t->device(), " but ", a_name, " is on ",
                      a.device());
    TORCH_CHECK_VALUE(t->is_contiguous(), op, ": ", name, " must be contiguous");
  }
  TORCH_CHECK_VALUE(offs.scalar_type() == at::kInt && offs.dim() == 1, op, ": offs must be a 1-D int32 tensor, got ",
                    offs.scalar_type(), " of shape ", offs.sizes());
  const at::ScalarType b_expected = a.scalar_type() == at::kFloat8_e5m2 ? at::kFloat8_e4m3fn : a.scalar_type();
  TORCH_CHECK_VALUE(b.scalar_type() == b_expected, op, ": ", b_name, " must be ", b_expected, " (", a_name, " is ",
                    a.scalar_type(), "), got ", b.scalar_type());
  const c10::cuda::CUDAGuard guard(a.device());
  dg_grouped_desc desc{};
  desc.kind = kind;
  desc.num_groups = offs.numel();
  desc.offs = offs.data_ptr<int32_t>();
  desc.a = a.data_ptr();
  desc.a_shape = shape_of(a);
  desc.b = b.data_ptr();
  desc.b_shape = shape_of(b);
  desc.out = out.data_ptr();
  desc.out_shape = shape_of(out);
  desc.in_dtype = to_dg_dtype(a.scalar_type(), a_name);
  desc.out_dtype = to_dg_dtype(out.scalar_type(), "out");
  desc.accumulate = accumulate;
  desc.config = to_int(config, op, "config");
  marshal_scales(op, scales, a, &desc);
  if (backend == kCublas) {
    const at::Tensor host_offs = offs.to(at::kCPU);  // the baseline's host sync
    check(dg_grouped_gemm_cublas(&desc, host_offs.data_ptr<int32_t>(), current_stream()), op);
    return;
  }
  size_t bytes = 0;
  check(dg_grouped_gemm_workspace_size(&desc, &bytes), op);
  at::Tensor ws = workspace(bytes, a.device());
  check(dg_grouped_gemm(&desc, ws.data_ptr(), bytes, current_stream()), op);
}

// x (T, K); w (G, N, K) when trans_w, else (G, K, N); out (T, N).
void grouped_mm_out(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs, const at::Tensor& out,
                    bool accumulate, bool trans_w, int64_t backend, int64_t config) {
  run_grouped(trans_w ? DG_GROUPED_FORWARD : DG_GROUPED_DGRAD, x, w, offs, out, accumulate, backend, config);
}

at::Tensor grouped_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs, at::ScalarType out_dtype,
                      bool trans_w, int64_t backend, int64_t config) {
  // The output's size needs x's rows and w's N; every other size is the core's to check.
  TORCH_CHECK_VALUE(x.dim() == 2 && w.dim() == 3, "distgemm.grouped_mm: x must be 2-D and w 3-D, got ", x.sizes(),
                    " and ", w.sizes());
  at::Tensor out = at::empty({x.size(0), trans_w ? w.size(1) : w.size(2)}, x.options().dtype(out_dtype));
  grouped_mm_out(x, w, offs, out, false, trans_w, backend, config);
  return out;
}

// dy (T, N), x (T, K); out (G, N, K) = per group dy_g^T @ x_g.
void grouped_mm_wgrad_out(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& offs, const at::Tensor& out,
                          bool accumulate, int64_t backend, int64_t config) {
  run_grouped(DG_GROUPED_WGRAD, dy, x, offs, out, accumulate, backend, config);
}

at::Tensor grouped_mm_wgrad(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& offs, at::ScalarType out_dtype,
                            int64_t backend, int64_t config) {
  // The output's size needs dy's and x's columns; every other size is the core's to check.
  TORCH_CHECK_VALUE(dy.dim() == 2 && x.dim() == 2, "distgemm.grouped_mm_wgrad: dy and x must be 2-D, got ", dy.sizes(),
                    " and ", x.sizes());
  at::Tensor out = at::empty({offs.numel(), dy.size(1), x.size(1)}, dy.options().dtype(out_dtype));
  grouped_mm_wgrad_out(dy, x, offs, out, false, backend, config);
  return out;
}

// FP8 (e4m3): x (T, K), w (G, N, K) K-major, scale_mode 1 (row) or 2 (block); out (T, N).
void grouped_mm_fp8_out(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs, const at::Tensor& scale_x,
                        const at::Tensor& scale_w, int64_t scale_mode, const at::Tensor& out, bool accumulate,
                        int64_t config) {
  run_grouped(DG_GROUPED_FORWARD, x, w, offs, out, accumulate, kCutlass, config,
              {to_enum<dg_scale_mode>(scale_mode, "distgemm.grouped_mm", "scale_mode"), &scale_x, &scale_w});
}

at::Tensor grouped_mm_fp8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs, const at::Tensor& scale_x,
                          const at::Tensor& scale_w, int64_t scale_mode, at::ScalarType out_dtype, int64_t config) {
  TORCH_CHECK_VALUE(x.dim() == 2 && w.dim() == 3, "distgemm.grouped_mm: x must be 2-D and w 3-D, got ", x.sizes(),
                    " and ", w.sizes());
  at::Tensor out = at::empty({x.size(0), w.size(1)}, x.options().dtype(out_dtype));
  grouped_mm_fp8_out(x, w, offs, scale_x, scale_w, scale_mode, out, false, config);
  return out;
}

// FP8 wgrad: dy_t (N, Tp), x_t (K, Tp) in quantize_fp8's padded per-group layout, their
// scales (Tp / 128, N) and (Tp / 128, K) contiguous; out (G, N, K) float32.
void grouped_mm_wgrad_fp8_out(const at::Tensor& dy_t, const at::Tensor& x_t, const at::Tensor& offs,
                              const at::Tensor& scale_dy, const at::Tensor& scale_x, const at::Tensor& out,
                              bool accumulate, int64_t config) {
  run_grouped(DG_GROUPED_WGRAD, dy_t, x_t, offs, out, accumulate, kCutlass, config,
              {DG_SCALE_BLOCK, &scale_dy, &scale_x});
}

std::vector<std::string> grouped_configs(int64_t kind, at::ScalarType in, at::ScalarType out, int64_t arch,
                                         int64_t scale_mode) {
  dg_grouped_desc d{};
  constexpr const char* kOp = "distgemm.grouped_configs";
  d.kind = to_enum<dg_grouped_kind>(kind, kOp, "kind");
  d.scale_mode = to_enum<dg_scale_mode>(scale_mode, kOp, "scale_mode");
  d.in_dtype = to_dg_dtype(in, "in");
  d.out_dtype = to_dg_dtype(out, "out");
  std::vector<std::string> names;
  const int device_arch = to_int(arch, kOp, "arch");
  const int count = dg_grouped_gemm_config_count(&d, device_arch);
  for (int i = 0; i < count; ++i) names.emplace_back(dg_grouped_gemm_config_name(&d, device_arch, i));
  return names;
}

}  // namespace
}  // namespace distgemm::torch_binding

TORCH_LIBRARY_FRAGMENT(distgemm, m) {
  m.def(
      "grouped_mm(Tensor x, Tensor w, Tensor offs, ScalarType out_dtype, bool trans_w, "
      "int backend=0, int config=-1) -> Tensor");
  m.def(
      "grouped_mm_out(Tensor x, Tensor w, Tensor offs, Tensor(a!) out, bool accumulate, "
      "bool trans_w, int backend=0, int config=-1) -> ()");
  m.def(
      "grouped_mm_wgrad(Tensor dy, Tensor x, Tensor offs, ScalarType out_dtype, "
      "int backend=0, int config=-1) -> Tensor");
  m.def(
      "grouped_mm_wgrad_out(Tensor dy, Tensor x, Tensor offs, Tensor(a!) out, bool accumulate, "
      "int backend=0, int config=-1) -> ()");
  m.def(
      "grouped_mm_fp8(Tensor x, Tensor w, Tensor offs, Tensor scale_x, Tensor scale_w, "
      "int scale_mode, ScalarType out_dtype, int config=-1) -> Tensor");
  m.def(
      "grouped_mm_fp8_out(Tensor x, Tensor w, Tensor offs, Tensor scale_x, Tensor scale_w, "
      "int scale_mode, Tensor(a!) out, bool accumulate, int config=-1) -> ()");
  m.def(
      "grouped_mm_wgrad_fp8_out(Tensor dy_t, Tensor x_t, Tensor offs, Tensor scale_dy, "
      "Tensor scale_x, Tensor(a!) out, bool accumulate, int config=-1) -> ()");
  m.def(
      "grouped_configs(int kind, ScalarType in_dtype, ScalarType out_dtype, int arch, "
      "int scale_mode=0) -> str[]",
      &distgemm::torch_binding::grouped_configs);
}

TORCH_LIBRARY_IMPL(distgemm, CUDA, m) {
  m.impl("grouped_mm", &distgemm::torch_binding::grouped_mm);
  m.impl("grouped_mm_out", &distgemm::torch_binding::grouped_mm_out);
  m.impl("grouped_mm_wgrad", &distgemm::torch_binding::grouped_mm_wgrad);
  m.impl("grouped_mm_wgrad_out", &distgemm::torch_binding::grouped_mm_wgrad_out);
  m.impl("grouped_mm_fp8", &distgemm::torch_binding::grouped_mm_fp8);
  m.impl("grouped_mm_fp8_out", &distgemm::torch_binding::grouped_mm_fp8_out);
  m.impl("grouped_mm_wgrad_fp8_out", &distgemm::torch_binding::grouped_mm_wgrad_fp8_out);
}

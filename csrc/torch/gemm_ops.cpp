// distgemm::gemm and its heuristics queries: tensors -> dg_gemm_desc -> dg_gemm.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "torch/marshal.h"

namespace distgemm::torch_binding {
namespace {

// TMA needs 16-byte aligned base addresses: a view at an odd offset is copied (same strides
// are not needed: the copy is contiguous, which the kernels read in place).
at::Tensor aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.contiguous().clone();
}

dg_gemm_desc make_desc(at::ScalarType a, at::ScalarType b, at::ScalarType out, bool b_k_major, bool fast_accum) {
  dg_gemm_desc d{};
  d.fast_accum = fast_accum;
  d.a = {nullptr, to_dg_dtype(a, "a"), 0, 0, 0, 1};
  d.b = {nullptr, to_dg_dtype(b, "b"), 0, 0, b_k_major ? 0 : 1, b_k_major ? 1 : 0};
  d.d = {nullptr, to_dg_dtype(out, "out_dtype"), 0, 0, 0, 1};
  d.config = -1;
  return d;
}

at::Tensor gemm_cuda(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& c, double alpha,
                     double beta, at::ScalarType out_dtype, const c10::optional<at::Tensor>& scale_a,
                     const c10::optional<at::Tensor>& scale_b, bool fast_accum, int64_t config, int64_t swizzle) {
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2, "distgemm.gemm: a and b must be 2-D");
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor out = at::empty({a.size(0), b.size(0)}, a.options().dtype(out_dtype));
  if (out.numel() == 0) return out;

  dg_gemm_desc desc = gemm_desc("distgemm.gemm", aligned16(a), aligned16(b),
                                c ? c10::optional<at::Tensor>(aligned16(*c)) : c10::nullopt, out, alpha, beta, scale_a,
                                scale_b, fast_accum);
  desc.config = to_int(config, "distgemm.gemm", "config");
  desc.swizzle = to_int(swizzle, "distgemm.gemm", "swizzle");

  size_t bytes = 0;
  check(dg_gemm_workspace_size(&desc, &bytes), "distgemm.gemm");
  at::Tensor ws = workspace(bytes, a.device());
  check(dg_gemm(&desc, bytes ? ws.data_ptr() : nullptr, bytes, current_stream()), "distgemm.gemm");
  return out;
}

std::vector<std::string> gemm_configs(at::ScalarType a, at::ScalarType b, at::ScalarType out, bool b_k_major,
                                      int64_t arch, bool fast_accum) {
  const dg_gemm_desc d = make_desc(a, b, out, b_k_major, fast_accum);
  std::vector<std::string> names;
  const int device_arch = to_int(arch, "distgemm.gemm_configs", "arch");
  const int count = dg_gemm_config_count(&d, device_arch);
  for (int i = 0; i < count; ++i) names.emplace_back(dg_gemm_config_name(&d, device_arch, i));
  return names;
}

int64_t gemm_select_config(int64_t m, int64_t n, int64_t k, at::ScalarType a, at::ScalarType b, at::ScalarType out,
                           bool b_k_major, int64_t arch, int64_t sm_count, bool fast_accum) {
  dg_gemm_desc d = make_desc(a, b, out, b_k_major, fast_accum);
  // Shapes only: aligned dummy pointers and packed strides.
  alignas(16) static const char dummy[16] = {};
  d.a = {dummy, d.a.dtype, m, k, k, 1};
  d.b = b_k_major ? dg_matrix{dummy, d.b.dtype, n, k, k, 1} : dg_matrix{dummy, d.b.dtype, n, k, 1, n};
  d.d = {dummy, d.d.dtype, m, n, n, 1};
  return dg_gemm_select_config(&d, to_int(arch, "distgemm.gemm_select_config", "arch"),
                               to_int(sm_count, "distgemm.gemm_select_config", "sm_count"));
}

}  // namespace
}  // namespace distgemm::torch_binding

TORCH_LIBRARY_FRAGMENT(distgemm, m) {
  // alpha * (scale_a * scale_b * (a @ b.T)) + beta * c; see distgemm/gemm.py.
  m.def(
      "gemm(Tensor a, Tensor b, Tensor? c, float alpha, float beta, ScalarType out_dtype, "
      "Tensor? scale_a, Tensor? scale_b, bool fast_accum=False, int config=-1, int swizzle=0) -> Tensor");
  // Host-side heuristics, for tests and the tuning sweep (no device needed).
  m.def(
      "gemm_configs(ScalarType a, ScalarType b, ScalarType out, bool b_k_major, int arch, "
      "bool fast_accum=False) -> str[]",
      &distgemm::torch_binding::gemm_configs);
  m.def(
      "gemm_select_config(int m, int n, int k, ScalarType a, ScalarType b, ScalarType out, "
      "bool b_k_major, int arch, int sm_count, bool fast_accum=False) -> int",
      &distgemm::torch_binding::gemm_select_config);
}

TORCH_LIBRARY_IMPL(distgemm, CUDA, m) { m.impl("gemm", &distgemm::torch_binding::gemm_cuda); }

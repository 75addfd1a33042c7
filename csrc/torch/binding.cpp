// The distgemm torch library: op schemas, and the marshalling helpers they share.
#include <torch/library.h>

#include <climits>

#include "torch/marshal.h"
#include "distgemm_build_id.h"

namespace distgemm::torch_binding {

dg_dtype to_dg_dtype(at::ScalarType t, const char* arg) {
  switch (t) {
    case at::kFloat:
      return DG_F32;
    case at::kHalf:
      return DG_F16;
    case at::kBFloat16:
      return DG_BF16;
    case at::kFloat8_e4m3fn:
      return DG_E4M3;
    case at::kFloat8_e5m2:
      return DG_E5M2;
    case at::kInt:
      return DG_I32;
    default:
      break;
  }
  TORCH_CHECK_VALUE(false, arg, " has unsupported dtype ", t);
}

int to_int(int64_t value, const char* op, const char* arg) {
  TORCH_CHECK_VALUE(value >= INT_MIN && value <= INT_MAX, op, ": ", arg, " must fit in a 32-bit int, got ", value);
  return static_cast<int>(value);
}

dg_matrix to_matrix(const at::Tensor& t, const char* arg) {
  if (!t.defined()) return dg_matrix{nullptr, DG_F32, 0, 0, 0, 0};
  TORCH_CHECK_VALUE(t.dim() == 1 || t.dim() == 2, arg, " must be 1-D or 2-D, got ", t.dim(), "-D");
  if (t.dim() == 1)
    return dg_matrix{t.data_ptr(), to_dg_dtype(t.scalar_type(), arg), 1, t.size(0), t.size(0), t.stride(0)};
  return dg_matrix{t.data_ptr(), to_dg_dtype(t.scalar_type(), arg), t.size(0), t.size(1), t.stride(0), t.stride(1)};
}

namespace {

void require_same_device(const char* op, const at::Tensor& t, const at::Tensor& ref, const char* arg) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), op, ": ", arg, " is on ", t.device(), " but a is on ", ref.device());
}

}  // namespace

void set_scale(const char* op, const c10::optional<at::Tensor>& scale, const at::Tensor& a, const char* arg,
               const float** ptr, int64_t* len) {
  if (!scale) return;
  require_same_device(op, *scale, a, arg);
  TORCH_CHECK_VALUE(scale->scalar_type() == at::kFloat && scale->is_contiguous(), op, ": ", arg,
                    " must be a contiguous float32 tensor, got ", scale->scalar_type());
  *ptr = scale->data_ptr<float>();
  *len = scale->numel();
}

dg_gemm_desc gemm_desc(const char* op, const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& c,
                       const at::Tensor& out, double alpha, double beta, const c10::optional<at::Tensor>& scale_a,
                       const c10::optional<at::Tensor>& scale_b, bool fast_accum) {
  require_same_device(op, b, a, "b");
  dg_gemm_desc desc{};
  desc.a = to_matrix(a, "a");
  desc.b = to_matrix(b, "b");
  if (c) {
    require_same_device(op, *c, a, "c");
    desc.c = to_matrix(*c, "c");
  }
  desc.d = to_matrix(out, "out");
  desc.alpha = static_cast<float>(alpha);
  desc.beta = static_cast<float>(beta);
  set_scale(op, scale_a, a, "scale_a", &desc.scale_a, &desc.scale_a_len);
  set_scale(op, scale_b, a, "scale_b", &desc.scale_b, &desc.scale_b_len);
  desc.fast_accum = fast_accum;
  desc.config = -1;
  return desc;
}

void check(dg_status status, const char* op) {
  if (status == DG_SUCCESS) return;
  const std::string msg = std::string(op) + ": " + dg_last_error();
  switch (status) {
    case DG_ERROR_INVALID_ARGUMENT:
    case DG_ERROR_PEER_MISMATCH:
      TORCH_CHECK_VALUE(false, msg);
    case DG_ERROR_NOT_SUPPORTED:
      TORCH_CHECK_NOT_IMPLEMENTED(false, msg);
    default:
      TORCH_CHECK(false, msg, " (", dg_status_name(status), ")");
  }
}

at::Tensor workspace(size_t bytes, const at::Device& device) {
  return at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).device(device));
}

}  // namespace distgemm::torch_binding

namespace {
// The build ids of this binding and of the core library it loaded: the Python package checks
// both against its own at import.
std::vector<std::string> build_ids() { return {DISTGEMM_BUILD_ID, dg_build_id()}; }
}  // namespace

// Each op file adds its schemas with TORCH_LIBRARY_FRAGMENT(distgemm, m).
TORCH_LIBRARY(distgemm, m) { m.def("build_ids() -> str[]", &build_ids); }

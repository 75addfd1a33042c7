// distgemm tensor-parallel ops: tensors + the ranks' mapped workspace addresses -> dg_tp_desc.
// The workspaces themselves (symmetric memory, rendezvous, reuse) are managed in Python
// (distgemm/tp.py) through torch.distributed.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>
#include <string>

#include "torch/marshal.h"
#include "tp/tp_settings.h"

namespace distgemm::torch_binding {
namespace {

dg_tp_desc tp_desc(const dg_gemm_desc& gemm, int64_t rank, int64_t world, const std::vector<int64_t>& workspaces,
                   std::vector<void*>& storage, int64_t workspace_bytes, double timeout_s,
                   const std::vector<double>& settings, int agree_only) {
  // Checked before the narrowing casts below (int64 -> int, int64 -> size_t, double -> int).
  TORCH_CHECK_VALUE(world >= 1 && world <= INT_MAX, "distgemm: world must be a positive group size, got ", world);
  TORCH_CHECK_VALUE(rank >= 0 && rank < world, "distgemm: rank ", rank, " is out of range for world size ", world);
  TORCH_CHECK_VALUE(workspace_bytes >= 0, "distgemm: workspace_bytes must be non-negative, got ", workspace_bytes);
  storage.clear();
  for (int64_t ptr : workspaces) storage.push_back(reinterpret_cast<void*>(ptr));
  TORCH_CHECK_VALUE(static_cast<int64_t>(storage.size()) == world,
                    "distgemm: one workspace address per rank expected, got ", storage.size());
  dg_tp_desc d{};
  d.gemm = gemm;
  d.rank = static_cast<int>(rank);
  d.world = static_cast<int>(world);
  d.peer_workspaces = storage.data();
  d.workspace_bytes = static_cast<size_t>(workspace_bytes);
  d.timeout_s = timeout_s;
  // settings: (algo, pieces, tapered, rs_split_gflops), as distgemm/tp.py reads them
  std::string why;
  TORCH_CHECK_VALUE(tp::settings_from_doubles(settings.data(), settings.size(), &d.settings, &why), "distgemm: ", why);
  d.agree_only = agree_only;
  return d;
}

std::tuple<at::Tensor, at::Tensor> tp_all_gather_gemm(
    const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& c, double alpha, double beta,
    at::ScalarType out_dtype, const c10::optional<at::Tensor>& scale_a, const c10::optional<at::Tensor>& scale_b,
    bool fast_accum, int64_t rank, int64_t world, const std::vector<int64_t>& workspaces, int64_t workspace_bytes,
    double timeout_s, bool return_gathered, const std::vector<double>& settings, bool agree_only) {
  const char* op = "distgemm.all_gather_matmul";
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2, op, ": a and b must be 2-D");
  TORCH_CHECK_VALUE(world >= 1 && world <= INT_MAX, op, ": world must be a positive group size, got ", world);
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor out = at::empty({a.size(0) * world, b.size(0)}, a.options().dtype(out_dtype));
  at::Tensor gathered =
      return_gathered ? at::empty({a.size(0) * world, a.size(1)}, a.options()) : at::empty({0}, a.options());
  std::vector<void*> storage;
  dg_tp_desc d = tp_desc(gemm_desc(op, a, b, c, out, alpha, beta, scale_a, scale_b, fast_accum), rank, world,
                         workspaces, storage, workspace_bytes, timeout_s, settings, agree_only);
  if (return_gathered) d.gathered_out = gathered.data_ptr();
  check(dg_all_gather_gemm(&d, current_stream()), op);
  return {out, gathered};
}

at::Tensor tp_gemm_reduce_scatter(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& bias,
                                  double alpha, double beta, at::ScalarType out_dtype,
                                  const c10::optional<at::Tensor>& scale_a, const c10::optional<at::Tensor>& scale_b,
                                  bool fast_accum, int64_t rank, int64_t world, const std::vector<int64_t>& workspaces,
                                  int64_t workspace_bytes, double timeout_s, const std::vector<double>& settings,
                                  bool agree_only) {
  const char* op = "distgemm.matmul_reduce_scatter";
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2, op, ": a and b must be 2-D");
  // Before the division below (world 0 would trap): tp_desc checks it again with the rank.
  TORCH_CHECK_VALUE(world >= 1 && world <= INT_MAX, op, ": world must be a positive group size, got ", world);
  TORCH_CHECK_VALUE(a.size(0) % world == 0, op, ": a's ", a.size(0), " rows must divide by the world size ", world);
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor out = at::empty({a.size(0) / world, b.size(0)}, a.options().dtype(out_dtype));
  std::vector<void*> storage;
  dg_tp_desc d = tp_desc(gemm_desc(op, a, b, bias, out, alpha, beta, scale_a, scale_b, fast_accum), rank, world,
                         workspaces, storage, workspace_bytes, timeout_s, settings, agree_only);
  check(dg_gemm_reduce_scatter(&d, current_stream()), op);
  return out;
}

// A rank whose call runs through the collectives fallback says so on the group's workspace
// (DG_TP_AGREE_ELSEWHERE); `a` is its operand as passed (read for its shape and dtype only),
// out (out_rows, n) of out_dtype is never allocated.
void tp_agree_elsewhere(int64_t kind, const at::Tensor& a, int64_t out_rows, int64_t n, at::ScalarType out_dtype,
                        const c10::optional<at::Tensor>& scale_a, int64_t rank, int64_t world,
                        const std::vector<int64_t>& workspaces, int64_t workspace_bytes, double timeout_s) {
  const bool all_gather = kind == DG_TP_ALL_GATHER_GEMM;
  const char* op = all_gather ? "distgemm.all_gather_matmul" : "distgemm.matmul_reduce_scatter";
  TORCH_CHECK_VALUE(all_gather || kind == DG_TP_GEMM_REDUCE_SCATTER, op, ": unknown tensor-parallel kind ", kind);
  TORCH_CHECK_VALUE(a.dim() == 2, op, ": a must be 2-D");
  const c10::cuda::CUDAGuard guard(a.device());
  dg_gemm_desc g{};
  g.a = to_matrix(a, "a");
  g.d = dg_matrix{nullptr, to_dg_dtype(out_dtype, "out_dtype"), out_rows, n, n, 1};
  set_scale(op, scale_a, a, "scale_a", &g.scale_a, &g.scale_a_len);  // its length is the scale mode
  std::vector<void*> storage;
  const dg_tp_desc d =
      tp_desc(g, rank, world, workspaces, storage, workspace_bytes, timeout_s, {0, 0, 0, 0}, DG_TP_AGREE_ELSEWHERE);
  check(all_gather ? dg_all_gather_gemm(&d, current_stream()) : dg_gemm_reduce_scatter(&d, current_stream()), op);
}

// Bytes of each rank's workspace: kind 1 all-gather (rows = this rank's shard rows),
// kind 2 reduce-scatter (rows = this rank's output rows).
int64_t tp_workspace_size(int64_t kind, int64_t rows, int64_t k, int64_t n, at::ScalarType in_dtype,
                          at::ScalarType out_dtype, int64_t world) {
  dg_tp_desc d{};
  constexpr const char* kOp = "distgemm.tp_workspace_size";
  d.world = to_int(world, kOp, "world");
  d.gemm.a = {nullptr, to_dg_dtype(in_dtype, "in_dtype"), rows, k, k, 1};
  d.gemm.d = {nullptr, to_dg_dtype(out_dtype, "out_dtype"), rows, n, n, 1};
  size_t bytes = 0;
  check(dg_tp_workspace_size(to_enum<dg_tp_kind>(kind, kOp, "kind"), &d, &bytes), kOp);
  return static_cast<int64_t>(bytes);
}

int64_t tp_error(int64_t device) { return dg_tp_error(to_int(device, "distgemm.tp_error", "device")); }

void tp_clear_error(int64_t device) {
  constexpr const char* kOp = "distgemm.tp_clear_error";
  check(dg_tp_clear_error(to_int(device, kOp, "device")), kOp);
}

}  // namespace
}  // namespace distgemm::torch_binding

TORCH_LIBRARY_FRAGMENT(distgemm, m) {
  m.def(
      "tp_all_gather_gemm(Tensor a, Tensor b, Tensor? c, float alpha, float beta, "
      "ScalarType out_dtype, Tensor? scale_a, Tensor? scale_b, bool fast_accum, int rank, "
      "int world, int[] workspaces, int workspace_bytes, float timeout_s, bool return_gathered, "
      "float[] settings, bool agree_only=False) -> (Tensor, Tensor)");
  m.def(
      "tp_gemm_reduce_scatter(Tensor a, Tensor b, Tensor? bias, float alpha, float beta, "
      "ScalarType out_dtype, Tensor? scale_a, Tensor? scale_b, bool fast_accum, int rank, "
      "int world, int[] workspaces, int workspace_bytes, float timeout_s, float[] settings, "
      "bool agree_only=False) -> Tensor");
  m.def(
      "tp_agree_elsewhere(int kind, Tensor a, int out_rows, int n, ScalarType out_dtype, Tensor? scale_a, "
      "int rank, int world, int[] workspaces, int workspace_bytes, float timeout_s) -> ()");
  m.def(
      "tp_workspace_size(int kind, int rows, int k, int n, ScalarType in_dtype, "
      "ScalarType out_dtype, int world) -> int",
      &distgemm::torch_binding::tp_workspace_size);
  m.def("tp_error(int device) -> int", &distgemm::torch_binding::tp_error);
  m.def("tp_clear_error(int device) -> ()", &distgemm::torch_binding::tp_clear_error);
}

TORCH_LIBRARY_IMPL(distgemm, CUDA, m) {
  m.impl("tp_all_gather_gemm", &distgemm::torch_binding::tp_all_gather_gemm);
  m.impl("tp_gemm_reduce_scatter", &distgemm::torch_binding::tp_gemm_reduce_scatter);
  m.impl("tp_agree_elsewhere", &distgemm::torch_binding::tp_agree_elsewhere);
}

// dg_gemm_desc -> cublasLtMatmul. Row-major D (M, N) is the column-major (N, M) matrix
// B @ A^T, so cuBLASLt's "A" is our B and its "B" our A (the usual TN GEMM).
#include "gemm/cublaslt_gemm.h"

#include <cublasLt.h>

#include <map>
#include <tuple>

#include "common/checked_math.h"
#include "common/device.h"
#include "common/dtype.h"
#include "common/per_device.h"
#include "common/status.h"

namespace distgemm::gemm {
namespace {

// The cuBLASLt handle of `device`, made on first use (common/per_device.h); nullptr (error
// recorded) if that failed.
cublasLtHandle_t lt_handle(int device) {
  static PerDevice<cublasLtHandle_t> handles;
  cublasLtHandle_t* h = handles.get(device, "the cuBLASLt handle", [](int d, cublasLtHandle_t* out) {
    const cublasStatus_t st = cublasLtCreate(out);
    if (st != CUBLAS_STATUS_SUCCESS)
      return fail(DG_ERROR_CUDA, cat("cublasLtCreate failed on device ", d, ": ",
                                     cublasLtGetStatusString(st)));
    return DG_SUCCESS;
  });
  return h ? *h : nullptr;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// A leading dimension of `ld` elements of `bytes` each is a non-negative multiple of 16 bytes
// (false where the caller's stride overflows, rather than wrapping).
bool pitch16(int64_t ld, int bytes) {
  int64_t pitch = 0;
  return ld >= 0 && checked_mul(ld, bytes, &pitch) && pitch % 16 == 0;
}

#define DG_LT_RETURN(expr)                                                                   \
  do {                                                                                       \
    cublasStatus_t dg_lt_ = (expr);                                                          \
    if (dg_lt_ != CUBLAS_STATUS_SUCCESS)                                                     \
      return fail(DG_ERROR_CUDA, cat(#expr, ": ", cublasLtGetStatusString(dg_lt_)));         \
  } while (0)

// Everything cuBLASLt's plan depends on; pointers only through their (checked) alignment.
using PlanKey = std::tuple<int, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int,
                           bool, bool, size_t>;

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool bias = false;
};

dg_status make_plan(cublasLtHandle_t handle, const PlanKey& key, size_t workspace_bytes, Plan* plan) {
  const auto [device, b_k_major, m, n, k, lda, ldb, ldc, ldd, in_type, out_type, with_c, bias, ws] = key;
  (void)device;
  (void)with_c;
  (void)ws;
  const cudaDataType_t in = static_cast<cudaDataType_t>(in_type), out = static_cast<cudaDataType_t>(out_type);
  DG_LT_RETURN(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans_a = b_k_major ? CUBLAS_OP_T : CUBLAS_OP_N, trans_b = CUBLAS_OP_N;
  DG_LT_RETURN(
      cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  DG_LT_RETURN(
      cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  if (bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    DG_LT_RETURN(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                                sizeof(epilogue)));
    DG_LT_RETURN(
        cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &out, sizeof(out)));
  }
  plan->bias = bias;
  // Our B (N, K) is cuBLASLt's A: stored (K, N) column-major if K-major, else (N, K).
  if (b_k_major)
    DG_LT_RETURN(cublasLtMatrixLayoutCreate(&plan->a, in, k, n, ldb));
  else
    DG_LT_RETURN(cublasLtMatrixLayoutCreate(&plan->a, in, n, k, ldb));
  DG_LT_RETURN(cublasLtMatrixLayoutCreate(&plan->b, in, k, m, lda));
  DG_LT_RETURN(cublasLtMatrixLayoutCreate(&plan->c, out, n, m, ldc));
  DG_LT_RETURN(cublasLtMatrixLayoutCreate(&plan->d, out, n, m, ldd));

  cublasLtMatmulPreference_t pref = nullptr;
  DG_LT_RETURN(cublasLtMatmulPreferenceCreate(&pref));
  const uint32_t align = 16;
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                           &workspace_bytes, sizeof(workspace_bytes));
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulAlgoGetHeuristic(handle, plan->op, plan->a, plan->b, plan->c, plan->d, pref, 1,
                                        &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  DG_LT_RETURN(st);
  if (found < 1)
    return fail(DG_ERROR_NOT_SUPPORTED, cat("cuBLASLt has no algorithm for M=", m, " N=", n, " K=", k));
  plan->algo = result.algo;
  return DG_SUCCESS;
}

}  // namespace

// A bias row goes through cuBLASLt's bias epilogue (which does not scale it). Over a one-row D
// it is the C operand instead (same values, and beta applies), unless that is taken by a
// chained partial sum.
bool is_bias(const dg_gemm_desc& d, bool chained) {
  return d.c.data && d.c.rows == 1 && (d.d.rows > 1 || chained);
}

const char* cublaslt_unsupported(const dg_gemm_desc& d, bool chained) {
  if (!is_16bit_float(d.a.dtype) || d.b.dtype != d.a.dtype) return "inputs other than bf16/fp16";
  if (d.scale_a || d.scale_b) return "scales";
  if (!(d.d.dtype == d.a.dtype || d.d.dtype == DG_F32))
    return "an output dtype other than the input's or fp32";
  if (is_bias(d, chained) && d.beta != 1.f && d.beta != 0.f) return "a bias scaled by beta other than 0 or 1";
  if (d.a.col_stride != 1 || d.d.col_stride != 1 || (d.c.data && !is_bias(d, chained) && d.c.col_stride != 1))
    return "a, c and out other than row-major";
  if (d.b.col_stride != 1 && d.b.row_stride != 1) return "b neither K- nor N-major";
  const int64_t ldb = d.b.col_stride == 1 ? d.b.row_stride : d.b.col_stride;
  const int in = dtype_bytes(d.a.dtype), out = dtype_bytes(d.d.dtype);
  if (!aligned16(d.a.data) || !aligned16(d.b.data) || !aligned16(d.d.data) ||
      (d.c.data && !aligned16(d.c.data)) || !pitch16(d.a.row_stride, in) || !pitch16(ldb, in) ||
      !pitch16(d.d.row_stride, out) || (d.c.data && !is_bias(d, chained) && !pitch16(d.c.row_stride, out)))
    return "pointers or leading dimensions not 16-byte aligned";
  return nullptr;
}

namespace {

// What one call passes to cublasLtMatmul besides A, B and D: the C operand and its beta.
struct Operands {
  const void* c = nullptr;
  int64_t ldc = 0;
  float beta = 0.f;
};

// The cached plan for `d` (made on first use), after the checks every call needs.
dg_status find_plan(const dg_gemm_desc& d, const void* chain_c, int64_t chain_ldc, size_t workspace_bytes,
                    cublasLtHandle_t* handle_out, Plan** plan_out, Operands* ops) {
  const bool chained = chain_c != nullptr;
  if (const char* why = cublaslt_unsupported(d, chained))
    return fail(DG_ERROR_NOT_SUPPORTED, cat("the cuBLASLt GEMM does not take ", why));
  const bool full_c = d.c.data && !is_bias(d, chained) && d.beta != 0.f;
  const bool bias = is_bias(d, chained) && d.beta != 0.f;
  DG_REQUIRE(!(chained && full_c), "a chained partial sum cannot be combined with a full C operand");
  DG_REQUIRE(!chained || (aligned16(chain_c) && pitch16(chain_ldc, dtype_bytes(d.d.dtype))),
             "the chained partial sums must be 16-byte aligned");
  const int device = current_device();
  cublasLtHandle_t handle = lt_handle(device);
  if (!handle) return DG_ERROR_CUDA;

  const bool b_k_major = d.b.col_stride == 1;
  const int64_t m = d.a.rows, n = d.b.rows, k = d.a.cols;
  ops->c = chained ? chain_c : full_c ? d.c.data : d.d.data;
  ops->ldc = chained ? chain_ldc : full_c ? d.c.row_stride : d.d.row_stride;
  ops->beta = chained ? 1.f : full_c ? d.beta : 0.f;
  const PlanKey key{device, b_k_major, m, n, k, d.a.row_stride,
                    b_k_major ? d.b.row_stride : d.b.col_stride, ops->ldc, d.d.row_stride,
                    static_cast<int>(cublas_float_type(d.a.dtype)),
                    static_cast<int>(cublas_float_type(d.d.dtype)), ops->beta != 0.f, bias, workspace_bytes};
  thread_local std::map<PlanKey, Plan> plans;
  auto it = plans.find(key);
  if (it == plans.end()) {
    Plan plan;
    DG_RETURN_IF_ERROR(make_plan(handle, key, workspace_bytes, &plan));
    it = plans.emplace(key, plan).first;
  }
  *handle_out = handle;
  *plan_out = &it->second;
  return DG_SUCCESS;
}

}  // namespace

dg_status plan_cublaslt_gemm(const dg_gemm_desc& d, const void* chain_c, int64_t chain_ldc,
                             size_t workspace_bytes) {
  cublasLtHandle_t handle = nullptr;
  Plan* plan = nullptr;
  Operands ops;
  return find_plan(d, chain_c, chain_ldc, workspace_bytes, &handle, &plan, &ops);
}

dg_status run_cublaslt_gemm(const dg_gemm_desc& d, const void* chain_c, int64_t chain_ldc, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream) {
  DG_REQUIRE(workspace_bytes == 0 || aligned16(workspace), "the cuBLASLt workspace must be 16-byte aligned");
  cublasLtHandle_t handle = nullptr;
  Plan* plan = nullptr;
  Operands ops;
  DG_RETURN_IF_ERROR(find_plan(d, chain_c, chain_ldc, workspace_bytes, &handle, &plan, &ops));
  if (plan->bias)
    DG_LT_RETURN(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &d.c.data,
                                                sizeof(d.c.data)));
  const float alpha = d.alpha;
  DG_LT_RETURN(cublasLtMatmul(handle, plan->op, &alpha, d.b.data, plan->a, d.a.data, plan->b, &ops.beta,
                              ops.c, plan->c, const_cast<void*>(d.d.data), plan->d, &plan->algo, workspace,
                              workspace_bytes, stream));
  return DG_SUCCESS;
}

}  // namespace distgemm::gemm

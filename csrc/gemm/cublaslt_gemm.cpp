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
      return fail(DG_ERROR_CUDA, cat("cublasLtCreate failed on device ", d, ": ", cublasLtGetStatusString(st)));
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

#define DG_LT_RETURN(expr)                                                           \
  do {                                                                               \
    cublasStatus_t dg_lt_ = (expr);                                                  \
    if (dg_lt_ != CUBLAS_STATUS_SUCCESS)                                             \
      return fail(DG_ERROR_CUDA, cat(#expr, ": ", cublasLtGetStatusString(dg_lt_))); \
  } while (0)

// How cuBLASLt applies FP8 scales: one value per operand (or none), or one per row of a and
// per row of b (outer-vector scaling).
enum class LtScales : int { kTensor, kOuterVector };

// Everything cuBLASLt's plan depends on; pointers only through their (checked) alignment.
struct PlanKey {
  int device = 0;
  bool b_k_major = true;
  int64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0, ldd = 0;
  int a_type = 0, b_type = 0, out_type = 0;
  bool with_c = false, bias = false, fast_accum = false;
  LtScales scales = LtScales::kTensor;
  size_t workspace_bytes = 0;
  auto tie() const {
    return std::tie(device, b_k_major, m, n, k, lda, ldb, ldc, ldd, a_type, b_type, out_type, with_c, bias, fast_accum,
                    scales, workspace_bytes);
  }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool bias = false;
  bool fp8 = false;  // the scale pointers are set per call
};

dg_status make_plan(cublasLtHandle_t handle, const PlanKey& key, Plan* plan) {
  const auto a_type = static_cast<cudaDataType_t>(key.a_type), b_type = static_cast<cudaDataType_t>(key.b_type),
             out = static_cast<cudaDataType_t>(key.out_type);
  const int64_t m = key.m, n = key.n, k = key.k;
  DG_LT_RETURN(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans_a = key.b_k_major ? CUBLAS_OP_T : CUBLAS_OP_N, trans_b = CUBLAS_OP_N;
  DG_LT_RETURN(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  DG_LT_RETURN(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  if (key.fast_accum) {
    const int8_t fast = 1;
    DG_LT_RETURN(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
  }
  if (key.scales == LtScales::kOuterVector) {
    const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    for (auto attr : {CUBLASLT_MATMUL_DESC_A_SCALE_MODE, CUBLASLT_MATMUL_DESC_B_SCALE_MODE})
      DG_LT_RETURN(cublasLtMatmulDescSetAttribute(plan->op, attr, &mode, sizeof(mode)));
  }
  if (key.bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    DG_LT_RETURN(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    DG_LT_RETURN(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &out, sizeof(out)));
  }
  plan->bias = key.bias;
  plan->fp8 = a_type == CUDA_R_8F_E4M3 || a_type == CUDA_R_8F_E5M2;
  // Our B (N, K) is cuBLASLt's A: stored (K, N) column-major if K-major, else (N, K).
  if (key.b_k_major)
    DG_LT_RETURN(cublasLtMatrixLayoutCreate(&plan->a, b_type, k, n, key.ldb));
  else
    DG_LT_RETURN(cublasLtMatrixLayoutCreate(&plan->a, b_type, n, k, key.ldb));
  DG_LT_RETURN(cublasLtMatrixLayoutCreate(&plan->b, a_type, k, m, key.lda));
  DG_LT_RETURN(cublasLtMatrixLayoutCreate(&plan->c, out, n, m, key.ldc));
  DG_LT_RETURN(cublasLtMatrixLayoutCreate(&plan->d, out, n, m, key.ldd));

  cublasLtMatmulPreference_t pref = nullptr;
  DG_LT_RETURN(cublasLtMatmulPreferenceCreate(&pref));
  const uint32_t align = 16;
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                           &key.workspace_bytes, sizeof(key.workspace_bytes));
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulAlgoGetHeuristic(handle, plan->op, plan->a, plan->b, plan->c, plan->d, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  DG_LT_RETURN(st);
  if (found < 1) return fail(DG_ERROR_NOT_SUPPORTED, cat("cuBLASLt has no algorithm for M=", m, " N=", n, " K=", k));
  plan->algo = result.algo;
  return DG_SUCCESS;
}

}  // namespace

// A bias row goes through cuBLASLt's bias epilogue (which does not scale it). Over a one-row D
// it is the C operand instead (same values, and beta applies), unless that is taken by a
// chained partial sum.
bool is_bias(const dg_gemm_desc& d, bool chained) { return d.c.data && d.c.rows == 1 && (d.d.rows > 1 || chained); }

namespace {

// How cuBLASLt applies d's FP8 scales, or why it cannot.
const char* lt_scales(const dg_gemm_desc& d, LtScales* out) {
  const bool rows_a = d.scale_a && d.scale_a_len > 1, rows_b = d.scale_b && d.scale_b_len > 1;
  if (rows_a != rows_b) return "FP8 scales of one value on one operand and one per row on the other";
  *out = rows_a ? LtScales::kOuterVector : LtScales::kTensor;
  return nullptr;
}

// Why cuBLASLt cannot take d's dtypes and scales (nullptr if it can).
const char* unsupported_types(const dg_gemm_desc& d, bool chained) {
  if (is_fp8(d.a.dtype)) {
    if (!is_fp8(d.b.dtype) || (d.a.dtype == DG_E5M2 && d.b.dtype == DG_E5M2))
      return "FP8 inputs other than e4m3 x e4m3, e4m3 x e5m2 or e5m2 x e4m3";
    if (!is_16bit_float(d.d.dtype) && d.d.dtype != DG_F32) return "an FP8 output";
    if (d.d.dtype == DG_F32 && is_bias(d, chained)) return "a bias with FP8 inputs and an fp32 output";
    if (d.b.col_stride != 1) return "FP8 b other than K-major";
    if (d.a.cols % 16 || d.b.rows % 16) return "FP8 inputs with K or N not a multiple of 16";
    // A gathered peer's scale sits at its rows' offset in the gathered scales: 16-byte aligned
    // only for some row counts, and cuBLASLt's scale pointers are not known to accept less.
    if ((d.scale_a && !aligned16(d.scale_a)) || (d.scale_b && !aligned16(d.scale_b)))
      return "FP8 scale pointers not 16-byte aligned";
    LtScales scales;
    return lt_scales(d, &scales);
  }
  if (!is_16bit_float(d.a.dtype) || d.b.dtype != d.a.dtype) return "inputs other than bf16/fp16 or FP8";
  if (d.scale_a || d.scale_b) return "scales on bf16/fp16 inputs";
  if (d.d.dtype != d.a.dtype && d.d.dtype != DG_F32) return "an output dtype other than the input's or fp32";
  return nullptr;
}

}  // namespace

const char* cublaslt_unsupported(const dg_gemm_desc& d, bool chained) {
  if (const char* why = unsupported_types(d, chained)) return why;
  if (is_bias(d, chained) && d.beta != 1.f && d.beta != 0.f) return "a bias scaled by beta other than 0 or 1";
  if (d.a.col_stride != 1 || d.d.col_stride != 1 || (d.c.data && !is_bias(d, chained) && d.c.col_stride != 1))
    return "a, c and out other than row-major";
  if (d.b.col_stride != 1 && d.b.row_stride != 1) return "b neither K- nor N-major";
  const int64_t ldb = d.b.col_stride == 1 ? d.b.row_stride : d.b.col_stride;
  const int in = dtype_bytes(d.a.dtype), out = dtype_bytes(d.d.dtype);
  if (!aligned16(d.a.data) || !aligned16(d.b.data) || !aligned16(d.d.data) || (d.c.data && !aligned16(d.c.data)) ||
      !pitch16(d.a.row_stride, in) || !pitch16(ldb, in) || !pitch16(d.d.row_stride, out) ||
      (d.c.data && !is_bias(d, chained) && !pitch16(d.c.row_stride, out)))
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
  PlanKey key;
  key.device = device;
  key.b_k_major = b_k_major;
  key.m = m;
  key.n = n;
  key.k = k;
  key.lda = d.a.row_stride;
  key.ldb = b_k_major ? d.b.row_stride : d.b.col_stride;
  key.ldc = ops->ldc;
  key.ldd = d.d.row_stride;
  key.a_type = static_cast<int>(cublas_float_type(d.a.dtype));
  key.b_type = static_cast<int>(cublas_float_type(d.b.dtype));
  key.out_type = static_cast<int>(cublas_float_type(d.d.dtype));
  key.with_c = ops->beta != 0.f;
  key.bias = bias;
  key.fast_accum = is_fp8(d.a.dtype) && d.fast_accum;
  if (is_fp8(d.a.dtype)) lt_scales(d, &key.scales);
  key.workspace_bytes = workspace_bytes;
  thread_local std::map<PlanKey, Plan> plans;
  auto it = plans.find(key);
  if (it == plans.end()) {
    Plan plan;
    DG_RETURN_IF_ERROR(make_plan(handle, key, &plan));
    it = plans.emplace(key, plan).first;
  }
  *handle_out = handle;
  *plan_out = &it->second;
  return DG_SUCCESS;
}

}  // namespace

dg_status plan_cublaslt_gemm(const dg_gemm_desc& d, const void* chain_c, int64_t chain_ldc, size_t workspace_bytes) {
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
    DG_LT_RETURN(
        cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &d.c.data, sizeof(d.c.data)));
  if (plan->fp8) {  // cuBLASLt's A is our b, its B our a; NULL: 1.0
    DG_LT_RETURN(
        cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &d.scale_b, sizeof(d.scale_b)));
    DG_LT_RETURN(
        cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &d.scale_a, sizeof(d.scale_a)));
  }
  const float alpha = d.alpha;
  DG_LT_RETURN(cublasLtMatmul(handle, plan->op, &alpha, d.b.data, plan->a, d.a.data, plan->b, &ops.beta, ops.c, plan->c,
                              const_cast<void*>(d.d.data), plan->d, &plan->algo, workspace, workspace_bytes, stream));
  return DG_SUCCESS;
}

}  // namespace distgemm::gemm

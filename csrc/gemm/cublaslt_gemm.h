// The dense GEMM through cuBLASLt, for the tensor-parallel pieces where cuBLAS's tuned kernels
// beat ours (large bf16/fp16 GEMMs, and FP8 ones with FP32-promoted accumulation): same
// dg_gemm_desc contract, host-only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "distgemm/distgemm.h"

namespace distgemm::gemm {

// Why cuBLASLt cannot run `desc` (nullptr if it can), with a chained partial sum or not: dtypes
// other than bf16/fp16, or FP8 (e4m3/e5m2, not both e5m2) into bf16/fp16/fp32 with K-major b,
// K and N multiples of 16, and scales of one value per operand or one per row of each
// (outer-vector); a bias scaled by beta other than 0 or 1; layouts other than row-major
// a/c/out and K- or N-major b; pointers and leading dimensions not 16-byte aligned.
const char* cublaslt_unsupported(const dg_gemm_desc& desc, bool chained);

// Makes (or finds) the cached plan run_cublaslt_gemm would use for these arguments, so that a
// caller can fail before it enqueues anything; the pointers count only through their alignment.
dg_status plan_cublaslt_gemm(const dg_gemm_desc& desc, const void* chain_c, int64_t chain_ldc, size_t workspace_bytes);

// D = alpha * A @ B^T + beta * C (desc.c full or a bias row with beta 1) + chain_c (coefficient
// 1, (M, N) with chain_ldc; then desc.c may only be a bias). The plan (layouts and algorithm)
// is cached per shape and thread.
dg_status run_cublaslt_gemm(const dg_gemm_desc& desc, const void* chain_c, int64_t chain_ldc, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream);

}  // namespace distgemm::gemm

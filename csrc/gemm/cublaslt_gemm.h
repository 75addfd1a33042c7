// The dense GEMM through cuBLASLt, for the tensor-parallel pieces where cuBLAS's tuned kernels
// beat ours (large bf16/fp16 GEMMs): same dg_gemm_desc contract, host-only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "distgemm/distgemm.h"

namespace distgemm::gemm {

// Why cuBLASLt cannot run `desc` (nullptr if it can): FP8, scales, a bias with beta other
// than 1, an N-major... layout it has no plan for, or misaligned pointers.
const char* cublaslt_unsupported(const dg_gemm_desc& desc);

// D = alpha * A @ B^T + beta * C (desc.c full or a bias row with beta 1) + chain_c (coefficient
// 1, (M, N) with chain_ldc; then desc.c may only be a bias). The plan (layouts and algorithm)
// is cached per shape and thread.
dg_status run_cublaslt_gemm(const dg_gemm_desc& desc, const void* chain_c, int64_t chain_ldc,
                            void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace distgemm::gemm

/*
 * distgemm C API: framework-free entry points of the distgemm core.
 *
 * Raw device pointers, shapes, strides, dtypes and a cudaStream_t; no framework types.
 * Every call validates its arguments and returns a dg_status; on failure
 * dg_last_error() returns a message (thread-local) naming the argument at fault.
 * Nothing here allocates device memory or synchronizes with the host: callers pass
 * workspaces, so every call can be captured in a CUDA graph.
 */
#ifndef DISTGEMM_DISTGEMM_H_
#define DISTGEMM_DISTGEMM_H_

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DG_API __attribute__((visibility("default")))

typedef enum dg_status {
  DG_SUCCESS = 0,
  DG_ERROR_INVALID_ARGUMENT = 1, /* bad shape, dtype, stride, alignment or pointer */
  DG_ERROR_NOT_SUPPORTED = 2,    /* valid request this build or device cannot run */
  DG_ERROR_CUDA = 3,             /* a CUDA runtime call failed */
  DG_ERROR_INTERNAL = 4,         /* a CUTLASS kernel refused a checked problem */
  DG_ERROR_TIMEOUT = 5,          /* a wait on another GPU ran past its bound */
} dg_status;

typedef enum dg_dtype {
  DG_F32 = 0,
  DG_F16 = 1,
  DG_BF16 = 2,
  DG_E4M3 = 3, /* float8_e4m3fn */
  DG_E5M2 = 4, /* float8_e5m2 */
  DG_I32 = 5,
} dg_dtype;

/* A 2-D strided view: element (i, j) lives at data + i * row_stride + j * col_stride
 * (strides in elements). */
typedef struct dg_matrix {
  const void* data;
  dg_dtype dtype;
  int64_t rows;
  int64_t cols;
  int64_t row_stride;
  int64_t col_stride;
} dg_matrix;

/* D = alpha * (scale_a[:, None] * scale_b[None, :] * (A @ B^T)) + beta * C
 *   A (M, K), B (N, K), D (M, N) row-major.
 *   C: NULL data, (M, N), or a bias row (1, N) broadcast over the rows.
 *   scale_a: NULL (1.0), 1 value, or M values; scale_b: NULL, 1 value or N values (FP32). */
typedef struct dg_gemm_desc {
  dg_matrix a;
  dg_matrix b;
  dg_matrix c;
  dg_matrix d;
  float alpha;
  float beta;
  const float* scale_a;
  int64_t scale_a_len;
  const float* scale_b;
  int64_t scale_b_len;
  int config;  /* -1: pick by heuristic; otherwise an index below dg_gemm_config_count() */
  int swizzle; /* 0: heuristic; otherwise the tile-raster swizzle (1, 2, 4 or 8) */
} dg_gemm_desc;

DG_API const char* dg_last_error(void);
DG_API const char* dg_status_name(dg_status status);

/* Checks a GEMM without touching device memory (data pointers are only checked for
 * alignment). Returns DG_SUCCESS when dg_gemm would run it. */
DG_API dg_status dg_gemm_check(const dg_gemm_desc* desc, int device_arch);
DG_API dg_status dg_gemm_workspace_size(const dg_gemm_desc* desc, size_t* bytes);
DG_API dg_status dg_gemm(const dg_gemm_desc* desc, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream);

/* Tile configurations compiled for the desc's dtypes and layouts on device_arch (90, 100).
 * dg_gemm_select_config returns the heuristic's choice for desc's shape. */
DG_API int dg_gemm_config_count(const dg_gemm_desc* desc, int device_arch);
DG_API const char* dg_gemm_config_name(const dg_gemm_desc* desc, int device_arch, int config);
DG_API int dg_gemm_select_config(const dg_gemm_desc* desc, int device_arch, int sm_count);

/* ---------------------------------------------------------------- grouped GEMM (MoE) */

/* Per group g, with rows [offs[g-1], offs[g]) of the token dimension (offs[-1] = 0):
 *   DG_GROUPED_FORWARD: out[rows] (T, N) = a[rows] (T, K) @ b[g]^T,  b (G, N, K)
 *   DG_GROUPED_DGRAD:   out[rows] (T, N) = a[rows] (T, K) @ b[g],    b (G, K, N)
 *   DG_GROUPED_WGRAD:   out[g] (G, N, K) = a[rows]^T @ b[rows],      a (T, N), b (T, K)
 * offs: G int32 cumulative row ends on the device; they never leave it. Offsets are clamped
 * to [0, T] and a decreasing offset ends its group where it starts, so no launch reads or
 * writes out of bounds. FORWARD/DGRAD leave rows past offs[G-1] untouched; WGRAD writes
 * zeros for empty groups, or leaves them untouched with accumulate.
 * accumulate: out += result (out must then hold valid data). */
typedef enum dg_grouped_kind {
  DG_GROUPED_FORWARD = 0,
  DG_GROUPED_DGRAD = 1,
  DG_GROUPED_WGRAD = 2,
} dg_grouped_kind;

typedef struct dg_grouped_desc {
  dg_grouped_kind kind;
  int num_groups;
  const int32_t* offs;
  int64_t tokens; /* T */
  int64_t n;
  int64_t k;
  const void* a;  /* contiguous, see above */
  const void* b;  /* contiguous, see above */
  void* out;      /* contiguous */
  dg_dtype in_dtype;  /* a and b */
  dg_dtype out_dtype;
  int accumulate;
  int config;     /* -1: heuristic */
} dg_grouped_desc;

DG_API dg_status dg_grouped_gemm_workspace_size(const dg_grouped_desc* desc, size_t* bytes);
DG_API dg_status dg_grouped_gemm(const dg_grouped_desc* desc, void* workspace,
                                 size_t workspace_bytes, cudaStream_t stream);
DG_API int dg_grouped_gemm_config_count(const dg_grouped_desc* desc, int device_arch);
DG_API const char* dg_grouped_gemm_config_name(const dg_grouped_desc* desc, int device_arch,
                                               int config);
/* The multi-stream cuBLAS baseline (one GEMM per non-empty group on a pool of streams joined
 * back to `stream`). It needs the offsets on the host: host_offs (G values). */
DG_API dg_status dg_grouped_gemm_cublas(const dg_grouped_desc* desc, const int32_t* host_offs,
                                        cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* DISTGEMM_DISTGEMM_H_ */

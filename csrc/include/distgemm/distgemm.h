/*
 * distgemm C API: framework-free entry points of the distgemm core.
 *
 * Raw device pointers, shapes, strides, dtypes and a cudaStream_t; no framework types.
 * Every call validates its arguments and returns a dg_status; on failure
 * dg_last_error() returns a message (thread-local) naming the argument at fault; the pointer
 * stays valid for the thread's lifetime (the next failure on the thread rewrites the text).
 * Nothing here allocates device memory or synchronizes with the host: callers pass
 * workspaces, so every call can be captured in a CUDA graph.
 * Buffers a call writes (outputs, workspaces) share no byte with any other buffer of the call:
 * the grouped GEMM, quantization, MoE activation, permute and combine calls refuse an overlap
 * (the kernels read their inputs while they write, in no order in-place use could rely on).
 */
#ifndef DISTGEMM_DISTGEMM_H_
#define DISTGEMM_DISTGEMM_H_

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "distgemm/types.h"
#include "distgemm/version.h"

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
 *   scale_a: NULL (1.0), 1 value, or M values; scale_b: NULL, 1 value or N values (FP32).
 *   D must share no element with A, B or the scales; this is not checked (strided views of one
 *   buffer may interleave without sharing elements, which byte ranges cannot tell). */
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
  int fast_accum; /* FP8 only: accumulate in the tensor cores' reduced precision for the whole K
                     (faster), instead of promoting partial sums to FP32 every 4 k-blocks */
  int config;     /* -1: pick by heuristic; otherwise an index below dg_gemm_config_count() */
  int swizzle;    /* 0: heuristic; otherwise the tile-raster swizzle (1, 2, 4 or 8) */
} dg_gemm_desc;

DG_API const char* dg_last_error(void);
DG_API const char* dg_status_name(dg_status status);
/* The id of the build this library comes from (bindings built with it must match). */
DG_API const char* dg_build_id(void);
/* The library's version, "major.minor.patch" (DG_VERSION_STRING of the headers it was built with). */
DG_API const char* dg_get_version(void);

/* Checks a GEMM without touching device memory (data pointers are only checked for being
 * non-NULL and aligned). Returns DG_SUCCESS when dg_gemm would run it on a device_arch GPU.
 * Strides are any int64: negative ones and sizes whose bytes overflow int64 are refused. A
 * matrix of one row may have any non-negative row stride (it addresses nothing there). */
DG_API dg_status dg_gemm_check(const dg_gemm_desc* desc, int device_arch);
DG_API dg_status dg_gemm_workspace_size(const dg_gemm_desc* desc, size_t* bytes);
DG_API dg_status dg_gemm(const dg_gemm_desc* desc, void* workspace, size_t workspace_bytes, cudaStream_t stream);

/* Tile configurations compiled for the desc's dtypes and layouts on device_arch (90, 100).
 * dg_gemm_select_config returns the heuristic's choice for desc's shape. */
DG_API int dg_gemm_config_count(const dg_gemm_desc* desc, int device_arch);
DG_API const char* dg_gemm_config_name(const dg_gemm_desc* desc, int device_arch, int config);
DG_API int dg_gemm_select_config(const dg_gemm_desc* desc, int device_arch, int sm_count);

/* ---------------------------------------------------------------- grouped GEMM (MoE) */

/* Per group g, with rows [offs[g-1], offs[g]) of the token dimension (offs[-1] = 0):
 *   DG_GROUPED_FORWARD: out[rows] (T, N) = a[rows] (T, K) @ b[g]^T,  a = x (T, K), b = w (G, N, K)
 *   DG_GROUPED_DGRAD:   out[rows] (T, N) = a[rows] (T, K) @ b[g],    a = x (T, K), b = w (G, K, N)
 *   DG_GROUPED_WGRAD:   out[g] (G, N, K) = a[rows]^T @ b[rows],      a = dy (T, N), b = x (T, K)
 * offs: G int32 cumulative row ends on the device; they never leave it. Offsets are clamped
 * to [0, T] and a decreasing offset ends its group where it starts, so no launch reads or
 * writes out of bounds. FORWARD/DGRAD leave rows past offs[G-1] untouched; WGRAD writes
 * zeros for empty groups, or leaves them untouched with accumulate.
 * accumulate: out += result (out must then hold valid data).
 *
 * The caller passes each tensor's shape as it holds it; G is num_groups and T, N, K are read
 * off the shapes (T and K from a for FORWARD/DGRAD; T and N from a, K from b for WGRAD), and
 * every other size must agree with them. Errors name the tensors as above (x, w, dy, offs, out).
 * Limits: 1 <= G < 2^31, 0 <= T < 2^31 (int32 offsets), 1 <= N, K < 2^31, N and K (and out's
 * rows) multiples of 16 bytes, every tensor's bytes within int64 and the address space; out shares
 * no byte with a, b, offs or the scales (refused: the kernels read them while they write out). */

/* A tensor's sizes: ndim of them in size[0..ndim-1] (row-major and contiguous). A caller with a
 * tensor of more than 3 dimensions passes its ndim (and its first 3 sizes): it is refused. */
typedef struct dg_grouped_shape {
  int ndim;
  int64_t size[3];
} dg_grouped_shape;

typedef struct dg_grouped_desc {
  dg_grouped_kind kind;
  int64_t num_groups;         /* G: the number of offsets in offs */
  const int32_t* offs;        /* G int32 values, 4-byte aligned */
  const void* a;              /* 16-byte aligned; NULL only if a has no elements */
  dg_grouped_shape a_shape;   /* FORWARD/DGRAD: x (T, K); WGRAD: dy (T, N) */
  const void* b;              /* 16-byte aligned; NULL only if b has no elements */
  dg_grouped_shape b_shape;   /* FORWARD: w (G, N, K); DGRAD: w (G, K, N); WGRAD: x (T, K) */
  void* out;                  /* 16-byte aligned; NULL only if out has no elements */
  dg_grouped_shape out_shape; /* FORWARD/DGRAD: (T, N); WGRAD: (G, N, K) */
  dg_dtype in_dtype;          /* a and b: bfloat16 or float16, or float8_e4m3fn; float8_e5m2:
                                 a (a gradient) in e5m2 against an e4m3 b (see below) */
  dg_dtype out_dtype;         /* in_dtype or float32; FP8: see below */
  int accumulate;
  int config; /* -1: heuristic */
  /* FP8 (in_dtype DG_E4M3 or DG_E5M2; NONE for bfloat16/float16): float32 scales on the device, 4-byte
   * aligned. out = (a * scale_a) @ (b * scale_b), partial sums scaled and promoted to FP32
   * once per 128 of K. Kb = ceil(K / 128), Nb = ceil(N / 128).
   *   FORWARD, ROW:   scale_a (T,) per row of x; scale_b (G, N) per row of w[g].
   *   FORWARD, BLOCK: scale_a per 1 x 128 of x, (t, kb) at scale_a[kb * scale_a_ld + t]
   *                   (scale_a_ld >= T: PyTorch's BlockWise1x128 and DeepGEMM's layout);
   *                   scale_b per 128 x 128 of w, (G, Kb, Nb) contiguous.
   *   WGRAD, BLOCK:   a = dy^T (N, Tp) and b = x^T (K, Tp), FP8, in the padded per-group
   *                   layout of dg_quantize_fp8 (transpose with offs): Tp = 128 * (ceil(T / 128)
   *                   + G), group g's tokens from column 128 * (g + start_g / 128), zeros
   *                   elsewhere; scale_a (Tp / 128, N) and scale_b (Tp / 128, K) contiguous,
   *                   one per 128 columns. out (G, N, K) float32; T is taken as Tp - 128 G.
   *                   Operands that cannot hold the tokens (offs[G-1] > Tp - 128 G: quantized
   *                   without offs) fill out with NaN, checked on the device.
   * FP8 reads a and b K-major only: a dgrad (dx = dy @ w[g]) is a FORWARD on w transposed
   * to (G, K, N) contiguous, with scale_b the transposed block scales. Outputs: FORWARD
   * bfloat16, WGRAD float32. */
  dg_scale_mode scale_mode;
  const float* scale_a;
  dg_grouped_shape scale_a_shape; /* as listed above: (T,), (T, Kb) or (Tp / 128, N) */
  int64_t scale_a_ld;
  const float* scale_b;
  dg_grouped_shape scale_b_shape; /* (G, N), (G, Kb, Nb) or (Tp / 128, K) */
} dg_grouped_desc;

/* The checks, then the workspace the CUTLASS kernel for desc needs on the current device. */
DG_API dg_status dg_grouped_gemm_workspace_size(const dg_grouped_desc* desc, size_t* bytes);
DG_API dg_status dg_grouped_gemm(const dg_grouped_desc* desc, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream);
DG_API int dg_grouped_gemm_config_count(const dg_grouped_desc* desc, int device_arch);
DG_API const char* dg_grouped_gemm_config_name(const dg_grouped_desc* desc, int device_arch, int config);
/* The multi-stream cuBLAS baseline (one GEMM per non-empty group on a pool of streams joined
 * back to `stream`). It needs the offsets on the host: host_offs (G values). With accumulate
 * into a bf16/fp16 out it is cuBLAS's beta = 1, which can round the product to out's dtype
 * before the addition (1-ulp differences from dg_grouped_gemm, which rounds once); the Python
 * backend computes the product into FP32 first. FP8 descriptors (any scale mode) are refused
 * with DG_ERROR_NOT_SUPPORTED. */
DG_API dg_status dg_grouped_gemm_cublas(const dg_grouped_desc* desc, const int32_t* host_offs, cudaStream_t stream);

/* ---------------------------------------------------------------- tensor-parallel GEMMs */

/* One rank's share of a GEMM over `world` GPUs of one node, its communication hidden under
 * the GEMM. Every rank passes the same shapes and dtypes. The ranks' symmetric workspaces
 * (dg_tp_workspace_size bytes each, zeroed once before first use, mapped into every rank)
 * hold the exchanged operand, the partial sums, the epoch flags that order the ranks and the
 * cuBLASLt scratch of the decomposed algorithm (32 MiB); every wait on a peer is bounded by
 * timeout_s and reported through dg_tp_error.
 *   DG_TP_ALL_GATHER_GEMM: gemm.a is this rank's (m, K) row shard, gemm.d the (world*m, N)
 *     output; C, alpha/beta and scales as in dg_gemm (scale_a: 1 or m values of this shard).
 *   DG_TP_GEMM_REDUCE_SCATTER: gemm.a (world*m, K) (K is this rank's shard), gemm.d this
 *     rank's (m, N) rows of the sum over ranks; c may only be a bias row. */
typedef enum dg_tp_kind {
  DG_TP_ALL_GATHER_GEMM = 1,
  DG_TP_GEMM_REDUCE_SCATTER = 2,
} dg_tp_kind;

/* How the communication is hidden:
 *   DG_TP_ALGO_FUSED: one persistent CUTLASS GEMM per ring step that waits, tile row by tile
 *     row, on per-chunk ready flags (all-gather) or on the previous rank's partial sums in its
 *     epilogue (reduce-scatter). Every dtype, FP8 scales included.
 *   DG_TP_ALGO_DECOMPOSED: one cuBLASLt GEMM per piece of a chunk, each after a bounded wait
 *     for its piece's flag on the caller's stream: bf16/fp16, and FP8 (e4m3/e5m2, not both
 *     e5m2; K-major b; K and N multiples of 16) with one scale per operand or one per row of
 *     a and of b where cuBLASLt has outer-vector scaling; a bias with fp32 output is not.
 *   DG_TP_ALGO_AUTO: decomposed where it applies, except reduce-scatters of under ~50 GFLOP
 *     per rank (there the fused ring's fewer launches win); else fused. */
typedef enum dg_tp_algo {
  DG_TP_ALGO_AUTO = 0,
  DG_TP_ALGO_FUSED = 1,
  DG_TP_ALGO_DECOMPOSED = 2,
} dg_tp_algo;

/* The most pieces a chunk travels in (dg_tp_settings.pieces). */
#define DG_TP_MAX_PIECES 4

/* How a tensor-parallel call is cut up. Every rank must pass the same settings (each call
 * checks: a difference is DG_ERROR_PEER_MISMATCH on every rank). All zero: the defaults. */
typedef struct dg_tp_settings {
  dg_tp_algo algo;
  /* Decomposed algorithm: 0 chooses from the shape (all-gathers: whole shards, halves from
   * ~200 GFLOP where the pushes take 0.3 of the GEMM's time; reduce-scatters: halves of every
   * ring step, three tapered pieces from ~100 GFLOP where the pushes take 0.4 of the GEMM's
   * time or a step has 8192+ rows); 1..DG_TP_MAX_PIECES: every chunk in that many pieces,
   * each with its own copy, flag and GEMM (fewer where a chunk has under 128 rows a piece). */
  int pieces;
  /* With pieces >= 3: the first and last piece half as large as the others. */
  int tapered;
  /* Fused reduce-scatter: a ring step runs as two launches (the first half's partial sums
   * travel while the second half is computed) when each half is at least this many GFLOP.
   * 0: the default, 25; negative: every step in halves. */
  double rs_split_gflops;
} dg_tp_settings;

typedef struct dg_tp_desc {
  dg_gemm_desc gemm; /* gemm.d row-major: col_stride 1, row_stride >= its columns */
  int rank;
  int world;
  void* const* peer_workspaces; /* [world]: rank r's workspace as mapped in this process */
  size_t workspace_bytes;       /* the size of each */
  double timeout_s;
  void* gathered_out; /* all-gather only: optional (world*m, K) copy of gathered a */
  dg_tp_settings settings;
  /* 0: the call. DG_TP_AGREE_ONLY: only the per-call agreement (below) runs, on `stream`, and
   * nothing is read or written but the workspace header (which may then be smaller than this
   * call needs): what a caller runs on its current workspaces before it makes larger ones for
   * this call. DG_TP_AGREE_ELSEWHERE: the same agreement, announcing that this rank runs the
   * call without the workspaces (e.g. through NCCL collectives, for dtypes or sizes the fused
   * kernels cannot take): a peer that runs it here fails with DG_ERROR_PEER_MISMATCH, reason 7,
   * instead of waiting for this rank in vain, and so does this rank; ranks that all announce
   * it agree as usual (rows, K or N, a's and out's dtypes, how a's scales travel: none, one,
   * one per row, or a multiple of the rows for blocks along K). Only gemm.a (its shape, dtype
   * and strides; never dereferenced), gemm.d's shape and dtype and scale_a's length are read
   * of `gemm`. */
  int agree_only;
} dg_tp_desc;

#define DG_TP_AGREE_ONLY 1
#define DG_TP_AGREE_ELSEWHERE 2

/* Every call begins by publishing its signature (op, rows, K or N, dtypes, algorithm and pieces,
 * call count) to every peer; before it writes into a peer or reads what one wrote, each rank
 * waits (bounded) for every peer to begin the same call and compares. A timeout or a
 * disagreement sets the device's error word (dg_tp_error), the call's outputs are filled with
 * NaN, and every later call on that device returns DG_ERROR_TIMEOUT or DG_ERROR_PEER_MISMATCH
 * until dg_tp_clear_error has run on every rank and the workspaces were zeroed again (the ranks'
 * call counters are then out of step). The workspaces of all ranks must be the same size, so
 * that what a rank with other shapes writes stays inside its peers' allocations. */
/* Calls are ordered per group: a group's calls go one at a time, in the same order on every
 * rank (a call from another stream than the previous one must wait for it), and two host threads
 * must not call the TP ops of one device at once (they share the device's side streams). */
DG_API dg_status dg_tp_workspace_size(dg_tp_kind kind, const dg_tp_desc* desc, size_t* bytes);
DG_API dg_status dg_all_gather_gemm(const dg_tp_desc* desc, cudaStream_t stream);
DG_API dg_status dg_gemm_reduce_scatter(const dg_tp_desc* desc, cudaStream_t stream);

/* The tensor-parallel error word of `device`: 0, or (reason << 24) | (kind << 16) | (peer rank + 1)
 * once a call failed: reason 0 a wait on that peer timed out; 1 the peer is at another call;
 * 2 another op, algorithm or piece split; 3 other rows; 4 another K (all-gather) or N
 * (reduce-scatter); 5 other dtypes or scale modes; 6 another group size; 7 one of the two runs
 * the call elsewhere (DG_TP_AGREE_ELSEWHERE) and the other on the workspaces; 8 the peer had
 * given up on the call (its own wait timed out or an earlier call of its failed: DG_ERROR_TIMEOUT).
 * A failed call marks itself in its peers' workspaces and raises no more flags, so its peers' calls
 * fail too; the word is the device's, so a failure fails the calls every group has in flight on
 * that device. Read from mapped host memory, without synchronizing the device. dg_tp_clear_error
 * synchronizes `device` and resets it. */
DG_API int dg_tp_error(int device);
DG_API dg_status dg_tp_clear_error(int device);

/* ---------------------------------------------------------------- FP8 quantization */

/* How many elements share one scale (dg_quantize_desc.granularity). */
typedef enum dg_quant_granularity {
  DG_QUANT_TENSOR = 0,  /* one scale for the whole input */
  DG_QUANT_ROW = 1,     /* one per row */
  DG_QUANT_1X128 = 2,   /* one per 128 consecutive elements of a row (activations; DeepGEMM) */
  DG_QUANT_128X128 = 3, /* one per 128 x 128 block (weights) */
} dg_quant_granularity;

/* x (batch, rows, cols), row-major and contiguous, quantized to FP8 with FP32 scales. For each
 * block of elements that share a scale:
 *   scale = amax / fp8_max (float32, amax = max |x| over the block; fp8_max 448 for e4m3,
 *           57344 for e5m2), or 1.0 where that is 0 (an all-zero block, or an amax so small
 *           that the division underflows);
 *   data  = x / scale rounded to nearest even and saturated to +-fp8_max (a true division, not
 *           x * (1 / scale)), so data * scale dequantizes. A NaN in a block makes its scale and
 *           data NaN.
 * Layouts (every buffer row-major and contiguous; dg_quantize_fp8_sizes gives the sizes):
 *   DG_QUANT_TENSOR:  data (rows, cols); scale 1 value.
 *   DG_QUANT_ROW:     data (rows, cols); scale (rows).
 *   DG_QUANT_1X128:   data (rows, cols); scale (ceil(cols / 128), rows): scale of row r, columns
 *                     128 j .. 128 j + 127 at scale[j * rows + r] (PyTorch's BlockWise1x128 and
 *                     DeepGEMM's layout: logically (rows, ceil(cols / 128)) with strides (1, rows)).
 *   DG_QUANT_128X128: data (batch, rows, cols); scale (batch, ceil(rows / 128), ceil(cols / 128)).
 *                     The only granularity with batch != 1: blocks never span two matrices.
 *   DG_QUANT_1X128 with transpose: x^T (cols, rows) quantized without being formed: blocks are
 *     128 consecutive rows of x in one column.
 *     num_groups = 0: data (cols, rows); scale (ceil(rows / 128), cols): block j of column c
 *       at scale[j * cols + c].
 *     num_groups = G >= 1 (offs: G int32 cumulative group ends on the device, as in
 *       dg_grouped_desc; never read on the host): the per-group padded layout of a variable-K
 *       grouped wgrad. Ends are clamped to [0, rows] and non-decreasing (end_g = min(rows,
 *       max(0, offs[0..g]))), so a decreasing offset gives an empty group; group g owns rows
 *       [start_g, end_g), start_g = end_{g-1} (0 for g = 0). Rp = 128 * (ceil(rows / 128) + G).
 *       data (cols, Rp): row start_g + i of x goes to column 128 * b_g + i, b_g = g +
 *       start_g / 128 (b_g + ceil(len_g / 128) <= b_{g+1}, so groups never overlap); every
 *       other column holds zeros. scale (Rp / 128, cols): one per 128 padded columns, so a
 *       block never mixes two groups; blocks without rows get 1.0.
 * The scale buffer is written whole (every block); so is data. */
typedef struct dg_quantize_desc {
  const void* x;    /* 16-byte alignment gives vector loads; element-aligned at least */
  dg_dtype x_dtype; /* DG_BF16, DG_F16 or DG_F32 */
  int64_t batch;    /* 1 (>= 0 for DG_QUANT_128X128) */
  int64_t rows;     /* >= 0 */
  int64_t cols;     /* >= 0 */
  dg_quant_granularity granularity;
  int transpose;       /* nonzero: quantize x^T (DG_QUANT_1X128 only) */
  const int32_t* offs; /* transpose with num_groups >= 1: 4-byte aligned */
  int64_t num_groups;  /* 0: no groups; G in [1, 2^31) with offs (rows < 2^31) */
  void* out;           /* the FP8 data; 16-byte alignment gives vector stores */
  dg_dtype out_dtype;  /* DG_E4M3 or DG_E5M2 */
  float* scale;        /* 4-byte aligned */
  void* workspace;     /* 4-byte aligned, workspace_bytes of dg_quantize_fp8_sizes */
  size_t workspace_bytes;
} dg_quantize_desc;

/* What the caller allocates for a desc: out holds batch * data_rows * data_cols bytes and
 * scale batch * scale_rows * scale_cols floats, each row-major as listed above (TENSOR: 1 x 1;
 * ROW: rows x 1); the workspace (any content; 0 bytes but for DG_QUANT_TENSOR, the amax, and for
 * offs, the groups' clamped ends) must not be in use by another call in flight. */
typedef struct dg_quantize_sizes {
  int64_t data_rows;
  int64_t data_cols;
  int64_t scale_rows;
  int64_t scale_cols;
  size_t workspace_bytes;
} dg_quantize_sizes;

/* Checks desc's shape fields (dtypes, granularity, sizes, transpose, num_groups; no pointer is
 * read) and fills *sizes. */
DG_API dg_status dg_quantize_fp8_sizes(const dg_quantize_desc* desc, dg_quantize_sizes* sizes);
/* Every check, then the kernels on `stream` (no host sync, no allocation; graph-capturable). */
DG_API dg_status dg_quantize_fp8(const dg_quantize_desc* desc, cudaStream_t stream);

/* ---------------------------------------------------------------- MoE expert MLP */

/* The activation dg_moe_activation applies (y from x, and dy in the backward ops). C = inner. */
typedef enum dg_moe_act {
  DG_MOE_IDENTITY = 0,        /* x (T, C): y = x (a GEMM operand's every FP8 copy in one read) */
  DG_MOE_SWIGLU = 1,          /* x (T, 2C) = [gate | up]: y (T, C) = silu(gate) * up */
  DG_MOE_GELU = 2,            /* x (T, C): y = gelu(x) = x * Phi(x) (the erf form) */
  DG_MOE_SWIGLU_BACKWARD = 3, /* x (T, 2C) the forward's input, dy (T, C):
                                 y (T, 2C) = [dy * up * silu'(gate) | dy * silu(gate)] */
  DG_MOE_GELU_BACKWARD = 4,   /* x (T, C) the forward's input, dy (T, C): y = dy * gelu'(x) */
} dg_moe_act;

/* An expert MLP's activation (or its derivative) applied to a GEMM's output in FP32 and
 * rounded to bf16, then written in every form the next GEMMs read, from one read of x (and dy):
 *   y:      bf16 (T, Y) row-major, Y = 2C for DG_MOE_SWIGLU_BACKWARD, else C;
 *   y_fp8:  FP8 (T, Y) with y_scale (ceil(Y / 128), T): one scale per 1 x 128, the layout of
 *           dg_quantize_fp8 with DG_QUANT_1X128 (the FP8 grouped GEMM's x);
 *   yt_fp8: FP8 (Y, Tp) with yt_scale (Tp / 128, Y): y transposed and padded per group, the
 *           layout of dg_quantize_fp8 with DG_QUANT_1X128, transpose and offs (the FP8 grouped
 *           wgrad's operands); Tp = 128 * (ceil(T / 128) + num_groups).
 * y and y_fp8 cover all T rows, those past offs[num_groups - 1] too; yt_fp8 covers the groups.
 * Each FP8 copy is bit-identical to dg_quantize_fp8 of the bf16 y. Any subset of the three
 * (at least one); NULL leaves a form out. DG_MOE_SWIGLU_BACKWARD with y_fp8 needs C % 128 == 0
 * (a 1 x 128 block never spans the gate and up halves). */
typedef struct dg_moe_act_desc {
  dg_moe_act act;
  const void* x;  /* bf16, row-major, contiguous; 16-byte alignment gives vector loads */
  const void* dy; /* bf16 (T, C) for the backward ops, NULL otherwise */
  int64_t tokens; /* T >= 0, < 2^31 with yt_fp8 */
  int64_t inner;  /* C >= 0 */
  void* y;
  void* y_fp8;
  float* y_scale;
  void* yt_fp8;
  float* yt_scale;
  const int32_t* offs; /* with yt_fp8: num_groups >= 1 int32 cumulative group ends on the device
                          (never read on the host), as in dg_grouped_desc */
  int64_t num_groups;  /* 0 without yt_fp8 */
  dg_dtype fp8_dtype;  /* DG_E4M3 or DG_E5M2 */
  void* workspace;     /* 4-byte aligned, dg_moe_activation_workspace_size bytes (4 * num_groups) */
  size_t workspace_bytes;
} dg_moe_act_desc;

/* Checks desc's shape fields (no pointer is read) and gives the workspace it needs. */
DG_API dg_status dg_moe_activation_workspace_size(const dg_moe_act_desc* desc, size_t* bytes);
/* Every check, then the kernels on `stream` (no host sync, no allocation; graph-capturable). */
DG_API dg_status dg_moe_activation(const dg_moe_act_desc* desc, cudaStream_t stream);

/* A batch of weights w (groups, rows, cols) in FP8: out (groups, rows, cols) and out_t
 * (groups, cols, rows) = its transpose (the dgrad's K-major operand); either may be NULL.
 *   granularity DG_QUANT_128X128: both from one read, with scale (groups, ceil(rows / 128),
 *     ceil(cols / 128)); the same bits as dg_quantize_fp8 with DG_QUANT_128X128 (and that,
 *     transposed). scale_t (or NULL) receives the same scales as (groups, ceil(cols / 128),
 *     ceil(rows / 128)): the layout dg_grouped_gemm's FORWARD BLOCK reads for w = out, as scale
 *     reads for w = out_t.
 *   granularity DG_QUANT_ROW: one scale per row of each copy (the row-wise recipe's output
 *     channels): out with scale (groups, rows) and out_t with scale_t (groups, cols), each
 *     needed with its copy; the same bits as dg_quantize_fp8 with DG_QUANT_ROW of w viewed
 *     (groups * rows, cols) and of its transpose (groups * cols, rows), which is never formed
 *     (w is read twice, not copied). */
typedef struct dg_quantize_weight_desc {
  const void* w;    /* row-major, contiguous */
  dg_dtype w_dtype; /* DG_BF16, DG_F16 or DG_F32 */
  int64_t groups;
  int64_t rows;
  int64_t cols;
  void* out;
  void* out_t;
  float* scale;
  dg_dtype out_dtype;               /* DG_E4M3 or DG_E5M2 */
  float* scale_t;                   /* 4-byte aligned, or NULL */
  dg_quant_granularity granularity; /* DG_QUANT_128X128 or DG_QUANT_ROW */
} dg_quantize_weight_desc;

DG_API dg_status dg_quantize_fp8_weight(const dg_quantize_weight_desc* desc, cudaStream_t stream);

/* ---------------------------------------------------------------- MoE token routing */

/* An MoE layer's permute with its FP8 quantization, in one read: row p of the permuted rows is
 * x[rows[p]], written in the forms dg_moe_activation writes for DG_MOE_IDENTITY (each when
 * asked): y bf16 (num_rows, hidden); y_fp8 with y_scale (ceil(hidden / 128), num_rows) per 1 x
 * 128; yt_fp8 with yt_scale, transposed and padded per group (offs, num_groups, workspace as
 * there). rows[p] < 0 (a copy the router dropped) gives a row of zeros; rows[p] >= x_rows (bad
 * input, found on the device only) a row of NaN, so that it shows in every output. Each FP8 copy
 * is bit-identical to dg_quantize_fp8 of the gathered bf16 rows. */
typedef struct dg_moe_permute_desc {
  const void* x;       /* bf16 (x_rows, hidden) row-major, contiguous */
  int64_t x_rows;      /* >= 0 */
  const int64_t* rows; /* (num_rows) on the device (never read on the host), 8-byte aligned */
  int64_t num_rows;    /* >= 0, < 2^31 */
  int64_t hidden;      /* >= 0 */
  void* y;
  void* y_fp8;
  float* y_scale;
  void* yt_fp8;
  float* yt_scale;
  const int32_t* offs; /* with yt_fp8: num_groups int32 cumulative group ends on the device */
  int64_t num_groups;  /* 0 without yt_fp8 */
  dg_dtype fp8_dtype;  /* DG_E4M3 or DG_E5M2 */
  void* workspace;     /* 4-byte aligned, dg_moe_permute_workspace_size bytes (4 * num_groups) */
  size_t workspace_bytes;
} dg_moe_permute_desc;

/* Checks desc's shape fields (no pointer is read) and gives the workspace it needs. */
DG_API dg_status dg_moe_permute_workspace_size(const dg_moe_permute_desc* desc, size_t* bytes);
/* Every check, then the kernel on `stream` (no host sync, no allocation; graph-capturable). */
DG_API dg_status dg_moe_permute(const dg_moe_permute_desc* desc, cudaStream_t stream);

/* The weighted sum of each token's k rows: an MoE layer's combine (the router's weights), and
 * the backward of its gather (no weights). For slot i = t * k + j (t < tokens, j < k):
 *   out[t] = sum over the j with 0 <= rows[i] < num_rows of weights[i] * y[rows[i]],
 * in FP32 in the order of j, rounded once to out's dtype. Any other row (negative: a copy the
 * router dropped) contributes nothing, whatever y holds there; a token with none gets zeros. */
typedef struct dg_moe_combine_desc {
  const void* y;        /* (num_rows, hidden) row-major, contiguous */
  dg_dtype dtype;       /* y's and out's: DG_BF16, DG_F16 or DG_F32 */
  int64_t num_rows;     /* >= 0 */
  const int64_t* rows;  /* (tokens * k) on the device (never read on the host), 8-byte aligned */
  const float* weights; /* (tokens * k) FP32 on the device, 4-byte aligned, or NULL: every weight 1 */
  int64_t tokens;       /* >= 0 */
  int64_t k;            /* >= 1 */
  int64_t hidden;       /* >= 0 */
  void* out;            /* (tokens, hidden) row-major */
} dg_moe_combine_desc;

DG_API dg_status dg_moe_combine(const dg_moe_combine_desc* desc, cudaStream_t stream);

/* The combine's backward, from dy = d out (tokens, hidden). For slot i = t * k + j:
 *   0 <= r = rows[i] < num_rows:      dy_rows[r] = weights[i] * dy[t] (an FP32 product rounded
 *                                     once to dy's dtype); with dweights, dweights[i] = the FP32
 *                                     sum over h of dy[t, h] * y[r, h];
 *   0 <= p = -1 - rows[i] < num_rows: (a dropped copy in row p) dy_rows[p] = 0, dweights[i] = 0;
 *   otherwise:                        nothing is written for the slot (dweights[i] = 0).
 * Rows of dy_rows that no slot names are left as they are. */
typedef struct dg_moe_combine_backward_desc {
  const void* dy; /* (tokens, hidden) row-major, contiguous */
  const void* y;  /* (num_rows, hidden): the forward's y; needed with dweights, else NULL */
  dg_dtype dtype; /* dy's, y's and dy_rows': DG_BF16, DG_F16 or DG_F32 */
  int64_t num_rows;
  const int64_t* rows;  /* (tokens * k) on the device, 8-byte aligned */
  const float* weights; /* (tokens * k) FP32 on the device, or NULL: every weight 1 */
  int64_t tokens;
  int64_t k;
  int64_t hidden;
  void* dy_rows;   /* (num_rows, hidden) */
  float* dweights; /* (tokens * k) FP32, or NULL */
} dg_moe_combine_backward_desc;

DG_API dg_status dg_moe_combine_backward(const dg_moe_combine_backward_desc* desc, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* DISTGEMM_DISTGEMM_H_ */

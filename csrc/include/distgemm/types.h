/* distgemm's basic C types: status codes and dtypes. Kept apart from the API so that the
 * kernel sources, which need only these, do not rebuild when the API grows. */
#ifndef DISTGEMM_TYPES_H_
#define DISTGEMM_TYPES_H_

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
  DG_ERROR_PEER_MISMATCH = 6,    /* the ranks of a tensor-parallel call disagree (shapes, dtypes,
                                    settings or call counts) */
} dg_status;

typedef enum dg_dtype {
  DG_F32 = 0,
  DG_F16 = 1,
  DG_BF16 = 2,
  DG_E4M3 = 3, /* float8_e4m3fn */
  DG_E5M2 = 4, /* float8_e5m2 */
  DG_I32 = 5,
} dg_dtype;

/* The three GEMMs of a Mixture-of-Experts layer (see dg_grouped_desc). */
typedef enum dg_grouped_kind {
  DG_GROUPED_FORWARD = 0,
  DG_GROUPED_DGRAD = 1,
  DG_GROUPED_WGRAD = 2,
} dg_grouped_kind;

/* How FP8 operands are scaled (dg_grouped_desc.scale_mode). */
typedef enum dg_scale_mode {
  DG_SCALE_NONE = 0,  /* bfloat16 / float16 inputs */
  DG_SCALE_ROW = 1,   /* one scale per row of x and per output column of w */
  DG_SCALE_BLOCK = 2, /* DeepSeek-V3: x per 1 x 128 (along K), w per 128 x 128 */
} dg_scale_mode;

#ifdef __cplusplus
}
#endif

#endif /* DISTGEMM_TYPES_H_ */

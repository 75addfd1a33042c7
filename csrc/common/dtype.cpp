#include "common/dtype.h"

namespace distgemm {

const char* dtype_name(dg_dtype t) {
  switch (t) {
    case DG_F32:
      return "float32";
    case DG_F16:
      return "float16";
    case DG_BF16:
      return "bfloat16";
    case DG_E4M3:
      return "float8_e4m3fn";
    case DG_E5M2:
      return "float8_e5m2";
    case DG_I32:
      return "int32";
  }
  return "unknown";
}

cudaDataType_t cublas_float_type(dg_dtype t) {
  switch (t) {
    case DG_BF16:
      return CUDA_R_16BF;
    case DG_F16:
      return CUDA_R_16F;
    case DG_E4M3:
      return CUDA_R_8F_E4M3;
    case DG_E5M2:
      return CUDA_R_8F_E5M2;
    default:
      return CUDA_R_32F;
  }
}

}  // namespace distgemm

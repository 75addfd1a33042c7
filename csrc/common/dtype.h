// Host-side facts about dg_dtype values.
#pragma once

#include <library_types.h>

#include "distgemm/types.h"

namespace distgemm {

constexpr int dtype_bytes(dg_dtype t) {
  switch (t) {
    case DG_F32:
    case DG_I32:
      return 4;
    case DG_F16:
    case DG_BF16:
      return 2;
    case DG_E4M3:
    case DG_E5M2:
      return 1;
  }
  return 0;
}

constexpr bool is_fp8(dg_dtype t) { return t == DG_E4M3 || t == DG_E5M2; }
constexpr bool is_16bit_float(dg_dtype t) { return t == DG_F16 || t == DG_BF16; }

const char* dtype_name(dg_dtype t);

// The cuBLAS data type of a float dtype (FP8, 16- or 32-bit).
cudaDataType_t cublas_float_type(dg_dtype t);

}  // namespace distgemm

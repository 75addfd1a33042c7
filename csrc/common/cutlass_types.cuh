// dg_dtype -> CUTLASS element type, for the kernel headers.
#pragma once

#include <cutlass/numeric_types.h>

#include "distgemm/types.h"

namespace distgemm {

template <dg_dtype T>
struct CutlassType;
template <>
struct CutlassType<DG_F32> {
  using type = float;
};
template <>
struct CutlassType<DG_F16> {
  using type = cutlass::half_t;
};
template <>
struct CutlassType<DG_BF16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CutlassType<DG_E4M3> {
  using type = cutlass::float_e4m3_t;
};
template <>
struct CutlassType<DG_E5M2> {
  using type = cutlass::float_e5m2_t;
};

template <dg_dtype T>
using cutlass_type_t = typename CutlassType<T>::type;

}  // namespace distgemm

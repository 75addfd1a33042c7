// The e5m2 x e4m3 FP8 grouped kernels (fp8_e5m2_grouped.h): the FP8 grouped GEMM of
// sm90_fp8_grouped.cuh with an e5m2 A operand, one instantiation per generated file.
#pragma once

#include "grouped/sm90_fp8_grouped.cuh"

#define DG_INSTANTIATE_SM90_FP8_E5M2_GROUPED(MODE, OUT, KIND, S, TM, TN, CM, CN)                \
  template struct distgemm::grouped::Sm90Fp8E5m2GroupedKernel<distgemm::grouped::MODE, OUT,          \
                                                              distgemm::grouped::KIND, TM, TN, CM, CN>;

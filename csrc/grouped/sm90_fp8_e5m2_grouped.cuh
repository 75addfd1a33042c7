// The FP8 grouped GEMM of sm90_fp8_grouped.cuh with an e5m2 A operand (a gradient) against an
// e4m3 B, one instantiation per file generated from the DG_SM90_FP8_E5M2_GROUPED lines.
#pragma once

#include "grouped/sm90_fp8_grouped.cuh"

#define DG_INSTANTIATE_SM90_FP8_E5M2_GROUPED(MODE, OUT, KIND, S, TM, TN, CM, CN)                                 \
  template struct distgemm::grouped::Sm90Fp8GroupedKernel<distgemm::grouped::MODE, OUT, distgemm::grouped::KIND, \
                                                          distgemm::grouped::S, TM, TN, CM, CN, DG_E5M2>;

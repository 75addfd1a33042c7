// Which GEMMs the decomposed tensor-parallel algorithm can hand cuBLASLt, decided from the
// descriptor alone (CPU only: no pointer is dereferenced), and the FP8 work the TP piece
// heuristics count.
#include <gtest/gtest.h>

#include <string>

#include "gemm/cublaslt_gemm.h"
#include "tp/tp_heuristics.h"

using distgemm::gemm::cublaslt_unsupported;

namespace {

alignas(256) char arena[1 << 12];  // stand-in addresses: only their alignment counts
const float* scale_at(size_t offset) { return reinterpret_cast<const float*>(arena + offset); }

// An FP8 GEMM with one scale per operand, bf16 out: what the decomposed algorithm runs.
dg_gemm_desc fp8_gemm(int64_t m, int64_t n, int64_t k) {
  dg_gemm_desc d{};
  d.a = {arena, DG_E4M3, m, k, k, 1};
  d.b = {arena, DG_E4M3, n, k, k, 1};
  d.d = {arena, DG_BF16, m, n, n, 1};
  d.alpha = 1.f;
  d.scale_a = scale_at(0);
  d.scale_a_len = 1;
  d.scale_b = scale_at(16);
  d.scale_b_len = 1;
  d.config = -1;
  return d;
}

std::string refusal(const dg_gemm_desc& d, bool chained = false) {
  const char* why = cublaslt_unsupported(d, chained);
  return why ? why : "";
}

}  // namespace

TEST(CublasLtChecks, Fp8WithOneScalePerOperandIsTaken) {
  EXPECT_EQ(refusal(fp8_gemm(256, 384, 512)), "");
  dg_gemm_desc mixed = fp8_gemm(256, 384, 512);
  mixed.b.dtype = DG_E5M2;  // e4m3 activations x e5m2 gradients
  EXPECT_EQ(refusal(mixed), "");
  dg_gemm_desc unscaled = fp8_gemm(300, 384, 512);
  unscaled.scale_a = unscaled.scale_b = nullptr;  // 1.0
  unscaled.d.dtype = DG_F32;
  EXPECT_EQ(refusal(unscaled), "");
  dg_gemm_desc fast = fp8_gemm(1, 16, 16);
  fast.fast_accum = 1;
  EXPECT_EQ(refusal(fast), "");
  dg_gemm_desc chained = fp8_gemm(128, 256, 256);  // a ring step adding pushed partial sums
  EXPECT_EQ(refusal(chained, true), "");
}

TEST(CublasLtChecks, Fp8RowScalesOnBothOperandsPassTheStaticChecks) {
  dg_gemm_desc d = fp8_gemm(256, 384, 512);
  d.scale_a_len = 256;
  d.scale_b_len = 384;
  EXPECT_EQ(refusal(d), "");  // outer-vector scaling: cuBLASLt's heuristic has the last word
}

TEST(CublasLtChecks, Fp8RefusalsNameTheReason) {
  auto expect_refused = [](const dg_gemm_desc& d, const std::string& reason) {
    EXPECT_NE(refusal(d).find(reason), std::string::npos) << "got '" << refusal(d) << "', wanted " << reason;
  };
  dg_gemm_desc d = fp8_gemm(256, 384, 512);
  d.a.dtype = d.b.dtype = DG_E5M2;
  expect_refused(d, "e4m3 x e4m3, e4m3 x e5m2 or e5m2 x e4m3");
  d = fp8_gemm(256, 384, 512);
  d.scale_a_len = 256;  // row-wise a, one scale for b
  expect_refused(d, "one value on one operand and one per row on the other");
  d = fp8_gemm(256, 384, 512);
  d.b = {arena, DG_E4M3, 384, 512, 1, 384};  // N-major
  expect_refused(d, "K-major");
  d = fp8_gemm(256, 384, 200);
  d.a.row_stride = d.b.row_stride = 208;
  expect_refused(d, "multiple of 16");
  d = fp8_gemm(256, 392, 512);
  d.d.row_stride = 400;
  expect_refused(d, "multiple of 16");
  d = fp8_gemm(256, 384, 512);
  d.scale_a = scale_at(4);  // a gathered peer's scale at an offset of one row
  expect_refused(d, "scale pointers not 16-byte aligned");
  d = fp8_gemm(256, 384, 512);
  d.d.dtype = DG_F32;
  d.c = {arena, DG_F32, 1, 384, 384, 1};
  d.beta = 1.f;
  expect_refused(d, "a bias with FP8 inputs and an fp32 output");
  d = fp8_gemm(256, 384, 512);
  d.d.dtype = DG_E4M3;
  expect_refused(d, "an FP8 output");
}

TEST(CublasLtChecks, SixteenBitRulesStand) {
  dg_gemm_desc d{};
  d.a = {arena, DG_BF16, 256, 512, 512, 1};
  d.b = {arena, DG_BF16, 384, 512, 512, 1};
  d.d = {arena, DG_BF16, 256, 384, 384, 1};
  d.alpha = 1.f;
  EXPECT_EQ(refusal(d), "");
  d.b.dtype = DG_F16;
  EXPECT_NE(refusal(d).find("inputs other than bf16/fp16 or FP8"), std::string::npos) << refusal(d);
  d.b.dtype = DG_BF16;
  d.scale_a = scale_at(0);
  d.scale_a_len = 1;
  EXPECT_NE(refusal(d).find("scales on bf16/fp16 inputs"), std::string::npos) << refusal(d);
}

TEST(TpHeuristics, Fp8GemmWorkCountsHalf) {
  EXPECT_DOUBLE_EQ(distgemm::tp::bf16_equivalent_flops(1e12, DG_E4M3), 5e11);
  EXPECT_DOUBLE_EQ(distgemm::tp::bf16_equivalent_flops(1e12, DG_E5M2), 5e11);
  EXPECT_DOUBLE_EQ(distgemm::tp::bf16_equivalent_flops(1e12, DG_BF16), 1e12);
}

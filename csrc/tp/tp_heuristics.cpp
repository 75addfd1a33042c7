#include "tp/tp_heuristics.h"

namespace distgemm::tp {
namespace {

// H200 x2 over NVLink: a copy-engine push under a GEMM, and a large bf16 cuBLAS GEMM.
constexpr double kPushBytesPerSecond = 350e9;
constexpr double kGemmFlopsPerSecond = 700e12;

// Estimated time of the pushes over that of the GEMM.
double push_over_gemm(double flops, double pushed_bytes) {
  return (pushed_bytes / kPushBytesPerSecond) / (flops / kGemmFlopsPerSecond);
}

}  // namespace

double bf16_equivalent_flops(double flops, dg_dtype in) { return in == DG_E4M3 || in == DG_E5M2 ? flops / 2 : flops; }

bool rs_auto_prefers_fused(double flops) {
  // 8B attn-out at 4096 tokens (69 GFLOP): decomposed 0.135-0.138 ms, fused 0.147-0.152.
  return flops < 50e9;
}

PieceSplit rs_fused_split(const dg_tp_settings& settings, double half_step_flops) {
  const double gflops = settings.rs_split_gflops == 0.0 ? 25.0 : settings.rs_split_gflops;
  return {half_step_flops >= gflops * 1e9 ? 2 : 1, false};
}

PieceSplit rs_decomposed_split(double flops, double pushed_bytes, int64_t step_rows) {
  // H200 x2, tapered vs halves: 8B attn-out at 8192/16384 tokens 0.224/0.422 vs 0.238/0.442 ms,
  // fc2 at 16384 1.427 vs 1.462; at 4096 tokens halves are ahead or even (fc2 0.333 vs 0.350).
  if (flops >= 100e9 && (push_over_gemm(flops, pushed_bytes) >= 0.4 || step_rows >= 8192)) return {3, true};
  return {2, false};
}

PieceSplit ag_decomposed_split(double flops, double pushed_bytes) {
  // 8B QKV at 16384 tokens: 0.590 ms in halves vs 0.627 whole; below 0.3 no shard waits.
  if (flops >= 200e9 && push_over_gemm(flops, pushed_bytes) >= 0.3) return {2, false};
  return {1, false};
}

PieceSplit decomposed_split(const dg_tp_settings& settings, PieceSplit automatic) {
  if (settings.pieces == 0) return automatic;
  return {settings.pieces, settings.tapered != 0};
}

}  // namespace distgemm::tp

#include "dist/tp_heuristics.h"

#include <cstdlib>

#include "common/status.h"

namespace distgemm::dist {
namespace {

// H200 x2 over NVLink: a copy-engine push under a GEMM, and a large bf16 cuBLAS GEMM.
constexpr double kPushBytesPerSecond = 350e9;
constexpr double kGemmFlopsPerSecond = 700e12;

}  // namespace

bool rs_auto_prefers_fused(double flops) {
  // 8B attn-out at 4096 tokens (69 GFLOP): decomposed 0.135-0.138 ms, fused 0.147-0.152.
  return flops < 50e9;
}

dg_status rs_fused_split(double half_step_flops, PieceSplit* split) {
  const char* v = std::getenv("DISTGEMM_RS_SPLIT_GFLOPS");
  double gflops = 25.0;
  if (v && *v) {
    char* end = nullptr;
    gflops = std::strtod(v, &end);
    DG_REQUIRE(*end == '\0' && gflops >= 0.0,
               "DISTGEMM_RS_SPLIT_GFLOPS must be a non-negative number of GFLOP, got '", v, "'");
  }
  *split = {half_step_flops >= gflops * 1e9 ? 2 : 1, false};
  return DG_SUCCESS;
}

PieceSplit rs_decomposed_split(double flops, double pushed_bytes) {
  const double gemm_s = flops / kGemmFlopsPerSecond, push_s = pushed_bytes / kPushBytesPerSecond;
  // 8B attn-out at 16384 tokens (push/GEMM ~0.5): 0.417 ms tapered vs 0.456 in halves (graph
  // replays); at 0.25 (70B attn-out, 4096 tokens) halves stay ahead, 0.382 vs 0.391.
  if (flops >= 200e9 && push_s >= 0.4 * gemm_s) return {3, true};
  return {2, false};
}

}  // namespace distgemm::dist

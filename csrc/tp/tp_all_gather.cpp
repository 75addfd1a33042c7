// dg_all_gather_gemm: the arguments of an all-gather + GEMM, checked, turned into a plan
// (tp_plan: the copies, flags and GEMMs that hide the all-gather under the GEMM) and run on the
// consumer the settings and the shape choose. Host-only.
#include <cstdint>

#include "common/dtype.h"
#include "common/status.h"
#include "tp/tp_call.h"
#include "tp/tp_executor.h"
#include "tp/tp_heuristics.h"
#include "distgemm/distgemm.h"

using namespace distgemm;
using namespace distgemm::tp;

extern "C" dg_status dg_all_gather_gemm(const dg_tp_desc* desc, cudaStream_t stream) {
  Peers peers;
  DG_RETURN_IF_ERROR(check_tp(desc, &peers));
  const dg_tp_desc& d = *desc;
  const dg_gemm_desc& g = d.gemm;
  const int world = d.world;
  DG_RETURN_IF_ERROR(check_exchange_size(world, g.a.rows, g.a.cols, g.a.dtype, "a (this rank's shard)"));
  DG_RETURN_IF_ERROR(check_exchange_size(world, 1, g.d.cols, g.d.dtype, "out"));
  const int64_t m = g.a.rows, k = g.a.cols, rows = m * world;
  DG_REQUIRE(g.a.col_stride == 1 && g.a.row_stride >= k, "a must be row-major, got strides (", g.a.row_stride, ", ",
             g.a.col_stride, ")");
  DG_REQUIRE(g.d.rows == rows, "out must have world * m = ", rows, " rows, got ", g.d.rows);
  DG_RETURN_IF_ERROR(check_scale_a(d, m, "m (this rank's shard rows)"));

  TpShape shape = base_shape(DG_TP_ALL_GATHER_GEMM, d);
  shape.m = m;
  shape.k = k;
  shape.n = g.d.cols;
  shape.row_scales = g.scale_a != nullptr;
  shape.gathered_out = d.gathered_out != nullptr;
  // Decomposed: a peer's shard travels in pieces, each multiplied as soon as it is in. Fused:
  // one piece (the kernel waits per tile row anyway).
  const double work = bf16_equivalent_flops(2.0 * static_cast<double>(rows) * shape.n * k, g.a.dtype);
  const double pushed_bytes = static_cast<double>(world - 1) * m * k * shape.in_bytes;  // into each rank
  TpChoices choices;
  choices.decomposed = ag_decomposed_split(work, pushed_bytes);
  // What is pushed, and the scale mode (one value per shard, or per row), which a decomposed
  // GEMM over a peer's rows reads as its own.
  choices.dtypes =
      static_cast<uint32_t>(g.a.dtype) | (g.scale_a ? 1u << 8 : 0u) | (g.scale_a && g.scale_a_len > 1 ? 1u << 9 : 0u);
  choices.tag = kTagAllGather;
  return plan_and_execute(d, peers, shape, choices, stream);
}

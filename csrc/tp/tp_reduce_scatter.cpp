// dg_gemm_reduce_scatter: the arguments of a GEMM + reduce-scatter, checked, turned into a plan
// (tp_plan: the ring of GEMMs whose partial sums travel under the next GEMM) and run on the
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

extern "C" dg_status dg_gemm_reduce_scatter(const dg_tp_desc* desc, cudaStream_t stream) {
  Peers peers;
  DG_RETURN_IF_ERROR(check_tp(desc, &peers));
  const dg_tp_desc& d = *desc;
  const dg_gemm_desc& g = d.gemm;
  const int world = d.world;
  DG_RETURN_IF_ERROR(check_exchange_size(world, g.d.rows, g.d.cols, g.d.dtype, "out (this rank's shard)"));
  const int64_t m = g.d.rows, n = g.d.cols;
  DG_REQUIRE(g.a.rows == m * world, "a must have world * m = ", m * world, " rows, got ", g.a.rows);
  DG_REQUIRE(g.a.col_stride == 1, "a must be row-major");
  DG_REQUIRE(!g.c.data || g.c.rows == 1,
             "c must be a bias row for GEMM + reduce-scatter (add a full C to the output shard)");
  DG_RETURN_IF_ERROR(check_scale_a(d, g.a.rows, "M"));

  TpShape shape = base_shape(DG_TP_GEMM_REDUCE_SCATTER, d);
  shape.m = m;
  shape.k = g.a.cols;
  shape.n = n;
  // Ring steps in pieces of their rows (tp_heuristics), so that the first piece travels while
  // the next is computed and the next rank's GEMMs wait for a piece, not a whole step.
  const double flops = 2.0 * static_cast<double>(g.a.rows) * n * g.a.cols;
  const double work = bf16_equivalent_flops(flops, g.a.dtype);
  const double pushed_bytes = static_cast<double>(world - 1) * m * n * shape.out_bytes;  // by each rank
  TpChoices choices;
  choices.decomposed = rs_decomposed_split(work, pushed_bytes, m);
  choices.fused = rs_fused_split(d.settings, flops / world / 2);
  choices.auto_fused = rs_auto_prefers_fused(work);
  choices.dtypes = static_cast<uint32_t>(g.d.dtype);  // of the partial sums pushed
  choices.tag = kTagReduceScatter;
  return plan_and_execute(d, peers, shape, choices, stream);
}

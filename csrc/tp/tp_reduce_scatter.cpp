// dg_gemm_reduce_scatter: the arguments of a GEMM + reduce-scatter, checked, turned into a plan
// (tp_plan: the ring of GEMMs whose partial sums travel under the next GEMM) and run on the
// consumer the settings and the shape choose. Host-only.
#include <cstdint>

#include "common/device.h"
#include "common/dtype.h"
#include "common/status.h"
#include "tp/tp_call.h"
#include "tp/tp_consumer.h"
#include "tp/tp_executor.h"
#include "tp/tp_heuristics.h"
#include "tp/tp_plan.h"
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
  DG_REQUIRE(!g.scale_a || g.scale_a_len == 1 || g.scale_a_len == g.a.rows,
             "scale_a must hold 1 or M = ", g.a.rows, " values");

  TpShape shape = base_shape(DG_TP_GEMM_REDUCE_SCATTER, d);
  shape.m = m;
  shape.k = g.a.cols;
  shape.n = n;
  const TpRegions regions = tp_regions(shape);
  DG_REQUIRE(d.agree_only || d.workspace_bytes >= regions.bytes, "the workspace of ", d.workspace_bytes,
             " bytes is smaller than the ", regions.bytes, " needed");

  const DeviceInfo& dev = device_info(peers.device);
  const CutlassRingGemm fused(dev.sm_count);
  const CublasLtPieces pieces(dev.arch, peers.base[d.rank] + regions.scratch, kGemmScratchBytes);
  // Ring steps in pieces of their rows (tp_heuristics), so that the first piece travels while
  // the next is computed and the next rank's GEMMs wait for a piece, not a whole step.
  const double flops = 2.0 * static_cast<double>(g.a.rows) * n * g.a.cols;
  const double pushed_bytes = static_cast<double>(world - 1) * m * n * shape.out_bytes;  // by each rank
  TpShape candidate = shape;
  candidate.decomposed = true;
  candidate.split = decomposed_split(d.settings, rs_decomposed_split(flops, pushed_bytes, m));
  candidate.scale_bias = needs_scaled_bias(g);
  candidate.agree_only = false;  // its GEMMs tell whether cuBLASLt takes the call
  bool decomposed = false;
  DG_RETURN_IF_ERROR(use_decomposed(d, unsupported_gemm(d, peers, make_plan(candidate), pieces),
                                    rs_auto_prefers_fused(flops), &decomposed));
  if (decomposed) {
    candidate.agree_only = shape.agree_only;
    shape = candidate;
  } else {
    shape.split = rs_fused_split(d.settings, flops / world / 2);
  }
  const TpPlan plan = make_plan(shape);
  // What the peers must agree on besides the plan: the dtype of the partial sums they push.
  return execute(d, peers, plan, static_cast<uint32_t>(g.d.dtype), kTagReduceScatter,
                 decomposed ? static_cast<const GemmConsumer&>(pieces) : fused, stream);
}

#include "tp/tp_call.h"

#include <algorithm>
#include <cmath>

#include "common/checked_math.h"
#include "common/device.h"
#include "common/dtype.h"
#include "common/error_state.h"
#include "common/status.h"
#include "tp/tp_kernels.cuh"

namespace distgemm::tp {

dg_status check_tp(const dg_tp_desc* d, Peers* peers) {
  DG_REQUIRE(d != nullptr, "desc must not be NULL");
  DG_REQUIRE(d->world >= 2 && d->world <= kMaxWorld, "world size must be in [2, ", kMaxWorld, "], got ", d->world);
  DG_REQUIRE(d->rank >= 0 && d->rank < d->world, "rank ", d->rank, " is out of range for world size ", d->world);
  DG_REQUIRE(d->peer_workspaces != nullptr, "peer_workspaces must not be NULL");
  DG_REQUIRE(std::isfinite(d->timeout_s) && d->timeout_s > 0,
             "timeout_s must be a finite positive number of seconds, got ", d->timeout_s);
  const dg_tp_settings& set = d->settings;
  const int algo = raw_enum(set.algo);
  DG_REQUIRE(algo == DG_TP_ALGO_AUTO || algo == DG_TP_ALGO_FUSED || algo == DG_TP_ALGO_DECOMPOSED,
             "settings.algo must be DG_TP_ALGO_AUTO, _FUSED or _DECOMPOSED, got ", algo);
  DG_REQUIRE(set.pieces >= 0 && set.pieces <= kMaxPieces, "settings.pieces must be 0 (automatic) or in [1, ",
             kMaxPieces, "], got ", set.pieces);
  DG_REQUIRE(!std::isnan(set.rs_split_gflops), "settings.rs_split_gflops must be a number, got NaN");
  DG_REQUIRE(d->agree_only == 0 || d->agree_only == DG_TP_AGREE_ONLY || d->agree_only == DG_TP_AGREE_ELSEWHERE,
             "agree_only must be 0, DG_TP_AGREE_ONLY or DG_TP_AGREE_ELSEWHERE, got ", d->agree_only);
  // The plans write rows of out contiguously, at its row_stride: any other layout would put
  // elements outside the view (col_stride 0 writes N-1 past it).
  DG_REQUIRE(d->gemm.d.col_stride == 1 && d->gemm.d.row_stride >= d->gemm.d.cols,
             "gemm.d (out) must be row-major: col_stride 1 and row_stride >= cols = ", d->gemm.d.cols,
             ", got strides (", d->gemm.d.row_stride, ", ", d->gemm.d.col_stride, ")");
  for (int r = 0; r < d->world; ++r) {
    DG_REQUIRE(d->peer_workspaces[r] != nullptr && (reinterpret_cast<uintptr_t>(d->peer_workspaces[r]) & 255u) == 0,
               "the workspace of rank ", r, " must be a 256-byte aligned device pointer");
    peers->base[r] = static_cast<char*>(d->peer_workspaces[r]);
  }
  peers->device = current_device();
  return check_no_earlier_failure(peers->device);
}

namespace {

const char* op_name(int tag) {
  return tag == kTagAllGather       ? "all-gather + GEMM"
         : tag == kTagReduceScatter ? "GEMM + reduce-scatter"
                                    : "tensor-parallel call";
}

const char* reason_text(int reason) {
  switch (reason) {
    case kReasonOutOfStep:
      return "is at another call (the ranks' call counts differ: an earlier call failed or "
             "was skipped on one side)";
    case kReasonPlan:
      return "runs another op, algorithm or piece split (the settings: algo, pieces and "
             "rs_split_gflops must match on every rank)";
    case kReasonRows:
      return "passed another number of rows";
    case kReasonWidth:
      return "passed another K (all-gather) or N (reduce-scatter)";
    case kReasonDtypes:
      return "passed other dtypes or FP8 scale modes";
    case kReasonWorld:
      return "has another group size";
    case kReasonElsewhere:
      return "runs the call elsewhere than the other (one through the collectives fallback, "
             "for dtypes or a K or N the fused kernels cannot take, or another backend "
             "setting; the other on the workspaces)";
  }
  return "disagrees";
}

}  // namespace

dg_status check_no_earlier_failure(int device) {
  const ErrorState* err = error_state(device);
  if (!err) return DG_ERROR_CUDA;
  const int code = *reinterpret_cast<const volatile int*>(err->host_word);
  if (code == 0) return DG_SUCCESS;
  const int reason = code >> kErrorReasonShift;
  const int tag = code & (0xff << kErrorPeerBits);
  const int peer = (code & ((1 << kErrorPeerBits) - 1)) - 1;
  if (reason == kReasonPeerFailed)
    return fail(DG_ERROR_TIMEOUT,
                cat("in a ", op_name(tag), " on device ", device, ": group rank ", peer,
                    " had given up on the call (it waited past its timeout for this rank, or an earlier call "
                    "of its failed); the outputs of this call were filled with NaN rather than read what that "
                    "rank still wrote. The group must be re-synchronised (dg_tp_clear_error on every rank, and "
                    "new workspaces) before the next call"));
  if (reason == kReasonTimeout)
    return fail(DG_ERROR_TIMEOUT,
                cat("a ", op_name(tag), " on device ", device, " waited past its timeout for rank ", peer,
                    ", which never arrived (died, hung, or was not in the call); the "
                    "outputs of that call were filled with NaN. The group must be re-synchronised "
                    "(dg_tp_clear_error on every rank, and new workspaces) before the next call"));
  return fail(
      DG_ERROR_PEER_MISMATCH,
      cat("the ranks disagree: in a ", op_name(tag), " on device ", device, " rank ", peer, " ", reason_text(reason),
          "; the outputs of that call were filled with NaN. The group must be "
          "re-synchronised (dg_tp_clear_error on every rank, and new workspaces) before the next call"));
}

CallSignature call_signature(const TpPlan& plan, uint32_t dtypes) {
  const TpShape& s = plan.shape;
  const int64_t width = s.kind == DG_TP_ALL_GATHER_GEMM ? s.k : s.n;
  CallSignature sig;
  sig.words[CallSignature::kPlan] = static_cast<uint32_t>(s.kind) | (s.decomposed ? 1u << 4 : 0u) |
                                    static_cast<uint32_t>(plan.cut.count) << 8 | (s.split.tapered ? 1u << 12 : 0u) |
                                    (s.elsewhere ? CallSignature::kElsewhere : 0u);
  sig.words[CallSignature::kRows] = static_cast<uint32_t>(s.m);
  sig.words[CallSignature::kRowsHigh] = static_cast<uint32_t>(static_cast<uint64_t>(s.m) >> 32);
  sig.words[CallSignature::kWidth] = static_cast<uint32_t>(width);
  sig.words[CallSignature::kDtypes] = dtypes;
  sig.words[CallSignature::kWorld] = static_cast<uint32_t>(s.world);
  return sig;
}

dg_status use_decomposed(const dg_tp_desc& d, const char* why_not, bool auto_fused, bool* decomposed) {
  const dg_tp_algo algo = d.settings.algo;
  if (algo == DG_TP_ALGO_DECOMPOSED && why_not)
    return fail(DG_ERROR_NOT_SUPPORTED, cat("the decomposed algorithm does not take ", why_not));
  *decomposed = !why_not && (algo == DG_TP_ALGO_DECOMPOSED || (algo == DG_TP_ALGO_AUTO && !auto_fused));
  return DG_SUCCESS;
}

dg_status check_exchange_size(int world, int64_t rows, int64_t cols, const dg_dtype& dtype, const char* what) {
  const int code = raw_enum(dtype);
  DG_REQUIRE(code >= DG_F32 && code <= DG_E5M2, what, " has an unknown dtype (", code, ")");
  DG_REQUIRE(rows >= 1 && cols >= 1, what, " must have at least one row and column, got (", rows, ", ", cols, ")");
  int64_t bytes = 0;
  DG_REQUIRE(checked_product({world, rows, cols, dtype_bytes(dtype)}, &bytes) && bytes < (int64_t{1} << 48), what,
             " of (", rows, ", ", cols, ") ", dtype_name(dtype), " on ", world,
             " ranks needs a workspace beyond 256 TiB");
  return DG_SUCCESS;
}

dg_status check_scale_a(const dg_tp_desc& d, int64_t rows, const char* rows_name) {
  const dg_gemm_desc& g = d.gemm;
  DG_REQUIRE(!g.scale_a || g.scale_a_len == 1 || g.scale_a_len == rows || (elsewhere(d) && g.scale_a_len % rows == 0),
             "scale_a must hold 1 or ", rows_name, " = ", rows, " values",
             elsewhere(d) ? ", or a multiple of them (blocks along K)" : "");
  return DG_SUCCESS;
}

uint32_t elsewhere_dtypes(const dg_gemm_desc& g) {
  const uint32_t scales = !g.scale_a ? 0u : g.scale_a_len == 1 ? 1u : g.scale_a_len == g.a.rows ? 2u : 3u;
  return static_cast<uint32_t>(g.a.dtype) | static_cast<uint32_t>(g.d.dtype) << 8 | scales << 16;
}

bool needs_scaled_bias(const dg_gemm_desc& g) { return g.c.data && g.c.rows == 1 && g.beta != 0.f && g.beta != 1.f; }

TpShape base_shape(dg_tp_kind kind, const dg_tp_desc& d) {
  TpShape s;
  s.kind = kind;
  s.rank = d.rank;
  s.world = d.world;
  s.in_bytes = dtype_bytes(d.gemm.a.dtype);
  s.out_bytes = dtype_bytes(d.gemm.d.dtype);
  s.agree_only = d.agree_only != 0;
  s.elsewhere = elsewhere(d);
  return s;
}

}  // namespace distgemm::tp

using namespace distgemm;
using namespace distgemm::tp;

extern "C" dg_status dg_tp_workspace_size(dg_tp_kind kind, const dg_tp_desc* desc, size_t* bytes) {
  DG_REQUIRE(desc != nullptr && bytes != nullptr, "desc and bytes must not be NULL");
  DG_REQUIRE(kind == DG_TP_ALL_GATHER_GEMM || kind == DG_TP_GEMM_REDUCE_SCATTER,
             "kind must be DG_TP_ALL_GATHER_GEMM or DG_TP_GEMM_REDUCE_SCATTER");
  DG_REQUIRE(desc->world >= 2 && desc->world <= kMaxWorld, "world size must be in [2, ", kMaxWorld, "]");
  const dg_gemm_desc& g = desc->gemm;
  if (kind == DG_TP_ALL_GATHER_GEMM) {
    DG_RETURN_IF_ERROR(check_exchange_size(desc->world, g.a.rows, g.a.cols, g.a.dtype, "a (this rank's shard)"));
    // out's width (N) and dtype size the region of the scaled bias
    DG_RETURN_IF_ERROR(check_exchange_size(desc->world, 1, g.d.cols, g.d.dtype, "out"));
  } else {
    DG_RETURN_IF_ERROR(check_exchange_size(desc->world, g.d.rows, g.d.cols, g.d.dtype, "out (this rank's shard)"));
  }
  TpShape shape;  // a's dtype is not read for a reduce-scatter: its workspace holds none of a
  shape.kind = kind;
  shape.world = desc->world;
  shape.in_bytes = kind == DG_TP_ALL_GATHER_GEMM ? dtype_bytes(g.a.dtype) : 0;
  shape.out_bytes = dtype_bytes(g.d.dtype);
  shape.m = kind == DG_TP_ALL_GATHER_GEMM ? g.a.rows : g.d.rows;
  shape.k = g.a.cols;
  shape.n = g.d.cols;
  *bytes = tp_regions(shape).bytes;
  return DG_SUCCESS;
}

// dg_grouped_gemm: argument checks, the instance table and dispatch. Host-only.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <string>
#include <vector>

#include "common/buffer_check.h"
#include "common/checked_math.h"
#include "common/device.h"
#include "common/dtype.h"
#include "common/status.h"
#include "common/tile_heuristic.h"
#include "distgemm/distgemm.h"
#include "grouped/grouped_problem.h"
#include "grouped/fp8_wgrad_layout_check.h"
#include "grouped/grouped_lower.h"

namespace distgemm::grouped {
namespace {

#if defined(DISTGEMM_WITH_SM90)
#define DG_SM90_GROUPED(IN, OUT, KIND, S, TM, TN, CM, CN)     \
  {90,                                                        \
   IN,                                                        \
   OUT,                                                       \
   dg_grouped_kind(KIND),                                     \
   DG_SCALE_NONE,                                             \
   Schedule(S),                                               \
   TM,                                                        \
   TN,                                                        \
   CM,                                                        \
   CN,                                                        \
   #S "_" #TM "x" #TN "_c" #CM "x" #CN,                       \
   &Sm90GroupedKernel<IN, OUT, KIND, S, TM, TN, CM, CN>::run, \
   &Sm90GroupedKernel<IN, OUT, KIND, S, TM, TN, CM, CN>::workspace},
#define DG_SM90_GROUPED_CONTIGUOUS(IN, OUT, KIND, TM, TN, CM)    \
  {90,                                                           \
   IN,                                                           \
   OUT,                                                          \
   dg_grouped_kind(KIND),                                        \
   DG_SCALE_NONE,                                                \
   gemm::kContiguous,                                            \
   TM,                                                           \
   TN,                                                           \
   CM,                                                           \
   1,                                                            \
   "contig_" #TM "x" #TN "_c" #CM "x1",                          \
   &Sm90GroupedContiguousKernel<IN, OUT, KIND, TM, TN, CM>::run, \
   &Sm90GroupedContiguousKernel<IN, OUT, KIND, TM, TN, CM>::workspace},
#define DG_SM90_GROUPED_CONTIGUOUS_WGRAD(IN, OUT, TM, TN)   \
  {90,                                                      \
   IN,                                                      \
   OUT,                                                     \
   DG_GROUPED_WGRAD,                                        \
   DG_SCALE_NONE,                                           \
   gemm::kContiguous,                                       \
   TM,                                                      \
   TN,                                                      \
   1,                                                       \
   1,                                                       \
   "contig_" #TM "x" #TN "_c1x1",                           \
   &Sm90GroupedContiguousWgradKernel<IN, OUT, TM, TN>::run, \
   &Sm90GroupedContiguousWgradKernel<IN, OUT, TM, TN>::workspace},
// An FP8 instance whose A operand is IN (e4m3, or e5m2 for a gradient) against an e4m3 B.
#define DG_SM90_FP8_GROUPED_OF(IN, PREFIX, MODE, OUT, KIND, S, TM, TN, CM, CN) \
  {90,                                                                         \
   IN,                                                                         \
   OUT,                                                                        \
   dg_grouped_kind(KIND),                                                      \
   dg_scale_mode(MODE),                                                        \
   Schedule(S),                                                                \
   TM,                                                                         \
   TN,                                                                         \
   CM,                                                                         \
   CN,                                                                         \
   PREFIX #MODE "_" #S "_" #TM "x" #TN "_c" #CM "x" #CN,                       \
   &Sm90Fp8GroupedKernel<MODE, OUT, KIND, S, TM, TN, CM, CN, IN>::run,         \
   &Sm90Fp8GroupedKernel<MODE, OUT, KIND, S, TM, TN, CM, CN, IN>::workspace},
#define DG_SM90_FP8_GROUPED(...) DG_SM90_FP8_GROUPED_OF(DG_E4M3, "", __VA_ARGS__)
#define DG_SM90_FP8_E5M2_GROUPED(...) DG_SM90_FP8_GROUPED_OF(DG_E5M2, "e5m2_", __VA_ARGS__)
#else
#define DG_SM90_GROUPED(...)
#define DG_SM90_GROUPED_CONTIGUOUS(...)
#define DG_SM90_GROUPED_CONTIGUOUS_WGRAD(...)
#define DG_SM90_FP8_GROUPED(...)
#define DG_SM90_FP8_E5M2_GROUPED(...)
#endif

// The compiled kernels, then a sentinel (arch 0) that keeps the array non-empty in a build
// without any arch (the host-checks build); kInstances is the table without it.
const GroupedInstance kInstanceTable[] = {
#include "grouped/grouped_instances.def"
#include "grouped/grouped_fp8_instances.def"
#if defined(DISTGEMM_TUNING_INSTANCES)
#include "grouped/grouped_instances_tuning.def"
#include "grouped/grouped_fp8_instances_tuning.def"
#endif
    GroupedInstance{},
};
#undef DG_SM90_GROUPED
#undef DG_SM90_GROUPED_CONTIGUOUS
#undef DG_SM90_GROUPED_CONTIGUOUS_WGRAD
#undef DG_SM90_FP8_GROUPED
#undef DG_SM90_FP8_E5M2_GROUPED
#undef DG_SM90_FP8_GROUPED_OF

struct InstanceList {
  const GroupedInstance* begin() const { return kInstanceTable; }
  const GroupedInstance* end() const { return kInstanceTable + std::size(kInstanceTable) - 1; }
};
constexpr InstanceList kInstances{};

const char* kind_name(dg_grouped_kind kind) {
  switch (kind) {
    case DG_GROUPED_FORWARD:
      return "forward";
    case DG_GROUPED_DGRAD:
      return "dgrad";
    case DG_GROUPED_WGRAD:
      return "wgrad";
  }
  return "unknown";
}

// The kernels for d's kind and dtypes, compared as the raw ints the caller stored (this also
// serves unchecked descs: dg_grouped_gemm_config_count / _name).
std::vector<const GroupedInstance*> candidates(const dg_grouped_desc& d, int device_arch) {
  std::vector<const GroupedInstance*> out;
  const int kind = raw_enum(d.kind), in = raw_enum(d.in_dtype), o = raw_enum(d.out_dtype);
  const int mode = raw_enum(d.scale_mode);
  for (const GroupedInstance& inst : kInstances)
    if (device_arch > 0 && inst.arch == device_arch && inst.in == in && inst.out == o && inst.kind == kind &&
        inst.scale_mode == mode)
      out.push_back(&inst);
  return out;
}

constexpr int64_t kInt32Limit = int64_t(1) << 31;

// A dtype as the caller stored it, for messages.
std::string dtype_str(int raw) {
  return raw >= DG_F32 && raw <= DG_I32 ? dtype_name(static_cast<dg_dtype>(raw)) : cat("dtype ", raw);
}

std::string shape_str(const dg_grouped_shape& s) {
  if (s.ndim < 0 || s.ndim > 3) return cat("a ", s.ndim, "-D tensor");
  std::string out = "(";
  for (int i = 0; i < s.ndim; ++i) out += cat(i ? ", " : "", s.size[i]);
  return out + (s.ndim == 1 ? ",)" : ")");
}

// `name` (the `role` operand) has `ndim` dimensions of the given sizes; `expected` spells them.
dg_status check_shape(const dg_grouped_shape& s, const char* name, const char* role,
                      std::initializer_list<int64_t> sizes, const std::string& expected) {
  bool same = s.ndim == static_cast<int>(sizes.size());
  for (size_t i = 0; same && i < sizes.size(); ++i) same = s.size[i] == sizes.begin()[i];
  DG_REQUIRE(same, name, " (", role, ") must have shape ", expected, ", got ", shape_str(s));
  return DG_SUCCESS;
}

// FP8: the dtypes, kind and scale mode this build's kernels take.
dg_status check_fp8_mode(const dg_grouped_desc& d, int in, int out) {
  const int kind = raw_enum(d.kind), mode = raw_enum(d.scale_mode);
  DG_REQUIRE(in == DG_E4M3 || in == DG_E5M2,
             "FP8 grouped GEMMs take float8_e4m3fn inputs, or a float8_e5m2 a (a gradient) against an "
             "e4m3 b, got ",
             dtype_str(in));
  DG_REQUIRE(mode == DG_SCALE_ROW || mode == DG_SCALE_BLOCK, "scale_mode must be ROW or BLOCK for FP8 inputs, got ",
             mode);
  DG_REQUIRE(kind != DG_GROUPED_DGRAD,
             "FP8 operands are read K-major only: run a dgrad as FORWARD on w transposed to "
             "(G, K, N) contiguous, with its block scales transposed");
  if (kind == DG_GROUPED_WGRAD) {
    DG_REQUIRE(mode == DG_SCALE_BLOCK, "FP8 wgrad takes BLOCK scales (per 128 tokens), got ROW");
    DG_REQUIRE(out == DG_F32, "FP8 wgrad writes float32, got out dtype ", dtype_str(out));
  } else {
    DG_REQUIRE(out == DG_BF16, "FP8 grouped forward writes bfloat16, got out dtype ", dtype_str(out));
  }
  return DG_SUCCESS;
}

// FP8: the scale tensors' shapes and extents, as dg_grouped_desc lays them out.
dg_status check_fp8_scales(const dg_grouped_desc& d, int64_t groups, int64_t tokens, int64_t n, int64_t k,
                           int64_t token_pitch) {
  const int64_t kb = (k + 127) / 128, nb = (n + 127) / 128, blocks = token_pitch / 128;
  const dg_grouped_shape &sa = d.scale_a_shape, &sb = d.scale_b_shape;
  if (d.kind == DG_GROUPED_WGRAD) {
    DG_RETURN_IF_ERROR(
        check_shape(sa, "scale_a", "dy's scales", {blocks, n}, cat("(Tp / 128, N) = (", blocks, ", ", n, ")")));
    DG_RETURN_IF_ERROR(
        check_shape(sb, "scale_b", "x's scales", {blocks, k}, cat("(Tp / 128, K) = (", blocks, ", ", k, ")")));
    DG_RETURN_IF_ERROR(check_extent(d.scale_a, "scale_a", {blocks, n}, 4, 4));
    return check_extent(d.scale_b, "scale_b", {blocks, k}, 4, 4);
  }
  if (d.scale_mode == DG_SCALE_ROW) {
    DG_RETURN_IF_ERROR(check_shape(sa, "scale_a", "x's row scales", {tokens}, cat("(T,) = (", tokens, ",)")));
    DG_RETURN_IF_ERROR(
        check_shape(sb, "scale_b", "w's row scales", {groups, n}, cat("(G, N) = (", groups, ", ", n, ")")));
    DG_RETURN_IF_ERROR(check_extent(d.scale_a, "scale_a", {tokens}, 4, 4));
    return check_extent(d.scale_b, "scale_b", {groups, n}, 4, 4);
  }
  DG_RETURN_IF_ERROR(check_shape(sa, "scale_a", "x's 1 x 128 scales", {tokens, kb},
                                 cat("(T, ceil(K / 128)) = (", tokens, ", ", kb, ")")));
  DG_RETURN_IF_ERROR(check_shape(sb, "scale_b", "w's 128 x 128 scales", {groups, kb, nb},
                                 cat("(G, ceil(K / 128), ceil(N / 128)) = (", groups, ", ", kb, ", ", nb, ")")));
  DG_REQUIRE(d.scale_a_ld >= std::max<int64_t>(tokens, 1),
             "scale_a_ld (the stride between x's K "
             "blocks of scales) must be at least T = ",
             tokens, ", got ", d.scale_a_ld);
  int64_t span = 0;
  DG_REQUIRE(checked_mul(kb - 1, d.scale_a_ld, &span) && checked_add(span, tokens, &span),
             "scale_a spans more than 2^63 elements");
  DG_RETURN_IF_ERROR(check_extent(d.scale_a, "scale_a", {span}, 4, 4));
  return check_extent(d.scale_b, "scale_b", {groups, kb, nb}, 4, 4);
}

// What a descriptor's shapes say of its problem: T, N, K, and the FP8 wgrad's padded T.
struct Extents {
  int64_t tokens = 0;
  int64_t n = 0;
  int64_t k = 0;
  int64_t token_pitch = 0;
};

// T, N and K within what the kernels index (offs are int32).
dg_status check_ranges(const Extents& e, const char* a_name, const dg_grouped_shape& as, const char* b_name,
                       const dg_grouped_shape& bs) {
  DG_REQUIRE(e.tokens >= 0 && e.tokens < kInt32Limit, a_name,
             " must have between 0 and 2^31 - 1 rows (T; offs are int32), got ", shape_str(as));
  DG_REQUIRE(e.n >= 1 && e.n < kInt32Limit && e.k >= 1 && e.k < kInt32Limit,
             "N and K must be in [1, 2^31), got N=", e.n, " K=", e.k, " from ", a_name, " ", shape_str(as), " and ",
             b_name, " ", shape_str(bs));
  return DG_SUCCESS;
}

// FORWARD (x (T, K), w (G, N, K)) and DGRAD (dy (T, K), w (G, K, N)): out (T, N).
dg_status lower_forward_shapes(const dg_grouped_desc& d, int kind, int64_t groups, bool fp8, Extents* e) {
  const bool fwd = kind == DG_GROUPED_FORWARD;
  const dg_grouped_shape &as = d.a_shape, &bs = d.b_shape;
  DG_REQUIRE(as.ndim == 2, "x (a) must be 2-D (T, K), got ", shape_str(as));
  DG_REQUIRE(bs.ndim == 3, "w (b) must be ", fwd ? "3-D (G, N, K)" : "3-D (G, K, N)", ", got ", shape_str(bs));
  e->tokens = as.size[0];
  e->n = fwd ? bs.size[1] : bs.size[2];
  e->k = as.size[1];
  DG_RETURN_IF_ERROR(check_ranges(*e, "x", as, "w", bs));
  const int64_t tokens = e->tokens, n = e->n, k = e->k;
  DG_RETURN_IF_ERROR(check_shape(bs, "w", "b", {groups, fwd ? n : k, fwd ? k : n},
                                 cat(fwd ? "(G, N, K) = (" : "(G, K, N) = (", groups, ", ", fwd ? "N" : cat(k), ", ",
                                     fwd ? cat(k) : "N", ") (offs' groups, x's K columns)")));
  DG_RETURN_IF_ERROR(
      check_shape(d.out_shape, "out", "out", {tokens, n}, cat("(T, N) = (", tokens, ", ", n, ") (x's rows, w's N)")));
  const int in = raw_enum(d.in_dtype), out = raw_enum(d.out_dtype);
  const int in_bytes = dtype_bytes(d.in_dtype), out_bytes = dtype_bytes(d.out_dtype);
  const int in_elems = 16 / in_bytes, out_elems = 16 / out_bytes;
  if (fp8) {
    // x and w are K-major: only their rows need 16-byte alignment.
    DG_REQUIRE(k % in_elems == 0, "K=", k, " must be a multiple of ", in_elems, " (16 bytes of ", dtype_str(in), ")");
    DG_REQUIRE(n % out_elems == 0, "N=", n, " must be a multiple of ", out_elems, " (16-byte rows of the ",
               dtype_str(out), " out)");
  } else {
    DG_REQUIRE(n % in_elems == 0 && k % in_elems == 0, "N=", n, " and K=", k, " must be multiples of ", in_elems,
               " (16 bytes of ", dtype_str(in), ")");
    DG_REQUIRE(n % out_elems == 0, "out rows of ", n, " ", dtype_str(out), " elements must be a multiple of 16 bytes");
  }
  DG_RETURN_IF_ERROR(check_extent(d.a, "x", {tokens, k}, in_bytes));
  DG_RETURN_IF_ERROR(check_extent(d.b, "w", {groups, n, k}, in_bytes));
  return check_extent(d.out, "out", {tokens, n}, out_bytes);
}

// The wgrad's out (G, N, K).
dg_status check_wgrad_out(const dg_grouped_desc& d, int64_t groups, const Extents& e, bool padded) {
  return check_shape(d.out_shape, "out", "out", {groups, e.n, e.k},
                     cat("(G, N, K) = (", groups, ", ", e.n, ", ", e.k, ") (offs' groups, dy's and x's ",
                         padded ? "rows)" : "columns)"));
}

// 16-bit WGRAD: dy (T, N), x (T, K), out (G, N, K).
dg_status lower_wgrad_shapes(const dg_grouped_desc& d, int64_t groups, Extents* e) {
  const dg_grouped_shape &as = d.a_shape, &bs = d.b_shape;
  DG_REQUIRE(as.ndim == 2, "dy (a) must be 2-D (T, N), got ", shape_str(as));
  DG_REQUIRE(bs.ndim == 2, "x (b) must be 2-D (T, K), got ", shape_str(bs));
  e->tokens = as.size[0];
  e->n = as.size[1];
  e->k = bs.size[1];
  DG_RETURN_IF_ERROR(check_ranges(*e, "dy", as, "x", bs));
  const int64_t tokens = e->tokens, n = e->n, k = e->k;
  DG_RETURN_IF_ERROR(check_shape(bs, "x", "b", {tokens, k}, cat("(T, K) with dy's T = ", tokens, " rows")));
  DG_RETURN_IF_ERROR(check_wgrad_out(d, groups, *e, false));
  const int in = raw_enum(d.in_dtype), out = raw_enum(d.out_dtype);
  const int in_bytes = dtype_bytes(d.in_dtype), out_bytes = dtype_bytes(d.out_dtype);
  const int in_elems = 16 / in_bytes, out_elems = 16 / out_bytes;
  DG_REQUIRE(n % in_elems == 0 && k % in_elems == 0, "N=", n, " and K=", k, " must be multiples of ", in_elems,
             " (16 bytes of ", dtype_str(in), ")");
  DG_REQUIRE(k % out_elems == 0, "out rows of ", k, " ", dtype_str(out), " elements must be a multiple of 16 bytes");
  DG_RETURN_IF_ERROR(check_extent(d.a, "dy", {tokens, n}, in_bytes));
  DG_RETURN_IF_ERROR(check_extent(d.b, "x", {tokens, k}, in_bytes));
  return check_extent(d.out, "out", {groups, n, k}, out_bytes);
}

// FP8 WGRAD: dy^T (N, Tp) and x^T (K, Tp) padded per group, out (G, N, K) float32.
dg_status lower_padded_wgrad_shapes(const dg_grouped_desc& d, int64_t groups, Extents* e) {
  const dg_grouped_shape &as = d.a_shape, &bs = d.b_shape;
  DG_REQUIRE(as.ndim == 2, "dy (a) must be 2-D (N, Tp), got ", shape_str(as));
  DG_REQUIRE(bs.ndim == 2, "x (b) must be 2-D (K, Tp), got ", shape_str(bs));
  e->n = as.size[0];
  e->k = bs.size[0];
  e->token_pitch = as.size[1];
  DG_REQUIRE(e->token_pitch % 128 == 0 && e->token_pitch / 128 >= groups && e->token_pitch < kInt32Limit,
             "dy (a) must be (N, Tp) with Tp = 128 * (ceil(T / 128) + G), a multiple of 128 of "
             "at least 128 G = ",
             128 * groups,
             " (the padded layout of quantize_fp8 with offs), "
             "got ",
             shape_str(as));
  e->tokens = e->token_pitch - 128 * groups;
  DG_RETURN_IF_ERROR(check_ranges(*e, "dy", as, "x", bs));
  const int64_t n = e->n, k = e->k, token_pitch = e->token_pitch;
  DG_RETURN_IF_ERROR(
      check_shape(bs, "x", "b", {k, token_pitch}, cat("(K, Tp) with dy's Tp = ", token_pitch, " columns")));
  DG_RETURN_IF_ERROR(check_wgrad_out(d, groups, *e, true));
  const int in_bytes = dtype_bytes(d.in_dtype), out_bytes = dtype_bytes(d.out_dtype);
  const int out_elems = 16 / out_bytes;
  DG_REQUIRE(k % out_elems == 0, "K=", k, " must be a multiple of ", out_elems, " (16-byte rows of the float32 out)");
  DG_RETURN_IF_ERROR(check_extent(d.a, "dy", {n, token_pitch}, in_bytes));
  DG_RETURN_IF_ERROR(check_extent(d.b, "x", {k, token_pitch}, in_bytes));
  return check_extent(d.out, "out", {groups, n, k}, out_bytes);
}

// out shares no byte with the operands, offs or the scales (each checked in bounds before).
dg_status check_buffers_apart(const dg_grouped_desc& d, int kind, bool fp8, int64_t groups, const Extents& e) {
  const int64_t in = dtype_bytes(d.in_dtype), out = dtype_bytes(d.out_dtype);
  const int64_t t = e.tokens, n = e.n, k = e.k, tp = e.token_pitch;
  const bool wgrad = kind == DG_GROUPED_WGRAD;
  const char* a_name = wgrad ? "dy" : "x";
  const char* b_name = wgrad ? "x" : "w";
  const int64_t a_bytes = wgrad ? (fp8 ? n * tp : t * n * in) : t * k * in;
  const int64_t b_bytes = wgrad ? (fp8 ? k * tp : t * k * in) : groups * n * k * in;
  const int64_t out_bytes = wgrad ? groups * n * k * out : t * n * out;
  int64_t sa = 0, sb = 0;  // the scales' bytes
  if (fp8) {
    const int64_t kb = (k + 127) / 128, nb = (n + 127) / 128;
    if (wgrad) {
      sa = 4 * (tp / 128) * n;
      sb = 4 * (tp / 128) * k;
    } else if (d.scale_mode == DG_SCALE_ROW) {
      sa = 4 * t;
      sb = 4 * groups * n;
    } else {
      sa = 4 * ((kb - 1) * d.scale_a_ld + t);
      sb = 4 * groups * kb * nb;
    }
  }
  return check_no_overlap({{"out", d.out, out_bytes, true},
                           {a_name, d.a, a_bytes, false},
                           {b_name, d.b, b_bytes, false},
                           {"offs", d.offs, 4 * groups, false},
                           {"scale_a", d.scale_a, sa, false},
                           {"scale_b", d.scale_b, sb, false}});
}

}  // namespace

dg_status lower(const dg_grouped_desc* desc, GroupedProblem* p) {
  DG_REQUIRE(desc != nullptr, "desc must not be NULL");
  const dg_grouped_desc& d = *desc;
  const int kind = raw_enum(d.kind);
  DG_REQUIRE(kind == DG_GROUPED_FORWARD || kind == DG_GROUPED_DGRAD || kind == DG_GROUPED_WGRAD,
             "kind must be forward, dgrad or wgrad, got ", kind);
  const int in = raw_enum(d.in_dtype), out = raw_enum(d.out_dtype);
  const bool fp8 = in == DG_E4M3 || in == DG_E5M2;
  if (fp8) {
    DG_RETURN_IF_ERROR(check_fp8_mode(d, in, out));
  } else {
    DG_REQUIRE(in == DG_BF16 || in == DG_F16, "inputs must be bfloat16, float16 or float8_e4m3fn, got ", dtype_str(in));
    DG_REQUIRE(out == in || out == DG_F32, "out dtype must be ", dtype_str(in), " or float32, got ", dtype_str(out));
    DG_REQUIRE(raw_enum(d.scale_mode) == DG_SCALE_NONE, "scale_mode must be NONE for bfloat16/float16 inputs");
  }
  DG_REQUIRE(d.config >= -1, "config must be -1 (the heuristic's choice) or a kernel index, got ", d.config);
  const int64_t groups = d.num_groups;
  DG_REQUIRE(groups >= 1 && groups < kInt32Limit, "offs must hold between 1 and 2^31 - 1 group ends (num_groups), got ",
             groups);
  DG_RETURN_IF_ERROR(check_extent(d.offs, "offs", {groups}, 4, 4));

  // The problem, read off the shapes; then every shape against it, by kind.
  Extents e;
  if (kind != DG_GROUPED_WGRAD) {
    DG_RETURN_IF_ERROR(lower_forward_shapes(d, kind, groups, fp8, &e));
  } else if (fp8) {
    DG_RETURN_IF_ERROR(lower_padded_wgrad_shapes(d, groups, &e));
  } else {
    DG_RETURN_IF_ERROR(lower_wgrad_shapes(d, groups, &e));
  }
  const int64_t tokens = e.tokens, n = e.n, k = e.k, token_pitch = e.token_pitch;
  if (fp8) DG_RETURN_IF_ERROR(check_fp8_scales(d, groups, tokens, n, k, token_pitch));
  DG_RETURN_IF_ERROR(check_buffers_apart(d, kind, fp8, groups, e));
  p->kind = d.kind;
  p->groups = static_cast<int>(groups);
  p->offs = d.offs;
  p->tokens = tokens;
  p->n = n;
  p->k = k;
  p->a = d.a;
  p->b = d.b;
  p->d = d.out;
  p->accumulate = d.accumulate != 0;
  p->scale_mode = fp8 ? d.scale_mode : DG_SCALE_NONE;
  p->scale_a = fp8 ? d.scale_a : nullptr;
  p->scale_b = fp8 ? d.scale_b : nullptr;
  p->scale_a_ld = fp8 ? d.scale_a_ld : 0;
  p->token_pitch = token_pitch;
  return DG_SUCCESS;
}

namespace {

dg_status plan(const dg_grouped_desc* desc, int device_arch, int sm_count, GroupedProblem* p,
               const GroupedInstance** chosen) {
  DG_RETURN_IF_ERROR(lower(desc, p));
  auto list = candidates(*desc, device_arch);
  if (device_arch <= 0)
    return fail(DG_ERROR_NOT_SUPPORTED,
                cat("no usable CUDA device (device arch ", device_arch, "): distgemm's grouped kernels run on sm_90"));
  if (list.empty())
    return fail(DG_ERROR_NOT_SUPPORTED,
                cat("no sm_", device_arch, " grouped ", kind_name(desc->kind), " kernel in this build for ",
                    dtype_name(desc->in_dtype), " -> ", dtype_name(desc->out_dtype)));
  if (desc->config >= 0) {
    DG_REQUIRE(desc->config < static_cast<int>(list.size()), "config ", desc->config, " out of range: ", list.size(),
               " configs");
    *chosen = list[desc->config];
  } else {
    // The cost model counts K in 16-bit elements: FP8 tensor cores do twice the work per cycle.
    const double per_16bit = p->scale_mode == DG_SCALE_NONE ? 1.0 : 0.5;
    const double epilogue_scale = dtype_bytes(desc->out_dtype) / 2.0;
    if (p->kind == DG_GROUPED_WGRAD) {  // every group is an N x K tile grid, its tokens deep
      const int64_t mean_rows = std::max<int64_t>(1, p->tokens / p->groups);
      *chosen = select_cheapest(list, p->n, p->k, per_16bit * mean_rows, p->groups, sm_count, epilogue_scale);
    } else {  // forward and dgrad: G groups of unknown sizes, each padded to its cluster granule
      *chosen = select_cheapest_by(list, [&](const TileConfig& c) {
        return estimate_grouped_cost(c, p->tokens, p->groups, p->n, per_16bit * p->k, sm_count, epilogue_scale);
      });
    }
  }
  p->sm_count = sm_count;
  return DG_SUCCESS;
}

}  // namespace
}  // namespace distgemm::grouped

using namespace distgemm;
using namespace distgemm::grouped;

extern "C" dg_status dg_grouped_gemm_workspace_size(const dg_grouped_desc* desc, size_t* bytes) {
  DG_REQUIRE(bytes != nullptr, "bytes must not be NULL");
  const DeviceInfo& dev = device_info();
  GroupedProblem p;
  const GroupedInstance* inst = nullptr;
  DG_RETURN_IF_ERROR(plan(desc, dev.arch, dev.sm_count, &p, &inst));
  *bytes = inst->workspace(p);
  return DG_SUCCESS;
}

extern "C" dg_status dg_grouped_gemm(const dg_grouped_desc* desc, void* workspace, size_t workspace_bytes,
                                     cudaStream_t stream) {
  const int device = current_device();
  const DeviceInfo& dev = device_info(device);
  GroupedProblem p;
  const GroupedInstance* inst = nullptr;
  DG_RETURN_IF_ERROR(plan(desc, dev.arch, dev.sm_count, &p, &inst));
  if (p.tokens == 0 && p.kind != DG_GROUPED_WGRAD) return DG_SUCCESS;  // no rows to write
  const size_t needed = inst->workspace(p);
  DG_REQUIRE(needed == 0 || (workspace != nullptr && workspace_bytes >= needed), "workspace of ", workspace_bytes,
             " bytes is smaller than the ", needed, " needed");
  p.device = device;
  p.workspace = workspace;
  p.workspace_bytes = workspace_bytes;
  DG_RETURN_IF_ERROR(inst->run(p, stream));
  if (p.kind == DG_GROUPED_WGRAD && p.token_pitch > 0) {
    // FP8 wgrad: operands quantized without offs fit the shape checks whenever T is a multiple
    // of 128 and T >= 128 G, and then hold more tokens than the padded layout can (offs, read
    // on the device): the output turns NaN rather than the wrong columns' sums.
    const int64_t count = static_cast<int64_t>(p.groups) * p.n * p.k;
    DG_CUDA_RETURN(
        launch_fp8_wgrad_layout_check(p.offs, p.groups, p.tokens, static_cast<float*>(p.d), count, p.sm_count, stream));
  }
  return DG_SUCCESS;
}

extern "C" int dg_grouped_gemm_config_count(const dg_grouped_desc* desc, int device_arch) {
  return desc ? static_cast<int>(candidates(*desc, device_arch).size()) : 0;
}

extern "C" const char* dg_grouped_gemm_config_name(const dg_grouped_desc* desc, int device_arch, int config) {
  if (!desc) return nullptr;
  auto list = candidates(*desc, device_arch);
  return config >= 0 && config < static_cast<int>(list.size()) ? list[config]->name : nullptr;
}

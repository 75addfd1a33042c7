// dg_grouped_gemm: argument checks, the instance table and dispatch. Host-only.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <string>
#include <vector>

#include "common/checked_math.h"
#include "common/device.h"
#include "common/dtype.h"
#include "common/status.h"
#include "common/tile_heuristic.h"
#include "distgemm/distgemm.h"
#include "grouped/grouped_problem.h"
#include "grouped/grouped_lower.h"

namespace distgemm::grouped {
namespace {

#if defined(DISTGEMM_WITH_SM90)
#define DG_SM90_GROUPED(IN, OUT, KIND, S, TM, TN, CM, CN)                                   \
  {90, IN, OUT, dg_grouped_kind(KIND), Schedule(S), TM, TN, CM, CN,                         \
   #S "_" #TM "x" #TN "_c" #CM "x" #CN,                                                     \
   &Sm90GroupedKernel<IN, OUT, KIND, S, TM, TN, CM, CN>::run,                               \
   &Sm90GroupedKernel<IN, OUT, KIND, S, TM, TN, CM, CN>::workspace},
#else
#define DG_SM90_GROUPED(...)
#endif

// The compiled kernels, then a sentinel (arch 0) that keeps the array non-empty in a build
// without any arch (the host-checks build); kInstances is the table without it.
const GroupedInstance kInstanceTable[] = {
#include "grouped/grouped_instances.def"
#if defined(DISTGEMM_TUNING_INSTANCES)
#include "grouped/grouped_instances_tuning.def"
#endif
    GroupedInstance{},
};
#undef DG_SM90_GROUPED

struct InstanceList {
  const GroupedInstance* begin() const { return kInstanceTable; }
  const GroupedInstance* end() const { return kInstanceTable + std::size(kInstanceTable) - 1; }
};
constexpr InstanceList kInstances{};

const char* kind_name(dg_grouped_kind kind) {
  switch (kind) {
    case DG_GROUPED_FORWARD: return "forward";
    case DG_GROUPED_DGRAD: return "dgrad";
    case DG_GROUPED_WGRAD: return "wgrad";
  }
  return "unknown";
}

// The kernels for d's kind and dtypes, compared as the raw ints the caller stored (this also
// serves unchecked descs: dg_grouped_gemm_config_count / _name).
std::vector<const GroupedInstance*> candidates(const dg_grouped_desc& d, int device_arch) {
  std::vector<const GroupedInstance*> out;
  const int kind = raw_enum(d.kind), in = raw_enum(d.in_dtype), o = raw_enum(d.out_dtype);
  for (const GroupedInstance& inst : kInstances)
    if (device_arch > 0 && inst.arch == device_arch && inst.in == in && inst.out == o && inst.kind == kind)
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

// `name` holds the product of `sizes` elements of `bytes` each at `p`: its byte extent fits in
// int64 and in the address space after p; p is `align`-byte aligned, and NULL only when there
// is nothing to read.
dg_status check_extent(const void* p, const char* name, std::initializer_list<int64_t> sizes,
                       int bytes, unsigned align = 16) {
  int64_t elements = 0, extent = 0;
  DG_REQUIRE(checked_product(sizes, &elements) && checked_mul(elements, bytes, &extent), name,
             " spans more than 2^63 bytes");
  DG_REQUIRE(p != nullptr || elements == 0, name, " must not be NULL");
  DG_REQUIRE((reinterpret_cast<uintptr_t>(p) & (align - 1)) == 0, name, " must be a ", align,
             "-byte aligned device pointer, got ", p);
  DG_REQUIRE(static_cast<uint64_t>(extent) <= UINTPTR_MAX - reinterpret_cast<uintptr_t>(p), name,
             " runs past the end of the address space (", extent, " bytes from ", p, ")");
  return DG_SUCCESS;
}

}  // namespace

dg_status lower(const dg_grouped_desc* desc, GroupedProblem* p) {
  DG_REQUIRE(desc != nullptr, "desc must not be NULL");
  const dg_grouped_desc& d = *desc;
  const int kind = raw_enum(d.kind);
  DG_REQUIRE(kind == DG_GROUPED_FORWARD || kind == DG_GROUPED_DGRAD || kind == DG_GROUPED_WGRAD,
             "kind must be forward, dgrad or wgrad, got ", kind);
  const int in = raw_enum(d.in_dtype), out = raw_enum(d.out_dtype);
  DG_REQUIRE(in == DG_BF16 || in == DG_F16, "inputs must be bfloat16 or float16, got ",
             dtype_str(in));
  DG_REQUIRE(out == in || out == DG_F32, "out dtype must be ", dtype_str(in),
             " or float32, got ", dtype_str(out));
  const int in_bytes = dtype_bytes(d.in_dtype), out_bytes = dtype_bytes(d.out_dtype);
  const int64_t groups = d.num_groups;
  DG_REQUIRE(groups >= 1 && groups < kInt32Limit,
             "offs must hold between 1 and 2^31 - 1 group ends (num_groups), got ", groups);
  DG_RETURN_IF_ERROR(check_extent(d.offs, "offs", {groups}, 4, 4));

  // The problem, read off the shapes; then every shape against it.
  const bool wgrad = kind == DG_GROUPED_WGRAD;
  const char* a_name = wgrad ? "dy" : "x";
  const char* b_name = wgrad ? "x" : "w";
  const dg_grouped_shape& as = d.a_shape;
  const dg_grouped_shape& bs = d.b_shape;
  DG_REQUIRE(as.ndim == 2, a_name, " (a) must be 2-D ", wgrad ? "(T, N)" : "(T, K)", ", got ",
             shape_str(as));
  DG_REQUIRE(bs.ndim == (wgrad ? 2 : 3), b_name, " (b) must be ",
             wgrad ? "2-D (T, K)" : kind == DG_GROUPED_FORWARD ? "3-D (G, N, K)" : "3-D (G, K, N)",
             ", got ", shape_str(bs));
  const int64_t tokens = as.size[0];
  const int64_t n = wgrad ? as.size[1] : kind == DG_GROUPED_FORWARD ? bs.size[1] : bs.size[2];
  const int64_t k = wgrad ? bs.size[1] : as.size[1];
  DG_REQUIRE(tokens >= 0 && tokens < kInt32Limit, a_name,
             " must have between 0 and 2^31 - 1 rows (T; offs are int32), got ", shape_str(as));
  DG_REQUIRE(n >= 1 && n < kInt32Limit && k >= 1 && k < kInt32Limit,
             "N and K must be in [1, 2^31), got N=", n, " K=", k, " from ", a_name, " ",
             shape_str(as), " and ", b_name, " ", shape_str(bs));
  if (wgrad) {
    DG_RETURN_IF_ERROR(check_shape(bs, "x", "b", {tokens, k},
                                   cat("(T, K) with dy's T = ", tokens, " rows")));
    DG_RETURN_IF_ERROR(check_shape(d.out_shape, "out", "out", {groups, n, k},
                                   cat("(G, N, K) = (", groups, ", ", n, ", ", k,
                                       ") (offs' groups, dy's and x's columns)")));
  } else {
    const bool fwd = kind == DG_GROUPED_FORWARD;
    DG_RETURN_IF_ERROR(check_shape(bs, "w", "b", {groups, fwd ? n : k, fwd ? k : n},
                                   cat(fwd ? "(G, N, K) = (" : "(G, K, N) = (", groups, ", ",
                                       fwd ? "N" : cat(k), ", ", fwd ? cat(k) : "N",
                                       ") (offs' groups, x's K columns)")));
    DG_RETURN_IF_ERROR(check_shape(d.out_shape, "out", "out", {tokens, n},
                                   cat("(T, N) = (", tokens, ", ", n, ") (x's rows, w's N)")));
  }

  const int in_elems = 16 / in_bytes, out_elems = 16 / out_bytes;
  DG_REQUIRE(n % in_elems == 0 && k % in_elems == 0, "N=", n, " and K=", k,
             " must be multiples of ", in_elems, " (16 bytes of ", dtype_str(in), ")");
  const int64_t out_row = wgrad ? k : n;
  DG_REQUIRE(out_row % out_elems == 0, "out rows of ", out_row, " ", dtype_str(out),
             " elements must be a multiple of 16 bytes");
  if (wgrad) {
    DG_RETURN_IF_ERROR(check_extent(d.a, "dy", {tokens, n}, in_bytes));
    DG_RETURN_IF_ERROR(check_extent(d.b, "x", {tokens, k}, in_bytes));
    DG_RETURN_IF_ERROR(check_extent(d.out, "out", {groups, n, k}, out_bytes));
  } else {
    DG_RETURN_IF_ERROR(check_extent(d.a, "x", {tokens, k}, in_bytes));
    DG_RETURN_IF_ERROR(check_extent(d.b, "w", {groups, n, k}, in_bytes));
    DG_RETURN_IF_ERROR(check_extent(d.out, "out", {tokens, n}, out_bytes));
  }
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
  return DG_SUCCESS;
}

namespace {

dg_status plan(const dg_grouped_desc* desc, int device_arch, int sm_count, GroupedProblem* p,
               const GroupedInstance** chosen) {
  DG_RETURN_IF_ERROR(lower(desc, p));
  auto list = candidates(*desc, device_arch);
  if (device_arch <= 0)
    return fail(DG_ERROR_NOT_SUPPORTED,
                cat("no usable CUDA device (device arch ", device_arch,
                    "): distgemm's grouped kernels run on sm_90"));
  if (list.empty())
    return fail(DG_ERROR_NOT_SUPPORTED,
                cat("no sm_", device_arch, " grouped ", kind_name(desc->kind), " kernel in this build for ",
                    dtype_name(desc->in_dtype), " -> ", dtype_name(desc->out_dtype)));
  if (desc->config >= 0) {
    DG_REQUIRE(desc->config < static_cast<int>(list.size()), "config ", desc->config,
               " out of range: ", list.size(), " configs");
    *chosen = list[desc->config];
  } else if (p->kind == DG_GROUPED_WGRAD) {
    // Every group is an N x K tile grid; its depth is the group's tokens.
    *chosen = select_cheapest(list, p->n, p->k, std::max<int64_t>(1, p->tokens / p->groups),
                              p->groups, sm_count);
  } else {
    // Balanced routing as the model: the mean group size, G problems.
    *chosen = select_cheapest(list, std::max<int64_t>(1, p->tokens / p->groups), p->n, p->k,
                              p->groups, sm_count);
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

extern "C" dg_status dg_grouped_gemm(const dg_grouped_desc* desc, void* workspace,
                                     size_t workspace_bytes, cudaStream_t stream) {
  const int device = current_device();
  const DeviceInfo& dev = device_info(device);
  GroupedProblem p;
  const GroupedInstance* inst = nullptr;
  DG_RETURN_IF_ERROR(plan(desc, dev.arch, dev.sm_count, &p, &inst));
  if (p.tokens == 0 && p.kind != DG_GROUPED_WGRAD) return DG_SUCCESS;  // no rows to write
  const size_t needed = inst->workspace(p);
  DG_REQUIRE(workspace != nullptr && workspace_bytes >= needed, "workspace of ", workspace_bytes,
             " bytes is smaller than the ", needed, " needed");
  p.device = device;
  p.workspace = workspace;
  p.workspace_bytes = workspace_bytes;
  return inst->run(p, stream);
}

extern "C" int dg_grouped_gemm_config_count(const dg_grouped_desc* desc, int device_arch) {
  return desc ? static_cast<int>(candidates(*desc, device_arch).size()) : 0;
}

extern "C" const char* dg_grouped_gemm_config_name(const dg_grouped_desc* desc, int device_arch,
                                                   int config) {
  if (!desc) return nullptr;
  auto list = candidates(*desc, device_arch);
  return config >= 0 && config < static_cast<int>(list.size()) ? list[config]->name : nullptr;
}

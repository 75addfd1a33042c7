// dg_grouped_gemm: argument checks, the instance table and dispatch. Host-only.
#include <algorithm>
#include <cstdint>
#include <vector>

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

const GroupedInstance kInstances[] = {
#include "grouped/grouped_instances.def"
#if defined(DISTGEMM_TUNING_INSTANCES)
#include "grouped/grouped_instances_tuning.def"
#endif
};
#undef DG_SM90_GROUPED

const char* kind_name(dg_grouped_kind kind) {
  switch (kind) {
    case DG_GROUPED_FORWARD: return "forward";
    case DG_GROUPED_DGRAD: return "dgrad";
    case DG_GROUPED_WGRAD: return "wgrad";
  }
  return "unknown";
}

std::vector<const GroupedInstance*> candidates(const dg_grouped_desc& d, int device_arch) {
  std::vector<const GroupedInstance*> out;
  for (const GroupedInstance& inst : kInstances)
    if (inst.arch == device_arch && inst.in == d.in_dtype && inst.out == d.out_dtype &&
        inst.kind == d.kind)
      out.push_back(&inst);
  return out;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

dg_status lower(const dg_grouped_desc* desc, GroupedProblem* p) {
  DG_REQUIRE(desc != nullptr, "desc must not be NULL");
  const dg_grouped_desc& d = *desc;
  DG_REQUIRE(d.kind == DG_GROUPED_FORWARD || d.kind == DG_GROUPED_DGRAD || d.kind == DG_GROUPED_WGRAD,
             "kind must be forward, dgrad or wgrad");
  DG_REQUIRE(d.num_groups >= 1, "the number of groups must be at least 1, got ", d.num_groups);
  DG_REQUIRE(d.offs != nullptr && (reinterpret_cast<uintptr_t>(d.offs) & 3u) == 0,
             "offs must be a 4-byte aligned device pointer");
  DG_REQUIRE(is_16bit_float(d.in_dtype), "inputs must be bfloat16 or float16, got ",
             dtype_name(d.in_dtype));
  DG_REQUIRE(d.out_dtype == d.in_dtype || d.out_dtype == DG_F32, "out dtype must be ",
             dtype_name(d.in_dtype), " or float32, got ", dtype_name(d.out_dtype));
  DG_REQUIRE(d.tokens >= 0 && d.tokens < (int64_t(1) << 31), "the token count must be in [0, 2^31), got ",
             d.tokens);
  DG_REQUIRE(d.n >= 1 && d.k >= 1 && d.n < (int64_t(1) << 31) && d.k < (int64_t(1) << 31),
             "N and K must be in [1, 2^31), got N=", d.n, " K=", d.k);
  const int in_elems = 16 / dtype_bytes(d.in_dtype), out_elems = 16 / dtype_bytes(d.out_dtype);
  DG_REQUIRE(d.n % in_elems == 0 && d.k % in_elems == 0, "N=", d.n, " and K=", d.k,
             " must be multiples of ", in_elems, " (16 bytes of ", dtype_name(d.in_dtype), ")");
  const int64_t out_row = d.kind == DG_GROUPED_WGRAD ? d.k : d.n;
  DG_REQUIRE(out_row % out_elems == 0, "the output row of ", out_row, " ", dtype_name(d.out_dtype),
             " elements must be a multiple of 16 bytes");
  DG_REQUIRE(aligned16(d.a) && aligned16(d.b) && aligned16(d.out),
             "a, b and out must be 16-byte aligned device pointers");
  p->kind = d.kind;
  p->groups = d.num_groups;
  p->offs = d.offs;
  p->tokens = d.tokens;
  p->n = d.n;
  p->k = d.k;
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

// dg_gemm: argument checks, the instance table and dispatch. Host-only.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/checked_math.h"
#include "common/device.h"
#include "common/dtype.h"
#include "common/status.h"
#include "distgemm/distgemm.h"
#include "common/tile_heuristic.h"
#include "gemm/gemm_internal.h"
#include "gemm/gemm_problem.h"

namespace distgemm::gemm {
namespace {

// One compiled kernel: its dtypes, layout, tile and entry points.
struct GemmInstance {
  int arch;
  dg_dtype a, b, d;
  bool b_k_major;
  Schedule schedule;
  int tile_m, tile_n, cluster_m, cluster_n;
  const char* name;
  GemmRunFn run;
  GemmWorkspaceFn workspace;
};

#if defined(DISTGEMM_WITH_SM90)
#define DG_SM90_GEMM(A, B, D, BK, S, TM, TN, CM, CN)          \
  {90,                                                        \
   A,                                                         \
   B,                                                         \
   D,                                                         \
   BK != 0,                                                   \
   Schedule(S),                                               \
   TM,                                                        \
   TN,                                                        \
   CM,                                                        \
   CN,                                                        \
   #S "_" #TM "x" #TN "_c" #CM "x" #CN,                       \
   &Sm90GemmKernel<A, B, D, BK != 0, S, TM, TN, CM, CN>::run, \
   &Sm90GemmKernel<A, B, D, BK != 0, S, TM, TN, CM, CN>::workspace},
#else
#define DG_SM90_GEMM(...)
#endif
#if defined(DISTGEMM_WITH_SM100)
#define DG_SM100_GEMM(A, B, D, BK, S, TM, TN, CM, CN)          \
  {100,                                                        \
   A,                                                          \
   B,                                                          \
   D,                                                          \
   BK != 0,                                                    \
   Schedule(S),                                                \
   TM,                                                         \
   TN,                                                         \
   CM,                                                         \
   CN,                                                         \
   #S "_" #TM "x" #TN "_c" #CM "x" #CN,                        \
   &Sm100GemmKernel<A, B, D, BK != 0, S, TM, TN, CM, CN>::run, \
   &Sm100GemmKernel<A, B, D, BK != 0, S, TM, TN, CM, CN>::workspace},
#else
#define DG_SM100_GEMM(...)
#endif

// The compiled kernels, then a sentinel (arch 0) that keeps the array non-empty in a build
// without any arch (the host-checks build); kInstances is the table without it.
const GemmInstance kInstanceTable[] = {
#include "gemm/gemm_instances.def"
#if defined(DISTGEMM_TUNING_INSTANCES)
#include "gemm/gemm_instances_tuning.def"
#endif
    GemmInstance{},
};
#undef DG_SM90_GEMM
#undef DG_SM100_GEMM

struct InstanceList {
  const GemmInstance* begin() const { return kInstanceTable; }
  const GemmInstance* end() const { return kInstanceTable + std::size(kInstanceTable) - 1; }
};
constexpr InstanceList kInstances{};

// The arch whose kernels serve a device of compute capability `arch` (e.g. 90 -> 90).
int kernel_arch(int device_arch) {
  if (device_arch == 90) return 90;
  if (device_arch == 100) return 100;
  return 0;
}

bool b_is_k_major(const dg_matrix& b) { return b.col_stride == 1; }

// The kernels for d's dtypes and b layout; the dtypes are compared as the raw ints the caller
// stored (this also serves unchecked descs: dg_gemm_config_count / _name).
std::vector<const GemmInstance*> candidates(const dg_gemm_desc& d, int device_arch) {
  std::vector<const GemmInstance*> out;
  const int arch = kernel_arch(device_arch);
  const bool bk = b_is_k_major(d.b);
  const int a = raw_enum(d.a.dtype), b = raw_enum(d.b.dtype), dd = raw_enum(d.d.dtype);
  // sm100's UMMA accumulates FP8 in FP32 throughout: fast accumulation means nothing there.
  const bool fast = (a == DG_E4M3 || a == DG_E5M2) && d.fast_accum && arch == 90;
  for (const GemmInstance& inst : kInstances) {
    if (inst.arch == arch && inst.a == a && inst.b == b && inst.d == dd && inst.b_k_major == bk &&
        is_fast_accum(inst.schedule) == fast)
      out.push_back(&inst);
  }
  return out;
}

// Raster swizzle for the persistent scheduler: wider swizzles keep the operands of
// neighbouring tiles in L2 once the grid spans many tiles.
int select_swizzle(const GemmInstance& inst, int64_t m, int64_t n, int sm_count) {
  const int64_t tiles = ((m + inst.tile_m - 1) / inst.tile_m) * ((n + inst.tile_n - 1) / inst.tile_n);
  return tiles >= 4 * static_cast<int64_t>(sm_count) ? 2 : 1;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

bool known_dtype(int t) { return t >= DG_F32 && t <= DG_I32; }

// A (rows, cols) matrix whose columns are contiguous, with a 16-byte aligned row pitch, at a
// non-NULL 16-byte aligned address; its dtype is known (check_dtypes). *ld: the leading
// dimension the kernels get.
// Sizes: rows and cols are the problem's (in [1, 2^31)); the strides are the caller's, any
// int64: every product is checked, and the matrix's byte extent ((rows - 1) * row pitch + the
// row's bytes) must fit in int64 and in the address space after data.
// One row: its pitch addresses nothing, so any row stride that is non-negative and whose byte
// pitch fits in int64 is taken (PyTorch gives 1-row views arbitrary strides, e.g. (1, 1) for the
// transpose of a (K, 1) column, or 0 for an expanded row); the kernels get the packed pitch
// `cols` instead.
dg_status check_row_major(const dg_matrix& m, const char* name, int64_t rows, int64_t cols, int64_t* ld) {
  DG_REQUIRE(m.rows == rows && m.cols == cols, name, " must have shape (", rows, ", ", cols, "), got (", m.rows, ", ",
             m.cols, ")");
  DG_REQUIRE(m.data != nullptr, name, " data pointer must not be NULL");
  DG_REQUIRE(aligned16(m.data), name, " data pointer must be 16-byte aligned");
  DG_REQUIRE(m.col_stride == 1 || cols == 1, name, " must be row-major (unit column stride), got strides (",
             m.row_stride, ", ", m.col_stride, ")");
  const int bytes = dtype_bytes(m.dtype);
  DG_REQUIRE(bytes > 0, name, " has an unknown dtype");
  const int64_t row_bytes = cols * bytes;  // cols < 2^31, bytes <= 4
  DG_REQUIRE(row_bytes % 16 == 0, name, " has ", cols, " columns of ", dtype_name(m.dtype),
             ": the contiguous dimension must be a multiple of ", 16 / bytes, " elements (16 bytes)");
  int64_t pitch = 0;
  DG_REQUIRE(m.row_stride >= 0 && checked_mul(m.row_stride, bytes, &pitch), name, " row stride ", m.row_stride,
             " must be non-negative, with a byte pitch that fits in int64");
  int64_t extent = row_bytes;
  if (rows == 1) {
    *ld = cols;
  } else {
    DG_REQUIRE(m.row_stride >= cols, name, " row stride ", m.row_stride, " is smaller than its ", cols, " columns");
    DG_REQUIRE(pitch % 16 == 0, name, " row stride of ", m.row_stride, " elements is not a multiple of 16 bytes");
    DG_REQUIRE(checked_mul(rows - 1, pitch, &extent) && checked_add(extent, row_bytes, &extent), name,
               " spans more than 2^63 bytes: ", rows, " rows ", pitch, " bytes apart");
    *ld = m.row_stride;
  }
  DG_REQUIRE(static_cast<uint64_t>(extent) <= UINTPTR_MAX - reinterpret_cast<uintptr_t>(m.data), name,
             " runs past the end of the address space (", extent, " bytes from ", m.data, ")");
  return DG_SUCCESS;
}

dg_status check_dtypes(const dg_gemm_desc& d) {
  const int raw_a = raw_enum(d.a.dtype), raw_b = raw_enum(d.b.dtype), raw_out = raw_enum(d.d.dtype);
  DG_REQUIRE(known_dtype(raw_a), "a has an unknown dtype (", raw_a, ")");
  DG_REQUIRE(known_dtype(raw_b), "b has an unknown dtype (", raw_b, ")");
  DG_REQUIRE(known_dtype(raw_out), "out has an unknown dtype (", raw_out, ")");
  if (d.c.data) {
    const int raw_c = raw_enum(d.c.dtype);
    DG_REQUIRE(known_dtype(raw_c), "c has an unknown dtype (", raw_c, ")");
  }
  const dg_dtype a = d.a.dtype, b = d.b.dtype, out = d.d.dtype;
  if (is_16bit_float(a)) {
    DG_REQUIRE(b == a, "a and b must have the same dtype, got ", dtype_name(a), " and ", dtype_name(b));
    DG_REQUIRE(out == a || out == DG_F32, "out dtype must be ", dtype_name(a), " or float32 for ", dtype_name(a),
               " inputs, got ", dtype_name(out));
    DG_REQUIRE(!d.scale_a && !d.scale_b, "scale_a / scale_b apply to float8 inputs only");
    return DG_SUCCESS;
  }
  if (is_fp8(a)) {
    DG_REQUIRE(is_fp8(b), "a is ", dtype_name(a), " so b must be float8 too, got ", dtype_name(b));
    DG_REQUIRE(!(a == DG_E5M2 && b == DG_E5M2),
               "float8_e5m2 x float8_e5m2 is not supported (one operand must be float8_e4m3fn)");
    DG_REQUIRE(out == DG_BF16 || out == DG_F16 || out == DG_F32,
               "out dtype for float8 inputs must be bfloat16, float16 or float32, got ", dtype_name(out));
    return DG_SUCCESS;
  }
  return fail(DG_ERROR_INVALID_ARGUMENT,
              cat("a must be bfloat16, float16, float8_e4m3fn or float8_e5m2, got ", dtype_name(a)));
}

// Validates `d` and lowers it to a GemmProblem (pointers and leading dimensions).
dg_status lower(const dg_gemm_desc* desc, GemmProblem* p) {
  DG_REQUIRE(desc != nullptr, "desc must not be NULL");
  const dg_gemm_desc& d = *desc;
  DG_RETURN_IF_ERROR(check_dtypes(d));
  // The launch settings, here rather than where they are used, so that dg_gemm_check refuses
  // what dg_gemm would (config's upper bound needs the kernel list: lower_and_list).
  DG_REQUIRE(d.config >= -1, "config must be -1 (the heuristic's choice) or a kernel index, got ", d.config);
  DG_REQUIRE(d.swizzle == 0 || d.swizzle == 1 || d.swizzle == 2 || d.swizzle == 4 || d.swizzle == 8,
             "swizzle must be 0 (the heuristic's choice), 1, 2, 4 or 8, got ", d.swizzle);
  const int64_t m = d.a.rows, k = d.a.cols, n = d.b.rows;
  DG_REQUIRE(m >= 1 && n >= 1 && k >= 1, "M, N and K must be positive, got M=", m, " N=", n, " K=", k);
  DG_REQUIRE(m < (int64_t(1) << 31) && n < (int64_t(1) << 31) && k < (int64_t(1) << 31),
             "M, N and K must be below 2^31");
  DG_RETURN_IF_ERROR(check_row_major(d.a, "a", m, k, &p->lda));
  DG_REQUIRE(d.b.cols == k, "b must have shape (N, K) with K=", k, " (a's columns), got (", d.b.rows, ", ", d.b.cols,
             ")");
  if (b_is_k_major(d.b)) {
    DG_RETURN_IF_ERROR(check_row_major(d.b, "b", n, k, &p->ldb));
    p->b_k_major = true;
  } else {
    DG_REQUIRE(d.b.row_stride == 1,
               "b must be K-major (unit column stride) or N-major (unit row "
               "stride), got strides (",
               d.b.row_stride, ", ", d.b.col_stride, ")");
    DG_REQUIRE(is_16bit_float(d.b.dtype), "float8 b must be K-major (row-major (N, K))");
    dg_matrix bt{d.b.data, d.b.dtype, k, n, d.b.col_stride, 1};
    DG_RETURN_IF_ERROR(check_row_major(bt, "b (N-major, as its (K, N) transpose)", k, n, &p->ldb));
    p->b_k_major = false;
  }
  DG_RETURN_IF_ERROR(check_row_major(d.d, "out", m, n, &p->ldd));
  if (d.c.data) {
    DG_REQUIRE(d.c.dtype == d.d.dtype, "c must have the output dtype ", dtype_name(d.d.dtype), ", got ",
               dtype_name(d.c.dtype));
    if (d.c.rows == 1) {  // a bias row (for M == 1 also the full C: the same values)
      int64_t unused_ld = 0;
      DG_RETURN_IF_ERROR(check_row_major(d.c, "c (bias)", 1, n, &unused_ld));
      if (d.beta != 0.f) {  // as BLAS: beta = 0 reads no c (0 * NaN would be NaN)
        p->bias = d.c.data;
        p->beta_bias = d.beta;
      }
    } else {
      DG_RETURN_IF_ERROR(check_row_major(d.c, "c", m, n, &p->ldc));
      if (d.beta != 0.f) {
        p->c = d.c.data;
        p->beta_c = d.beta;
      }
    }
  }
  if (d.scale_a) {
    DG_REQUIRE(d.scale_a_len == 1 || d.scale_a_len == m, "scale_a must hold 1 or M=", m, " values, got ",
               d.scale_a_len);
    DG_REQUIRE(aligned16(d.scale_a), "scale_a must be 16-byte aligned");
  }
  if (d.scale_b) {
    DG_REQUIRE(d.scale_b_len == 1 || d.scale_b_len == n, "scale_b must hold 1 or N=", n, " values, got ",
               d.scale_b_len);
    DG_REQUIRE(aligned16(d.scale_b), "scale_b must be 16-byte aligned");
  }
  p->m = static_cast<int>(m);
  p->n = static_cast<int>(n);
  p->k = static_cast<int>(k);
  p->a = d.a.data;
  p->b = d.b.data;
  p->d = const_cast<void*>(d.d.data);
  p->alpha = d.alpha;
  p->scale_a = d.scale_a;
  p->scale_a_per_row = d.scale_a && d.scale_a_len > 1;
  p->scale_b = d.scale_b;
  p->scale_b_per_col = d.scale_b && d.scale_b_len > 1;
  return DG_SUCCESS;
}

// Lowers `desc` and lists the kernels that can run it.
dg_status lower_and_list(const dg_gemm_desc* desc, int device_arch, GemmProblem* p,
                         std::vector<const GemmInstance*>* list) {
  DG_RETURN_IF_ERROR(lower(desc, p));
  if (device_arch <= 0)
    return fail(DG_ERROR_NOT_SUPPORTED, cat("no usable CUDA device (device arch ", device_arch,
                                            "): distgemm kernels run on "
                                            "sm_90 and sm_100"));
  if (!kernel_arch(device_arch))
    return fail(DG_ERROR_NOT_SUPPORTED,
                cat("distgemm kernels run on sm_90 and sm_100; this device is sm_", device_arch));
  *list = candidates(*desc, device_arch);
  if (list->empty())
    return fail(DG_ERROR_NOT_SUPPORTED,
                cat("no sm_", kernel_arch(device_arch), " kernel in this build for a=", dtype_name(desc->a.dtype),
                    " b=", dtype_name(desc->b.dtype), " out=", dtype_name(desc->d.dtype),
                    p->b_k_major ? " (b K-major" : " (b N-major",
                    desc->fast_accum && is_fp8(desc->a.dtype) ? ", fast accumulation)" : ")",
                    "; DISTGEMM_CUDA_ARCHS may exclude this arch"));
  DG_REQUIRE(desc->config < static_cast<int>(list->size()), "config ", desc->config, " out of range: ", list->size(),
             " configs for these dtypes");
  return DG_SUCCESS;
}

// Lowers, checks that a kernel exists and picks it (desc->config, else the heuristic).
// cooperative_only: the C-operand wait of the tensor-parallel ring lives in the scheduler's
// compute_epilogue hook, which CUTLASS's cooperative kernel calls and its ping-pong does not.
dg_status plan(const dg_gemm_desc* desc, int device_arch, int sm_count, GemmProblem* p, const GemmInstance** chosen,
               bool cooperative_only = false) {
  std::vector<const GemmInstance*> list;
  DG_RETURN_IF_ERROR(lower_and_list(desc, device_arch, p, &list));
  auto cooperative = [](const GemmInstance* inst) {
    return inst->schedule == kCooperative || inst->schedule == kCooperativeFastAccum;
  };
  if (desc->config >= 0) {  // an index into dg_gemm_config_name's list, with or without the waits
    *chosen = list[desc->config];
    DG_REQUIRE(!cooperative_only || cooperative(*chosen), "config ", desc->config, " (", (*chosen)->name,
               ") cannot run a reduce-scatter ring step, which needs a cooperative kernel (a coop_ config)");
  } else {
    if (cooperative_only) {
      std::vector<const GemmInstance*> coop;
      for (const GemmInstance* inst : list)
        if (cooperative(inst)) coop.push_back(inst);
      if (coop.empty())
        return fail(DG_ERROR_NOT_SUPPORTED, "no cooperative kernel for this GEMM + reduce-scatter step");
      list.swap(coop);
    }
    const double k_16bit = is_fp8(desc->a.dtype) ? p->k / 2.0 : p->k;
    *chosen = select_cheapest(list, p->m, p->n, k_16bit, 1, sm_count);
  }
  p->sm_count = sm_count;
  p->swizzle = desc->swizzle > 0 ? desc->swizzle : select_swizzle(**chosen, p->m, p->n, sm_count);
  return DG_SUCCESS;
}

// Plans and launches `desc` on the current device: the one run path of dg_gemm and the
// tensor-parallel steps.
dg_status plan_and_run(const dg_gemm_desc& desc, const GemmExtras& extras, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream) {
  const int device = current_device();
  const DeviceInfo& dev = device_info(device);
  const int sm_count = extras.sm_count > 0 ? std::min(extras.sm_count, dev.sm_count) : dev.sm_count;
  GemmProblem p;
  const GemmInstance* inst = nullptr;
  DG_RETURN_IF_ERROR(plan(&desc, dev.arch, sm_count, &p, &inst, extras.sync.c_ready != nullptr));
  if (extras.chain_c) {
    DG_REQUIRE(!p.c, "a chained partial sum cannot be combined with a full C operand");
    p.c = extras.chain_c;
    p.ldc = extras.chain_ldc;
    p.beta_c = 1.f;
  }
  p.sync = extras.sync;
  const size_t needed = inst->workspace(p);
  DG_REQUIRE(workspace_bytes >= needed && (needed == 0 || workspace != nullptr), "workspace of ", workspace_bytes,
             " bytes is smaller than the ", needed, " needed");
  p.device = device;
  p.workspace = workspace;
  p.workspace_bytes = workspace_bytes;
  return inst->run(p, stream);
}

}  // namespace

dg_status run_gemm_desc(const dg_gemm_desc& desc, const GemmExtras& extras, cudaStream_t stream) {
  return plan_and_run(desc, extras, nullptr, 0, stream);
}

dg_status check_gemm_desc(const dg_gemm_desc& desc, bool waits_for_c) {
  const DeviceInfo& dev = device_info(current_device());
  GemmProblem p;
  const GemmInstance* inst = nullptr;
  DG_RETURN_IF_ERROR(plan(&desc, dev.arch, dev.sm_count, &p, &inst, waits_for_c));
  DG_REQUIRE(inst->workspace(p) == 0, "kernel ", inst->name,
             " needs a workspace, which a tensor-parallel "
             "step does not have");
  return DG_SUCCESS;
}

}  // namespace distgemm::gemm

using namespace distgemm;
using namespace distgemm::gemm;

extern "C" dg_status dg_gemm_check(const dg_gemm_desc* desc, int device_arch) {
  GemmProblem p;
  std::vector<const GemmInstance*> list;
  return lower_and_list(desc, device_arch, &p, &list);
}

extern "C" dg_status dg_gemm_workspace_size(const dg_gemm_desc* desc, size_t* bytes) {
  DG_REQUIRE(bytes != nullptr, "bytes must not be NULL");
  const DeviceInfo& dev = device_info();
  GemmProblem p;
  const GemmInstance* inst = nullptr;
  DG_RETURN_IF_ERROR(plan(desc, dev.arch, dev.sm_count, &p, &inst));
  *bytes = inst->workspace(p);
  return DG_SUCCESS;
}

extern "C" dg_status dg_gemm(const dg_gemm_desc* desc, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  DG_REQUIRE(desc != nullptr, "desc must not be NULL");
  return plan_and_run(*desc, GemmExtras{}, workspace, workspace_bytes, stream);
}

extern "C" int dg_gemm_config_count(const dg_gemm_desc* desc, int device_arch) {
  return desc ? static_cast<int>(candidates(*desc, device_arch).size()) : 0;
}

extern "C" const char* dg_gemm_config_name(const dg_gemm_desc* desc, int device_arch, int config) {
  if (!desc) return nullptr;
  auto list = candidates(*desc, device_arch);
  return config >= 0 && config < static_cast<int>(list.size()) ? list[config]->name : nullptr;
}

extern "C" int dg_gemm_select_config(const dg_gemm_desc* desc, int device_arch, int sm_count) {
  GemmProblem p;
  const GemmInstance* inst = nullptr;
  dg_gemm_desc auto_desc = desc ? *desc : dg_gemm_desc{};
  auto_desc.config = -1;
  if (plan(&auto_desc, device_arch, sm_count, &p, &inst) != DG_SUCCESS) return -1;
  auto list = candidates(auto_desc, device_arch);
  for (size_t i = 0; i < list.size(); ++i)
    if (list[i] == inst) return static_cast<int>(i);
  return -1;
}

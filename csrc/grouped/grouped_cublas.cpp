// The multi-stream cuBLAS grouped GEMM: one cublasGemmEx per non-empty group, spread over a
// pool of streams forked from and joined back to the caller's stream (the seed's
// nvte_multi_stream_cublas_gemm baseline, with FP32 output and accumulation).
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdint>

#include "common/checked_math.h"
#include "common/device.h"
#include "common/dtype.h"
#include "common/per_device.h"
#include "common/status.h"
#include "common/stream_pool.h"
#include "distgemm/distgemm.h"
#include "grouped/grouped_lower.h"

namespace distgemm::grouped {
namespace {

constexpr int kStreams = 4;

// One cuBLAS handle per side stream of each device, made on first use (common/per_device.h)
// and bound to the first kStreams streams of `pool` (the device's pool: one per device too).
cublasHandle_t* cublas_handles(int device, StreamPool& pool) {
  using Handles = std::array<cublasHandle_t, kStreams>;
  static PerDevice<Handles> handles;
  Handles* h = handles.get(device, "the cuBLAS handles", [&pool](int d, Handles* out) {
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
    for (int i = 0; i < kStreams && st == CUBLAS_STATUS_SUCCESS; ++i) {
      st = cublasCreate(&(*out)[i]);
      if (st == CUBLAS_STATUS_SUCCESS) st = cublasSetStream((*out)[i], pool.streams[i]);
      // A split-K reduction in bf16/fp16 rounds the partial sums (the GPU fuzz saw 1-ulp
      // errors in bf16 wgrad accumulation): reduce in FP32 as the CUTLASS kernels do.
      if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasSetMathMode((*out)[i], static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                                                    CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
    }
    if (st == CUBLAS_STATUS_SUCCESS) return DG_SUCCESS;
    for (cublasHandle_t& handle : *out)
      if (handle) cublasDestroy(handle);
    return fail(DG_ERROR_CUDA,
                cat("creating the cuBLAS handles of device ", d, " failed: ", cublasGetStatusString(st)));
  });
  return h ? h->data() : nullptr;
}

}  // namespace
}  // namespace distgemm::grouped

using namespace distgemm;
using namespace distgemm::grouped;

extern "C" dg_status dg_grouped_gemm_cublas(const dg_grouped_desc* desc, const int32_t* host_offs,
                                            cudaStream_t stream) {
  GroupedProblem p;
  DG_RETURN_IF_ERROR(lower(desc, &p));
  DG_REQUIRE(host_offs != nullptr, "host_offs must not be NULL");
  // cublasGemmEx here applies no scales and reads FP8 in none of the layouts the FP8 grouped
  // GEMMs take (the padded wgrad operands): refused, never a silently unscaled product.
  const int in = raw_enum(desc->in_dtype);
  if ((in != DG_BF16 && in != DG_F16) || raw_enum(desc->scale_mode) != DG_SCALE_NONE)
    return fail(DG_ERROR_NOT_SUPPORTED,
                cat("dg_grouped_gemm_cublas takes bfloat16/float16 inputs without scales, got in_dtype ",
                    dtype_name(desc->in_dtype), " (scale_mode ", raw_enum(desc->scale_mode),
                    "); run FP8 grouped GEMMs with dg_grouped_gemm"));
  DG_REQUIRE(p.n <= INT32_MAX && p.k <= INT32_MAX && p.tokens <= INT32_MAX,
             "dg_grouped_gemm_cublas: N, K and T must fit cuBLAS's int sizes, got N ", p.n, ", K ", p.k, ", T ",
             p.tokens);
  const int device = current_device();
  StreamPool* pool = stream_pool(device);
  if (!pool) return DG_ERROR_CUDA;
  cublasHandle_t* handles = cublas_handles(device, *pool);
  if (!handles) return DG_ERROR_CUDA;

  const size_t in_bytes = dtype_bytes(desc->in_dtype), out_bytes = dtype_bytes(desc->out_dtype);
  const cudaDataType_t in_type = cublas_float_type(desc->in_dtype), out_type = cublas_float_type(desc->out_dtype);
  const float alpha = 1.f, beta = p.accumulate ? 1.f : 0.f;
  auto const* a = static_cast<const char*>(p.a);
  auto const* b = static_cast<const char*>(p.b);
  auto* out = static_cast<char*>(p.d);
  const int n = static_cast<int>(p.n), k = static_cast<int>(p.k);

  DG_RETURN_IF_ERROR(fork_streams(*pool, stream, kStreams));
  // From here every path joins the side streams back into `stream`, failures included: a
  // caller's stream must never run ahead of GEMMs still queued on them.
  dg_status status = DG_SUCCESS;
  auto clamp_row = [&](int64_t r) { return std::min<int64_t>(std::max<int64_t>(r, 0), p.tokens); };
  for (int g = 0; g < p.groups && status == DG_SUCCESS; ++g) {
    // Same bounds as the device-side argument builder.
    const int64_t start = g == 0 ? 0 : clamp_row(host_offs[g - 1]);
    const int64_t end = std::max(start, clamp_row(host_offs[g]));
    const int rows = static_cast<int>(end - start);
    const int s = g % kStreams;
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
    if (p.kind == DG_GROUPED_WGRAD) {
      char* out_g = out + static_cast<int64_t>(g) * n * k * out_bytes;
      if (rows == 0) {
        if (!p.accumulate) {
          const cudaError_t err = cudaMemsetAsync(out_g, 0, size_t(n) * k * out_bytes, pool->streams[s]);
          if (err != cudaSuccess)
            status =
                fail(DG_ERROR_CUDA, cat("cudaMemsetAsync of group ", g, "'s output failed: ", cudaGetErrorString(err)));
        }
      } else {
        // out_g^T (K x N, column-major) = x_g^T (K x rows) @ dy_g (rows x N)
        st = cublasGemmEx(handles[s], CUBLAS_OP_N, CUBLAS_OP_T, k, n, rows, &alpha, b + start * k * in_bytes, in_type,
                          k, a + start * n * in_bytes, in_type, n, &beta, out_g, out_type, k, CUBLAS_COMPUTE_32F,
                          CUBLAS_GEMM_DEFAULT);
      }
    } else if (rows > 0) {
      // out_g^T (N x rows) = W op (N x K) @ x_g^T (K x rows)
      const char* w = b + static_cast<int64_t>(g) * n * k * in_bytes;
      const bool forward = p.kind == DG_GROUPED_FORWARD;
      st = cublasGemmEx(handles[s], forward ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, n, rows, k, &alpha, w, in_type,
                        forward ? k : n, a + start * k * in_bytes, in_type, k, &beta, out + start * n * out_bytes,
                        out_type, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    }
    if (st != CUBLAS_STATUS_SUCCESS)
      status = fail(DG_ERROR_CUDA, cat("cublasGemmEx failed for group ", g, ": ", cublasGetStatusString(st)));
  }
  const dg_status joined = join_streams(*pool, stream, kStreams);
  return status != DG_SUCCESS ? status : joined;
}

// The MoE expert MLP's memory-bound kernels (plain CUDA, every arch the build compiles).
//
// act_kernel: a CTA per block of 128 rows (padded per expert when the transposed copy is
// written, so that no block mixes two experts) and 128 columns of the activation. It reads its
// inputs once, computes the activation (or its derivative) in FP32, rounds it to bf16 (the
// value an unfused layer would hold) and writes, each when asked: the bf16 rows; the FP8 rows
// with one scale per 1 x 128 (a tile row is one block: the amax is a 16-lane reduction); the
// FP8 transpose with one scale per 128 tokens of an expert, through shared memory. Scales and
// FP8 values follow quant/fp8_device.cuh, so each copy is bit-identical to quantize_fp8 of the
// bf16 activation.
//
// With a gather (x_rows, the identity only), row r of the tile reads x row x_rows[r]; the
// one-shot kernel takes those calls (its loads are per row already).
//
// weight_kernel: a CTA per 128 x 128 block of a weight: one amax, the FP8 block written as it
// is and, through shared memory, transposed. weight_rows_t_kernel: the row recipe's transposed
// copy, one scale per column of the weight.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "moe/moe_act_quantize.h"
#include "quant/fp8_device.cuh"
#include "quant/fp8_quantize.h"

namespace distgemm::moe {
namespace {

using quant::abs_bits;
using quant::Bf16;
using quant::Divisor;
using quant::F16;
using quant::F32;
using quant::kBlock;
using quant::kFullMask;
using quant::kThreads;
using quant::load8;
using quant::max64;
using quant::min64;
using quant::scale_of;
using quant::store8;
using quant::to_fp8;
using quant::to_fp8x4;

__device__ __forceinline__ float sigmoid(float v) { return 1.f / (1.f + expf(-v)); }

// Phi(v) as erfc: 1 + erf(v / sqrt 2) cancels for negative v.
__device__ __forceinline__ float gauss_cdf(float v) { return 0.5f * erfcf(-v * 0.70710678118654752f); }

__device__ __forceinline__ float gelu(float v) { return v * gauss_cdf(v); }

__device__ __forceinline__ float gelu_grad(float v) {
  const float cdf = gauss_cdf(v);
  return cdf + v * 0.39894228040143268f * expf(-0.5f * v * v);
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// Eight bf16 of a row at columns [c, c + 8), zeros past `cols`, as raw bits.
__device__ __forceinline__ uint4 load_raw8(const uint16_t* __restrict__ row, int64_t c, int64_t cols, bool vec) {
  if (vec && c + 8 <= cols) return __ldg(reinterpret_cast<const uint4*>(row + c));
  uint16_t b[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) b[e] = c + e < cols ? row[c + e] : uint16_t(0);
  return make_uint4(b[0] | uint32_t(b[1]) << 16, b[2] | uint32_t(b[3]) << 16, b[4] | uint32_t(b[5]) << 16,
                    b[6] | uint32_t(b[7]) << 16);
}

__device__ __forceinline__ void unpack8(uint4 raw, float (&v)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = Bf16::to_float(static_cast<uint16_t>(w[i] & 0xffffu));
    v[2 * i + 1] = Bf16::to_float(static_cast<uint16_t>(w[i] >> 16));
  }
}

// The inputs an activation reads at columns [c, c + 8) of one row: x (the gate half for
// SwiGLU), the up half, and dy, as raw bf16 vectors (loaded for all rows of a thread first, so
// that its loads are in flight together).
struct Raw8 {
  uint4 a, u, d;
};

template <int Act>
__device__ __forceinline__ Raw8 load_inputs(const uint16_t* __restrict__ x, int64_t x_cols,
                                            const uint16_t* __restrict__ dy, int64_t inner, int64_t r, int64_t c,
                                            bool vec) {
  Raw8 in{};
  const uint16_t* xr = x + r * x_cols;
  in.a = load_raw8(xr, c, inner, vec);
  if constexpr (Act == kSwiglu || Act == kSwigluBackward) in.u = load_raw8(xr + inner, c, inner, vec);
  if constexpr (Act == kSwigluBackward || Act == kGeluBackward) in.d = load_raw8(dy + r * inner, c, inner, vec);
  return in;
}

// The activation's values from the inputs: plane 0, and for the SwiGLU backward plane 1 (the
// up half's gradient), each rounded to bf16. Zeros stay zeros (the padding past `inner`).
template <int Act>
__device__ __forceinline__ void compute8(const Raw8& in, float (&v0)[8], float (&v1)[8]) {
  float a[8];
  unpack8(in.a, a);
  if constexpr (Act == kIdentity) {
#pragma unroll
    for (int e = 0; e < 8; ++e) v0[e] = a[e];
  } else if constexpr (Act == kGelu) {
#pragma unroll
    for (int e = 0; e < 8; ++e) v0[e] = round_bf16(gelu(a[e]));
  } else if constexpr (Act == kSwiglu) {
    float u[8];
    unpack8(in.u, u);
#pragma unroll
    for (int e = 0; e < 8; ++e) v0[e] = round_bf16(a[e] * sigmoid(a[e]) * u[e]);
  } else {
    float d[8];
    unpack8(in.d, d);
    if constexpr (Act == kGeluBackward) {
#pragma unroll
      for (int e = 0; e < 8; ++e) v0[e] = round_bf16(d[e] * gelu_grad(a[e]));
    } else {
      float u[8];
      unpack8(in.u, u);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float s = sigmoid(a[e]);
        v0[e] = round_bf16(d[e] * u[e] * s * (1.f + a[e] * (1.f - s)));
        v1[e] = round_bf16(d[e] * a[e] * s);
      }
    }
  }
}

constexpr uint32_t kNanBf16x2 = 0x7fc07fc0u;  // two bf16 quiet NaNs

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&b);
}

// Two adjacent columns of 32 rows of a bf16 tile in shared memory (`pair` points at their
// bf16x2 in the first row; rows 128 columns apart) as FP8, the first quantized by d0 and the
// second by d1: packed[t] holds column t's 32 bytes, the first row in the lowest byte.
template <__nv_fp8_interpretation_t I, class Q0, class Q1>
__device__ __forceinline__ void pack_column_pair(const uint32_t* pair, const Q0& d0, const Q1& d1,
                                                 uint32_t (&packed)[2][kBlock / 16]) {
#pragma unroll
  for (int k = 0; k < kBlock / 16; ++k) {
    float lo[4], hi[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint32_t b = pair[(4 * k + e) * (kBlock / 2)];
      lo[e] = Bf16::to_float(static_cast<uint16_t>(b & 0xffffu));
      hi[e] = Bf16::to_float(static_cast<uint16_t>(b >> 16));
    }
    packed[0][k] = to_fp8x4<I>(lo[0], lo[1], lo[2], lo[3], d0);
    packed[1][k] = to_fp8x4<I>(hi[0], hi[1], hi[2], hi[3], d1);
  }
}

// The FP8 transpose of a CTA's tile of bf16 values [kPlanes][128][128] (rows: the tokens of
// padded row block pblock; columns c0 + [0, 128) of each plane): a thread per pair of tile
// columns and quarter of the 128 rows; it reads both columns as bf16x2 (twice: their amax, then
// the values) and writes 32 FP8 bytes of each of two rows of yt. Every thread calls it.
template <__nv_fp8_interpretation_t I, int kPlanes>
__device__ __forceinline__ void write_transpose(const ActProblem& p, const uint16_t* tile,
                                                uint32_t (&red)[4][kBlock / 2], int64_t pblock, int64_t c0,
                                                bool vec_t) {
  const int jp = threadIdx.x & 63;
  const int quarter = threadIdx.x >> 6;
  constexpr int kRows = kBlock / 4;
#pragma unroll 1
  for (int q = 0; q < kPlanes; ++q) {
    const uint32_t* pair = reinterpret_cast<const uint32_t*>(tile + (q * kBlock + quarter * kRows) * kBlock) + jp;
    uint32_t m = 0;
#pragma unroll 8
    for (int r = 0; r < kRows; ++r) m = quant::max_abs_bf16x2(m, pair[r * (kBlock / 2)]);
    red[quarter][jp] = m;
    __syncthreads();
    m = __vmaxu2(__vmaxu2(red[0][jp], red[1][jp]), __vmaxu2(red[2][jp], red[3][jp]));
    const uint32_t m_lo = quant::bf16x2_low_amax(m), m_hi = quant::bf16x2_high_amax(m);
    uint32_t packed[2][kRows / 4];
    const float s0 = scale_of<I>(m_lo), s1 = scale_of<I>(m_hi);
    quant::with_quotients(Divisor(s0), Divisor(s1),
                          [&](const auto& q0, const auto& q1) { pack_column_pair<I>(pair, q0, q1, packed); });
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int64_t ac = c0 + 2 * jp + t;
      if (ac >= p.inner) continue;
      const int64_t yc = q * p.inner + ac;
      if (quarter == 0) p.yt_scale[pblock * p.y_cols + yc] = t == 0 ? s0 : s1;
      uint8_t* o = static_cast<uint8_t*>(p.yt_fp8) + yc * p.yt_ld + pblock * kBlock + quarter * kRows;
      if (vec_t) {
        reinterpret_cast<uint4*>(o)[0] = make_uint4(packed[t][0], packed[t][1], packed[t][2], packed[t][3]);
        reinterpret_cast<uint4*>(o)[1] = make_uint4(packed[t][4], packed[t][5], packed[t][6], packed[t][7]);
      } else {
        for (int e = 0; e < kRows; ++e) o[e] = static_cast<uint8_t>(packed[t][e / 4] >> (8 * (e % 4)));
      }
    }
    __syncthreads();  // red is rewritten by the next plane
  }
}

// The rows of padded row block `pblock`: its first row, how many (0..128), and whether they lie
// past the last group's end (rows the grouped GEMMs skip, such as a permute's dropped copies).
// Those take one more span after the last group's blocks (it fits in the padded row blocks:
// floor(E / 128) + ceil((T - E) / 128) <= ceil(T / 128)); the row-wise outputs cover them, the
// transpose does not (its blocks there hold zeros, as quantize_fp8 with offs leaves them).
struct BlockSpan {
  int64_t first;
  int count;
  bool past_groups;
};

__device__ __forceinline__ BlockSpan block_span(const ActProblem& p, const int32_t* ends, int64_t pblock) {
  if (ends == nullptr) {
    const int64_t first = pblock * kBlock;
    return {first, static_cast<int>(min64(kBlock, p.tokens - first)), false};
  }
  int64_t g = quant::find_group(ends, p.groups, pblock);  // warp-uniform
  int64_t start = g == 0 ? 0 : ends[g - 1], end = ends[g];
  const bool past_groups = g == p.groups - 1 && pblock >= p.groups + end / kBlock;
  if (past_groups) {
    g = p.groups;
    start = end;
    end = p.tokens;
  }
  const int64_t first = start + (pblock - (g + start / kBlock)) * kBlock;
  return {first, static_cast<int>(min64(kBlock, max64(0, end - first))), past_groups};
}

// CTAs an SM at least: 4 for the identity (<= 64 registers), 2 for the SwiGLU backward's two
// planes, 3 for the others (<= 85).
template <int Act, __nv_fp8_interpretation_t I>
__global__ void __launch_bounds__(kThreads, Act == kIdentity         ? 4
                                            : Act == kSwigluBackward ? 2
                                                                     : 3)
    act_kernel(ActProblem p, bool vec_in, bool vec_y, bool vec_y8, bool vec_t) {
  constexpr int kPlanes = Act == kSwigluBackward ? 2 : 1;
  extern __shared__ __align__(16) uint16_t tile[];  // [kPlanes][128][128] bf16 bits
  __shared__ uint32_t red[4][kBlock / 2];           // the transpose's column-pair maxima, per quarter of the rows
  __shared__ BlockSpan span;
  const auto* x = static_cast<const uint16_t*>(p.x);
  const auto* dy = static_cast<const uint16_t*>(p.dy);
  const int64_t pblock = blockIdx.x;
  const int64_t c0 = int64_t(blockIdx.y) * kBlock;

  if (threadIdx.x < 32) {
    const BlockSpan mine = block_span(p, p.ends, pblock);
    if (threadIdx.x == 0) span = mine;
  }
  __syncthreads();
  const int64_t first = span.first;
  const int count = span.count;
  const bool past_groups = span.past_groups;

  // Rows: a half-warp per row, 8 columns a lane, 8 rows a thread.
  const int sub = threadIdx.x & 15;
  const int64_t c = c0 + sub * 8;
  constexpr int kRowsPerThread = kBlock / (kThreads / 16);
  Raw8 in[kRowsPerThread];
#pragma unroll
  for (int k = 0; k < kRowsPerThread; ++k) {
    const int i = (threadIdx.x >> 4) + (kThreads / 16) * k;
    in[k] = Raw8{};
    if (i >= count) continue;
    if constexpr (Act == kIdentity) {
      if (p.x_rows != nullptr) {
        const int64_t source = p.x_rows[first + i];
        if (source >= p.x_tokens) {  // bad input: NaN in every output, not a read out of bounds
          in[k].a = make_uint4(kNanBf16x2, kNanBf16x2, kNanBf16x2, kNanBf16x2);
        } else if (source >= 0) {
          in[k] = load_inputs<Act>(x, p.x_cols, dy, p.inner, source, c, vec_in);
        }
        continue;
      }
    }
    in[k] = load_inputs<Act>(x, p.x_cols, dy, p.inner, first + i, c, vec_in);
  }
#pragma unroll
  for (int k = 0; k < kRowsPerThread; ++k) {
    const int i = (threadIdx.x >> 4) + (kThreads / 16) * k;
    const bool active = i < count;
    const int64_t r = first + i;
    float v[2][8];
    compute8<Act>(in[k], v[0], v[1]);
#pragma unroll
    for (int q = 0; q < kPlanes; ++q) {
      if (c >= p.inner) {
#pragma unroll
        for (int e = 0; e < 8; ++e) v[q][e] = 0.f;
      }
      const int64_t yc = q * p.inner + c;  // the column of y
      if (p.y_fp8 != nullptr) {
        uint32_t m = quant::max8(0u, v[q]);
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(kFullMask, m, o));  // the row's 128
        if (active) {
          const float s = scale_of<I>(m);
          const Divisor d(s);
          // Partial vectors at the activation's end: only the columns before it are written.
          uint8_t* row = static_cast<uint8_t*>(p.y_fp8) + r * p.y_cols + q * p.inner;
          store8<I>(row, c, p.inner, vec_y8, v[q], d);
          if (sub == 0) p.y_scale[(yc / kBlock) * p.tokens + r] = s;
        }
      }
      if (p.y != nullptr && active && c < p.inner) {
        uint16_t* row = static_cast<uint16_t*>(p.y) + r * p.y_cols + q * p.inner;
        if (vec_y && c + 8 <= p.inner) {
          *reinterpret_cast<uint4*>(row + c) = make_uint4(pack_bf16x2(v[q][0], v[q][1]), pack_bf16x2(v[q][2], v[q][3]),
                                                          pack_bf16x2(v[q][4], v[q][5]), pack_bf16x2(v[q][6], v[q][7]));
        } else {
          for (int e = 0; e < 8 && c + e < p.inner; ++e) {
            const __nv_bfloat16 b = __float2bfloat16_rn(v[q][e]);
            row[c + e] = *reinterpret_cast<const uint16_t*>(&b);
          }
        }
      }
      if (p.yt_fp8 != nullptr) {
        uint16_t* t = tile + (q * kBlock + i) * kBlock + sub * 8;
        *reinterpret_cast<uint4*>(t) = past_groups
                                           ? make_uint4(0, 0, 0, 0)
                                           : make_uint4(pack_bf16x2(v[q][0], v[q][1]), pack_bf16x2(v[q][2], v[q][3]),
                                                        pack_bf16x2(v[q][4], v[q][5]), pack_bf16x2(v[q][6], v[q][7]));
      }
    }
  }
  if (p.yt_fp8 == nullptr) return;  // uniform across the CTA
  __syncthreads();

  write_transpose<I, kPlanes>(p, tile, red, pblock, c0, vec_t);
}

// ---------------------------------------------------------------- pipelined forms

// The same outputs as act_kernel and weight_kernel, for aligned bf16 inputs (the common case),
// from persistent CTAs that keep their next inputs in flight: the one-shot kernels load a tile,
// then compute, then store, so the SM waits on DRAM in between (measured at 2.8-5.6x a plain
// copy's time). Here cp.async streams inputs into a ring of shared-memory stages a few units
// ahead of the compute, and each CTA walks tiles blockIdx.x, blockIdx.x + gridDim.x, ...

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const auto dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Inputs an activation reads per element: x (or the gate half), the up half, dy.
template <int Act>
__host__ __device__ constexpr int input_planes() {
  return Act == kSwigluBackward ? 3 : (Act == kSwiglu || Act == kGeluBackward) ? 2 : 1;
}

// Group ends searched from shared memory when they fit (the common case: up to 1,024 experts).
constexpr int kSmemGroups = 1024;
constexpr int kUnitRows = 32;  // a pipeline unit: 32 rows x 128 columns
constexpr int kUnitsPerTile = kBlock / kUnitRows;
constexpr int kActStages = 4;

template <int Act, __nv_fp8_interpretation_t I>
__global__ void __launch_bounds__(kThreads)
    act_pipelined_kernel(ActProblem p, int64_t col_blocks, bool vec_y, bool vec_y8, bool vec_t) {
  constexpr int kIn = input_planes<Act>();
  constexpr int kPlanes = Act == kSwigluBackward ? 2 : 1;
  constexpr int kUnitElems = kUnitRows * kBlock;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* ring = smem;                                  // [stage][kIn][32][128] bf16 inputs
  uint16_t* tile = smem + kActStages * kIn * kUnitElems;  // [kPlanes][128][128] for the transpose
  __shared__ uint32_t red[4][kBlock / 2];
  __shared__ int32_t ends_s[kSmemGroups];
  const auto* x = static_cast<const uint16_t*>(p.x);
  const auto* dy = static_cast<const uint16_t*>(p.dy);
  const bool transposed = p.yt_fp8 != nullptr;

  const int32_t* ends = p.ends;
  if (ends != nullptr && p.groups <= kSmemGroups) {
    for (int64_t g = threadIdx.x; g < p.groups; g += kThreads) ends_s[g] = ends[g];
    __syncthreads();
    ends = ends_s;
  }
  const int64_t tiles = p.row_blocks * col_blocks;
  const int64_t my_tiles = tiles > blockIdx.x ? (tiles - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  const int64_t units = my_tiles * kUnitsPerTile;
  // The CTA's k-th tile: its padded row block and first column (a 32-bit division a tile).
  auto locate = [&](int64_t k, int64_t& pblock, int64_t& c0) {
    const int64_t t = blockIdx.x + k * gridDim.x;
    pblock = static_cast<uint32_t>(t) / static_cast<uint32_t>(col_blocks);  // < 2^32 tiles
    c0 = (t - pblock * col_blocks) * kBlock;
  };

  // Producer: unit n's inputs into stage n % kActStages (zeros past the rows and the columns).
  // Thread t copies 16 bytes at row t / 16 + 16 j (j < kLoads) and column 8 (t % 16) of each
  // unit; its addresses are set up once a tile and step by 32 rows a unit.
  constexpr int kLoads = kUnitElems / 8 / kThreads;
  const int chunk_row = threadIdx.x / 16;
  const int chunk_col = (threadIdx.x % 16) * 8;
  const int64_t x_unit = int64_t(kUnitRows) * p.x_cols, dy_unit = int64_t(kUnitRows) * p.inner;
  int64_t load_k = -1;
  const uint16_t* load_x = x;    // the thread's first chunk of the tile in x
  const uint16_t* load_dy = dy;  // and in dy
  int load_count = 0;
  bool load_col = false;
  auto issue = [&](int64_t n) {
    if (n < units) {
      const int64_t k = n / kUnitsPerTile;
      const int u = static_cast<int>(n % kUnitsPerTile);
      if (k != load_k) {
        load_k = k;
        int64_t pb, c0;
        locate(k, pb, c0);
        const BlockSpan span = block_span(p, ends, pb);
        const int64_t first = span.first;
        load_count = span.count;
        load_col = c0 + chunk_col < p.inner;
        load_x = x + (first + chunk_row) * p.x_cols + c0 + chunk_col;
        if constexpr (Act == kSwigluBackward || Act == kGeluBackward)
          load_dy = dy + (first + chunk_row) * p.inner + c0 + chunk_col;
      }
      uint16_t* stage = ring + (n % kActStages) * kIn * kUnitElems + chunk_row * kBlock + chunk_col;
#pragma unroll
      for (int j = 0; j < kLoads; ++j) {
        const bool valid = load_col && u * kUnitRows + chunk_row + 16 * j < load_count;
        const uint16_t* xs = valid ? load_x + u * x_unit + 16 * j * p.x_cols : x;
        uint16_t* dst = stage + 16 * j * kBlock;
        cp_async16(dst, xs, valid);
        if constexpr (Act == kSwiglu || Act == kSwigluBackward)
          cp_async16(dst + kUnitElems, valid ? xs + p.inner : x, valid);
        if constexpr (Act == kSwigluBackward || Act == kGeluBackward)
          cp_async16(dst + (kIn - 1) * kUnitElems, valid ? load_dy + u * dy_unit + 16 * j * p.inner : dy, valid);
      }
    }
    cp_async_commit();  // an empty group past the end keeps the wait counts uniform
  };
#pragma unroll
  for (int n = 0; n < kActStages - 1; ++n) issue(n);

  int64_t use_k = -1, pblock = 0, c0 = 0;
  BlockSpan span{0, 0, false};
  // The unit's rows: 8 lanes a row, 16 columns a lane (8 at 8 lane, 8 at 64 + 8 lane, so that
  // the lanes of a row read and write contiguous runs), one row a thread.
  const int lane = threadIdx.x & 7;
  const int iu = threadIdx.x >> 3;
  for (int64_t n = 0; n < units; ++n) {
    cp_async_wait<kActStages - 2>();
    __syncthreads();  // unit n is visible to all; stage (n - 1) % kActStages and the tile are free
    issue(n + kActStages - 1);
    const int64_t k = n / kUnitsPerTile;
    if (k != use_k) {
      use_k = k;
      locate(k, pblock, c0);
      span = block_span(p, ends, pblock);
    }
    const int i = static_cast<int>(n % kUnitsPerTile) * kUnitRows + iu;  // the row within the tile
    const bool active = i < span.count;
    const int64_t r = span.first + i;
    const uint16_t* stage = ring + (n % kActStages) * kIn * kUnitElems;
    float v[2][2][8];     // [plane][half][column]
    uint32_t b[2][2][4];  // the same values as bf16 pairs
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int off = iu * kBlock + h * 64 + lane * 8;
      Raw8 in{};
      in.a = *reinterpret_cast<const uint4*>(stage + off);
      if constexpr (Act == kSwiglu || Act == kSwigluBackward)
        in.u = *reinterpret_cast<const uint4*>(stage + kUnitElems + off);
      if constexpr (Act == kSwigluBackward || Act == kGeluBackward)
        in.d = *reinterpret_cast<const uint4*>(stage + (kIn - 1) * kUnitElems + off);
      compute8<Act>(in, v[0][h], v[1][h]);
#pragma unroll
      for (int q = 0; q < kPlanes; ++q) {
        if constexpr (Act == kIdentity) {  // the input's own bits
          b[q][h][0] = in.a.x, b[q][h][1] = in.a.y, b[q][h][2] = in.a.z, b[q][h][3] = in.a.w;
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e) b[q][h][e] = pack_bf16x2(v[q][h][2 * e], v[q][h][2 * e + 1]);
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kPlanes; ++q) {
      if (p.y_fp8 != nullptr) {
        uint32_t m = 0;  // the values are bf16: their amax from the pairs
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 4; ++e) m = quant::max_abs_bf16x2(m, b[q][h][e]);
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) m = __vmaxu2(m, __shfl_xor_sync(kFullMask, m, o));  // the row's 8 lanes
        if (active) {
          const float s = scale_of<I>(quant::bf16x2_amax(m));
          uint8_t* row = static_cast<uint8_t*>(p.y_fp8) + r * p.y_cols + q * p.inner;
          quant::with_quotient(Divisor(s), [&](const auto& form) {
#pragma unroll
            for (int h = 0; h < 2; ++h) store8<I>(row, c0 + h * 64 + lane * 8, p.inner, vec_y8, v[q][h], form);
          });
          if (lane == 0) p.y_scale[(q * p.inner + c0) / kBlock * p.tokens + r] = s;
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t c = c0 + h * 64 + lane * 8;
        const uint4 w = make_uint4(b[q][h][0], b[q][h][1], b[q][h][2], b[q][h][3]);
        if (p.y != nullptr && active && c < p.inner) {
          uint16_t* row = static_cast<uint16_t*>(p.y) + r * p.y_cols + q * p.inner;
          if (vec_y) {
            *reinterpret_cast<uint4*>(row + c) = w;
          } else {
            for (int e = 0; e < 8; ++e) row[c + e] = static_cast<uint16_t>(b[q][h][e / 2] >> (16 * (e % 2)));
          }
        }
        if (transposed)
          *reinterpret_cast<uint4*>(tile + (q * kBlock + i) * kBlock + h * 64 + lane * 8) =
              span.past_groups ? make_uint4(0, 0, 0, 0) : w;
      }
    }
    if (!transposed || n % kUnitsPerTile != kUnitsPerTile - 1) continue;  // uniform
    __syncthreads();
    write_transpose<I, kPlanes>(p, tile, red, pblock, c0, vec_t);
  }
  cp_async_wait<0>();  // no copy outlives the CTA
}

// ---------------------------------------------------------------- weights

// Thread t holds rows t / 16 + 16 k (k < 8) at columns 8 (t % 16) + [0, 8) of block (g, rb, cb);
// the FP8 block goes through shared memory row-major, and thread t writes 64 bytes of row
// cb * 128 + t / 2 of the transpose (a column of the block, read byte by byte).
template <class In, __nv_fp8_interpretation_t I>
__global__ void __launch_bounds__(kThreads)
    weight_kernel(const typename In::Storage* __restrict__ w, int64_t groups, int64_t rows, int64_t cols, bool vec,
                  uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, bool vec_t, float* __restrict__ scale,
                  float* __restrict__ scale_t) {
  __shared__ uint32_t red[kThreads / 32];
  __shared__ __align__(16) uint8_t tile[kBlock * kBlock];  // [row][column]
  const int64_t row_blocks = (rows + kBlock - 1) / kBlock;
  const int64_t col_blocks = (cols + kBlock - 1) / kBlock;
  const int64_t blocks = groups * row_blocks * col_blocks;
  const int col = (threadIdx.x & 15) * 8;
  const int row = threadIdx.x >> 4;
  for (int64_t blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
    const int64_t cb = blk % col_blocks;
    const int64_t rest = blk / col_blocks;
    const int64_t rb = rest % row_blocks;
    const int64_t g = rest / row_blocks;
    const auto* wg = w + g * rows * cols;
    const int64_t c = cb * kBlock + col;
    float v[8][8];
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t r = rb * kBlock + row + 16 * k;
      if (r < rows) {
        load8<In>(wg + r * cols, c, cols, vec, v[k]);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) v[k][e] = 0.f;
      }
      m = quant::max8(m, v[k]);
    }
    const float s = scale_of<I>(quant::block_max(m, red));
    if (threadIdx.x == 0) {
      scale[blk] = s;
      if (scale_t != nullptr) scale_t[(g * col_blocks + cb) * row_blocks + rb] = s;
    }
    quant::with_quotient(Divisor(s), [&](const auto& q) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const int64_t r = rb * kBlock + row + 16 * k;
        if (out != nullptr && r < rows) store8<I>(out + g * rows * cols + r * cols, c, cols, vec, v[k], q);
        if (out_t != nullptr) {
          const uint2 b = make_uint2(to_fp8x4<I>(v[k][0], v[k][1], v[k][2], v[k][3], q),
                                     to_fp8x4<I>(v[k][4], v[k][5], v[k][6], v[k][7], q));
          *reinterpret_cast<uint2*>(tile + (row + 16 * k) * kBlock + col) = b;
        }
      }
    });
    if (out_t == nullptr) continue;  // uniform
    __syncthreads();
    const int j = threadIdx.x >> 1;  // the block's column: a row of the transpose
    const int half = threadIdx.x & 1;
    const int64_t orow = cb * kBlock + j;
    const int64_t ocol = rb * kBlock + half * 64;
    if (orow < cols) {
      uint8_t* o = out_t + g * rows * cols + orow * rows + ocol;
      const uint8_t* src = tile + half * 64 * kBlock + j;
      if (vec_t && ocol + 64 <= rows) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          uint32_t q[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const uint8_t* p4 = src + (16 * k + 4 * e) * kBlock;
            q[e] = p4[0] | uint32_t(p4[kBlock]) << 8 | uint32_t(p4[2 * kBlock]) << 16 | uint32_t(p4[3 * kBlock]) << 24;
          }
          reinterpret_cast<uint4*>(o)[k] = make_uint4(q[0], q[1], q[2], q[3]);
        }
      } else {
        for (int e = 0; e < 64 && ocol + e < rows; ++e) o[e] = src[e * kBlock];
      }
    }
    __syncthreads();  // the tile is rewritten by the next block
  }
}

constexpr int kWeightStages = 3;

// Block `blk` of a (groups, row_blocks, col_blocks) grid: 32-bit divisions (a 64-bit one is a
// call of ~70 instructions; a weight has far fewer than 2^32 blocks).
__device__ __forceinline__ void split_block(int64_t blk, int64_t col_blocks, int64_t row_blocks, int64_t& g,
                                            int64_t& rb, int64_t& cb) {
  const auto b = static_cast<uint32_t>(blk), cbs = static_cast<uint32_t>(col_blocks);
  const uint32_t rest = b / cbs;
  cb = b - rest * cbs;
  rb = rest % static_cast<uint32_t>(row_blocks);
  g = rest / static_cast<uint32_t>(row_blocks);
}

// weight_kernel for bf16 weights with 8-aligned rows: the 128 x 128 blocks of a CTA stream
// through a ring of kWeightStages shared-memory stages, and the transpose reads the bf16 block
// straight from its stage (a thread per pair of columns and quarter of the rows).
template <__nv_fp8_interpretation_t I>
__global__ void __launch_bounds__(kThreads)
    weight_pipelined_kernel(const uint16_t* __restrict__ w, int64_t groups, int64_t rows, int64_t cols,
                            uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, bool vec_t,
                            float* __restrict__ scale, float* __restrict__ scale_t) {
  extern __shared__ __align__(16) uint16_t ring[];  // [stage][128][128] bf16
  __shared__ uint32_t red[kThreads / 32];
  const int64_t row_blocks = (rows + kBlock - 1) / kBlock;
  const int64_t col_blocks = (cols + kBlock - 1) / kBlock;
  const int64_t blocks = groups * row_blocks * col_blocks;
  const int64_t mine = blocks > blockIdx.x ? (blocks - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  constexpr int kElems = kBlock * kBlock;

  auto issue = [&](int64_t n) {
    if (n < mine) {
      int64_t g, rb, cb;
      split_block(blockIdx.x + n * gridDim.x, col_blocks, row_blocks, g, rb, cb);
      uint16_t* stage = ring + (n % kWeightStages) * kElems;
#pragma unroll
      for (int k = 0; k < kElems / 8 / kThreads; ++k) {
        const int chunk = threadIdx.x + k * kThreads;
        const int i = chunk / 16, cc = (chunk % 16) * 8;
        const int64_t r = rb * kBlock + i, c = cb * kBlock + cc;
        const bool valid = r < rows && c < cols;
        cp_async16(stage + i * kBlock + cc, valid ? w + (g * rows + r) * cols + c : w, valid);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int n = 0; n < kWeightStages - 1; ++n) issue(n);

  const int col = (threadIdx.x & 15) * 8;
  const int row = threadIdx.x >> 4;
  for (int64_t n = 0; n < mine; ++n) {
    cp_async_wait<kWeightStages - 2>();
    __syncthreads();
    issue(n + kWeightStages - 1);
    const int64_t blk = blockIdx.x + n * gridDim.x;
    int64_t g, rb, cb;
    split_block(blk, col_blocks, row_blocks, g, rb, cb);
    const uint16_t* stage = ring + (n % kWeightStages) * kElems;
    uint4 raw[8];
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      raw[k] = *reinterpret_cast<const uint4*>(stage + (row + 16 * k) * kBlock + col);
      const uint32_t h[4] = {raw[k].x, raw[k].y, raw[k].z, raw[k].w};
#pragma unroll
      for (int e = 0; e < 4; ++e) m = quant::max_abs_bf16x2(m, h[e]);
    }
    const float s = scale_of<I>(quant::block_max(quant::bf16x2_amax(m), red));
    const Divisor d(s);
    if (threadIdx.x == 0) {
      scale[blk] = s;
      if (scale_t != nullptr) scale_t[(g * col_blocks + cb) * row_blocks + rb] = s;
    }
    if (out != nullptr) {
      quant::with_quotient(d, [&](const auto& q) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const int64_t r = rb * kBlock + row + 16 * k;
          float v[8];
          unpack8(raw[k], v);
          if (r < rows) store8<I>(out + (g * rows + r) * cols, cb * kBlock + col, cols, true, v, q);
        }
      });
    }
    if (out_t == nullptr) continue;  // uniform
    const int jp = threadIdx.x & 63, quarter = threadIdx.x >> 6;
    constexpr int kRows = kBlock / 4;
    const uint32_t* pair = reinterpret_cast<const uint32_t*>(stage + quarter * kRows * kBlock) + jp;
    uint32_t packed[2][kRows / 4];
    quant::with_quotient(d, [&](const auto& q) { pack_column_pair<I>(pair, q, q, packed); });
    const int64_t ocol = rb * kBlock + quarter * kRows;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int64_t orow = cb * kBlock + 2 * jp + t;
      if (orow >= cols) continue;
      uint8_t* o = out_t + (g * cols + orow) * rows + ocol;
      if (vec_t && ocol + kRows <= rows) {
        reinterpret_cast<uint4*>(o)[0] = make_uint4(packed[t][0], packed[t][1], packed[t][2], packed[t][3]);
        reinterpret_cast<uint4*>(o)[1] = make_uint4(packed[t][4], packed[t][5], packed[t][6], packed[t][7]);
      } else {
        for (int e = 0; e < kRows && ocol + e < rows; ++e)
          o[e] = static_cast<uint8_t>(packed[t][e / 4] >> (8 * (e % 4)));
      }
    }
  }
  cp_async_wait<0>();
}

// ---------------------------------------------------------------- weights, one scale per channel

constexpr int kStripCols = 64;   // columns of w (rows of the transpose) a CTA owns
constexpr int kStripRows = 128;  // rows of w a CTA stages at a time

// The row recipe's dgrad copy: out_t (groups, cols, rows), w's transpose with one scale per row
// of it (a column of w: scale_t (groups, cols)), the bits quantize_fp8(..., "row") gives for
// w^T, without w^T ever formed. A CTA owns 64 columns of one group: it reads them once for
// their amax (thread t: columns 8 (t % 8) + [0, 8), every 32nd row), then again a 128-row tile
// at a time through shared memory, where thread t writes 32 bytes of transposed row t % 64.
template <class In, __nv_fp8_interpretation_t I>
__global__ void __launch_bounds__(kThreads)
    weight_rows_t_kernel(const typename In::Storage* __restrict__ w, int64_t groups, int64_t rows, int64_t cols,
                         bool vec, uint8_t* __restrict__ out_t, bool vec_t, float* __restrict__ scale_t) {
  static_assert(kThreads == 256, "the lane layouts below assume 256 threads");
  __shared__ __align__(16) float tile[kStripRows][kStripCols];
  __shared__ float strip_scale[kStripCols];
  auto* red = reinterpret_cast<uint32_t(*)[kStripCols]>(&tile[0][0]);  // [32][64] in the tile's memory
  const int64_t strips_per_group = (cols + kStripCols - 1) / kStripCols;
  const int64_t strips = groups * strips_per_group;
  const int load_col = (threadIdx.x & 7) * 8, load_row = threadIdx.x >> 3;  // 8 columns of row 0..31
  const int out_row = threadIdx.x & 63, chunk = threadIdx.x >> 6;           // 32 rows of w each
  for (int64_t strip = blockIdx.x; strip < strips; strip += gridDim.x) {
    const int64_t g = strip / strips_per_group;
    const int64_t c0 = (strip - g * strips_per_group) * kStripCols;
    const auto* wg = w + g * rows * cols;
    uint32_t m[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll 4
    for (int64_t r = load_row; r < rows; r += 32) {
      float v[8];
      load8<In>(wg + r * cols, c0 + load_col, cols, vec, v);
#pragma unroll
      for (int e = 0; e < 8; ++e) m[e] = max(m[e], abs_bits(v[e]));
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) red[load_row][load_col + e] = m[e];
    __syncthreads();
    if (threadIdx.x < kStripCols) {
      uint32_t amax = 0;
#pragma unroll 8
      for (int i = 0; i < 32; ++i) amax = max(amax, red[i][threadIdx.x]);
      const float s = scale_of<I>(amax);
      strip_scale[threadIdx.x] = s;
      if (c0 + threadIdx.x < cols) scale_t[g * cols + c0 + threadIdx.x] = s;
    }
    __syncthreads();
    const Divisor d(strip_scale[out_row]);
    const int64_t oc = c0 + out_row;  // the transposed row this thread writes
    for (int64_t r0 = 0; r0 < rows; r0 += kStripRows) {
#pragma unroll
      for (int pass = 0; pass < kStripRows / 32; ++pass) {
        const int row = load_row + 32 * pass;
        float v[8];
        if (r0 + row < rows) {
          load8<In>(wg + (r0 + row) * cols, c0 + load_col, cols, vec, v);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = 0.f;
        }
        reinterpret_cast<float4*>(&tile[row][load_col])[0] = make_float4(v[0], v[1], v[2], v[3]);
        reinterpret_cast<float4*>(&tile[row][load_col])[1] = make_float4(v[4], v[5], v[6], v[7]);
      }
      __syncthreads();
      const int64_t orow0 = r0 + chunk * 32;  // this thread's first column of its transposed row
      if (oc < cols && orow0 < rows) {
        uint32_t packed[8];
        quant::with_quotient(d, [&](const auto& q) {
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const int r = chunk * 32 + 4 * i;
            packed[i] =
                to_fp8x4<I>(tile[r][out_row], tile[r + 1][out_row], tile[r + 2][out_row], tile[r + 3][out_row], q);
          }
        });
        uint8_t* o = out_t + (g * cols + oc) * rows + orow0;
        if (vec_t && orow0 + 32 <= rows) {
          reinterpret_cast<uint4*>(o)[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
          reinterpret_cast<uint4*>(o)[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
        } else {
          for (int e = 0; e < 32 && orow0 + e < rows; ++e) o[e] = static_cast<uint8_t>(packed[e / 4] >> (8 * (e % 4)));
        }
      }
      __syncthreads();  // the tile is rewritten by the next rows (or by the next strip's amax)
    }
  }
}

// ---------------------------------------------------------------- launch

// Sets a kernel's dynamic shared memory and gives its persistent grid: the CTAs that fit on the
// device at once, never more than `work` items.
template <class Kernel>
cudaError_t persistent_grid(Kernel kernel, size_t smem, int sm_count, int64_t work, unsigned* grid) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  int per_sm = 0;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem);
  if (err != cudaSuccess) return err;
  const int64_t sms = sm_count > 0 ? sm_count : 132;
  *grid = static_cast<unsigned>(std::min<int64_t>(work, std::max(per_sm, 1) * sms));
  return cudaSuccess;
}

template <int Act, __nv_fp8_interpretation_t I>
cudaError_t launch_act_typed(const ActProblem& p, cudaStream_t stream) {
  constexpr int kPlanes = Act == kSwigluBackward ? 2 : 1;
  const size_t tile_bytes = p.yt_fp8 != nullptr ? size_t(kPlanes) * kBlock * kBlock * sizeof(uint16_t) : 0;
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  // Vector loads need every row and both halves of a SwiGLU input 16-byte aligned.
  const bool vec_in = aligned(p.x) && p.x_cols % 8 == 0 && p.inner % 8 == 0 && (p.dy == nullptr || aligned(p.dy));
  const bool vec_y = p.y != nullptr && aligned(p.y) && p.y_cols % 8 == 0 && p.inner % 8 == 0;
  const bool vec_y8 = p.y_fp8 != nullptr && aligned(p.y_fp8) && p.y_cols % 8 == 0 && p.inner % 8 == 0;
  const bool vec_t = p.yt_fp8 != nullptr && aligned(p.yt_fp8) && p.yt_ld % 16 == 0;
  const int64_t col_blocks = (p.inner + kBlock - 1) / kBlock;
  // The pipelined kernel streams contiguous rows (a gather takes the one-shot kernel) and
  // splits tiles in 32 bits.
  if (vec_in && p.x_rows == nullptr && p.row_blocks * col_blocks < (int64_t(1) << 32)) {
    const size_t smem = size_t(kActStages) * input_planes<Act>() * kUnitRows * kBlock * sizeof(uint16_t) + tile_bytes;
    unsigned grid = 0;
    const cudaError_t err =
        persistent_grid(act_pipelined_kernel<Act, I>, smem, p.sm_count, p.row_blocks * col_blocks, &grid);
    if (err != cudaSuccess) return err;
    act_pipelined_kernel<Act, I><<<grid, kThreads, smem, stream>>>(p, col_blocks, vec_y, vec_y8, vec_t);
    return cudaGetLastError();
  }
  if (tile_bytes > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(act_kernel<Act, I>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(tile_bytes));
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(static_cast<unsigned>(p.row_blocks), static_cast<unsigned>(col_blocks));
  act_kernel<Act, I><<<grid, kThreads, tile_bytes, stream>>>(p, vec_in, vec_y, vec_y8, vec_t);
  return cudaGetLastError();
}

template <__nv_fp8_interpretation_t I>
cudaError_t launch_act_fp8(const ActProblem& p, cudaStream_t stream) {
  switch (p.act) {
    case kIdentity:
      return launch_act_typed<kIdentity, I>(p, stream);
    case kSwiglu:
      return launch_act_typed<kSwiglu, I>(p, stream);
    case kGelu:
      return launch_act_typed<kGelu, I>(p, stream);
    case kSwigluBackward:
      return launch_act_typed<kSwigluBackward, I>(p, stream);
    case kGeluBackward:
      return launch_act_typed<kGeluBackward, I>(p, stream);
  }
  return cudaErrorInvalidValue;
}

template <class In, __nv_fp8_interpretation_t I>
cudaError_t launch_weight_typed(const WeightProblem& p, cudaStream_t stream) {
  const int64_t blocks = p.groups * ((p.rows + kBlock - 1) / kBlock) * ((p.cols + kBlock - 1) / kBlock);
  if (blocks == 0) return cudaSuccess;
  const int64_t sms = p.sm_count > 0 ? p.sm_count : 132;
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const bool vec = aligned(p.w) && (p.out == nullptr || aligned(p.out)) && p.cols % 8 == 0;
  const bool vec_t = p.out_t != nullptr && aligned(p.out_t) && p.rows % 16 == 0;
  if constexpr (std::is_same_v<In, Bf16>) {
    if (vec && blocks < (int64_t(1) << 32)) {  // the kernel splits blocks in 32 bits
      const size_t smem = size_t(kWeightStages) * kBlock * kBlock * sizeof(uint16_t);
      unsigned grid = 0;
      const cudaError_t err = persistent_grid(weight_pipelined_kernel<I>, smem, p.sm_count, blocks, &grid);
      if (err != cudaSuccess) return err;
      weight_pipelined_kernel<I><<<grid, kThreads, smem, stream>>>(
          static_cast<const uint16_t*>(p.w), p.groups, p.rows, p.cols, static_cast<uint8_t*>(p.out),
          static_cast<uint8_t*>(p.out_t), vec_t, p.scale, p.scale_t);
      return cudaGetLastError();
    }
  }
  const auto grid = static_cast<unsigned>(std::min<int64_t>(blocks, sms * 8));
  weight_kernel<In, I><<<grid, kThreads, 0, stream>>>(static_cast<const typename In::Storage*>(p.w), p.groups, p.rows,
                                                      p.cols, vec, static_cast<uint8_t*>(p.out),
                                                      static_cast<uint8_t*>(p.out_t), vec_t, p.scale, p.scale_t);
  return cudaGetLastError();
}

// The row recipe's dgrad copy (weight_rows_t_kernel).
template <class In, __nv_fp8_interpretation_t I>
cudaError_t launch_weight_rows_t_typed(const WeightProblem& p, cudaStream_t stream) {
  const int64_t strips = p.groups * ((p.cols + kStripCols - 1) / kStripCols);
  if (strips == 0) return cudaSuccess;
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const bool vec = aligned(p.w) && p.cols % 8 == 0;
  const bool vec_t = aligned(p.out_t) && p.rows % 16 == 0;
  unsigned grid = 0;
  const cudaError_t err = persistent_grid(weight_rows_t_kernel<In, I>, 0, p.sm_count, strips, &grid);
  if (err != cudaSuccess) return err;
  weight_rows_t_kernel<In, I><<<grid, kThreads, 0, stream>>>(static_cast<const typename In::Storage*>(p.w), p.groups,
                                                             p.rows, p.cols, vec, static_cast<uint8_t*>(p.out_t), vec_t,
                                                             p.scale_t);
  return cudaGetLastError();
}

template <class In>
cudaError_t launch_weight_for_input(const WeightProblem& p, cudaStream_t stream) {
  if (p.row_scales)
    return p.fp8_dtype == DG_E5M2 ? launch_weight_rows_t_typed<In, __NV_E5M2>(p, stream)
                                  : launch_weight_rows_t_typed<In, __NV_E4M3>(p, stream);
  return p.fp8_dtype == DG_E5M2 ? launch_weight_typed<In, __NV_E5M2>(p, stream)
                                : launch_weight_typed<In, __NV_E4M3>(p, stream);
}

// The row recipe's forward copy: quantize_fp8's per-row kernel on w as (groups * rows, cols),
// which picks its own types.
cudaError_t launch_weight_rows(const WeightProblem& p, cudaStream_t stream) {
  quant::QuantizeProblem q;
  q.x = p.w;
  q.x_dtype = p.w_dtype;
  q.rows = p.groups * p.rows;
  q.cols = p.cols;
  q.granularity = quant::kRow;
  q.out = p.out;
  q.out_dtype = p.fp8_dtype;
  q.scale = p.scale;
  q.sm_count = p.sm_count;
  return quant::launch_quantize_fp8(q, stream);
}

}  // namespace

cudaError_t launch_act(const ActProblem& p, cudaStream_t stream) {
  if (p.row_blocks == 0 || p.inner == 0) return cudaSuccess;
  if (p.ends != nullptr) {
    quant::group_ends_kernel<<<1, 1024, 0, stream>>>(p.offs, p.groups, p.tokens, p.ends);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return p.fp8_dtype == DG_E5M2 ? launch_act_fp8<__NV_E5M2>(p, stream) : launch_act_fp8<__NV_E4M3>(p, stream);
}

cudaError_t launch_weight_quantize(const WeightProblem& p, cudaStream_t stream) {
  if (p.row_scales && p.out != nullptr) {
    const cudaError_t err = launch_weight_rows(p, stream);
    if (err != cudaSuccess || p.out_t == nullptr) return err;
  }
  return quant::with_input_type(p.w_dtype, [&](auto in) { return launch_weight_for_input<decltype(in)>(p, stream); });
}

}  // namespace distgemm::moe

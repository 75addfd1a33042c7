// FP8 quantization kernels (plain CUDA, every arch the build compiles): per tensor, per row,
// per 1 x 128 (also transposed, optionally padded per group) and per 128 x 128 block.
//
// Every block's scale is amax / fp8_max in float32 (IEEE division), or 1 where that is 0, and
// its data is saturate_rn(x / scale): the correctly rounded quotient (quant::Divisor), not a
// product with 1 / scale, so that the plain-PyTorch reference (distgemm/quantize.py) gives the
// same bits. The amax is a
// max over the float bits of |x| as unsigned integers: the numeric order for non-negative
// floats, with a NaN above +inf, so one NaN makes its block's scale and data NaN.
//
// Memory-bound: 16-byte loads of the input where the pointers and row pitch allow, 8- or
// 16-byte stores of the FP8 data, one pass over the input (two for the rows that do not fit in
// registers and for the per-tensor amax).
#include <algorithm>
#include <cstdint>

#include "quant/fp8_device.cuh"

namespace distgemm::quant {
namespace {

// ---------------------------------------------------------------- per tensor

// *amax = max(*amax, the bits of max |x|) over the n elements of x (*amax zeroed before).
template <class In>
__global__ void __launch_bounds__(kThreads)
    tensor_amax_kernel(const typename In::Storage* __restrict__ x, int64_t n, bool vec, uint32_t* amax) {
  __shared__ uint32_t red[kThreads / 32];
  uint32_t m = 0;
  const int64_t vectors = (n + 7) / 8;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < vectors; i += int64_t(gridDim.x) * kThreads) {
    float v[8];
    load8<In>(x, i * 8, n, vec, v);
    m = max8(m, v);
  }
  m = block_max(m, red);
  if (threadIdx.x == 0 && m != 0) atomicMax(amax, m);
}

template <class In, __nv_fp8_interpretation_t I>
__global__ void __launch_bounds__(kThreads)
    tensor_quantize_kernel(const typename In::Storage* __restrict__ x, int64_t n, bool vec, const uint32_t* amax,
                           uint8_t* __restrict__ out, float* scale) {
  const float s = scale_of<I>(*amax);
  const Divisor d(s);
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale = s;
  const int64_t vectors = (n + 7) / 8;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < vectors; i += int64_t(gridDim.x) * kThreads) {
    float v[8];
    load8<In>(x, i * 8, n, vec, v);
    store8<I>(out, i * 8, n, vec, v, d);
  }
}

// ---------------------------------------------------------------- per row

// A CTA per row: amax over the row, then the row quantized. The first kCached vectors of 8
// elements per thread stay in registers between the passes (rows of up to 8192 elements are
// read once); the rest are read again (mostly from L2).
template <class In, __nv_fp8_interpretation_t I>
__global__ void __launch_bounds__(kThreads)
    row_quantize_kernel(const typename In::Storage* __restrict__ x, int64_t rows, int64_t cols, bool vec,
                        uint8_t* __restrict__ out, float* __restrict__ scale) {
  constexpr int kCached = 4;
  __shared__ uint32_t red[kThreads / 32];
  const int64_t vectors = (cols + 7) / 8;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const auto* xr = x + r * cols;
    uint8_t* outr = out + r * cols;
    float cache[kCached][8];
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < kCached; ++k) {
      const int64_t i = threadIdx.x + int64_t(k) * kThreads;
      if (i < vectors) {
        load8<In>(xr, i * 8, cols, vec, cache[k]);
        m = max8(m, cache[k]);
      }
    }
    for (int64_t i = threadIdx.x + int64_t(kCached) * kThreads; i < vectors; i += kThreads) {
      float v[8];
      load8<In>(xr, i * 8, cols, vec, v);
      m = max8(m, v);
    }
    const float s = scale_of<I>(block_max(m, red));
    const Divisor d(s);
    if (threadIdx.x == 0) scale[r] = s;
#pragma unroll
    for (int k = 0; k < kCached; ++k) {
      const int64_t i = threadIdx.x + int64_t(k) * kThreads;
      if (i < vectors) store8<I>(outr, i * 8, cols, vec, cache[k], d);
    }
    for (int64_t i = threadIdx.x + int64_t(kCached) * kThreads; i < vectors; i += kThreads) {
      float v[8];
      load8<In>(xr, i * 8, cols, vec, v);
      store8<I>(outr, i * 8, cols, vec, v, d);
    }
  }
}

// ---------------------------------------------------------------- 1 x 128

// 16 lanes per (row, 128-column block), 8 elements each; a warp takes two consecutive blocks
// of the row-major order. Scale (r, cb) goes to scale[cb * rows + r].
template <class In, __nv_fp8_interpretation_t I>
__global__ void __launch_bounds__(kThreads)
    quantize_1x128_kernel(const typename In::Storage* __restrict__ x, int64_t rows, int64_t cols, bool vec,
                          uint8_t* __restrict__ out, float* __restrict__ scale) {
  const int64_t col_blocks = (cols + kBlock - 1) / kBlock;
  const int64_t items = rows * col_blocks;
  const int sub = threadIdx.x & 15;
  const int half = (threadIdx.x >> 4) & 1;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / 32);
  // The loop is uniform across the warp (the shuffles need all 32 lanes).
  for (int64_t w = int64_t(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5); w * 2 < items; w += warps) {
    const int64_t item = w * 2 + half;
    const bool active = item < items;
    const int64_t r = active ? item / col_blocks : 0;
    const int64_t cb = active ? item - r * col_blocks : 0;
    const int64_t c = cb * kBlock + sub * 8;
    float v[8];
    if (active) {
      load8<In>(x + r * cols, c, cols, vec, v);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = 0.f;
    }
    uint32_t m = max8(0u, v);
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(kFullMask, m, o));  // within 16 lanes
    if (!active) continue;
    const float s = scale_of<I>(m);
    const Divisor d(s);
    store8<I>(out + r * cols, c, cols, vec, v, d);
    if (sub == 0) scale[cb * rows + r] = s;
  }
}

// ---------------------------------------------------------------- 128 x 128

// A CTA per block: thread t holds rows t / 16 + 16 k (k < 8) at columns 8 (t % 16) + [0, 8).
// Block (b, rb, cb) of the (batch, row blocks, column blocks) grid has scale[block index].
template <class In, __nv_fp8_interpretation_t I>
__global__ void __launch_bounds__(kThreads)
    quantize_128x128_kernel(const typename In::Storage* __restrict__ x, int64_t batch, int64_t rows, int64_t cols,
                            bool vec, uint8_t* __restrict__ out, float* __restrict__ scale) {
  __shared__ uint32_t red[kThreads / 32];
  const int64_t row_blocks = (rows + kBlock - 1) / kBlock;
  const int64_t col_blocks = (cols + kBlock - 1) / kBlock;
  const int64_t blocks = batch * row_blocks * col_blocks;
  const int col = (threadIdx.x & 15) * 8;
  const int row = threadIdx.x >> 4;
  for (int64_t blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
    const int64_t cb = blk % col_blocks;
    const int64_t rest = blk / col_blocks;
    const int64_t rb = rest % row_blocks;
    const int64_t b = rest / row_blocks;
    const auto* xb = x + b * rows * cols;
    uint8_t* outb = out + b * rows * cols;
    const int64_t c = cb * kBlock + col;
    float v[8][8];
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t r = rb * kBlock + row + 16 * k;
      if (r < rows) {
        load8<In>(xb + r * cols, c, cols, vec, v[k]);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[k][i] = 0.f;
      }
      m = max8(m, v[k]);
    }
    const float s = scale_of<I>(block_max(m, red));
    const Divisor d(s);
    if (threadIdx.x == 0) scale[blk] = s;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t r = rb * kBlock + row + 16 * k;
      if (r < rows) store8<I>(outb + r * cols, c, cols, vec, v[k], d);
    }
  }
}

// ---------------------------------------------------------------- 1 x 128, transposed

constexpr int kTileCols = 64;  // columns of x per tile: rows of out

// A CTA per block p of 128 rows of out's (padded) token dimension and a column tile of x: the
// tile x[first, first + count) x [c0, c0 + 64) goes through shared memory, so x is read and out
// written in full rows. Without ends (no offs): block p holds rows 128 p .. of x, and out has
// `out_ld` = rows columns. With ends: p is the (p - first_block(g))-th block of group g, out has
// out_ld = 128 * row_blocks columns and every one of the block's 128 is written (zeros past the
// group's rows; a block without rows gets scale 1). Scale (p, c) goes to scale[p * cols + c].
template <class In, __nv_fp8_interpretation_t I>
__global__ void __launch_bounds__(kThreads)
    quantize_transposed_kernel(const typename In::Storage* __restrict__ x, int64_t rows, int64_t cols, bool vec_in,
                               const int32_t* __restrict__ ends, int64_t groups, int64_t row_blocks,
                               uint8_t* __restrict__ out, int64_t out_ld, bool vec_out, float* __restrict__ scale) {
  __shared__ float tile[kBlock][kTileCols + 1];
  __shared__ uint32_t red[kThreads / kTileCols][kTileCols];
  __shared__ int64_t span[2];
  const int64_t col_tiles = (cols + kTileCols - 1) / kTileCols;
  const int j = threadIdx.x % kTileCols;                           // the tile column this thread reduces and writes
  const int q = threadIdx.x / kTileCols;                           // and its quarter of the 128 rows
  constexpr int kRowsPerThread = kBlock / (kThreads / kTileCols);  // 32
  for (int64_t p = blockIdx.x; p < row_blocks; p += gridDim.x) {
    if (threadIdx.x < 32) {
      int64_t first, count;
      if (ends == nullptr) {
        first = p * kBlock;
        count = min64(kBlock, rows - first);
      } else {
        const int64_t g = find_group(ends, groups, p);
        const int64_t start = g == 0 ? 0 : ends[g - 1];
        first = start + (p - (g + start / kBlock)) * kBlock;
        count = min64(kBlock, max64(0, ends[g] - first));
      }
      if (threadIdx.x == 0) {
        span[0] = first;
        span[1] = count;
      }
    }
    __syncthreads();
    const int64_t first = span[0];
    const int count = static_cast<int>(span[1]);
    for (int64_t t = blockIdx.y; t < col_tiles; t += gridDim.y) {
      const int64_t c0 = t * kTileCols;
      // 128 rows x 8 groups of 8 columns: a warp reads 4 rows of 64 columns.
#pragma unroll
      for (int k = 0; k < kBlock * (kTileCols / 8) / kThreads; ++k) {
        const int idx = threadIdx.x + k * kThreads;
        const int i = idx / (kTileCols / 8);
        const int jc = (idx % (kTileCols / 8)) * 8;
        float v[8];
        if (i < count) {
          load8<In>(x + (first + i) * cols, c0 + jc, cols, vec_in, v);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) tile[i][jc + e] = v[e];
      }
      __syncthreads();
      uint32_t m = 0;
#pragma unroll 8
      for (int r = 0; r < kRowsPerThread; ++r) m = max(m, abs_bits(tile[q * kRowsPerThread + r][j]));
      red[q][j] = m;
      __syncthreads();
#pragma unroll
      for (int k = 0; k < kThreads / kTileCols; ++k) m = max(m, red[k][j]);
      const float s = scale_of<I>(m);
      const Divisor d(s);
      const int64_t c = c0 + j;
      if (c < cols) {
        if (q == 0) scale[p * cols + c] = s;
        const int64_t col = p * kBlock + q * kRowsPerThread;  // out's first column written here
        uint8_t* o = out + c * out_ld + col;
        const float* src = &tile[q * kRowsPerThread][j];
        constexpr int kPitch = kTileCols + 1;
        if (vec_out && col + kRowsPerThread <= out_ld) {
          uint32_t w[kRowsPerThread / 4];
          quant::with_quotient(d, [&](const auto& q) {
#pragma unroll
            for (int k = 0; k < kRowsPerThread / 4; ++k)
              w[k] = to_fp8x4<I>(src[(4 * k) * kPitch], src[(4 * k + 1) * kPitch], src[(4 * k + 2) * kPitch],
                                 src[(4 * k + 3) * kPitch], q);
          });
#pragma unroll
          for (int k = 0; k < kRowsPerThread / 16; ++k)
            reinterpret_cast<uint4*>(o)[k] = make_uint4(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]);
        } else {
          for (int r = 0; r < kRowsPerThread && col + r < out_ld; ++r) o[r] = to_fp8<I>(src[r * kPitch], d);
        }
      }
      __syncthreads();  // the tile and red are rewritten by the next tile
    }
    __syncthreads();  // span is rewritten for the next block
  }
}

// ---------------------------------------------------------------- launch

template <class In, __nv_fp8_interpretation_t I>
cudaError_t launch_typed(const QuantizeProblem& p, cudaStream_t stream) {
  using T = typename In::Storage;
  const T* x = static_cast<const T*>(p.x);
  auto* out = static_cast<uint8_t*>(p.out);
  const int64_t sms = p.sm_count > 0 ? p.sm_count : 132;
  // Grid-stride loops everywhere: enough CTAs to fill the GPU a few times over, never more
  // than a grid dimension holds.
  auto grid = [&](int64_t ctas, int64_t per_sm) {
    return static_cast<unsigned>(std::max<int64_t>(1, std::min(ctas, sms * per_sm)));
  };
  const bool x16 = reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
  const bool out16 = reinterpret_cast<uintptr_t>(p.out) % 16 == 0;
  const bool rows_vec = x16 && out16 && p.cols % 8 == 0;  // every row's start aligned too
  switch (p.granularity) {
    case kTensor: {
      const int64_t n = p.batch * p.rows * p.cols;
      auto* amax = static_cast<uint32_t*>(p.workspace);
      const cudaError_t err = cudaMemsetAsync(amax, 0, sizeof(uint32_t), stream);
      if (err != cudaSuccess) return err;
      const int64_t ctas = ((n + 7) / 8 + kThreads - 1) / kThreads;
      tensor_amax_kernel<In><<<grid(ctas, 8), kThreads, 0, stream>>>(x, n, x16, amax);
      tensor_quantize_kernel<In, I><<<grid(ctas, 32), kThreads, 0, stream>>>(x, n, x16 && out16, amax, out, p.scale);
      break;
    }
    case kRow:
      if (p.rows > 0)
        row_quantize_kernel<In, I>
            <<<grid(p.rows, 32), kThreads, 0, stream>>>(x, p.rows, p.cols, rows_vec, out, p.scale);
      break;
    case k1x128:
      if (!p.transpose) {
        const int64_t items = p.rows * ((p.cols + kBlock - 1) / kBlock);
        if (items > 0)
          quantize_1x128_kernel<In, I>
              <<<grid((items + 15) / 16, 64), kThreads, 0, stream>>>(x, p.rows, p.cols, rows_vec, out, p.scale);
      } else if (p.cols > 0 && p.row_blocks > 0) {
        int32_t* ends = nullptr;
        if (p.offs) {
          ends = static_cast<int32_t*>(p.workspace);
          group_ends_kernel<<<1, 1024, 0, stream>>>(p.offs, p.groups, p.rows, ends);
        }
        // Blocks along x; along y the column tiles, 4 per CTA (one group search per 256
        // columns) unless that leaves the GPU short of CTAs.
        const int64_t col_tiles = (p.cols + kTileCols - 1) / kTileCols;
        int64_t tiles_y = (col_tiles + 3) / 4;
        const int64_t tiles_wanted = (4 * sms + p.row_blocks - 1) / p.row_blocks;
        if (tiles_y < tiles_wanted) tiles_y = std::min(col_tiles, tiles_wanted);
        const dim3 blocks(static_cast<unsigned>(std::min<int64_t>(p.row_blocks, 0x7fffffff)),
                          static_cast<unsigned>(std::min<int64_t>(tiles_y, 65535)));
        const bool vec_in = x16 && p.cols % 8 == 0;
        const bool vec_out = out16 && p.out_ld % 16 == 0;
        quantize_transposed_kernel<In, I><<<blocks, kThreads, 0, stream>>>(
            x, p.rows, p.cols, vec_in, ends, p.groups, p.row_blocks, out, p.out_ld, vec_out, p.scale);
      }
      break;
    case k128x128: {
      const int64_t blocks = p.batch * ((p.rows + kBlock - 1) / kBlock) * ((p.cols + kBlock - 1) / kBlock);
      if (blocks > 0)
        quantize_128x128_kernel<In, I>
            <<<grid(blocks, 16), kThreads, 0, stream>>>(x, p.batch, p.rows, p.cols, rows_vec, out, p.scale);
      break;
    }
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <class In>
cudaError_t launch_for_input(const QuantizeProblem& p, cudaStream_t stream) {
  return p.out_dtype == DG_E5M2 ? launch_typed<In, __NV_E5M2>(p, stream) : launch_typed<In, __NV_E4M3>(p, stream);
}

}  // namespace

cudaError_t launch_quantize_fp8(const QuantizeProblem& p, cudaStream_t stream) {
  return with_input_type(p.x_dtype, [&](auto in) { return launch_for_input<decltype(in)>(p, stream); });
}

}  // namespace distgemm::quant

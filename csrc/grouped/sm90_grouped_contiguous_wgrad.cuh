// SM90 grouped weight gradient over the contiguous token tensors (bf16/fp16 in, FP32 out):
// out[g] (N, K) = dy[rows_g]^T @ x[rows_g] for every group g, with one TMA descriptor for dy
// (T, N) and one for x (T, K), both read MN-major, and one for out as a (N, K, G) tensor, so no
// argument builder runs and no per-group descriptor is built or fenced (the ptr-array wgrads
// rewrite and fence four on every change of group: on few-token wgrads, nearly every tile).
// Its first epilogue stored from registers through a padded staging tile and ran 0.52-0.80x a
// dense bmm where the ptr-array wgrads run 0.77-0.97x
// (bench/results/h200_grouped_profile_contig_wgrad.json); it now stores with TMA,
// asynchronously, as the ptr-array kernels do, and is one of the autotuner's candidates in the
// default build (grouped_instances.def says where it wins).
//
// A tile's reduction runs over its group's tokens from the group's first token (any token: TMA
// takes element coordinates), 64 a step. The last step also loads the next group's first
// tokens: the consumers zero them in both shared-memory tiles before the tensor cores read
// them (past T, TMA's out-of-bounds fill gives zeros already). Persistent CTAs walk the (group,
// N tile, K tile) units. The epilogue writes the FP32 tile 128 bytes of columns at a time into
// one of two swizzled shared-memory buffers and one thread stores it with TMA (clipped at N
// and K by the descriptor), or, accumulating, adds it with TMA's FP32 reduce-add (one rounding,
// as beta = 1), while the consumers go on to the next columns or the next tile.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/grid_dependency_control.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/pipeline/pipeline.hpp>

#include "common/cutlass_types.cuh"
#include "common/status.h"
#include "grouped/grouped_problem.h"
#include "grouped/sm90_grouped_common.cuh"
#include "grouped/sm90_grouped_contiguous_common.cuh"

namespace distgemm::grouped::sm90 {

using namespace cute;

template <dg_dtype In, dg_dtype Out, int TileM, int TileN>
struct ContiguousWgrad : ContiguousKernelShape<In, Out,
                                               cutlass::layout::ColumnMajor,  // dy^T (N, T): dy (T, N), N-major
                                               cutlass::layout::RowMajor,     // x^T (K, T): x (T, K), K-major
                                               TileM, TileN, 1> {
  using Base = typename ContiguousWgrad::ContiguousKernelShape;
  using typename Base::CollectiveMainloop;
  using typename Base::Element;
  using typename Base::ElementD;
  using typename Base::StrideA;
  using typename Base::StrideB;
  static constexpr int kStepTokens = Base::kStepK;  // tokens per K step
  static_assert(std::is_same_v<ElementD, float>,
                "FP32 out: accumulating is TMA's reduce-add, exact (one rounding) only in FP32");

  // The epilogue's shared memory: kEpiBuffers tiles of TileM rows x 128 bytes, swizzled as TMA
  // and the bank-spread accumulator writes both want.
  static constexpr int kEpiCols = 128 / static_cast<int>(sizeof(ElementD));  // 32 floats
  static constexpr int kEpiBuffers = 2;
  using SmemLayoutEpi =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<ElementD>{}, Shape<Int<TileM>, Int<kEpiCols>>{}));
  struct SharedStorage {
    typename CollectiveMainloop::TensorStorage mainloop;  // first: 1024-byte aligned swizzles
    alignas(1024) ElementD epilogue[kEpiBuffers][cosize_v<SmemLayoutEpi>];
    alignas(16) typename CollectiveMainloop::PipelineStorage pipeline;
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  // The mainloop's stage count was set aside for Base's staging: this epilogue must fit there.
  static_assert(sizeof(SharedStorage::epilogue) <= Base::kStagingBytes);

  // out as (N, K, G): row stride K, group stride N * K.
  using StrideOut = Stride<int64_t, _1, int64_t>;
  static auto out_tensor(ElementD* d, int n, int k, int groups) {
    return make_tensor(make_gmem_ptr(d), make_shape(n, k, groups), StrideOut{int64_t(k), _1{}, int64_t(n) * k});
  }
  using TmaStore = decltype(make_tma_copy(SM90_TMA_STORE{}, out_tensor(nullptr, 0, 0, 0), SmemLayoutEpi{}));
  using TmaAdd = decltype(make_tma_copy(SM90_TMA_REDUCE_ADD{}, out_tensor(nullptr, 0, 0, 0), SmemLayoutEpi{}));

  struct Params {
    typename CollectiveMainloop::Params mainloop;
    TmaStore tma_store;
    TmaAdd tma_add;  // accumulate: out += the tile
    const int32_t* offs;
    int groups, tokens, n, k;
    int m_tiles, n_tiles;  // of one group's (N, K) output
    bool accumulate;
    // The (group, N tile, K tile) grid the persistent CTAs walk.
    __host__ __device__ int64_t units() const { return int64_t(m_tiles) * n_tiles * groups; }
  };

  static Params params(const GroupedProblem& p) {
    StrideA sa{};
    get<1>(sa) = p.n;
    StrideB sb{};
    get<1>(sb) = p.k;
    const int t = static_cast<int>(p.tokens), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
    typename CollectiveMainloop::Arguments args{static_cast<Element const*>(p.a), sa, static_cast<Element const*>(p.b),
                                                sb};
    Params out{};
    out.mainloop = CollectiveMainloop::to_underlying_arguments(make_shape(n, k, t, 1), args, nullptr);
    auto d = out_tensor(static_cast<ElementD*>(p.d), n, k, static_cast<int>(p.groups));
    out.tma_store = make_tma_copy(SM90_TMA_STORE{}, d, SmemLayoutEpi{});
    out.tma_add = make_tma_copy(SM90_TMA_REDUCE_ADD{}, d, SmemLayoutEpi{});
    out.offs = p.offs;
    out.groups = p.groups;
    out.tokens = t;
    out.n = n;
    out.k = k;
    out.m_tiles = (n + TileM - 1) / TileM;
    out.n_tiles = (k + TileN - 1) / TileN;
    out.accumulate = p.accumulate;
    return out;
  }
};

// Unit u of the (group, N tile, K tile) grid: group-major, so that the CTAs running at once
// share a group's tokens in L2.
struct WgradUnit {
  int g, m_tile, n_tile;
  int64_t start, rows;  // the group's tokens
  int k_steps;          // their steps of kStepTokens: the producer's loads, the consumers' MMAs
};
template <class W>
__device__ WgradUnit wgrad_unit(typename W::Params const& params, int64_t u) {
  const int64_t per_group = int64_t(params.m_tiles) * params.n_tiles;
  WgradUnit w;
  w.g = static_cast<int>(u / per_group);
  const int64_t r = u - w.g * per_group;
  w.m_tile = static_cast<int>(r % params.m_tiles);
  w.n_tile = static_cast<int>(r / params.m_tiles);
  const GroupRows rows = group_rows(params.offs, params.tokens, w.g);
  w.start = rows.start;
  w.rows = rows.rows;
  w.k_steps = static_cast<int>((rows.rows + W::kStepTokens - 1) / W::kStepTokens);
  return w;
}

// The consumers' K loop over one tile's token steps (CUTLASS's collective mma, one step's MMAs
// in flight), zeroing dy's and x's tokens [valid_last, kStepTokens) of the last step first.
template <class W, class Accumulators>
__device__ void mma_group_tokens(typename W::Pipeline& pipeline, typename W::PipelineState read, Accumulators& accum,
                                 int k_steps, int valid_last, int mma_thread,
                                 typename W::CollectiveMainloop::TensorStorage& smem) {
  using Mainloop = typename W::CollectiveMainloop;
  constexpr int kTileM = size<0>(typename W::TileShape{});
  constexpr int kTileN = size<1>(typename W::TileShape{});
  Tensor sA = make_tensor(make_smem_ptr(smem.smem_A.data()), typename Mainloop::SmemLayoutA{});  // (M, K, PIPE)
  Tensor sB = make_tensor(make_smem_ptr(smem.smem_B.data()), typename Mainloop::SmemLayoutB{});  // (N, K, PIPE)
  typename W::TiledMma tiled_mma;
  constexpr int kWarpGroups = W::kConsumerThreads / cutlass::NumThreadsPerWarpGroup;
  auto warp_groups = make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
  const int warp_group = __shfl_sync(0xffffffffu, mma_thread / cutlass::NumThreadsPerWarpGroup, 0);
  auto thr_mma = tiled_mma.get_slice(warp_groups(warp_group));
  Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));
  Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));

  auto release = read;
  tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
  warpgroup_fence_operand(accum);
  for (int step = 0; step < k_steps; ++step) {
    pipeline.consumer_wait(read);
    const int stage = read.index();
    if (step == k_steps - 1 && valid_last < W::kStepTokens) {
      // Both operands: a zero in one alone leaves 0 * Inf = NaN where the other's tokens past
      // the group (the next expert's, or rows past offs[-1]) hold an Inf or a NaN.
      for (int i = valid_last * kTileM + mma_thread; i < W::kStepTokens * kTileM; i += W::kConsumerThreads)
        sA(i % kTileM, i / kTileM, stage) = typename W::Element(0);
      for (int i = valid_last * kTileN + mma_thread; i < W::kStepTokens * kTileN; i += W::kConsumerThreads)
        sB(i % kTileN, i / kTileN, stage) = typename W::Element(0);
      cutlass::arch::fence_view_async_shared();  // the writes, visible to the tensor cores' reads
      cutlass::arch::NamedBarrier::sync(W::kConsumerThreads, 1);
    }
    warpgroup_fence_operand(accum);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tCrA); ++kb) {
      cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), accum);
      tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_wait<1>();  // the previous step's MMAs are done: its stage goes back to the producer
    warpgroup_fence_operand(accum);
    if (step > 0) {
      pipeline.consumer_release(release);
      ++release;
    }
    ++read;
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(accum);
  if (k_steps > 0) pipeline.consumer_release(release);
}

// One output tile from the consumers' accumulators: kEpiCols columns at a time into the next
// epilogue buffer, stored (or added) by TMA from consumer thread 0, who first waits until the
// store that last read that buffer has read it. `buffer` carries the rotation across tiles.
template <class W, class Accumulators, class OutCoords>
__device__ void store_tile_tma(Accumulators const& acc, typename W::SharedStorage& shared,
                               typename W::Params const& params, OutCoords const& out, WgradUnit const& w,
                               int mma_thread, int& buffer) {
  constexpr int kTileM = size<0>(typename W::TileShape{});
  constexpr int kTileN = size<1>(typename W::TileShape{});
  constexpr int kCols = W::kEpiCols;
  const bool issuer = mma_thread == 0;
  typename W::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(mma_thread);
  Tensor coords = thr_mma.partition_C(make_identity_tensor(make_shape(Int<kTileM>{}, Int<kTileN>{})));
  CUTE_UNROLL
  for (int pass = 0; pass < kTileN / kCols; ++pass) {
    if (issuer) tma_store_wait<W::kEpiBuffers - 1>();  // this buffer's last store has read it
    cutlass::arch::NamedBarrier::sync(W::kConsumerThreads, 0);
    // sD(r, c), the 128-byte swizzle written out (16-byte chunks XOR the row mod 8; the buffer
    // is 1024-byte aligned): through CuTe's layout the addresses of all 64 accumulators stay
    // live and spill.
    typename W::ElementD* staged = shared.epilogue[buffer];
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) {
      const int r = get<0>(coords(i)), c = get<1>(coords(i)) - pass * kCols;
      if (c >= 0 && c < kCols) staged[r * kCols + (c ^ ((r & 7) << 2))] = acc(i);
    }
    cutlass::arch::fence_view_async_shared();  // the writes, visible to TMA's reads
    cutlass::arch::NamedBarrier::sync(W::kConsumerThreads, 0);
    if (issuer) {
      Tensor sD = make_tensor(make_smem_ptr(shared.epilogue[buffer]), typename W::SmemLayoutEpi{});
      Tensor gD = local_tile(out(_, _, w.g), make_shape(Int<kTileM>{}, Int<kCols>{}),
                             make_coord(w.m_tile, w.n_tile * (kTileN / kCols) + pass));
      if (params.accumulate) {
        auto tma = params.tma_add.get_slice(Int<0>{});
        copy(params.tma_add, tma.partition_S(sD), tma.partition_D(gD));
      } else {
        auto tma = params.tma_store.get_slice(Int<0>{});
        copy(params.tma_store, tma.partition_S(sD), tma.partition_D(gD));
      }
      tma_store_arrive();
    }
    buffer = (buffer + 1) % W::kEpiBuffers;
  }
}

template <class W>
__global__ void __launch_bounds__(W::kThreads, 1)
    contiguous_grouped_wgrad(const __grid_constant__ typename W::Params params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Mainloop = typename W::CollectiveMainloop;
  using Pipeline = typename W::Pipeline;
  extern __shared__ __align__(1024) char smem[];
  ContiguousCta<W> cta(smem, params);
  auto& shared = cta.shared;
  auto& pipeline = cta.pipeline;

  const int64_t units = params.units();
  Mainloop mainloop;
  Tensor mA = params.mainloop.tma_load_a.get_tma_tensor(make_shape(params.n, params.tokens, 1));
  Tensor mB = params.mainloop.tma_load_b.get_tma_tensor(make_shape(params.k, params.tokens, 1));

  if (cta.warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (cta.warp != 0) return;
    auto write = cutlass::make_producer_start_state<Pipeline>();
    for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
      const WgradUnit w = wgrad_unit<W>(params, u);
      if (w.k_steps == 0) continue;
      Tensor gA = local_tile(domain_offset(make_coord(0, w.start, 0), mA), typename W::TileShape{}, make_coord(_, _, _),
                             Step<_1, Underscore, _1>{});
      Tensor gB = local_tile(domain_offset(make_coord(0, w.start, 0), mB), typename W::TileShape{}, make_coord(_, _, _),
                             Step<Underscore, _1, _1>{});
      auto k_iter = cute::make_coord_iterator(shape<3>(gA));
      mainloop.load(params.mainloop, pipeline, write, cute::make_tuple(gA, gB), make_coord(w.m_tile, w.n_tile, _, 0),
                    k_iter, w.k_steps, threadIdx.x % 32, 0u, shared.mainloop);
      write.advance(w.k_steps);
    }
    mainloop.load_tail(pipeline, write);
  } else {
    cutlass::arch::warpgroup_reg_alloc<232>();
    const int mma_thread = threadIdx.x - W::kProducerThreads;
    typename W::PipelineState read;
    typename W::TiledMma tiled_mma;
    Tensor out = params.tma_store.get_tma_tensor(make_shape(params.n, params.k, params.groups));
    int buffer = 0;
    // The next unit's group bounds are loaded (two dependent global loads) while this one's
    // MMAs run, not at the top of its tile.
    WgradUnit next = blockIdx.x < units ? wgrad_unit<W>(params, blockIdx.x) : WgradUnit{};
    for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
      const WgradUnit w = next;
      if (u + gridDim.x < units) next = wgrad_unit<W>(params, u + gridDim.x);
      if (w.k_steps == 0 && params.accumulate) continue;  // adds nothing
      Tensor acc = partition_fragment_C(tiled_mma, take<0, 2>(typename W::TileShape{}));
      if (w.k_steps == 0) {
        clear(acc);  // an expert without tokens: a zero gradient
      } else {
        const int valid_last = static_cast<int>(w.rows - int64_t(w.k_steps - 1) * W::kStepTokens);
        mma_group_tokens<W>(pipeline, read, acc, w.k_steps, valid_last, mma_thread, shared.mainloop);
        read.advance(w.k_steps);
      }
      store_tile_tma<W>(acc, shared, params, out, w, mma_thread, buffer);
    }
    if (mma_thread == 0) tma_store_wait<0>();  // shared memory stays until TMA has read it
  }
#endif
}

}  // namespace distgemm::grouped::sm90

namespace distgemm::grouped {

template <dg_dtype In, dg_dtype Out, int TM, int TN>
dg_status Sm90GroupedContiguousWgradKernel<In, Out, TM, TN>::run(const GroupedProblem& p, cudaStream_t stream) {
  using W = sm90::ContiguousWgrad<In, Out, TM, TN>;
  const size_t out_bytes = static_cast<size_t>(p.groups) * p.n * p.k * sizeof(typename W::ElementD);
  if (p.tokens == 0) {  // no descriptor over zero tokens: every expert's gradient is zero
    if (!p.accumulate) DG_CUDA_RETURN(cudaMemsetAsync(p.d, 0, out_bytes, stream));
    return DG_SUCCESS;
  }
  const typename W::Params params = W::params(p);
  const int ctas = static_cast<int>(std::min<int64_t>(params.units(), std::max(p.sm_count, 1)));
  return sm90::launch_persistent(&sm90::contiguous_grouped_wgrad<W>, ctas, W::kThreads, W::kSmemBytes, 1, stream,
                                 params);
}

template <dg_dtype In, dg_dtype Out, int TM, int TN>
size_t Sm90GroupedContiguousWgradKernel<In, Out, TM, TN>::workspace(const GroupedProblem&) {
  return 0;
}

}  // namespace distgemm::grouped

#define DG_INSTANTIATE_SM90_GROUPED_CONTIGUOUS_WGRAD(IN, OUT, TM, TN) \
  template struct distgemm::grouped::Sm90GroupedContiguousWgradKernel<IN, OUT, TM, TN>;

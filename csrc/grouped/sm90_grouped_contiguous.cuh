// SM90 grouped GEMM over the contiguous token tensor (forward and dgrad, bf16/fp16): one TMA
// descriptor for x (T, K) and one for w (G, ., .) with the group as its batch coordinate, so
// no per-group descriptor is built or fenced (the ptr-array kernels' cost on small problems),
// and no argument-builder kernel runs first. Every warp walks the device-side offsets itself.
// Clusters of ClusterM CTAs along M share (multicast) the group's weight tile: they take
// adjacent tile rows of one group and N tile, the last pair's spare CTA storing nothing.
//
// A tile's A rows start at its group's first row (any row: TMA takes element coordinates);
// rows past the group's end load the next group's tokens and are never stored: the epilogue
// stages the FP32 tile in shared memory and writes only the group's rows. Persistent CTAs, one
// producer warp; 128-row tiles are two consumer warpgroups of 64 rows each (CUTLASS's
// cooperative mainloop collective), 64-row tiles one (twice the tiles where a problem has too
// few of 128 rows to fill the GPU).
#pragma once

#include <algorithm>
#include <cstdint>

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

template <dg_dtype In, dg_dtype Out, int Kind, int TileM, int TileN, int ClusterM>
struct ContiguousGrouped
    : ContiguousKernelShape<
          In, Out,
          cutlass::layout::RowMajor,  // x or dy: (T, K) K-major
          // forward: w (G, N, K) K-major; dgrad: w (G, K, N), N-major.
          std::conditional_t<Kind == DG_GROUPED_FORWARD, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>,
          TileM, TileN, ClusterM> {
  static_assert(Kind == DG_GROUPED_FORWARD || Kind == DG_GROUPED_DGRAD,
                "the contiguous kernel computes forward and dgrad (rows are tokens)");
  using Base = typename ContiguousGrouped::ContiguousKernelShape;
  using typename Base::CollectiveMainloop;
  using typename Base::Element;
  using typename Base::ElementD;
  using typename Base::StrideA;
  using typename Base::StrideB;

  struct Params {
    typename CollectiveMainloop::Params mainloop;
    ElementD* d;
    const int32_t* offs;
    int groups;
    int tokens;
    int n, k;
    int n_tiles;
    bool accumulate;
  };

  static Params params(const GroupedProblem& p) {
    StrideA sa{};
    get<0>(sa) = p.k;
    StrideB sb{};
    if constexpr (Kind == DG_GROUPED_FORWARD)
      get<0>(sb) = p.k;
    else
      get<1>(sb) = p.n;
    get<2>(sb) = p.n * p.k;
    const int t = static_cast<int>(p.tokens), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
    typename CollectiveMainloop::Arguments args{static_cast<Element const*>(p.a), sa, static_cast<Element const*>(p.b),
                                                sb};
    // x's descriptor spans all T tokens (one batch); w's spans the G groups (the batch
    // coordinate). The collective builds both from one problem shape, so it is asked twice
    // (in the second, A is a valid one-row stand-in that is never used).
    Params out{};
    out.mainloop = CollectiveMainloop::to_underlying_arguments(make_shape(t, n, k, 1), args, nullptr);
    StrideA one_row = sa;
    get<2>(one_row) = p.k;
    args.dA = one_row;
    out.mainloop.tma_load_b =
        CollectiveMainloop::to_underlying_arguments(make_shape(1, n, k, p.groups), args, nullptr).tma_load_b;
    out.d = static_cast<ElementD*>(p.d);
    out.offs = p.offs;
    out.groups = p.groups;
    out.tokens = t;
    out.n = n;
    out.k = k;
    out.n_tiles = (n + TileN - 1) / TileN;
    out.accumulate = p.accumulate;
    return out;
  }
};

// Which group, and which of its work units, unit t is. A unit is a cluster's work: ClusterM
// tile rows (M-adjacent) of one N tile. Units are numbered group by group, within a group
// M-fastest. Called with the whole warp and a t that never decreases, so the walk over the
// offsets is shared by a CTA's units and done 32 groups per step.
template <int TileM, int ClusterM>
struct GroupTileWalker {
  const int32_t* offs;
  int groups, tokens, n_tiles;
  int g = -1;
  int64_t base = 0, count = 0;  // group g holds units [base, base + count)
  int start = 0, rows = 0, m_units = 0;

  __device__ bool locate(int64_t t) {
    if (g >= 0 && t < base + count) return true;
    const int lane = threadIdx.x % 32;
    base += count;
    g += 1;
    while (g < groups) {
      const int gi = g + lane;
      int s = 0, n_rows = 0;  // the group's rows, as the ptr-array kernels read them
      if (gi < groups) {
        const GroupRows r = group_rows(offs, tokens, gi);
        s = static_cast<int>(r.start);
        n_rows = static_cast<int>(r.rows);
      }
      const int mt = ((n_rows + TileM - 1) / TileM + ClusterM - 1) / ClusterM;
      const int64_t c = int64_t(mt) * n_tiles;
      int64_t incl = c;
      for (int o = 1; o < 32; o *= 2) {
        const int64_t v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
      }
      const int64_t total = __shfl_sync(0xffffffffu, incl, 31);
      if (t < base + total) {
        const unsigned hit = __ballot_sync(0xffffffffu, t < base + incl);
        const int first = __ffs(hit) - 1;
        base += __shfl_sync(0xffffffffu, incl - c, first);
        count = __shfl_sync(0xffffffffu, c, first);
        start = __shfl_sync(0xffffffffu, s, first);
        rows = __shfl_sync(0xffffffffu, n_rows, first);
        m_units = __shfl_sync(0xffffffffu, mt, first);
        g += first;
        return true;
      }
      base += total;
      g += 32;
    }
    count = 0;
    return false;
  }
  // This CTA's tile row in unit t: the `rank`-th of the unit's ClusterM (past the group's rows
  // for the spare CTA of a group's last unit).
  __device__ int m_tile(int64_t t, int rank) const { return static_cast<int>((t - base) % m_units) * ClusterM + rank; }
  __device__ int n_tile(int64_t t) const { return static_cast<int>((t - base) / m_units); }
};

template <class K>
__global__ void __launch_bounds__(K::kThreads, 1)
    contiguous_grouped_gemm(const __grid_constant__ typename K::Params params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Mainloop = typename K::CollectiveMainloop;
  using Pipeline = typename K::Pipeline;
  extern __shared__ __align__(1024) char smem[];
  ContiguousCta<K> cta(smem, params);
  auto& shared = cta.shared;
  auto& pipeline = cta.pipeline;

  constexpr int kTileM = size<0>(typename K::TileShape{});
  constexpr int kTileN = size<1>(typename K::TileShape{});
  GroupTileWalker<kTileM, K::kClusterM> walker{params.offs, params.groups, params.tokens, params.n_tiles};
  Mainloop mainloop;
  Tensor mA = params.mainloop.tma_load_a.get_tma_tensor(make_shape(params.tokens, params.k, 1));
  Tensor mB = params.mainloop.tma_load_b.get_tma_tensor(make_shape(params.n, params.k, params.groups));
  const int k_tiles = (params.k + size<2>(typename K::TileShape{}) - 1) / size<2>(typename K::TileShape{});
  // The cluster's units: all its CTAs walk the same sequence, so their pipelines stay in step.
  const int rank = static_cast<int>(cute::block_rank_in_cluster());
  const int64_t first_unit = blockIdx.x / K::kClusterM, unit_stride = gridDim.x / K::kClusterM;

  if (cta.warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (cta.warp != 0) return;
    auto write = cutlass::make_producer_start_state<Pipeline>();
    for (int64_t t = first_unit; walker.locate(t); t += unit_stride) {
      const int row0 = walker.start + walker.m_tile(t, rank) * kTileM;
      Tensor gA = local_tile(domain_offset(make_coord(row0, 0, 0), mA), typename K::TileShape{}, make_coord(_, _, _),
                             Step<_1, Underscore, _1>{});
      Tensor gB = local_tile(domain_offset(make_coord(0, 0, walker.g), mB), typename K::TileShape{},
                             make_coord(_, _, _), Step<Underscore, _1, _1>{});
      auto k_iter = cute::make_coord_iterator(shape<3>(gA));
      mainloop.load(params.mainloop, pipeline, write, cute::make_tuple(gA, gB), make_coord(0, walker.n_tile(t), _, 0),
                    k_iter, k_tiles, threadIdx.x % 32, static_cast<uint32_t>(rank), shared.mainloop);
      write.advance(k_tiles);
    }
    mainloop.load_tail(pipeline, write);
  } else {
    cutlass::arch::warpgroup_reg_alloc<232>();
    const int mma_thread = threadIdx.x - K::kProducerThreads;
    typename K::PipelineState read;
    typename K::TiledMma tiled_mma;
    for (int64_t t = first_unit; walker.locate(t); t += unit_stride) {
      Tensor acc = partition_fragment_C(tiled_mma, take<0, 2>(typename K::TileShape{}));
      mainloop.mma(pipeline, read, acc, k_tiles, mma_thread, shared.mainloop, params.mainloop);
      mainloop.mma_tail(pipeline, read, k_tiles);
      read.advance(k_tiles);
      const int m_tile = walker.m_tile(t, rank);
      const int row0 = walker.start + m_tile * kTileM, col0 = walker.n_tile(t) * kTileN;
      store_tile<K>(acc, shared.staging, mma_thread, params.d + int64_t(row0) * params.n + col0, params.n,
                    min(kTileM, walker.rows - m_tile * kTileM), params.n - col0, params.accumulate);
    }
  }
#endif
}

}  // namespace distgemm::grouped::sm90

namespace distgemm::grouped {

template <dg_dtype In, dg_dtype Out, int Kind, int TM, int TN, int CM>
dg_status Sm90GroupedContiguousKernel<In, Out, Kind, TM, TN, CM>::run(const GroupedProblem& p, cudaStream_t stream) {
  using K = sm90::ContiguousGrouped<In, Out, Kind, TM, TN, CM>;
  if (p.tokens == 0) return DG_SUCCESS;
  const typename K::Params params = K::params(p);
  // Units (a cluster's tiles): at most one per group more than the tokens alone need.
  const int64_t units = ((p.tokens + TM * CM - 1) / (TM * CM) + std::min<int64_t>(p.groups, p.tokens)) * params.n_tiles;
  const int clusters = static_cast<int>(std::min<int64_t>(units, std::max(p.sm_count / CM, 1)));
  return sm90::launch_persistent(&sm90::contiguous_grouped_gemm<K>, clusters * CM, K::kThreads, K::kSmemBytes, CM,
                                 stream, params);
}

template <dg_dtype In, dg_dtype Out, int Kind, int TM, int TN, int CM>
size_t Sm90GroupedContiguousKernel<In, Out, Kind, TM, TN, CM>::workspace(const GroupedProblem&) {
  return 0;
}

}  // namespace distgemm::grouped

#define DG_INSTANTIATE_SM90_GROUPED_CONTIGUOUS(IN, OUT, KIND, TM, TN, CM) \
  template struct distgemm::grouped::Sm90GroupedContiguousKernel<IN, OUT, distgemm::grouped::KIND, TM, TN, CM>;

// SM90 FP8 blockwise-scaled grouped mainloop that skips the WGMMAs of rows past a group's end.
//
// A group of T tokens fills ceil(T / TileM) tiles; the last one holds T mod TileM rows and
// CUTLASS's mainloop multiplies all TileM of them (TMA fills the rest with zeros). With skewed
// MoE routing most experts end in such a tile: over 64 experts of 512 tokens on average,
// Zipf-routed, 256-row tiles cover 1.24x the tokens and the forward ran 1.18-1.20x slower
// than on balanced routing (bench/NOTES.md, session 19).
//
// Each consumer warpgroup issues its part of the tile as NumSplitsM slices of 64 rows (two
// warpgroups, a 128-row slice of the tile per split). This mainloop issues, promotes and
// keeps only the slices holding a row of the group: a tile of 1-64 rows costs a quarter of
// a 256-row tile's WGMMAs, one of 65-128 rows half. How many rows the tile holds travels with
// the K tile's operands: the scale-loading producer warp learns the group's rows when its
// tensors are updated for the group and copies the count into shared memory per pipeline
// stage (a cp.async from a table of counts, so that the stage's full barrier covers it like
// the scales it loads). Loads, scale layouts and the kernel are CUTLASS's; this type derives
// from its collective and replaces `load_auxiliary` and `mma`.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/collective_builder.hpp>

namespace distgemm::grouped::sm90 {

// row_counts[i] == i: the global source of the per-stage row count's cp.async.
struct RowCountTable {
  uint32_t row_counts[257];
};
constexpr RowCountTable make_row_count_table() {
  RowCountTable t{};
  for (uint32_t i = 0; i < 257; ++i) t.row_counts[i] = i;
  return t;
}
__device__ const RowCountTable kRowCountTable = make_row_count_table();

template <class Base>
struct RowTrimmedMma : Base {
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::SmemLayoutSFA;
  using typename Base::SmemLayoutSFB;
  using typename Base::TileShape;
  using typename Base::TiledMma;
  using ScaleT = typename Base::ElementBlockScale;
  using NumSplitsM = typename Base::NumSplitsM;
  static constexpr int kStages = Base::DispatchPolicy::Stages;
  static constexpr int kTileM = cute::size<0>(TileShape{});
  static_assert(kTileM <= 256, "the row-count table covers tiles of up to 256 rows");
  static_assert(Base::ScalePromotionInterval == 4, "one promotion per 128-deep K tile");
  static_assert(Base::ScaleNsPerTile == 1, "B's scales: one per tile (block forward or row-wise)");

  struct TensorStorage : Base::TensorStorage {
    alignas(16) uint32_t tile_rows[kStages];  // rows of the group in the stage's tile
  };

  int group_rows_ = 0;  // the producer's current group (set per group by tensors_perform_update)

  template <class InputTensors, class ProblemShape_MNKL>
  CUTLASS_DEVICE auto tensors_perform_update(InputTensors const& input_tensors, Params const& params,
                                             ProblemShape_MNKL problem_shape_mnkl, int32_t next_batch) {
    group_rows_ = cute::get<0>(problem_shape_mnkl);
    return Base::tensors_perform_update(input_tensors, params, problem_shape_mnkl, next_batch);
  }

  // The scale loads of CUTLASS's load_auxiliary (one cp.async per scale, bounds-predicated
  // along M / N), plus each K tile's row count. Its set-up and predicates are computed once per
  // tile rather than per K tile: this warp shares issue slots with the consumers.
  template <class TensorA, class TensorB, class TensorSFA, class TensorSFB, class KTileIterator,
            class BlockCoord>
  CUTLASS_DEVICE void load_auxiliary(Params const& /*params*/, MainloopPipeline pipeline,
                                     PipelineState smem_pipe_write,
                                     cute::tuple<TensorA, TensorB, TensorSFA, TensorSFB> const& load_inputs,
                                     BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                                     int thread_idx, uint32_t /*block_rank_in_cluster*/,
                                     TensorStorage& shared_tensors) {
    using namespace cute;
    if (k_tile_count <= 0) return;
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor sSFA = make_tensor(make_smem_ptr(shared_tensors.smem_SFA.data()), SmemLayoutSFA{});  // (BLK_M, BLK_K, PIPE)
    Tensor sSFB = make_tensor(make_smem_ptr(shared_tensors.smem_SFB.data()), SmemLayoutSFB{});
    Tensor mSFA = get<2>(load_inputs);  // (m, k, l)
    Tensor mSFB = get<3>(load_inputs);
    // This tile's scales per K tile, and their coordinates: (BLK, BLK_K, k)
    Tensor gSFA = local_tile(mSFA, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{})(_, _, m_coord, _, l_coord);
    Tensor cSFA = local_tile(make_identity_tensor(shape(mSFA)), TileShape{}, make_coord(_, _, _),
                             Step<_1, X, _1>{})(_, _, m_coord, _, l_coord);
    Tensor gSFB = local_tile(mSFB, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{})(_, _, n_coord, _, l_coord);
    Tensor cSFB = local_tile(make_identity_tensor(shape(mSFB)), TileShape{}, make_coord(_, _, _),
                             Step<X, _1, _1>{})(_, _, n_coord, _, l_coord);
    auto copy_a = make_tiled_copy(typename Base::CopyAtomSFA{}, Layout<Shape<_32>>{}, Layout<Shape<_1>>{});
    auto copy_b = make_tiled_copy(typename Base::CopyAtomSFB{}, Layout<Shape<_32>>{}, Layout<Shape<_1>>{});
    auto thr_a = copy_a.get_slice(thread_idx);
    auto thr_b = copy_b.get_slice(thread_idx);
    Tensor tSFAgSFA = thr_a.partition_S(gSFA);
    Tensor tSFAsSFA = thr_a.partition_D(sSFA);
    Tensor tSFBgSFB = thr_b.partition_S(gSFB);
    Tensor tSFBsSFB = thr_b.partition_D(sSFB);
    // In bounds along M / N (K tiles are whole scale blocks): the same for every K tile.
    Tensor pSFA = make_tensor<bool>(shape(filter_zeros(tSFAsSFA(_, _, _, _0{}))));
    Tensor pSFB = make_tensor<bool>(shape(filter_zeros(tSFBsSFB(_, _, _, _0{}))));
    Tensor tSFAcSFA = filter_zeros(thr_a.partition_S(cSFA)(_, _, _, *k_tile_iter));
    Tensor tSFBcSFB = filter_zeros(thr_b.partition_S(cSFB)(_, _, _, *k_tile_iter));
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(pSFA); ++i)
      pSFA(i) = thread_idx < Base::ScaleMsPerTile && elem_less(tSFAcSFA(i), shape(mSFA));
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(pSFB); ++i)
      pSFB(i) = thread_idx < Base::ScaleNsPerTile && elem_less(tSFBcSFB(i), shape(mSFB));

    const int rows_left = group_rows_ - static_cast<int>(m_coord) * kTileM;
    const uint32_t& rows = kRowCountTable.row_counts[rows_left < 0 ? 0 : rows_left > kTileM ? kTileM : rows_left];
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      if (thread_idx == 0) SM80_CP_ASYNC_CACHEALWAYS<uint32_t>::copy(rows, shared_tensors.tile_rows[stage]);
      copy_if(copy_a, pSFA, filter_zeros(tSFAgSFA(_, _, _, *k_tile_iter)), filter_zeros(tSFAsSFA(_, _, _, stage)));
      copy_if(copy_b, pSFB, filter_zeros(tSFBgSFB(_, _, _, *k_tile_iter)), filter_zeros(tSFBsSFB(_, _, _, stage)));
      pipeline.producer_commit(smem_pipe_write, cutlass::arch::cpasync_barrier_arrive_noinc);
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors,
                          Params const& /*mainloop_params*/) {
    using namespace cute;
    static_assert(is_rmem<FrgTensorC>::value, "the accumulator must be in registers");

    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    // The scales as (BLK_M, BLK_N, (BLK_K, PIPE)) views, broadcast along the other operand's
    // dimension, so that partition_C gives each thread the scales of its accumulator elements.
    Tensor sSFA = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFA.data()),
        make_layout(make_shape(shape<0>(SmemLayoutSFA{}), get<1>(TileShape{}),
                               make_shape(shape<1>(SmemLayoutSFA{}), shape<2>(SmemLayoutSFA{}))),
                    make_stride(stride<0>(SmemLayoutSFA{}), _0{},
                                make_stride(stride<1>(SmemLayoutSFA{}), stride<2>(SmemLayoutSFA{})))));
    Tensor sSFB = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFB.data()),
        make_layout(make_shape(get<0>(TileShape{}), shape<0>(SmemLayoutSFB{}),
                               make_shape(shape<1>(SmemLayoutSFB{}), shape<2>(SmemLayoutSFB{}))),
                    make_stride(_0{}, stride<0>(SmemLayoutSFB{}),
                                make_stride(stride<1>(SmemLayoutSFB{}), stride<2>(SmemLayoutSFB{})))));

    constexpr int kWgThreads = cutlass::NumThreadsPerWarpGroup;
    constexpr int kWarpGroups = size(TiledMma{}) / kWgThreads;
    Layout warp_group_layout = make_layout(Int<kWarpGroups>{}, Int<kWgThreads>{});
    const int warp_group = __shfl_sync(0xffffffff, thread_idx / kWgThreads, 0);
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(warp_group_layout(warp_group));
    Tensor tCsSFA = tiled_mma.get_slice(thread_idx).partition_C(sSFA);  // (MMA, M, N, (K, PIPE))
    Tensor tCsSFB = tiled_mma.get_slice(thread_idx).partition_C(sSFB);
    Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA, M, K, PIPE)
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));
    // Registers for the distinct scales only: the broadcast modes keep stride 0.
    Tensor tCrSFA = make_tensor_like<ScaleT>(tCsSFA(_, _, _, _0{}));
    Tensor tCrSFB = make_tensor_like<ScaleT>(tCsSFB(_, _, _, _0{}));

    // Per M split: the accumulator, A's fragments, A's scales (one per tile when row-wise),
    // and the first row this warpgroup holds in it (its first thread's first element), which
    // is the same for all of the warpgroup's threads.
    using ScaleSplits = std::conditional_t<Base::ScaleMsPerTile == 1, _1, NumSplitsM>;
    auto accum_split = tiled_divide(accum, make_tuple(_1{}, NumSplitsM{}));
    auto tCrA_split = tiled_divide(tCrA, make_tuple(_1{}, NumSplitsM{}));
    auto tCrSFA_split = tiled_divide(tCrSFA, make_tuple(_1{}, ScaleSplits{}));
    Tensor tCcC = tiled_mma.get_slice(warp_group * kWgThreads)
                      .partition_C(make_identity_tensor(take<0, 2>(TileShape{})));
    auto tCcC_split = tiled_divide(tCcC, make_tuple(_1{}, NumSplitsM{}));
    auto temp = make_fragment_like(accum_split(_0{}, _, _, _));

    clear(accum);
    if (k_tile_count <= 0) return;
    auto barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.consumer_wait(smem_pipe_read, barrier_token);
      const int stage = smem_pipe_read.index();
      const int tile_rows = static_cast<int>(shared_tensors.tile_rows[stage]);
      copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), tCrSFA);
      copy(tCsSFB(_, _, _, make_coord(_0{}, stage)), tCrSFB);
      // B's one scale folded into A's, under the first split's WGMMAs.
      auto fold_scales = [&] {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(filter_zeros(tCrSFA)); ++i) filter_zeros(tCrSFA)(i) *= tCrSFB(_0{});
      };
      CUTLASS_PRAGMA_UNROLL
      for (int split = 0; split < NumSplitsM{}; ++split) {
        const bool live = get<0>(tCcC_split(split, 0, 0, 0)) < tile_rows;
        const bool last = split == NumSplitsM{} - 1;
        // Issue and wait within one branch: ptxas then sees no WGMMA in flight on any path
        // to the promotion below (it injects waits where it cannot tell).
        if (live) {
          tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
          warpgroup_fence_operand(temp);
          warpgroup_arrive();
          CUTLASS_PRAGMA_UNROLL
          for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
            cute::gemm(tiled_mma, tCrA_split(split, _, _, k_block, stage), tCrB(_, _, k_block, stage), temp);
            tiled_mma.accumulate_ = GMMA::ScaleOut::One;
          }
          warpgroup_commit_batch();
          warpgroup_fence_operand(temp);
          if (split == 0) fold_scales();
          warpgroup_wait<0>();
        } else if (split == 0) {
          fold_scales();
        }
        if (last) {  // the stage's operands and scales are all read: hand it back
          pipeline.consumer_release(smem_pipe_read);
          ++smem_pipe_read;
          if (k_tile_count > 1) barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
        }
        if (live) {
          auto accum_local = accum_split(split, _, _, _);
          warpgroup_fence_operand(accum);
          if constexpr (Base::ScaleMsPerTile == 1) {
            const ScaleT scale = tCrSFA(_0{});
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < size(accum_local); ++i) accum_local(i) += temp(i) * scale;
          } else {
            auto scale = tCrSFA_split(split, _, _, _);
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < size(accum_local); ++i) accum_local(i) += temp(i) * scale(i);
          }
          warpgroup_fence_operand(accum);
        }
      }
    }
  }
};

}  // namespace distgemm::grouped::sm90

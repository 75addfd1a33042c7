// SM90 FP8 blockwise-scaled mainloop whose promotion overlaps the tensor cores.
//
// CUTLASS's ptr-array blockwise mainloop issues one K tile's WGMMAs into a temporary
// accumulator, waits for them, then promotes (accum += temp * scales) while this warpgroup's
// tensor work stops. In the cooperative kernel the other warpgroup's WGMMAs fill that gap; in
// the ping-pong kernel, where one warpgroup runs its mainloop while the other runs its
// epilogue, nothing does.
//
// This mainloop keeps two temporary accumulators: it issues K tile k's WGMMAs into one, then
// promotes K tile k-1's from the other while they run. It needs three tile-sized accumulators
// per thread: cooperative 128 x 128 (3 x 64 registers) or ping-pong 64 x 128 (3 x 64). The
// loads, the pipeline, the scale layouts and the kernel are CUTLASS's: this type derives from
// its collective and replaces only `mma`.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/collective_builder.hpp>

namespace distgemm::grouped::sm90 {

template <class Base>
struct OverlappedPromotionMma : Base {
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::SmemLayoutSFA;
  using typename Base::SmemLayoutSFB;
  using typename Base::TensorStorage;
  using typename Base::TiledMma;
  using typename Base::TileShape;
  using ScaleT = typename Base::ElementBlockScale;

  static_assert(typename Base::NumSplitsM{} == 1,
                "overlapped promotion holds three tile accumulators: one 128-row slice per tile");
  static_assert(Base::ScalePromotionInterval == 4, "one promotion per 128-deep K tile");

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum, int k_tile_count,
                          int thread_idx, TensorStorage& shared_tensors, Params const& /*mainloop_params*/) {
    using namespace cute;
    static_assert(is_rmem<FrgTensorC>::value, "the accumulator must be in registers");

    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    // The scales as (BLK_M, BLK_N, (BLK_K, PIPE)) views, broadcast along the other operand's
    // dimension, so that partition_C gives each thread the scales of its accumulator elements.
    Tensor sSFA =
        make_tensor(make_smem_ptr(shared_tensors.smem_SFA.data()),
                    make_layout(make_shape(shape<0>(SmemLayoutSFA{}), get<1>(TileShape{}),
                                           make_shape(shape<1>(SmemLayoutSFA{}), shape<2>(SmemLayoutSFA{}))),
                                make_stride(stride<0>(SmemLayoutSFA{}), _0{},
                                            make_stride(stride<1>(SmemLayoutSFA{}), stride<2>(SmemLayoutSFA{})))));
    Tensor sSFB =
        make_tensor(make_smem_ptr(shared_tensors.smem_SFB.data()),
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

    Tensor temp0 = make_fragment_like(accum);
    Tensor temp1 = make_fragment_like(accum);
    clear(accum);

    // K tile `stage`'s WGMMAs into `temp`, overwriting it, without waiting for them.
    auto issue = [&](auto& temp, int stage) {
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(temp);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
        cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), temp);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(temp);
    };
    // accum += temp * (single * per_element), one operand's scale a single value per tile.
    auto promote_with = [&](auto& temp, ScaleT single, auto& per_element) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(filter_zeros(per_element)); ++i) filter_zeros(per_element)(i) *= single;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) accum(i) += temp(i) * per_element(i);
    };
    // accum += temp * (scale_a * scale_b) of K tile `stage`, whose WGMMAs have completed.
    auto promote = [&](auto& temp, int stage) {
      copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), tCrSFA);
      copy(tCsSFB(_, _, _, make_coord(_0{}, stage)), tCrSFB);
      warpgroup_fence_operand(temp);
      warpgroup_fence_operand(accum);
      if constexpr (Base::ScaleMsPerTile == 1 && Base::ScaleNsPerTile == 1) {
        const ScaleT scale = tCrSFA(_0{}) * tCrSFB(_0{});
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) += temp(i) * scale;
      } else if constexpr (Base::ScaleNsPerTile == 1) {
        promote_with(temp, tCrSFB(_0{}), tCrSFA);
      } else if constexpr (Base::ScaleMsPerTile == 1) {
        promote_with(temp, tCrSFA(_0{}), tCrSFB);
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) += temp(i) * tCrSFA(i) * tCrSFB(i);
      }
      warpgroup_fence_operand(accum);
      warpgroup_fence_operand(temp);
    };

    if (k_tile_count <= 0) return;
    // `pending` is the K tile whose WGMMAs are in flight; its stage is released once promoted.
    PipelineState pending = smem_pipe_read;
    pipeline.consumer_wait(pending, pipeline.consumer_try_wait(pending));
    issue(temp0, pending.index());
    ++smem_pipe_read;
    --k_tile_count;
    // Two K tiles per iteration, so that each temporary accumulator keeps its registers.
    auto step = [&](auto& next_temp, auto& done_temp) {
      pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
      issue(next_temp, smem_pipe_read.index());
      warpgroup_wait<1>();  // the pending tile's WGMMAs are done; the new ones run on
      promote(done_temp, pending.index());
      pipeline.consumer_release(pending);
      pending = smem_pipe_read;
      ++smem_pipe_read;
      --k_tile_count;
    };
    CUTLASS_PRAGMA_NO_UNROLL
    while (k_tile_count > 0) {
      step(temp1, temp0);
      if (k_tile_count == 0) {
        warpgroup_wait<0>();
        promote(temp1, pending.index());
        pipeline.consumer_release(pending);
        return;
      }
      step(temp0, temp1);
    }
    warpgroup_wait<0>();
    promote(temp0, pending.index());
    pipeline.consumer_release(pending);
  }
};

}  // namespace distgemm::grouped::sm90

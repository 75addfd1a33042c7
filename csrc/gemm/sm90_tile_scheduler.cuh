// The persistent SM90 tile scheduler of every distgemm dense kernel: CUTLASS's static
// persistent scheduler, plus what the tensor-parallel GEMMs need (all off when SyncParams is
// empty, as for a plain GEMM):
//   - tile order by chunk: rows are walked from `first_chunk` on, wrapping around, so a rank
//     computes its own shard first and the peers' shards in the order they arrive;
//   - before the mainloop producer loads the A rows of a tile, a bounded wait until every
//     chunk those rows touch is in place (all-gather + GEMM);
//   - before the epilogue loads C, a bounded wait until the peer's partial sums are complete
//     (GEMM + reduce-scatter).
#pragma once

#include <cutlass/gemm/kernel/sm90_tile_scheduler.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

#include "common/sync.cuh"

namespace distgemm::gemm {

struct SyncTileSchedulerTag {};

class Sm90SyncTileScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  using WorkTileInfo = typename Base::WorkTileInfo;

  struct Arguments : Base::Arguments {
    SyncParams sync{};
  };

  struct Params : Base::Params {
    SyncParams sync{};
    int32_t tile_m = 0;
    int32_t tiles_m = 0;   // M tiles, rounded up to whole clusters
    int32_t rotate_m = 0;  // first tile row, a multiple of the cluster's M extent
    int32_t problem_m = 0;
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape_mnkl, TileShape tile_shape,
                                        ClusterShape cluster_shape, cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& args, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Params params;
    static_cast<Base::Params&>(params) =
        Base::to_underlying_arguments(problem_shape_mnkl, tile_shape, cluster_shape, hw_info, args, workspace,
                                      epilogue_subtile, ktile_start_alignment_count);
    params.sync = args.sync;
    constexpr int kTileM = cute::size<0>(TileShape{});
    constexpr int kClusterM = cute::size<0>(ClusterShape{});
    const int m = static_cast<int>(cute::get<0>(problem_shape_mnkl));
    params.problem_m = m;
    params.tile_m = kTileM;
    params.tiles_m = ((m + kTileM - 1) / kTileM + kClusterM - 1) / kClusterM * kClusterM;
    if (args.sync.num_chunks > 0 && params.tiles_m > 0) {
      const int first_row = args.sync.first_chunk * args.sync.chunk_rows;
      params.rotate_m = (first_row / kTileM) / kClusterM * kClusterM % params.tiles_m;
    }
    return params;
  }

  // `params` lives in the kernel's __grid_constant__ parameters, so keeping its address is free.
  CUTLASS_DEVICE explicit Sm90SyncTileScheduler(Params const& params) : Base(params), params_(&params) {}

  CUTLASS_DEVICE WorkTileInfo get_current_work() {
    WorkTileInfo work = Base::get_current_work();
    if (params_->rotate_m != 0 && work.is_valid()) {
      work.M_idx = (work.M_idx + params_->rotate_m) % params_->tiles_m;
    }
    if (params_->sync.num_chunks > 0 && work.is_valid() && threadIdx.x < 32) {
      wait_for_rows(work.M_idx);  // the mainloop producer warp
    }
    return work;
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return get_current_work();
  }

  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work_tile_info) {
    if (Base::continue_current_work(work_tile_info)) return cute::make_tuple(work_tile_info, true);
    advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }

  template <class TileSchedulerPipeline, class TileSchedulerPipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work_tile_info, TileSchedulerPipeline&, TileSchedulerPipelineState) {
    return fetch_next_work(work_tile_info);
  }

  // Called by the epilogue producer before it loads C, and by the consumers before they
  // store: the C operand must be complete.
  CUTLASS_HOST_DEVICE static bool compute_epilogue(WorkTileInfo const&, Params const& params) {
#if defined(__CUDA_ARCH__)
    if (params.sync.c_ready) {
      wait_flag(params.sync.c_ready, *params.sync.epoch, params.sync, params.sync.c_peer);
    }
#endif
    return true;
  }

  CUTLASS_HOST_DEVICE static bool compute_epilogue(WorkTileInfo const&) { return true; }

 private:
  // One lane waits for each chunk the tile's rows touch; after a timeout this CTA stops waiting.
  CUTLASS_DEVICE void wait_for_rows(int32_t m_idx) {
    if (timed_out_) return;
    const SyncParams& s = params_->sync;
    const int32_t row0 = m_idx * params_->tile_m;
    if (row0 >= params_->problem_m) return;
    const int32_t row1 = min(row0 + params_->tile_m, params_->problem_m) - 1;
    for (int32_t c = row0 / s.chunk_rows; c <= row1 / s.chunk_rows && c < s.num_chunks; ++c) {
      bool ok = true;
      if (threadIdx.x % 32 == 0) ok = wait_flag(s.chunk_ready + c, *s.epoch, s, c);
      ok = __shfl_sync(0xffffffffu, ok, 0);
      fence_generic_to_async_global();
      if (!ok) {
        timed_out_ = true;
        return;
      }
    }
  }

  Params const* params_;
  bool timed_out_ = false;
};

}  // namespace distgemm::gemm

namespace cutlass::gemm::kernel::detail {

template <class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<distgemm::gemm::SyncTileSchedulerTag, arch::Sm90, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = distgemm::gemm::Sm90SyncTileScheduler;
};

}  // namespace cutlass::gemm::kernel::detail

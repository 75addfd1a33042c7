// What the sm90 contiguous-token grouped kernels (sm90_grouped_contiguous.cuh: forward and
// dgrad; sm90_grouped_contiguous_wgrad.cuh) share: their shape (mainloop collective, threads,
// shared memory), the mainloop pipeline's set-up, the launch, and the forward's and dgrad's
// masked epilogue (the wgrad stores with TMA instead).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/grid_dependency_control.h>
#include <cutlass/array.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/pipeline/pipeline.hpp>

#include "common/cutlass_types.cuh"
#include "common/status.h"

namespace distgemm::grouped::sm90 {

using namespace cute;

// A contiguous kernel's shape: CUTLASS's sm90 TMA mainloop collective for In operands in
// (LayoutA, LayoutB), tiles of TileM x TileN x 128 bytes of K; a producer warpgroup and a
// consumer warpgroup per 64 rows; shared memory for the mainloop's stages, the epilogue's FP32
// staging (kEpiN columns at a time, rows padded by 8 floats so that the consumers' accumulator
// writes spread over the banks) and the pipeline's barriers.
template <dg_dtype In, dg_dtype Out, class LayoutA_, class LayoutB_, int TileM, int TileN, int ClusterM>
struct ContiguousKernelShape {
  static_assert(TileM == 64 || TileM == 128, "one or two consumer warpgroups of 64 rows each");
  using Element = cutlass_type_t<In>;
  using ElementD = cutlass_type_t<Out>;
  using LayoutA = LayoutA_;
  using LayoutB = LayoutB_;
  static constexpr int kAlign = 16 / sizeof(Element);
  static constexpr int kStepK = 128 / static_cast<int>(sizeof(Element));  // K per mainloop step
  using TileShape = Shape<Int<TileM>, Int<TileN>, Int<kStepK>>;
  using ClusterShape = Shape<Int<ClusterM>, _1, _1>;
  static constexpr int kClusterM = ClusterM;

  static constexpr int kEpiN = TileN < 64 ? TileN : 64;
  static constexpr int kStagingLd = kEpiN + 8;
  static constexpr int kStagingBytes = TileM * kStagingLd * 4;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element, LayoutB, kAlign, float,
      TileShape, ClusterShape, cutlass::gemm::collective::StageCountAutoCarveout<kStagingBytes>,
      // The schedule only sets the warpgroups of the TiledMma: ping-pong's is one warpgroup.
      std::conditional_t<TileM == 128, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                         cutlass::gemm::KernelTmaWarpSpecializedPingpong>>::CollectiveOp;
  using TiledMma = typename CollectiveMainloop::TiledMma;
  using Pipeline = typename CollectiveMainloop::MainloopPipeline;
  using PipelineState = typename CollectiveMainloop::PipelineState;
  using StrideA = typename CollectiveMainloop::StrideA;
  using StrideB = typename CollectiveMainloop::StrideB;

  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerThreads = TileM * 2;  // a warpgroup per 64 rows
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  static_assert(size(TiledMma{}) == kConsumerThreads);

  struct SharedStorage {
    typename CollectiveMainloop::TensorStorage mainloop;  // first: 1024-byte aligned swizzles
    alignas(128) float staging[TileM * kStagingLd];
    alignas(16) typename CollectiveMainloop::PipelineStorage pipeline;
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
};

// The mainloop pipeline of a contiguous kernel K in its shared memory: warp 0 produces (TMA),
// the consumer warpgroups consume. The TMA descriptors are prefetched, and it returns once every
// CTA of the cluster has its barriers initialised (before any multicast can reach them).
template <class K>
__device__ typename K::Pipeline make_mainloop_pipeline(typename K::SharedStorage& shared,
                                                       typename K::Params const& params, int warp, int warp_group) {
  using Pipeline = typename K::Pipeline;
  typename Pipeline::Params pipe{};
  pipe.role = warp_group == 0
                  ? (warp == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::NonParticipant)
                  : Pipeline::ThreadCategory::Consumer;
  pipe.is_leader = threadIdx.x % 128 == 0;
  pipe.num_consumers = K::kConsumerThreads;
  pipe.transaction_bytes = params.mainloop.tma_transaction_bytes;
  Pipeline pipeline(shared.pipeline, pipe, typename K::ClusterShape{});
  if (warp == 0 && cute::elect_one_sync()) K::CollectiveMainloop::prefetch_tma_descriptors(params.mainloop);
  if constexpr (K::kClusterM > 1)
    cute::cluster_sync();
  else
    __syncthreads();
  return pipeline;
}

// What a contiguous kernel's CTA starts with: its shared memory, warp and warpgroup, and the
// mainloop pipeline; constructed once the kernel is launched as a programmatic dependent has
// waited for the kernel before it (whose offsets and operands it may read), so nothing global
// is touched earlier.
template <class K>
struct ContiguousCta {
  typename K::SharedStorage& shared;
  const int warp;
  const int warp_group;
  typename K::Pipeline pipeline;

  __device__ ContiguousCta(char* smem, typename K::Params const& params)
      : shared(*reinterpret_cast<typename K::SharedStorage*>(smem)),
        warp(cutlass::canonical_warp_idx_sync()),
        warp_group(cutlass::canonical_warp_group_idx()),
        pipeline(make_mainloop_pipeline<K>(shared, params, warp, warp_group)) {
    cutlass::arch::wait_on_dependent_grids();
  }
};

// The consumers' epilogue: the FP32 tile through shared memory (K::kEpiN columns at a time),
// out to `tile` (leading dimension `ld`), only its first rows_valid rows and cols_valid columns
// (a group's rows; the output's edge). Accumulating adds the old values (one rounding, as the
// ptr-array kernels' beta = 1); each thread loads all of its old values of a pass before its
// first add, so that their latencies overlap. Staging rows are padded (K::kStagingLd) so that
// the accumulator writes spread over the banks.
template <class K, class Accumulators>
__device__ void store_tile(Accumulators const& acc, float* staging, int mma_thread, typename K::ElementD* tile,
                           int64_t ld, int rows_valid, int cols_valid, bool accumulate) {
  using ElementD = typename K::ElementD;
  constexpr int kTileM = size<0>(typename K::TileShape{});
  constexpr int kTileN = size<1>(typename K::TileShape{});
  constexpr int kVec = 4;  // columns per thread and store: 8 bytes of bf16, 16 of float
  constexpr int kChunksPerRow = K::kEpiN / kVec;
  static_assert(kTileM * kChunksPerRow % K::kConsumerThreads == 0, "whole chunks per thread");
  constexpr int kChunksPerThread = kTileM * kChunksPerRow / K::kConsumerThreads;
  using Packed = cutlass::Array<ElementD, kVec>;
  typename K::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(mma_thread);
  Tensor coords = thr_mma.partition_C(make_identity_tensor(make_shape(Int<kTileM>{}, Int<kTileN>{})));
  CUTE_UNROLL
  for (int pass = 0; pass < kTileN / K::kEpiN; ++pass) {
    cutlass::arch::NamedBarrier::sync(K::kConsumerThreads, 0);  // the last pass's reads are done
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) {
      const int r = get<0>(coords(i));
      const int c = get<1>(coords(i)) - pass * K::kEpiN;
      if (c >= 0 && c < K::kEpiN) staging[r * K::kStagingLd + c] = acc(i);
    }
    cutlass::arch::NamedBarrier::sync(K::kConsumerThreads, 0);
    Packed old[kChunksPerThread];
    CUTE_UNROLL
    for (int i = 0; i < kChunksPerThread; ++i) {
      const int chunk = mma_thread + i * K::kConsumerThreads;
      const int r = chunk / kChunksPerRow, c = pass * K::kEpiN + chunk % kChunksPerRow * kVec;
      if (accumulate && r < rows_valid && c < cols_valid)
        old[i] = *reinterpret_cast<const Packed*>(tile + int64_t(r) * ld + c);
    }
    CUTE_UNROLL
    for (int i = 0; i < kChunksPerThread; ++i) {
      const int chunk = mma_thread + i * K::kConsumerThreads;
      const int r = chunk / kChunksPerRow, c_staged = chunk % kChunksPerRow * kVec;
      const int c = pass * K::kEpiN + c_staged;
      if (r >= rows_valid || c >= cols_valid) continue;
      const float4 v = *reinterpret_cast<const float4*>(staging + r * K::kStagingLd + c_staged);
      float out[kVec] = {v.x, v.y, v.z, v.w};
      Packed packed;
      CUTE_UNROLL
      for (int j = 0; j < kVec; ++j)
        packed[j] = static_cast<ElementD>(accumulate ? out[j] + static_cast<float>(old[i][j]) : out[j]);
      *reinterpret_cast<Packed*>(tile + int64_t(r) * ld + c) = packed;
    }
  }
}

// Launches a persistent kernel of `ctas` CTAs in clusters of `cluster_m` along x, as a
// programmatic dependent of the kernel before it on the stream (its launch and set-up overlap
// that kernel; it waits for it before reading global memory).
template <class Params>
dg_status launch_persistent(void (*kernel)(Params), int ctas, int threads, int smem_bytes, int cluster_m,
                            cudaStream_t stream, const Params& params) {
  DG_CUDA_RETURN(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(ctas);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attributes[2]{};
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = 1;
  attributes[1].id = cudaLaunchAttributeClusterDimension;
  attributes[1].val.clusterDim.x = cluster_m;
  attributes[1].val.clusterDim.y = 1;
  attributes[1].val.clusterDim.z = 1;
  config.attrs = attributes;
  config.numAttrs = 2;
  DG_CUDA_RETURN(cudaLaunchKernelEx(&config, kernel, params));
  return DG_SUCCESS;
}

}  // namespace distgemm::grouped::sm90

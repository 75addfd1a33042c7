// The grouped kernels' direct-store epilogue: each consumer thread writes its accumulators to
// global memory itself, two adjacent FP32 columns per 8-byte store. CUTLASS's own
// (DefaultEpilogueArray, PtrArrayNoSmemWarpSpecialized) stores one element at a time, each behind
// its own bounds branch, and ran 0.31-0.43x bmm on store-bound FP32 wgrads where the TMA-store
// epilogue reaches 0.70-0.89x (bench/results/h200_grouped_profile_direct_store.json). Everything
// but the store loop (arguments, workspace, the adapter to the warp-specialized kernels) is
// CUTLASS's: this class only replaces DefaultEpilogueArray's operator().
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/default_epilogue_array.hpp>
#include <cutlass/epilogue/collective/detail.hpp>

namespace distgemm::grouped::sm90 {

template <class ElementC, class StrideC, class StrideD, class ThreadEpilogueOp, class Schedule>
class PairStoreEpilogueArray : public cutlass::epilogue::collective::DefaultEpilogueArray<ElementC, StrideC, StrideD,
                                                                                          ThreadEpilogueOp, Schedule> {
  using Base =
      cutlass::epilogue::collective::DefaultEpilogueArray<ElementC, StrideC, StrideD, ThreadEpilogueOp, Schedule>;

 public:
  using typename Base::Params;
  using ElementD = typename Base::ElementD;
  static_assert(std::is_same_v<ElementD, float> && std::is_same_v<typename Base::GmemElementC, float>,
                "pair stores are written for FP32 outputs (the wgrads)");

  CUTLASS_HOST_DEVICE PairStoreEpilogueArray(Params const& params) : Base(params), params_(params) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    const int m_extent = get<0>(problem_shape_mnkl);
    const int n_extent = get<1>(problem_shape_mnkl);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;
    ThreadEpilogueOp epilogue_op(params_.thread, l_coord);
    const bool add_source = epilogue_op.is_source_needed();  // beta != 0: accumulate into C

    // Group l's D (and C) as an (M, N) row-major tensor, this CTA's tile of it, this thread's
    // accumulator elements of that tile and their (m, n) coordinates.
    auto stride_d = cutlass::epilogue::collective::detail::get_epilogue_stride<Schedule>(params_.dD[l_coord]);
    Tensor m_d =
        make_tensor(make_gmem_ptr(params_.ptr_D[l_coord]), make_shape(m_extent, n_extent), take<0, 2>(stride_d));
    Tensor g_d = local_tile(m_d, take<0, 2>(blk_shape_mnk), make_coord(m_coord, n_coord));
    Tensor c_d = local_tile(make_identity_tensor(make_shape(m_extent, n_extent)), take<0, 2>(blk_shape_mnk),
                            make_coord(m_coord, n_coord));
    auto thread_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor t_d = thread_mma.partition_C(g_d);
    Tensor t_coord = thread_mma.partition_C(c_d);
    // A GMMA accumulator fragment's first mode holds two adjacent columns: element 2i + 1 is
    // the column after element 2i, in D's row-major memory too.
    static_assert(size<0, 0>(decltype(t_d.layout()){}) == 2, "accumulator pairs expected");
    static_assert(decltype(stride<0, 0>(t_d.layout()))::value == 1, "row-major D expected");
    CUTE_STATIC_ASSERT_V(size(t_d) == size(accumulators));

    // C is D (accumulate=True reads the output it adds into): the same offset from its base.
    float* const d_base = params_.ptr_D[l_coord];
    const float* const c_base = add_source ? params_.ptr_C[l_coord] : nullptr;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accumulators); i += 2) {
      const int m = get<0>(t_coord(i));
      const int n = get<1>(t_coord(i));
      if (m >= m_extent || n >= n_extent) continue;
      float* out = &t_d(i);
      const int64_t at = out - d_base;
      if (n + 1 < n_extent) {  // both columns in: one 8-byte store (rows 16-byte aligned, n even)
        float2 value;
        if (add_source) {
          const float2 old = __ldcg(reinterpret_cast<const float2*>(c_base + at));
          value = make_float2(epilogue_op(accumulators(i), old.x), epilogue_op(accumulators(i + 1), old.y));
        } else {
          value = make_float2(epilogue_op(accumulators(i)), epilogue_op(accumulators(i + 1)));
        }
        __stwb(reinterpret_cast<float2*>(out), value);  // st.global, not a generic store
      } else {                                          // the last column of an odd N
        __stwb(out, add_source ? epilogue_op(accumulators(i), __ldcg(c_base + at)) : epilogue_op(accumulators(i)));
      }
    }
  }

 private:
  Params params_;
};

// The builder's direct-store epilogue (the adapter around DefaultEpilogueArray) with pair stores.
template <class BuiltEpilogue>
struct WithPairStores {
  using type = BuiltEpilogue;
};
template <class ElementC, class StrideC, class StrideD, class ThreadEpilogueOp, class Schedule>
struct WithPairStores<cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
    cutlass::epilogue::collective::DefaultEpilogueArray<ElementC, StrideC, StrideD, ThreadEpilogueOp, Schedule>>> {
  using type = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
      PairStoreEpilogueArray<ElementC, StrideC, StrideD, ThreadEpilogueOp, Schedule>>;
};

}  // namespace distgemm::grouped::sm90

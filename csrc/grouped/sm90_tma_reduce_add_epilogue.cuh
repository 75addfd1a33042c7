// A CUTLASS ptr-array epilogue whose TMA stores add into D (FP32 reduce-add, done in L2)
// instead of overwriting it: `D += acc` without reading D into the SM first.
//
// For an accumulating FP32 wgrad (main_grad += dy^T x) the beta = 1 epilogue loads each C
// tile through shared memory before storing it back; with reduce-add stores there is no
// source operand at all (no C loads, no C buffers, so more mainloop stages fit), and the sum is
// rounded once, as beta = 1 rounds it. Each output element is still written by exactly one
// tile, so the result does not depend on timing.
//
// CuTe's SM90_TMA_REDUCE_ADD has no `.with(descriptor)` form, which the ptr-array epilogue
// uses to switch descriptors between groups; TmaReduceAdd below is that op with one.
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/epilogue/collective/collective_epilogue.hpp>

namespace distgemm::grouped::sm90 {

struct TmaReduceAdd : cute::SM90_TMA_REDUCE_ADD {};
struct TmaReduceAddPtr : cute::SM90_TMA_REDUCE_ADD {};  // with a descriptor from shared memory

// CollectiveEpilogue with its shared-memory-to-global copy op replaced by `StoreOp`.
template <class Epilogue, class StoreOp>
struct WithStoreOp;
template <class Policy, class CtaTile, class EpiTile, class ElementC, class StrideC, class ElementD,
          class StrideD, class Fusion, class G2S, class SmemAtomC, class S2R, class S2G, class SmemAtomD,
          class R2S, class CopyAtomC, class R2R, class StoreOp>
struct WithStoreOp<cutlass::epilogue::collective::CollectiveEpilogue<
                       Policy, CtaTile, EpiTile, ElementC, StrideC, ElementD, StrideD, Fusion, G2S, SmemAtomC,
                       S2R, S2G, SmemAtomD, R2S, CopyAtomC, R2R>,
                   StoreOp> {
  using type = cutlass::epilogue::collective::CollectiveEpilogue<
      Policy, CtaTile, EpiTile, ElementC, StrideC, ElementD, StrideD, Fusion, G2S, SmemAtomC, S2R, StoreOp,
      SmemAtomD, R2S, CopyAtomC, R2R>;
};

// Adds the shared-memory tile `src` into the global tile at `dst`'s coordinates.
template <class TS, class SLayout, class TD, class DLayout>
CUTE_HOST_DEVICE void tma_reduce_add(cute::TmaDescriptor const* desc, cute::Tensor<TS, SLayout> const& src,
                                     cute::Tensor<TD, DLayout>& dst) {
  using namespace cute;
  static_assert(is_smem<TS>::value, "TMA reduce-add reads shared memory");
  auto dst_coord = dst(Int<0>{});
  detail::explode_tuple(detail::CallCOPY<SM90_TMA_REDUCE_ADD>{},
                        make_tuple(static_cast<void const*>(desc), static_cast<void const*>(raw_pointer_cast(src.data()))),
                        seq<0, 1>{}, dst_coord, tuple_seq<decltype(dst_coord)>{});
}

}  // namespace distgemm::grouped::sm90

namespace cute {

// TmaReduceAdd: SM90_TMA_REDUCE_ADD's traits plus `.with(descriptor)`.
template <class NumBitsPerTMA, class AuxParams_>
struct Copy_Traits<distgemm::grouped::sm90::TmaReduceAdd, NumBitsPerTMA, AuxParams_> {
  using ThrID = Layout<_1>;
  using SrcLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using DstLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using RefLayout = SrcLayout;

  TmaDescriptor tma_desc_;
  using AuxParams = AuxParams_;
  AuxParams aux_params_;

  CUTE_HOST_DEVICE constexpr TmaDescriptor const* get_tma_descriptor() const { return &tma_desc_; }

  template <class GShape>
  CUTE_HOST_DEVICE constexpr auto get_tma_tensor(GShape const& g_shape) const {
    static_assert(is_congruent<decltype(g_shape), decltype(aux_params_.g_stride_)>::value);
    return make_coord_tensor(make_layout(g_shape, aux_params_.g_stride_));
  }

  CUTE_HOST_DEVICE constexpr Copy_Traits<distgemm::grouped::sm90::TmaReduceAddPtr, NumBitsPerTMA>
  with(TmaDescriptor const* new_tma_desc) const {
    return {new_tma_desc};
  }

  template <class TS, class SLayout, class TD, class DLayout>
  CUTE_HOST_DEVICE friend constexpr void copy_unpack(Copy_Traits const& traits, Tensor<TS, SLayout> const& src,
                                                     Tensor<TD, DLayout>& dst) {
    distgemm::grouped::sm90::tma_reduce_add(&traits.tma_desc_, src, dst);
  }
};

template <class NumBitsPerTMA>
struct Copy_Traits<distgemm::grouped::sm90::TmaReduceAddPtr, NumBitsPerTMA> {
  using ThrID = Layout<_1>;
  using SrcLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using DstLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using RefLayout = SrcLayout;

  TmaDescriptor const* tma_desc_;

  template <class TS, class SLayout, class TD, class DLayout>
  CUTE_HOST_DEVICE friend constexpr void copy_unpack(Copy_Traits const& traits, Tensor<TS, SLayout> const& src,
                                                     Tensor<TD, DLayout>& dst) {
    distgemm::grouped::sm90::tma_reduce_add(traits.tma_desc_, src, dst);
  }
};

}  // namespace cute

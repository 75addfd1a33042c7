#include "common/buffer_check.h"

#include "common/checked_math.h"
#include "common/status.h"

namespace distgemm {

dg_status check_extent(const void* p, const char* name, std::initializer_list<int64_t> sizes, int bytes,
                       unsigned align) {
  int64_t elements = 0, extent = 0;
  DG_REQUIRE(checked_product(sizes, &elements) && checked_mul(elements, bytes, &extent), name,
             " spans more than 2^63 bytes");
  DG_REQUIRE(p != nullptr || elements == 0, name, " must not be NULL");
  DG_REQUIRE((reinterpret_cast<uintptr_t>(p) & (align - 1)) == 0, name, " must be a ", align,
             "-byte aligned device pointer, got ", p);
  DG_REQUIRE(static_cast<uint64_t>(extent) <= UINTPTR_MAX - reinterpret_cast<uintptr_t>(p), name,
             " runs past the end of the address space (", extent, " bytes from ", p, ")");
  return DG_SUCCESS;
}

dg_status check_no_overlap(std::initializer_list<Span> spans) {
  for (const Span* w = spans.begin(); w != spans.end(); ++w) {
    if (!w->written || w->bytes <= 0) continue;
    const uintptr_t w_first = reinterpret_cast<uintptr_t>(w->p), w_end = w_first + static_cast<uint64_t>(w->bytes);
    for (const Span* o = spans.begin(); o != spans.end(); ++o) {
      if (o == w || o->bytes <= 0 || (o->written && o < w)) continue;  // a pair of outputs once
      const uintptr_t o_first = reinterpret_cast<uintptr_t>(o->p), o_end = o_first + static_cast<uint64_t>(o->bytes);
      DG_REQUIRE(w_end <= o_first || o_end <= w_first, w->name, " must not overlap ", o->name, " (", w->bytes,
                 " bytes from ", w->p, " and ", o->bytes, " bytes from ", o->p, "): the kernels ",
                 o->written ? "write both" : cat("read ", o->name, " while they write ", w->name));
    }
  }
  return DG_SUCCESS;
}

}  // namespace distgemm

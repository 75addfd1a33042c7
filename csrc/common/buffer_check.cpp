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

}  // namespace distgemm

// The check every C API entry point makes of a device buffer it is handed. Host-only.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "distgemm/types.h"

namespace distgemm {

// `name` holds the product of `sizes` elements of `bytes` each at `p`: its byte extent fits in
// int64 and in the address space after p; p is `align`-byte aligned, and NULL only when there
// is nothing to read.
dg_status check_extent(const void* p, const char* name, std::initializer_list<int64_t> sizes, int bytes,
                       unsigned align = 16);

}  // namespace distgemm

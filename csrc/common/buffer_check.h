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

// A buffer a call names: `bytes` from `p` (checked by check_extent, so within int64 and the
// address space), and whether the call writes it.
struct Span {
  const char* name;
  const void* p;
  int64_t bytes;
  bool written;
};

// No buffer the call writes shares a byte with another buffer it names (read or written): the
// kernels read their inputs while they write their outputs, in no order that in-place use could
// rely on. Empty buffers overlap nothing.
dg_status check_no_overlap(std::initializer_list<Span> spans);

}  // namespace distgemm

// Size arithmetic of the argument checks without signed overflow: every product of caller-given
// sizes goes through these, and a result that does not fit int64 is refused by name. Host-only.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace distgemm {

// *out = a * b; false (and *out unspecified) on int64 overflow.
inline bool checked_mul(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

// *out = a + b; false on int64 overflow.
inline bool checked_add(int64_t a, int64_t b, int64_t* out) { return !__builtin_add_overflow(a, b, out); }

// The product of `factors`; false on int64 overflow.
inline bool checked_product(std::initializer_list<int64_t> factors, int64_t* out) {
  int64_t p = 1;
  for (int64_t f : factors)
    if (!checked_mul(p, f, &p)) return false;
  *out = p;
  return true;
}

// The value of an enum field as the caller stored it. The C API's enums come from C, where an
// enum object may hold any int; in C++ loading a value outside the enumeration's range through
// the enum type is undefined (and trips UBSan), so the checks read the raw int first.
template <class Enum>
int raw_enum(const Enum& e) {
  static_assert(sizeof(Enum) == sizeof(int), "C enums are int-sized");
  int v;
  std::memcpy(&v, &e, sizeof v);
  return v;
}

}  // namespace distgemm

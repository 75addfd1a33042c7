// The TP settings as the PyTorch op takes them (a float[]: algo, pieces, tapered,
// rs_split_gflops) turned into dg_tp_settings, each value checked before its cast: a float
// that is NaN, infinite or outside int's range converts to int with undefined behaviour.
// Header-only (no torch), so that the host-check build tests it.
#pragma once

#include <cmath>
#include <cstddef>
#include <sstream>
#include <string>

#include "distgemm/distgemm.h"

namespace distgemm::tp {

namespace detail {

inline bool whole_in(double v, double lo, double hi) {
  return std::isfinite(v) && v == std::trunc(v) && v >= lo && v <= hi;
}

}  // namespace detail

// Fills *out and returns true, or returns false with *why naming the setting and its value.
inline bool settings_from_doubles(const double* values, size_t count, dg_tp_settings* out, std::string* why) {
  std::ostringstream msg;
  msg.precision(17);
  if (values == nullptr || count != 4) {
    msg << "tp settings must be 4 values (algo, pieces, tapered, rs_split_gflops), got " << count;
  } else if (!detail::whole_in(values[0], DG_TP_ALGO_AUTO, DG_TP_ALGO_DECOMPOSED)) {
    msg << "tp setting algo must be 0 (auto), 1 (fused) or 2 (decomposed), got " << values[0];
  } else if (!detail::whole_in(values[1], 0, DG_TP_MAX_PIECES)) {
    msg << "tp setting pieces must be a whole number in [0, " << DG_TP_MAX_PIECES << "], got " << values[1];
  } else if (values[2] != 0.0 && values[2] != 1.0) {
    msg << "tp setting tapered must be 0 or 1, got " << values[2];
  } else if (!std::isfinite(values[3])) {
    msg << "tp setting rs_split_gflops must be a finite number, got " << values[3];
  } else {
    dg_tp_settings s{};
    s.algo = static_cast<dg_tp_algo>(static_cast<int>(values[0]));
    s.pieces = static_cast<int>(values[1]);
    s.tapered = values[2] != 0.0;
    s.rs_split_gflops = values[3];
    *out = s;
    return true;
  }
  if (why) *why = msg.str();
  return false;
}

}  // namespace distgemm::tp

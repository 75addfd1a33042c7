// The one argument check of a grouped GEMM, shared by every backend.
#pragma once

#include "grouped/grouped_problem.h"

namespace distgemm::grouped {

// Validates `desc` and lowers it to a GroupedProblem; the message names what is wrong.
dg_status lower(const dg_grouped_desc* desc, GroupedProblem* problem);

}  // namespace distgemm::grouped

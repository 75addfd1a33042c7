# CUTLASS 4.5.0 headers: CUTLASS_DIR (a checkout or an extracted include tree) wins; otherwise
# cmake/fetch_cutlass.py fetches the pinned headers once (checked by hash and version) into a
# per-user cache. Why 4.5 and where it comes from: README, "CUTLASS".
set(CUTLASS_DIR "$ENV{CUTLASS_DIR}" CACHE PATH "CUTLASS source tree (include/ and tools/util/include/)")
if(NOT CUTLASS_DIR)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" "${CMAKE_CURRENT_LIST_DIR}/fetch_cutlass.py"
    OUTPUT_VARIABLE _cutlass_fetched OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _cutlass_result)
  if(NOT _cutlass_result EQUAL 0)
    message(FATAL_ERROR "CUTLASS 4.5.0 headers could not be fetched (see above); set CUTLASS_DIR "
                        "to a CUTLASS 4.5 tree (include/ and tools/util/include/)")
  endif()
  set(CUTLASS_DIR "${_cutlass_fetched}")
endif()

set(CUTLASS_INCLUDE_DIRS "${CUTLASS_DIR}/include" "${CUTLASS_DIR}/tools/util/include")
if(NOT EXISTS "${CUTLASS_DIR}/include/cutlass/version.h")
  message(FATAL_ERROR "CUTLASS_DIR=${CUTLASS_DIR} has no include/cutlass/version.h")
endif()
file(STRINGS "${CUTLASS_DIR}/include/cutlass/version.h" _cutlass_version_lines
     REGEX "#define CUTLASS_(MAJOR|MINOR) ")
string(REGEX REPLACE ".*CUTLASS_MAJOR ([0-9]+).*" "\\1" CUTLASS_VERSION_MAJOR "${_cutlass_version_lines}")
string(REGEX REPLACE ".*CUTLASS_MINOR ([0-9]+).*" "\\1" CUTLASS_VERSION_MINOR "${_cutlass_version_lines}")
if(NOT "${CUTLASS_VERSION_MAJOR}.${CUTLASS_VERSION_MINOR}" STREQUAL "4.5")
  message(FATAL_ERROR "distgemm is pinned to CUTLASS 4.5; ${CUTLASS_DIR} holds ${CUTLASS_VERSION_MAJOR}.${CUTLASS_VERSION_MINOR}")
endif()
message(STATUS "distgemm: CUTLASS 4.5 from ${CUTLASS_DIR}")

# CUTLASS headers: CUTLASS_DIR (a checkout or an extracted include tree) wins; otherwise
# the pinned nvidia-cutlass wheel's headers (cutlass_library.source_path).
set(CUTLASS_DIR "$ENV{CUTLASS_DIR}" CACHE PATH "CUTLASS source tree (include/ and tools/util/include/)")
if(NOT CUTLASS_DIR)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "import cutlass_library; print(cutlass_library.source_path)"
    OUTPUT_VARIABLE _cutlass_wheel_dir OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _cutlass_result ERROR_QUIET)
  if(NOT _cutlass_result EQUAL 0)
    message(FATAL_ERROR "CUTLASS not found: set CUTLASS_DIR or `pip install nvidia-cutlass==4.2.0.0`")
  endif()
  set(CUTLASS_DIR "${_cutlass_wheel_dir}")
endif()

set(CUTLASS_INCLUDE_DIRS "${CUTLASS_DIR}/include" "${CUTLASS_DIR}/tools/util/include")
if(NOT EXISTS "${CUTLASS_DIR}/include/cutlass/version.h")
  message(FATAL_ERROR "CUTLASS_DIR=${CUTLASS_DIR} has no include/cutlass/version.h")
endif()
file(STRINGS "${CUTLASS_DIR}/include/cutlass/version.h" _cutlass_version_lines
     REGEX "#define CUTLASS_(MAJOR|MINOR) ")
string(REGEX REPLACE ".*CUTLASS_MAJOR ([0-9]+).*" "\\1" CUTLASS_VERSION_MAJOR "${_cutlass_version_lines}")
string(REGEX REPLACE ".*CUTLASS_MINOR ([0-9]+).*" "\\1" CUTLASS_VERSION_MINOR "${_cutlass_version_lines}")
if(NOT "${CUTLASS_VERSION_MAJOR}.${CUTLASS_VERSION_MINOR}" STREQUAL "4.2")
  message(FATAL_ERROR "distgemm is pinned to CUTLASS 4.2; ${CUTLASS_DIR} holds ${CUTLASS_VERSION_MAJOR}.${CUTLASS_VERSION_MINOR}")
endif()
message(STATUS "distgemm: CUTLASS 4.2 from ${CUTLASS_DIR}")

# A build id, new at every configure, baked into the core library, the torch binding and the
# Python package (distgemm/_build_info.py), so that a package whose libraries come from another
# build is refused at import with a clear message instead of crashing on a changed signature.
string(RANDOM LENGTH 16 ALPHABET "0123456789abcdef" DISTGEMM_BUILD_ID)
string(TIMESTAMP DISTGEMM_BUILD_TIME "%Y-%m-%dT%H:%M:%SZ" UTC)
set(DISTGEMM_BUILD_ID "${DISTGEMM_BUILD_ID}-${DISTGEMM_BUILD_TIME}")
file(WRITE "${CMAKE_BINARY_DIR}/build_id/distgemm_build_id.h.in"
  "#pragma once\n#define DISTGEMM_BUILD_ID \"@DISTGEMM_BUILD_ID@\"\n")
configure_file("${CMAKE_BINARY_DIR}/build_id/distgemm_build_id.h.in"
               "${CMAKE_BINARY_DIR}/build_id/distgemm_build_id.h" @ONLY)
# The source's git commit ("+" when tracked files differ from it; empty outside a checkout), which
# benchmark results name: an installed package has no .git to ask.
set(DISTGEMM_COMMIT "")
find_package(Git QUIET)
if(GIT_FOUND AND EXISTS "${CMAKE_SOURCE_DIR}/.git")
  execute_process(COMMAND "${GIT_EXECUTABLE}" rev-parse --short HEAD WORKING_DIRECTORY "${CMAKE_SOURCE_DIR}"
                  OUTPUT_VARIABLE DISTGEMM_COMMIT OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  execute_process(COMMAND "${GIT_EXECUTABLE}" status --porcelain --untracked-files=no
                  WORKING_DIRECTORY "${CMAKE_SOURCE_DIR}" OUTPUT_VARIABLE distgemm_changes ERROR_QUIET)
  if(DISTGEMM_COMMIT AND distgemm_changes)
    string(APPEND DISTGEMM_COMMIT "+")
  endif()
endif()
file(WRITE "${CMAKE_BINARY_DIR}/build_id/_build_info.py"
  "# Generated at build time: the build these libraries come from.\nBUILD_ID = \"${DISTGEMM_BUILD_ID}\"\n"
  "COMMIT = \"${DISTGEMM_COMMIT}\"\n")

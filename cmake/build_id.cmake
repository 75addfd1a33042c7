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
file(WRITE "${CMAKE_BINARY_DIR}/build_id/_build_info.py"
  "# Generated at build time: the build these libraries come from.\nBUILD_ID = \"${DISTGEMM_BUILD_ID}\"\n")

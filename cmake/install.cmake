# What C++ users get: headers, the core library and a CMake package (distgemm::core).
#   cmake -B build -DCUTLASS_DIR=... && cmake --build build && cmake --install build --prefix P
#     -> P/include/distgemm/*.h, P/lib/libdistgemm_core.so.<soversion>, P/lib/cmake/distgemm/
# The wheel (pip install .) carries the same tree inside the package, beside _C.so:
#     site-packages/distgemm/{include/distgemm/*.h, libdistgemm_core.so.<soversion>, lib/cmake/distgemm/}
# so a C++ project can find_package(distgemm) against a pip-installed distgemm too
# (cmake -DCMAKE_PREFIX_PATH="$(python -c 'import distgemm; print(distgemm.cmake_prefix_path)')").
# Both carry the SONAME libdistgemm_core.so.<soversion> (what a linked program records and
# loads). A wheel holds no symlinks, so it gets the one file of that name: no namelink, and no
# .so.<full version> beside it (a copy of each would triple the library).
include(CMakePackageConfigHelpers)
# 0.x: every minor release may change the C structs, so the soversion is 0.<minor>.
set(DG_SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR})
if(SKBUILD)
  set(DG_LIB_DIR distgemm)  # where _C.so's $ORIGIN rpath finds it
  set(DG_INCLUDE_DIR distgemm/include)
  set(DG_CMAKE_DIR distgemm/lib/cmake/distgemm)
  set(DG_NAMELINK NAMELINK_SKIP)
  set_target_properties(distgemm_core PROPERTIES SOVERSION ${DG_SOVERSION})
else()
  include(GNUInstallDirs)
  set(DG_LIB_DIR ${CMAKE_INSTALL_LIBDIR})
  set(DG_INCLUDE_DIR ${CMAKE_INSTALL_INCLUDEDIR})
  set(DG_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/distgemm)
  set(DG_NAMELINK "")
  set_target_properties(distgemm_core PROPERTIES VERSION ${PROJECT_VERSION} SOVERSION ${DG_SOVERSION})
endif()

set_target_properties(distgemm_core PROPERTIES EXPORT_NAME core)
install(TARGETS distgemm_core EXPORT distgemmTargets
        LIBRARY DESTINATION ${DG_LIB_DIR} ${DG_NAMELINK}
        INCLUDES DESTINATION ${DG_INCLUDE_DIR})
install(DIRECTORY "${CMAKE_SOURCE_DIR}/csrc/include/distgemm" "${DISTGEMM_GENERATED_INCLUDE}/distgemm"
        DESTINATION ${DG_INCLUDE_DIR})
install(EXPORT distgemmTargets NAMESPACE distgemm:: DESTINATION ${DG_CMAKE_DIR})
configure_package_config_file("${CMAKE_SOURCE_DIR}/cmake/distgemmConfig.cmake.in"
                              "${CMAKE_BINARY_DIR}/distgemmConfig.cmake"
                              INSTALL_DESTINATION ${DG_CMAKE_DIR})
write_basic_package_version_file("${CMAKE_BINARY_DIR}/distgemmConfigVersion.cmake"
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES "${CMAKE_BINARY_DIR}/distgemmConfig.cmake" "${CMAKE_BINARY_DIR}/distgemmConfigVersion.cmake"
        DESTINATION ${DG_CMAKE_DIR})

# distgemm_nccl (find_package(distgemm) -> distgemm::nccl): the tensor-parallel GEMMs' symmetric
# workspaces set up over an NCCL communicator (csrc/include/distgemm/nccl.h), for C/C++ programs
# without a framework. Built when NCCL is found (DISTGEMM_BUILD_NCCL); installed beside
# distgemm_core in the same export set, so the wheel carries it too.
#
# NCCL: NCCL_HOME, the CUDA toolkit, or the pip package torch brings (nvidia-nccl-cu*:
# site-packages/nvidia/nccl/{include,lib/libnccl.so.2}, no unversioned symlink). A wheel build
# looks at the pip package first: that is the libnccl.so.2 torch loads beside it.
set(_dg_nccl_roots "")
if(DEFINED ENV{NCCL_HOME})
  list(APPEND _dg_nccl_roots "$ENV{NCCL_HOME}")
endif()
set(_dg_nccl_python "${Python_EXECUTABLE}")
if(NOT _dg_nccl_python)
  find_program(_dg_nccl_python NAMES python3 python)
endif()
set(_dg_nccl_pip "")
if(_dg_nccl_python)
  # nvidia.nccl is a namespace package (no __file__): its first __path__ entry.
  execute_process(
    COMMAND "${_dg_nccl_python}" -c "import nvidia.nccl as m; print(list(m.__path__)[0])"
    OUTPUT_VARIABLE _dg_nccl_pip OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _dg_nccl_pip_result ERROR_QUIET)
  if(NOT _dg_nccl_pip_result EQUAL 0)
    set(_dg_nccl_pip "")
  endif()
endif()
if(SKBUILD AND _dg_nccl_pip)
  list(APPEND _dg_nccl_roots "${_dg_nccl_pip}" "${CUDAToolkit_LIBRARY_ROOT}")
else()
  list(APPEND _dg_nccl_roots "${CUDAToolkit_LIBRARY_ROOT}" ${_dg_nccl_pip})
endif()
# The library first, then the header beside it (one NCCL, not one's header and another's library).
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR
  HINTS ${_dg_nccl_roots} ${CUDAToolkit_LIBRARY_DIR}
  PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu)
set(_dg_nccl_lib_root "")
if(NCCL_LIBRARY)
  get_filename_component(_dg_nccl_lib_root "${NCCL_LIBRARY}" DIRECTORY)
  get_filename_component(_dg_nccl_lib_root "${_dg_nccl_lib_root}/.." ABSOLUTE)
endif()
find_path(NCCL_INCLUDE_DIR nccl.h
  HINTS ${_dg_nccl_lib_root} ${_dg_nccl_roots} ${CUDAToolkit_INCLUDE_DIRS}
  PATH_SUFFIXES include)

if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
  set(_dg_nccl_found ON)
  message(STATUS "distgemm: NCCL found: ${NCCL_LIBRARY} (headers ${NCCL_INCLUDE_DIR})")
else()
  set(_dg_nccl_found OFF)
  message(STATUS "distgemm: NCCL not found (set NCCL_HOME, or pip install nvidia-nccl-cu12/13): "
                 "distgemm_nccl (distgemm::nccl) is not built")
endif()
option(DISTGEMM_BUILD_NCCL "Build distgemm_nccl (distgemm::nccl): the TP GEMMs' workspaces over NCCL"
       ${_dg_nccl_found})
if(NOT DISTGEMM_BUILD_NCCL)
  if(_dg_nccl_found)
    message(STATUS "distgemm: DISTGEMM_BUILD_NCCL=OFF: distgemm_nccl is not built")
  endif()
  return()
endif()
if(NOT _dg_nccl_found)
  message(FATAL_ERROR "DISTGEMM_BUILD_NCCL=ON but NCCL was not found: set NCCL_HOME, or "
                      "NCCL_INCLUDE_DIR and NCCL_LIBRARY")
endif()

# The NCCL consumers of distgemm::nccl compile and link with (its header includes <nccl.h>).
# The installed package recreates this target from distgemmNccl.cmake (below).
add_library(distgemm::nccl_runtime SHARED IMPORTED)
set_target_properties(distgemm::nccl_runtime PROPERTIES
  IMPORTED_LOCATION "${NCCL_LIBRARY}"
  INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")

add_library(distgemm_nccl SHARED csrc/nccl/nccl_workspace.cpp)
target_include_directories(distgemm_nccl
  PUBLIC "$<BUILD_INTERFACE:${CMAKE_SOURCE_DIR}/csrc/include>" "$<BUILD_INTERFACE:${DISTGEMM_GENERATED_INCLUDE}>"
  PRIVATE "${CMAKE_SOURCE_DIR}/csrc")
# PUBLIC core: what dg_nccl_tp_bind fills is run by the core's dg_all_gather_gemm /
# dg_gemm_reduce_scatter, so linking distgemm::nccl alone is enough. The runtime API only (no libcuda).
target_link_libraries(distgemm_nccl PUBLIC distgemm_core distgemm::nccl_runtime CUDA::cudart)
target_link_options(distgemm_nccl PRIVATE ${DISTGEMM_PRIVATE_STATIC_LIBS} "LINKER:--no-undefined")
# In the wheel, torch's pip NCCL sits at site-packages/nvidia/nccl/lib (torch has loaded it by
# then anyway; the rpath serves a C++ program that loads this library first).
if(SKBUILD)
  set(_dg_nccl_rpath "$ORIGIN;$ORIGIN/../nvidia/nccl/lib")
else()
  set(_dg_nccl_rpath "$ORIGIN")
endif()
set_target_properties(distgemm_nccl PROPERTIES
  EXPORT_NAME nccl
  INSTALL_RPATH "${_dg_nccl_rpath}")
# The SONAME libdistgemm_nccl.so.<soversion>, as distgemm_core's (install.cmake says how the
# wheel holds it).
if(SKBUILD)
  set_target_properties(distgemm_nccl PROPERTIES SOVERSION ${DG_SOVERSION})
else()
  set_target_properties(distgemm_nccl PROPERTIES VERSION ${PROJECT_VERSION} SOVERSION ${DG_SOVERSION})
endif()

# DG_LIB_DIR, DG_INCLUDE_DIR, DG_CMAKE_DIR, DG_NAMELINK: set by install.cmake (the headers,
# nccl.h among them, are installed there too).
install(TARGETS distgemm_nccl EXPORT distgemmTargets
        LIBRARY DESTINATION ${DG_LIB_DIR} ${DG_NAMELINK}
        INCLUDES DESTINATION ${DG_INCLUDE_DIR})
# distgemmConfig.cmake includes this file (when present) before the targets: it defines
# distgemm::nccl_runtime from the paths found here, or finds NCCL again where they moved.
configure_file("${CMAKE_SOURCE_DIR}/cmake/distgemmNccl.cmake.in" "${CMAKE_BINARY_DIR}/distgemmNccl.cmake" @ONLY)
install(FILES "${CMAKE_BINARY_DIR}/distgemmNccl.cmake" DESTINATION ${DG_CMAKE_DIR})

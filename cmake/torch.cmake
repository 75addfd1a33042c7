# The installed torch, used as headers + shared libraries only (the binding registers its
# ops through TORCH_LIBRARY and does not link Python, so one build serves any CPython). The
# repeat-call tables (csrc/torch/repeat_calls.cpp) use Python's stable ABI only, through the
# headers of this interpreter; their Python symbols come from the running one at load time, and
# libtorch_python's from the copy `import torch` loaded.
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
    "import torch, os, sysconfig; print(os.path.dirname(torch.__file__)); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(sysconfig.get_paths()['include']); print(torch.version.cuda or '')"
  OUTPUT_VARIABLE _torch_info OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _torch_result)
if(NOT _torch_result EQUAL 0)
  message(FATAL_ERROR "torch is not importable by ${Python_EXECUTABLE}: install torch first "
                      "and build with `pip install --no-build-isolation .`")
endif()
string(REPLACE "\n" ";" _torch_info "${_torch_info}")
list(GET _torch_info 0 TORCH_DIR)
list(GET _torch_info 1 TORCH_CXX11_ABI)
list(GET _torch_info 2 PYTHON_HEADERS_DIR)
list(LENGTH _torch_info _n)
set(TORCH_CUDA_VERSION "")
if(_n GREATER 3)
  list(GET _torch_info 3 TORCH_CUDA_VERSION)
endif()
string(REGEX MATCH "^[0-9]+" _torch_cuda_major "${TORCH_CUDA_VERSION}")
if(NOT _torch_cuda_major STREQUAL CUDAToolkit_VERSION_MAJOR)
  message(FATAL_ERROR "torch is built for CUDA '${TORCH_CUDA_VERSION}' but nvcc is "
                      "${CUDAToolkit_VERSION}: install a torch whose CUDA major version matches")
endif()
message(STATUS "distgemm: torch at ${TORCH_DIR} (CUDA ${TORCH_CUDA_VERSION})")

add_library(distgemm_torch_libs INTERFACE)
target_include_directories(distgemm_torch_libs SYSTEM INTERFACE
  "${TORCH_DIR}/include" "${TORCH_DIR}/include/torch/csrc/api/include")
target_compile_definitions(distgemm_torch_libs INTERFACE
  _GLIBCXX_USE_CXX11_ABI=${TORCH_CXX11_ABI} TORCH_API_INCLUDE_EXTENSION_H)
foreach(lib c10 c10_cuda torch torch_cpu torch_cuda torch_python)
  find_library(TORCH_LIB_${lib} ${lib} PATHS "${TORCH_DIR}/lib" NO_DEFAULT_PATH REQUIRED)
  target_link_libraries(distgemm_torch_libs INTERFACE "${TORCH_LIB_${lib}}")
endforeach()
target_link_libraries(distgemm_torch_libs INTERFACE CUDA::cudart)

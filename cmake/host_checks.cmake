# DISTGEMM_HOST_CHECKS: the host code of the core (C API checks, heuristics, TP planning) built
# with AddressSanitizer + UndefinedBehaviorSanitizer, and its CPU tests under ctest: GoogleTest
# binaries of the C API's argument checks and of the TP plans, and a deterministic fuzzer of the checks. No CUTLASS kernel
# instances (the instance tables are empty), no torch, no GPU needed: without a device every
# path stops at its checks or at a clean DG_ERROR_CUDA / DG_ERROR_NOT_SUPPORTED.
#
#   cmake -S . -B build-host-checks -DDISTGEMM_HOST_CHECKS=ON -DCMAKE_BUILD_TYPE=Debug
#   cmake --build build-host-checks && ctest --test-dir build-host-checks --output-on-failure

find_package(GTest REQUIRED)  # Debian/Ubuntu: libgtest-dev
enable_testing()

set(DISTGEMM_SANITIZE -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)

add_library(distgemm_host_checks STATIC ${core_host_srcs})  # the .cu kernels: nvcc code, not instrumented
# One PTX target is enough to link the TP flag and FP8 quantization kernels; nothing runs them
# here (without DISTGEMM_WITH_SM90/SM100, dg_quantize_fp8 stops at NOT_SUPPORTED after its checks).
set_source_files_properties(csrc/tp/tp_kernels.cu csrc/quant/fp8_quantize.cu csrc/moe/moe_act_quantize.cu
                            csrc/moe/moe_routing.cu csrc/grouped/fp8_wgrad_layout_check.cu PROPERTIES
  COMPILE_OPTIONS "-gencode=arch=compute_90,code=compute_90")
target_include_directories(distgemm_host_checks
  PUBLIC "${CMAKE_SOURCE_DIR}/csrc/include" "${DISTGEMM_GENERATED_INCLUDE}" "${CMAKE_SOURCE_DIR}/csrc")
target_link_libraries(distgemm_host_checks PUBLIC CUDA::cudart CUDA::cublas CUDA::cublasLt)
target_compile_options(distgemm_host_checks PUBLIC
  $<$<COMPILE_LANGUAGE:CXX>:${DISTGEMM_SANITIZE} -O1 -g -Wall -Wextra -Wno-unused-parameter>)
target_link_options(distgemm_host_checks PUBLIC ${DISTGEMM_SANITIZE})
set_target_properties(distgemm_host_checks PROPERTIES CUDA_ARCHITECTURES OFF)

add_executable(distgemm_host_tests tests/cpp/test_c_api.cpp)
target_link_libraries(distgemm_host_tests PRIVATE distgemm_host_checks GTest::gtest GTest::gtest_main)

# The tensor-parallel plans of every rank checked together (CPU only).
add_executable(distgemm_plan_tests tests/cpp/test_tp_plan.cpp)
target_link_libraries(distgemm_plan_tests PRIVATE distgemm_host_checks GTest::gtest GTest::gtest_main)

# The tile-choice cost model (CPU only).
add_executable(distgemm_heuristic_tests tests/cpp/test_tile_heuristic.cpp)
target_link_libraries(distgemm_heuristic_tests PRIVATE distgemm_host_checks GTest::gtest GTest::gtest_main)

# What the decomposed TP algorithm can hand cuBLASLt, FP8 included (CPU only).
add_executable(distgemm_cublaslt_check_tests tests/cpp/test_cublaslt_checks.cpp)
target_link_libraries(distgemm_cublaslt_check_tests PRIVATE distgemm_host_checks GTest::gtest GTest::gtest_main)

# The FP8 kernels' quotient without the division, against the division (CPU only).
add_executable(distgemm_quotient_tests tests/cpp/test_exact_quotient.cpp)
target_link_libraries(distgemm_quotient_tests PRIVATE distgemm_host_checks GTest::gtest GTest::gtest_main)

add_executable(distgemm_fuzz_checks tests/cpp/fuzz_checks.cpp)
target_link_libraries(distgemm_fuzz_checks PRIVATE distgemm_host_checks)

# halt_on_error: any report fails the test; protect_shadow_gap=0 lets the CUDA driver map its
# memory on a machine that has one.
set(DISTGEMM_SANITIZER_ENV
  "ASAN_OPTIONS=halt_on_error=1:detect_leaks=1:protect_shadow_gap=0:abort_on_error=0"
  "UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1")
add_test(NAME c_api_checks COMMAND distgemm_host_tests)
add_test(NAME tp_plans COMMAND distgemm_plan_tests)
add_test(NAME tile_heuristics COMMAND distgemm_heuristic_tests)
add_test(NAME cublaslt_checks COMMAND distgemm_cublaslt_check_tests)
add_test(NAME exact_quotient COMMAND distgemm_quotient_tests)
set(DISTGEMM_FUZZ_ITERATIONS 200000 CACHE STRING "Random descriptors per run of the C API fuzzer")
set(DISTGEMM_FUZZ_FAMILIES "gemm,grouped,tp,quant,moe,routing,weight" CACHE STRING
    "What the C API fuzzer calls: gemm,grouped,tp,quant,moe (with the permute),routing,weight")
add_test(NAME c_api_fuzz
         COMMAND distgemm_fuzz_checks ${DISTGEMM_FUZZ_ITERATIONS} 20260101 ${DISTGEMM_FUZZ_FAMILIES})
set_tests_properties(c_api_checks tp_plans tile_heuristics cublaslt_checks exact_quotient c_api_fuzz PROPERTIES ENVIRONMENT "${DISTGEMM_SANITIZER_ENV}")

#!/usr/bin/env bash
# On a GPU machine: build with every core, run the whole test suite and the benchmarks, and
# leave logs and results in the folder given (default: ./gpu_check_out).
#   bash scripts/gpu_check.sh OUT_DIR
# Needs torch (CUDA 13), scikit-build-core and ninja installed, and CUTLASS 4.5 headers
# (CUTLASS_DIR on an offline machine; otherwise cmake/fetch_cutlass.py fetches them). Set DISTGEMM_PREBUILT_WHEEL=path.whl to install
# a wheel built elsewhere instead of building. The C++ tests need GoogleTest: libgtest-dev, or its
# sources at GTEST_SOURCE_DIR (default here: a copy at .googletest, if there is one).
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="$(mkdir -p "${1:-gpu_check_out}" && cd "${1:-gpu_check_out}" && pwd)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" DISTGEMM_CUDA_ARCHS="${DISTGEMM_CUDA_ARCHS:-90a}"
cd "$repo"
if [ -z "${GTEST_SOURCE_DIR:-}" ] && [ -d .googletest ]; then export GTEST_SOURCE_DIR="$repo/.googletest"; fi
status=0
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv > "$out/gpu.txt" 2>&1
if [ -n "${DISTGEMM_PREBUILT_WHEEL:-}" ]; then
  python3 -m pip install --no-deps --no-index --force-reinstall -q "$DISTGEMM_PREBUILT_WHEEL" > "$out/build.log" 2>&1 || status=1
else
  ( time python3 -m pip install --no-build-isolation --no-deps -v . ) > "$out/build.log" 2>&1 || status=1
fi
tail -3 "$out/build.log"
[ $status -eq 0 ] || { echo "build failed: see $out/build.log"; exit 1; }
python3 -m pytest -q -ra -p no:cacheprovider ${DISTGEMM_TESTS:-tests} 2>&1 | tee "$out/tests.log" | tail -25 || status=1
python3 -m distgemm.bench --out "$out" ${DISTGEMM_BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" | grep -v "^tune" | tail -60 || status=1
exit $status

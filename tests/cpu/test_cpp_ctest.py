"""The C++ tests of tests/cpp (GoogleTest under ctest), built as an out-of-tree consumer of the
installed package (find_package(distgemm)), so that the README's test command runs them too:
the TP plan executor and consumers on one GPU, the NCCL path on two, the C API's NCCL checks.
Their GPU tests skip (GTEST_SKIP) where the machine has no such GPUs; on a GPU machine they run.
GoogleTest: an installed one, or its sources at GTEST_SOURCE_DIR (or /usr/src/googletest)."""

import os
import pathlib
import shutil
import subprocess

import pytest

import distgemm

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "cpp-tests"


def _run(args, timeout):
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def test_cpp_tests_pass_under_ctest():
    cmake, ctest = shutil.which("cmake"), shutil.which("ctest")
    if cmake is None or ctest is None:
        pytest.fail("cmake and ctest are needed to build and run the C++ tests (pip install cmake)")
    rc, out = _run([cmake, "-S", str(ROOT / "tests" / "cpp"), "-B", str(BUILD), "-DCMAKE_BUILD_TYPE=Release",
                    f"-DCMAKE_PREFIX_PATH={distgemm.cmake_prefix_path}",
                    # find_package keeps the distgemm_DIR a previous configure cached: name this one's
                    f"-Ddistgemm_DIR={pathlib.Path(distgemm.cmake_prefix_path) / 'distgemm'}"], 300)
    assert rc == 0, f"configuring tests/cpp against the installed distgemm failed:\n{out[-4000:]}"
    jobs = str(os.cpu_count() or 2)
    rc, out = _run([cmake, "--build", str(BUILD), "-j", jobs], 900)
    assert rc == 0, f"building tests/cpp failed:\n{out[-4000:]}"
    rc, out = _run([ctest, "--test-dir", str(BUILD), "--output-on-failure", "--timeout", "300"], 1200)
    print(out[-6000:])
    assert rc == 0, f"ctest failed:\n{out[-8000:]}"
    # "100% tests passed, 0 tests failed out of N", or "100% tests passed out of N" when some skipped
    assert "100% tests passed" in out, out[-2000:]

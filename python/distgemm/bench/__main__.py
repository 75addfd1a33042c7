"""python -m distgemm.bench: runs every benchmark suite this machine's GPUs allow, prints one
line per shape with TFLOP/s and ratios to each peer plus geomeans, and writes JSON + PNG
results (bench/results/ by default). Without a GPU it runs the CPU reference check."""

from __future__ import annotations

import argparse
import os
import sys

import torch

SUITES = ("gemm", "grouped", "grouped_fp8", "tp")


def cpu_reference_check() -> None:
    import distgemm

    a = torch.randn(64, 128).to(torch.bfloat16)
    b = torch.randn(96, 128).to(torch.bfloat16)
    c = torch.randn(96).to(torch.bfloat16)
    out = distgemm.gemm(a, b, c, alpha=0.5, beta=2.0)
    ref = 0.5 * (a.double() @ b.double().T) + 2.0 * c.double()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    status = "OK" if err < 1e-2 else "FAILED"
    print(f"CPU reference check of distgemm.gemm (64x96x128 bf16): relative error {err:.2e}: {status}")
    if status != "OK":
        sys.exit(1)


def run_tp_suite(gpus: int, out: str, quick: bool) -> str:
    """Runs the tensor-parallel suite under torchrun, one process per GPU."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}",
           "-m", "distgemm.bench.tp_suite", "--out", out] + (["--quick"] if quick else [])
    result = subprocess.run(cmd, env=dict(os.environ))
    return "ok" if result.returncode == 0 else f"failed (exit {result.returncode})"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m distgemm.bench", description=__doc__)
    parser.add_argument("--suites", default=",".join(SUITES),
                        help=f"comma-separated subset of {','.join(SUITES)}")
    parser.add_argument("--out", default=os.path.join("bench", "results"), help="results folder")
    parser.add_argument("--quick", action="store_true", help="a few shapes per suite")
    parser.add_argument("--tune", action="store_true",
                        help="also sweep every tile configuration (and dense swizzle)")
    args = parser.parse_args(argv)
    suites = [s for s in args.suites.split(",") if s]
    unknown = set(suites) - set(SUITES)
    if unknown:
        parser.error(f"unknown suites {sorted(unknown)}; choose from {SUITES}")

    import distgemm

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    usable = gpus and distgemm.has_kernels(torch.device("cuda", 0))
    if not usable:
        what = "no CUDA GPU" if not gpus else f"{torch.cuda.get_device_name(0)} has no distgemm kernels"
        print(f"distgemm.bench: {what}; the benchmarks need an sm_90 or sm_100 GPU. "
              "Running the CPU reference check instead.")
        cpu_reference_check()
        return

    print(f"distgemm.bench on {gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}; results in {args.out}")
    summary = {}
    if "gemm" in suites:
        from . import gemm_suite

        summary.update(gemm_suite.run(args.out, args.quick))
        if args.tune:
            gemm_suite.tune(args.out, args.quick)
    if "grouped" in suites:
        from . import grouped_suite

        summary.update(grouped_suite.run(args.out, args.quick))
        if args.tune:
            grouped_suite.tune(args.out, args.quick)
    if "grouped_fp8" in suites:
        from . import grouped_fp8_suite

        summary.update(grouped_fp8_suite.run(args.out, args.quick))
    if "tp" in suites:
        if gpus < 2:
            print("\n== tensor-parallel suite skipped: it needs 2 or more GPUs")
        else:
            summary["tp"] = run_tp_suite(gpus, args.out, args.quick)
    print("\n== summary (geomean of peer time / distgemm time)")
    for name, value in summary.items():
        print(f"  {name}: {value}")


if __name__ == "__main__":
    main()

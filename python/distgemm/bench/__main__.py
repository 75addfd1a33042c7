"""python -m distgemm.bench: runs every benchmark suite this machine's GPUs allow, prints one
line per shape with TFLOP/s and ratios to each peer plus geomeans, and writes JSON + PNG
results (bench/results/ by default). Without a GPU it runs the CPU reference check.

The sweep suite (--suites sweep) times distgemm against PyTorch on the layer shapes of real
models (Llama-3, DeepSeek-V3, Qwen3, Mixtral, GPT-OSS; unsharded and at TP 2/4/8) over token
counts M from 1 to 32768, dense and grouped (MoE); --quick runs ~20 dense and ~6 grouped rows.
Your own shapes:

  python -m distgemm.bench --shapes 4096x2112x7168,128x4096x4096
  python -m distgemm.bench --shapes @shapes.txt          # one MxNxK a line, '#' comments
  python -m distgemm.bench --grouped-shapes 8x1024x4096x7168,32x256x2048x7168

--shapes MxNxK,...: distgemm.gemm(a, b) (a (M, K), b (N, K) bf16, bf16 out) against
torch.matmul(a, b.t()) (cuBLAS) on those shapes only: device time, TFLOP/s, ratio, host time
per call, the backend distgemm ran. --grouped-shapes GxPERxNxK,... (G experts of PER tokens
each, w (G, N, K)): the grouped forward, dgrad and wgrad against torch.bmm and
torch._grouped_mm. Either one (both may be given, each also as @FILE) runs the sweep suite on
those rows only (with --suites, next to the suites named there), and writes
<gpu>_gemm_sweep_shapes.json / <gpu>_grouped_sweep_shapes.json (+ .png) under --out.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys

import torch

SUITES = ("gemm", "gemm_fp8_block", "grouped", "grouped_fp8", "moe", "moe_layer", "host", "sweep", "tp", "tp_fp8")


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


def run_tp_suite(gpus: int, out: str, quick: bool, extra=()) -> str:
    """Runs the tensor-parallel suite under torchrun, one process per GPU (`extra`: its options,
    e.g. --dtype fp8)."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}",
           "-m", "distgemm.bench.tp_suite", "--out", out] + (["--quick"] if quick else []) + list(extra)
    result = subprocess.run(cmd)  # the environment (and the settings in it) passes on
    return "ok" if result.returncode == 0 else f"failed (exit {result.returncode})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m distgemm.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suites", default=None,
                        help=f"comma-separated subset of {','.join(SUITES)} (default: all; with --shapes "
                             "or --grouped-shapes: sweep only)")
    parser.add_argument("--out", default=os.path.join("bench", "results"), help="results folder")
    parser.add_argument("--quick", action="store_true", help="a few shapes per suite")
    parser.add_argument("--tune", action="store_true",
                        help="also sweep every tile configuration (and dense swizzle)")
    parser.add_argument("--shapes", default=None, metavar="MxNxK[,MxNxK...] | @FILE",
                        help="dense bf16 shapes to time distgemm.gemm against torch.matmul (cuBLAS) on, "
                             "instead of the sweep's model shapes, e.g. 4096x2112x7168,128x4096x4096; "
                             "@FILE reads one MxNxK a line ('#' starts a comment). Runs the sweep suite "
                             "on these rows only (its grouped part only with --grouped-shapes)")
    parser.add_argument("--grouped-shapes", default=None, metavar="GxPERxNxK[,...] | @FILE",
                        help="grouped (MoE) bf16 shapes: G experts of PER tokens each, w (G, N, K), e.g. "
                             "8x1024x4096x7168; forward, dgrad and wgrad against torch.bmm and "
                             "torch._grouped_mm, in the sweep suite (its dense part only with --shapes)")
    return parser


def parse_args(argv=None):
    """The parsed arguments, with `suites` (a list), `shapes` and `grouped_shapes` (lists of
    tuples, or None) checked: a bad value exits with a usage error naming it."""
    from .sweep_suite import parse_shapes

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.shapes = parse_shapes(args.shapes, 3, "--shapes") if args.shapes is not None else None
        args.grouped_shapes = (parse_shapes(args.grouped_shapes, 4, "--grouped-shapes")
                               if args.grouped_shapes is not None else None)
    except ValueError as e:
        parser.error(str(e))
    custom = args.shapes is not None or args.grouped_shapes is not None
    if args.suites is None:
        suites = ["sweep"] if custom else list(SUITES)
    else:
        suites = [s.strip() for s in args.suites.split(",") if s.strip()]
        unknown = set(suites) - set(SUITES)
        if unknown:
            parser.error(f"unknown suites {sorted(unknown)}; choose from {SUITES}")
        if custom and "sweep" not in suites:
            suites.append("sweep")
    args.suites = suites
    return args


def main(argv=None) -> None:
    # `kill -USR1 <pid>` (or `timeout -s USR1`) prints every thread's stack: where a run stalls.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    args = parse_args(argv)
    suites = args.suites

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
    if "gemm_fp8_block" in suites:
        from . import gemm_suite

        summary.update(gemm_suite.run(args.out, args.quick, (gemm_suite.BLOCK_VARIANT,)))
    if "grouped" in suites:
        from . import grouped_suite

        summary.update(grouped_suite.run(args.out, args.quick))
        if args.tune:
            grouped_suite.tune(args.out, args.quick)
    if "grouped_fp8" in suites:
        from . import grouped_fp8_suite

        summary.update(grouped_fp8_suite.run(args.out, args.quick))
    if "moe" in suites:
        from . import moe_suite

        summary.update(moe_suite.run(args.out, args.quick))
    if "moe_layer" in suites:
        from . import moe_layer_suite

        summary.update(moe_layer_suite.run(args.out, args.quick))
    if "host" in suites:
        from . import host_suite

        summary.update(host_suite.run(args.out, args.quick))
    if "sweep" in suites:
        from . import sweep_suite

        summary.update(sweep_suite.run(args.out, args.quick, args.shapes, args.grouped_shapes))
    for suite, extra in (("tp", ()), ("tp_fp8", ("--dtype", "fp8"))):
        if suite not in suites:
            continue
        if gpus < 2:
            print(f"\n== {suite} suite skipped: it needs 2 or more GPUs")
        else:
            summary[suite] = run_tp_suite(gpus, args.out, args.quick, extra)
    print("\n== summary (geomean of peer time / distgemm time)")
    for name, value in summary.items():
        print(f"  {name}: {value}")


if __name__ == "__main__":
    main()

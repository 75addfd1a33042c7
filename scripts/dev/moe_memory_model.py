"""Peak memory of one expert-MLP training step, modelled on the CPU (tests/memory_model.py: meta
tensors with the sm_90 dispatch), for the moe suite's rows: ours (bf16, FP8 block and row, and
block with save_original_input) against torch's bf16 layer, and what is alive at each peak;
with --layer, the moe_layer suite's whole layer (MoEExperts against the torch-ops layer).

    python scripts/dev/moe_memory_model.py [--detail] [--layer]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from distgemm.bench.moe_suite import LAYERS, TOKENS  # noqa: E402
from distgemm.bench.moe_layer_suite import CASES  # noqa: E402
from tests.memory_model import expert_mlp_peak, moe_layer_peak  # noqa: E402

MIB = 2 ** 20
VARIANTS = (("bf16", dict(fp8=None)), ("block", dict(fp8="block")),
            ("block, save_original_input", dict(fp8="block", save_original_input=True)), ("row", dict(fp8="row")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--detail", action="store_true", help="list what is alive at each peak")
    parser.add_argument("--layer", action="store_true", help="the moe_layer suite's whole layer instead")
    args = parser.parse_args()
    if args.layer:
        for case in CASES:
            torch_peak, torch_live = moe_layer_peak("torch", *case)
            cols, details = [f"torch ops bf16 {torch_peak / MIB:.0f} MiB"], [("torch ops bf16", torch_live)]
            for name, fp8 in (("bf16", None), ("block", "block")):
                peak, live = moe_layer_peak("ours", *case, fp8=fp8)
                cols.append(f"{name} {peak / MIB:.0f} MiB ({peak / torch_peak:.2f}x)")
                details.append((name, live))
            print("{} experts top-{} H{} F{} {} tokens: ".format(*case) + "; ".join(cols))
            if args.detail:
                _print_details(details)
        return
    for activation in ("swiglu", "gelu"):
        for experts, hidden, ffn in LAYERS:
            torch_peak, torch_live = expert_mlp_peak("torch", experts, hidden, ffn, TOKENS, activation)
            cols = [f"torch bf16 {torch_peak / MIB:.0f} MiB"]
            details = [("torch bf16", torch_live)]
            for name, kwargs in VARIANTS:
                peak, live = expert_mlp_peak("ours", experts, hidden, ffn, TOKENS, activation, **kwargs)
                cols.append(f"{name} {peak / MIB:.0f} MiB ({peak / torch_peak:.2f}x)")
                details.append((name, live))
            print(f"{activation} {experts}x{TOKENS // experts} H{hidden} F{ffn}: " + "; ".join(cols))
            if args.detail:
                _print_details(details)


def _print_details(details) -> None:
    for name, live in details:
        print(f"  at {name}'s peak:")
        for n, what in live[:10]:
            print(f"    {n / MIB:8.1f} MiB  {what}")


if __name__ == "__main__":
    main()

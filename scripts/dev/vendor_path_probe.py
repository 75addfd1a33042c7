"""Probe: FP8 ``distgemm.gemm`` (per tensor, row-wise, 128-block scales, as the README documents
them) against the vendor call a user would make instead (torch._scaled_mm; F.scaled_mm with its
scales prepared once), device time, same inputs, interleaved; with the backend ours ran. The rows
are shapes off the suites' lists (LLM projections), the dispatch's vendor path in particular.

    PROBE_OUT=out.json python scripts/dev/vendor_path_probe.py
"""

import json
import os

import torch

import distgemm
from distgemm import autotune
from distgemm.bench.common import Timer, env_info, geomean
from distgemm.bench.gemm_suite import _block_fns, _inputs

SHAPES = [(12288, 5120, 5120), (16384, 1536, 7168), (640, 18944, 3584), (3000, 7168, 2304), (8192, 3584, 18944),
          (1536, 12288, 4096), (24576, 2048, 6144)]


def main() -> None:
    timer = Timer()
    rows = []
    for m, n, k in SHAPES:
        for scaling in ("tensor", "row", "block"):
            a, b, sa, sb = _inputs(m, n, k, True, scaling)
            if scaling == "block":
                fns = _block_fns(a, b, sa, sb)
                fns.pop("kernel")
            else:
                ours_sa, ours_sb = (sa.reshape(-1), sb.reshape(-1)) if scaling == "row" else (sa, sb)
                bt = b.t()
                fns = {"ours": lambda a=a, b=b, x=ours_sa, y=ours_sb: distgemm.gemm(a, b, scale_a=x, scale_b=y),
                       "peer": lambda a=a, bt=bt, x=sa, y=sb: torch._scaled_mm(a, bt, x, y, out_dtype=torch.bfloat16)}
            fns["ours"]()
            backend = autotune.last_backend()
            t = timer.compare(fns)
            flops = 2.0 * m * n * k
            row = {"m": m, "n": n, "k": k, "scaling": scaling, "backend": backend, "ours_ms": t["ours"],
                   "peer_ms": t["peer"], "ratio": round(t["peer"] / t["ours"], 4),
                   "ours_tflops": round(flops / t["ours"] / 1e9, 1)}
            rows.append(row)
            print(f"{scaling:6s} {m}x{n}x{k}: ours {t['ours']:.3f} ms ({row['ours_tflops']} TFLOP/s, {backend}) "
                  f"peer {t['peer']:.3f} ms  peer/ours {row['ratio']:.3f}x", flush=True)
    summary = {s: round(geomean([r["ratio"] for r in rows if r["scaling"] == s]), 4) for s in ("tensor", "row", "block")}
    summary["worst"] = min(r["ratio"] for r in rows)
    print("geomean peer time / ours:", summary)
    out = os.environ.get("PROBE_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"env": env_info(), "rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()

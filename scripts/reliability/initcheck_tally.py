"""compute-sanitizer initcheck reports tallied by the kernel that made them, distgemm's own
kernels apart from the rest (cuBLAS, NCCL, PyTorch), so that each kind can be shown benign or
fixed rather than dismissed by count.

  python scripts/reliability/initcheck_tally.py LOG [LOG ...] [--out tally.json]

A report is a block that starts with "Uninitialized __global__ memory read" and names its
kernel in an "at ..." line. Kernels are grouped by name without their template arguments and
parameters (the full name of the first report of each group is kept as an example)."""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

REPORT = re.compile(r"=+\s+Uninitialized __global__ memory read of size (\d+) bytes")
AT = re.compile(r"=+\s+at (.*)$")


def kernel_of(location: str) -> str:
    """The kernel's name in an "at" line: '0x1a0 in NAME', 'NAME+0x1a0' or 'NAME'."""
    text = location.strip()
    match = re.match(r"0x[0-9a-fA-F]+ in (.*)$", text)
    if match:
        text = match.group(1)
    return re.sub(r"\+0x[0-9a-fA-F]+$", "", text).strip()


def short_name(kernel: str) -> str:
    """The name without template arguments and parameters: 'void ns::k<...>(...)' -> 'ns::k'."""
    name = kernel[5:] if kernel.startswith("void ") else kernel
    name = name.replace("(anonymous namespace)", "{anonymous}")
    depth, out = 0, []
    for ch in name:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out).strip() or kernel[:80]


def tally(lines) -> dict:
    counts = collections.Counter()
    sizes = collections.defaultdict(collections.Counter)
    example = {}
    pending = None
    for line in lines:
        report = REPORT.search(line)
        if report:
            pending = int(report.group(1))
            continue
        at = AT.search(line)
        if at and pending is not None:
            kernel = kernel_of(at.group(1))
            key = short_name(kernel)
            counts[key] += 1
            sizes[key][pending] += 1
            example.setdefault(key, kernel[:400])
            pending = None
    ours = {k: v for k, v in counts.items() if "distgemm" in example[k]}
    return {"reports": sum(counts.values()),
            "distgemm_reports": sum(ours.values()),
            "by_kernel": [{"kernel": k, "reports": v, "distgemm": k in ours, "read_sizes": dict(sizes[k]),
                           "example": example[k]} for k, v in counts.most_common()]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--out")
    args = ap.parse_args()
    lines = []
    for path in args.logs:
        with open(path, errors="replace") as f:
            lines.extend(f)
    result = tally(lines)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(json.dumps({"reports": result["reports"], "distgemm_reports": result["distgemm_reports"],
                      "kernels": [(r["kernel"], r["reports"]) for r in result["by_kernel"][:20]]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

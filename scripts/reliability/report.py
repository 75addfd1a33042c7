"""Collects the reliability run's pieces into one JSON (default bench/results/h200x2_reliability.json):

  python scripts/reliability/report.py --dir OUT [--out PATH]

reads OUT/fuzz_report.jsonl (DISTGEMM_FUZZ_REPORT lines of tests/gpu/test_fuzz_gpu.py and
tests/multigpu/test_tp_fuzz.py), OUT/fault_report.jsonl (DISTGEMM_FAULT_REPORT lines of
tests/multigpu/test_tp_faults.py), OUT/sanitizer/sanitizer_summary.json and OUT/soak.json
(each path overridable), and writes

  {"env": {gpu, torch, cuda, commit, ...}, "fuzz_cases": N, "mismatches": 0, "canary_hits": 0,
   "sanitizer_errors": 0, "fault_cases": [{"name", "outcome", "seconds"}], "hangs": 0,
   "soak": {"calls", "device_mem_growth_bytes", "rss_growth_bytes", "fd_growth"}}

plus detail keys: "fuzz" (the per-op lines), "fault_failures", "sanitizer" (per tool),
"soak_detail", "missing" (inputs that were not there) and "complete". Counts that could
not be established are null (a sanitizer that did not finish, a missing soak), never 0.
Exits 1 when something failed or is missing, 0 when all is clean.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _lines(path):
    if not os.path.exists(path):
        return None
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    out.append({"unparsable": line[:200]})
    return out


def _json(path):
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        return {"unparsable": str(e)}


def _run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=REPO).stdout.strip()
    except Exception:
        return ""


def environment() -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.node(), "python": platform.python_version(),
           "commit": _run(["git", "rev-parse", "HEAD"]),
           "dirty": bool(_run(["git", "status", "--porcelain", "--untracked-files=no"]))}
    try:
        import torch

        env.update(torch=torch.__version__, cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version()))
                   if torch.cuda.is_available() else None)
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["gpus"] = torch.cuda.device_count()
    except Exception as e:  # torch missing or broken: say so, keep going
        env["torch_error"] = str(e)[:200]
    try:
        import distgemm

        env["distgemm"] = getattr(distgemm, "__version__", None)
    except Exception as e:
        env["distgemm_error"] = str(e)[:200]
    try:
        import hypothesis

        env["hypothesis"] = hypothesis.__version__
    except Exception:
        pass
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    if smi:
        env["nvidia_smi"] = smi.splitlines()
        env.setdefault("gpu", smi.splitlines()[0].split(",")[0].strip())
    return env


def build(args) -> dict:
    missing = []
    fuzz = _lines(args.fuzz)
    if fuzz is None:
        missing.append(args.fuzz)
        fuzz = []
    faults = _lines(args.faults)
    if faults is None:
        missing.append(args.faults)
        faults = []
    sanitizer = _json(args.sanitizer)
    if sanitizer is None:
        missing.append(args.sanitizer)
    soak = _json(args.soak)
    if soak is None:
        missing.append(args.soak)

    def total(key):
        return sum(int(line.get(key) or 0) for line in fuzz)

    san_errors, san_complete = None, False
    if isinstance(sanitizer, dict) and "unparsable" not in sanitizer:
        counts = [t.get("errors") for t in sanitizer.values() if isinstance(t, dict)]
        san_complete = bool(counts) and all(t.get("complete") for t in sanitizer.values() if isinstance(t, dict))
        known = [c for c in counts if c is not None]
        san_errors = sum(known) if (san_complete or any(known)) else None
    soak_keys = ("calls", "device_mem_growth_bytes", "rss_growth_bytes", "fd_growth")
    soak_summary = {k: soak.get(k) for k in soak_keys} if isinstance(soak, dict) else None
    fault_cases = [{"name": c.get("name"), "outcome": c.get("outcome"), "seconds": c.get("seconds")} for c in faults]
    report = {
        "env": environment(),
        "fuzz_cases": total("cases") if fuzz else None,
        "mismatches": total("mismatches") if fuzz else None,
        "canary_hits": total("canary_hits") if fuzz else None,
        "sanitizer_errors": san_errors,
        "fault_cases": fault_cases,
        "hangs": sum(1 for c in faults if c.get("hang")) if faults else None,
        "soak": soak_summary,
        # details
        "fuzz": fuzz,
        "fault_failures": [c for c in faults if not c.get("ok", True)],
        "sanitizer": sanitizer,
        "sanitizer_complete": san_complete,
        "soak_detail": ({k: soak.get(k) for k in ("cache_growth", "cache_sizes_start", "cache_sizes_end", "ops",
                                                  "time_capped", "seconds", "world")}
                        if isinstance(soak, dict) else None),
        "missing": missing,
    }
    clean = (not missing and report["mismatches"] == 0 and report["canary_hits"] == 0 and san_errors == 0
             and san_complete and report["hangs"] == 0 and not report["fault_failures"]
             and not any(line.get("fatal") for line in fuzz))
    report["complete"] = not missing and san_complete
    report["clean"] = clean
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="reliability_out", help="the folder run_all.sh wrote")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "h200x2_reliability.json"))
    ap.add_argument("--fuzz", help="default: DIR/fuzz_report.jsonl")
    ap.add_argument("--faults", help="default: DIR/fault_report.jsonl")
    ap.add_argument("--sanitizer", help="default: DIR/sanitizer/sanitizer_summary.json")
    ap.add_argument("--soak", help="default: DIR/soak.json")
    args = ap.parse_args()
    args.fuzz = args.fuzz or os.path.join(args.dir, "fuzz_report.jsonl")
    args.faults = args.faults or os.path.join(args.dir, "fault_report.jsonl")
    args.sanitizer = args.sanitizer or os.path.join(args.dir, "sanitizer", "sanitizer_summary.json")
    args.soak = args.soak or os.path.join(args.dir, "soak.json")
    report = build(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    head = {k: report[k] for k in ("fuzz_cases", "mismatches", "canary_hits", "sanitizer_errors", "hangs", "soak",
                                   "complete", "clean")}
    head["fault_cases"] = f"{len(report['fault_cases'])} ({len(report['fault_failures'])} failed)"
    print(json.dumps(head))
    if report["missing"]:
        print("missing inputs: " + ", ".join(report["missing"]), file=sys.stderr)
    print(f"wrote {args.out}")
    return 0 if report["clean"] else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck, synccheck and initcheck over every kernel family
# (scripts/reliability/sanitizer_driver.py: dense bf16/fp16/fp8 GEMMs, grouped forward / dgrad /
# wgrad, and the TP ops with both algorithms at 2 ranks incl. a graph replay after workspace
# growth), at tiny shapes.
#   bash scripts/reliability/sanitizer.sh OUT
# Leaves in OUT: <tool>_<part>.log (the driver's output), <tool>_<part>.<pid>.sanitizer.log (one
# per process: --target-processes all follows the spawned ranks) and sanitizer_summary.json:
#   {"memcheck": {"errors": N, "exit": rc, "complete": bool, "parts": {"single": {...}, "tp": {...}}}, ...}
# "errors" sums the "ERROR SUMMARY: N errors" lines of every process; null when a part left no
# summary (timed out, crashed, or the sanitizer could not attach: it refuses the GPU on gVisor
# machines, 'Device not supported'). "exit" is the worst exit code of the parts (124: timeout).
#
# Flags: --error-exitcode 1 --target-processes all --print-limit 100 (initcheck: below); memcheck with
# --leak-check no (the caching allocators keep memory until exit) and --report-api-errors no
# (NCCL and torch probe CUDA APIs that fail on purpose); memcheck and initcheck run with
# PYTORCH_NO_CUDA_MEMORY_CACHING=1, so that every tensor is its own allocation and an access
# past one is seen. SANITIZER_EXTRA_<TOOL> adds flags to a tool (e.g. SANITIZER_EXTRA_INITCHECK=
# "--kernel-name-exclude kns=nccl").
#
# initcheck: the driver fills every tensor torch allocates before its first use
# (--fill-uninitialized; SANITIZER_INITCHECK_FILLED=0 turns it off), because initcheck does not
# count TMA stores as writes: without the fill, every read of a GEMM's output is a report
# (262,144 for one 512 x 512 torch.mm, scripts/dev/initcheck_probe.py). Its reports are printed
# up to SANITIZER_INITCHECK_LIMIT (default 1,000,000) and tallied by kernel, distgemm's own
# apart, into initcheck_tally.json (scripts/reliability/initcheck_tally.py).
#
# Time (H200 x2, estimates: instrumenting the first launch of each CUTLASS kernel dominates):
# the four single-GPU parts run at once (two per GPU), <= SANITIZER_SINGLE_S (default 100 s);
# then the TP parts two at a time on both GPUs, <= SANITIZER_TP_S (default 55 s) each pair:
# ~3.5 min at most, ~2-3 min expected. SANITIZER_ALL_CONFIGS=memcheck (default) runs every
# compiled tile configuration under memcheck ("all": every tool; "none": the heuristic's only).
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
out="$(mkdir -p "${1:-sanitizer_out}" && cd "${1:-sanitizer_out}" && pwd)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export DISTGEMM_TIMEOUT_S="${DISTGEMM_TIMEOUT_S:-120}"
cd "$repo" || exit 1
single_s="${SANITIZER_SINGLE_S:-100}"
tp_s="${SANITIZER_TP_S:-55}"
all_configs="${SANITIZER_ALL_CONFIGS:-memcheck}"
tools=(memcheck racecheck synccheck initcheck)
only="${SANITIZER_TOOLS:-${tools[*]}}"  # a subset, e.g. SANITIZER_TOOLS=initcheck
want() { [[ " $only " == *" $1 "* ]]; }

san="$(command -v compute-sanitizer || true)"
for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
         /opt/nvidia/compute-sanitizer/compute-sanitizer; do
  [ -z "$san" ] && [ -x "$c" ] && san="$c"
done

tool_flags() {
  case "$1" in
    memcheck) echo "--tool memcheck --leak-check no --report-api-errors no ${SANITIZER_EXTRA_MEMCHECK:-}" ;;
    racecheck) echo "--tool racecheck --racecheck-report all ${SANITIZER_EXTRA_RACECHECK:-}" ;;
    synccheck) echo "--tool synccheck ${SANITIZER_EXTRA_SYNCCHECK:-}" ;;
    initcheck) echo "--tool initcheck ${SANITIZER_EXTRA_INITCHECK:-}" ;;
  esac
}

# run TOOL PART SECONDS [GPU]: one sanitized run of the driver; its exit code and time to files
run() {
  local tool="$1" part="$2" secs="$3" gpu="${4:-}" extra=() start rc
  if [ "$part" = single ] && { [ "$all_configs" = all ] || [ "$all_configs" = "$tool" ]; }; then
    extra=(--all-configs)
  fi
  local limit=100
  if [ "$tool" = initcheck ]; then
    limit="${SANITIZER_INITCHECK_LIMIT:-1000000}"
    [ "$part" = single ] && [ "${SANITIZER_INITCHECK_FILLED:-1}" = 1 ] && extra+=(--fill-uninitialized)
  fi
  rm -f "$out/${tool}_${part}".*.sanitizer.log
  start=$(date +%s)
  (
    [ -n "$gpu" ] && export CUDA_VISIBLE_DEVICES="$gpu"
    # Uncached allocations let memcheck/initcheck see an access past a tensor; the TP part captures
    # CUDA graphs, which the uncached allocator refuses (captures_underway assert), so it keeps the cache.
    if [ "$part" = single ] && { [ "$tool" = memcheck ] || [ "$tool" = initcheck ]; }; then
      export PYTORCH_NO_CUDA_MEMORY_CACHING=1
    fi
    # shellcheck disable=SC2046
    timeout -k 10 "$secs" "$san" $(tool_flags "$tool") --error-exitcode 1 --target-processes all \
      --print-limit "$limit" --log-file "$out/${tool}_${part}.%p.sanitizer.log" \
      python3 scripts/reliability/sanitizer_driver.py "$part" ${extra[@]+"${extra[@]}"}
  ) > "$out/${tool}_${part}.log" 2>&1
  rc=$?
  echo "$rc $(( $(date +%s) - start ))" > "$out/${tool}_${part}.rc"
  echo "sanitizer: $tool $part exit $rc after $(( $(date +%s) - start )) s"
}

if [ -z "$san" ]; then
  echo "compute-sanitizer not found" | tee "$out/sanitizer_missing.txt"
  for t in "${tools[@]}"; do for p in single tp; do echo "127 0" > "$out/${t}_${p}.rc"; done; done
else
  "$san" --version > "$out/sanitizer_version.txt" 2>&1
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  second=$(( gpus > 1 ? 1 : 0 ))
  # single-GPU parts: all four at once, two per GPU (all on GPU 0 where there is one)
  want memcheck && run memcheck single "$single_s" 0 &
  want racecheck && run racecheck single "$single_s" "$second" &
  want synccheck && run synccheck single "$single_s" 0 &
  want initcheck && run initcheck single "$single_s" "$second" &
  wait
  if [ "$gpus" -ge 2 ]; then
    # TP parts: two tools at a time, each on both GPUs
    run memcheck tp "$tp_s" & run synccheck tp "$tp_s" & wait
    run racecheck tp "$tp_s" & run initcheck tp "$tp_s" & wait
  else
    echo "sanitizer: the TP parts need two GPUs; not run" | tee "$out/tp_not_run.txt"
  fi
fi

if ls "$out"/initcheck_*.sanitizer.log > /dev/null 2>&1; then
  python3 "$repo/scripts/reliability/initcheck_tally.py" "$out"/initcheck_*.sanitizer.log \
    --out "$out/initcheck_tally.json" > "$out/initcheck_tally.txt" 2>&1
fi

python3 - "$out" <<'EOF'
import glob, json, os, re, sys

out = sys.argv[1]
summary = {}
for tool in ("memcheck", "racecheck", "synccheck", "initcheck"):
    parts, errors, worst, complete = {}, None, 0, True
    for part in ("single", "tp"):
        rc_file = os.path.join(out, f"{tool}_{part}.rc")
        if not os.path.exists(rc_file):  # not run (the TP part on one GPU): neither an error nor a pass
            parts[part] = {"errors": None, "exit": None, "note": "not run"}
            complete = False
            continue
        rc, secs = (open(rc_file).read().split() + ["-1", "0"])[:2]
        rc, secs = int(rc), int(secs)
        logs = sorted(glob.glob(os.path.join(out, f"{tool}_{part}.*.sanitizer.log")))
        text = "".join(open(f, errors="replace").read() for f in logs)
        driver = os.path.join(out, f"{tool}_{part}.log")
        driver_text = open(driver, errors="replace").read() if os.path.exists(driver) else ""
        # one "ERROR SUMMARY: N errors" line per process (not the "N errors were not printed" one);
        # racecheck says "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)"
        counts = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) errors?\s*$", text + driver_text, re.M)]
        if not counts:
            counts = [int(n) for n in re.findall(r"RACECHECK SUMMARY: \d+ hazards displayed \((\d+) errors", text)]
        n = sum(counts) if counts else None
        note = ""
        if "Device not supported" in text + driver_text:
            note = "the sanitizer does not support this device or runtime"
        elif rc == 124 or rc == 137:
            note = "timed out"
        elif rc == 127:
            note = "compute-sanitizer not found"
        failed_checks = re.search(r"sanitizer driver \(\w+\): (\d+) failed checks", driver_text)
        parts[part] = {"errors": n, "exit": rc, "seconds": secs, "processes": len(counts),
                       "driver_failed_checks": int(failed_checks.group(1)) if failed_checks else None,
                       "note": note, "log": os.path.basename(driver)}
        complete &= n is not None and rc not in (124, 137, 127, -1) and failed_checks is not None
        if n is not None:
            errors = (errors or 0) + n
        worst = rc if rc != 0 and (worst == 0 or rc > worst) else worst
    # errors: the sum over the parts that left a summary (None when none did); complete: every
    # part ran to its end (false on one GPU, where the TP part is not run).
    summary[tool] = {"errors": errors, "exit": worst, "complete": complete, "parts": parts}
with open(os.path.join(out, "sanitizer_summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
print(json.dumps({t: {k: v[k] for k in ("errors", "exit", "complete")} for t, v in summary.items()}))
EOF

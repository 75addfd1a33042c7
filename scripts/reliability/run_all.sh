#!/usr/bin/env bash
# The whole reliability run on an H200 x2 machine, in one command, bounded in time:
#   bash scripts/reliability/run_all.sh OUT
# (the package installed first; logs, report lines and JSON land in OUT, the summary in
# bench/results/h200x2_reliability.json, or RELIABILITY_REPORT=path).
#
# Stages, in order, each under `timeout`, all of them under one budget (RELIABILITY_BUDGET_S,
# default 540 s: a stage gets at most what is left, less 20 s kept for the report):
#   1. single-GPU fuzz, DISTGEMM_FUZZ_EXAMPLES=2000 per op: gemm (GPU 0), grouped_mm (GPU 1) and
#      grouped_mm_wgrad (GPU 0) as three pytest processes at once; each op stops at
#      DISTGEMM_FUZZ_TIME_S=85 if slower than expected and says so in its report line.
#      Estimate: ~10-40 ms a case, so ~30-85 s, plus ~15 s start-up.           <= 120 s
#   2. TP fuzz at 2 ranks, DISTGEMM_FUZZ_EXAMPLES=2000, loop capped at 50 s
#      (~20-40 ms a case: ~1300-2000 cases).  Estimate ~65 s.                  <= 95 s
#   3. TP fault injection: 6 spawns of 2 ranks (~8 s start-up each), DISTGEMM_TIMEOUT_S=3.
#      Estimate ~90-120 s (one that hangs costs its spawn's deadline).         <= 150 s
#   4. soak under torchrun (2 ranks): 10,000 calls of each of the 5 ops, --max-seconds 45.
#      Estimate ~40-55 s incl. start-up.                                        <= 75 s
#   5. compute-sanitizer memcheck / racecheck / synccheck / initcheck (sanitizer.sh).
#      Estimate ~2-3 min.                                                       <= 180 s
#   6. report.py                                                                 <= 15 s
# Expected total ~7-8 min; never more than the budget plus the report (~9.3 min).
# Exit code: report.py's (0 when every count is clean and every input is there).
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
out="$(mkdir -p "${1:-reliability_out}" && cd "${1:-reliability_out}" && pwd)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cd "$repo" || exit 1
budget="${RELIABILITY_BUDGET_S:-540}"
t0=$(date +%s)
: > "$out/stages.txt"
rm -f "$out/fuzz_report.jsonl" "$out/fault_report.jsonl" "$out/soak.json"
export DISTGEMM_FUZZ_REPORT="$out/fuzz_report.jsonl" DISTGEMM_FAULT_REPORT="$out/fault_report.jsonl"

left() { echo $(( budget - 20 - ($(date +%s) - t0) )); }
cap() {  # cap SECONDS: SECONDS, or what the budget has left if less (at least 5)
  local l; l=$(left)
  [ "$l" -lt "$1" ] && { [ "$l" -lt 5 ] && echo 5 || echo "$l"; } || echo "$1"
}
stage() {  # stage NAME SECONDS CMD...: the command under timeout, output to OUT/NAME.log
  local name="$1" secs s rc; secs=$(cap "$2"); shift 2
  s=$(date +%s)
  timeout -k 10 "$secs" "$@" > "$out/$name.log" 2>&1
  rc=$?
  echo "$name: exit $rc in $(( $(date +%s) - s )) s (limit $secs s)" | tee -a "$out/stages.txt"
  return $rc
}
pytest_q=(python3 -m pytest -q -rs -p no:cacheprovider)

nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv > "$out/gpu.txt" 2>&1
if ! python3 -c "import distgemm, hypothesis" > "$out/import.log" 2>&1; then
  echo "distgemm or hypothesis does not import: see $out/import.log" | tee -a "$out/stages.txt"
fi

# 1. single-GPU fuzz, three ops at once
secs=$(cap 60)  # 12-23 s measured for 2000 cases each
(
  export DISTGEMM_FUZZ_EXAMPLES=2000 DISTGEMM_FUZZ_TIME_S="${FUZZ_TIME_S:-85}"
  CUDA_VISIBLE_DEVICES=0 stage fuzz_gemm "$secs" "${pytest_q[@]}" tests/gpu/test_fuzz_gpu.py::test_gemm_fuzz &
  CUDA_VISIBLE_DEVICES=1 stage fuzz_grouped_mm "$secs" "${pytest_q[@]}" tests/gpu/test_fuzz_gpu.py::test_grouped_mm_fuzz &
  CUDA_VISIBLE_DEVICES=0 stage fuzz_grouped_mm_wgrad "$secs" "${pytest_q[@]}" \
    tests/gpu/test_fuzz_gpu.py::test_grouped_mm_wgrad_fuzz &
  wait
)

# 2. tensor-parallel fuzz
# 6000 cases over the three TP ops (>= 2000 each): ~60 s measured for 2000 on the H200 x2.
DISTGEMM_FUZZ_EXAMPLES="${TP_FUZZ_EXAMPLES:-6000}" DISTGEMM_FUZZ_TIME_S="${TP_FUZZ_TIME_S:-110}" \
  stage fuzz_tp 130 "${pytest_q[@]}" tests/multigpu/test_tp_fuzz.py

# 3. fault injection
stage faults 110 "${pytest_q[@]}" tests/multigpu/test_tp_faults.py  # 76 s measured

# 4. soak (2 ranks: every op)
stage soak 75 torchrun --standalone --nproc-per-node 2 scripts/reliability/soak.py --out "$out/soak.json" \
  --calls 10000 --max-seconds 45

# 5. compute-sanitizer: what is left, less the report's share (parts: 45% single, 2 x 25% TP)
san=$(cap 240)  # initcheck needed more than 70 s (single) and 40 s (TP) on the H200
SANITIZER_SINGLE_S=$(( san * 45 / 100 )) SANITIZER_TP_S=$(( san * 25 / 100 )) \
  stage sanitizer "$san" bash scripts/reliability/sanitizer.sh "$out/sanitizer"

# 6. the summary
s=$(date +%s)
timeout 15 python3 scripts/reliability/report.py --dir "$out" \
  --out "${RELIABILITY_REPORT:-$repo/bench/results/h200x2_reliability.json}" 2>&1 | tee "$out/report.log"
rc=${PIPESTATUS[0]}
echo "report: exit $rc in $(( $(date +%s) - s )) s; total $(( $(date +%s) - t0 )) s" | tee -a "$out/stages.txt"
exit "$rc"

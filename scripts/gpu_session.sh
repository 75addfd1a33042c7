#!/usr/bin/env bash
# Developer helper for the device machine: build (or install a carried wheel), then run the
# steps named in $STEPS, logs under $OUT. Not part of the package.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CUTLASS_DIR="${CUTLASS_DIR:-$PWD/.cutlass}" GTEST_SOURCE_DIR="${GTEST_SOURCE_DIR:-$PWD/.googletest}" DISTGEMM_CUDA_ARCHS=90a CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/steps.log" /tmp/steps.log >/dev/null; echo "[$(( $(date +%s) - t0 )) s] $*"; }
if python3 -c "import distgemm" 2>/dev/null && [ -z "${REBUILD:-}" ]; then
  stamp "distgemm already installed"
elif ls .whl/distgemm-*.whl >/dev/null 2>&1 && [ -z "${REBUILD:-}" ]; then
  python3 -m pip install -q --no-deps --no-index --force-reinstall .whl/distgemm-*.whl; stamp "carried wheel installed"
else
  rm -rf /tmp/wh; ( time python3 -m pip wheel --no-build-isolation --no-deps -w /tmp/wh -v . ) > "$OUT/build.log" 2>&1 \
    || { tail -60 "$OUT/build.log"; exit 1; }
  python3 -m pip install -q --no-deps --force-reinstall /tmp/wh/distgemm-*.whl
  cp /tmp/wh/distgemm-*.whl "$OUT/" ; ls -la /tmp/wh; stamp "built"
fi
# A step's timeout kills its direct child only: a compute-sanitizer or pytest child left running
# time-slices the GPU with every later step (the bench stalls it caused). Log and end them.
# nvidia-smi lists no processes inside the device machine's container (its gpu_apps.log stayed
# empty): log the process table too, and end orphaned test processes (parent 1, a
# pytest or multiprocessing command line: a previous step's children outliving it).
reap() {
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader >> "$OUT/gpu_apps.log" 2>&1
  { echo "== before step $step"; ps -eo pid,ppid,stat,etime,pcpu,rss,args --sort=-pcpu | head -15; } >> "$OUT/gpu_apps.log" 2>&1
  # Never this script's own ancestors: the command that started it may name python and tests/.
  local ancestors=" $$ " p=$$
  while [ "$p" -gt 1 ] 2>/dev/null; do p=$(ps -o ppid= -p "$p" | tr -d ' '); ancestors+="$p "; done
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null) \
             $(ps -eo pid=,ppid=,args= | awk '$2 == 1 && /python/ && /pytest|multiprocessing|tests\// {print $1}'); do
    [[ "$ancestors" != *" $pid "* ]] && kill -9 "$pid" 2>/dev/null && stamp "reaped stray process $pid"
  done
}
for step in ${STEPS:-}; do
  # step@S: this step's own time limit (S seconds) in place of T / TB
  T_ALL="${T:-}" TB_ALL="${TB:-}"
  if [[ "$step" == *@* ]]; then T="${step##*@}" TB="${step##*@}"; step="${step%@*}"; fi
  reap
  case "$step" in
    segv1) timeout 120 cuda-gdb -batch -ex run -ex bt --args python3 -c "import torch, distgemm; print(torch.ops.distgemm.gemm_select_config(64, 64, 64, torch.bfloat16, torch.bfloat16, torch.bfloat16, True, 80, 108))" > "$OUT/segv1.log" 2>&1 ;;
    cpu|gpu|multigpu) timeout "${T:-400}" python3 -m pytest -q -ra -p no:cacheprovider "tests/$step" > "$OUT/tests_$step.log" 2>&1; tail -5 "$OUT/tests_$step.log" ;;
    all) timeout "${T:-540}" python3 -m pytest -q -ra -p no:cacheprovider > "$OUT/tests_all.log" 2>&1; tail -8 "$OUT/tests_all.log" ;;
    pytest:*) f="${step#pytest:}"; log="$OUT/tests_$(basename "${f%%.py*}").log"
      timeout "${T:-400}" python3 -m pytest -q -ra -p no:cacheprovider "$f" > "$log" 2>&1; tail -15 "$log" ;;
    bench:*) s="${step#bench:}"; CUDA_MODULE_LOADING=EAGER timeout -s USR1 -k 15 "${TB:-300}" python3 -m distgemm.bench --suites "$s" ${BENCH_ARGS:-} \
      --out "$OUT/results" > "$OUT/bench_${s//,/_}.log" 2>&1; grep -v "^tune" "$OUT/bench_${s//,/_}.log" | tail -40 ;;
    tune:*) s="${step#tune:}"; timeout -s USR1 -k 15 "${TB:-300}" python3 -m distgemm.bench --suites "$s" --tune \
      --out "$OUT/results" > "$OUT/tune_${s//,/_}.log" 2>&1; tail -5 "$OUT/tune_${s//,/_}.log" ;;
    fuzz) # the single-GPU fuzz on GPU 0 (scripts/reliability/run_all.sh runs it on two): every op with
      # the grouped tile choice of the cost model (DISTGEMM_AUTOTUNE=0: 2000 cases fit the time),
      # and the grouped ops again with autotuning (each new problem timed first; fewer cases)
      for run in gemm:1 grouped_mm:0 grouped_mm_wgrad:0 grouped_mm:1 grouped_mm_wgrad:1; do
        t="${run%%:*}"; tune="${run##*:}"
        DISTGEMM_AUTOTUNE="$tune" DISTGEMM_FUZZ_EXAMPLES="${FUZZ_EXAMPLES:-2000}" DISTGEMM_FUZZ_TIME_S="${FUZZ_TIME_S:-170}" \
          DISTGEMM_FUZZ_REPORT="$OUT/fuzz_report_autotune$tune.jsonl" timeout "${T:-240}" python3 -m pytest -q -rs \
          -p no:cacheprovider "tests/gpu/test_fuzz_gpu.py::test_${t}_fuzz" > "$OUT/fuzz_${t}_autotune$tune.log" 2>&1 &
      done; wait; tail -n 3 "$OUT"/fuzz_*.log ;;
    fuzz8) # the FP8 grouped ops' fuzz (forward/dgrad, wgrad), as users run them (autotuning on), in parallel
      for t in grouped_mm_fp8 grouped_mm_wgrad_fp8; do
        DISTGEMM_FUZZ_EXAMPLES="${FUZZ_EXAMPLES:-2000}" DISTGEMM_FUZZ_TIME_S="${FUZZ_TIME_S:-170}" \
          DISTGEMM_FUZZ_REPORT="$OUT/fuzz_report_fp8.jsonl" timeout "${T:-240}" python3 -m pytest -q -rs \
          -p no:cacheprovider "tests/gpu/test_fuzz_gpu.py::test_${t}_fuzz" > "$OUT/fuzz_${t}.log" 2>&1 &
      done; wait; tail -n 25 "$OUT"/fuzz_grouped_mm_*fp8.log ;;
    gprofile) PROFILE_OUT="$OUT/grouped_profile.json" CUDA_MODULE_LOADING=EAGER timeout -s USR1 -k 15 "${T:-240}" \
      python3 scripts/dev/grouped_profile.py ${PROFILE_ROWS:-} > "$OUT/grouped_profile.log" 2>&1; tail -40 "$OUT/grouped_profile.log" ;;
    tuner_probe) PROBE_OUT="$OUT/tuner_probe.json" timeout "${T:-150}" python3 scripts/dev/tuner_probe.py > "$OUT/tuner_probe.log" 2>&1
      tail -30 "$OUT/tuner_probe.log" ;;
    gtuner) PROBE_OUT="$OUT/grouped_tuner_probe.json" CUDA_MODULE_LOADING=EAGER timeout -s USR1 -k 15 "${T:-240}" \
      python3 scripts/dev/grouped_tuner_probe.py > "$OUT/grouped_tuner_probe.log" 2>&1; tail -20 "$OUT/grouped_tuner_probe.log" ;;
    flush_probe) PROBE_OUT="$OUT/flush_probe.json" timeout "${T:-150}" python3 scripts/dev/flush_probe.py ${PROBE_SHAPES:-} > "$OUT/flush_probe.log" 2>&1
      tail -50 "$OUT/flush_probe.log" ;;
    ncu) timeout "${T:-300}" ncu --profile-from-start off --clock-control none --set full \
      --kernel-name regex:'device_kernel|nvjet' --print-summary none ${NCU_ARGS:-} python3 scripts/dev/ncu_probe.py > "$OUT/ncu.log" 2>&1
      grep -E "^  [a-z_]|Duration|Compute \(SM\) Throughput|DRAM Throughput|Memory Throughput|Registers Per|profiled in" "$OUT/ncu.log" | head -80 ;;
    fp8sweep) CUDA_MODULE_LOADING=EAGER timeout "${T:-240}" python3 scripts/dev/fp8_grouped_sweep.py ${FP8_SWEEP_ARGS:-} \
      "$OUT/fp8_grouped_sweep.json" > "$OUT/fp8_sweep.log" 2>&1; tail -40 "$OUT/fp8_sweep.log" | cut -c1-220 ;;
    fp8probe) timeout "${T:-150}" python3 scripts/dev/fp8_wgrad_data_probe.py "$OUT/fp8_wgrad_data_probe.json" \
      > "$OUT/fp8_wgrad_data_probe.log" 2>&1; tail -12 "$OUT/fp8_wgrad_data_probe.log" ;;
    probe) PROBE_OUT="$OUT/host_probe.json" timeout "${T:-180}" python3 scripts/dev/host_probe.py > "$OUT/probe.log" 2>&1
      tail -12 "$OUT/probe.log" ;;
    soak) timeout "${T:-120}" python3 scripts/reliability/soak.py --out "$OUT/soak.json" --calls 10000 \
      --max-seconds "${SOAK_S:-90}" > "$OUT/soak.log" 2>&1; tail -5 "$OUT/soak.log" ;;
    sanitizer) SANITIZER_SINGLE_S="${SANITIZER_SINGLE_S:-150}" timeout "${T:-200}" \
      bash scripts/reliability/sanitizer.sh "$OUT/sanitizer" > "$OUT/sanitizer.log" 2>&1; tail -3 "$OUT/sanitizer.log" ;;
    initcheck) SANITIZER_TOOLS=initcheck SANITIZER_SINGLE_S="${SANITIZER_SINGLE_S:-240}" timeout "${T:-300}" \
      bash scripts/reliability/sanitizer.sh "$OUT/initcheck" > "$OUT/initcheck.log" 2>&1
      rm -f "$OUT"/initcheck/initcheck_*.sanitizer.log  # tallied into initcheck_tally.json (too large to bring back)
      tail -3 "$OUT/initcheck.log"; cat "$OUT/initcheck/initcheck_tally.txt" 2>/dev/null | head -30 ;;
    vendor) PROBE_OUT="$OUT/vendor_path_probe.json" CUDA_MODULE_LOADING=EAGER timeout "${T:-200}" \
      python3 scripts/dev/vendor_path_probe.py > "$OUT/vendor_path_probe.log" 2>&1; tail -25 "$OUT/vendor_path_probe.log" ;;
    moebw) PROBE_OUT="$OUT/moe_bandwidth.json" timeout "${T:-200}" python3 scripts/dev/moe_bandwidth.py \
      > "$OUT/moe_bandwidth.log" 2>&1; tail -30 "$OUT/moe_bandwidth.log" ;;
    *) stamp "unknown step $step" ;;
  esac
  stamp "step $step rc=$?"
  T="$T_ALL" TB="$TB_ALL"
done
# At most 8 files come back from the device machine: everything but the step log goes into one archive.
if [ -n "${PACK:-}" ]; then
  tar czf /tmp/session.tgz -C "$OUT" --exclude steps.log . && rm -rf "${OUT:?}"/* && mv /tmp/session.tgz "$OUT/" \
    && cp /tmp/steps.log "$OUT/" 2>/dev/null
fi

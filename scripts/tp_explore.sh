#!/usr/bin/env bash
# On a 2+ GPU machine, with a wheel built elsewhere in dist/: checks the TP ops and times
# variants of them, leaving everything under $OUT (a developer's loop: one device
# call per round of ideas).
#   TESTS="node ids"  TIMELINE="label substrings"  TIMELINE_VARIANTS="spec"  TIMELINE_ARGS="--graph"
#   SUITE_ARGS="..." (no spaces inside an argument)
set -uo pipefail
res="${OUT:-explore_out}"; mkdir -p "$res"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install --no-deps --no-index -q --force-reinstall dist/*.whl 2>&1 | grep -v WARNING
site="$(cd /tmp && python3 -c 'import distgemm, os; print(os.path.dirname(distgemm.__file__))')"
cp -r python/distgemm/* "$site/"
nproc_gpu=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv > "$res/gpu.txt"
run() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$res/$name.log" 2>&1; echo "rc $?" >> "$res/$name.log"; tail -n "${TAIL:-30}" "$res/$name.log"; }
if [ -n "${TESTS:-}" ]; then
  DISTGEMM_TIMEOUT_S=15 run tests "${TESTS_LIMIT:-170}" python3 -m pytest -q -ra -p no:cacheprovider $TESTS
fi
if [ -n "${TIMELINE:-}" ]; then
  run timeline "${TIMELINE_LIMIT:-120}" python3 -m torch.distributed.run --nproc-per-node="$nproc_gpu" scripts/dev/tp_timeline.py \
    --out /tmp/timeline --only "$TIMELINE" --variants "${TIMELINE_VARIANTS:-}" ${TIMELINE_ARGS:-}
  tar czf "$res/timeline.tgz" -C /tmp timeline
fi
if [ -n "${SUITE_ARGS:-}" ]; then
  TAIL=45 run suite "${SUITE_LIMIT:-280}" python3 -m torch.distributed.run --nproc-per-node="$nproc_gpu" -m distgemm.bench.tp_suite \
    --out "$res/suite" $SUITE_ARGS
fi

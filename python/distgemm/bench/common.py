"""Timing, result files and plots shared by the benchmark suites."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
from typing import Callable, Dict, List, Optional

import torch

from distgemm import _settings


def commit() -> str:
    """The commit results name: the setting, else the one the installed build was made from,
    else git's HEAD where the package runs from a checkout."""
    if _settings.current().commit:
        return _settings.current().commit
    try:
        from distgemm._build_info import COMMIT  # noqa: PLC0415 (written by the build)

        if COMMIT:
            return COMMIT
    except ImportError:  # a build from before the commit was recorded, or none
        pass
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=here, text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def bench_device() -> torch.device:
    """Where the suites run: the current GPU (a CPU smoke test runs the MoE suites' control flow
    on the host by replacing this)."""
    return torch.device("cuda")


def gpu_slug(gpus: int) -> str:
    """'h200' for one NVIDIA H200, 'h200x2' for two."""
    name = torch.cuda.get_device_name(0).lower().replace("nvidia", "").strip()
    name = name.split()[0] if name else "gpu"
    return name if gpus == 1 else f"{name}x{gpus}"


def timing_discipline() -> str:
    """How Timer.compare times (setting bench_timing, DISTGEMM_BENCH_TIMING): "interleaved"
    (default), "sequential" or "sustained"."""
    return _settings.current().bench_timing


def env_info(gpus: int = 1) -> dict:
    return {"gpu": torch.cuda.get_device_name(0), "gpus": gpus, "torch": torch.__version__,
            "cuda": torch.version.cuda, "commit": commit(), "timing": timing_discipline()}


class Timer:
    """Median device time of a callable: CUDA events around each run, L2 flushed before
    each run by overwriting a buffer twice the L2 size."""

    def __init__(self, device=None):
        from distgemm.autotune import flush_buffer  # here: the module's other helpers load without the library

        # On the GPU (device None: the current one). An earlier Timer with `device=None` put this
        # buffer, and the warm-up below, on the host: the benchmarks' "flush" left the L2 as the
        # previous run left it, and the warm-up ran 400 matmuls on the CPU (minutes).
        self._flush = flush_buffer(device)
        device = self._flush.device
        # Bring the clocks up before the first measurement (~1 s of matrix work).
        x = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        for _ in range(400):
            x @ x
        torch.cuda.synchronize(device)

    def __call__(self, fn: Callable[[], object], warmup: int = 3, reps: int = 20) -> float:
        return self._interleaved({"fn": fn}, warmup, reps)["fn"]

    def queue_ahead(self) -> None:
        """Flushes L2 and queues ~1 ms of GPU work, so the next run is timed on the device
        alone, not on the host that enqueues it (200 us was too little where the previous
        implementation left the GPU idle, e.g. one that synchronizes)."""
        self._flush.zero_()
        torch.cuda._sleep(2_000_000)

    def compare(self, fns: Dict[str, Callable[[], object]], warmup: int = 3, reps: int = 20) -> Dict[str, float]:
        """Median device time of each callable, the runs interleaved (in a fresh order every
        round: the GPU runs faster for a while after lighter work, so a fixed neighbour biases) so
        that clock and power drift over a row falls on every implementation alike.
        DISTGEMM_BENCH_TIMING=sequential times them one after the other instead, and
        DISTGEMM_BENCH_TIMING=sustained with the GPU never idle (see sustained_ms)."""
        discipline = timing_discipline()
        if discipline == "sequential":
            return {name: self(fn, warmup, reps) for name, fn in fns.items()}
        if discipline == "sustained":
            return sustained_ms(fns, warmup, reps)
        return self._interleaved(fns, warmup, reps)

    def _interleaved(self, fns: Dict[str, Callable[[], object]], warmup: int, reps: int) -> Dict[str, float]:
        for fn in fns.values():
            for _ in range(warmup):
                fn()
        return round_robin_ms(fns, reps, before_each=self.queue_ahead)


def sustained_ms(fns: Dict[str, Callable[[], object]], warmup: int = 3, reps: int = 20) -> Dict[str, float]:
    """Median device time of each callable called round-robin (a fresh order every round)
    with no flush, sleep or synchronize in between: the GPU stays busy, at the clocks its power
    limit allows under a training step's run of GEMMs (DISTGEMM_BENCH_TIMING=sustained). The
    interleaved discipline's flush and ~1 ms of light work before each run let the clocks
    recover; on the H200 that reads large grouped GEMMs ~15% faster and can rank two tiles
    differently (scripts/dev/grouped_tuner_probe.py). Without a flush, operands that fit in L2
    stay there; and a GEMM shorter than the host's time per call drains the queue, so its
    events then take in host time: device time only where the GPU work outlasts the host's (on
    the H200 sweep, rows of >= ~50 us read the same ratios as interleaved)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    return round_robin_ms(fns, reps)


def round_robin_ms(fns: Dict[str, Callable[[], object]], reps: int,
                   before_each: Optional[Callable[[], object]] = None) -> Dict[str, float]:
    """Median time between each callable's own CUDA events over `reps` rounds, the callables
    in a fresh order every round (the same on every rank); `before_each` runs ahead of every
    call, outside its events."""
    events = {name: [] for name in fns}
    for rep in range(reps):
        for name in shuffled(list(fns), rep):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if before_each is not None:
                before_each()
            s.record()
            fns[name]()
            e.record()
            events[name].append((s, e))
    torch.cuda.synchronize()
    return {name: median(s.elapsed_time(e) for s, e in pairs) for name, pairs in events.items()}


def host_ms(fn: Callable[[], object], calls: int = 20, before: Optional[Callable[[], object]] = None) -> float:
    """CPU time per call to enqueue `fn` while the GPU is busy (so that enqueueing never waits
    on it): where this reaches the device time, the op is host-bound at that size. `before`
    runs first (e.g. a barrier, so that the ranks of a collective start together)."""
    import time

    fn()
    torch.cuda.synchronize()
    if before is not None:
        before()
    torch.cuda._sleep(100_000_000)  # ~50 ms
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e3


def with_settings(overrides: Dict[str, object], fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` run under ``distgemm.settings(**overrides)``, the previous settings restored after each
    call: how the suites time one backend or algorithm."""
    def call():
        with _settings.settings(**overrides):
            return fn()
    return call


def parse_variants(spec: str) -> Dict[str, Dict[str, str]]:
    """'name:VAR=value,VAR2=value;name2:VAR=value' -> {name: {setting: value, ...}, ...}: extra
    columns of a suite, each the default call run under its own settings (VAR: a setting's name,
    e.g. tp_algo, or its environment variable, e.g. DISTGEMM_TP_ALGO)."""
    variants = {}
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        name, _, assigns = item.partition(":")
        overrides = {}
        for assign in filter(None, assigns.split(",")):
            var, eq, value = assign.partition("=")
            var = var.strip()
            if not eq or not var:
                raise ValueError(f"variant {name!r}: expected VAR=value, got {assign!r}")
            field = _settings.variable_field(var) if var.startswith("DISTGEMM_") else var
            _settings.replaced(**{field: value.strip()})  # a bad name or value is named here
            overrides[field] = value.strip()
        if not name or not overrides:
            raise ValueError(f"variant {item!r}: expected name:VAR=value[,VAR=value...]")
        variants[name.strip()] = overrides
    return variants


def shuffled(names: List[str], turn: int) -> List[str]:
    """`names` in the order of round `turn`: the same on every rank (seeded by the round), a
    different one every round."""
    order = list(names)
    random.Random(turn).shuffle(order)
    return order


def median(values) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def entry(ms: float, flops: float) -> dict:
    return {"ms": round(ms, 5), "tflops": round(flops / ms / 1e9, 2)}


def geomean(values: List[float]) -> float:
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def ratio_geomeans(rows: List[dict], ours: str, peers: List[str]) -> Dict[str, float]:
    """{peer: geomean over rows of peer_ms / ours_ms} (>1: ours faster)."""
    out = {}
    for peer in peers:
        ratios = [r[peer]["ms"] / r[ours]["ms"] for r in rows if peer in r and ours in r]
        if ratios:
            out[peer] = round(geomean(ratios), 4)
    return out


def write_results(out_dir: str, slug: str, suite: str, rows: List[dict], geo: Dict[str, object],
                  gpus: int = 1, extra: Optional[dict] = None) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{slug}_{suite}.json")
    doc = {"env": env_info(gpus), "rows": rows, "geomean": geo}
    if extra:
        doc.update(extra)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return path


def plot_ratios(path_png: str, title: str, labels: List[str], series: Dict[str, List[float]],
                ylabel: str, line: Optional[float] = 1.0) -> None:
    """Grouped bars: one group per shape, one bar per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, 0.38 * len(labels) * max(1, len(series))), 4.8))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [x + i * width for x in range(len(labels))]
        ax.bar(xs, values, width, label=name)
    if line is not None:
        ax.axhline(line, color="black", lw=0.8, ls="--")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))])
    ax.set_xticklabels(labels, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path_png, dpi=110)
    plt.close(fig)


def print_row(label: str, cols: Dict[str, str]) -> None:
    print(f"{label:<34}" + "  ".join(f"{k}={v}" for k, v in cols.items()), flush=True)

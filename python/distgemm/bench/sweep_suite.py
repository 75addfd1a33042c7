"""Sweep suite: distgemm against PyTorch on the layer shapes of real models, over a spread of
token counts, plus users' own shapes (``python -m distgemm.bench --suites sweep``,
``--shapes MxNxK,...``, ``--grouped-shapes GxPERxNxK,...``).

Dense (bf16 in, bf16 out): ``distgemm.gemm(a, b)`` against ``torch.matmul(a, b.t())``
(cuBLAS), a (M, K), b (N, K) (the nn.Linear layout), the same inputs. The (N, K) pairs are the
linear layers of Llama-3 8B/70B/405B, DeepSeek-V3, Qwen3 (dense and MoE), Mixtral 8x7B and
GPT-OSS 120B, unsharded and as one rank's shard at TP = 2, 4, 8 (N divided for column-parallel
layers, K for row-parallel ones; K/V heads replicated where a model has fewer than TP); M is
drawn from a fixed-seed log-uniform distribution over 1..32768 plus fixed odd values. Each row
records the device time of both (median, common.Timer, runs interleaved in a fresh order every
round, L2 flushed), TFLOP/s, ratio = cuBLAS time / ours, the host time per eager call of both
(wall clock of back-to-back calls queued behind a busy GPU) and their ratio, which backend
distgemm ran (``distgemm.dense.last_backend()``, else ``distgemm.autotune.last_backend()``,
else None: the dense autotuner may pick cuBLAS for a shape), and the wall time of the row's
first call (which may autotune; warm-up calls follow before timing). Results:
``<gpu>_gemm_sweep.json`` (+ .png).

Grouped (bf16, MoE expert shapes): equal groups, forward ``distgemm.grouped_mm(x, w, offs)``
against ``torch.bmm`` and ``torch._grouped_mm``, dgrad (``trans_w=False``) against ``torch.bmm``
(and ``torch._grouped_mm``), wgrad ``distgemm.grouped_mm_wgrad(dy, x, offs)`` (FP32 out)
against ``torch.bmm(dy_g.T, x_g, out_dtype=torch.float32)`` (FP32 out too; where this torch
refuses ``out_dtype``, bf16-out bmm, named in the file as ``wgrad_bmm_out_dtype``); and Zipf
(ragged) rows, forward only, against ``torch._grouped_mm``. distgemm runs its default backend
(``DISTGEMM_GROUPED_BACKEND`` as set, ``auto`` if not). Results: ``<gpu>_grouped_sweep.json``
(+ .png).

With ``--shapes`` / ``--grouped-shapes`` only those rows run, written to
``<gpu>_gemm_sweep_shapes.json`` / ``<gpu>_grouped_sweep_shapes.json`` (the model sweep's files
are left as they are).

The shape lists, the spec parser and the summaries are plain Python (no GPU, no compiled
library: ``distgemm`` is imported only when a suite runs), tested in
tests/cpu/test_bench_helpers.py.
"""

from __future__ import annotations

import math
import random
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .common import Timer, entry, geomean, gpu_slug, print_row, shuffled, with_settings, write_results

# ------------------------------------------------------------------------------ shape lists

TP_DEGREES = (1, 2, 4, 8)
M_MAX = 32768
# Token counts every full sweep has (odd ones included: tails of tiles, GEMV-like decode).
NAMED_M = (1, 7, 33, 127, 255, 1000, 3000, 4097, 8191, 16384, 32768)
DENSE_ROWS, DENSE_ROWS_QUICK = 144, 20
DENSE_SEED = 20250101
# No dense row does more FLOPs than this (an H200 runs 1e13 in ~15 ms): the largest M go to the
# layers they fit, which keeps the suite within about two minutes.
DENSE_FLOP_CAP = 1.0e13


def _attention(model: str, hidden: int, heads: int, kv_heads: int, head_dim: int) -> list:
    """(model, layer, N, K, tp) of a GQA attention block's projections at every TP degree:
    q, k or v alone (kv), fused QKV and o; heads split across ranks, K/V heads replicated
    where there are fewer than ranks (as Megatron and vLLM do)."""
    out = []
    for tp in TP_DEGREES:
        if heads % tp or (kv_heads >= tp and kv_heads % tp):
            continue
        q, kv = heads // tp * head_dim, max(1, kv_heads // tp) * head_dim
        out += [(model, "q", q, hidden, tp), (model, "kv", kv, hidden, tp),
                (model, "qkv", q + 2 * kv, hidden, tp), (model, "o", hidden, q, tp)]
    return out


def _mlp(model: str, hidden: int, inter: int, prefix: str = "", tps: Sequence[int] = TP_DEGREES) -> list:
    """Gate (= up), fused gate+up (column-parallel: N sharded) and down (row-parallel: K
    sharded) of a SwiGLU MLP."""
    out = []
    for tp in tps:
        if inter % tp or (inter // tp) % 8:
            continue
        i = inter // tp
        out += [(model, f"{prefix}gate", i, hidden, tp), (model, f"{prefix}gate_up", 2 * i, hidden, tp),
                (model, f"{prefix}down", hidden, i, tp)]
    return out


def _deepseek_v3() -> list:
    """DeepSeek-V3 (671B): MLA (q_lora 1536, kv_lora 512, rope 64, 128 heads of 128 + 64), the
    dense MLP of its first three layers (18432) and the shared expert (2048, run unsharded)."""
    m, h = "deepseek-v3", 7168
    out = [(m, "q_a+kv_a", 1536 + 512 + 64, h, 1), (m, "q_a", 1536, h, 1), (m, "kv_a", 512 + 64, h, 1)]
    for tp in TP_DEGREES:
        heads = 128 // tp
        out += [(m, "q_b", heads * 192, 1536, tp), (m, "kv_b", heads * 256, 512, tp),
                (m, "o", h, heads * 128, tp)]
    return out + _mlp(m, h, 18432) + _mlp(m, h, 2048, "shared_", (1,))


def model_layers() -> list:
    """Every (model, layer, N, K, tp) of the catalogue, duplicates across models included."""
    return (_attention("llama3-8b", 4096, 32, 8, 128) + _mlp("llama3-8b", 4096, 14336)
            + _attention("llama3-70b", 8192, 64, 8, 128) + _mlp("llama3-70b", 8192, 28672)
            + _attention("llama3-405b", 16384, 128, 8, 128) + _mlp("llama3-405b", 16384, 53248)
            + _deepseek_v3()
            + _attention("qwen3-8b", 4096, 32, 8, 128) + _mlp("qwen3-8b", 4096, 12288)
            + _attention("qwen3-32b", 5120, 64, 8, 128) + _mlp("qwen3-32b", 5120, 25600)
            + _attention("qwen3-235b-a22b", 4096, 64, 4, 128) + _mlp("qwen3-235b-a22b", 4096, 1536, "expert_", (1,))
            + _attention("qwen3-30b-a3b", 2048, 32, 4, 128) + _mlp("qwen3-30b-a3b", 2048, 768, "expert_", (1,))
            + _attention("mixtral-8x7b", 4096, 32, 8, 128) + _mlp("mixtral-8x7b", 4096, 14336, "expert_", (1,))
            + _attention("gpt-oss-120b", 2880, 64, 8, 64) + _mlp("gpt-oss-120b", 2880, 2880, "expert_", (1,)))


def catalogue() -> List[dict]:
    """The distinct (N, K) pairs of model_layers(), in first-seen order: {"n", "k", "layer"
    ('model.layer/tpN' of the first), "also" (the other layers of that shape)}."""
    seen: Dict[Tuple[int, int], dict] = {}
    for model, layer, n, k, tp in model_layers():
        name = f"{model}.{layer}/tp{tp}"
        if (n, k) in seen:
            seen[(n, k)]["also"].append(name)
        else:
            seen[(n, k)] = {"n": n, "k": k, "layer": name, "tp": tp, "also": []}
    return list(seen.values())


def _log_uniform_m(rng: random.Random) -> int:
    return max(1, min(M_MAX, int(round(math.exp(rng.uniform(0.0, math.log(M_MAX)))))))


def dense_rows(quick: bool = False, seed: int = DENSE_SEED, flop_cap: float = DENSE_FLOP_CAP) -> List[dict]:
    """The dense sweep's rows {"m", "n", "k", "layer", "also"}: DENSE_ROWS (quick:
    DENSE_ROWS_QUICK) distinct (N, K) pairs of the catalogue (every unsharded layer first),
    each with one M: the NAMED_M values, the rest log-uniform over 1..M_MAX; the largest M go
    first, each to a random layer it fits (2MNK <= flop_cap); the order shuffled. Fixed seed:
    the same rows on every run."""
    target = DENSE_ROWS_QUICK if quick else DENSE_ROWS
    rng = random.Random(seed)
    layers = catalogue()
    unsharded = [r for r in layers if r["tp"] == 1]
    sharded = [r for r in layers if r["tp"] != 1]
    rng.shuffle(unsharded)
    rng.shuffle(sharded)
    chosen = (unsharded + sharded)[:target] if not quick else rng.sample(layers, target)
    ms = list(NAMED_M)[:target]
    while len(ms) < len(chosen):
        ms.append(_log_uniform_m(rng))
    rows, free = [], list(chosen)
    for m in sorted(ms, reverse=True):
        fits = [r for r in free if 2.0 * m * r["n"] * r["k"] <= flop_cap]
        if fits:
            layer = rng.choice(fits)
        else:  # no layer left takes this M: the smallest one, at the largest M it takes
            layer = min(free, key=lambda r: r["n"] * r["k"])
            m = max(1, int(flop_cap // (2.0 * layer["n"] * layer["k"])))
        free.remove(layer)
        rows.append({"m": m, **{key: layer[key] for key in ("n", "k", "layer", "also")}})
    random.Random(seed + 1).shuffle(rows)
    return rows


# (name, N, K, experts of the model) of MoE expert GEMMs: y_g = x_g @ w_g.T, w (G, N, K); a
# rank holds G <= experts of them (all, or a share under expert parallelism).
MOE_NK = (
    ("deepseek-v3.expert_gate", 2048, 7168, 256), ("deepseek-v3.expert_gate_up", 4096, 7168, 256),
    ("deepseek-v3.expert_down", 7168, 2048, 256),
    ("qwen3-235b-a22b.expert_gate_up", 3072, 4096, 128), ("qwen3-235b-a22b.expert_down", 4096, 1536, 128),
    ("qwen3-30b-a3b.expert_gate_up", 1536, 2048, 128), ("qwen3-30b-a3b.expert_down", 2048, 768, 128),
    ("mixtral-8x7b.expert_gate_up", 28672, 4096, 8), ("mixtral-8x7b.expert_down", 4096, 14336, 8),
    ("gpt-oss-120b.expert_gate_up", 5760, 2880, 128), ("gpt-oss-120b.expert_down", 2880, 2880, 128),
)
GROUPS = (4, 8, 16, 32, 64, 128)
TOKENS_PER_GROUP = (128, 256, 512, 1024, 2048, 4096)
GROUPED_ROWS, GROUPED_ROWS_QUICK = 30, 5
GROUPED_TOKENS_CAP = 65536  # G x tokens per expert
GROUPED_FLOP_CAP = 6.0e12
GROUPED_SEED = 7
# Ragged rows (forward against torch._grouped_mm only): (MOE_NK name, G, mean tokens per expert)
RAGGED = (("deepseek-v3.expert_gate", 32, 2048), ("qwen3-235b-a22b.expert_gate_up", 128, 256),
          ("gpt-oss-120b.expert_down", 32, 1024), ("mixtral-8x7b.expert_gate_up", 8, 2048))


def grouped_rows(quick: bool = False, seed: int = GROUPED_SEED) -> List[dict]:
    """The grouped sweep's configurations {"name", "groups", "tokens_per_group", "n", "k",
    "routing"}: GROUPED_ROWS (quick: GROUPED_ROWS_QUICK) balanced ones, every MOE_NK pair and
    every G and tokens-per-expert value among them, G at most the model's experts, within
    GROUPED_TOKENS_CAP tokens and GROUPED_FLOP_CAP FLOPs; then the RAGGED (Zipf-routed) ones
    (quick: the first)."""
    rng = random.Random(seed)
    target = GROUPED_ROWS_QUICK if quick else GROUPED_ROWS
    rows, seen = [], set()
    grid = [(g, p) for g in GROUPS for p in TOKENS_PER_GROUP]
    i = 0
    while len(rows) < target:
        name, n, k, experts = MOE_NK[i % len(MOE_NK)] if not quick else MOE_NK[(3 * i) % len(MOE_NK)]
        # cycle G and tokens per expert so that each value occurs, then fill at random
        g, per = (GROUPS[i % len(GROUPS)], TOKENS_PER_GROUP[(i * 5 + i // len(GROUPS)) % len(TOKENS_PER_GROUP)])
        i += 1
        tries = [(g, per)] + rng.sample(grid, len(grid))
        for g, per in tries:
            if (g <= experts and g * per <= GROUPED_TOKENS_CAP and 2.0 * g * per * n * k <= GROUPED_FLOP_CAP
                    and (g, per, n, k) not in seen):
                break
        else:
            continue
        seen.add((g, per, n, k))
        rows.append({"name": name, "groups": g, "tokens_per_group": per, "n": n, "k": k, "routing": "balanced"})
    nk = {name: (n, k) for name, n, k, _ in MOE_NK}
    for name, g, per in RAGGED[:1] if quick else RAGGED:
        rows.append({"name": name, "groups": g, "tokens_per_group": per, "n": nk[name][0], "k": nk[name][1],
                     "routing": "zipf"})
    return rows


# ------------------------------------------------------------------------------ user shapes


def parse_shapes(spec: str, dims: int = 3, option: str = "--shapes") -> List[Tuple[int, ...]]:
    """'4096x2112x7168,128x4096x4096' or '@file' (one shape a line, '#' starts a comment;
    commas also separate) -> [(4096, 2112, 7168), (128, 4096, 4096)]: `dims` positive integers
    joined by 'x' each (MxNxK for dense, GxPERxNxK for grouped), duplicates dropped. Raises
    ValueError naming the option and the bad item."""
    form = "MxNxK" if dims == 3 else "GxPERxNxK"
    example = "4096x2112x7168" if dims == 3 else "8x1024x4096x7168"
    if spec is None or not spec.strip():
        raise ValueError(f"{option}: empty; expected {form}[,{form}...] or @FILE, e.g. {example}")
    spec = spec.strip()
    if spec.startswith("@"):
        path = spec[1:]
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"{option}: cannot read {path!r}: {e.strerror or e}") from None
        items = [(f"{path}:{no}", item) for no, line in enumerate(text.splitlines(), 1)
                 for item in line.split("#", 1)[0].split(",")]
    else:
        items = [(f"item {no}", item) for no, item in enumerate(spec.split(","), 1)]
    shapes: List[Tuple[int, ...]] = []
    for where, item in items:
        item = item.strip()
        if not item:
            if spec.startswith("@"):
                continue  # blank lines and comment-only lines
            raise ValueError(f"{option}: {where} is empty; expected {form}[,{form}...], e.g. {example}")
        parts = [p.strip() for p in item.lower().split("x")]
        if len(parts) != dims or not all(p.isdigit() for p in parts) or any(int(p) <= 0 for p in parts):
            raise ValueError(f"{option}: {where} {item!r} is not {form} ({dims} positive integers "
                             f"joined by 'x', e.g. {example})")
        shape = tuple(int(p) for p in parts)
        if shape not in shapes:
            shapes.append(shape)
    if not shapes:
        raise ValueError(f"{option}: no shapes in {spec!r}; expected {form} lines, e.g. {example}")
    return shapes


def user_dense_rows(shapes: Sequence[Tuple[int, int, int]]) -> List[dict]:
    return [{"m": m, "n": n, "k": k, "layer": "user", "also": []} for m, n, k in shapes]


def user_grouped_rows(shapes: Sequence[Tuple[int, int, int, int]]) -> List[dict]:
    return [{"name": "user", "groups": g, "tokens_per_group": per, "n": n, "k": k, "routing": "balanced"}
            for g, per, n, k in shapes]


# ------------------------------------------------------------------------------ summaries


def _shape_str(row: dict) -> str:
    s = row["shape"]
    return f"{s['m']}x{s['n']}x{s['k']}"


def _round(v: Optional[float]) -> Optional[float]:
    return None if v is None or not math.isfinite(v) else round(v, 4)


def _geo(values: List[float]) -> Optional[float]:
    return _round(geomean(values)) if values else None


def summarize_dense(rows: List[dict]) -> dict:
    """The dense summary from rows that ran (rows with "error" are left out): geomeans of the
    device ratio (cuBLAS time / ours) overall, for M >= 2048 and for M <= 256, its minimum and
    that row's shape ('MxNxK', as --shapes takes it) and layer; the same for the host ratio
    (torch host time per call / ours); and how many rows each backend of ours ran."""
    ok = [r for r in rows if "error" not in r and r.get("ratio")]
    ratios = [r["ratio"] for r in ok]
    worst = min(ok, key=lambda r: r["ratio"]) if ok else None
    host = [r for r in ok if r.get("host_ratio")]
    worst_host = min(host, key=lambda r: r["host_ratio"]) if host else None
    backends: Dict[str, int] = {}
    for r in ok:
        key = str(r.get("backend"))
        backends[key] = backends.get(key, 0) + 1
    return {
        "bf16_vs_cublas": _geo(ratios),
        "bf16_vs_cublas_min": _round(worst["ratio"]) if worst else None,
        "bf16_vs_cublas_min_shape": _shape_str(worst) if worst else None,
        "bf16_vs_cublas_min_layer": worst["shape"].get("layer") if worst else None,
        "bf16_vs_cublas_max": _round(max(ratios)) if ratios else None,
        "bf16_vs_cublas_m_ge_2048": _geo([r["ratio"] for r in ok if r["shape"]["m"] >= 2048]),
        "bf16_vs_cublas_m_le_256": _geo([r["ratio"] for r in ok if r["shape"]["m"] <= 256]),
        "bf16_host_vs_torch": _geo([r["host_ratio"] for r in host]),
        "bf16_host_vs_torch_min": _round(worst_host["host_ratio"]) if worst_host else None,
        "bf16_host_vs_torch_min_shape": _shape_str(worst_host) if worst_host else None,
        "backends": backends,
        "rows": len(ok),
        "rows_failed": len(rows) - len(ok),
    }


GROUPED_SUMMARY = (("forward", "bmm"), ("dgrad", "bmm"), ("wgrad", "bmm"),
                   ("forward", "torch_grouped_mm"), ("dgrad", "torch_grouped_mm"))
# The grouped rows also time distgemm's kernels alone (backend cutlass: no torch._grouped_mm
# stand-in), whose ratios go under "kernel_ratios" and the summary's kernel_* keys.
KERNEL = "distgemm_kernel"


def summarize_grouped(rows: List[dict]) -> dict:
    """{pass}_vs_{peer} (geomean of peer time / ours) and {pass}_vs_{peer}_min with the worst
    row's 'GxPERxNxK' in {pass}_vs_{peer}_min_shape, for the GROUPED_SUMMARY pairs; the
    torch._grouped_mm forward figure includes the ragged rows (its _balanced and _ragged parts
    are given too). None where no row has the pair."""
    out: dict = {}
    for pass_name, peer in GROUPED_SUMMARY:
        mine = [r for r in rows if "error" not in r and r["shape"]["pass"] == pass_name
                and peer in r.get("ratios", {})]
        key = f"{pass_name}_vs_{peer}"
        out[key] = _geo([r["ratios"][peer] for r in mine])
        worst = min(mine, key=lambda r: r["ratios"][peer]) if mine else None
        out[f"{key}_min"] = _round(worst["ratios"][peer]) if worst else None
        s = worst["shape"] if worst else None
        out[f"{key}_min_shape"] = (f"{s['groups']}x{s['tokens_per_group']}x{s['n']}x{s['k']}"
                                   + ("" if s["routing"] == "balanced" else f" ({s['routing']})")) if s else None
    fwd = [r for r in rows if "error" not in r and r["shape"]["pass"] == "forward"
           and "torch_grouped_mm" in r.get("ratios", {})]
    for part, routing in (("balanced", True), ("ragged", False)):
        out[f"forward_vs_torch_grouped_mm_{part}"] = _geo(
            [r["ratios"]["torch_grouped_mm"] for r in fwd if (r["shape"]["routing"] == "balanced") == routing])
    for pass_name, peer in GROUPED_SUMMARY:
        vals = [r["kernel_ratios"][peer] for r in rows if "error" not in r and r["shape"]["pass"] == pass_name
                and peer in r.get("kernel_ratios", {})]
        out[f"kernel_{pass_name}_vs_{peer}"] = _geo(vals)
        out[f"kernel_{pass_name}_vs_{peer}_min"] = _round(min(vals)) if vals else None
    backends: Dict[str, int] = {}
    for r in rows:
        if r.get("backend"):
            kind = "torch" if r["backend"] == "torch._grouped_mm" else "distgemm"
            backends[kind] = backends.get(kind, 0) + 1
    out["backends"] = backends
    out["rows_failed"] = sum(1 for r in rows if "error" in r)
    return out


def estimate_seconds(dense: List[dict], grouped: List[dict], tflops: float = 600.0, tbps: float = 3.5,
                     autotune_candidates: int = 12) -> float:
    """A rough wall-clock model of a sweep on an H200 (device time from `tflops` and `tbps`,
    the Timer's ~1.05 ms of queued work before each run, the autotuner timing each candidate
    ~4 times on a shape's first call, the host-time measurement), to keep the lists in budget."""
    def device_ms(flops, nbytes):
        return max(flops / (tflops * 1e9), nbytes / (tbps * 1e9), 0.006)

    total = 1.5  # Timer set-up (clocks brought up)
    for r in dense:
        m, n, k = r["m"], r["n"], r["k"]
        t = device_ms(2.0 * m * n * k, 2.0 * (m * k + n * k + m * n))
        reps = 20 if t < 2.0 else 10
        timing = 2 * (3 * t + reps * (1.05 + t))
        autotune = autotune_candidates * (t + 3 * max(t, min(2.0, 20 * t) + 0.05))
        calls = _host_calls(t)
        host = 30.0 + 2 * calls * t + 2 * t
        total += (timing + autotune + host + 4 * t + 5.0) / 1e3
    for r in grouped:
        g, per, n, k = r["groups"], r["tokens_per_group"], r["n"], r["k"]
        t = device_ms(2.0 * g * per * n * k, 2.0 * (g * per * (n + k) + g * n * k))
        impls = 3 if r["routing"] == "balanced" else 2
        passes = 3 if r["routing"] == "balanced" else 1
        total += passes * (impls * (3 * t + 20 * (1.05 + t)) + 3 * t + 10.0) / 1e3
    return total


# ------------------------------------------------------------------------------ timing


def _host_calls(device_ms: float) -> int:
    """Back-to-back calls for the host time: 50, fewer where the GPU would then run > ~100 ms."""
    return max(8, min(50, int(50.0 / max(device_ms, 1e-3))))


def host_times(fns: Dict[str, Callable[[], object]], calls: int, turn: int = 0) -> Dict[str, float]:
    """Host ms per eager call of each callable: `calls` back-to-back calls, wall clock, while
    the GPU runs ~30 ms of queued work (so that no launch waits on the GPU; an op that
    synchronizes shows its wait), the callables in a seeded random order."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(60_000_000)  # ~30 ms at the H200's clocks
    out = {}
    for name in shuffled(list(fns), turn):
        fn = fns[name]
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        out[name] = (time.perf_counter() - start) / calls * 1e3
    torch.cuda.synchronize()
    return out


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)).item()


def _last_backend() -> Optional[Callable[[], Optional[str]]]:
    """distgemm.dense.last_backend (or distgemm.autotune.last_backend), None where the library
    has neither."""
    import distgemm

    fn = getattr(getattr(distgemm, "dense", None), "last_backend", None)
    if fn is None:
        fn = getattr(getattr(distgemm, "autotune", None), "last_backend", None)
    return fn if callable(fn) else None


def _free() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def run_dense(timer: Timer, rows: List[dict]) -> List[dict]:
    import distgemm
    from tqdm import tqdm

    backend_of = _last_backend()
    results = []
    print("\n== sweep: dense bf16, distgemm.gemm vs torch.matmul (cuBLAS) (TFLOP/s; ratio = cuBLAS "
          "time / ours; host us per call ours/torch)")
    for i, spec in enumerate(tqdm(rows, desc="sweep dense", leave=False)):
        m, n, k = spec["m"], spec["n"], spec["k"]
        shape = {"m": m, "n": n, "k": k, "dtype": "bf16", "layer": spec["layer"], "also": spec["also"]}
        label = f"{m}x{n}x{k} {spec['layer']}"
        try:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            ours = lambda: distgemm.gemm(a, b)
            theirs = lambda: torch.matmul(a, b.t())
            torch.cuda.synchronize()
            start = time.perf_counter()
            ours()  # untimed: the first call of a shape may autotune
            torch.cuda.synchronize()
            first_ms = (time.perf_counter() - start) * 1e3
            flops = 2.0 * m * n * k
            estimate = flops / 600e12 * 1e3
            times = timer.compare({"distgemm": ours, "cublas": theirs}, reps=20 if estimate < 2.0 else 10)
            out = ours()
            backend = backend_of() if backend_of is not None else None
            err = _rel(out, theirs())
            del out
            calls = _host_calls(max(times.values()))
            host = host_times({"distgemm": ours, "cublas": theirs}, calls, i)
            row = {"shape": shape, "distgemm": entry(times["distgemm"], flops), "cublas": entry(times["cublas"], flops),
                   "ratio": round(times["cublas"] / times["distgemm"], 4),
                   "host_ms": {name: round(v, 5) for name, v in host.items()},
                   "host_ratio": round(host["cublas"] / host["distgemm"], 4), "host_calls": calls,
                   "backend": backend, "first_call_ms": round(first_ms, 3), "rel_err": err}
            if not err < 2e-2:
                print(f"WARNING {label}: distgemm differs from torch.matmul (relative error {err:.2e})")
            print_row(f"{i:3d} {label}", {"ours": row["distgemm"]["tflops"], "cublas": row["cublas"]["tflops"],
                                          "ratio": f"{row['ratio']:.3f}",
                                          "host_us": f"{host['distgemm'] * 1e3:.0f}/{host['cublas'] * 1e3:.0f}",
                                          "backend": backend, "first_ms": f"{first_ms:.1f}"})
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:  # OOM is a RuntimeError
            row = {"shape": shape, "error": f"{type(e).__name__}: {e}"[:500]}
            print(f"{i:3d} {label}: FAILED {row['error']}", flush=True)
        finally:
            a = b = None
            _free()
        results.append(row)
    return results


def _wgrad_bmm_out_dtype() -> torch.dtype:
    """float32 where this torch's bmm takes out_dtype (2.9+), else bfloat16."""
    try:
        x = torch.ones(1, 16, 16, device="cuda", dtype=torch.bfloat16)
        torch.bmm(x, x, out_dtype=torch.float32)
        return torch.float32
    except (TypeError, RuntimeError):
        return torch.bfloat16


def run_grouped(timer: Timer, configs: List[dict]) -> Tuple[List[dict], str]:
    import distgemm
    from tqdm import tqdm

    from .grouped_suite import counts_for

    backend_of = _last_backend()
    wgrad_dtype = _wgrad_bmm_out_dtype()
    wgrad_kw = {"out_dtype": torch.float32} if wgrad_dtype == torch.float32 else {}
    rows = []
    print(f"\n== sweep: grouped bf16 (TFLOP/s of ours; ratio = peer time / ours; wgrad: ours FP32 out, "
          f"bmm {str(wgrad_dtype)[6:]} out)")
    for i, c in enumerate(tqdm(configs, desc="sweep grouped", leave=False)):
        g, per, n, k, routing = c["groups"], c["tokens_per_group"], c["n"], c["k"], c["routing"]
        counts = counts_for(g, per, routing)
        t = sum(counts)
        flops = 2.0 * t * n * k
        base = {"name": c["name"], "groups": g, "tokens_per_group": per, "n": n, "k": k, "routing": routing}
        if routing != "balanced":
            base["counts"] = counts
        label = f"{g}x{per}x{n}x{k}{'' if routing == 'balanced' else ' ' + routing} {c['name']}"
        x = w = dy = offs = None
        try:
            offs = torch.tensor(counts, device="cuda", dtype=torch.int64).cumsum(0).to(torch.int32)
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) * 0.05
            dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
            equal = routing == "balanced"
            passes = {"forward": {"distgemm": lambda: distgemm.grouped_mm(x, w, offs),
                                  "torch_grouped_mm": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)}}
            if equal:
                passes["forward"]["bmm"] = lambda: torch.bmm(x.view(g, per, k), w.transpose(1, 2))
                passes["dgrad"] = {"distgemm": lambda: distgemm.grouped_mm(dy, w, offs, trans_w=False),
                                   "bmm": lambda: torch.bmm(dy.view(g, per, n), w),
                                   "torch_grouped_mm": lambda: torch._grouped_mm(dy, w, offs=offs)}
                passes["wgrad"] = {"distgemm": lambda: distgemm.grouped_mm_wgrad(dy, x, offs),
                                   "bmm": lambda: torch.bmm(dy.view(g, per, n).transpose(1, 2), x.view(g, per, k),
                                                            **wgrad_kw)}
            for impls in passes.values():  # distgemm's own kernels alone, tuned among themselves
                impls[KERNEL] = with_settings({"grouped_backend": "cutlass"}, impls["distgemm"])
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
            rows.append({"shape": {**base, "pass": "forward"}, "error": f"{type(e).__name__}: {e}"[:500]})
            print(f"{i:3d} {label}: FAILED {rows[-1]['error']}", flush=True)
            x = w = dy = offs = None
            _free()
            continue
        for pass_name, impls in passes.items():
            row = {"shape": {**base, "pass": pass_name}}
            try:
                _time_pass(timer, impls, flops, row)
                impls["distgemm"]()
                row["backend"] = backend_of() if backend_of is not None else None  # what the default ran
                row["kernel_ratios"] = {impl: round(row[impl]["ms"] / row[KERNEL]["ms"], 4)
                                        for impl in impls if impl not in ("distgemm", KERNEL) and impl in row}
                print_row(f"{i:3d} {pass_name:7s} {label}", {"ours": row["distgemm"]["tflops"],
                          **{p: f"{r:.3f}x" for p, r in row["ratios"].items()}})
            except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
                row["error"] = f"{type(e).__name__}: {e}"[:500]
                print(f"{i:3d} {pass_name:7s} {label}: FAILED {row['error']}", flush=True)
            rows.append(row)
        x = w = dy = offs = passes = None
        _free()
    return rows, str(wgrad_dtype)[6:]


def _time_pass(timer: Timer, impls: Dict[str, Callable[[], torch.Tensor]], flops: float, row: dict) -> None:
    """Times ours and every peer that takes the shape (one that refuses it is named under
    "peer_errors" and left out), after comparing their results with ours ("rel_err")."""
    ours = impls["distgemm"]()
    live = {"distgemm": impls["distgemm"]}
    for peer, fn in impls.items():
        if peer == "distgemm":
            continue
        try:
            ref = fn()
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
            row.setdefault("peer_errors", {})[peer] = f"{type(e).__name__}: {e}"[:300]
            continue
        live[peer] = fn
        row.setdefault("rel_err", {})[peer] = _rel(ours.reshape(ref.shape), ref)
        del ref
    del ours
    times = timer.compare(live)
    for impl, ms in times.items():
        row[impl] = entry(ms, flops)
    row["ratios"] = {impl: round(ms / times["distgemm"], 4) for impl, ms in times.items() if impl != "distgemm"}


# ------------------------------------------------------------------------------ plots


def plot_dense(path_png: str, title: str, rows: List[dict]) -> None:
    """Device ratio (cuBLAS / ours) and host time per call against M, one point per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    by_backend: Dict[str, List[dict]] = {}
    for r in ok:
        kind = str(r.get("backend") or "distgemm").split(":")[0]
        by_backend.setdefault(kind, []).append(r)
    for kind, rs in sorted(by_backend.items()):
        ax1.scatter([r["shape"]["m"] for r in rs], [r["ratio"] for r in rs], s=14, label=f"ours ran {kind}")
    ax1.axhline(1.0, color="black", lw=0.8, ls="--")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("M (tokens)")
    ax1.set_ylabel("cuBLAS time / distgemm time (device)")
    ax1.set_title(title, fontsize=9)
    ax1.legend(fontsize=8)
    for impl, marker in (("distgemm", "o"), ("cublas", "x")):
        ax2.scatter([r["shape"]["m"] for r in ok], [r["host_ms"][impl] * 1e3 for r in ok], s=14, marker=marker,
                    label=impl if impl == "distgemm" else "torch.matmul")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("M (tokens)")
    ax2.set_ylabel("host time per eager call (us)")
    ax2.set_title("host time per call", fontsize=9)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path_png, dpi=110)
    plt.close(fig)


def plot_grouped(path_png: str, title: str, rows: List[dict]) -> None:
    from .common import plot_ratios

    series = {f"{p} vs {peer}": [] for p, peer in GROUPED_SUMMARY}
    labels, index = [], {}
    for r in rows:
        s = r["shape"]
        key = (s["groups"], s["tokens_per_group"], s["n"], s["k"], s["routing"])
        if key not in index:
            index[key] = len(labels)
            labels.append(f"{s['groups']}x{s['tokens_per_group']}x{s['n']}x{s['k']}"
                          + ("" if s["routing"] == "balanced" else f" {s['routing']}"))
            for values in series.values():
                values.append(0.0)
        for p, peer in GROUPED_SUMMARY:
            if p == s["pass"] and peer in r.get("ratios", {}):
                series[f"{p} vs {peer}"][index[key]] = r["ratios"][peer]
    series = {name: v for name, v in series.items() if any(v)}
    if labels and series:
        plot_ratios(path_png, title, labels, series, "peer time / distgemm time")


# ------------------------------------------------------------------------------ entry point


def run(out_dir: str, quick: bool = False, shapes: Optional[Sequence[Tuple[int, int, int]]] = None,
        grouped_shapes: Optional[Sequence[Tuple[int, int, int, int]]] = None) -> dict:
    """The model sweep (dense, then grouped), or, where `shapes` or `grouped_shapes` is given,
    only those. Returns the summary lines for `python -m distgemm.bench`."""
    custom = shapes is not None or grouped_shapes is not None
    dense = user_dense_rows(shapes) if shapes else ([] if custom else dense_rows(quick))
    grouped = user_grouped_rows(grouped_shapes) if grouped_shapes else ([] if custom else grouped_rows(quick))
    suffix = "_shapes" if custom else ""
    print(f"\n== sweep: {len(dense)} dense rows, {len(grouped)} grouped configurations "
          f"(~{estimate_seconds(dense, grouped):.0f} s on an H200)")
    timer = Timer()
    slug = gpu_slug(1)
    result = {}
    wall = time.perf_counter()
    if dense:
        rows = run_dense(timer, dense)
        summary = summarize_dense(rows)
        print("sweep dense summary:", summary)
        path = write_results(out_dir, slug, f"gemm_sweep{suffix}", rows, summary,
                             extra={"notes": "ratio = cuBLAS (torch.matmul) device time / distgemm.gemm's; "
                                             "host_ratio = torch host time per eager call / ours; backend = "
                                             "what distgemm ran (last_backend(), None where absent)",
                                    "wall_s": round(time.perf_counter() - wall, 1)})
        plot_dense(path.replace(".json", ".png"), f"distgemm.gemm bf16 vs cuBLAS on {slug}", rows)
        print(f"wrote {path}")
        result.update({f"sweep_{key}": summary[key] for key in (
            "bf16_vs_cublas", "bf16_vs_cublas_min", "bf16_vs_cublas_min_shape", "bf16_vs_cublas_m_ge_2048",
            "bf16_vs_cublas_m_le_256", "bf16_host_vs_torch", "bf16_host_vs_torch_min")})
    if grouped:
        start = time.perf_counter()
        rows, wgrad_dtype = run_grouped(timer, grouped)
        summary = summarize_grouped(rows)
        summary["wgrad_bmm_out_dtype"] = wgrad_dtype
        print("sweep grouped summary:", summary)
        path = write_results(out_dir, slug, f"grouped_sweep{suffix}", rows, summary,
                             extra={"notes": "ratios = peer device time / distgemm's (default grouped backend); "
                                             f"wgrad: distgemm FP32 out vs torch.bmm {wgrad_dtype} out",
                                    "wall_s": round(time.perf_counter() - start, 1)})
        plot_grouped(path.replace(".json", ".png"), f"distgemm grouped GEMM (bf16) vs PyTorch on {slug}", rows)
        print(f"wrote {path}")
        result.update({f"sweep_grouped_{key}": summary[key] for key in (
            "forward_vs_bmm", "forward_vs_bmm_min", "dgrad_vs_bmm", "wgrad_vs_bmm", "forward_vs_torch_grouped_mm")})
    return result


__all__ = ["run", "dense_rows", "grouped_rows", "parse_shapes", "summarize_dense", "summarize_grouped",
           "catalogue", "model_layers", "estimate_seconds", "host_times"]

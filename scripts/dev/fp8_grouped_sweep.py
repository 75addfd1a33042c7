"""Sweep: every compiled FP8 grouped configuration (build with DISTGEMM_TUNING_INSTANCES=ON)
on the DeepSeek-V3 MoE shapes, forward (block, row) and wgrad, with the heuristic's pick.
Prints TFLOP/s per config; writes JSON. A developer probe for choosing the default tiles:
the configurations of one shape are timed interleaved (distgemm.bench's Timer), so that clock
drift over the sweep falls on all of them alike."""

import json
import subprocess
import sys
import time

import torch

import distgemm  # noqa: F401  (loads the ops)
from distgemm._library import ops
from distgemm.bench.common import Timer, env_info
from distgemm.bench.grouped_suite import counts_for

E4M3 = torch.float8_e4m3fn




def offs_of(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32).cuda()


# ``--only wgrad`` (or forward, tails, order, power, ksweep; several comma-separated): those
# passes only; the other arguments name the output file. tails: equal groups of 1-256 tokens, each group one partial tile (what a
# tile's rows past its group's end cost). order: the block forward's default config on Zipf
# routing with the experts in the suite's order (largest first), reversed and shuffled, and
# balanced. power: the block forward on random, zero and constant operands (the same work, less
# switching in the tensor cores and on the wires): interleaved times, then each run alone for
# ~2 s while nvidia-smi samples the board's power and SM clock. ksweep: the block and row-wise
# forwards and torch._scaled_mm (row-wise and per-tensor) on one M x N at K = 128 ... 7168: the time
# per wave of tiles against K separates a tile's fixed cost (epilogue, tile switch) from its
# cost per 128 of K.
PASSES = set(sys.argv[sys.argv.index("--only") + 1].split(",")) if "--only" in sys.argv else {"forward", "wgrad"}
ARGS = [a for i, a in enumerate(sys.argv[1:], 1) if a != "--only" and sys.argv[i - 1] != "--only"]
TAIL_SHAPES = [(264, per, 4096, 7168) for per in (1, 64, 128, 192, 256)]

SHAPES = [(8, 4096, 4096, 7168), (8, 4096, 7168, 2048), (32, 1024, 4096, 7168),
          (32, 1024, 7168, 2048), (64, 512, 4096, 7168), (4, 8192, 7168, 2048)]
rows = []
timer = Timer() if "--plot" not in sys.argv else None


def record(op, routing, shape, config, ms, **extra):
    """One timed row (and any extra fields): printed, and kept for the JSON."""
    g, per, n, k = shape
    r = dict(op=op, routing=routing, g=g, per=per, n=n, k=k, config=config, ms=ms,
             tflops=2 * g * per * n * k / ms / 1e9, **extra)
    print(json.dumps(r), flush=True)
    rows.append(r)


def sweep(op, shape, names, call, routing="balanced"):
    """Times call(config) for the heuristic (-1) and every config, interleaved."""
    fns = {"heuristic": lambda: call(-1)}
    fns.update({name: (lambda c=c: call(c)) for c, name in enumerate(names)})
    for config, ms in timer.compare(fns).items():
        record(op, routing, shape, config, ms)


def block_operands(g, t, n, k):
    """x (T, K) and w (G, N, K) in e4m3, with 128-block scales in the kernel's layouts."""
    x, w = torch.randn(t, k, device="cuda").to(E4M3), torch.randn(g, n, k, device="cuda").to(E4M3)
    kb, nb = (k + 127) // 128, (n + 127) // 128
    return x, w, (torch.rand(kb, t, device="cuda") + 0.5).t(), torch.rand(g, kb, nb, device="cuda") + 0.5


def forward_rows(g, per, n, k):
    """Block and row-wise forwards, balanced and Zipf routing."""
    t = g * per
    x, w, sx_b, sw_b = block_operands(g, t, n, k)
    sx_r, sw_r = torch.rand(t, device="cuda") + 0.5, torch.rand(g, n, device="cuda") + 0.5
    for routing in ("balanced",) if "tails" in PASSES else ("balanced", "zipf"):  # zipf: the suites' skew
        offs = offs_of(counts_for(g, per, routing))
        for mode, code, sx, sw in (("block", 2, sx_b, sw_b), ("row", 1, sx_r, sw_r)):
            sweep(f"forward_{mode}", (g, per, n, k), ops.grouped_configs(0, E4M3, torch.bfloat16, 90, code),
                  lambda c: ops.grouped_mm_fp8(x, w, offs, sx, sw, code, torch.bfloat16, c), routing)


def order_rows(g, per, n, k):
    """Does the order of the experts' sizes matter? One interleaved comparison of the same
    Zipf counts in three orders (and balanced routing) through the heuristic's config."""
    x, w, sx, sw = block_operands(g, g * per, n, k)
    zipf = counts_for(g, per, "zipf")
    shuffled = [zipf[i] for i in torch.randperm(g, generator=torch.Generator().manual_seed(0)).tolist()]
    orders = {"zipf_largest_first": zipf, "zipf_smallest_first": zipf[::-1], "zipf_shuffled": shuffled,
              "balanced": counts_for(g, per, "balanced")}
    offs = {name: offs_of(c) for name, c in orders.items()}
    fns = {name: (lambda o=o: ops.grouped_mm_fp8(x, w, o, sx, sw, 2, torch.bfloat16, -1)) for name, o in offs.items()}
    for name, ms in timer.compare(fns).items():
        record("forward_block_order", name, (g, per, n, k), "heuristic", ms)


def sampled_power(fn, seconds=2.0):
    """fn run back to back for ~seconds while nvidia-smi samples power (W) and SM clock (MHz);
    (calls per second, mean W, max W, mean MHz, min MHz) over the samples of the busy phase."""
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=power.draw,clocks.sm", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    torch.cuda.synchronize()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    rate = calls / (time.perf_counter() - start)
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()
    samples = [tuple(float(v) for v in line.split(",")) for line in lines if line.count(",") == 1]
    busy = samples[len(samples) // 4:]  # skip the ramp (and the idle lead-in)
    watts, mhz = [w for w, _ in busy], [c for _, c in busy]
    return rate, sum(watts) / max(1, len(watts)), max(watts, default=0), sum(mhz) / max(1, len(mhz)), min(mhz, default=0)


def power_rows(g, per, n, k):
    """The block forward on random, all-zero and constant operands: same instructions, less
    switching. If the kernel is power-limited, the quiet data run at higher clocks."""
    x, w, sx, sw = block_operands(g, g * per, n, k)
    offs = offs_of(counts_for(g, per, "balanced"))
    data = {"random": (x, w), "x_zero": (torch.zeros_like(x), w),
            "constant": (torch.ones_like(x), torch.ones_like(w))}
    fns = {name: (lambda a=a, b=b: ops.grouped_mm_fp8(a, b, offs, sx, sw, 2, torch.bfloat16, -1))
           for name, (a, b) in data.items()}
    for name, ms in timer.compare(fns).items():
        record("forward_block_data", name, (g, per, n, k), "heuristic", ms)
    for name, fn in fns.items():
        rate, watts, peak, mhz, low = sampled_power(fn)
        record("forward_block_data_sustained", name, (g, per, n, k), "heuristic", 1e3 / rate,
               watts_mean=round(watts, 1), watts_max=peak, sm_mhz_mean=round(mhz), sm_mhz_min=low)


def ksweep_rows(g, per, n, _k):
    """Forwards of one (tokens, N) at growing K, and cuBLAS's dense row-wise FP8 GEMM of the same
    total shape beside them, interleaved per K."""
    t = g * per
    offs = offs_of(counts_for(g, per, "balanced"))
    for k in (128, 256, 512, 1024, 2048, 4096, 7168):
        x, w, sx_b, sw_b = block_operands(g, t, n, k)
        sx_r, sw_r = torch.rand(t, device="cuda") + 0.5, torch.rand(g, n, device="cuda") + 0.5
        w_dense, one = w[0].t(), torch.ones((), device="cuda")  # (K, N) column-major: what _scaled_mm takes
        fns = {"block": lambda: ops.grouped_mm_fp8(x, w, offs, sx_b, sw_b, 2, torch.bfloat16, -1),
               "row": lambda: ops.grouped_mm_fp8(x, w, offs, sx_r, sw_r, 1, torch.bfloat16, -1),
               # dense peers of the same total shape: row-wise (torch's own CUTLASS kernel on
               # sm_90) and per-tensor scales (cuBLAS)
               "torch_scaled_mm_row": lambda: torch._scaled_mm(x, w_dense, sx_r.view(-1, 1), sw_r[0].view(1, -1),
                                                               out_dtype=torch.bfloat16),
               "cublas_scaled_mm_tensor": lambda: torch._scaled_mm(x, w_dense, one, one, out_dtype=torch.bfloat16)}
        for name, ms in timer.compare(fns).items():
            record("forward_ksweep", name, (g, per, n, k), "heuristic", ms)


def wgrad_rows(g, per, n, k):
    """The block wgrad into FP32 (accumulating), balanced and Zipf routing: dy^T (N, Tp) and
    x^T (K, Tp), padded per expert, hold room for either routing."""
    tp = 128 * ((g * per + 127) // 128 + g)
    dy_t, x_t = torch.randn(n, tp, device="cuda").to(E4M3), torch.randn(k, tp, device="cuda").to(E4M3)
    s_dy, s_x = torch.rand(tp // 128, n, device="cuda") + 0.5, torch.rand(tp // 128, k, device="cuda") + 0.5
    out = torch.zeros(g, n, k, device="cuda")
    for routing in ("balanced", "zipf"):
        offs = offs_of(counts_for(g, per, routing))
        sweep("wgrad_block", (g, per, n, k), ops.grouped_configs(2, E4M3, torch.float32, 90, 2),
              lambda c: ops.grouped_mm_wgrad_fp8_out(dy_t, x_t, offs, s_dy, s_x, out, True, c), routing)


def plot_ksweep(rows, path_png):
    """Time against K of each forward in the K sweep, one panel per N; the fitted slope
    (us per 128 of K) and intercept (a tile wave's fixed cost times the waves) in the legend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    sweep_rows = [r for r in rows if r["op"] == "forward_ksweep"]
    ns = sorted({r["n"] for r in sweep_rows})
    if not ns:
        return
    fig, axes = plt.subplots(1, len(ns), figsize=(6 * len(ns), 4.5), squeeze=False)
    for ax, n in zip(axes[0], ns):
        for name in dict.fromkeys(r["routing"] for r in sweep_rows if r["n"] == n):
            pts = sorted((r["k"], r["ms"] * 1e3) for r in sweep_rows if r["n"] == n and r["routing"] == name)
            k, us = np.array(pts, dtype=float).T
            slope, fixed = np.polyfit(k[2:] / 128, us[2:], 1)  # K >= 512: past the launch-bound points
            ax.plot(k, us, "o-", label=f"{name}: {slope:.1f} us / 128 K + {fixed:.0f} us")
        g, per = sweep_rows[0]["g"], sweep_rows[0]["per"]
        ax.set(title=f"FP8 forward, {g} x {per} tokens, N {n}", xlabel="K", ylabel="us")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path_png, dpi=110)


if "--plot" in sys.argv:  # plot a recorded K sweep: --plot results.json
    with open(sys.argv[sys.argv.index("--plot") + 1]) as f:
        plot_ksweep(json.load(f)["rows"], sys.argv[sys.argv.index("--plot") + 1].replace(".json", ".png"))
    sys.exit(0)

for shape in TAIL_SHAPES if "tails" in PASSES else SHAPES:
    if "order" in PASSES:
        order_rows(*shape)
    if "power" in PASSES and shape in SHAPES[:2]:
        power_rows(*shape)
    if "ksweep" in PASSES and shape in SHAPES[:2]:
        ksweep_rows(*shape)
    if PASSES & {"tails", "forward"}:
        forward_rows(*shape)
    if "wgrad" in PASSES:
        wgrad_rows(*shape)
    torch.cuda.empty_cache()  # each pass's operands are freed on its return
OUT_JSON = ARGS[0] if ARGS else "fp8_grouped_sweep.json"
with open(OUT_JSON, "w") as f:
    json.dump({"env": env_info(1), "rows": rows}, f, indent=1)
if "ksweep" in PASSES:
    plot_ksweep(rows, OUT_JSON.replace(".json", ".png"))

"""Sweep: every compiled FP8 grouped configuration (build with DISTGEMM_TUNING_INSTANCES=ON)
on the DeepSeek-V3 MoE shapes, forward (block, row) and wgrad, with the heuristic's pick.
Prints TFLOP/s per config; writes JSON. A developer probe for choosing the default tiles:
the configurations of one shape are timed interleaved (distgemm.bench's Timer), so that clock
drift over the sweep falls on all of them alike."""

import json
import sys

import torch

import distgemm
from distgemm._library import ops
from distgemm.bench.common import Timer, env_info
from distgemm.bench.grouped_suite import counts_for

E4M3 = torch.float8_e4m3fn




def offs_of(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32).cuda()


# ``--only wgrad`` (or forward, tails, order): one pass only; the other arguments name the
# output file. tails: equal groups of 1-256 tokens, each group one partial tile (what a tile's
# rows past its group's end cost). order: the block forward's default config on Zipf routing
# with the experts in the suite's order (largest first), reversed and shuffled, and balanced.
ONLY = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
ARGS = [a for i, a in enumerate(sys.argv[1:], 1) if a != "--only" and sys.argv[i - 1] != "--only"]
TAIL_SHAPES = [(264, per, 4096, 7168) for per in (1, 64, 128, 192, 256)]

SHAPES = [(8, 4096, 4096, 7168), (8, 4096, 7168, 2048), (32, 1024, 4096, 7168),
          (32, 1024, 7168, 2048), (64, 512, 4096, 7168), (4, 8192, 7168, 2048)]
rows = []
timer = Timer()


def record(op, routing, shape, config, ms):
    """One timed row: printed, and kept for the JSON."""
    g, per, n, k = shape
    r = dict(op=op, routing=routing, g=g, per=per, n=n, k=k, config=config, ms=ms,
             tflops=2 * g * per * n * k / ms / 1e9)
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
    for routing in ("balanced",) if ONLY == "tails" else ("balanced", "zipf"):  # zipf: the suites' skew
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


for shape in TAIL_SHAPES if ONLY == "tails" else SHAPES:
    if ONLY == "order":
        order_rows(*shape)
    if ONLY in ("tails", None, "forward"):
        forward_rows(*shape)
    if ONLY in (None, "wgrad"):
        wgrad_rows(*shape)
    torch.cuda.empty_cache()  # each pass's operands are freed on its return
with open(ARGS[0] if ARGS else "fp8_grouped_sweep.json", "w") as f:
    json.dump({"env": env_info(1), "rows": rows}, f, indent=1)

"""Why the FP8 wgrad reads ~790 TFLOP/s in the FP8 suite and ~870 in the configuration sweep
(8 x 4096 tokens, N 4096, K 7168, accumulating into FP32): the same kernel timed interleaved
on the sweep's operands (random e4m3, random scales) and the suite's (bf16 values quantized by
distgemm.quantize_fp8, their own scales), through the registered op with one fixed config and
through distgemm.grouped_mm_wgrad. A developer probe; prints TFLOP/s, writes JSON."""

import json
import sys

import torch

import distgemm
from distgemm._library import ops
from distgemm.bench.common import Timer, env_info

E4M3 = torch.float8_e4m3fn
G, PER, N, K = 8, 4096, 4096, 7168
T = G * PER
TP = 128 * ((T + 127) // 128 + G)
offs = torch.full((G,), PER, device="cuda", dtype=torch.int64).cumsum(0).to(torch.int32)

# The sweep's operands: (Tp/128, R) scales, contiguous.
rand_dy, rand_x = torch.randn(N, TP, device="cuda").to(E4M3), torch.randn(K, TP, device="cuda").to(E4M3)
rand_sdy, rand_sx = torch.rand(TP // 128, N, device="cuda") + 0.5, torch.rand(TP // 128, K, device="cuda") + 0.5
# The suite's: bf16 values quantized per 128 tokens, transposed and padded per expert; scales
# (R, Tp/128) as quantize_fp8 returns them.
dy_bf, x_bf = torch.randn(T, N, device="cuda", dtype=torch.bfloat16), torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
q_dy, q_sdy = distgemm.quantize_fp8(dy_bf, (1, 128), transpose=True, offs=offs)
q_x, q_sx = distgemm.quantize_fp8(x_bf, (1, 128), transpose=True, offs=offs)
del dy_bf, x_bf
assert q_dy.shape == (N, TP) and q_x.shape == (K, TP), (q_dy.shape, q_x.shape)
out = torch.zeros(G, N, K, device="cuda")
config = ops.grouped_configs(2, E4M3, torch.float32, 90, 2).index("block_coop_128x128_c1x2")
flop = 2 * T * N * K


def op(dy, x, sdy_kn, sx_kn):
    return lambda: ops.grouped_mm_wgrad_fp8_out(dy, x, offs, sdy_kn, sx_kn, out, True, config)


fns = {
    "op_random": op(rand_dy, rand_x, rand_sdy, rand_sx),
    "op_quantized": op(q_dy, q_x, q_sdy.t().contiguous(), q_sx.t().contiguous()),
    "op_quantized_data_random_scales": op(q_dy, q_x, rand_sdy, rand_sx),
    "op_random_data_quantized_scales": op(rand_dy, rand_x, q_sdy.t().contiguous(), q_sx.t().contiguous()),
    "api_quantized": lambda: distgemm.grouped_mm_wgrad(q_dy, q_x, offs, scale_dy=q_sdy, scale_x=q_sx,
                                                       out=out, accumulate=True),
    "api_random": lambda: distgemm.grouped_mm_wgrad(rand_dy, rand_x, offs, scale_dy=rand_sdy.t(),
                                                    scale_x=rand_sx.t(), out=out, accumulate=True),
}
rows = []
for rep in range(2):
    for name, ms in Timer().compare(fns).items():
        rows.append(dict(rep=rep, name=name, ms=ms, tflops=flop / ms / 1e9))
        print(f"{rep} {name:36s} {ms:.3f} ms {flop / ms / 1e9:.0f} TFLOP/s", flush=True)
with open(sys.argv[1] if len(sys.argv) > 1 else "fp8_wgrad_data_probe.json", "w") as f:
    json.dump({"env": env_info(1), "shape": dict(g=G, per=PER, n=N, k=K), "rows": rows}, f, indent=1)

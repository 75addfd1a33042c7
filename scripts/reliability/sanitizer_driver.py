"""What scripts/reliability/sanitizer.sh runs under compute-sanitizer: every kernel family once
at tiny, tile-ragged shapes, each result checked against a plain reference (a kernel that
is silently wrong under the sanitizer fails the run too).

  python scripts/reliability/sanitizer_driver.py single [--all-configs]
      dense GEMM: bf16 / fp16 (out same or fp32, b K-major and N-major), float8 e4m3 (and
      e4m3 x e5m2, e5m2 x e4m3) with per-tensor and row-wise scales, fast accumulation on and
      off; the public op's copy / pad paths (odd K, odd N, transposed a, misaligned c).
      Grouped: forward, dgrad and wgrad on the CUTLASS backend (out bf16 / fp32, zero-token
      experts, unrouted tail rows, out= with accumulate) and the cuBLAS backend once.
      --all-configs: every compiled tile configuration of each (heuristic choice otherwise).
      FP8 and MoE: quantize_fp8 at every granularity, the FP8 grouped forward and wgrad, each
      MoE activation pass (forward and backward, every form), the weight copies and an FP8
      expert-MLP step, at ragged token counts with an empty expert.
      --fill-uninitialized: every tensor torch allocates is filled first (for initcheck).
  python scripts/reliability/sanitizer_driver.py tp
      2 ranks (spawned, NCCL): all_gather_matmul and matmul_reduce_scatter with
      DISTGEMM_TP_ALGO fused and decomposed (pieces 3t, reduce-scatter split in halves), bias
      and full c, float8 with scales (fused), and a CUDA graph captured before the
      workspaces grew and replayed after.

Exit code 0 when every check passed; the sanitizer's own findings are in its log.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import traceback

for _var, _val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                   ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_var] = _val
os.environ.setdefault("DISTGEMM_TIMEOUT_S", "120")  # instrumented kernels are slow

import torch  # noqa: E402

import distgemm  # noqa: E402
from distgemm._library import device_arch, ops  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FAILURES: list = []


def rnd(shape, dtype, dev, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * scale
    return (x.clamp(-240, 240) if dtype in (E4M3, E5M2) else x).to(dtype).to(dev)


def ref(a, b, c=None, alpha=1.0, beta=0.0, sa=None, sb=None):
    acc = a.double() @ b.double().T
    if sa is not None:
        acc = acc * sa.double().reshape(-1, 1)
    if sb is not None:
        acc = acc * sb.double().reshape(1, -1)
    return alpha * acc + (0 if c is None else beta * c.double())


def check(what, out, expected, tol):
    try:
        torch.cuda.synchronize()
        o = out.double()
        if not bool(torch.isfinite(o).all()):
            raise AssertionError("non-finite values")
        err = float((o - expected).norm() / expected.norm().clamp_min(1e-30))
        if err > tol:
            raise AssertionError(f"relative error {err:.3e} > {tol:.1e}")
    except Exception as e:
        FAILURES.append(f"{what}: {type(e).__name__}: {e}")
        print(f"FAIL {what}: {e}", flush=True)


def guarded(what, fn):
    try:
        fn()
    except Exception as e:
        FAILURES.append(f"{what}: raised {type(e).__name__}: {str(e)[:300]}")
        print(f"FAIL {what}: raised\n{traceback.format_exc()}", flush=True)


TOL = {BF16: 1e-2, FP16: 2e-3, FP32: 1e-4}


def dense(dev, all_configs: bool):
    arch = device_arch(dev)
    m, n, k = 130, 200, 272  # ragged against every tile shape (K: 16 bytes of FP8)
    combos = [(BF16, BF16, BF16, True, False), (FP16, FP16, FP16, True, False), (BF16, BF16, FP32, True, False),
              (FP16, FP16, FP32, True, False), (BF16, BF16, BF16, False, False), (FP16, FP16, FP16, False, False),
              (E4M3, E4M3, BF16, True, False), (E4M3, E4M3, BF16, True, True), (E4M3, E4M3, FP32, True, False),
              (E4M3, E5M2, BF16, True, False), (E5M2, E4M3, FP16, True, False)]
    for a_dt, b_dt, out_dt, k_major, fast in combos:
        fp8 = a_dt in (E4M3, E5M2)
        a = rnd((m, k), a_dt, dev, seed=1)
        b = rnd((n, k), b_dt, dev, 0.5, seed=2) if k_major else rnd((k, n), b_dt, dev, 0.5, seed=2).T
        c = rnd((m, n), out_dt, dev, seed=3)
        sa = (torch.rand(m, device=dev) + 0.5) if fp8 else None
        sb = (torch.rand(n, device=dev) + 0.5) if fp8 else None
        names = ops.gemm_configs(a_dt, b_dt, out_dt, k_major, arch, fast)
        expected = ref(a, b, c, 1.5, 0.5, sa, sb)
        tol = max(TOL[out_dt], 8e-3 if fast else (2e-3 if fp8 else 0))
        if not names:  # no instance of this combination: the public op picks a wider output
            what = f"gemm {a_dt}x{b_dt}->{out_dt} k_major={k_major} fast={fast} (public op)"
            guarded(what, lambda: check(what, distgemm.gemm(a, b, c, alpha=1.5, beta=0.5, out_dtype=out_dt,
                                                            scale_a=sa, scale_b=sb, use_fast_accum=fast),
                                        expected, tol))
            continue
        for cfg in (list(range(len(names))) if all_configs else [-1]):
            what = f"gemm {a_dt}x{b_dt}->{out_dt} k_major={k_major} fast={fast} config={names[cfg] if cfg >= 0 else 'auto'}"
            guarded(what, lambda: check(what, ops.gemm(a, b, c, 1.5, 0.5, out_dt, sa, sb, fast, cfg, 1), expected, tol))
    # the public op's copy / pad paths
    a, b = rnd((96, 20), BF16, dev, seed=4), rnd((40, 20), BF16, dev, seed=5)
    guarded("gemm odd K", lambda: check("gemm odd K", distgemm.gemm(a, b), ref(a, b), TOL[BF16]))
    a, b = rnd((96, 64), BF16, dev, seed=6), rnd((33, 64), BF16, dev, seed=7)
    bias = rnd((33,), BF16, dev, seed=8)
    guarded("gemm odd N + bias", lambda: check("gemm odd N + bias", distgemm.gemm(a, b, bias, beta=1.0),
                                                 ref(a, b, bias, 1.0, 1.0), TOL[BF16]))
    at = rnd((64, 96), FP16, dev, seed=9).T
    b = rnd((48, 64), FP16, dev, seed=10)
    c = rnd((96 * 48 + 1,), FP16, dev, seed=11)[1:].view(96, 48)  # misaligned c
    guarded("gemm transposed a, misaligned c", lambda: check(
        "gemm transposed a, misaligned c", distgemm.gemm(at, b, c, alpha=0.5, beta=2.0), ref(at, b, c, 0.5, 2.0), TOL[FP16]))
    one = torch.ones(1, device=dev)
    a8, b8 = rnd((70, 128), E4M3, dev, seed=12), rnd((48, 128), E4M3, dev, seed=13).T.contiguous().T  # N-major fp8 b
    guarded("gemm fp8 N-major b", lambda: check("gemm fp8 N-major b", distgemm.gemm(a8, b8, scale_a=one, scale_b=one), ref(a8, b8), 1e-2))


def _counts_offs(groups, tokens, dev, tail=5):
    counts = [0] * groups
    routed = tokens - tail
    for i in range(routed):
        counts[(i * 7) % groups if groups > 1 else 0] += 1
    if groups > 2:
        counts[1] += counts[0]
        counts[0] = 0  # a zero-token expert
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)
    return counts, offs


def _grouped_ref(x, w, counts, trans_w):
    outs, s = [], 0
    for g, c in enumerate(counts):
        wg = w[g].double()
        outs.append(x[s:s + c].double() @ (wg.T if trans_w else wg))
        s += c
    return torch.cat(outs)


def _wgrad_ref(dy, x, counts):
    outs, s = [], 0
    for c in counts:
        outs.append(dy[s:s + c].double().T @ x[s:s + c].double())
        s += c
    return torch.stack(outs)


def grouped(dev, all_configs: bool):
    arch = device_arch(dev)
    groups, tokens, n, k = 5, 203, 136, 72
    counts, offs = _counts_offs(groups, tokens, dev)
    routed = sum(counts)
    for dtype in (BF16, FP16):
        x, dy = rnd((tokens, k), dtype, dev, seed=20), rnd((tokens, n), dtype, dev, seed=21)
        for kind, trans_w in ((0, True), (1, False)):  # forward: w (G, N, K); dgrad: w (G, K, N)
            w = rnd((groups, n, k) if trans_w else (groups, k, n), dtype, dev, 0.25, seed=22)
            expected = _grouped_ref(x, w, counts, trans_w)
            for out_dt in (dtype, FP32):
                names = ops.grouped_configs(kind, dtype, out_dt, arch)
                if not names:  # not built: the public API takes another backend (tested elsewhere)
                    continue
                for cfg in (list(range(len(names))) if all_configs else [-1]):
                    what = f"grouped kind={kind} {dtype}->{out_dt} config={names[cfg] if cfg >= 0 else 'auto'}"
                    guarded(what, lambda: check(what, ops.grouped_mm(x, w, offs, out_dt, trans_w, 0, cfg)[:routed],
                                                expected, TOL[out_dt]))
            out = torch.randn(tokens, n, device=dev)
            base = out[:routed].double().clone()
            what = f"grouped kind={kind} {dtype} out= accumulate"
            guarded(what, lambda: check(what, distgemm.grouped_mm(x, w, offs, out=out, accumulate=True,
                                                                  trans_w=trans_w)[:routed], base + expected, 1e-4))
        expected = _wgrad_ref(dy, x, counts)
        for out_dt in (FP32, dtype):
            names = ops.grouped_configs(2, dtype, out_dt, arch)
            if not names:  # not built: the public API takes another backend (tested elsewhere)
                continue
            for cfg in (list(range(len(names))) if all_configs else [-1]):
                what = f"wgrad {dtype}->{out_dt} config={names[cfg] if cfg >= 0 else 'auto'}"
                guarded(what, lambda: check(what, ops.grouped_mm_wgrad(dy, x, offs, out_dt, 0, cfg), expected,
                                            TOL[out_dt]))
        main_grad = torch.randn(groups, n, k, device=dev)
        base = main_grad.double().clone()
        what = f"wgrad {dtype} accumulate into main_grad"
        guarded(what, lambda: check(what, distgemm.grouped_mm_wgrad(dy, x, offs, out=main_grad, accumulate=True),
                                    base + expected, 1e-4))
        with distgemm.settings(grouped_backend="cublas"):
            what = f"grouped cuBLAS backend {dtype}"
            w = rnd((groups, n, k), dtype, dev, 0.25, seed=24)
            guarded(what, lambda: check(what, distgemm.grouped_mm(x, w, offs, out_dtype=FP32)[:routed],
                                        _grouped_ref(x, w, counts, True), 1e-4))
            guarded(what + " wgrad", lambda: check(what + " wgrad", distgemm.grouped_mm_wgrad(dy, x, offs),
                                                   expected, 1e-4))


def moe_and_fp8(dev):
    """FP8 quantization (every granularity, the transposed per-group copy), the FP8 grouped
    forward and wgrad, the MoE passes (each activation and its backward, every form) and weight
    copies, and the FP8 expert MLP's step, at ragged token counts with an empty expert."""
    from distgemm import moe

    counts = [130, 0, 1, 255]
    offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    tokens, hidden, ffn = sum(counts), 256, 384
    x = rnd((tokens, hidden), BF16, dev, seed=100)
    from distgemm.grouped_fp8 import dequantize_blocks

    blocks = {"tensor": (tokens, hidden), "row": (1, hidden), (1, 128): (1, 128), (128, 128): (128, 128)}
    for gran, (br, bc) in blocks.items():
        what = f"quantize_fp8 {gran}"

        def dequantized(gran=gran, br=br, bc=bc):
            q, s = distgemm.quantize_fp8(x, gran)
            return dequantize_blocks(q, s.reshape(-(-tokens // br), -(-hidden // bc)), br, bc)
        guarded(what, lambda: check(what, dequantized(), x.double(), 0.08))
    xt8, sxt = distgemm.quantize_fp8(x, (1, 128), transpose=True, offs=offs)
    for kind, dy in (("identity", None), ("swiglu", None), ("gelu", None),
                     ("swiglu", rnd((tokens, ffn), BF16, dev, seed=101)), ("gelu", rnd((tokens, ffn), BF16, dev, seed=102))):
        h = rnd((tokens, 2 * ffn if kind == "swiglu" else (hidden if kind == "identity" else ffn)), BF16, dev, seed=103)
        what = f"moe.activation {kind}{' backward' if dy is not None else ''}"

        def forms(kind=kind, h=h, dy=dy):
            out = moe.activation(h, kind, dy=dy, offs=offs, bf16=True, fp8_rows=True, fp8_transposed=True)
            rows8, _ = distgemm.quantize_fp8(out.y, (1, 128))
            if not torch.equal(out.y_fp8.view(torch.uint8), rows8.view(torch.uint8)):
                raise AssertionError("the FP8 rows differ from quantize_fp8 of the bf16 values")
            return out.y.float()
        guarded(what, lambda: check(what, forms(), forms().double(), 0.0))
    w = rnd((4, ffn, hidden), BF16, dev, 0.1, seed=104)
    what = "moe.quantize_weight both copies"
    guarded(what, lambda: check(what, moe.quantize_weight(w, "block")[2].float().transpose(1, 2),
                                moe.quantize_weight(w, "block")[0].double(), 0.0))
    x8, sx = distgemm.quantize_fp8(x, (1, 128))
    w8, sw = distgemm.quantize_fp8(w, (128, 128))
    ref_fwd = torch.cat([x[a:b].double() @ w[g].double().T for g, (a, b) in
                         enumerate(zip([0] + offs.tolist()[:-1], offs.tolist()))])
    what = "grouped_mm fp8 block forward"
    guarded(what, lambda: check(what, distgemm.grouped_mm(x8, w8, offs, scale_x=sx, scale_w=sw), ref_fwd, 0.08))
    dy = rnd((tokens, ffn), BF16, dev, seed=105)
    dyt8, sdyt = distgemm.quantize_fp8(dy, (1, 128), transpose=True, offs=offs)
    ref_wgrad = torch.stack([dy[a:b].double().T @ x[a:b].double() for a, b in
                             zip([0] + offs.tolist()[:-1], offs.tolist())])
    what = "grouped_mm_wgrad fp8 block"
    guarded(what, lambda: check(what, distgemm.grouped_mm_wgrad(dyt8, xt8, offs, scale_dy=sdyt, scale_x=sxt),
                                ref_wgrad, 0.08))
    what = "grouped_mlp fp8 block step"

    def step(fp8):
        w1 = rnd((4, 2 * ffn, hidden), BF16, dev, 0.05, seed=106).requires_grad_()
        w2 = rnd((4, hidden, ffn), BF16, dev, 0.05, seed=107).requires_grad_()
        xg = x.clone().requires_grad_()
        y = moe.grouped_mlp(xg, offs, w1, w2, activation="swiglu", fp8=fp8)
        y.float().square().sum().backward()
        return torch.cat([t.detach().reshape(-1).float() for t in (y, xg.grad, w1.grad, w2.grad)])
    guarded(what, lambda: check(what, step("block"), step(None).double(), 0.15))


# ---------------------------------------------------------------- tensor parallel (2 ranks)


def _tp_rank(rank, world, port, errors):
    import torch.distributed as dist

    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    try:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=dev)
        m, k, n = 100, 256, 264
        for algo in ("fused", "decomposed"):
            overrides = {"tp_algo": algo}
            overrides.update({"rs_split_gflops": 0} if algo == "fused" else {"tp_pieces": "3t"})
            with distgemm.settings(**overrides):
                for dtype in (BF16, FP16):
                    a_full = rnd((m * world, k), dtype, dev, seed=30)
                    b = rnd((n, k), dtype, dev, 0.1, seed=31 + rank)
                    bias = rnd((n,), dtype, dev, seed=33)
                    what = f"all_gather_matmul {algo} {dtype}"
                    out, gathered = distgemm.all_gather_matmul(a_full[rank * m:(rank + 1) * m], b, c=bias, beta=1.0,
                                                               return_gathered=True)
                    check(what, out, ref(a_full, b, bias, 1.0, 1.0), TOL[dtype])
                    if not torch.equal(gathered, a_full):
                        FAILURES.append(f"{what}: return_gathered differs")
                    parts = [(rnd((m * world, k), dtype, dev, seed=40 + q), rnd((n, k), dtype, dev, 0.1, seed=50 + q))
                             for q in range(world)]
                    c = rnd((m, n), dtype, dev, seed=60 + rank)
                    what = f"matmul_reduce_scatter {algo} {dtype}"
                    out = distgemm.matmul_reduce_scatter(parts[rank][0], parts[rank][1], c=c, beta=-1.0, out_dtype=FP32)
                    expected = sum(ref(a, bb) for a, bb in parts)[rank * m:(rank + 1) * m] - c.double()
                    check(what, out, expected, 1e-3)
        # float8 (the fused algorithm) with row-wise / per-tensor scales
        a_full = rnd((m * world, k), E4M3, dev, seed=70)
        b = rnd((n, k), E4M3, dev, seed=71 + rank)
        sa = torch.rand(m * world, generator=torch.Generator().manual_seed(72)).to(dev) + 0.5
        sb = torch.rand(n, generator=torch.Generator().manual_seed(73 + rank)).to(dev) + 0.5
        out = distgemm.all_gather_matmul(a_full[rank * m:(rank + 1) * m], b, scale_a=sa[rank * m:(rank + 1) * m].clone(),
                                         scale_b=sb)
        check("all_gather_matmul fp8", out, ref(a_full, b, sa=sa, sb=sb), 1e-2)
        parts = [rnd((m * world, k), E4M3, dev, seed=80 + q) for q in range(world)]
        bs = [rnd((n, k), E4M3, dev, seed=90 + q) for q in range(world)]
        scale = torch.full((1,), 0.5 + rank, device=dev)
        out = distgemm.matmul_reduce_scatter(parts[rank], bs[rank], scale_a=scale)
        expected = sum(ref(p, bb) * (0.5 + q) for q, (p, bb) in enumerate(zip(parts, bs)))[rank * m:(rank + 1) * m]
        check("matmul_reduce_scatter fp8", out, expected, 1e-2)
        # CUDA graph captured at a small shape, replayed after the workspaces grew
        a = rnd((64, 128), BF16, dev, seed=100)
        a_all = rnd((64 * world, 128), BF16, dev, seed=100)
        a.copy_(a_all[rank * 64:(rank + 1) * 64])
        b = rnd((136, 128), BF16, dev, 0.1, seed=101 + rank)
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            distgemm.all_gather_matmul(a, b)
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = distgemm.all_gather_matmul(a, b)
        big = rnd((1024, 1024), BF16, dev, seed=102)
        distgemm.all_gather_matmul(big, rnd((512, 1024), BF16, dev, seed=103))  # grows the workspace
        torch.cuda.synchronize(dev)
        dist.barrier()
        graph.replay()
        check("graph replay after workspace growth", out, ref(a_all, b), TOL[BF16])
        torch.cuda.synchronize(dev)
        distgemm.check_errors(dev)
        dist.barrier()
    except Exception:
        FAILURES.append(traceback.format_exc())
    if FAILURES:
        errors.put((rank, "\n".join(FAILURES)))
    if dist.is_initialized():
        dist.destroy_process_group()


def tp(world: int = 2) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_tp_rank, args=(r, world, port, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            FAILURES.append(f"rank {r} did not finish")
        elif p.exitcode != 0:
            FAILURES.append(f"rank {r} exited with {p.exitcode}")
    while not errors.empty():
        r, text = errors.get()
        FAILURES.append(f"rank {r}:\n{text}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=["single", "tp"])
    ap.add_argument("--all-configs", action="store_true")
    ap.add_argument("--fill-uninitialized", action="store_true",
                    help="every tensor torch allocates filled first (NaN), so that initcheck reports only reads "
                         "of memory nothing wrote (its TMA stores do not count as writes)")
    args = ap.parse_args()
    if args.fill_uninitialized:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
    if args.part == "single":
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        dense(dev, args.all_configs)
        grouped(dev, args.all_configs)
        moe_and_fp8(dev)
        torch.cuda.synchronize()
    else:
        tp()
    print(f"sanitizer driver ({args.part}): {len(FAILURES)} failed checks", flush=True)
    for f in FAILURES:
        print(f, flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())

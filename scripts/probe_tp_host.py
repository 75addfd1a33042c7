"""Session-3 probe (torchrun, 2 ranks): where the host time of a TP call goes, and what cuBLAS
loses when a TP GEMM is cut into row chunks (the decomposed all-gather / reduce-scatter)."""
import cProfile, io, json, os, pstats, sys, time

import torch
import torch.distributed as dist

import distgemm
from distgemm.bench.common import Timer

rank = int(os.environ["RANK"]); world = int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
out = {}
bf = torch.bfloat16
a_ag = torch.randn(2048, 4096, device="cuda", dtype=bf); b_ag = torch.randn(3072, 4096, device="cuda", dtype=bf)
a_rs = torch.randn(4096, 2048, device="cuda", dtype=bf); b_rs = torch.randn(4096, 2048, device="cuda", dtype=bf)
calls = {"ag": lambda: distgemm.all_gather_matmul(a_ag, b_ag),
         "rs": lambda: distgemm.matmul_reduce_scatter(a_rs, b_rs)}
for name, fn in calls.items():
    for _ in range(5): fn()
    torch.cuda.synchronize(); dist.barrier()
    torch.cuda._sleep(50_000_000)  # keep the GPU busy so enqueue never blocks
    t0 = time.perf_counter()
    for _ in range(40): fn()
    host = (time.perf_counter() - t0) / 40 * 1e3
    torch.cuda.synchronize(); dist.barrier()
    torch.cuda._sleep(50_000_000)
    pr = cProfile.Profile(); pr.enable()
    for _ in range(40): fn()
    pr.disable()
    torch.cuda.synchronize(); dist.barrier()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    out[name] = {"host_ms": host}
    if rank == 0:
        print(f"== {name}: host {host:.3f} ms/call"); print(s.getvalue()[:6000], flush=True)
# cuBLAS on row chunks of the TP GEMMs
timer = Timer()
shapes = [(4096, 3072, 4096), (8192, 3072, 4096), (16384, 3072, 4096), (4096, 14336, 4096), (8192, 14336, 4096),
          (4096, 4096, 2048), (16384, 4096, 2048), (4096, 4096, 7168), (16384, 4096, 7168),
          (8192, 28672, 8192), (16384, 28672, 8192), (8192, 5120, 8192), (16384, 8192, 4096), (8192, 8192, 14336)]
rows = []
for m, n, k in shapes:
    a = torch.randn(m, k, device="cuda", dtype=bf); b = torch.randn(n, k, device="cuda", dtype=bf)
    o = torch.empty(m, n, device="cuda", dtype=bf)
    def chunks(p):
        h = m // p
        def f():
            for i in range(p):
                torch.matmul(a[i * h:(i + 1) * h], b.T, out=o[i * h:(i + 1) * h])
        return f
    t = timer.compare({"full": chunks(1), "halves": chunks(2), "quarters": chunks(4)}, reps=10)
    ours = timer(lambda: distgemm.gemm(a, b), reps=10)
    rows.append({"mnk": [m, n, k], **{kk: round(v, 4) for kk, v in t.items()}, "ours": round(ours, 4)})
    if rank == 0:
        print(f"{m}x{n}x{k}: full {t['full']:.3f} halves {t['halves']/t['full']:.3f}x quarters {t['quarters']/t['full']:.3f}x ours {ours/t['full']:.3f}x", flush=True)
out["chunks"] = rows
if rank == 0 and os.environ.get("PROBE_OUT"):
    json.dump(out, open(os.environ["PROBE_OUT"], "w"), indent=1)
dist.barrier(); dist.destroy_process_group()

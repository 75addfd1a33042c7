"""Session-3 probe (torchrun, 2 ranks): host time per call and the CUDA runtime calls behind it
(torch.profiler), for the TP ops (both algorithms) and the grouped GEMM vs torch._grouped_mm."""
import faulthandler, json, os, sys, time

import torch
import torch.distributed as dist

import distgemm

faulthandler.dump_traceback_later(200, exit=True)
rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
bf = torch.bfloat16
a_ag = torch.randn(2048, 4096, device="cuda", dtype=bf); b_ag = torch.randn(3072, 4096, device="cuda", dtype=bf)
a_rs = torch.randn(4096, 2048, device="cuda", dtype=bf); b_rs = torch.randn(4096, 2048, device="cuda", dtype=bf)
g, mean, n, k = 8, 512, 768, 2048
offs = torch.full((g,), mean, device="cuda", dtype=torch.int64).cumsum(0).to(torch.int32)
x = torch.randn(g * mean, k, device="cuda").to(bf); w = (torch.randn(g, n, k, device="cuda") * 0.05).to(bf)


def algo(name, fn):
    def run():
        os.environ["DISTGEMM_TP_ALGO"] = name
        return fn()
    return run


calls = {
    "ag_fused": algo("fused", lambda: distgemm.all_gather_matmul(a_ag, b_ag)),
    "ag_decomposed": algo("decomposed", lambda: distgemm.all_gather_matmul(a_ag, b_ag)),
    "rs_fused": algo("fused", lambda: distgemm.matmul_reduce_scatter(a_rs, b_rs)),
    "rs_decomposed": algo("decomposed", lambda: distgemm.matmul_reduce_scatter(a_rs, b_rs)),
    "grouped_ours": lambda: distgemm.grouped_mm(x, w, offs),
    "grouped_torch": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
    "dense_ours": lambda: distgemm.gemm(a_rs, b_rs),
    "dense_torch": lambda: torch.matmul(a_rs, b_rs.T),
}
out = {}
for name, fn in calls.items():
    for _ in range(5): fn()
    torch.cuda.synchronize(); dist.barrier()
    torch.cuda._sleep(100_000_000)  # the GPU stays busy: enqueue never waits on it
    t0 = time.perf_counter()
    for _ in range(30): fn()
    host = (time.perf_counter() - t0) / 30 * 1e3
    torch.cuda.synchronize(); dist.barrier()
    torch.cuda._sleep(100_000_000)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10): fn()
    torch.cuda.synchronize(); dist.barrier()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60)
    out[name] = {"host_ms": round(host, 4)}
    if rank == 0:
        print(f"== {name}: host {host * 1e3:.1f} us/call", flush=True)
        print(table, flush=True)
if rank == 0 and os.environ.get("PROBE_OUT"):
    json.dump(out, open(os.environ["PROBE_OUT"], "w"), indent=1)
dist.barrier(); dist.destroy_process_group()
faulthandler.cancel_dump_traceback_later()

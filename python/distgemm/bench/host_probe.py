"""Where a call's host time goes: CPU microseconds to enqueue one call (the GPU kept busy, so
enqueueing never waits on it) of the public op and of the raw torch.ops entry (no Python
checks), per dense tile config, for the grouped GEMM and for the TP ops with each algorithm.
``python -m distgemm.bench.host_probe`` (one GPU), or under ``torchrun --nproc-per-node=2``."""
import faulthandler, json, os

import torch

import distgemm
from distgemm._library import ops

from .common import host_ms

faulthandler.dump_traceback_later(150, exit=True)


def host_us(fn):
    return round(host_ms(fn, calls=40) * 1e3, 1)


res = {}
tp = "RANK" in os.environ
if tp:
    import torch.distributed as dist
    rank = int(os.environ["RANK"]); torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
bf = torch.bfloat16
a = torch.randn(4096, 2048, device="cuda", dtype=bf); b = torch.randn(4096, 2048, device="cuda", dtype=bf)
if not tp:
    res["torch_matmul"] = host_us(lambda: torch.matmul(a, b.T))
    res["distgemm_gemm"] = host_us(lambda: distgemm.gemm(a, b))
    res["ops_gemm_auto"] = host_us(lambda: ops.gemm(a, b, None, 1.0, 0.0, bf, None, None, False))
    names = ops.gemm_configs(bf, bf, bf, True, 90, False)
    for i, name in enumerate(names):
        try:
            res[f"ops_gemm[{name}]"] = host_us(lambda: ops.gemm(a, b, None, 1.0, 0.0, bf, None, None, False, i))
        except Exception as e:  # noqa
            res[f"ops_gemm[{name}]"] = str(e)[:80]
    g, mean, n, k = 8, 512, 768, 2048
    offs = torch.full((g,), mean, device="cuda", dtype=torch.int64).cumsum(0).to(torch.int32)
    x = torch.randn(g * mean, k, device="cuda").to(bf); w = torch.randn(g, n, k, device="cuda").to(bf)
    res["grouped_ours"] = host_us(lambda: distgemm.grouped_mm(x, w, offs))
    res["grouped_torch"] = host_us(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))
    res["empty_launch"] = host_us(lambda: torch.empty(1, device="cuda").zero_())
else:
    from distgemm import tp as tpm
    a_ag = torch.randn(2048, 4096, device="cuda", dtype=bf); b_ag = torch.randn(3072, 4096, device="cuda", dtype=bf)
    for algo_name, algo in (("fused", 1), ("decomposed", 2)):
        os.environ["DISTGEMM_TP_ALGO"] = algo_name
        res[f"ag_{algo_name}"] = host_us(lambda: distgemm.all_gather_matmul(a_ag, b_ag))
        res[f"rs_{algo_name}"] = host_us(lambda: distgemm.matmul_reduce_scatter(a, b))
        ws = tpm._workspaces[(dist.group.WORLD.group_name, tpm._AG)]
        res[f"ops_ag_{algo_name}"] = host_us(lambda: ops.tp_all_gather_gemm(
            a_ag, b_ag, None, 1.0, 0.0, bf, None, None, False, rank, 2, ws.ptrs, ws.nbytes, 60.0, False, algo))
        wr = tpm._workspaces[(dist.group.WORLD.group_name, tpm._RS)]
        res[f"ops_rs_{algo_name}"] = host_us(lambda: ops.tp_gemm_reduce_scatter(
            a, b, None, 1.0, 0.0, bf, None, None, False, rank, 2, wr.ptrs, wr.nbytes, 60.0, algo))
    dist.barrier()
if not tp or rank == 0:
    print(json.dumps(res, indent=1), flush=True)
    if os.environ.get("PROBE_OUT"):
        json.dump(res, open(os.environ["PROBE_OUT"], "w"), indent=1)
if tp:
    dist.destroy_process_group()

"""Where a call's host time goes: CPU microseconds to enqueue one call (the GPU kept busy, so
enqueueing never waits on it) of the public op and of the raw torch.ops entry (no Python
checks), per dense tile config, for the grouped GEMM and for the TP ops with each algorithm.
``python scripts/dev/host_probe.py`` (one GPU), or under ``torchrun --nproc-per-node=2``."""

from __future__ import annotations

import faulthandler
import json
import os

import torch

import distgemm
from distgemm._library import ops

from distgemm.bench.common import env_info, host_ms, with_settings


def host_us(fn) -> float:
    return round(host_ms(fn, calls=40) * 1e3, 1)


def single_gpu() -> dict:
    bf = torch.bfloat16
    a = torch.randn(4096, 2048, device="cuda", dtype=bf)
    b = torch.randn(4096, 2048, device="cuda", dtype=bf)
    res = {"torch_matmul": host_us(lambda: torch.matmul(a, b.T)),
           "distgemm_gemm": host_us(lambda: distgemm.gemm(a, b)),
           # which path that repeated call took: a cuBLAS-backed call costs our Python plus
           # torch.mm, a CUTLASS one our Python plus the op (the sweep's rows are mostly the former)
           "distgemm_gemm_backend": distgemm.autotune.last_backend(),
           "ops_gemm_auto": host_us(lambda: ops.gemm(a, b, None, 1.0, 0.0, bf, None, None, False))}
    for i, name in enumerate(ops.gemm_configs(bf, bf, bf, True, 90, False)):
        try:
            res[f"ops_gemm[{name}]"] = host_us(lambda: ops.gemm(a, b, None, 1.0, 0.0, bf, None, None, False, i))
        except Exception as e:  # a config that cannot run this shape says so
            res[f"ops_gemm[{name}]"] = str(e)[:80]
    g, mean, n, k = 8, 512, 768, 2048
    offs = torch.full((g,), mean, device="cuda", dtype=torch.int64).cumsum(0).to(torch.int32)
    x = torch.randn(g * mean, k, device="cuda").to(bf)
    w = torch.randn(g, n, k, device="cuda").to(bf)
    res["grouped_ours"] = host_us(lambda: distgemm.grouped_mm(x, w, offs))
    res["grouped_ours_backend"] = distgemm.autotune.last_backend()  # the autotuner's pick: ours or torch's
    res["grouped_ops"] = host_us(lambda: ops.grouped_mm(x, w, offs, bf, True, 0))  # no Python checks
    res["grouped_torch"] = host_us(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))
    out = torch.empty(g * mean, n, device="cuda", dtype=bf)
    res["grouped_ops_out"] = host_us(lambda: ops.grouped_mm_out(x, w, offs, out, False, True, 0))  # no allocation
    res["empty_launch"] = host_us(lambda: torch.empty(1, device="cuda").zero_())
    return res


def tensor_parallel(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from distgemm import tp

    bf = torch.bfloat16
    a_ag = torch.randn(2048, 4096, device="cuda", dtype=bf)
    b_ag = torch.randn(3072, 4096, device="cuda", dtype=bf)
    a_rs = torch.randn(4096, 2048, device="cuda", dtype=bf)
    b_rs = torch.randn(4096, 2048, device="cuda", dtype=bf)
    res = {}
    for name in ("fused", "decomposed"):
        algo = tp._ALGOS[name]
        res[f"ag_{name}"] = host_us(with_settings({"tp_algo": name},
                                             lambda: distgemm.all_gather_matmul(a_ag, b_ag)))
        res[f"rs_{name}"] = host_us(with_settings({"tp_algo": name},
                                             lambda: distgemm.matmul_reduce_scatter(a_rs, b_rs)))
        ag = rs = tp._state(dist.group.WORLD).workspace  # one workspace serves both ops
        res[f"ops_ag_{name}"] = host_us(lambda: ops.tp_all_gather_gemm(
            a_ag, b_ag, None, 1.0, 0.0, bf, None, None, False, rank, world, ag.ptrs, ag.nbytes, 60.0, False, algo))
        res[f"ops_rs_{name}"] = host_us(lambda: ops.tp_gemm_reduce_scatter(
            a_rs, b_rs, None, 1.0, 0.0, bf, None, None, False, rank, world, rs.ptrs, rs.nbytes, 60.0, algo))
    dist.barrier()
    return res


def main() -> None:
    faulthandler.dump_traceback_later(150, exit=True)  # a hang prints every thread's stack
    if "RANK" in os.environ:
        import torch.distributed as dist

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
        res = tensor_parallel(rank, world)
        dist.destroy_process_group()
    else:
        rank, res = 0, single_gpu()
    if rank == 0:
        res = {"env": env_info(int(os.environ.get("WORLD_SIZE", "1"))), "results": res}
        print(json.dumps(res, indent=1), flush=True)
        if os.environ.get("PROBE_OUT"):
            with open(os.environ["PROBE_OUT"], "w") as f:
                json.dump(res, f, indent=1)
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()

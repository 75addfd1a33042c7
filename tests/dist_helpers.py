"""Spawning ranks for the distributed tests: each test body runs in `world` fresh processes
(one per GPU for NCCL, CPU for gloo) and any rank's exception fails the test."""

import faulthandler
import gc
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, backend, port, fn, args, env, errors):
    import distgemm

    os.environ.update(SAFE_ENV)
    os.environ.update(env)  # the parent's settings for this rank, read again here
    distgemm.reload_settings()
    faulthandler.enable()  # a crashing rank prints where it was
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world,
                                device_id=torch.device("cuda", rank) if backend == "nccl" else None)
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:  # reported to the parent, which fails the test
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # Garbage cycles holding a group (autograd graphs, modules) freed now, not while the
        # interpreter finalizes, when its store's and backend's threads can no longer end cleanly.
        gc.collect()


def run_ranks(fn, world: int, backend: str, *args, env=None, timeout: float = 600):
    """Runs fn(rank, world, *args) on `world` spawned ranks; raises with the failing ranks'
    tracebacks."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, backend, port, fn, args, env or {}, errors))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    reports = []
    while not errors.empty():
        reports.append(errors.get())
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout} s")
    if reports or any(p.exitcode != 0 for p in procs):
        detail = "\n".join(f"--- rank {r}:\n{tb}" for r, tb in sorted(reports))
        raise AssertionError(f"ranks failed (exit codes {[p.exitcode for p in procs]}):\n{detail}")


"""How fast can a rank move a shard to / from a peer while a GEMM holds every SM?

``torchrun --nproc-per-node=2 scripts/dev/copy_probe.py``. Every rank copies at the same
time (as in an all-gather), through symmetric-memory buffers, with

- ``memcpy``: plain ``cudaMemcpyAsync`` (the driver may run device-to-device copies on SMs),
- ``ce``: ``cudaMemcpyBatchAsync`` with ``cudaMemcpyFlagPreferOverlapWithCompute`` (copy engine),

in three directions (push = local -> peer, pull = peer -> local, local -> local), alone and
concurrent with a cuBLAS GEMM queued first on another stream. Prints GB/s per case and the
GEMM's slow-down, and whether each mode can be captured in a CUDA graph."""

from __future__ import annotations

import ctypes
import json
import os

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from distgemm.bench.common import median


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_hint", _MemLocation),
                ("dst_loc_hint", _MemLocation), ("flags", ctypes.c_uint)]


_rt = ctypes.CDLL("libcudart.so.13")
_STREAM_ORDER, _PREFER_OVERLAP, _D2D = 1, 1, 3


def _check(code: int, what: str) -> None:
    if code != 0:
        _rt.cudaGetLastError()
        raise RuntimeError(f"{what} failed with cudaError {code}")


def copy(dst: int, src: int, nbytes: int, mode: str, stream: torch.cuda.Stream) -> None:
    handle = ctypes.c_void_p(stream.cuda_stream)
    if mode == "memcpy":
        _check(_rt.cudaMemcpyAsync(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes),
                                   _D2D, handle), "cudaMemcpyAsync")
        return
    dsts = (ctypes.c_void_p * 1)(dst)
    srcs = (ctypes.c_void_p * 1)(src)
    sizes = (ctypes.c_size_t * 1)(nbytes)
    attrs = (_MemcpyAttributes * 1)()
    attrs[0].src_access_order = _STREAM_ORDER
    attrs[0].flags = _PREFER_OVERLAP
    idx = (ctypes.c_size_t * 1)(0)
    _check(_rt.cudaMemcpyBatchAsync(dsts, srcs, sizes, ctypes.c_size_t(1), attrs, idx, ctypes.c_size_t(1),
                                    handle), "cudaMemcpyBatchAsync")


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    peer = (rank + 1) % world
    results = []
    side = torch.cuda.Stream()
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for mib in (32, 128):
        nbytes = mib << 20
        buf = symm_mem.empty(2 * nbytes, dtype=torch.uint8, device="cuda")
        handle = symm_mem.rendezvous(buf, dist.group.WORLD)
        src_local = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
        local = buf.data_ptr()
        remote = int(handle.buffer_ptrs[peer])
        cases = {"push": (remote + nbytes, src_local.data_ptr()), "pull": (local, remote + nbytes),
                 "local": (local, src_local.data_ptr())}
        for direction, (dst, src) in cases.items():
            for mode in ("memcpy", "ce"):
                row = {"mib": mib, "direction": direction, "mode": mode}
                for with_gemm in (False, True):
                    times, gemm_ms = [], []
                    for rep in range(6):
                        torch.cuda.synchronize()
                        dist.barrier()
                        torch.cuda.synchronize()
                        g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        if with_gemm:
                            g0.record()
                            torch.mm(x, x)
                            g1.record()
                        c0.record(side)
                        copy(dst, src, nbytes, mode, side)
                        c1.record(side)
                        torch.cuda.synchronize()
                        if rep >= 1:
                            times.append(c0.elapsed_time(c1))
                            if with_gemm:
                                gemm_ms.append(g0.elapsed_time(g1))
                    ms = median(times)
                    key = "under_gemm" if with_gemm else "alone"
                    row[key + "_gbps"] = round(nbytes / ms / 1e6, 1)
                    if with_gemm:
                        row["gemm_ms_with_copy"] = round(median(gemm_ms), 4)
                results.append(row)
        del handle, buf
    # the GEMM alone, for the slow-down
    alone = []
    for _ in range(6):
        g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g0.record()
        torch.mm(x, x)
        g1.record()
        torch.cuda.synchronize()
        alone.append(g0.elapsed_time(g1))
    gemm_alone = median(alone)
    # CUDA-graph capture of each mode
    capture = {}
    dst = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    src = torch.ones(1 << 20, dtype=torch.uint8, device="cuda")
    for mode in ("memcpy", "ce"):
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                copy(dst.data_ptr(), src.data_ptr(), 1 << 20, mode, torch.cuda.current_stream())
            dst.zero_()
            graph.replay()
            torch.cuda.synchronize()
            capture[mode] = "ok" if bool((dst == 1).all()) else "replay wrong"
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            capture[mode] = f"failed: {exc}"
    if rank == 0:
        print(f"GEMM 8192^3 bf16 alone: {gemm_alone:.3f} ms")
        for row in results:
            print(json.dumps(row))
        print("graph capture:", capture)
        out = os.environ.get("PROBE_OUT")
        if out:
            with open(out, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                           "gemm_alone_ms": gemm_alone, "rows": results, "capture": capture}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Soak: many calls of every op over a fixed list of ~20 mixed shapes, cycled, watching for
growth of device memory (torch.cuda.memory_allocated / memory_reserved and the driver's
cudaMemGetInfo), host RSS (/proc/self/status VmRSS), open file descriptors
(/proc/self/fd) and distgemm's visible caches (functools caches and module-level dicts /
sets of distgemm's modules, e.g. tp._workspaces, tp._shapes_checked).

  python scripts/reliability/soak.py --out OUT/soak.json            # gemm, grouped_mm, grouped_mm_wgrad
  torchrun --standalone --nproc-per-node 2 scripts/reliability/soak.py --out OUT/soak.json
                                                                    # + all_gather_matmul, matmul_reduce_scatter

Every rank runs the single-GPU ops on its own GPU, then (under torchrun) the TP ops; rank 0
writes the JSON: {"calls", "device_mem_growth_bytes", "rss_growth_bytes", "fd_growth",
"cache_sizes_start", "cache_sizes_end", "ops": {op: details}, "per_rank": [...]}; growth
is measured from after a warm-up pass over every shape of every op (workspaces, plans and
allocator pools set up) to the end, and is the largest over the ranks.

Bounded: --calls (default 10000) per op and --max-seconds (default 170) overall; an op
that runs out of its share of the time stops early and says so ("time_capped"). With small
shapes, 10,000 calls take ~1-4 s per single-GPU op and ~5-10 s per TP op on an H200.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

for _var, _val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                   ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_var] = _val
os.environ.setdefault("DISTGEMM_TIMEOUT_S", "60")  # a TP wait that never ends fails the soak, bounded

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import distgemm  # noqa: E402

BF16, FP16, FP32, E4M3, E5M2 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2


# ---------------------------------------------------------------- measurements


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return -1


def fd_count() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def cache_sizes() -> dict:
    """Sizes of what distgemm keeps between calls: functools caches and module-level
    dicts / sets / lists (ALL-CAPS constants left out) of every loaded distgemm module, each
    object once, and the per-group TP state where visible (names guarded: they may change)."""
    sizes, seen = {}, set()
    for modname, mod in sorted(sys.modules.items()):
        if not (modname == "distgemm" or modname.startswith("distgemm.")) or mod is None:
            continue
        for name, obj in list(vars(mod).items()):
            if name.startswith("__") or name.strip("_").isupper() or id(obj) in seen:
                continue
            info = getattr(obj, "cache_info", None)
            if callable(info):
                try:
                    sizes[f"{modname}.{name}"] = info().currsize
                    seen.add(id(obj))
                except Exception:
                    pass
            elif isinstance(obj, (dict, set, list)):
                sizes[f"{modname}.{name}"] = len(obj)
                seen.add(id(obj))
    tp = sys.modules.get("distgemm.tp")
    for name in ("_workspaces", "_shapes_checked", "_fused_ok", "_group_infos"):  # older layouts
        value = getattr(tp, name, None)
        if isinstance(value, (dict, set, list)):
            sizes[f"distgemm.tp.{name}"] = len(value)
    states = getattr(tp, "_states", None)
    if isinstance(states, dict):
        sizes["distgemm.tp._states[*].retired"] = sum(len(getattr(st, "retired", ())) for st in states.values())
        sizes["distgemm.tp._states[*].workspace_bytes"] = sum(
            getattr(getattr(st, "workspace", None), "nbytes", 0) or 0 for st in states.values())
        uses = getattr(getattr(tp, "_GroupState", None), "_uses", None)
        if isinstance(uses, dict):
            sizes["distgemm.tp._GroupState._uses"] = len(uses)
    return sizes


def snapshot(dev) -> dict:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        free, total = torch.cuda.mem_get_info(dev)
        device = {"allocated": torch.cuda.memory_allocated(dev), "reserved": torch.cuda.memory_reserved(dev),
                  "driver_used": total - free}
    else:  # --cpu dry run
        device = {"allocated": 0, "reserved": 0, "driver_used": 0}
    return {**device, "rss": rss_bytes(), "fds": fd_count(), "caches": cache_sizes(), "time": time.time()}


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def growth(start: dict, end: dict) -> dict:
    g = {k: end[k] - start[k] for k in ("allocated", "reserved", "driver_used", "rss", "fds")}
    g["device"] = max(g["allocated"], g["reserved"], g["driver_used"])
    g["caches"] = {k: end["caches"].get(k, 0) - v for k, v in start["caches"].items()
                   if end["caches"].get(k, 0) != v}
    g["caches"].update({k: v for k, v in end["caches"].items() if k not in start["caches"]})
    return g


# ---------------------------------------------------------------- the ops and their shapes


def rnd(shape, dtype, dev, scale=1.0):
    x = torch.randn(*shape, device=dev) * scale
    return x.clamp(-240, 240).to(dtype) if dtype in (E4M3, E5M2) else x.to(dtype)


def gemm_calls(dev):
    """~20 gemm calls: dtypes, out dtypes, scales, c, fast accumulation, fallback layouts."""
    s = lambda n: torch.rand(n, device=dev) + 0.5  # noqa: E731
    calls = []

    def add(m, n, k, dtype=BF16, b_dtype=None, b_t=False, **kw):
        a = rnd((m, k), dtype, dev)
        b = rnd((k, n), b_dtype or dtype, dev, 0.1).T if b_t else rnd((n, k), b_dtype or dtype, dev, 0.1)
        calls.append(lambda a=a, b=b, kw=kw: distgemm.gemm(a, b, **kw))

    add(128, 256, 512)
    add(1, 4096, 1024)
    add(333, 520, 256, FP16)
    add(1000, 1032, 520)
    add(64, 2048, 128, out_dtype=FP32)
    add(512, 512, 512, c=rnd((512,), BF16, dev), beta=1.0)
    add(256, 384, 256, c=rnd((256, 384), BF16, dev), alpha=0.5, beta=-1.0)
    add(200, 264, 128, b_t=True)
    add(17, 136, 16)
    add(96, 80, 20)                      # K not a multiple of 16 bytes: padded
    add(96, 33, 64)                      # N not a multiple of 16 bytes: padded
    add(256, 512, 512, E4M3, scale_a=s(1), scale_b=s(1))
    add(200, 1040, 512, E4M3, scale_a=s(200), scale_b=s(1040))
    add(512, 512, 1024, E4M3, scale_a=s(1), scale_b=s(512), use_fast_accum=True)
    add(128, 256, 256, E4M3, E5M2, out_dtype=FP32)
    add(64, 128, 256, E5M2, E4M3, out_dtype=FP16, scale_a=s(64))
    add(1024, 1024, 256, FP16, out_dtype=FP32)
    add(48, 4096, 256, c=rnd((4096,), BF16, dev), beta=0.5)
    add(768, 256, 1024)
    add(3, 7, 5)                         # tiny, everything padded
    return calls


def _offs(counts, dev):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)


def grouped_calls(dev, wgrad: bool):
    """~20 grouped_mm (forward / dgrad, out=, accumulate) or grouped_mm_wgrad calls."""
    g = torch.Generator().manual_seed(1)
    calls = []
    specs = [(8, 1024, 256, 128), (1, 300, 128, 64), (16, 2048, 512, 256), (64, 4096, 128, 128), (4, 0, 64, 64),
             (6, 777, 264, 136), (32, 1000, 256, 512), (2, 64, 1024, 256), (8, 512, 128, 1024), (12, 1536, 384, 192)]
    for i, (groups, tokens, n, k) in enumerate(specs * 2):
        dtype = BF16 if i % 3 else FP16
        counts = torch.multinomial(torch.rand(groups, generator=g) + 0.01, tokens, replacement=True,
                                   generator=g).bincount(minlength=groups).tolist() if tokens else [0] * groups
        if groups > 2:
            counts[1] += counts[0]   # a zero-token expert
            counts[0] = 0
        offs = _offs(counts, dev)
        x = rnd((tokens, k), dtype, dev)
        if wgrad:
            dy = rnd((tokens, n), dtype, dev)
            if i % 4 == 0:
                out = torch.zeros(groups, n, k, device=dev)
                calls.append(lambda dy=dy, x=x, offs=offs, out=out:
                             distgemm.grouped_mm_wgrad(dy, x, offs, out=out, accumulate=True))
            else:
                od = FP32 if i % 4 != 3 else dtype
                calls.append(lambda dy=dy, x=x, offs=offs, od=od: distgemm.grouped_mm_wgrad(dy, x, offs, out_dtype=od))
        else:
            trans = i % 2 == 0
            w = rnd((groups, n, k) if trans else (groups, k, n), dtype, dev, 0.1)
            if i % 5 == 4:
                out = torch.zeros(tokens, n, device=dev)
                calls.append(lambda x=x, w=w, offs=offs, out=out, trans=trans:
                             distgemm.grouped_mm(x, w, offs, out=out, accumulate=True, trans_w=trans))
            else:
                od = FP32 if i % 5 == 3 else None
                calls.append(lambda x=x, w=w, offs=offs, od=od, trans=trans:
                             distgemm.grouped_mm(x, w, offs, out_dtype=od, trans_w=trans))
    return calls


def tp_calls(dev, rank, world, op):
    """~20 calls of one TP op: shapes (odd rows, fallback sizes), dtypes, c, and the
    algorithm / pieces settings, the same list on every rank."""
    s = lambda n: torch.rand(n, device=dev) + 0.5  # noqa: E731
    settings = [{"DISTGEMM_TP_ALGO": "auto"}, {"DISTGEMM_TP_ALGO": "fused"},
                {"DISTGEMM_TP_ALGO": "decomposed", "DISTGEMM_TP_PIECES": "2"},
                {"DISTGEMM_TP_ALGO": "decomposed", "DISTGEMM_TP_PIECES": "3t"}]
    shapes = [(128, 256, 256), (333, 512, 264), (1, 264, 64), (1000, 520, 256), (256, 1024, 512),
              (64, 128, 2048), (512, 768, 384), (97, 136, 100), (200, 40, 24), (768, 512, 1024)]  # N=100: collectives path
    calls = []
    for i, (m, k, n) in enumerate(shapes * 2):
        env = settings[i % len(settings)]
        dtype = FP16 if i % 7 == 3 else BF16
        kw = {}
        if i % 10 == 9:
            dtype, env = E4M3, {"DISTGEMM_TP_ALGO": "fused"}
            kw = {"scale_a": s(1), "scale_b": s(n)}
        if op == "all_gather_matmul":
            a, b = rnd((m, k), dtype, dev), rnd((n, k), dtype, dev, 0.1)
            if i % 3 == 1:
                kw["c"] = rnd((n,), BF16 if dtype == E4M3 else dtype, dev)
                kw["beta"] = 1.0
            calls.append((env, lambda a=a, b=b, kw=kw: distgemm.all_gather_matmul(a, b, **kw)))
        else:
            if kw.get("scale_a") is not None:
                kw["scale_a"] = s(m * world)
            a, b = rnd((m * world, k), dtype, dev), rnd((n, k), dtype, dev, 0.1)
            if i % 3 == 1:
                kw["c"] = rnd((n,), BF16 if dtype == E4M3 else dtype, dev)
                kw["beta"] = 1.0
            calls.append((env, lambda a=a, b=b, kw=kw: distgemm.matmul_reduce_scatter(a, b, **kw)))
    return calls


def set_env(env: dict, keys=("DISTGEMM_TP_ALGO", "DISTGEMM_TP_PIECES")) -> None:
    for key in keys:
        if key in env:
            os.environ[key] = env[key]
        else:
            os.environ.pop(key, None)
    distgemm.reload_settings()  # read once otherwise


def run(op, calls, n_calls, dev, deadline, tp=False):
    """n_calls calls cycling `calls`; a synchronize (and for TP ops an error check) every 250.
    For TP ops the time cap is decided together (a rank that stopped alone would leave its
    peer waiting in the next call)."""
    start = time.monotonic()
    done = 0
    capped = False
    for i in range(n_calls):
        entry = calls[i % len(calls)]
        if tp:
            set_env(entry[0])
            out = entry[1]()
        else:
            out = entry()
        del out
        done += 1
        if done % 250 == 0:
            sync(dev)
            if tp:
                distgemm.check_errors(dev)
            late = time.monotonic() > deadline
            if tp and dist.is_initialized():
                flag = torch.tensor([int(late)], device=dev)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                late = bool(flag.item())
            if late:
                capped = done < n_calls
                break
    sync(dev)
    if tp:
        distgemm.check_errors(dev)
    seconds = time.monotonic() - start
    return {"calls": done, "seconds": round(seconds, 3), "calls_per_s": round(done / max(seconds, 1e-9), 1),
            "time_capped": capped, "shapes": len(calls)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="soak.json")
    ap.add_argument("--calls", type=int, default=10000, help="calls of each op")
    ap.add_argument("--max-seconds", type=float, default=170.0)
    ap.add_argument("--cpu", action="store_true", help="dry run of this script on CPU tensors (gloo)")
    args = ap.parse_args()
    t0 = time.monotonic()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cpu") if args.cpu else torch.device("cuda", local)
    if not args.cpu:
        torch.cuda.set_device(dev)
    if world > 1:
        dist.init_process_group("gloo" if args.cpu else "nccl", device_id=None if args.cpu else dev)
    torch.manual_seed(rank)

    ops = {"gemm": (gemm_calls(dev), False), "grouped_mm": (grouped_calls(dev, False), False),
           "grouped_mm_wgrad": (grouped_calls(dev, True), False)}
    if world > 1:
        ops["all_gather_matmul"] = (tp_calls(dev, rank, world, "all_gather_matmul"), True)
        ops["matmul_reduce_scatter"] = (tp_calls(dev, rank, world, "matmul_reduce_scatter"), True)

    # warm-up: every shape of every op twice (workspaces, cuBLASLt plans, allocator pools)
    for name, (calls, tp) in ops.items():
        run(name, calls, 2 * len(calls), dev, float("inf"), tp)
    if world > 1:
        dist.barrier()
    start = snapshot(dev)
    details = {}
    budget_end = t0 + args.max_seconds
    names = list(ops)
    for i, name in enumerate(names):
        calls, tp = ops[name]
        share = (budget_end - time.monotonic()) / (len(names) - i)
        details[name] = run(name, calls, args.calls, dev, time.monotonic() + share, tp)
        details[name]["after"] = {k: v for k, v in snapshot(dev).items() if k != "caches"}
        if world > 1 and tp:
            # the ranks agree on how many TP calls they made; a rank that stopped early stops both
            counts = [None] * world
            dist.all_gather_object(counts, details[name]["calls"])
            details[name]["calls_per_rank"] = counts
    if world > 1:
        dist.barrier()
    end = snapshot(dev)
    g = growth(start, end)
    mine = {"rank": rank, "device": "cpu" if args.cpu else torch.cuda.get_device_name(dev), "start": start, "end": end, "growth": g,
            "ops": details, "seconds": round(time.monotonic() - t0, 2)}
    per_rank = [mine]
    if world > 1:
        per_rank = [None] * world
        dist.all_gather_object(per_rank, mine)
    if rank == 0:
        result = {
            "calls": sum(d["calls"] for d in details.values()),
            "device_mem_growth_bytes": max(p["growth"]["device"] for p in per_rank),
            "rss_growth_bytes": max(p["growth"]["rss"] for p in per_rank),
            "fd_growth": max(p["growth"]["fds"] for p in per_rank),
            "cache_sizes_start": start["caches"], "cache_sizes_end": end["caches"],
            "cache_growth": g["caches"], "ops": details, "world": world, "calls_per_op": args.calls,
            "time_capped": any(d["time_capped"] for d in details.values()),
            "seconds": round(time.monotonic() - t0, 2), "per_rank": per_rank,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(json.dumps({k: result[k] for k in ("calls", "device_mem_growth_bytes", "rss_growth_bytes",
                                                  "fd_growth", "cache_growth", "time_capped", "seconds")}))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

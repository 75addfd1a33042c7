"""Bodies of the tensor-parallel tests, run on every rank by tests.dist_helpers.run_ranks.
The same checks run on CPU with gloo (the collectives path) and on GPUs with NCCL (the
fused path). Every rank draws the full operands from one seed and keeps its shard, so the
reference is the plain single-device product."""

import time

import torch
import torch.distributed as dist

import distgemm
from distgemm.nn import ColumnParallelLinear, RowParallelLinear
from tests.reference import assert_close
from tests.reference import ref_gemm as ref


def device_for(rank: int) -> torch.device:
    return torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")


def full(shape, dtype, dev, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * scale
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        x = x.clamp(-240, 240)
    return x.to(dtype).to(dev)


AG_SHAPES = [(128, 256, 128), (1000, 520, 256), (1, 264, 64), (333, 1032, 512)]  # (m_local, N, K)


def check_all_gather_matmul(rank, world, dtypes=(torch.bfloat16, torch.float16)):
    dev = device_for(rank)
    for dtype in dtypes:
        for i, (m, n, k) in enumerate(AG_SHAPES):
            a_full = full((m * world, k), dtype, dev, 10 + i)
            b = full((n, k), dtype, dev, 20 + i, 0.1)
            a = a_full[rank * m:(rank + 1) * m]
            out, gathered = distgemm.all_gather_matmul(a, b, return_gathered=True)
            assert out.shape == (m * world, n) and torch.equal(gathered, a_full)
            assert_close(out, ref(a_full, b))
            c = full((m * world, n), dtype, dev, 30 + i)
            assert_close(distgemm.all_gather_matmul(a, b, c=c, alpha=0.5, beta=-1.5), ref(a_full, b, c, 0.5, -1.5))
            bias = full((n,), dtype, dev, 40 + i)
            out32 = distgemm.all_gather_matmul(a, b, c=bias, beta=1.0, out_dtype=torch.float32)
            assert out32.dtype == torch.float32
            assert_close(out32, ref(a_full, b, bias.expand(m * world, n), 1.0, 1.0))
    # dist_matmul: the seed's argument order, default group
    a_full = full((64 * world, 128), torch.bfloat16, dev, 50)
    b, c = full((256, 128), torch.bfloat16, dev, 51), full((64 * world, 256), torch.bfloat16, dev, 52)
    out = distgemm.dist_matmul(a_full[rank * 64:(rank + 1) * 64], b, c, 2.0, 0.5)
    assert_close(out, ref(a_full, b, c, 2.0, 0.5))


def check_all_gather_matmul_fp8(rank, world):
    dev = device_for(rank)
    m, n, k = 200, 512, 256
    a_full = full((m * world, k), torch.float8_e4m3fn, dev, 60)
    b = full((n, k), torch.float8_e4m3fn, dev, 61)
    a = a_full[rank * m:(rank + 1) * m]
    # each rank's shard has its own per-tensor scale; b has per-channel scales
    sa_full = torch.arange(1, world + 1, dtype=torch.float32, device=dev).repeat_interleave(m) * 0.25
    sb = torch.rand(n, generator=torch.Generator().manual_seed(62)).to(dev) + 0.5
    out = distgemm.all_gather_matmul(a, b, scale_a=sa_full[rank * m:rank * m + 1].clone(), scale_b=sb)
    assert_close(out, ref(a_full, b, sa=sa_full, sb=sb), torch.float8_e4m3fn)
    rowwise = torch.rand(m * world, generator=torch.Generator().manual_seed(63)).to(dev) + 0.5
    out = distgemm.all_gather_matmul(a, b, scale_a=rowwise[rank * m:(rank + 1) * m].contiguous(), scale_b=sb)
    assert_close(out, ref(a_full, b, sa=rowwise, sb=sb), torch.float8_e4m3fn)
    if dist.get_backend() != "nccl":  # the algorithms are the fused backend's
        return
    with distgemm.settings(tp_algo="decomposed"):  # cuBLASLt FP8 pieces, each shard with its own scale
        sb_tensor = sb[:1].clone()
        out = distgemm.all_gather_matmul(a, b, scale_a=sa_full[rank * m:rank * m + 1].clone(), scale_b=sb_tensor)
        assert_close(out, ref(a_full, b, sa=sa_full, sb=sb_tensor.expand(n)), torch.float8_e4m3fn)
        try:  # row-wise: cuBLASLt's outer-vector scaling, where this cuBLASLt has it
            out = distgemm.all_gather_matmul(a, b, scale_a=rowwise[rank * m:(rank + 1) * m].contiguous(), scale_b=sb)
        except NotImplementedError as e:
            assert "no algorithm" in str(e), e
        else:
            assert_close(out, ref(a_full, b, sa=rowwise, sb=sb), torch.float8_e4m3fn)


# (m_local, N, K_local); 520 rows: four pieces of a chunk where they are asked for, the last of 8 rows
RS_SHAPES = [(128, 256, 128), (250, 520, 256), (1, 264, 64), (300, 264, 128), (520, 136, 64)]


def check_matmul_reduce_scatter(rank, world, dtypes=(torch.bfloat16, torch.float16)):
    dev = device_for(rank)
    for dtype in dtypes:
        for i, (m, n, k) in enumerate(RS_SHAPES):
            a_full = full((m * world, k * world), dtype, dev, 70 + i)
            b_full = full((n, k * world), dtype, dev, 80 + i, 0.1)
            a, b = a_full[:, rank * k:(rank + 1) * k], b_full[:, rank * k:(rank + 1) * k]
            rows = slice(rank * m, (rank + 1) * m)
            out = distgemm.matmul_reduce_scatter(a.contiguous(), b.contiguous())
            assert out.shape == (m, n)
            assert_close(out, ref(a_full, b_full)[rows])
            bias = full((n,), dtype, dev, 90 + i)
            out = distgemm.matmul_reduce_scatter(a.contiguous(), b.contiguous(), c=bias, alpha=0.5, beta=2.0)
            assert_close(out, ref(a_full, b_full, bias.expand(m * world, n), 0.5, 2.0)[rows])
            c = full((m, n), dtype, dev, 95 + i)
            out = distgemm.matmul_reduce_scatter(a.contiguous(), b.contiguous(), c=c, beta=-1.0,
                                                 out_dtype=torch.float32)
            assert_close(out, ref(a_full, b_full)[rows] - c.double())


def check_parallel_mlp_autograd(rank, world, sequence_parallel=True):
    """Column- then row-parallel layers vs one GPU's nn.Linear pair: outputs and gradients."""
    dev = device_for(rank)
    dtype = torch.bfloat16
    s, d, h = 64 * world, 128, 256
    torch.manual_seed(0)
    fc1 = torch.nn.Linear(d, h, dtype=torch.float32, device=dev)
    fc2 = torch.nn.Linear(h, d, dtype=torch.float32, device=dev)
    col = ColumnParallelLinear(d, h, bias=True, sequence_parallel=sequence_parallel, dtype=dtype, device=dev)
    row = RowParallelLinear(h, d, bias=True, sequence_parallel=sequence_parallel, dtype=dtype, device=dev)
    hl, rows = h // world, slice(rank * (s // world), (rank + 1) * (s // world))
    with torch.no_grad():
        for p in (*fc1.parameters(), *fc2.parameters()):  # the same bf16 values on both sides
            p.copy_(p.to(dtype))
        col.weight.copy_(fc1.weight[rank * hl:(rank + 1) * hl])
        col.bias.copy_(fc1.bias[rank * hl:(rank + 1) * hl])
        row.weight.copy_(fc2.weight[:, rank * hl:(rank + 1) * hl])
        row.bias.copy_(fc2.bias)
    x_full = full((s, d), dtype, dev, 100)
    x = (x_full[rows] if sequence_parallel else x_full).clone().requires_grad_()
    y = row(torch.relu(col(x)))
    x_ref = x_full.float().requires_grad_()
    y_ref = fc2(torch.relu(fc1(x_ref)))
    assert_close(y, y_ref[rows] if sequence_parallel else y_ref)
    dy_full = full((s, d), dtype, dev, 101)
    y.backward(dy_full[rows] if sequence_parallel else dy_full)
    y_ref.backward(dy_full.float())
    assert_close(x.grad, x_ref.grad[rows] if sequence_parallel else x_ref.grad)
    assert_close(col.weight.grad, fc1.weight.grad[rank * hl:(rank + 1) * hl])
    assert_close(col.bias.grad, fc1.bias.grad[rank * hl:(rank + 1) * hl])
    assert_close(row.weight.grad, fc2.weight.grad[:, rank * hl:(rank + 1) * hl])
    assert_close(row.bias.grad, fc2.bias.grad)


def check_alternating_shapes(rank, world):
    dev = device_for(rank)
    shapes = [(256, 512, 256), (96, 264, 128)]
    for step in range(6):
        m, n, k = shapes[step % 2]
        a_full = full((m * world, k), torch.bfloat16, dev, 200 + step)
        b = full((n, k), torch.bfloat16, dev, 300 + step, 0.1)
        out = distgemm.all_gather_matmul(a_full[rank * m:(rank + 1) * m], b)
        assert_close(out, ref(a_full, b))
        out = distgemm.matmul_reduce_scatter(a_full, b)  # the same K on every rank: world * a @ b.T
        assert_close(out, world * ref(a_full, b)[rank * m:(rank + 1) * m])


def check_everything_gloo(rank, world):
    check_all_gather_matmul(rank, world, dtypes=(torch.bfloat16,))
    check_all_gather_matmul_fp8(rank, world)
    check_matmul_reduce_scatter(rank, world, dtypes=(torch.bfloat16,))
    check_parallel_mlp_autograd(rank, world, sequence_parallel=True)
    check_parallel_mlp_autograd(rank, world, sequence_parallel=False)
    check_alternating_shapes(rank, world)


def check_graph_compile_and_alternation(rank, world):
    check_alternating_shapes(rank, world)
    check_cuda_graph_replay(rank, world)
    check_torch_compile(rank, world)


def _expect_disagreement(dev, call, what):
    """A call whose ranks disagree: it raises ValueError naming the disagreement at once (when
    it had to agree before growing the workspace) or hands back NaN and check_errors raises
    it, on every rank; then recover() re-synchronises the group."""
    try:
        out = call()
    except ValueError as e:
        assert "the ranks disagree" in str(e), e
    else:
        torch.cuda.synchronize(dev)
        assert torch.isnan(out.float()).all(), f"{what}: a disagreeing call handed back numbers"
        try:
            distgemm.check_errors(dev)
        except ValueError as e:
            assert "the ranks disagree" in str(e), e
        else:
            raise AssertionError(f"{what}: the disagreement was not reported")
    distgemm.recover()


def check_mismatched_shapes(rank, world):
    dev = device_for(rank)
    m = 64 if rank == 0 else 32
    a = full((m, 128), torch.bfloat16, dev, 400)
    b = full((256, 128), torch.bfloat16, dev, 401)
    if dist.get_backend() != "nccl":  # the collectives path refuses it at once, on every rank
        try:
            distgemm.all_gather_matmul(a, b)
        except ValueError as e:
            assert "the ranks disagree" in str(e), e
        else:
            raise AssertionError("mismatched shapes were not reported")
        return
    _expect_disagreement(dev, lambda: distgemm.all_gather_matmul(a, b), "rows differing on the first call")
    # after agreeing once, other rows on one rank (2048 vs 1024 within the same workspace)
    a = full((2048, 128), torch.bfloat16, dev, 402)
    distgemm.all_gather_matmul(a, b)
    _expect_disagreement(dev, lambda: distgemm.all_gather_matmul(a if rank == 0 else a[:1024], b),
                         "rows differing on a later call")
    # a malformed split setting is refused by name before anything is enqueued (no peer waits)
    a = full((256, 128), torch.bfloat16, dev, 403)
    try:
        with distgemm.settings(tp_algo="decomposed", tp_pieces=5):
            distgemm.all_gather_matmul(a, b)
    except ValueError as e:
        assert "tp_pieces must be 'auto', N or Nt" in str(e), e
    else:
        raise AssertionError("tp_pieces=5 was not refused")
    # settings that differ between the ranks: every rank names the disagreement
    a_big = full((1024, 128), torch.bfloat16, dev, 404)
    with distgemm.settings(tp_algo="decomposed", tp_pieces="2" if rank == 0 else "3"):
        _expect_disagreement(dev, lambda: distgemm.all_gather_matmul(a_big, b), "tp_pieces differing")
    out = distgemm.all_gather_matmul(a, b)  # and the next call runs
    assert_close(out, ref(torch.cat([a] * world), b))


def check_arguments_are_named(rank, world):
    """Bad arguments of the TP ops and modules are named, on every rank alike, before anything
    is exchanged (the ranks then still agree on a call)."""
    import pytest

    dev = device_for(rank)
    a, b = full((16, 64), torch.bfloat16, dev, 500), full((32, 64), torch.bfloat16, dev, 501)
    cases = [
        (lambda: distgemm.all_gather_matmul("a", b), TypeError, "a must be a torch.Tensor"),
        (lambda: distgemm.all_gather_matmul(None, b), TypeError, "a must be a torch.Tensor"),
        (lambda: distgemm.matmul_reduce_scatter(3, b), TypeError, "a must be a torch.Tensor"),
        (lambda: distgemm.dist_matmul([1], b), TypeError, "a must be a torch.Tensor"),
        (lambda: distgemm.all_gather_matmul(a, b, group=3), TypeError, "group must be a torch.distributed"),
        (lambda: distgemm.all_gather_matmul(a, b, group="no such group"), ValueError, "names no process group"),
        (lambda: distgemm.recover(torch.ones(2)), TypeError, "group must be a torch.distributed"),
        (lambda: distgemm.all_gather_matmul(a, b, return_gathered=torch.ones(2)), TypeError,
         "return_gathered must be True or False"),
        (lambda: distgemm.matmul_reduce_scatter(a, b, use_fast_accum="no"), TypeError,
         "use_fast_accum must be True or False"),
        (lambda: ColumnParallelLinear(64, 32 * world, device=dev)(None), ValueError,
         r"ColumnParallelLinear: x must be a \(\.\.\., 64\) tensor, got NoneType"),
        (lambda: RowParallelLinear(64 * world, 32, device=dev)(torch.ones(4, 63, device=dev)), ValueError,
         r"RowParallelLinear: x must be a \(\.\.\., 64\) tensor, got \(4, 63\)"),
        (lambda: ColumnParallelLinear(0, 32 * world, device=dev), ValueError,
         "ColumnParallelLinear: in_features must be an int >= 1, got 0"),  # was a ZeroDivisionError
        (lambda: RowParallelLinear(64 * world, "32", device=dev), ValueError,
         "RowParallelLinear: out_features must be an int >= 1, got '32'"),
        (lambda: ColumnParallelLinear(64, 32 * world, sequence_parallel=torch.ones(2), device=dev), TypeError,
         "sequence_parallel must be True or False"),
        (lambda: RowParallelLinear(64 * world, 32, bias="yes", device=dev), TypeError, "bias must be True or False"),
        (lambda: ColumnParallelLinear(64, 32 * world, dtype=torch.int32, device=dev), ValueError,
         "ColumnParallelLinear: dtype must be torch.bfloat16 or torch.float16"),
    ]
    for call, kind, match in cases:
        with pytest.raises(kind, match=match):
            call()
    assert_close(distgemm.all_gather_matmul(a, b), ref(torch.cat([a] * world), b))  # still paired


def check_recover_after_a_timed_out_exchange(rank, world):
    """A set-up exchange that timed out on one rank (its peers never reached it: they failed
    before) leaves that rank's exchange count ahead of theirs; recover() still pairs every rank
    (the store's count of recover() calls names the generation), promptly, and twice in a row."""
    from distgemm import tp

    dev = device_for(rank)
    group = dist.group.WORLD
    state = tp._state(group)
    with distgemm.settings(timeout_s=2):
        if rank == 0:
            try:
                state.exchange("size", "1")
            except TimeoutError:
                pass
            else:
                raise AssertionError("an exchange no peer joined did not time out")
        for _ in range(2):
            start = time.monotonic()
            distgemm.recover(group)  # bounded by 3 x 2 s: counts that differ would run it out
            assert time.monotonic() - start < 5.0, f"recover took {time.monotonic() - start:.1f} s"
        a = full((16, 64), torch.bfloat16, dev, 450 + rank)
        b = full((32, 64), torch.bfloat16, dev, 460)
        out = distgemm.all_gather_matmul(a, b)
        a_all = torch.cat([full((16, 64), torch.bfloat16, dev, 450 + r) for r in range(world)])
        assert_close(out, ref(a_all, b))
        assert state.exchange("after", str(rank)) == [str(r) for r in range(world)]


def check_gathered_gradient_on_some_ranks_only(rank, world):
    """all_gather_matmul(..., return_gathered=True) under autograd where only rank 0's loss uses
    the gathered copy: the backward's reduce-scatter of its gradient runs on every rank (zeros
    from the others), so the ranks stay paired and a's gradient is the reference's."""
    dev = device_for(rank)
    m, k, n = 16, 64, 32
    a_all = torch.cat([full((m, k), torch.bfloat16, dev, 470 + r) for r in range(world)])
    b = full((n, k), torch.bfloat16, dev, 480 + rank, 0.1)
    a = a_all[rank * m:(rank + 1) * m].clone().requires_grad_()
    out, gathered = distgemm.all_gather_matmul(a, b, return_gathered=True)
    loss = out.float().sum() + (gathered.float().pow(2).sum() if rank == 0 else 0.0)
    loss.backward()
    # reference: d/da_r of sum_q sum(a_all @ b_q^T) + sum(a_all^2) on rank 0's side
    b_sum = torch.zeros(n, k, dtype=torch.float64, device=dev)
    for q in range(world):
        b_sum += full((n, k), torch.bfloat16, dev, 480 + q, 0.1).double()
    grad_all = torch.ones(m * world, n, dtype=torch.float64, device=dev) @ b_sum + 2 * a_all.double()
    assert_close(a.grad, grad_all[rank * m:(rank + 1) * m])
    # the ranks are still paired: a plain call afterwards agrees
    out = distgemm.all_gather_matmul(a.detach(), b)
    assert_close(out, ref(a_all, b))


def check_collectives_path_on_every_rank(rank, world):
    """Operands the fused kernels cannot take (K or N not a multiple of 16 bytes) on every rank:
    the collectives path, right, also on a group whose ranks run the fused path (there the
    ranks agree on the workspace first, tests/tp_fault_checks.py has one rank on each path).
    Where no rank can run fused (gloo), a DISTGEMM_TP_BACKEND that differs changes nothing."""
    dev = device_for(rank)
    b = full((256, 128), torch.bfloat16, dev, 410)
    a = full((64, 128), torch.bfloat16, dev, 411)
    assert_close(distgemm.all_gather_matmul(a, b), ref(torch.cat([a] * world), b))
    b_odd = full((256, 100), torch.bfloat16, dev, 412)  # K = 100 bf16: 200 bytes
    a_odd = full((64, 100), torch.bfloat16, dev, 413)
    assert_close(distgemm.all_gather_matmul(a_odd, b_odd), ref(torch.cat([a_odd] * world), b_odd))
    rs_a = full((64 * world, 128), torch.bfloat16, dev, 414)
    b_narrow = full((100, 128), torch.bfloat16, dev, 415)  # N = 100 bf16 out: 200 bytes
    out = distgemm.matmul_reduce_scatter(rs_a, b_narrow)
    assert_close(out, world * ref(rs_a, b_narrow)[rank * 64:(rank + 1) * 64])
    assert_close(distgemm.all_gather_matmul(a, b), ref(torch.cat([a] * world), b))  # fused again
    if dist.get_backend() != "nccl":
        with distgemm.settings(tp_backend="collectives" if rank == 1 else "auto"):
            assert_close(distgemm.all_gather_matmul(a, b), ref(torch.cat([a] * world), b))


def check_fp8_block_scales(rank, world):
    """FP8 with DeepSeek-V3's 128-block scales (a per 1 x 128, b per 128 x 128, each rank's
    scales following its shard) through both ops, against the dequantized operands' product:
    the all-gather gathers the scales with the rows; the reduce-scatter's ranks hold K shards of
    whole 128-blocks."""
    from distgemm.grouped_fp8 import dequantize_blocks

    dev = device_for(rank)
    m, n, k = 96, 384, 256  # rows per rank; 3 and 2 blocks of 128
    x = full((m * world, k), torch.bfloat16, dev, 600)
    w = full((n, k), torch.bfloat16, dev, 601, 0.1)
    xq, sx = distgemm.quantize_fp8(x, (1, 128))  # sx (M, K/128), M-major as PyTorch holds it
    wq, sw = distgemm.quantize_fp8(w, (128, 128))
    want = dequantize_blocks(xq, sx, 1, 128) @ dequantize_blocks(wq, sw, 128, 128).T
    rows = slice(rank * m, (rank + 1) * m)
    out = distgemm.all_gather_matmul(xq[rows], wq, scale_a=sx[rows], scale_b=sw)
    assert out.dtype == torch.bfloat16
    assert_close(out, want)
    # reduce-scatter: this rank's K shard (whole blocks) of a (M, world * k) and w (n, world * k)
    xk = full((m * world, k * world), torch.bfloat16, dev, 602)
    wk = full((n, k * world), torch.bfloat16, dev, 603, 0.1)
    xkq, sxk = distgemm.quantize_fp8(xk, (1, 128))
    wkq, swk = distgemm.quantize_fp8(wk, (128, 128))
    want = (dequantize_blocks(xkq, sxk, 1, 128) @ dequantize_blocks(wkq, swk, 128, 128).T)[rows]
    cols, blocks = slice(rank * k, (rank + 1) * k), slice(rank * k // 128, (rank + 1) * k // 128)
    out = distgemm.matmul_reduce_scatter(xkq[:, cols], wkq[:, cols], scale_a=sxk[:, blocks],
                                         scale_b=swk[:, blocks])
    assert tuple(out.shape) == (m, n) and out.dtype == torch.bfloat16
    assert_close(out, want)


def check_cuda_graph_replay(rank, world):
    dev = device_for(rank)
    m, n, k = 256, 512, 256
    a = torch.empty(m, k, dtype=torch.bfloat16, device=dev)
    a_rs = torch.empty(m * world, k, dtype=torch.bfloat16, device=dev)
    b = full((n, k), torch.bfloat16, dev, 500, 0.1)
    a.copy_(full((m, k), torch.bfloat16, dev, 501))
    a_rs.copy_(full((m * world, k), torch.bfloat16, dev, 502))
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up: workspaces and checks happen outside the capture
        distgemm.all_gather_matmul(a, b)
        distgemm.matmul_reduce_scatter(a_rs, b)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_ag = distgemm.all_gather_matmul(a, b)
        out_rs = distgemm.matmul_reduce_scatter(a_rs, b)
    for step in range(4):
        a_full = full((m * world, k), torch.bfloat16, dev, 600 + step)
        a.copy_(a_full[rank * m:(rank + 1) * m])
        a_rs.copy_(a_full)
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize(dev)
        assert_close(out_ag, ref(a_full, b))
        assert_close(out_rs, world * ref(a_full, b)[rank * m:(rank + 1) * m])
    distgemm.check_errors(dev)


def check_torch_compile(rank, world):
    dev = device_for(rank)
    a_full = full((128 * world, 256), torch.bfloat16, dev, 700)
    b = full((512, 256), torch.bfloat16, dev, 701, 0.1)
    group = dist.group.WORLD

    def f(a, b):
        return torch.relu(distgemm.all_gather_matmul(a, b, group=group))

    compiled = torch.compile(f, fullgraph=True)
    out = compiled(a_full[rank * 128:(rank + 1) * 128], b)
    assert_close(out, ref(a_full, b).clamp_min(0))


def check_peer_timeout(rank, world):
    """Rank 0 calls once more than rank 1: its call must give up after DISTGEMM_TIMEOUT_S, hand
    back NaN, report rank 1 as TimeoutError (and keep doing so) until both ranks recover()."""
    dev = device_for(rank)
    a = full((128, 256), torch.bfloat16, dev, 800)
    b = full((256, 256), torch.bfloat16, dev, 801)
    distgemm.all_gather_matmul(a, b)  # both ranks: workspace set up
    torch.cuda.synchronize(dev)
    dist.barrier()
    if rank == 0:
        start = time.time()
        out = distgemm.all_gather_matmul(a, b)
        torch.cuda.synchronize(dev)
        elapsed = time.time() - start
        assert torch.isnan(out.float()).all(), "the timed-out call handed back numbers"
        try:
            distgemm.check_errors(dev)
        except TimeoutError as e:
            assert "waited more than DISTGEMM_TIMEOUT_S=3 s for group rank 1" in str(e), e
        else:
            raise AssertionError("no timeout error after the peer never arrived")
        assert elapsed < 60, f"the timed-out call took {elapsed:.0f} s"
        try:
            distgemm.all_gather_matmul(a, b)  # the next call reports it too
        except TimeoutError as e:
            assert "waited more than" in str(e)
        else:
            raise AssertionError("the next call did not report the timeout")
    distgemm.recover()  # both ranks: the group is usable again
    out = distgemm.all_gather_matmul(a, b)
    assert_close(out, ref(torch.cat([a] * world), b))
    dist.barrier()


def check_empty_shards(rank, world, then_a_product=True):
    """Calls with nothing to multiply, the same on every rank: no rows (all-gather: per rank;
    reduce-scatter: M), no K (all-gather), no N (reduce-scatter). The output is beta * c (zeros
    without c) of the right shape, as on the collectives path; autograd gives empty or zero
    gradients; the fused path (NCCL) runs them without its kernels, which take no empty operand."""
    dev = device_for(rank)
    dtype = torch.bfloat16
    m, n, k = 4, 32, 64
    b, bias = full((n, k), dtype, dev, 900, 0.1), full((n,), dtype, dev, 901)
    c = full((m * world, n), dtype, dev, 902)
    # all-gather: no rows per rank (with a bias and with return_gathered), then K = 0
    a0 = full((0, k), dtype, dev, 903).requires_grad_()
    out, gathered = distgemm.all_gather_matmul(a0, b, c=bias, beta=2.0, return_gathered=True)
    assert tuple(out.shape) == (0, n) and tuple(gathered.shape) == (0, k)
    out.float().sum().backward()
    assert tuple(a0.grad.shape) == (0, k)
    ak = full((m, 0), dtype, dev, 904).requires_grad_()
    bk = full((n, 0), dtype, dev, 905).requires_grad_()
    ck = c.clone().requires_grad_()
    out = distgemm.all_gather_matmul(ak, bk, c=ck, alpha=3.0, beta=-0.5, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert_close(out, -0.5 * c.double())
    out.sum().backward()
    assert tuple(ak.grad.shape) == (m, 0) and tuple(bk.grad.shape) == (n, 0)
    assert_close(ck.grad, torch.full((m * world, n), -0.5, dtype=torch.float64, device=dev))
    # reduce-scatter: M = 0, then N = 0
    out = distgemm.matmul_reduce_scatter(full((0, k), dtype, dev, 906), b, c=bias, beta=1.0)
    assert tuple(out.shape) == (0, n)
    a = full((m * world, k), dtype, dev, 907).requires_grad_()
    b_none = full((0, k), dtype, dev, 908).requires_grad_()
    out = distgemm.matmul_reduce_scatter(a, b_none)
    assert tuple(out.shape) == (m, 0)
    out.float().sum().backward()
    assert_close(a.grad, torch.zeros(m * world, k, dtype=torch.float64, device=dev))
    assert tuple(b_none.grad.shape) == (0, k)
    if not then_a_product:
        return
    # and a call with something to multiply still runs (and pairs) after them
    a_full = full((m * world, k), dtype, dev, 909)
    assert_close(distgemm.all_gather_matmul(a_full[rank * m:(rank + 1) * m], b), ref(a_full, b))

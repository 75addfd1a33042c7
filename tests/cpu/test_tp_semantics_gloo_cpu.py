"""The tensor-parallel ops' documented semantics through gloo on CPU (the collectives path), at 2
and 3 ranks, against one process's product of the concatenated shards: c as a full matrix or a
bias (added once, not once per rank), alpha / beta, out_dtype, FP8 scales per tensor, per row and
per 128-block (M per rank and K not multiples of 128) following their shards, transposed and
non-contiguous operands, empty shards, each rank's rows in rank order, and the gradients of a, b
and c of both ops against torch autograd of the reference."""

import pytest
import torch

import distgemm
from tests.dist_helpers import run_ranks
from tests.reference import assert_close

F8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


def _full(shape, dtype, seed, scale=1.0):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale
    return x.clamp(-240, 240).to(dtype) if dtype == F8 else x.to(dtype)


def _dequantized(q, s, rows, cols):
    from distgemm.grouped_fp8 import dequantize_blocks

    return dequantize_blocks(q, s, rows, cols).double()


def _all_gather_checks(rank, world):
    m, n, k = 5, 24, 40
    rows = slice(rank * m, (rank + 1) * m)
    for dtype in (BF16, torch.float16):
        a_full, b = _full((m * world, k), dtype, 1), _full((n, k), dtype, 2, 0.1)
        c, bias = _full((m * world, n), dtype, 3), _full((n,), dtype, 4)
        p = a_full.double() @ b.double().T
        a = a_full[rows]
        out, gathered = distgemm.all_gather_matmul(a, b, return_gathered=True)
        assert torch.equal(gathered, a_full), "the gathered rows are not in rank order"
        assert_close(out, p)
        assert_close(distgemm.all_gather_matmul(a, b, c=c, alpha=0.5, beta=-1.5), 0.5 * p - 1.5 * c.double())
        assert_close(distgemm.all_gather_matmul(a, b, c=bias, alpha=2.0, beta=0.5), 2 * p + 0.5 * bias.double())
        assert_close(distgemm.all_gather_matmul(a, b, c=bias[None], beta=0.5), p + 0.5 * bias.double())
        # beta = 0 does not read c (as BLAS and the fused GPU path): a NaN there stays out
        assert_close(distgemm.all_gather_matmul(a, b, c=torch.full_like(c, float("nan")), beta=0.0), p)
        out = distgemm.all_gather_matmul(a, b, c=c.float() * 1.001, beta=1.0, out_dtype=torch.float32)
        assert out.dtype == torch.float32
        assert_close(out, p + 1.001 * c.double())
        # b read transposed, c and a non-contiguous
        assert_close(distgemm.all_gather_matmul(a, b.T.contiguous().T, c=c.T.contiguous().T, beta=1.0), p + c.double())
        wide = _full((m * world, 2 * k), dtype, 5)
        assert_close(distgemm.all_gather_matmul(wide[rows, ::2], b), wide[:, ::2].double() @ b.double().T)
    # every rank its own number of output columns (N is not agreed on)
    n_r = 10 - 3 * (rank % 2)
    b_r = _full((n_r, k), BF16, 6 + rank, 0.1)
    a_full = _full((m * world, k), BF16, 7)
    assert_close(distgemm.all_gather_matmul(a_full[rows], b_r), a_full.double() @ b_r.double().T)
    # empty shards: no rows (also a non-contiguous view), K = 0 (out is beta * c)
    empty = distgemm.all_gather_matmul(_full((0, 2 * k), BF16, 8)[:, ::2], _full((n, k), BF16, 9))
    assert tuple(empty.shape) == (0, n)
    c = _full((m * world, n), BF16, 10)
    out = distgemm.all_gather_matmul(_full((m, k), BF16, 11)[:, :0], _full((n, k), BF16, 12)[:, :0], c=c, beta=2.0)
    assert_close(out, 2 * c.double())


def _all_gather_fp8_checks(rank, world):
    m, n, k = 6, 32, 64
    rows = slice(rank * m, (rank + 1) * m)
    a_full, b = _full((m * world, k), F8, 20), _full((n, k), F8, 21)
    sb = torch.rand(n, generator=torch.Generator().manual_seed(22)) + 0.5
    sa_rows = torch.rand(m * world, generator=torch.Generator().manual_seed(23)) + 0.5
    sa_ranks = torch.cat([torch.full((m,), 0.5 + q) for q in range(world)])  # one value per rank's shard
    c, bias = _full((m * world, n), BF16, 24), _full((n,), BF16, 25)
    p = a_full.double() @ b.double().T * sb.double()
    for out_dtype in (BF16, torch.float16, torch.float32):
        out = distgemm.all_gather_matmul(a_full[rows], b, scale_a=torch.tensor([0.5 + rank]), scale_b=sb, c=c,
                                         alpha=0.5, beta=2.0, out_dtype=out_dtype)
        assert out.dtype == out_dtype
        assert_close(out, 0.5 * p * sa_ranks.double()[:, None] + 2 * c.double(), F8)
        out = distgemm.all_gather_matmul(a_full[rows], b, scale_a=sa_rows[rows].clone(), scale_b=sb, c=bias,
                                         beta=-1.0, out_dtype=out_dtype)
        assert_close(out, p * sa_rows.double()[:, None] - bias.double(), F8)
    # 128-block scales: 130 rows per rank and K = 200 (neither a multiple of 128), N = 136
    m, n, k = 130, 136, 200
    rows = slice(rank * m, (rank + 1) * m)
    xq, sx = distgemm.quantize_fp8(_full((m * world, k), BF16, 26), (1, 128))
    wq, sw = distgemm.quantize_fp8(_full((n, k), BF16, 27, 0.1), (128, 128))
    want = _dequantized(xq, sx, 1, 128) @ _dequantized(wq, sw, 128, 128).T
    c, bias = _full((m * world, n), BF16, 28), _full((n,), BF16, 29)
    assert_close(distgemm.all_gather_matmul(xq[rows], wq, scale_a=sx[rows], scale_b=sw), want)
    out = distgemm.all_gather_matmul(xq[rows], wq, scale_a=sx[rows].contiguous(), scale_b=sw, c=c, alpha=0.5,
                                     beta=-2.0)
    assert_close(out, 0.5 * want - 2 * c.double())
    for bias_form in (bias, bias[None]):
        out = distgemm.all_gather_matmul(xq[rows], wq, scale_a=sx[rows], scale_b=sw, c=bias_form, beta=3.0)
        assert_close(out, want + 3 * bias.double())
    empty_q, empty_s = distgemm.quantize_fp8(_full((0, k), BF16, 30), (1, 128))
    out = distgemm.all_gather_matmul(empty_q, wq, scale_a=empty_s, scale_b=sw, c=bias, beta=1.0)
    assert tuple(out.shape) == (0, n)


def _reduce_scatter_checks(rank, world):
    mr, n, k = 3, 24, 40
    m, rows, cols = mr * world, slice(rank * mr, (rank + 1) * mr), slice(rank * k, (rank + 1) * k)
    for dtype in (BF16, torch.float16):
        a_full, b_full = _full((m, k * world), dtype, 40), _full((n, k * world), dtype, 41, 0.1)
        a, b = a_full[:, cols], b_full[:, cols]  # non-contiguous K shards
        c, bias = _full((m, n), dtype, 42)[rows], _full((n,), dtype, 43)
        p = (a_full.double() @ b_full.double().T)[rows]
        assert_close(distgemm.matmul_reduce_scatter(a, b), p)
        # a bias is added once to the sum, not once per rank; a full c is this rank's rows
        assert_close(distgemm.matmul_reduce_scatter(a, b, c=bias, alpha=0.5, beta=2.0), 0.5 * p + 2 * bias.double())
        assert_close(distgemm.matmul_reduce_scatter(a, b, c=bias[None], beta=2.0), p + 2 * bias.double())
        for unread in (torch.full_like(c, float("nan")), torch.full_like(bias, float("nan"))):
            assert_close(distgemm.matmul_reduce_scatter(a, b, c=unread, beta=0.0), p)
        assert_close(distgemm.matmul_reduce_scatter(a, b, c=c, alpha=-0.5, beta=1.5), -0.5 * p + 1.5 * c.double())
        for out_dtype in (torch.float32, dtype):
            out = distgemm.matmul_reduce_scatter(a, b, c=c, beta=1.5, out_dtype=out_dtype)
            assert out.dtype == out_dtype
            assert_close(out, p + 1.5 * c.double())
            assert_close(distgemm.matmul_reduce_scatter(a, b, c=bias.float(), beta=1.5, out_dtype=out_dtype),
                         p + 1.5 * bias.double())
        assert_close(distgemm.matmul_reduce_scatter(a, b.contiguous().T.contiguous().T, c=c.T.contiguous().T,
                                                    beta=1.0), p + c.double())
    # K split unevenly across the ranks (K is not agreed on)
    a_full, b_full = _full((m, 40), BF16, 44), _full((n, 40), BF16, 45, 0.1)
    edges = [q * 40 // world for q in range(world + 1)]
    part = slice(edges[rank], edges[rank + 1])
    assert_close(distgemm.matmul_reduce_scatter(a_full[:, part], b_full[:, part]),
                 (a_full.double() @ b_full.double().T)[rows])
    # no rows, and K = 0 (out is beta * c)
    assert tuple(distgemm.matmul_reduce_scatter(_full((0, k), BF16, 46), _full((n, k), BF16, 47)).shape) == (0, n)
    out = distgemm.matmul_reduce_scatter(a_full[:, :0], b_full[:, :0], c=bias, beta=2.0)
    assert_close(out, 2 * bias.double().expand(mr, n))


def _reduce_scatter_fp8_checks(rank, world):
    mr, n, k = 4, 32, 64
    m, rows, cols = mr * world, slice(rank * mr, (rank + 1) * mr), slice(rank * k, (rank + 1) * k)
    a_full, b_full = _full((m, k * world), F8, 50), _full((n, k * world), F8, 51)
    # each rank's own row-wise scales of its K shard
    sa = [torch.rand(m, generator=torch.Generator().manual_seed(52 + q)) + 0.5 for q in range(world)]
    sb = [torch.rand(n, generator=torch.Generator().manual_seed(62 + q)) + 0.5 for q in range(world)]
    parts = [a_full[:, q * k:(q + 1) * k].double() @ b_full[:, q * k:(q + 1) * k].double().T for q in range(world)]
    c = _full((mr, n), BF16, 53)
    want = sum(parts[q] * sa[q].double()[:, None] * sb[q].double() for q in range(world))[rows]
    want_tensor = sum(parts[q] * (0.5 + q) for q in range(world))[rows]
    for out_dtype in (BF16, torch.float16, torch.float32):
        out = distgemm.matmul_reduce_scatter(a_full[:, cols].contiguous(), b_full[:, cols].contiguous(),
                                             scale_a=sa[rank], scale_b=sb[rank], c=c, alpha=0.5, beta=2.0,
                                             out_dtype=out_dtype)
        assert_close(out, 0.5 * want + 2 * c.double(), F8)
        out = distgemm.matmul_reduce_scatter(a_full[:, cols].contiguous(), b_full[:, cols].contiguous(),
                                             scale_a=torch.tensor([0.5 + rank]), scale_b=torch.ones(1), c=c[0],
                                             beta=2.0, out_dtype=out_dtype)
        assert_close(out, want_tensor + 2 * c[0].double(), F8)
    # 128-block scales, each rank's K shard (200: not whole blocks) quantized on its own; 130 rows per rank
    mr, n, k = 130, 136, 200
    m, rows = mr * world, slice(rank * mr, (rank + 1) * mr)
    x, w = _full((m, k * world), BF16, 54), _full((n, k * world), BF16, 55, 0.1)
    xs = [distgemm.quantize_fp8(x[:, q * k:(q + 1) * k].contiguous(), (1, 128)) for q in range(world)]
    ws = [distgemm.quantize_fp8(w[:, q * k:(q + 1) * k].contiguous(), (128, 128)) for q in range(world)]
    want = sum(_dequantized(*xs[q], 1, 128) @ _dequantized(*ws[q], 128, 128).T for q in range(world))[rows]
    (xq, sx), (wq, sw) = xs[rank], ws[rank]
    c, bias = _full((mr, n), BF16, 56), _full((n,), BF16, 57)
    assert_close(distgemm.matmul_reduce_scatter(xq, wq, scale_a=sx, scale_b=sw), want)
    out = distgemm.matmul_reduce_scatter(xq, wq, scale_a=sx, scale_b=sw, c=c, alpha=0.5, beta=-2.0)
    assert_close(out, 0.5 * want - 2 * c.double())
    assert_close(distgemm.matmul_reduce_scatter(xq, wq, scale_a=sx, scale_b=sw, c=bias, beta=3.0),
                 want + 3 * bias.double())


def _gradient_checks(rank, world):
    """Every rank's loss weighs its own output; the reference differentiates the sum of all the
    ranks' losses. b and c are each rank's own (a bias of matmul_reduce_scatter: its rows' share,
    which RowParallelLinear all-reduces)."""
    m, n, k = 4, 24, 40
    rows = slice(rank * m, (rank + 1) * m)
    for dtype in (BF16, torch.float16):
        a_full = _full((m * world, k), dtype, 70)
        bs = [_full((n, k), dtype, 71 + q, 0.1) for q in range(world)]
        for c_form in ("full", "bias", "row"):
            cs = [{"full": _full((m * world, n), dtype, 80 + q), "bias": _full((n,), dtype, 80 + q),
                   "row": _full((1, n), dtype, 80 + q)}[c_form] for q in range(world)]
            weights = [_full((m * world, n), torch.float32, 90 + q) for q in range(world)]
            gweights = [_full((m * world, k), torch.float32, 95 + q) for q in range(world)]
            for gathered_too in (False, True):
                a = a_full[rows].clone().requires_grad_()
                b, c = bs[rank].clone().requires_grad_(), cs[rank].clone().requires_grad_()
                out = distgemm.all_gather_matmul(a, b, c=c, alpha=0.7, beta=-1.3, out_dtype=torch.float32,
                                                 return_gathered=gathered_too)
                loss = (out[0] if gathered_too else out).mul(weights[rank]).sum()
                if gathered_too:
                    loss = loss + out[1].float().mul(gweights[rank]).sum()
                loss.backward()
                ra = a_full.double().requires_grad_()
                rb = [x.double().requires_grad_() for x in bs]
                rc = [x.double().requires_grad_() for x in cs]
                total = sum(((0.7 * ra @ rb[q].T - 1.3 * rc[q]) * weights[q]).sum() for q in range(world))
                if gathered_too:
                    total = total + sum((ra * gweights[q]).sum() for q in range(world))
                total.backward()
                assert_close(a.grad, ra.grad[rows])
                assert_close(b.grad, rb[rank].grad)
                assert_close(c.grad, rc[rank].grad)
        # matmul_reduce_scatter: a (M, K/P) and b (N, K/P) column shards
        cols = slice(rank * k, (rank + 1) * k)
        a_full, b_full = _full((m * world, k * world), dtype, 100), _full((n, k * world), dtype, 101, 0.1)
        weights = _full((m * world, n), torch.float32, 102)
        for c_form in ("full", "bias", "row"):
            c0 = {"full": _full((m, n), dtype, 103 + rank), "bias": _full((n,), dtype, 103),
                  "row": _full((1, n), dtype, 103)}[c_form]
            a, b = a_full[:, cols].clone().requires_grad_(), b_full[:, cols].clone().requires_grad_()
            c = c0.clone().requires_grad_()
            out = distgemm.matmul_reduce_scatter(a, b, c=c, alpha=0.7, beta=-1.3, out_dtype=torch.float32)
            out.mul(weights[rows]).sum().backward()
            ra, rb = a_full.double().requires_grad_(), b_full.double().requires_grad_()
            rc = c0.double().requires_grad_()
            ((0.7 * ra @ rb.T) * weights).sum().backward()
            ((-1.3 * rc).expand(m, n) * weights[rows]).sum().backward()  # this rank's rows
            assert_close(a.grad, ra.grad[:, cols])
            assert_close(b.grad, rb.grad[:, cols])
            assert_close(c.grad, rc.grad)


def _everything(rank, world):
    _all_gather_checks(rank, world)
    _all_gather_fp8_checks(rank, world)
    _reduce_scatter_checks(rank, world)
    _reduce_scatter_fp8_checks(rank, world)
    _gradient_checks(rank, world)


@pytest.mark.parametrize("world", [2, 3])
def test_tp_semantics_match_the_concatenated_reference(world):
    run_ranks(_everything, world, "gloo", timeout=300)

"""ColumnParallelLinear / RowParallelLinear as a Megatron-LM user runs them, through gloo on CPU:
sequence-first (S, B, H) inputs against one process's float64 nn.Linear pair (output and the
gradients of x, the weights and the biases), with and without sequence parallelism and biases,
at 1, 2 and 3 ranks; the parameters each rank draws (its shard of one nn.Linear's weight, so
ranks seeded alike do not hold copies of one shard); the errors of sizes that do not split."""

import copy

import pytest
import torch

from tests.dist_helpers import run_ranks


def _value(shape, dtype, g, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).double()


def _mlp_matches_linear(rank, world):
    from distgemm.nn import ColumnParallelLinear, RowParallelLinear

    s, b, d, h = 2 * world, 3, 16, 8 * world
    hl = h // world
    cols, rows = slice(rank * hl, (rank + 1) * hl), slice(rank * s // world, (rank + 1) * s // world)
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        for sp in (True, False):
            for bias in (True, False):
                for x_grad in (True, False):
                    g = torch.Generator().manual_seed(1)
                    w1, b1 = _value((h, d), dtype, g, 0.3), _value((h,), dtype, g, 0.3)
                    w2, b2 = _value((d, h), dtype, g, 0.3), _value((d,), dtype, g, 0.3)
                    x_full, dy_full = _value((s, b, d), dtype, g), _value((s, b, d), dtype, g)
                    col = ColumnParallelLinear(d, h, bias=bias, sequence_parallel=sp, dtype=dtype)
                    row = RowParallelLinear(h, d, bias=bias, sequence_parallel=sp, dtype=dtype)
                    with torch.no_grad():
                        col.weight.copy_(w1[cols])
                        row.weight.copy_(w2[:, cols])
                        if bias:
                            col.bias.copy_(b1[cols])
                            row.bias.copy_(b2)
                    x = (x_full[rows] if sp else x_full).to(dtype).requires_grad_(x_grad)
                    mid = col(x)
                    y = row(torch.relu(mid))
                    y.backward((dy_full[rows] if sp else dy_full).to(dtype))
                    ref = [t.clone().requires_grad_() for t in (x_full, w1, b1, w2, b2)]
                    mid_ref = torch.nn.functional.linear(ref[0], ref[1], ref[2] if bias else None)
                    y_ref = torch.nn.functional.linear(torch.relu(mid_ref), ref[3], ref[4] if bias else None)
                    y_ref.backward(dy_full)
                    pairs = [("column output", mid, mid_ref[:, :, cols]), ("output", y, y_ref[rows] if sp else y_ref),
                             ("col.weight.grad", col.weight.grad, ref[1].grad[cols]),
                             ("row.weight.grad", row.weight.grad, ref[3].grad[:, cols])]
                    if x_grad:
                        pairs.append(("x.grad", x.grad, ref[0].grad[rows] if sp else ref[0].grad))
                    if bias:
                        pairs += [("col.bias.grad", col.bias.grad, ref[2].grad[cols]),
                                  ("row.bias.grad", row.bias.grad, ref[4].grad)]
                    for name, got, want in pairs:
                        what = f"{name} ({dtype}, sequence_parallel={sp}, bias={bias}, rank {rank} of {world})"
                        assert got is not None and got.shape == want.shape, what
                        err = (got.double() - want).abs().max() / want.abs().max().clamp_min(1e-9)
                        assert err <= tol, f"{what}: relative error {err:.3g}"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_parallel_mlp_matches_one_process_linear(world):
    run_ranks(_mlp_matches_linear, world, "gloo", timeout=120)


def _shards_of_one_linear(rank, world):
    import torch.distributed as dist

    from distgemm.nn import ColumnParallelLinear, RowParallelLinear

    d, h = 12, 6 * world
    hl = h // world
    cols = slice(rank * hl, (rank + 1) * hl)
    for dtype in (torch.bfloat16, torch.float16):
        for bias in (True, False):
            torch.manual_seed(7)  # every rank alike, as data-parallel scripts seed
            col = ColumnParallelLinear(d, h, bias=bias, dtype=dtype)
            row = RowParallelLinear(h, d, bias=bias, dtype=dtype)
            torch.manual_seed(7)
            fc1 = torch.nn.Linear(d, h, bias=bias, dtype=dtype)
            fc2 = torch.nn.Linear(h, d, bias=bias, dtype=dtype)
            assert torch.equal(col.weight, fc1.weight[cols])
            assert torch.equal(row.weight, fc2.weight[:, cols])
            if bias:
                assert torch.equal(col.bias, fc1.bias[cols])
                assert torch.equal(row.bias, fc2.bias)
            with torch.no_grad():
                col.weight.zero_()
            torch.manual_seed(7)
            col.reset_parameters()  # the same draw again
            assert torch.equal(col.weight, fc1.weight[cols])
    if world > 1:  # the ranks' shards differ
        shards = [torch.empty_like(col.weight) for _ in range(world)]
        dist.all_gather(shards, col.weight.detach().contiguous())
        assert not torch.equal(shards[0], shards[1])


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_rank_holds_its_shard_of_one_linear(world):
    run_ranks(_shards_of_one_linear, world, "gloo", timeout=60)


def _sizes_that_do_not_split(rank, world):
    from distgemm.nn import ColumnParallelLinear, RowParallelLinear

    with pytest.raises(ValueError, match=f"ColumnParallelLinear: out_features=7 must divide evenly by the "
                                         f"tensor-parallel group size {world}"):
        ColumnParallelLinear(8, 7)
    with pytest.raises(ValueError, match=f"RowParallelLinear: in_features=7 must divide evenly by the "
                                         f"tensor-parallel group size {world}"):
        RowParallelLinear(7, 8)
    ColumnParallelLinear(7, 4 * world)  # the other side need not split
    RowParallelLinear(4 * world, 7)
    row = RowParallelLinear(4 * world, 8)
    # (S, B, H / P) with S = 3: S * B = 6 rows split in two, but not along the sequence
    with pytest.raises(ValueError, match=r"RowParallelLinear: with sequence_parallel, x's sequence length "
                                         r"\(its first dimension\) 3 must divide evenly by the tensor-parallel "
                                         rf"group size {world}"):
        row(torch.ones(3, 2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"sequence length .* 5 must divide"):
        row(torch.ones(5, 4, dtype=torch.bfloat16))
    assert row(torch.ones(2 * world, 2, 4, dtype=torch.bfloat16)).shape == (2, 2, 8)


def test_sizes_that_do_not_split_are_named():
    run_ranks(_sizes_that_do_not_split, 2, "gloo", timeout=60)


def _copies_and_descriptions(rank, world):
    from distgemm.nn import ColumnParallelLinear, RowParallelLinear

    col = ColumnParallelLinear(8, 4 * world, sequence_parallel=False)
    row = RowParallelLinear(4 * world, 8, bias=False)
    for layer in (col, row):
        twin = copy.deepcopy(layer)  # an EMA or reference copy of the model: the same group
        assert twin.group is layer.group
        assert twin.weight is not layer.weight and torch.equal(twin.weight, layer.weight)
        with torch.no_grad():
            twin.weight.add_(1)
        assert not torch.equal(twin.weight, layer.weight)
    x = torch.ones(2, 3, 8, dtype=torch.bfloat16)
    assert torch.equal(copy.deepcopy(col)(x), col(x))
    assert repr(col) == (f"ColumnParallelLinear(in_features=8, out_features={4 * world}, bias=True, "
                         f"sequence_parallel=False, tensor_parallel={world})")
    assert repr(row) == (f"RowParallelLinear(in_features={4 * world}, out_features=8, bias=False, "
                         f"sequence_parallel=True, tensor_parallel={world})")


def test_copies_share_the_group_and_descriptions_name_the_sizes():
    run_ranks(_copies_and_descriptions, 2, "gloo", timeout=60)


def _empty_batch(rank, world):
    from distgemm.nn import ColumnParallelLinear, RowParallelLinear

    for sp in (True, False):
        col = ColumnParallelLinear(8, 4 * world, sequence_parallel=sp)
        row = RowParallelLinear(4 * world, 8, sequence_parallel=sp)
        s = 2 * world
        x = torch.ones(s // world if sp else s, 0, 8, dtype=torch.bfloat16, requires_grad=True)
        mid = col(x)
        assert mid.shape == (s, 0, 4)
        y = row(mid)
        assert y.shape == (s // world if sp else s, 0, 8)
        y.sum().backward()
        assert x.grad.shape == x.shape
        assert torch.equal(col.weight.grad, torch.zeros_like(col.weight))
        assert torch.equal(row.bias.grad, torch.zeros_like(row.bias))


def test_a_batch_of_no_sequences_gives_empty_outputs_and_zero_gradients():
    run_ranks(_empty_batch, 2, "gloo", timeout=60)

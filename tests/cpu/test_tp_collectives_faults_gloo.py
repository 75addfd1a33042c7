"""The collectives path's promises under faults and misuse on gloo (CPU tensors): a rank that
never makes its call is a TimeoutError on its peers within DISTGEMM_TIMEOUT_S, not a wait for
the process group's own timeout; a rank that arrives after its peers gave up is told so at once;
the group's calls raise until recover(), after which they are right again."""

import time

import pytest
import torch
import torch.distributed as dist

import distgemm
from tests.dist_helpers import run_ranks
from tests.reference import assert_close

BF16 = torch.bfloat16
TIMEOUT_S = 3.0


def _full(shape, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


def _calls(rank, world, seed):
    """An all-gather and a reduce-scatter of every rank's shards, with their references."""
    m, n, k = 4, 24, 32
    a_full, b = _full((m * world, k), seed), _full((n, k), seed + 1, 0.1)
    ag = (lambda: distgemm.all_gather_matmul(a_full[rank * m:(rank + 1) * m], b), a_full.double() @ b.double().T)
    rs_a, rs_b = _full((m * world, k * world), seed + 2), _full((n, k * world), seed + 3, 0.1)
    cols = slice(rank * k, (rank + 1) * k)
    rs = (lambda: distgemm.matmul_reduce_scatter(rs_a[:, cols], rs_b[:, cols]),
          (rs_a.double() @ rs_b.double().T)[rank * m:(rank + 1) * m])
    return ag, rs


def _expect_timeout(call, words, within):
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        call()
    seconds = time.monotonic() - start
    assert seconds < within, f"the call took {seconds:.1f} s to fail"
    for w in words:
        assert w in str(info.value), info.value
    assert "recover" in str(info.value), info.value


def _peer_never_calls(rank, world, op):
    """The last rank raises before its call (it never makes it); the others time out naming it
    (at three ranks rank 1 comes late and fails as soon as rank 0 gives up) and keep raising; the
    last rank, calling after they gave up, is told so without a wait of its own. Every rank
    recover()s, and the next calls of both ops are right (the group's collectives still pair)."""
    late = world - 1
    with distgemm.settings(timeout_s=TIMEOUT_S):
        for call, want in _calls(rank, world, 10):  # the group is set up and in step
            assert_close(call(), want)
        call, _ = _calls(rank, world, 20)[op == "rs"]
        name = "distgemm.all_gather_matmul" if op == "ag" else "distgemm.matmul_reduce_scatter"
        if rank != late:
            # A rank that comes later fails when the first gives up, not a timeout after its own call.
            if rank == 1 and world > 2:
                time.sleep(TIMEOUT_S - 0.5)
            _expect_timeout(call, (name, f"group rank {late} did not arrive", "DISTGEMM_TIMEOUT_S=3"),
                            2.0 if rank == 1 and world > 2 else TIMEOUT_S + 10)
            _expect_timeout(call, (name, f"group rank {late}"), 2.0)  # until recover(), without another wait
        else:
            time.sleep(TIMEOUT_S + 3)  # past the others' wait
            _expect_timeout(call, (name, "given up"), 2.0)
        distgemm.recover()
        for seed in (30, 40):
            for call, want in _calls(rank, world, seed):
                assert_close(call(), want)


@pytest.mark.parametrize("op,world", [("ag", 3), ("rs", 2)])
def test_a_rank_that_never_calls_is_a_timeout_on_every_rank(op, world):
    run_ranks(_peer_never_calls, world, "gloo", op, timeout=60)


def _late_but_within_the_timeout(rank, world):
    """A peer that is slow but arrives within DISTGEMM_TIMEOUT_S is waited for: no error."""
    with distgemm.settings(timeout_s=TIMEOUT_S + 5):
        for call, want in _calls(rank, world, 50):
            if rank == 1:
                time.sleep(TIMEOUT_S)
            assert_close(call(), want)


def test_a_slow_peer_within_the_timeout_is_waited_for():
    run_ranks(_late_but_within_the_timeout, 3, "gloo", timeout=60)


def _disagreement_needs_no_recover(rank, world):
    """Shapes that differ are a ValueError on every rank naming each rank's; the ranks stay in
    step (no recover() needed), also on a subgroup."""
    sub = dist.new_group([0, 1])
    if rank > 1:  # not in the group: named, not a TypeError about the sentinel new_group hands back
        for call in (lambda: distgemm.all_gather_matmul(_full((4, 32), 60), _full((24, 32), 61), group=sub),
                     lambda: distgemm.recover(sub)):
            with pytest.raises(ValueError, match="this rank is not a member of group"):
                call()
        return
    a = _full((4 if rank == 0 else 5, 32), 60)
    b = _full((24, 32), 61)
    for _ in range(2):
        with pytest.raises(ValueError, match="the ranks disagree.*rank 0: .*4, 32.*rank 1: .*5, 32"):
            distgemm.all_gather_matmul(a, b, group=sub)
    a = _full((4, 32), 62)
    assert_close(distgemm.all_gather_matmul(a, b, group=sub), torch.cat([a, a]).double() @ b.double().T)


def test_disagreeing_shapes_raise_on_every_rank_and_the_ranks_stay_in_step():
    run_ranks(_disagreement_needs_no_recover, 3, "gloo", timeout=60)


def _threads(rank, world):
    """Calls from two threads on one group are one at a time per group (each call's agreement
    and collectives together): every call is right or, where the threads' calls met in another
    order on the ranks, a ValueError naming the disagreement; never a crash, a hang or a mix of
    two calls' bytes. Two groups on two threads run at once, every call right."""
    import threading

    pair = dist.new_group([0, 1])
    shapes = [(3, 16, 8), (5, 40, 24)]  # (rows per rank, K, N)
    problems = []
    for i, (m, k, n) in enumerate(shapes):
        a_full, b = _full((m * world, k), 70 + i), _full((n, k), 80 + i, 0.2)
        problems.append((a_full[rank * m:(rank + 1) * m], b, a_full.double() @ b.double().T))
    outcomes = [[], []]

    def body(i, group, calls):
        a, b, want = problems[i]
        for _ in range(calls):
            try:
                out = distgemm.all_gather_matmul(a, b, group=group)
            except ValueError as e:
                outcomes[i].append("disagree" if "the ranks disagree" in str(e) else repr(e))
            except Exception as e:  # noqa: BLE001 - reported below
                outcomes[i].append(repr(e))
            else:
                outcomes[i].append("right" if (out.double() - want).abs().max() < 0.05 * want.abs().max() else "wrong")

    for groups, calls, allowed in (((None, None), 12, {"right", "disagree"}), ((None, pair), 8, {"right"})):
        outcomes = [[], []]
        threads = [threading.Thread(target=body, args=(i, groups[i], calls)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        assert not any(t.is_alive() for t in threads), "a thread's call hung"
        assert all(len(o) == calls for o in outcomes), outcomes
        assert set(outcomes[0] + outcomes[1]) <= allowed, outcomes


def test_calls_from_two_threads_are_one_at_a_time():
    run_ranks(_threads, 2, "gloo", timeout=60)


def _fp8_c_gradient(rank, world):
    """FP8 inputs with a c that requires grad (a bias being trained): c's gradient, as
    distgemm.gemm gives it; a or b requiring grad is still refused by name."""
    f8 = torch.float8_e4m3fn
    m, n, k = 4, 16, 32
    a_full = _full((m * world, k), 90).float().to(f8)
    b = _full((n, k), 91, 0.5).float().to(f8)
    ones = torch.ones(1)
    weights = torch.randn(m * world, n, generator=torch.Generator().manual_seed(92 + rank))
    rows = slice(rank * m, (rank + 1) * m)
    for shape in ((n,), (1, n), (m * world, n)):
        c = _full(shape, 93).requires_grad_()
        out = distgemm.all_gather_matmul(a_full[rows], b, scale_a=ones, scale_b=ones, c=c, beta=-2.0)
        assert_close(out, a_full.double() @ b.double().T - 2 * c.detach().double(), f8)
        out.float().mul(weights).sum().backward()
        want = -2 * weights.double()
        assert_close(c.grad, want if len(shape) == 2 and shape[0] != 1 else want.sum(0).reshape(shape))
    for shape in ((n,), (1, n), (m, n)):
        c = _full(shape, 94).requires_grad_()
        out = distgemm.matmul_reduce_scatter(a_full, b, scale_a=ones, scale_b=ones, c=c, beta=0.5)
        assert_close(out, world * (a_full.double() @ b.double().T)[rows] + 0.5 * c.detach().double(), f8)
        out.float().mul(weights[rows]).sum().backward()
        want = 0.5 * weights[rows].double()
        assert_close(c.grad, want if shape[0] == m else want.sum(0).reshape(shape))
    for op in (distgemm.all_gather_matmul, distgemm.matmul_reduce_scatter):
        with pytest.raises(NotImplementedError, match="autograd through float8 inputs"):
            op(a_full.clone().requires_grad_(), b, scale_a=ones, scale_b=ones)


def test_fp8_inputs_give_the_gradient_of_c():
    run_ranks(_fp8_c_gradient, 2, "gloo", timeout=60)


def _compiled_first_call(rank, world):
    """torch.compile(fullgraph=True) of a function whose TP call is the group's first (the group
    state is made outside the traced code), both ops, forward and backward; also at one rank."""
    group = dist.new_group(list(range(world))) if world > 1 else dist.group.WORLD
    m, n, k = 4, 16, 32
    a_full, b = _full((m * world, k), 100), _full((n, k), 101, 0.2)
    rows = slice(rank * m, (rank + 1) * m)

    def ag(a, b):
        return torch.relu(distgemm.all_gather_matmul(a, b, group=group))

    def rs(a, b):
        return 2 * distgemm.matmul_reduce_scatter(a, b, group=group)

    want = a_full.double() @ b.double().T
    assert_close(torch.compile(ag, fullgraph=True)(a_full[rows], b), want.clamp_min(0))
    if world == 1:  # one compile is enough there (the same traced code as every op's)
        return
    assert_close(torch.compile(rs, fullgraph=True)(a_full, b), 2 * world * want[rows])
    a, bg = a_full[rows].clone().requires_grad_(), b.clone().requires_grad_()
    torch.compile(ag, fullgraph=True)(a, bg).float().sum().backward()
    ra, rb = a_full.double().requires_grad_(), b.double().requires_grad_()
    torch.relu(ra @ rb.T).sum().backward()
    assert_close(a.grad, world * ra.grad[rows])  # every rank's loss reads every row
    assert_close(bg.grad, rb.grad)


@pytest.mark.parametrize("world", [1, 2])
def test_a_compiled_first_call_on_a_group(world):
    run_ranks(_compiled_first_call, world, "gloo", timeout=120)


def test_empty_shards():
    from tests import tp_checks

    run_ranks(tp_checks.check_empty_shards, 2, "gloo", timeout=60)


def _empty_shards_on_a_fused_group(rank, world):
    """The fused path's handling of empty calls, with the group's choice set to fused (gloo
    stands in for NCCL): they run on each rank alone, reaching neither the fused kernels nor
    their agreement (which refuse empty operands: a ValueError there, where the collectives
    path gives beta * c)."""
    from distgemm import tp

    def unreachable(*args, **kwargs):
        raise AssertionError("an empty call reached the fused path")

    tp._state(dist.group.WORLD).fused = True
    for name in ("_fused_all_gather_matmul", "_fused_matmul_reduce_scatter", "_agree_before_collectives"):
        setattr(tp, name, unreachable)
    from tests import tp_checks

    tp_checks.check_empty_shards(rank, world, then_a_product=False)


def test_empty_shards_on_a_fused_group():
    run_ranks(_empty_shards_on_a_fused_group, 2, "gloo", timeout=60)

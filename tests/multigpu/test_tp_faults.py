"""Fault injection at 2 ranks (NCCL): killed and failing peers, ranks that disagree after the
first call, recovery, side streams, two groups at once, and CUDA-graph replay after the
workspaces grew. The contract and the rank bodies: tests/tp_fault_checks.py.

Each test spawns fresh ranks with DISTGEMM_TIMEOUT_S=3 (DISTGEMM_FAULT_TIMEOUT_S overrides)
and one deadline for the whole spawn; every case ends with a clear error on every surviving
rank (or a right result, for the cases that must work), within DISTGEMM_TIMEOUT_S + 15 s
(DISTGEMM_FAULT_SLACK_S), never a hang and never a wrong result returned as valid.
With DISTGEMM_FAULT_REPORT=<path>, one JSON line per case:
{"name", "outcome", "seconds", "hang", "ok", "detail"}.
"""

import json
import os

import pytest
import torch

from tests import tp_fault_checks as fc

WORLD = 2
pytestmark = [pytest.mark.multigpu,
              pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs")]

TIMEOUT_S = float(os.environ.get("DISTGEMM_FAULT_TIMEOUT_S", "3"))
STARTUP_S = 60.0  # spawn, CUDA and NCCL set-up, first workspace (typically ~8 s)
CASE_S = 2 * TIMEOUT_S + fc.SLACK_S + 10  # one failing call, the next call, recover, a check


def _report(line: dict) -> None:
    path = os.environ.get("DISTGEMM_FAULT_REPORT")
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def run_cases(body, *args, cases, ranks=(0, 1), victim=None, env=None, n_case_budgets=None):
    """Spawns `body`, judges `cases` (names every rank in `ranks` must report), writes the
    report lines and fails with every case that went wrong."""
    budget = STARTUP_S + CASE_S * (n_case_budgets or len(cases))
    res = fc.spawn(body, *args, world=WORLD, env={"DISTGEMM_TIMEOUT_S": f"{TIMEOUT_S:g}", **(env or {})},
                   deadline_s=budget)
    failures = []
    for name in cases:
        got = {r: res.cases[r].get(name) for r in ranks}
        missing = [r for r, v in got.items() if v is None]
        hang = False
        if missing:
            why = []
            for r in missing:
                if r in res.errors:
                    why.append(f"rank {r} raised before reporting: {res.errors[r].strip().splitlines()[-1][:300]}")
                elif r in res.hung:
                    hang = True
                    why.append(f"rank {r} did not report within the spawn's {budget:.0f} s (hang)")
                else:
                    why.append(f"rank {r} exited (code {res.exitcodes[r]}) without reporting")
            outcome, seconds, ok = "FAILED: " + "; ".join(why), res.seconds, False
        else:
            ok = all(v["ok"] for v in got.values())
            seconds = max(v["seconds"] for v in got.values())
            outcomes = {v["outcome"] for v in got.values()}
            if ok and outcomes <= {"error", "error on every rank"} and len(ranks) == WORLD:
                outcome = "error on every rank"
            elif ok and len(outcomes) == 1:
                outcome = outcomes.pop()
            elif ok:
                outcome = "; ".join(f"rank {r}: {v['outcome']}" for r, v in got.items())
            else:
                outcome = "FAILED: " + "; ".join(f"rank {r}: {v['outcome']}" for r, v in got.items() if not v["ok"])
        detail = " | ".join(f"rank {r}: {v['detail']}" for r, v in got.items() if v and v.get("detail"))
        _report({"name": name, "outcome": outcome, "seconds": round(seconds, 2), "hang": hang, "ok": ok,
                 "detail": detail[:2000]})
        if not ok:
            failures.append(f"{name}: {outcome}")
    for r, tb in res.errors.items():
        failures.append(f"rank {r} raised outside a case:\n{tb}")
    expected_exit = {r: (fc.KILLED_EXIT if r == victim else 0) for r in range(WORLD)}
    wrong_exit = [r for r in range(WORLD) if r not in res.hung and res.exitcodes[r] != expected_exit[r]]
    if wrong_exit:
        failures.append(f"exit codes {res.exitcodes} (expected {list(expected_exit.values())}; "
                        f"rank {fc.KILLED_EXIT} = killed on purpose)")
    assert not failures, f"{len(failures)} fault cases failed (spawn took {res.seconds:.1f} s):\n" + "\n".join(failures)


@pytest.mark.parametrize("mode,op,algo", [("before", "ag", "auto"), ("mid", "rs", "fused")])
def test_killed_peer(mode, op, algo):
    """Rank 1 os._exit()s before / during its call: rank 0 raises TimeoutError in time, its next
    call raises, and recover() without the peer times out."""
    name = f"killed_peer_{mode}_{op}"
    run_cases(fc.killed_peer, mode, op, cases=[name, f"{name}:next_call_raises", f"{name}:recover_without_peer"],
              ranks=(0,), victim=1, env={"DISTGEMM_TP_ALGO": algo}, n_case_budgets=2)


def test_peer_raises_then_recover():
    run_cases(fc.peer_raises_then_recover, "ag", cases=["peer_raises_before_call_ag", "recover_after_timeout"],
              env={"DISTGEMM_TP_ALGO": "decomposed"})


@pytest.mark.parametrize("op,algo", [("ag", "fused"), ("rs", "decomposed")])
def test_late_peer(op, algo):
    """Rank 1 arrives after rank 0 timed out (and ran its next call): both raise, rank 1 at
    once and with NaN rather than the next call's data; recover() makes both right again."""
    run_cases(fc.late_peer, op, cases=[f"late_peer_{op}", f"late_peer_{op}:recover"], env={"DISTGEMM_TP_ALGO": algo})


def test_shapes_and_dtypes_that_differ_after_the_first_call():
    run_cases(fc.shapes_disagree, cases=["shapes_differ_ag", "shapes_differ_rs", "dtypes_differ_ag"])


def test_settings_that_differ_after_the_first_call():
    run_cases(fc.settings_disagree, cases=["pieces_differ_ag", "pieces_differ_rs", "algo_differ_ag",
                                           "algo_differ_rs", "rs_split_differ_rs"])


def test_paths_that_differ():
    run_cases(fc.paths_disagree, cases=["path_differs_ag", "path_differs_rs", "backend_differs_ag"])


def test_side_stream_two_groups_and_graph_replay_after_growth():
    run_cases(fc.correct_cases, cases=["side_stream", "two_groups", "graph_replay_after_growth",
                                       "graph_replay_after_recover"])

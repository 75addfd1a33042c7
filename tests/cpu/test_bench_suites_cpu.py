"""The MoE suites' whole control flow on the host (tiny layers, CPU tensors, the CUDA timers
and memory counters replaced), so that a mistake in a suite shows here rather than on the GPU
machine, whose time is scarce: every layer of a row is built, stepped, timed, reported and
written to JSON + PNG."""

import json
import time

import pytest
import torch

from distgemm.bench import common, moe_layer_suite, moe_suite


class _Event:
    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


@pytest.fixture
def host_as_gpu(monkeypatch):
    pytest.importorskip("matplotlib")
    for name, value in (("Event", _Event), ("synchronize", lambda *a, **k: None),
                        ("reset_peak_memory_stats", lambda *a, **k: None), ("empty_cache", lambda: None),
                        ("memory_allocated", lambda *a, **k: 0), ("max_memory_allocated", lambda *a, **k: 0),
                        ("get_device_name", lambda *a, **k: "NVIDIA H200")):
        monkeypatch.setattr(torch.cuda, name, value)
    one_round = common.round_robin_ms
    for module in (common, moe_suite, moe_layer_suite):
        monkeypatch.setattr(module, "bench_device", lambda: torch.device("cpu"))
    for module in (moe_suite, moe_layer_suite):  # one round: the figures mean nothing here
        monkeypatch.setattr(module, "round_robin_ms", lambda fns, reps, **kw: one_round(fns, 1, **kw))

    def kernel_table(fn):  # torch.profiler sees no CUDA kernels on the host: a made-up step
        fn()
        rows, classes = moe_suite.tabulate_kernels({"cutlass::device_kernel<GemmUniversal>": [5.0, 7.0],
                                                    "distgemm::moe::act_pipelined_kernel<0>": [2.0]})
        return rows, classes, moe_suite.gpu_span([(0.0, 5.0), (6.0, 13.0), (13.0, 15.0)])

    monkeypatch.setattr(moe_suite, "kernel_table", kernel_table)


def test_moe_suite_runs_every_layer(host_as_gpu, monkeypatch, tmp_path):
    monkeypatch.setattr(moe_suite, "TOKENS", 384)
    monkeypatch.setattr(moe_suite, "QUICK_LAYERS", ((3, 128, 128),))
    geo = moe_suite.run(str(tmp_path), quick=True, activations=("swiglu",))
    assert set(geo) == {"moe distgemm bf16", "moe distgemm block", "moe distgemm row"}
    rows = json.loads((tmp_path / "h200_moe.json").read_text())["rows"]
    assert len(rows) == 2 and (tmp_path / "h200_moe.png").exists()
    for row in rows:
        for name, *_ in moe_suite.VARIANTS:
            assert row[name]["ms"] > 0 and row[name]["vs_torch_bf16"] > 0, name
    assert rows[0]["distgemm block, overwrite"]["gpu_span"] == {"span_us": 15.0, "idle_us": 1.0}
    assert "kernels" in rows[0]["torch bf16"]  # the peer's GPU time, kernel by kernel, too


def test_moe_layer_suite_runs_every_layer(host_as_gpu, monkeypatch, tmp_path):
    monkeypatch.setattr(moe_layer_suite, "QUICK_CASES", ((4, 2, 128, 128, 96),))
    geo = moe_layer_suite.run(str(tmp_path), quick=True)
    assert set(geo) == {"moe_layer distgemm bf16", "moe_layer distgemm block"}
    rows = json.loads((tmp_path / "h200_moe_layer.json").read_text())["rows"]
    assert len(rows) == 2 and (tmp_path / "h200_moe_layer.png").exists()
    for row in rows:
        block = row["distgemm block"]
        assert block["overwrite_step_ms"] > 0 and block["permuted_step_ms"] > 0
        assert row["bf16_vs_torch_rel_err"] < 0.05  # the same layer, bf16 rounding apart

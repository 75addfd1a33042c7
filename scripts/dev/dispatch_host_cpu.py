"""Host time of a repeated `distgemm.gemm` and `distgemm.grouped_mm` without a GPU: CPU tensors,
the dispatch of an sm_90 GPU (kernel checks faked, the autotuner's timing replaced so that the
vendor call is chosen), so that the repeated call runs its remembered runner, F.linear,
torch._scaled_mm (float8, per-tensor scales) or torch._grouped_mm. Prints our calls against
F.linear, torch.matmul, torch._scaled_mm and torch._grouped_mm, and the pieces of our path: the
native table's call alone (its key, lookup and vendor call; the rest of ours is the op's Python
frame and its torch.compile check). What it measures is this host;
the H200's figures come from the bench's `host` suite.

    python scripts/dev/dispatch_host_cpu.py
"""

import contextlib
import sys
import tempfile
import timeit

import torch

import distgemm
import distgemm._library as library
from distgemm import _repeat_calls, autotune, grouped


class _NoDeviceContext(contextlib.nullcontext):
    def __init__(self, device):
        super().__init__()


def fake_sm90() -> None:
    has_kernels, device_arch = library.has_kernels, library.device_arch
    for name, module in list(sys.modules.items()):
        if name.startswith("distgemm") and module is not None:
            if getattr(module, "has_kernels", None) is has_kernels:
                module.has_kernels = lambda device: True
            if getattr(module, "device_arch", None) is device_arch:
                module.device_arch = lambda device: 90
    autotune._LOADED = True
    autotune.may_time = lambda: True
    autotune.flush_buffer = lambda *args, **kwargs: None
    vendors = ("cublas", "torch._scaled_mm", grouped.TORCH)
    autotune._medians = lambda candidates, flush: {n: 0.5 if n in vendors else 1.0 for n in candidates}
    torch.cuda.device = _NoDeviceContext  # a class: torch's code tests isinstance(..., torch.cuda.device)
    backend = grouped._backend
    grouped._backend = lambda op, device, *args: backend(op, torch.device("cuda", 0), *args)


def per_call_us(calls: dict, number: int, rounds: int = 7) -> dict:
    """Each call's best time per call (us) over `rounds`, the calls taking turns, so that this
    host's noise falls on them alike."""
    best = {name: float("inf") for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            best[name] = min(best[name], timeit.timeit(fn, number=number) / number * 1e6)
    return best


def main() -> None:
    fake_sm90()
    torch.set_num_threads(1)  # the CPU kernels' threads add noise only: on the GPU they are not there
    with distgemm.settings(autotune=True, autotune_cache=tempfile.mktemp(suffix=".json")):
        a, b = torch.randn(1, 8, dtype=torch.bfloat16), torch.randn(8, 8, dtype=torch.bfloat16)
        distgemm.gemm(a, b)
        assert autotune.last_backend() == "cublas", autotune.last_backend()
        t = per_call_us({"ours": lambda: distgemm.gemm(a, b), "linear": lambda: torch.nn.functional.linear(a, b),
                         "matmul": lambda: torch.matmul(a, b.T),
                         "native": lambda: _repeat_calls.gemm(a, b, None, 1.0, 0.0, None)}, number=100_000)
        print(f"distgemm.gemm (repeated) {t['ours']:.2f} us; F.linear {t['linear']:.2f} us; torch.matmul "
              f"{t['matmul']:.2f} us; ours - torch.matmul {t['ours'] - t['matmul']:+.2f} us")
        print(f"  of ours: the native table's call {t['native']:.2f} us ({t['native'] - t['linear']:+.2f} us over "
              f"F.linear: its key and lookup), the Python around it {t['ours'] - t['native']:.2f} us")
        fa, fb = torch.randn(1, 16).to(torch.float8_e4m3fn), torch.randn(16, 16).to(torch.float8_e4m3fn)
        sa, sb = torch.tensor(0.5), torch.tensor(2.0)
        distgemm.gemm(fa, fb, scale_a=sa, scale_b=sb)
        assert autotune.last_backend() == "torch._scaled_mm", autotune.last_backend()
        calls = {"ours": lambda: distgemm.gemm(fa, fb, scale_a=sa, scale_b=sb),
                 "peer": lambda: torch._scaled_mm(fa, fb.t(), sa, sb, out_dtype=torch.bfloat16)}
        native = getattr(_repeat_calls, "scaled_gemm", None)
        if native is not None:
            calls["native"] = lambda: native(fa, fb, None, 1.0, 0.0, None, sa, sb, False)
        t = per_call_us(calls, number=50_000)
        print(f"distgemm.gemm float8, per-tensor scales (repeated) {t['ours']:.2f} us; torch._scaled_mm "
              f"{t['peer']:.2f} us; ours - torch {t['ours'] - t['peer']:+.2f} us")
        if native is not None:
            print(f"  of ours: the native table's call {t['native']:.2f} us ({t['native'] - t['peer']:+.2f} us over "
                  f"torch._scaled_mm), the Python around it {t['ours'] - t['native']:.2f} us")
        x, w = torch.randn(16, 8, dtype=torch.bfloat16), torch.randn(2, 8, 8, dtype=torch.bfloat16)
        offs = torch.tensor([8, 16], dtype=torch.int32)
        distgemm.grouped_mm(x, w, offs)
        assert autotune.last_backend() == grouped.TORCH, autotune.last_backend()
        t = per_call_us({"ours": lambda: distgemm.grouped_mm(x, w, offs),
                         "peer": lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs),
                         "native": lambda: _repeat_calls.grouped_mm(x, w, offs, None, True)}, number=20_000)
        print(f"distgemm.grouped_mm (repeated) {t['ours']:.2f} us; torch._grouped_mm {t['peer']:.2f} us; "
              f"ours - torch {t['ours'] - t['peer']:+.2f} us")
        print(f"  of ours: the native table's call {t['native']:.2f} us ({t['native'] - t['peer']:+.2f} us over "
              f"torch._grouped_mm), the Python around it {t['ours'] - t['native']:.2f} us")


if __name__ == "__main__":
    main()

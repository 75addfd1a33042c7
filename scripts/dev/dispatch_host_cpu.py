"""Host time of a repeated `distgemm.gemm` and `distgemm.grouped_mm` without a GPU: CPU tensors,
the dispatch of an sm_90 GPU (kernel checks faked, the autotuner's timing replaced so that the
vendor call is chosen), so that the repeated call runs its remembered runner, F.linear or
torch._grouped_mm. Prints our calls against F.linear, torch.matmul and torch._grouped_mm, and
the pieces of our dense path (the signature, the lookup). What it measures is Python on this
host; the H200's figures come from the bench's `host` suite.

    python scripts/dev/dispatch_host_cpu.py
"""

import contextlib
import sys
import tempfile
import timeit

import torch

import distgemm
import distgemm._library as library
from distgemm import autotune, dense, grouped


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
    vendors = ("cublas", grouped.TORCH)
    autotune._medians = lambda candidates, flush: {n: 0.5 if n in vendors else 1.0 for n in candidates}
    torch.cuda.device = lambda device: contextlib.nullcontext()
    backend = grouped._backend
    grouped._backend = lambda op, device, *args: backend(op, torch.device("cuda", 0), *args)


def per_call_us(fn, number=200_000) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main() -> None:
    fake_sm90()
    with distgemm.settings(autotune=True, autotune_cache=tempfile.mktemp(suffix=".json")):
        a, b = torch.randn(1, 8, dtype=torch.bfloat16), torch.randn(8, 8, dtype=torch.bfloat16)
        distgemm.gemm(a, b)
        assert autotune.last_backend() == "cublas", autotune.last_backend()
        ours = per_call_us(lambda: distgemm.gemm(a, b))
        linear = per_call_us(lambda: torch.nn.functional.linear(a, b))
        matmul = per_call_us(lambda: torch.matmul(a, b.T))
        print(f"distgemm.gemm (repeated) {ours:.2f} us; F.linear {linear:.2f} us; torch.matmul {matmul:.2f} us; "
              f"ours - torch.matmul {ours - matmul:+.2f} us")
        signature = per_call_us(lambda: dense._call_signature(a, b, None, 1.0, 0.0, None))
        lookup = per_call_us(lambda: dense._repeat_call(a, b, None, 1.0, 0.0, None))
        print(f"  of ours: the signature {signature:.2f} us, the lookup with it {lookup:.2f} us")
        x, w = torch.randn(16, 8, dtype=torch.bfloat16), torch.randn(2, 8, 8, dtype=torch.bfloat16)
        offs = torch.tensor([8, 16], dtype=torch.int32)
        distgemm.grouped_mm(x, w, offs)
        assert autotune.last_backend() == grouped.TORCH, autotune.last_backend()
        ours = per_call_us(lambda: distgemm.grouped_mm(x, w, offs), number=50_000)
        peer = per_call_us(lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs), number=50_000)
        print(f"distgemm.grouped_mm (repeated) {ours:.2f} us; torch._grouped_mm {peer:.2f} us; "
              f"ours - torch {ours - peer:+.2f} us")


if __name__ == "__main__":
    main()

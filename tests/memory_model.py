"""Peak memory of a training step as an sm_90 GPU would hold it, on a machine without one.

The step runs on meta tensors (sizes, no data) with the dispatch of an sm_90 GPU: distgemm's
ops answer through their registered fake implementations, so every tensor the Python layers
and the ops create has the shape, dtype and lifetime it has on the GPU. `step_peak` follows
the storages each op creates (not those that existed before the step: parameters, inputs,
main_grad) and reports the most alive at once and what was alive then. Workspaces the C++ ops
allocate internally are not seen (a few MB: the grouped GEMMs' argument arrays).

Checked against the H200 (bench/results/h200_moe.json, the moe suite's peak memory): the bf16
and FP8 block GroupedMLP steps and torch's bf16 layer on the suite's rows agree within 0.5%
(the FP8 step's difference is those workspaces).
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from typing import Callable, Iterable, List, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@contextlib.contextmanager
def sm90_on_meta():
    """distgemm dispatches meta tensors as it would CUDA tensors of an sm_90 GPU."""
    import distgemm
    import distgemm._library as library
    from distgemm import grouped, grouped_fp8

    saved: List[Tuple[object, str, object]] = []

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    has_kernels, device_arch = library.has_kernels, library.device_arch
    for name, module in list(sys.modules.items()):
        if name.startswith("distgemm") and module is not None:
            if getattr(module, "has_kernels", None) is has_kernels:
                patch(module, "has_kernels", lambda device: device.type in ("cuda", "meta"))
            if getattr(module, "device_arch", None) is device_arch:
                patch(module, "device_arch", lambda device: 90)
    backend = grouped._backend
    patch(grouped, "_backend", lambda op, device, *args: backend(op, torch.device("cuda", 0), *args))
    patch(grouped_fp8, "_use_kernel", lambda device: True)
    patch(torch.Tensor, "is_cuda", property(lambda t: t.device.type in ("cuda", "meta")))
    patch(torch.cuda, "is_current_stream_capturing", lambda: False)
    patch(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    try:
        with distgemm.settings(autotune=False):  # nothing to time: the heuristic's tiles
            yield torch.device("meta")
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def _site() -> str:
    """The innermost distgemm (or test) frame: where a tensor was made."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/distgemm/" in frame.filename and "_python_dispatch" not in frame.filename:
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.name}:{frame.lineno}"
    return "?"


class _LiveStorages(TorchDispatchMode):
    def __init__(self, before: Iterable[torch.Tensor]):
        super().__init__()
        self.ignore = {StorageWeakRef(t.untyped_storage()).cdata for t in before if t is not None}
        self.live = {}  # storage -> (weak ref, bytes, what made it)
        self.now = self.peak = 0
        self.at_peak: List[Tuple[int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [k for k, (ref, _, _) in self.live.items() if ref.expired()]:
            self.now -= self.live.pop(key)[1]
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref.cdata not in self.live and ref.cdata not in self.ignore:
                    self.live[ref.cdata] = (ref, storage.nbytes(),
                                            f"{tuple(t.shape)} {str(t.dtype)[6:]} {func.__name__} at {_site()}")
                    self.now += storage.nbytes()
        if self.now > self.peak:
            self.peak = self.now
            self.at_peak = sorted(((n, what) for _, n, what in self.live.values()), reverse=True)
        return out


def step_peak(step: Callable[[], None], before: Iterable[torch.Tensor]) -> Tuple[int, List[Tuple[int, str]]]:
    """Bytes alive at the step's peak beyond `before` (the tensors that exist before it), and
    those tensors, largest first."""
    tracker = _LiveStorages(before)
    with tracker:
        step()
    return tracker.peak, tracker.at_peak


def expert_mlp_peak(layer: str, experts: int, hidden: int, ffn: int, tokens: int, activation: str = "swiglu",
                    **kwargs) -> Tuple[int, List[Tuple[int, str]]]:
    """One training step (forward, backward) of the moe suite's layers: "ours" (GroupedMLP,
    wgrads into FP32 main_grad; kwargs go to it) or "torch" (the suite's torch._grouped_mm layer,
    its bf16 gradients made in the step)."""
    from distgemm.bench.moe_suite import _TorchLayer
    from distgemm.nn import GroupedMLP

    with sm90_on_meta() as dev:
        if layer == "ours":
            module = GroupedMLP(experts, hidden, ffn, activation=activation, device=dev,
                                fuse_wgrad_accumulation=True, **kwargs)
            params = [module.fc1_weight, module.fc2_weight]
            for w in params:
                w.main_grad = torch.zeros(w.shape, device=dev)
        else:
            width = 2 * ffn if activation == "swiglu" else ffn
            module = _TorchLayer(torch.empty(experts, width, hidden, device=dev, dtype=torch.bfloat16),
                                 torch.empty(experts, hidden, ffn, device=dev, dtype=torch.bfloat16), activation)
            params = list(module.parameters())
        x = torch.empty(tokens, hidden, device=dev, dtype=torch.bfloat16)
        dy = torch.empty(tokens, hidden, device=dev, dtype=torch.bfloat16)
        offs = torch.empty(experts, device=dev, dtype=torch.int32)
        before = [x, dy, offs, *params] + [getattr(p, "main_grad", None) for p in params]
        return step_peak(lambda: module(x, offs).backward(dy), before)


def moe_layer_peak(layer: str, experts: int, k: int, hidden: int, ffn: int, tokens: int,
                   **kwargs) -> Tuple[int, List[Tuple[int, str]]]:
    """One training step of the moe_layer suite's whole expert path from the router's top-k
    (permute -> SwiGLU experts -> unpermute): "ours" (MoEExperts, wgrads into FP32 main_grad;
    kwargs go to it) or "torch" (the suite's torch-ops layer, its bf16 gradients made in the
    step). x requires its gradient, as in a model."""
    from distgemm.bench.moe_layer_suite import _TorchMoE
    from distgemm.nn import MoEExperts

    with sm90_on_meta() as dev, _bincount_on_meta():
        if layer == "ours":
            module = MoEExperts(experts, hidden, ffn, activation="swiglu", device=dev, fuse_wgrad_accumulation=True,
                                **kwargs)
            params = [module.experts.fc1_weight, module.experts.fc2_weight]
            for w in params:
                w.main_grad = torch.zeros(w.shape, device=dev)
        else:
            module = _TorchMoE(torch.empty(experts, 2 * ffn, hidden, device=dev, dtype=torch.bfloat16),
                               torch.empty(experts, hidden, ffn, device=dev, dtype=torch.bfloat16))
            params = list(module.parameters())
        x = torch.empty(tokens, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.empty(tokens, hidden, device=dev, dtype=torch.bfloat16)
        topk_ids = torch.empty(tokens, k, device=dev, dtype=torch.int32)
        topk_weights = torch.empty(tokens, k, device=dev, dtype=torch.float32)
        before = [x, dy, topk_ids, topk_weights, *params] + [getattr(p, "main_grad", None) for p in params]
        return step_peak(lambda: module(x, topk_ids, topk_weights).backward(dy), before)


@contextlib.contextmanager
def _bincount_on_meta():
    """torch.bincount has no meta kernel (its length depends on the data); the torch-ops layer
    calls it with minlength = the expert count, which is its length for in-range ids."""
    bincount = torch.bincount

    def meta_aware(t, weights=None, minlength=0):
        if t.device.type == "meta":
            return torch.empty(minlength, dtype=torch.int64, device=t.device)
        return bincount(t, weights, minlength)

    torch.bincount = meta_aware
    try:
        yield
    finally:
        torch.bincount = bincount

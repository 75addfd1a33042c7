"""The ops' argument checks: each names the argument it refuses (TypeError for a wrong type,
ValueError for a wrong value), before anything runs."""

from __future__ import annotations

import numbers
from typing import Tuple

import torch

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOAT16 = (torch.bfloat16, torch.float16)
_OUT_DTYPES_FP8 = (torch.bfloat16, torch.float16, torch.float32)
_INPUT_DTYPES = frozenset(FLOAT16 + FLOAT8)


def check_flags(op: str, **flags) -> None:
    """Each flag True or False (a Python int 0 or 1, or a NumPy bool, too), or a TypeError naming it."""
    for name, v in flags.items():
        if not (isinstance(v, bool) or (type(v) is int and v in (0, 1)) or type(v).__name__ == "bool_"):
            shown = f"a tensor of shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else f"{type(v).__name__} {v!r}"
            raise TypeError(f"{op}: {name} must be True or False, got {shown}")


def check_main_grad(op: str, name: str, weight) -> None:
    """weight.main_grad as fused wgrad accumulation needs it (Megatron-LM's convention): an FP32
    tensor of the weight's shape on its device, contiguous; a RuntimeError naming it otherwise
    (missing) or a ValueError (malformed)."""
    grad = getattr(weight, "main_grad", None)
    if grad is None:
        raise RuntimeError(f"{op}: fuse_wgrad_accumulation=True needs {name}.main_grad: an FP32 tensor of the "
                           "weight's shape")
    if (not isinstance(grad, torch.Tensor) or grad.dtype != torch.float32 or grad.shape != weight.shape
            or grad.device != weight.device or not grad.is_contiguous()):
        got = (f"{grad.dtype} {tuple(grad.shape)} on {grad.device}" if isinstance(grad, torch.Tensor)
               else type(grad).__name__)
        raise ValueError(f"{op}: {name}.main_grad must be a contiguous float32 tensor of shape {tuple(weight.shape)} "
                         f"on {weight.device}, got {got}")


def needs_autograd(*tensors) -> bool:
    """Whether a call must record autograd: grad mode on and any argument requiring grad
    (None and non-tensors count as not: the argument checks name the latter)."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:  # a loop, not any(<generator>): this runs on every call, and that costs ~1 us more
        if getattr(t, "requires_grad", False):
            return True
    return False


def check_no_overlap(op: str, out, inputs) -> None:
    """A ValueError when out's bytes overlap any of ``inputs`` ((name, tensor) pairs): the kernels
    read the operands while they write out (conservative: byte ranges, not elements)."""
    if out is None or out.numel() == 0 or out.device.type == "meta" or torch.compiler.is_compiling():
        return
    start = out.data_ptr()
    end = start + out.numel() * out.element_size()  # out is contiguous
    for name, t in inputs:
        if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.device != out.device:
            continue
        first = t.data_ptr()
        last = first + (sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()
        if first < end and start < last:
            raise ValueError(f"{op}: out must not overlap {name} (the kernel reads {name} while it writes out); "
                             "pass a separate tensor")


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def check_operands(op: str, a, b, c, out_dtype, scale_a, scale_b) -> torch.dtype:
    """Validates the arguments of a gemm-like op (a (M, K), b (N, K)); returns the out dtype."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{op}: {name} must be 2-D, got shape {_shape(t)}")
    if a.dtype not in _INPUT_DTYPES:
        raise ValueError(
            f"{op}: a must be bfloat16, float16, float8_e4m3fn or float8_e5m2, got {a.dtype}"
        )
    if a.dtype in FLOAT16 and b.dtype != a.dtype:
        raise ValueError(f"{op}: b must have a's dtype {a.dtype}, got {b.dtype}")
    if a.dtype in FLOAT8:
        if b.dtype not in FLOAT8:
            raise ValueError(f"{op}: a is {a.dtype} so b must be float8 too, got {b.dtype}")
        if a.dtype == b.dtype == torch.float8_e5m2:
            raise ValueError(f"{op}: float8_e5m2 x float8_e5m2 is not supported; one of a, b "
                             "must be float8_e4m3fn")
    if b.shape[1] != a.shape[1]:
        raise ValueError(
            f"{op}: b must have shape (N, K) with K = a.shape[1] = {a.shape[1]}, got {_shape(b)}"
        )
    if b.device != a.device:
        raise ValueError(f"{op}: b is on {b.device} but a is on {a.device}")

    if out_dtype is None:
        out_dtype = a.dtype if a.dtype in FLOAT16 else torch.bfloat16
    if a.dtype in FLOAT16 and out_dtype not in (a.dtype, torch.float32):
        raise ValueError(f"{op}: out_dtype must be {a.dtype} or torch.float32 for {a.dtype} "
                         f"inputs, got {out_dtype}")
    if a.dtype in FLOAT8 and out_dtype not in _OUT_DTYPES_FP8:
        raise ValueError(f"{op}: out_dtype must be bfloat16, float16 or float32 for float8 "
                         f"inputs, got {out_dtype}")

    m, n = a.shape[0], b.shape[0]
    if c is not None:
        if not isinstance(c, torch.Tensor):
            raise TypeError(f"{op}: c must be a torch.Tensor or None, got {type(c).__name__}")
        if c.device != a.device:
            raise ValueError(f"{op}: c is on {c.device} but a is on {a.device}")
        if not c.is_floating_point():
            raise ValueError(f"{op}: c must be a floating-point tensor, got {c.dtype}")
        if _shape(c) not in ((m, n), (n,), (1, n)):
            raise ValueError(f"{op}: c must have shape (M, N) = ({m}, {n}) or be a bias of "
                             f"shape ({n},), got {_shape(c)}")
    block_scaled = is_block_scaled(a, b, scale_a, scale_b)
    if block_scaled and (out_dtype != torch.bfloat16 or c is not None):
        raise ValueError(f"{op}: 128-block scales give bfloat16 out without c (got out_dtype "
                         f"{out_dtype}, c {'given' if c is not None else 'None'})")
    if block_scaled and b.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{op}: 128-block scales take a float8_e4m3fn b (a float8_e4m3fn or float8_e5m2), "
                         f"got b {b.dtype}")
    for name, s, length, axis in (("scale_a", scale_a, m, "M"), ("scale_b", scale_b, n, "N")):
        if s is None:
            continue
        if a.dtype not in FLOAT8:
            raise ValueError(f"{op}: {name} applies to float8 inputs only (a is {a.dtype})")
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
            raise ValueError(f"{op}: {name} must be a float32 tensor")
        if s.device != a.device:
            raise ValueError(f"{op}: {name} is on {s.device} but a is on {a.device}")
        if not block_scaled and s.numel() not in (1, length):
            _refuse_block_shapes(op, a, b, scale_a, scale_b)
            raise ValueError(f"{op}: {name} must hold 1 value (per tensor) or {axis} = {length} "
                             f"values (row-wise), got shape {_shape(s)}")
    return out_dtype


def _refuse_block_shapes(op, a, b, scale_a, scale_b) -> None:
    """Scales that are neither per tensor nor row-wise, one of them of more than one dimension:
    meant as 128-block scales, so the error names the one whose shape is not the block shape."""
    if not (isinstance(scale_a, torch.Tensor) and isinstance(scale_b, torch.Tensor)
            and max(scale_a.dim(), scale_b.dim()) >= 2):
        return
    m, n, kb = a.shape[0], b.shape[0], _blocks(a.shape[1])
    wrong = [f"{name} must be {form} = {want}, got {_shape(s)}"
             for name, s, form, want in (("scale_a", scale_a, "(M, ceil(K/128))", (m, kb)),
                                         ("scale_b", scale_b, "(ceil(N/128), ceil(K/128))", (_blocks(n), kb)))
             if _shape(s) != want]
    if wrong:
        raise ValueError(f"{op}: 128-block scales: {'; '.join(wrong)} (or one value per tensor or per row: "
                         f"1 or M = {m} for scale_a, 1 or N = {n} for scale_b)")


def check_scalars(op: str, **values) -> Tuple[float, ...]:
    """alpha / beta as floats, or a TypeError naming the one that is not a real number."""
    out = []
    for name, v in values.items():
        if isinstance(v, (torch.SymFloat, torch.SymInt)):  # traced under torch.compile
            out.append(v)
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{op}: {name} must be a real number (int or float), got "
                            f"{type(v).__name__} {v!r}")
        out.append(float(v))
    return tuple(out)


def require_fp8_scales(op: str, a, scale_a, scale_b) -> None:
    """float8 inputs need both scales: the quantizer's, never an assumed 1."""
    if a.dtype in FLOAT8 and (scale_a is None or scale_b is None):
        missing = " and ".join(n for n, s in (("scale_a", scale_a), ("scale_b", scale_b)) if s is None)
        raise ValueError(f"{op}: float8 inputs need scale_a and scale_b (FP32, one value per tensor, "
                         f"per row, or per 128-block); {missing} not given (pass torch.ones(1) for "
                         "unscaled data)")


def _blocks(n: int) -> int:
    return (n + 127) // 128


def _reads_row_wise(a, b, scale_a, scale_b) -> bool:
    """Both scales read as per-tensor or row-wise values (1 or M, 1 or N). Block-shaped scales
    do so only with one block of K and one of N (ceil(K/128) = ceil(N/128) = 1), where the two
    readings are the same product; scale_b alone may hold N values in blocks (N a multiple of
    128 and ceil(K/128) = 128: (N/128, 128))."""
    return scale_a.numel() in (1, a.shape[0]) and scale_b.numel() in (1, b.shape[0])


def is_block_scaled(a, b, scale_a, scale_b) -> bool:
    """DeepSeek-style scales: a per 1 x 128 (M, ceil(K/128)), b per 128 x 128
    (ceil(N/128), ceil(K/128)); shapes that also read as per-tensor or row-wise go that way."""
    if not (isinstance(scale_a, torch.Tensor) and isinstance(scale_b, torch.Tensor)):
        return False
    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    if scale_a.dim() != 2 or scale_b.dim() != 2 or _reads_row_wise(a, b, scale_a, scale_b):
        return False
    return tuple(scale_a.shape) == (m, _blocks(k)) and tuple(scale_b.shape) == (_blocks(n), _blocks(k))


def block_scales(a, b, scale_a, scale_b) -> bool:
    """is_block_scaled for arguments the checks accepted (both scales given): a 2-D scale_b
    whose scales do not both read as per-tensor or row-wise can only be 128 x 128 block
    scales there."""
    return (scale_a is not None and scale_b is not None and scale_b.dim() == 2
            and not _reads_row_wise(a, b, scale_a, scale_b))


def check_tp_operands(op, a, b, c, out_dtype, scale_a, scale_b, c_rows_of) -> Tuple[torch.dtype, bool]:
    """check_operands for a TP call (c_rows_of(a's rows): the rows of the output c is added to);
    returns the out dtype and whether autograd records the call."""
    out_dtype = check_operands(op, a, b, None, out_dtype, scale_a, scale_b)
    require_fp8_scales(op, a, scale_a, scale_b)
    n, c_rows = b.shape[0], c_rows_of(a.shape[0])
    if c is not None:
        if not isinstance(c, torch.Tensor) or not c.is_floating_point() or c.device != a.device:
            raise ValueError(f"{op}: c must be a floating-point tensor on {a.device}")
        if tuple(c.shape) not in ((c_rows, n), (n,), (1, n)):
            raise ValueError(f"{op}: c must have shape ({c_rows}, {n}) or be a bias of shape ({n},), "
                             f"got {tuple(c.shape)}")
    return out_dtype, needs_autograd(a, b, c)

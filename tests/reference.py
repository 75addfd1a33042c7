"""Plain-PyTorch references and dtype-aware tolerances shared by the tests."""

import torch


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere fails."""
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "output has NaN or Inf"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


_ROUNDING = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def tolerance(out_dtype: torch.dtype, in_dtype: torch.dtype = torch.bfloat16) -> float:
    """Relative error allowed: the output's rounding, or for float8 inputs the tensor
    cores' reduced-precision partial sums between FP32 promotions (the reference rounds
    its inputs the same way, so input quantization cancels)."""
    accumulation = 2e-3 if in_dtype in FLOAT8 else 2e-5
    return max(_ROUNDING[out_dtype], accumulation)


def assert_close(out: torch.Tensor, ref: torch.Tensor, in_dtype: torch.dtype = torch.bfloat16):
    tol = tolerance(out.dtype, in_dtype)
    err = rel_error(out, ref)
    assert err <= tol, f"relative error {err:.3e} > {tol:.1e}"


def ref_gemm(a, b, c=None, alpha=1.0, beta=0.0, sa=None, sb=None):
    """alpha * (sa[:, None] * sb[None, :] * (a @ b.T)) + beta * c in float64."""
    acc = a.double() @ b.double().T
    if sa is not None:
        acc = acc * sa.double().reshape(-1, 1)
    if sb is not None:
        acc = acc * sb.double().reshape(1, -1)
    out = alpha * acc
    return out if c is None else out + beta * c.double()


def randn(*shape, dtype, device, scale=1.0):
    """Random values in `dtype` (float8 from a scaled normal, kept in range)."""
    x = torch.randn(*shape, device=device) * scale
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        x = x.clamp(-240, 240)
    return x.to(dtype)


def make_offs(counts, device="cuda") -> torch.Tensor:
    """int32 cumulative group ends (torch._grouped_mm's offs) of the given group sizes."""
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def random_counts(groups: int, tokens: int, zero_groups=()) -> list:
    """Random group sizes summing to `tokens`, the groups in `zero_groups` empty."""
    w = torch.rand(groups)
    for g in zero_groups:
        w[g] = 0
    c = (w / w.sum() * tokens).floor().long()
    live = [g for g in range(groups) if g not in zero_groups]
    c[live[0]] += tokens - int(c.sum())
    return c.tolist()


def grouped_loop(x, w, offs, trans_w=True):
    """Per expert g in float64: x[rows_g] @ w[g].T (trans_w) or @ w[g]; rows past offs[-1] zero."""
    out, start = torch.zeros(x.shape[0], w.shape[1] if trans_w else w.shape[2], dtype=torch.float64), 0
    for g, end in enumerate(offs.tolist()):
        wg = w[g].double()
        out[start:end] = x[start:end].double() @ (wg.T if trans_w else wg)
        start = end
    return out


def grouped_wgrad_loop(dy, x, offs):
    """Per expert g in float64: dy[rows_g].T @ x[rows_g] (zeros for an expert without rows)."""
    out, start = torch.zeros(offs.numel(), dy.shape[1], x.shape[1], dtype=torch.float64), 0
    for g, end in enumerate(offs.tolist()):
        out[g] = dy[start:end].double().T @ x[start:end].double()
        start = end
    return out

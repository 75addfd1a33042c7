"""The expert MLP in FP32, one expert at a time: the reference of distgemm.moe's tests."""

import torch


def expert_mlp_reference(x, counts, w1, w2, activation, b1=None, b2=None):
    """y (T, hidden) float32 with autograd through x, w1, w2 (and the biases), per expert."""
    outs, start = [], 0
    ffn = w2.shape[2]
    for g, n in enumerate(counts):
        xg = x[start:start + n].float()
        h = xg @ w1[g].float().T
        if b1 is not None:
            h = h + b1[g].float()
        if activation == "swiglu":
            a = torch.nn.functional.silu(h[:, :ffn]) * h[:, ffn:]
        else:
            a = torch.nn.functional.gelu(h)
        y = a @ w2[g].float().T
        if b2 is not None:
            y = y + b2[g].float()
        outs.append(y)
        start += n
    return torch.cat(outs) if outs else x.new_zeros((0, w2.shape[1]), dtype=torch.float32)


def rel(a, b):
    """Norm-wise relative error of a against b."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))

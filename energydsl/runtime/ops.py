"""The operations generated modules call: causal reductions and the attention forms they lower to.

Plain PyTorch, differentiable by autograd, so `torch.compile` sees through them. Each matches the
reference interpreter (`energydsl.evaluate`) exactly in its conventions: a context is `j <= i`, or
`j < i` when strict; an empty context (strict, i = 0) sums to 0, has log-sum-exp 0 and no weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["causal_masks", "linear_attention", "masked_reduce", "masked_softmax", "prefix_reduce",
           "softmax_attention"]


def causal_masks(T: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Boolean (T, T) masks of the admissible keys: j <= i, and j < i."""
    i = torch.arange(T, device=device)
    return i[None, :] <= i[:, None], i[None, :] < i[:, None]


def masked_softmax(x: Tensor, mask: Tensor, dim: int) -> Tensor:
    p = torch.softmax(x.masked_fill(~mask, float("-inf")), dim=dim)
    return torch.nan_to_num(p, nan=0.0) * mask


def masked_reduce(x: Tensor, mask: Tensor, dim: int, op: str) -> Tensor:
    """Reduce along the context axis `dim` over the admissible entries only (the T x T form)."""
    if op == "sum":
        return torch.where(mask, x, 0.0).sum(dim)
    if op == "mean":
        return torch.where(mask, x, 0.0).sum(dim) / mask.sum(dim).clamp(min=1)
    if op == "logsumexp":
        out = torch.logsumexp(x.masked_fill(~mask, float("-inf")), dim=dim)
        return torch.where(torch.isneginf(out), torch.zeros_like(out), out)
    if op == "prod":
        return torch.where(mask, x, 1.0).prod(dim)
    if op == "max":
        return x.masked_fill(~mask, float("-inf")).amax(dim)
    raise ValueError(op)


def _shift(x: Tensor, dim: int, fill: float) -> Tensor:
    """x moved one step along `dim` (entry i holds x[i - 1]; entry 0 holds `fill`)."""
    pad = torch.full_like(x.narrow(dim, 0, 1), fill)
    return torch.cat([pad, x.narrow(dim, 0, x.shape[dim] - 1)], dim=dim)


def prefix_reduce(x: Tensor, dim: int, op: str, strict: bool) -> Tensor:
    """Reduce over j <= i (j < i when strict) of a value that does not depend on i: O(T), not O(T^2)."""
    if op == "sum":
        out = torch.cumsum(x, dim)
        return _shift(out, dim, 0.0) if strict else out
    if op == "mean":
        n = x.shape[dim]
        count = torch.arange(0 if strict else 1, n + (0 if strict else 1), device=x.device, dtype=x.dtype)
        shape = [1] * x.dim()
        shape[dim] = n
        return prefix_reduce(x, dim, "sum", strict) / count.clamp(min=1).reshape(shape)
    if op == "logsumexp":
        out = torch.logcumsumexp(x, dim)
        return _shift(out, dim, 0.0) if strict else out
    raise ValueError(op)


def softmax_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float | Tensor, bias: Tensor | None = None,
                      strict: bool = False) -> Tensor:
    """o_i = Σ_{j ≤ i} softmax_j(scale q_i·k_j + bias_ij) v_j, q, k, v as (B, H, T, D).

    The causal case without a bias is `scaled_dot_product_attention(is_causal=True)`, which picks a
    fused (flash / memory-efficient) kernel; a bias or a strict context passes an additive mask.
    """
    if isinstance(scale, Tensor):  # a learned temperature: fold it into the queries
        q, scale = q * scale, 1.0
    if bias is None and not strict:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=float(scale))
    T = q.shape[-2]
    allowed = causal_masks(T, q.device)[1 if strict else 0]
    if strict:  # row 0 has no context: let it see key 0, then zero its output (no update, zero gradient)
        allowed = allowed.clone()
        allowed[0, 0] = True
    mask = torch.zeros(T, T, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
    if bias is not None:
        mask = bias.to(q.dtype) + mask
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=float(scale))
    if strict:
        keep = torch.ones(T, 1, dtype=out.dtype, device=out.device)
        keep[0] = 0
        out = out * keep
    return out


def linear_attention(q: Tensor, k: Tensor, v: Tensor, *, log_decay: Tensor | None = None, strict: bool = False,
                     chunk: int = 64) -> Tensor:
    """o_i = Σ_{j ≤ i} a^(i-j) (q_i·k_j) v_j in chunks of C: O(T·C·d + T·d²) time, no T x T matrix.

    q, k (B, H, T, Dk), v (B, H, T, Dv); log_decay = log a, a scalar (None: a = 1). Within a chunk
    the masked C x C form, across chunks a running state S = Σ a^(·) k_j v_jᵀ (the recurrent form).
    """
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    C = min(chunk, T)
    pad = (-T) % C
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    n = (T + pad) // C
    q, k, v = (t.reshape(B, H, n, C, -1) for t in (q, k, v))
    idx = torch.arange(C, device=q.device)
    allowed = (idx[None, :] < idx[:, None]) if strict else (idx[None, :] <= idx[:, None])
    if log_decay is None:
        intra = allowed.to(q.dtype)
        q_in, k_out, chunk_decay = q, k, None
    else:
        ld = log_decay.to(q.dtype)
        dist = (idx[:, None] - idx[None, :]).to(q.dtype)
        intra = torch.exp((ld * dist).masked_fill(~allowed, float("-inf")))
        pos = idx.to(q.dtype)
        q_in = q * torch.exp(ld * pos)[:, None]  # a^c for the query at offset c
        k_out = k * torch.exp(ld * (C - 1 - pos))[:, None]  # a^(C-1-c): decay to the chunk's end
        chunk_decay = torch.exp(ld * C)
    scores = (q @ k.transpose(-1, -2)) * intra  # (B, H, n, C, C)
    out = scores @ v
    # the state carried into each chunk: S_c = Σ over earlier chunks, decayed to the chunk's start
    kv = k_out.transpose(-1, -2) @ v  # (B, H, n, Dk, Dv): each chunk's contribution at its end
    states = []
    S = q.new_zeros(B, H, Dk, Dv)
    for c in range(n):
        states.append(S)
        S = (S * chunk_decay if chunk_decay is not None else S) + kv[:, :, c]
    S_in = torch.stack(states, dim=2)  # (B, H, n, Dk, Dv)
    if log_decay is not None:
        # a query at offset c sees the state (at the previous chunk's end) decayed by a^(c + 1)
        q_in = q_in * torch.exp(ld)
    out = out + q_in @ S_in
    return out.reshape(B, H, n * C, Dv)[:, :, :T]

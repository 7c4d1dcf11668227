"""Plain PyTorch references for (gated) linear attention.

Linear attention is the update derived from a sum-of-squares energy
F = -(T/2) sum_j gamma_ij (z . W h_j)^2: its gradient step reads out
o_i = scale * sum_{j <= i} gamma_ij (q_i . k_j) v_j  (j < i when `strict`),
with gamma_ij = exp(sum_{s=j+1}^{i} log_decay[s]) the product of the per-step decays a_s = exp(log_decay[s]).

Two formulations that share no code, so that agreeing with both is real evidence for the Triton kernels in
`energydsl.kernels.linear`:

* `linear_attention_parallel_ref`: the O(T^2) masked "attention" form, decay matrix built from a cumulative
  sum (or, for a per-head decay, from the distance i - j directly);
* `linear_attention_recurrent_ref`: the O(T) recurrence S_i = a_i S_{i-1} + k_i v_i^T, o_i = q_i S_i.

Both are differentiable by autograd, which gives the reference gradients (dq, dk, dv, d log_decay).
Shapes: q, k (B, H, T, Dk); v (B, H, T, Dv); log_decay (B, H, T) per token or (H,) per head.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["linear_attention_parallel_ref", "linear_attention_recurrent_ref"]


def _check(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor | None) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"expected q, k (B,H,T,Dk) and v (B,H,T,Dv); got {q.shape}, {k.shape}, {v.shape}")
    if log_decay is not None and log_decay.shape not in (q.shape[:3], q.shape[1:2]):
        raise ValueError(f"log_decay must be (B,H,T) or (H,); got {tuple(log_decay.shape)} for q {q.shape}")


def linear_attention_parallel_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float = 1.0,
    log_decay: Tensor | None = None,
    strict: bool = False,
) -> Tensor:
    """O(T^2) masked form: o = scale * ((q k^T) * Gamma * mask) v. Memory grows as T^2: tests only."""
    _check(q, k, v, log_decay)
    T = q.shape[2]
    i = torch.arange(T, device=q.device)
    mask = i[:, None] > i[None, :] if strict else i[:, None] >= i[None, :]
    scores = q @ k.transpose(-1, -2)  # (B, H, T, T): scores[i, j] = q_i . k_j
    if log_decay is None:
        weights = scores.masked_fill(~mask, 0.0)
    else:
        if log_decay.dim() == 1:
            # per-head constant decay a_h: gamma_ij = a_h^(i-j) = exp((i - j) * log a_h)
            dist = (i[:, None] - i[None, :]).to(log_decay.dtype)
            log_gamma = log_decay[None, :, None, None] * dist  # (1, H, T, T)
        else:
            # gamma_ij = exp(c_i - c_j) with c the running sum of log decays
            c = torch.cumsum(log_decay, dim=-1)
            log_gamma = c[..., :, None] - c[..., None, :]  # (B, H, T, T)
        # -inf before exp: the masked (j > i) entries would overflow, and give 0 with 0 gradient this way
        gamma = torch.exp(log_gamma.masked_fill(~mask, float("-inf")))
        weights = scores * gamma.to(scores.dtype)  # fp32 decays on 16-bit inputs, as the kernels take them
    return scale * (weights @ v)


def linear_attention_recurrent_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float = 1.0,
    log_decay: Tensor | None = None,
    strict: bool = False,
) -> Tensor:
    """Token-by-token recurrence S_i = a_i S_{i-1} + k_i v_i^T, o_i = q_i S_i (strict: q_i a_i S_{i-1})."""
    _check(q, k, v, log_decay)
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    S = q.new_zeros(B, H, Dk, Dv)
    outs = []
    for t in range(T):
        if log_decay is not None:
            a = torch.exp(log_decay[:, :, t] if log_decay.dim() == 3 else log_decay[None, :].expand(B, H))
            S = a[..., None, None].to(S.dtype) * S
        if strict:  # read the state before this token's key/value is written
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
        S = S + k[:, :, t, :, None] * v[:, :, t, None, :]
        if not strict:
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return scale * torch.stack(outs, dim=2)

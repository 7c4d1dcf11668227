"""Plain PyTorch references for the softmax-family kernels: the ground truth the Triton ops are tested on.

Everything here is written the explicit, obviously-correct way: the full T x T score matrix, causal masking
with -inf, `torch.softmax`, a matrix product. Memory is O(T^2) per head, so these are for tests, CPU runs and
short sequences; autograd provides every gradient (run them in float64 for gradient checks).

Score of query i against key j, per batch b and head h (the scores the compiler derives for attention-like
energies: scaled dot product, ALiBi distance penalty, a learnable self-affinity and a per-key bias such as
-||k_j||^2 / (2T) for l2-distance scores)::

    s_ij = scale * q_i . k_j  -  slope_h * |i - j|  +  [i == j] * self_bias_h  +  key_bias[b, h, j]

with j <= i admissible (causal) or j < i (strict: row 0 has no context, its output is defined as 0).

Convention for the log-sum-exp of a row with no admissible key (strict row 0): 0, so that every saved
statistic is finite and p_ij = exp(s_ij - lse_i) is still 0 there (all its scores are -inf).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "attention_mask_ref",
    "attention_probs_ref",
    "attention_scores_ref",
    "energy_attention_lse_ref",
    "energy_attention_ref",
    "weighted_second_moment_ref",
]


def attention_mask_ref(T: int, *, strict: bool = False, device: torch.device | str | None = None) -> Tensor:
    """Boolean (T, T) mask of admissible keys: j <= i (causal) or j < i (strict)."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    return j < i if strict else j <= i


def attention_scores_ref(
    q: Tensor,
    k: Tensor,
    *,
    scale: float,
    alibi_slopes: Tensor | None = None,
    self_bias: Tensor | None = None,
    key_bias: Tensor | None = None,
) -> Tensor:
    """Unmasked scores s_ij, shape (B, H, T, T), in q's dtype (biases broadcast as documented above)."""
    T = q.shape[-2]
    s = scale * (q @ k.transpose(-1, -2))
    i = torch.arange(T, device=q.device)[:, None]
    j = torch.arange(T, device=q.device)[None, :]
    if alibi_slopes is not None:
        dist = (i - j).abs().to(s.dtype)  # (T, T)
        s = s - alibi_slopes.to(s.dtype)[None, :, None, None] * dist
    if self_bias is not None:
        eye = (i == j).to(s.dtype)
        s = s + self_bias.to(s.dtype)[None, :, None, None] * eye
    if key_bias is not None:
        s = s + key_bias.to(s.dtype)[:, :, None, :]
    return s


def attention_probs_ref(
    q: Tensor,
    k: Tensor,
    *,
    scale: float,
    strict: bool = False,
    alibi_slopes: Tensor | None = None,
    self_bias: Tensor | None = None,
    key_bias: Tensor | None = None,
) -> Tensor:
    """Row-stochastic p_ij (B, H, T, T); rows without any admissible key are all zeros (not NaN)."""
    T = q.shape[-2]
    s = attention_scores_ref(
        q, k, scale=scale, alibi_slopes=alibi_slopes, self_bias=self_bias, key_bias=key_bias
    )
    mask = attention_mask_ref(T, strict=strict, device=q.device)
    s = s.masked_fill(~mask, float("-inf"))
    if strict:
        # Row 0 is all -inf; softmax would give NaN (and NaN gradients even through masked_fill), so give it a
        # harmless finite row and zero it afterwards: its probabilities are 0 and it passes no gradient.
        empty = ~mask.any(-1)  # (T,)
        s = s.masked_fill(empty[:, None], 0.0)
        return torch.softmax(s, dim=-1).masked_fill(empty[:, None], 0.0)
    return torch.softmax(s, dim=-1)


def energy_attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    strict: bool = False,
    alibi_slopes: Tensor | None = None,
    self_bias: Tensor | None = None,
    key_bias: Tensor | None = None,
) -> Tensor:
    """o_i = sum_j softmax_j(s_ij) v_j, shape (B, H, T, Dv); strict row 0 is 0."""
    p = attention_probs_ref(
        q, k, scale=scale, strict=strict, alibi_slopes=alibi_slopes, self_bias=self_bias, key_bias=key_bias
    )
    return p @ v


def energy_attention_lse_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    strict: bool = False,
    alibi_slopes: Tensor | None = None,
    self_bias: Tensor | None = None,
    key_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(o, lse), lse_i = log sum_j exp(s_ij) over admissible j, shape (B, H, T); empty rows get lse = 0."""
    T = q.shape[-2]
    o = energy_attention_ref(
        q, k, v, scale=scale, strict=strict, alibi_slopes=alibi_slopes, self_bias=self_bias, key_bias=key_bias
    )
    s = attention_scores_ref(
        q, k, scale=scale, alibi_slopes=alibi_slopes, self_bias=self_bias, key_bias=key_bias
    )
    mask = attention_mask_ref(T, strict=strict, device=q.device)
    empty = ~mask.any(-1)
    s = s.masked_fill(~mask, float("-inf")).masked_fill(empty[:, None], 0.0)
    lse = torch.logsumexp(s, dim=-1).masked_fill(empty, 0.0)
    return o, lse


def weighted_second_moment_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor | None,
    u: Tensor,
    *,
    scale: float,
    strict: bool = False,
    alibi_slopes: Tensor | None = None,
    self_bias: Tensor | None = None,
    key_bias: Tensor | None = None,
) -> Tensor:
    """r_i = sum_j p_ij (v_j . u_i) v_j = (sum_j p_ij v_j v_j^T) u_i, shape (B, H, T, Dv).

    The softmax-weighted second moment of the values applied to a per-query vector u_i, as needed by the
    second-order (Newton / covariance-preconditioned) attention variants. `lse` is accepted for signature
    parity with the kernel and ignored: the reference recomputes p from q and k, so its gradients include the
    full softmax Jacobian (which is what the kernel's backward reproduces).
    """
    del lse
    p = attention_probs_ref(
        q, k, scale=scale, strict=strict, alibi_slopes=alibi_slopes, self_bias=self_bias, key_bias=key_bias
    )
    w = u @ v.transpose(-1, -2)  # w_ij = u_i . v_j, (B, H, T, T)
    return (p * w) @ v

"""The pointwise-weight family in plain PyTorch: what the kernels of `pointwise_kernels.py` compute, T x T.

    o_i = sum_j w(scale q_i . k_j + row_bias_i + key_bias_j - slope_h |i - j| + [i = j] self_h) v_j
                                                                       over j <= i (j < i if strict)

Exact in float64 (the generated modules run it for float64 tensors and where no kernel can run), and what the
kernels are tested against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def pointwise_attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    weight: Callable[[Tensor], Tensor],
    *,
    scale: float = 1.0,
    strict: bool = False,
    row_bias: Tensor | None = None,
    key_bias: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    self_bias: Tensor | None = None,
) -> Tensor:
    """q, k: (B, H, T, Dk); v: (B, H, T, Dv); row_bias, key_bias (B, H, T); alibi_slopes, self_bias (H,): the
    score is scale q_i . k_j + row_bias_i + key_bias_j - slope_h |i - j| + [i = j] self_h. The weights outside
    the context are 0, not w of anything (w(-inf) need not vanish)."""
    T = q.shape[-2]
    s = (q @ k.transpose(-1, -2)) * scale
    if row_bias is not None:
        s = s + row_bias[..., :, None]
    if key_bias is not None:
        s = s + key_bias[..., None, :]
    i = torch.arange(T, device=q.device)
    if alibi_slopes is not None:
        s = s - alibi_slopes[:, None, None] * (i[:, None] - i[None, :]).abs()
    if self_bias is not None:
        s = s + self_bias[:, None, None] * torch.eye(T, device=q.device)
    admissible = torch.ones(T, T, dtype=torch.bool, device=q.device).tril(-1 if strict else 0)
    w = torch.where(admissible, weight(s), 0.0)
    return w.to(v.dtype) @ v

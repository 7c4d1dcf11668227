"""The operations generated modules call: causal reductions and the attention forms they lower to.

Plain PyTorch, differentiable by autograd, so `torch.compile` sees through them. Each matches the
reference interpreter (`energydsl.evaluate`) exactly in its conventions: a context is `j <= i`, or
`j < i` when strict; an empty context (strict, i = 0) sums to 0, has log-sum-exp 0 and no weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["causal_masks", "inverse", "linear_attention", "masked_reduce", "masked_softmax", "prefix_reduce",
           "prod_of_others", "projections", "rope", "softmax_attention"]


def causal_masks(T: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Boolean (T, T) masks of the admissible keys: j <= i, and j < i."""
    i = torch.arange(T, device=device)
    return i[None, :] <= i[:, None], i[None, :] < i[:, None]


def inverse(a: Tensor) -> Tensor:
    """A batch of matrix inverses; half-precision matrices are inverted in float32 (LAPACK and cuSOLVER
    have no bfloat16 or float16 inverse), as autocast does, and the result cast back.

    The one inverse a derived update takes is a per-head Newton step's (A_k A_kᵀ)⁻¹, which maps the head's
    step back through the pseudo-inverse of its map A_k: a singular one is said in those terms."""
    half = a.dtype in (torch.float16, torch.bfloat16)
    if torch.compiler.is_compiling():  # (a compiled graph cannot raise on a value)
        return torch.linalg.inv(a.float()).to(a.dtype) if half else torch.linalg.inv(a)
    try:
        return torch.linalg.inv(a.float()).to(a.dtype) if half else torch.linalg.inv(a)
    except torch.linalg.LinAlgError as e:
        raise ValueError(f"a per-head Newton step's A_k A_kᵀ is singular ({str(e).splitlines()[0]}): each head's "
                         "map A_k must have full row rank, which a weight initialised to zeros or ones (or "
                         "trained to rank below the head width) has not; initialise it at random") from None


def projections(*pairs: Tensor) -> tuple[Tensor, ...]:
    """`F.linear(x_n, w_n)` for the pairs x_0, w_0, x_1, w_1, ...: one matrix product per distinct input.

    The weights of one input (the same tensor object, as the context is the state when a layer is given no
    context) are concatenated, so its projections cost one GEMM forward and two backward instead of one and
    two each; the outputs are views of the product's columns.
    """
    inputs, weights = pairs[0::2], pairs[1::2]
    out: list[Tensor | None] = [None] * len(weights)
    for n, x in enumerate(inputs):
        if out[n] is not None:
            continue
        group = [m for m in range(n, len(inputs)) if inputs[m] is x]
        if len(group) == 1:
            out[n] = F.linear(x, weights[n])
            continue
        product = F.linear(x, torch.cat([weights[m] for m in group]))
        for m, part in zip(group, product.split([weights[m].shape[0] for m in group], dim=-1), strict=True):
            out[m] = part
    return tuple(out)


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
    if op == "max":  # over no tokens: 0, as logsumexp's (not -inf, which would poison every gradient)
        return torch.where(mask.any(dim), x.masked_fill(~mask, float("-inf")).amax(dim), 0.0)
    raise ValueError(op)


def prod_of_others(x: Tensor, dim: int, mask: Tensor | None = None) -> Tensor:
    """Entry k: the product of the entries m ≠ k along `dim` (those `mask` keeps; 0 where it drops k), the gradient
    of a product. The products before and after k, not ∏ x / x_k: that is NaN where an entry is 0."""
    if mask is not None:
        x = torch.where(mask, x, 1.0)
    before = _shift(x, dim, 1.0).cumprod(dim)
    after = _shift(x.flip(dim), dim, 1.0).cumprod(dim).flip(dim)
    out = before * after
    return out if mask is None else out * mask


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


def rope(x: Tensor, dim: int, *, base: float = 10000.0, sign: int = 1) -> Tensor:
    """Rotary position embedding, rotate-half pairing (GPT-NeoX, Hugging Face Llama): features m and m + D/2 of x
    (..., D) turned by sign · p · θ_m, θ_m = base^(−2m/D), p the position along axis `dim` of x (0, 1, ...). The
    positions and angles are at least float32, whatever x's dtype (bfloat16 counts exactly only to 256)."""
    half = x.shape[-1] // 2
    acc = torch.promote_types(x.dtype, torch.float32)
    theta = base ** (-2.0 * torch.arange(half, device=x.device, dtype=acc) / x.shape[-1])
    shape = [1] * (x.dim() - 1)
    shape[dim] = x.shape[dim]
    angle = sign * torch.arange(x.shape[dim], device=x.device, dtype=acc).reshape(shape)[..., None] * theta
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def softmax_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float | Tensor, bias: Tensor | None = None,
                      key_bias: Tensor | None = None, strict: bool = False) -> Tensor:
    """o_i = Σ_{j ≤ i} softmax_j(scale q_i·k_j + bias_ij + key_bias_j) v_j, q, k, v as (B, H, T, D).

    Without a (T, T) `bias` this is `scaled_dot_product_attention(is_causal=True)`, which picks a fused
    (flash / memory-efficient) kernel and keeps memory linear in T: a per-key bias (B, H, T) rides along as
    one more feature (q' = [q, 1], k' = [k, key_bias / scale]), and a strict context is the causal one
    shifted by a token (query i + 1 against keys ≤ i; row 0, with no context, is 0). A `bias` passes an
    additive (T, T) mask.
    """
    # SDPA's fused kernels (flash, memory-efficient; CPU and CUDA) read features with unit stride; a view with
    # strided features (RMT's per-head einsum) made it fall back to the math form and its T x T weights
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if isinstance(scale, Tensor):  # a learned temperature: fold it into the queries
        q, scale = q * scale, 1.0
    if bias is not None or scale == 0:  # (a zero scale: torch 2.13's CPU flash kernel gives NaN for one)
        keys = 0.0 if key_bias is None else key_bias[..., None, :]
        return _masked_attention(q, k, v, scale, keys if bias is None else bias + keys, strict)
    if key_bias is not None:
        q = torch.cat([q, torch.ones_like(q[..., :1])], dim=-1)
        k = torch.cat([k, (key_bias / scale)[..., None].to(k.dtype)], dim=-1)
    if not strict:
        return _causal_attention(q, k, v, scale)
    shifted = _causal_attention(q[..., 1:, :], k[..., :-1, :], v[..., :-1, :], scale) if q.shape[-2] > 1 \
        else v[..., :0, :]  # one token: no row has a context (an empty slice keeps the graph)
    return F.pad(shifted, (0, 0, 1, 0))


def _causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """SDPA over j <= i. Where q and k are not as wide as v (a key bias's feature), all three are padded with
    zeros to one width, a multiple of 8, and the output cut back: SDPA's flash kernel takes equal widths only,
    its memory-efficient one multiples of 8 (otherwise the math fallback builds the T x T weights)."""
    if scale < 0:  # torch 2.13's CPU SDPA with is_causal returns NaN on every masked row for a negative scale
        q, scale = -q, -scale  # (the explicit-mask path takes one as it is)
    width = v.shape[-1]
    if q.shape[-1] != width:
        common = -(-max(q.shape[-1], width) // 8) * 8
        q, k, v = (F.pad(t, (0, common - t.shape[-1])) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=float(scale))[..., :width]


def _masked_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, bias: Tensor | float, strict: bool) -> Tensor:
    """SDPA with the context and the bias as one additive (T, T) mask (ALiBi, a self-token bias)."""
    T = q.shape[-2]
    allowed = causal_masks(T, q.device)[1 if strict else 0]
    if strict:  # row 0 has no context: let it see key 0, then zero its output (no update, zero gradient)
        allowed = allowed.clone()
        allowed[0, 0] = True
    mask = torch.zeros(T, T, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=(mask + bias).to(q.dtype), scale=float(scale))
    if strict:
        keep = torch.ones(T, 1, dtype=out.dtype, device=out.device)
        keep[0] = 0
        out = out * keep
    return out


LINEAR_CHUNK = 64  # the chunk length of `linear_attention` (and of the Triton kernels on a GPU)


def linear_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float = 1.0, log_decay: Tensor | None = None,
                     strict: bool = False, chunk: int = LINEAR_CHUNK) -> Tensor:
    """o_i = scale Σ_{j ≤ i} γ_ij (q_i·k_j) v_j in chunks of C: O(T·C·d + T·d² + (T/C)²·d²), no T x T matrix.

    q, k (B, H, T, Dk), v (B, H, T, Dv). log_decay: None (γ = 1); a scalar or (H,) log a (γ_ij = a^(i−j));
    or per token (B, H, T) (γ_ij = exp(Σ_{j<l≤i} log_decay_l), gated linear attention). Inside chunk n,
    with b the running log decay within the chunk and S_n the state before it:
        o_i = scale [Σ_{j in chunk, j ≤ i} exp(b_i − b_j) (q_i·k_j) v_j + exp(b_i) q_i S_n]
    Decay statistics and the cross-chunk sum are at least float32; the matmuls run in the input dtype.
    """
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    if log_decay is not None and log_decay.shape != (B, H, T):
        log_decay = log_decay.to(q.device).reshape(1, -1, 1).expand(B, H, T)  # scalar or per head
    C = chunk
    pad = (-T) % C
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        if log_decay is not None:
            log_decay = F.pad(log_decay, (0, pad))
    N = (T + pad) // C
    qc, kc, vc = q.reshape(B, H, N, C, Dk), k.reshape(B, H, N, C, Dk), v.reshape(B, H, N, C, Dv)
    idx = torch.arange(C, device=q.device)
    causal = idx[:, None] > idx[None, :] if strict else idx[:, None] >= idx[None, :]
    A = qc @ kc.transpose(-1, -2)  # (B, H, N, C, C)
    if log_decay is None:
        kv = (kc.transpose(-1, -2) @ vc).to(acc)  # (B, H, N, Dk, Dv)
        S = (kv.cumsum(2) - kv).to(q.dtype)  # exclusive prefix sum: the state before each chunk
        o = A.masked_fill(~causal, 0.0) @ vc + qc @ S
    else:
        b = log_decay.to(acc).reshape(B, H, N, C).cumsum(-1)
        b_last = b[..., -1]  # (B, H, N)
        M = torch.exp((b[..., :, None] - b[..., None, :]).masked_fill(~causal, float("-inf")))
        kv = ((kc * torch.exp(b_last[..., None] - b)[..., None].to(kc.dtype)).transpose(-1, -2) @ vc).to(acc)
        cum = b_last.cumsum(-1)  # W[n, m] = exp(cum[n-1] - cum[m]) for m < n
        n = torch.arange(N, device=q.device)
        W = ((cum - b_last)[..., :, None] - cum[..., None, :]).masked_fill(~(n[:, None] > n[None, :]), float("-inf"))
        S = torch.einsum("bhnm,bhmkv->bhnkv", torch.exp(W), kv).to(q.dtype)
        o = (A * M.to(A.dtype)) @ vc + (qc * torch.exp(b)[..., None].to(qc.dtype)) @ S
    return scale * o.reshape(B, H, N * C, Dv)[:, :, :T]

"""Product-weighted context sums lowered to chunked linear attention.

`sum[j](γ_ij (a(x_i) . b(h_j)) v_j)`, where γ is 1, a decay a^(i - j) (a number or one per head: RetNet's
multi-scale retention, or exp(-lam[k] (i - j)) written out, the distance in any form SymPy proves equal to
i - j on the causal context, such as abs(i - j)), a data-dependent gate `decay(r)` or a positive power of one
(GLA, Mamba-2; `gates.py`), or a gate times a decay: `linear_attention` of `energydsl.runtime.ops` (torch
backend) or the chunkwise Triton kernels (triton backend), O(T·C·d + T·d²) with no T x T matrix. The decay goes
in as one log decay per head, a gate as per-token log decays (B, H, T). A decayed sum without the coupling,
`sum[j](γ_ij v_j)` (a moving average of the values), runs as the same ops with q = k = 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sympy as sp

from .. import ir
from ..ir import Expr, IndexInfo
from .bias_kinds import distance_kind
from .gates import token_log_decay
from .lowering import _as_bhtd, _from_bhtd, _heads, _n_heads, _split, _state_dependent
from .torch_expr import BATCH, POS, Val, canonical, token_axes
from .triton_source import KernelRequest

if TYPE_CHECKING:
    from .torch_expr import Emitter


def linear_attention_sum(em: Emitter, e: ir.Reduce, info: IndexInfo) -> Val | None:
    """Σ_j γ_ij (q_i·k_j) v_j as the chunked linear-attention ops, or None when the sum is not of that form."""
    j = e.index
    qs, ks, both = _split(em, e.body, j)
    decay = None  # c of a^(i - j) = exp(c (i - j))
    gate = None  # decay(r): per-token rates
    power = None  # p of decay(r)^p
    coupling = None
    for f in both:
        g = ir.bare(f)
        d = _constant_decay(em, g, j, info.strict)
        if d is not None:  # a^(i - j) b^(i - j) = exp((log a + log b)(i - j))
            decay = d if decay is None else ir.add(decay, d)
        elif gate is None and (found := _gate_power(g, j)) is not None:
            gate, power = found
        elif isinstance(g, ir.Dot) and coupling is None and len(g.a.shape) == 1:
            coupling = g
        else:
            return None
    if len(e.shape) > 1 or (coupling is None and decay is None and gate is None):
        return None  # (a plain sum of values is a prefix sum)
    if coupling is None:  # Σ_j γ_ij v_j, a decayed running sum: the ops with q = k = 1 (width 1)
        q = k = em.tmp("torch.ones(1, device=dev, dtype=dt)", (), 1)
        width = 1
    else:
        a_ax = token_axes(coupling.a, em.indices)
        qe, ke = (coupling.a, coupling.b) if j not in a_ax else (coupling.b, coupling.a)
        if j in token_axes(qe, em.indices) or POS in token_axes(ke, em.indices):
            return None
        q, k = em.emit(qe), em.emit(ke)
        width = em.shape_size(qe.shape[0])
    v = em.emit(ir.mul(*ks)) if ks else Val("1.0", scalar=True)
    if POS in v.axes:  # a value of the pair, not of the key alone (a factor of the key's position j): generic
        return None
    rank = 0 if v.scalar else v.rank  # a scalar sum comes back a scalar per token
    if v.scalar:
        v = em.tmp(f"torch.ones_like({k.code}[..., :1]) * {v.code}", k.axes, 1)
    elif rank == 0:
        v = em.tmp(f"{v.code}[..., None]", v.axes, 1)
    # a decay or gate per head with q, k and v shared by the heads: those are spread over the heads
    per_head = (token_axes(decay, em.indices) if decay is not None else set()) | \
        (gate.body.free - {j} if gate is not None else set())
    heads = tuple(sorted(set(_heads(q, k, v, j=j)) | per_head))
    if any(h not in em.sizes for h in heads):  # (a decay over a token axis among them)
        return None
    dv = em.shape_size(e.shape[0]) if e.shape else 1
    qc, vc = _as_bhtd(em, q, heads, POS), _as_bhtd(em, v, heads, j)
    kc = qc if coupling is None else _as_bhtd(em, k, heads, j)  # ones: the same layout
    ld = _log_decay(em, decay, heads) if gate is None else token_log_decay(em, gate, decay, heads, power)
    # the ops' gate for pair (i, j) takes the rates of j < s <= i; a strict context's stops at i - 1 (no rate of
    # token i itself), which is the ops' causal sum for the query one token later, shifted back (and a constant
    # decay's a^(i - j) one factor a short: the early queries carry it)
    early = gate is not None and info.strict
    strict = info.strict and not early
    if early:
        code = f"F.pad({qc}[:, :, 1:], (0, 0, 0, 1))"
        if decay is not None:
            code += f" * torch.exp({_log_decay(em, decay, heads)})[:, None, None]"
        qc = em.tmp(code, (), 4, "each query one token early").code
    summed = "sum over j of (q.k_j) v_j" if coupling is not None else "decayed sum over j of v_j (q = k = 1)"
    if em.backend == "triton":
        ops = em.kernel_set(KernelRequest.linear(strict=strict, decay=ld != "None"))
        code = f"{ops}.linear_attention({qc}, {kc}, {vc}, log_decay={ld}, strict={strict})"
        comment = f"{summed}: the chunked Triton linear-attention kernels above"
    else:
        em.used_ops.add("linear_attention")
        code = f"linear_attention({qc}, {kc}, {vc}, log_decay={ld}, strict={strict})"
        comment = f"{summed}: chunked linear attention"
    if early:
        code = f"F.pad({code}[:, :, :-1], (0, 0, 1, 0))"
        comment += ", with j < i: one token later"
    out = _from_bhtd(em, code, heads, rank, comment)
    em.count_flops(em._axes_flops(set(heads)) * chunked_flops(em.context_len, width, dv, decayed=ld != "None"))
    if qs:
        rest = em.emit(ir.mul(*qs))
        axes = canonical(set(out.axes) | set(rest.axes))
        out = em.tmp(f"{em.align(out, axes, out.rank)} * {em.align(rest, axes, out.rank)}", axes, out.rank)
    return out


def chunked_flops(T: int, dk: int, dv: int, decayed: bool) -> float:
    """Per token and head, the matmul FLOPs of `ops.linear_attention` at length T: its chunks of C (T padded to
    whole chunks) each take q kᵀ and A v (2·C·(dk + dv) per token) and kᵀ v and q S (4·dk·dv per token); with a
    decay, the chunk states' sum over earlier chunks is a (T/C)² einsum of dk x dv states."""
    from ..runtime.ops import LINEAR_CHUNK as C

    chunks = -(-T // C)
    flops = chunks * C * (2 * C * (dk + dv) + 4 * dk * dv) + (2 * chunks**2 * dk * dv if decayed else 0)
    return flops / T


def _gate_power(e: Expr, j: str) -> tuple[ir.Decay, sp.Expr] | None:
    """(the gate, p) for decay(r) (p = 1) or decay(r)^p with p a positive number: the gate of the rates r^p."""
    power = sp.Integer(1)
    if isinstance(e, ir.Pow) and e.exponent.is_number and e.exponent.is_positive:
        e, power = ir.bare(e.base), e.exponent
    return (e, power) if isinstance(e, ir.Decay) and e.index == j else None


def _constant_decay(em: Emitter, e: Expr, j: str, strict: bool) -> Expr | None:
    """exp(c * (i - j)) -> c, the log of the per-step decay of gamma_ij = a^(i - j): a number (ir.Scalar), or a
    value per head (a[k]^(i - j), RetNet's multi-scale retention; exp(-lam[k] * (i - j)) written out) that
    depends on no token and not on the state. The distance is any factor SymPy proves equal to i - j (or j - i:
    c changes sign) on every pair of the causal context, so abs(i - j) is one too."""
    if not (isinstance(e, ir.Func) and e.name == "exp" and isinstance(e.arg, ir.Mul)):
        return None
    factors = list(e.arg.factors)
    for n, f in enumerate(factors):
        sign = {"alibi": 1, "-alibi": -1}.get(distance_kind(f, j, strict), 0)  # ALiBi's |i - j|, i - j here
        if sign:
            c = ir.mul(ir.scalar(sign), *factors[:n], *factors[n + 1:])
            break
    else:
        return None
    if c.shape or _state_dependent(c) or token_axes(c, em.indices) & {BATCH, POS, j}:
        return None
    return c


def _log_decay(em: Emitter, c: Expr | None, heads: tuple[str, ...]) -> str:
    """The linear-attention ops' `log_decay` argument for gamma_ij = exp(c (i - j)): None, or one log decay per
    head of the (B, H, T, D) layout, (H,) in the order `_as_bhtd` flattens the heads."""
    if c is None:
        return "None"
    n_heads = _n_heads(em, heads)
    if isinstance(c, ir.Scalar):
        return f"torch.as_tensor({em.scalar(c.value)}, dtype=dt, device=dev).reshape(1).expand({n_heads})"
    return f"{em.expand(em.emit(c), canonical(set(heads))).code}.reshape({n_heads})"

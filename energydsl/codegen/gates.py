"""Data-dependent gates, `decay(r)`: γ_ij = Π r_s over the context tokens s after j, from the log rates.

Every form is built from G, the prefix sum of log r over the tokens (at least float32), computed once before
the optimizer's steps since the rates read only the context: γ_ij = exp(G_i − G_j) (G_{i−1} under a strict
context, whose last token is i − 1). A gated sum Σ_j γ_ij (q_i·k_j) v_j takes the log rates themselves as the
linear-attention ops' per-token log decays (`token_log_decay`, used by `linear_sums.py`); a gate in a softmax
score, c log γ_ij, gives the attention kernels a per-key bias −c G_j (`lowering.key_bias_arg`), and a pointwise
kernel the row bias c G_i as well (`gate_query_part`: no softmax drops it there); anything else
gets the (T, T) values of log γ (`gate_log_weights`, for a log of a gate: never the log of its exp) or of γ
(`gate_weights`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import ir
from ..ir import Expr
from .torch_expr import BATCH, POS, Val, canonical

if TYPE_CHECKING:
    from .torch_expr import Emitter


def log_rate_prefix(em: Emitter, e: ir.Decay) -> tuple[Val, Val]:
    """(log r, G): the log rate of every context token of `decay(r)` and its prefix sum over the tokens (at least
    float32), laid out (batch, j, heads...) and computed once, before the optimizer's steps."""
    with em.in_prologue():
        rate = em.emit(ir.log_rate(e.body))  # the rates read only the context: the same at every step
        if e not in em.log_rate_prefixes:
            axis = rate.axes.index(e.index)
            em.log_rate_prefixes[e] = em.tmp(
                f"{rate.code}.to(torch.promote_types({rate.code}.dtype, torch.float32)).cumsum({axis})",
                rate.axes, 0, f"log decay from the first token through each {e.index}")
    return rate, em.log_rate_prefixes[e]


def _last_prefix(em: Emitter, e: ir.Decay) -> tuple[Val, Val, Val]:
    """(log r, G over j, G at the last context token of each query i, laid out over i): G_i, or G_{i−1} under a
    strict context."""
    j = e.index
    rate, g = log_rate_prefix(em, e)
    axis = rate.axes.index(j)
    at_i = canonical({POS if a == j else a for a in rate.axes})
    last = f"({g.code} - {rate.code})" if em.indices[j].strict else g.code
    return rate, g, Val(last if axis == at_i.index(POS) else f"{last}.movedim({axis}, {at_i.index(POS)})", at_i)


def gate_query_part(em: Emitter, e: ir.Decay) -> Val:
    """G_i of log γ_ij = G_i − G_j (G_{i−1} under a strict context), one per query: with −G_j as a key bias, a
    pointwise kernel's row bias, where no softmax drops it."""
    g_i = _last_prefix(em, e)[2]
    return em.tmp(g_i.code, g_i.axes, 0, "log decay up to the last context token, per query")


def gate_log_weights(em: Emitter, e: ir.Decay) -> Val:
    """log γ_ij = G_i − G_j as (T, T) values, 0 on masked pairs: what `log(decay(r))` is, never formed as the log
    of γ, whose exp underflows to 0 once the log decay passes −103 in float32 (the log is then −inf, its
    gradient NaN)."""
    j = e.index
    rate, g, g_i = _last_prefix(em, e)
    axes = canonical(set(rate.axes) | {POS})
    mask = em.align(Val("mask_strict" if em.indices[j].strict else "mask", (POS, j), 0), axes, 0)
    diff = f"{em.align(g_i, axes, 0)} - {em.align(g, axes, 0)}"
    return em.tmp(f"({diff}).masked_fill(~{mask}, 0.0).to(dt)", axes, 0,
                  f"log decay: the log rates of the tokens after {j} up to i")


def gate_weights(em: Emitter, e: ir.Decay) -> Val:
    """γ_ij = exp(G_i − G_j) as (T, T) weights; 1 on masked pairs, so that they stay finite."""
    log = gate_log_weights(em, e)
    return em.tmp(f"torch.exp({log.code})", log.axes, 0, "decay: the product of those rates")


def token_log_decay(em: Emitter, gate: ir.Decay, c: Expr | None, heads: tuple[str, ...], power: object = 1) -> str:
    """The linear-attention ops' per-token `log_decay` (B, H, T) for γ_ij = decay(r)^p (times exp(c (i - j))):
    p log r of every token, laid out once before the optimizer's steps, since the rates read only the context."""
    j = gate.index
    n_heads = " * ".join(em.size(h) for h in heads) or "1"
    rate = ir.mul(ir.scalar(power), ir.log_rate(gate.body))
    rate = rate if c is None else ir.add(rate, c)
    with em.in_prologue():
        v = em.emit(rate)
        key = ("log_decay", v.code, heads, j)
        if key not in em.invariant_layouts:
            axes = canonical({BATCH, j} | set(heads))
            full = em.expand(v, axes)
            order = [axes.index(BATCH)] + [axes.index(h) for h in heads] + [axes.index(j)]
            code = full.code if order == sorted(order) else f"{full.code}.permute({', '.join(map(str, order))})"
            em.invariant_layouts[key] = em.tmp(f"{code}.reshape(B, {n_heads}, T)", (), 3,
                                               f"log of decay's rates, (B, H, T): {j} as the token").code
    return em.invariant_layouts[key]

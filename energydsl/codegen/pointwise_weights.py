"""Context sums `Σ_j w(s_ij) v_j` on the pointwise-weight Triton kernels (triton backend).

`weighted_sums.py` writes a sum whose weight no attention form fits as the masked T x T weights times the
values. On the triton backend such a sum runs on the kernels of `energydsl/kernels/pointwise_kernels.py`
instead, with memory linear in T, when its weight is an element-wise function of one score:

    w_ij = G(s_ij),  s_ij = Σ_c c_c (a_c(x_i) · b_c(h_j)) + row_i + key_j + m_h |i − j| + c_h [i = j]

(the score's dot products concatenated as the softmax family's are; a row term has no context token, a key
term no query position or state; the position terms are classified as the softmax family's are, an ALiBi
slope or a self bias per head, proven by SymPy). G is what remains of the weight once the score is replaced
by a variable: it may hold numbers only (a learned scalar inside it, `σ(s + b)`, joins the score as a row term
instead). G and its derivative, taken by the IR's own calculus, are printed as `@triton.jit` functions of one
tile (`scalar_functions.py`) and baked into the kernels (`triton_source.py`); G is printed in torch too, for the
exact float64 path.

    split_weight(em, w, j, strict)    # G printed (`scalar_functions.py`) and its score's terms (a WeightPlan)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import sympy as sp

from .. import ir
from ..ir import Expr
from ..kernels import MAX_HEAD_DIM  # no triton imported: the kernels' package entry is light
from .bias_kinds import bias_kinds
from .gates import gate_query_part
from .lowering import (
    _apply_maps,
    _as_bhtd,
    _as_column,
    _emit_scores,
    _from_bhtd,
    _numel,
    _peel_maps,
    _scaled_val,
    _state_dependent,
    _sum_vals,
    _unflat,
    bias_heads,
    kernel_score_args,
    oriented_couplings,
)
from .scalar_functions import VAR as SCORE
from .scalar_functions import ScalarFunction, scalar_function
from .torch_expr import BATCH, POS, TOKEN_ROLES, Val, canonical, token_axes
from .triton_source import KernelRequest

if TYPE_CHECKING:
    from .torch_expr import Emitter


@dataclass(frozen=True)
class WeightPlan:
    """A pair weight split as G(score): G printed (`scalar_function`: G and G' in Triton, G in torch),
    and the score's couplings, its row terms (no context token) and its other terms by kernel argument."""

    weight: ScalarFunction
    couplings: list[tuple[sp.Expr, ir.Dot]]
    row_terms: list[Expr]
    kinds: dict[str, list]  # the terms with the context token: "key", "alibi", "self" and "gate" (`bias_kinds`)


def kernel_weighted_sum(em: Emitter, e: ir.Reduce, weight: Expr, value: Expr | None, strict: bool,
                        query_term: Expr | None = None) -> Val | None:
    """`Σ_j weight_ij value_j` (value None: 1) on the pointwise kernels (written into the file), or None where
    the weight is not G(score) with a G the printers take (the caller emits the einsum or the masked form).

    With a `query_term` a_i, the sum is `Σ_j weight_ij (a_i + value_j)`, a pair vector split over the sum: one
    call over the values [1, value_j] gives Σ_j weight_ij and Σ_j weight_ij value_j together (the scores once),
    then a_i times the first plus the rest."""
    j = e.index
    plan = split_weight(em, weight, j, strict)
    if plan is None:
        return None
    maps: list[Expr] = []
    if value is None:  # Σ_j w_ij: the weights times a column of ones
        v = Val("torch.ones(B, T, 1, dtype=dt, device=dev)", canonical({BATCH, j}), 1)
    elif query_term is not None:  # a column of ones before the values (no maps peeled: they would mix them)
        v = em.emit(value)
        if v.rank != 1:
            return None
        v = Val(f"F.pad({v.code}, (1, 0), value=1.0)", v.axes, 1)
    else:
        maps, value = _peel_maps(em, value, j)
        v = em.emit(value)
        v = _as_column(em, v)  # a number per key: a column (an expression: laid out once, as `_as_bhtd` keys)
    if POS in v.axes or v.rank != 1:
        return None
    width = 1 if value is None else _numel(em, value.shape) + (query_term is not None)  # (the column of ones)
    wide = max(sum(_numel(em, d.a.shape) for _, d in plan.couplings), width) > MAX_HEAD_DIM  # feature-tiled kernels
    sc, heads = _emit_scores(em, plan.couplings, [], j, also=(v,))
    kinds = plan.kinds  # their head axes too: a slope per head over a q and k the heads share
    heads = canonical(set(heads) | set(bias_heads(em, [*kinds["key"], *kinds["alibi"], *kinds["self"],
                                                       *(c for c, _ in kinds["gate"]), *plan.row_terms], j)))
    rows = [em.emit(ir.add(*plan.row_terms))] if plan.row_terms else []
    # a decay gate c log γ_ij = c (G_i - G_j) in the score: -c G_j goes in the key bias, c G_i here
    rows += [_scaled_val(em, em.emit(coef), gate_query_part(em, gate)) for coef, gate in plan.kinds["gate"]]
    row = _sum_vals(em, rows) if rows else None
    if any(h not in em.sizes for h in heads) or (row is not None and set(row.axes) - {BATCH, POS} - set(heads)):
        return None  # a head axis on the row bias that the scores do not have
    qc, kc, keywords = kernel_score_args(em, sc, plan.kinds, heads, j, strict)
    if row is not None:
        keywords.append(f"row_bias={_as_bhtd(em, _as_column(em, row), heads, POS)}[..., 0]")
    vc = _as_bhtd(em, v, heads, j)
    ops = em.kernel_set(KernelRequest.pointwise(
        strict=strict, row_bias=row is not None, key_bias=bool(plan.kinds["key"] or plan.kinds["gate"]),
        alibi=bool(plan.kinds["alibi"]),
        self_bias=bool(plan.kinds["self"]), weight=plan.weight.value, weight_grad=plan.weight.grad,
        reference=plan.weight.torch, wide=wide))
    code = f"{ops}.pointwise_attention({', '.join([qc, kc, vc, *keywords])})"
    if not e.shape:  # a number per query: the column's one feature
        return _from_bhtd(em, code, heads, 0, "sum over j of w(s_ij) v_j: the pointwise Triton kernels above")
    out = _from_bhtd(em, code, heads, 1, "sum over j of w(s_ij) v_j: the pointwise Triton kernels above")
    if query_term is not None:
        a = em.emit(query_term)
        if a.rank != 1 or not set(a.axes) <= set(out.axes):
            return None
        return em.tmp(f"{out.code}[..., :1] * {em.align(a, out.axes, 1)} + {out.code}[..., 1:]", out.axes, 1,
                      "a_i sum_j w_ij + sum_j w_ij b_j, from the one call over [1, b_j]")
    return _unflat(em, _apply_maps(em, maps, out), e.shape)


def _positions_only(e: Expr) -> bool:
    """Does e read token positions but no token's values (state, input or context)?"""
    return not any(isinstance(n, ir.Var) and n.role in (*TOKEN_ROLES, "context") for n in ir.nodes(e))


def split_weight(em: Emitter, w: Expr, j: str, strict: bool) -> WeightPlan | None:
    """w as G(score), trying the largest token-dependent sum, dot or product first (so that `σ(q·k + b)` takes
    `q·k + b` as its score, and G = σ has no learned scalar in it); None if no subexpression fits: one whose
    terms the kernels take and whose G the printers take."""
    def tokens(n: Expr) -> bool:
        return bool(token_axes(n, em.indices) & {BATCH, POS, j}) or _state_dependent(n)

    for node in ir.nodes(w):
        if not isinstance(node, (ir.Add, ir.Dot, ir.Mul, ir.Let)) or node.shape or not tokens(node):
            continue
        g = ir.substitute(w, {node: SCORE})
        if any(tokens(n) for n in ir.nodes(g)):
            continue  # tokens outside the candidate: not G of it
        terms = _score_terms(em, node, j, tokens, strict)
        printed = None if terms is None else scalar_function(em, g)
        if terms is not None and printed is not None:
            return WeightPlan(printed, *terms)
    return None


def _score_terms(em: Emitter, score: Expr, j: str, tokens: Callable[[Expr], bool], strict: bool
                 ) -> tuple[list[tuple[sp.Expr, ir.Dot]], list[Expr], dict[str, list[Expr]]] | None:
    """(couplings, row terms, the other terms by kind) of a score, or None if a term is none of them (a
    position term the kernels cannot take: a capped distance, a window)."""
    couplings: list[tuple[sp.Expr, ir.Dot]] = []
    rows: list[Expr] = []
    biases: list[Expr] = []
    for t in _terms(score, tokens):
        axes = token_axes(t, em.indices)
        if j not in axes:
            rows.append(t)
        elif not _state_dependent(t):  # a key term, or one of positions and params (ALiBi's)
            biases.append(t)
        else:
            found = oriented_couplings(em, t, j)
            if found is None:
                return None
            couplings += found
    kinds = bias_kinds(em, biases, j, strict)
    return (couplings, rows, kinds) if couplings and kinds is not None else None


def _terms(e: Expr, tokens: Callable[[Expr], bool]) -> list[Expr]:
    """e as a flat list of terms, a token-free factor in front of a sum distributed over it; a sum of positions
    alone is kept whole (`m (j - i)` is ALiBi's -m |i - j|, where `m j` alone would be no kind the kernels take)."""
    body = ir.bare(e)
    if isinstance(body, ir.Add):
        return [t for term in body.terms for t in _terms(term, tokens)]
    if isinstance(body, ir.Mul):
        sums = [f for f in body.factors if tokens(f)]
        if len(sums) == 1 and isinstance(ir.bare(sums[0]), ir.Add) and not _positions_only(sums[0]):
            coef = [f for f in body.factors if f is not sums[0]]
            return [ir.mul(*coef, t) for t in _terms(sums[0], tokens)]
    return [e]

"""Context sums `Σ_j w(s_ij) v_j` on the pointwise-weight Triton kernels (triton backend).

`weighted_sums.py` writes a sum whose weight no attention form fits as the masked T x T weights times the
values. On the triton backend such a sum runs on the kernels of `energydsl/kernels/pointwise_kernels.py`
instead, with memory linear in T, when its weight is an element-wise function of one score:

    w_ij = G(s_ij),  s_ij = Σ_c c_c (a_c(x_i) · b_c(h_j)) + row_i + key_j + m_h |i − j| + c_h [i = j]

(the score's dot products concatenated as the softmax family's are; a row term has no context token, a key
term no query position or state; the position terms are classified as the softmax family's are, an ALiBi
slope or a self bias per head, proven by SymPy). G is what remains of the weight once the score is replaced
by a variable: it may hold numbers only (a learned scalar inside it, `σ(s + b)`, joins the score as a row term
instead). G and its derivative, taken by the IR's own calculus, are printed as `@triton.jit` functions of one tile and
baked into the kernels (`triton_source.py`); G is printed in torch too, for the exact float64 path.

    split_weight(em, w, j, strict)    # G's printed forms and its score's terms (a WeightPlan), or None
    weight_functions(em, G)           # (Triton body of G, of G', torch expression of G), or None
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import sympy as sp

from .. import ir
from ..calculus import NotDifferentiable, gradient
from ..functions import REGISTRY
from ..ir import Expr
from ..kernels import MAX_HEAD_DIM  # no triton imported: the kernels' package entry is light
from .lowering import (
    _apply_maps,
    _as_bhtd,
    _bias_kinds,
    _emit_scores,
    _from_bhtd,
    _number,
    _numel,
    _peel_maps,
    _state_dependent,
    _unflat,
    kernel_score_args,
    oriented_couplings,
)
from .torch_expr import BATCH, POS, Val, canonical, token_axes
from .triton_source import KernelRequest

if TYPE_CHECKING:
    from .torch_expr import Emitter

#: the score inside G: a scalar variable of no token
SCORE = ir.Var("s", "param", ())


@dataclass(frozen=True)
class WeightPlan:
    """A pair weight split as G(score): G's printed forms (`weight_functions`: G and G' in Triton, G in torch),
    and the score's couplings, its row terms (no context token) and its other terms by kernel argument."""

    functions: tuple[str, str, str]
    couplings: list[tuple[sp.Expr, ir.Dot]]
    row_terms: list[Expr]
    kinds: dict[str, list[Expr]]  # the terms with the context token: "key", "alibi" and "self" (`_bias_kinds`)


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
        if v.rank == 0:  # a number per key: a column
            v = Val(f"{v.code}[..., None]", v.axes, 1)  # (an expression: laid out once, as `_as_bhtd` keys)
    if POS in v.axes or v.rank != 1:
        return None
    if sum(_numel(em, d.a.shape) for _, d in plan.couplings) > MAX_HEAD_DIM or (
            value is not None and _numel(em, value.shape) > MAX_HEAD_DIM):
        return None  # no feature-tiled pointwise kernels: wider scores or values keep the einsum
    sc, heads = _emit_scores(em, plan.couplings, [], j, also=(v,))
    row = em.emit(ir.add(*plan.row_terms)) if plan.row_terms else None
    if any(h not in em.sizes for h in heads) or (row is not None and set(row.axes) - {BATCH, POS} - set(heads)):
        return None  # a head axis on the row bias that the scores do not have
    qc, kc, keywords = kernel_score_args(em, sc, plan.kinds, heads, j, strict)
    if row is not None:
        column = row if row.rank else Val(f"{row.code}[..., None]", row.axes, 1)
        keywords.append(f"row_bias={_as_bhtd(em, column, heads, POS)}[..., 0]")
    vc = _as_bhtd(em, v, heads, j)
    triton_weight, triton_grad, torch_weight = plan.functions
    ops = em.kernel_set(KernelRequest.pointwise(
        strict=strict, row_bias=row is not None, key_bias=bool(plan.kinds["key"]), alibi=bool(plan.kinds["alibi"]),
        self_bias=bool(plan.kinds["self"]), weight=triton_weight, weight_grad=triton_grad, reference=torch_weight))
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


def split_weight(em: Emitter, w: Expr, j: str, strict: bool) -> WeightPlan | None:
    """w as G(score), trying the largest token-dependent sum, dot or product first (so that `σ(q·k + b)` takes
    `q·k + b` as its score, and G = σ has no learned scalar in it); None if no subexpression fits: one whose
    terms the kernels take and whose G the printers take."""
    def tokens(n: Expr) -> bool:
        return bool(token_axes(n, em.indices) & {BATCH, POS, j}) or _state_dependent(n)

    for node in ir.walk(w):
        if not isinstance(node, (ir.Add, ir.Dot, ir.Mul, ir.Let)) or node.shape or not tokens(node):
            continue
        g = ir.substitute(w, {node: SCORE})
        if any(tokens(n) for n in ir.walk(g)):
            continue  # tokens outside the candidate: not G of it
        terms = _score_terms(em, node, j, tokens, strict)
        functions = None if terms is None else weight_functions(em, g)
        if terms is not None and functions is not None:
            return WeightPlan(functions, *terms)
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
    kinds = _bias_kinds(em, biases, j, strict)
    return (couplings, rows, kinds) if couplings and kinds is not None else None


def _terms(e: Expr, tokens: Callable[[Expr], bool]) -> list[Expr]:
    """e as a flat list of terms, a token-free factor in front of a sum distributed over it."""
    body = e.body if isinstance(e, ir.Let) else e
    if isinstance(body, ir.Add):
        return [t for term in body.terms for t in _terms(term, tokens)]
    if isinstance(body, ir.Mul):
        sums = [f for f in body.factors if tokens(f)]
        if len(sums) == 1 and isinstance(sums[0].body if isinstance(sums[0], ir.Let) else sums[0], ir.Add):
            coef = [f for f in body.factors if f is not sums[0]]
            return [ir.mul(*coef, t) for t in _terms(sums[0], tokens)]
    return [e]


# ----------------------------------------------------------------------------- printing G and G'


def weight_functions(em: Emitter, g: Expr) -> tuple[str, str, str] | None:
    """(the Triton body of G, that of G', G as a torch expression in x), or None if G holds something the
    printers do not take (a learned scalar, a function without a Triton form, a non-numeric power)."""
    try:
        dg = gradient(g, SCORE)
    except (NotDifferentiable, ir.ShapeError):
        return None
    # a derivative that is 0 everywhere (step's, in relu(s)^2 step(s)) drops out of its product and sum
    dg = ir.substitute(dg, {n: ir.ZERO for n in ir.walk(dg) if isinstance(n, ir.Func) and n.name == "zero"})
    triton, triton_grad = (_TritonPrinter(em).body(f) for f in (g, dg))
    torch_src = _torch_src(em, g)
    if triton is None or triton_grad is None or torch_src is None:
        return None
    return triton, triton_grad, torch_src


#: element-wise functions in Triton, `{x}` a name (each argument is bound to a local first); numerically
#: stable forms where the naive one overflows (softplus, tanh)
TRITON_FUNCTIONS = {
    "exp": "tl.exp({x})",
    "log": "tl.log({x})",
    "inv": "1.0 / {x}",
    "sqrt": "tl.sqrt({x})",
    "abs": "tl.abs({x})",
    "sign": "tl.where({x} > 0.0, 1.0, tl.where({x} < 0.0, -1.0, 0.0))",
    "zero": "0.0 * {x}",
    "one": "0.0 * {x} + 1.0",
    "identity": "{x}",
    "square": "{x} * {x}",
    "relu": "tl.maximum({x}, 0.0)",
    "step": "tl.where({x} > 0.0, 1.0, 0.0)",
    "sigmoid": "tl.sigmoid({x})",
    "dsigmoid": "tl.sigmoid({x}) * (1.0 - tl.sigmoid({x}))",
    "tanh": "2.0 * tl.sigmoid(2.0 * {x}) - 1.0",
    "dtanh": "1.0 - (2.0 * tl.sigmoid(2.0 * {x}) - 1.0) * (2.0 * tl.sigmoid(2.0 * {x}) - 1.0)",
    "softplus": "tl.maximum({x}, 0.0) + tl.log(1.0 + tl.exp(-tl.abs({x})))",
    "silu": "{x} * tl.sigmoid({x})",
    "dsilu": "tl.sigmoid({x}) * (1.0 + {x} * (1.0 - tl.sigmoid({x})))",
    "gelu": "{x} * 0.5 * (1.0 + tl.math.erf({x} * 0.7071067811865476))",
    "dgelu": "0.5 * (1.0 + tl.math.erf({x} * 0.7071067811865476)) + {x} * tl.exp(-0.5 * {x} * {x}) * "
             "0.3989422804014327",
}


class _TritonPrinter:
    """A scalar expression in `SCORE` as the statements of a `@triton.jit` function of `x`, one local per node."""

    def __init__(self, em: Emitter):
        self.em = em
        self.lines: list[str] = []
        self.memo: dict[Expr, str] = {}

    def body(self, e: Expr) -> str | None:
        try:
            result = self.visit(e)
        except _Unprintable:
            return None
        return "\n".join([*self.lines, f"return {result}"])

    def local(self, code: str) -> str:
        name = f"t{len(self.lines)}"
        self.lines.append(f"{name} = {code}")
        return name

    def visit(self, e: Expr) -> str:
        if e in self.memo:
            return self.memo[e]
        match e:
            case ir.Var() if e == SCORE:
                out = "x"
            case ir.Scalar():
                out = repr(_float(self.em, e.value))
            case ir.Let() | ir.StopGrad():
                out = self.visit(e.body if isinstance(e, ir.Let) else e.a)
            case ir.Add():
                out = self.local(" + ".join(self.visit(t) for t in e.terms))
            case ir.Mul():
                out = self.local(" * ".join(self.visit(f) for f in e.factors))
            case ir.Pow():
                out = self.local(_triton_power(self.visit(e.base), _float(self.em, e.exponent)))
            case ir.Func() if e.name in TRITON_FUNCTIONS:
                out = self.local(TRITON_FUNCTIONS[e.name].format(x=self.visit(e.arg)))
            case _:
                raise _Unprintable
        self.memo[e] = out
        return out


def _triton_power(base: str, p: float) -> str:
    """base ** p: a product for small integer powers, sqrt for 1/2, exp(p log base) otherwise (base > 0)."""
    if p == int(p) and 1 <= abs(p) <= 4:
        product = " * ".join([base] * int(abs(p)))
        return product if p > 0 else f"1.0 / ({product})"
    if p == 0.5:
        return f"tl.sqrt({base})"
    return f"tl.exp({p!r} * tl.log({base}))"


def _torch_src(em: Emitter, e: Expr) -> str | None:
    """G as one torch expression in `x` (the reference path's weight), or None."""
    match e:
        case ir.Var() if e == SCORE:
            return "x"
        case ir.Scalar():
            value = _number(e.value, em.scalars)
            return None if value is None else repr(value)
        case ir.Let():
            return _torch_src(em, e.body)
        case ir.StopGrad():
            return _torch_src(em, e.a)
        case ir.Add() | ir.Mul():
            parts = [_torch_src(em, t) for t in e.children]
            return None if None in parts else "(" + (" + " if isinstance(e, ir.Add) else " * ").join(parts) + ")"
        case ir.Pow():
            base, p = _torch_src(em, e.base), _number(e.exponent, em.scalars)
            return None if base is None or p is None else f"({base} ** {p!r})"
        case ir.Func() if REGISTRY[e.name].torch_src:
            arg = _torch_src(em, e.arg)
            return None if arg is None else "(" + REGISTRY[e.name].torch_src.format(x=arg) + ")"
    return None


class _Unprintable(Exception):
    pass


def _float(em: Emitter, value: sp.Expr) -> float:
    number = _number(value, em.scalars)
    if number is None:
        raise _Unprintable
    return number

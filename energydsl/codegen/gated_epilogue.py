"""Products `value * G(pre)` on the gated epilogue's Triton kernels (triton backend).

An element-wise energy's update multiplies a token tensor by functions of one pre-activation: CEM's gated MLP
`(W h) ∘ σ(V u)`, NRGPT's `(W2ᵀ x) ∘ GELU′(W1 x + b)` and `GELU(a) GELU′(a)`. Eager torch spends a kernel per
operation there, and stores what autograd needs between them. On the triton backend such a product is one
fused pass forward and one backward (`energydsl/kernels/epilogue_kernels.py`): G is whatever product of the
factors is a function of `pre` alone (numbers allowed), printed with its derivative from the IR's calculus
(`scalar_functions.py`) and written into the file in place of the templates' activation table; the other
factors are the value (none: G(pre) alone).

    fused_gate(em, e)   # the fused call's value for a Mul, or None (the caller multiplies as usual)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import ir
from ..ir import Expr
from ..printing import show
from .lowering import _number
from .scalar_functions import VAR, scalar_function
from .torch_expr import BATCH, Val, token_axes
from .triton_source import KernelRequest

if TYPE_CHECKING:
    from .torch_expr import Emitter


def fused_gate(em: Emitter, e: ir.Mul) -> Val | None:
    """`e` as value * G(pre) on generated gated kernels, trying the innermost pre-activation first (so that
    `exp(-z²)` fuses whole); None where no factor is a printable function of one token tensor of e's shape."""
    candidates = [n for f in e.factors for fn in ir.nodes(f) if isinstance(fn, ir.Func) for n in ir.nodes(fn.arg)]
    for pre in reversed(list(dict.fromkeys(candidates))):
        axes = token_axes(pre, em.indices)
        if not ir.same_shape(pre.shape, e.shape) or BATCH not in axes:
            continue  # not a token tensor of the product's shape (parameters alone are not worth a kernel)
        g_factors, rest = _split(em, e.factors, pre)
        if not any(isinstance(n, ir.Func) for f in g_factors for n in ir.nodes(f)):
            continue  # nothing to fuse: a plain product
        rest_expr = ir.mul(*rest) if rest else None
        if rest_expr is not None and (token_axes(rest_expr, em.indices) != axes
                                      or not ir.same_shape(rest_expr.shape, e.shape)):
            continue  # a value of another layout (a parameter, a number per token): not an epilogue
        g = ir.mul(*g_factors)
        printed = scalar_function(em, g)
        if printed is None:
            continue  # a learned scalar inside G, a formula with no Triton form
        # (nothing is emitted before here: a refused candidate leaves no line behind)
        p, value = em.emit(pre), None if rest_expr is None else em.emit(rest_expr)
        if p.scalar or (value is not None and (value.axes, value.rank) != (p.axes, p.rank)):
            continue
        label = g.name if isinstance(g, ir.Func) else show(ir.substitute(g, {VAR: ir.Var("x", "param", ())}),
                                                           "registry")
        ops = em.kernel_set(KernelRequest.gated(label, printed.pair, printed.torch, value=value is not None))
        gate = "None" if value is None else value.code
        return em.tmp(f"{ops}.gated_activation({p.code}, {gate}, {label!r})", p.axes, p.rank,
                      f"{'' if value is None else gate + ' * '}G({p.code}), G(x) = {label}: fused")
    return None


def _split(em: Emitter, factors: tuple[Expr, ...], pre: Expr) -> tuple[list[Expr], list[Expr]]:
    """(the factors that are functions of `pre` and numbers alone, with `pre` replaced by `VAR`; the others)."""
    g, rest = [], []
    for f in factors:
        try:
            h = ir.substitute(f, {pre: VAR}) if _elementwise_over(f, pre) else None
        except ir.ShapeError:
            h = None
        if h is not None and all(n == VAR or (isinstance(n, ir.Scalar) and _number(n.value, em.scalars) is not None)
                                 for n in ir.nodes(h) if not n.children):
            g.append(h)
        else:
            rest.append(f)
    return g, rest


def _elementwise_over(f: Expr, pre: Expr) -> bool:
    """Whether every node of f above `pre` keeps pre's shape: f is element-wise in pre. A dot product, norm or
    sum over pre's entries (`sqrt(z·z + 1)`, rmsnorm's `(z·z / d + ε)^(-1/2)`) is not, and G, a function of one
    entry, would compute `z_m²` for `z·z` (found by differential fuzzing: wrong values, float64 too)."""
    memo: dict[int, tuple[bool, bool]] = {}  # each shared node once (the IR is a DAG)

    def visit(n: Expr) -> tuple[bool, bool]:  # (n contains pre, every node from n down to pre keeps its shape)
        hit = memo.get(id(n))
        if hit is None:
            if n == pre:
                hit = True, True
            else:
                below = [visit(c) for c in n.children]
                contains = any(c for c, _ in below)
                hit = contains, all(ok for _, ok in below) and (not contains or ir.same_shape(n.shape, pre.shape))
            memo[id(n)] = hit
        return hit

    return visit(f)[1]


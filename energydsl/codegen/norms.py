"""RMSNorm and LayerNorm found in a derived expression, so the generated code calls torch's fused norms.

`rmsnorm(x)` and `layernorm(x)` reach the IR expanded (`semantics_expr.py`), so that the derivation sees
through them: (1/n y·y + ε)^(-1/2) y, with y = x, or y = x − mean(x) 1 for layernorm. Printed node by node that
is five to seven eager ops forward and twice as many backward, each a pass over (batch, seq, n) that autograd
keeps for the backward. `F.rms_norm` / `F.layer_norm` compute the same values in one op each way, saving
only the row statistics. A `via` norm runs once per optimizer step, so in CEM's and NRGPT's layers this is
the step's largest chain of element-wise passes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import sympy as sp

from .. import ir
from ..ir import Expr
from .scalar_src import is_number

if TYPE_CHECKING:
    from .torch_expr import Emitter, Val


class Norm(NamedTuple):
    function: str  # "rms_norm" or "layer_norm" (torch.nn.functional)
    x: Expr  # the vector normalised (before centring, for layer_norm)
    eps: float
    weight: Expr | None = None  # a gain the same for every token (built from parameters), or none
    bias: Expr | None = None  # likewise an added vector (layer_norm only: rms_norm takes no bias)


def norm_form(e: ir.Mul) -> Norm | None:
    """The norm `e` computes, when it is (1/n y·y + ε)^(-1/2) y for a vector y of n entries, or a matrix of n
    (RMT's state `Z / sqrt(Z·Z / (dk dv) + ε)`: torch's norms take the normalised shape, here both axes)."""
    if len(e.factors) != 2:
        return None
    for scale, y in (e.factors, e.factors[::-1]):
        eps = _inverse_root_of_mean_square(scale, y)
        if eps is None:
            continue
        x = _centred(y)
        return Norm("rms_norm", y, eps) if x is None else Norm("layer_norm", x, eps)
    return None


def affine_norm(e: ir.Add) -> tuple[Norm, tuple[Expr, ...], tuple[Expr, ...]] | None:
    """(the norm with its gain and bias, the two terms of e it takes, e's other terms) when e adds up
    layernorm(x) + b, or layernorm(x) ∘ g + b, with b and g the same for every token: NRGPT's and the Energy
    Transformer's `layernorm(x) + delta`, `gamma * layernorm(x) + delta`, one `F.layer_norm(x, weight=g,
    bias=b)`. A gain without a bias stays a product: the plain norm may be used elsewhere too (CEM's
    `dg ∘ rmsnorm(x)` beside the query's `rmsnorm(x)`), and it is then computed once."""
    for i, term in enumerate(e.terms):
        norm, gain = _norm_and_gain(term)
        if norm is None or norm.function != "layer_norm":  # rms_norm takes no bias
            continue
        j = next((j for j, b in enumerate(e.terms) if j != i and _per_feature(b, norm.x.shape)), None)
        if j is None:
            continue
        return (norm._replace(weight=gain, bias=e.terms[j]), (e.terms[i], e.terms[j]),
                tuple(t for k, t in enumerate(e.terms) if k not in (i, j)))
    return None


def _norm_and_gain(term: Expr) -> tuple[Norm | None, Expr | None]:
    """(the norm, its gain) when `term` is a norm times a factor the same for every token; (norm, None) for
    a norm alone; (None, None) otherwise."""
    if not isinstance(term, ir.Mul):
        return None, None
    if (norm := norm_form(term)) is not None:
        return norm, None
    split = norm_factors(term)
    if split is None or len(split[1]) != 1:
        return None, None
    norm = norm_form(split[0])
    return (norm, split[1][0]) if norm is not None and _per_feature(split[1][0], norm.x.shape) else (None, None)


def _per_feature(e: Expr, shape: ir.Shape) -> bool:
    """Whether `e` is a tensor of the normalised shape or a scalar that is the same for every token: built from
    parameters (at least one, a tensor or a learned scalar: a plain number stays a product or sum of its own)
    and constants only."""
    if e.shape not in ((), shape) or e.free:
        return False
    nodes = list(ir.nodes(e))
    if not any(isinstance(v, ir.Var) and v.role == "param" or isinstance(v, ir.Scalar) and v.value.free_symbols
               for v in nodes):
        return False
    return all(isinstance(v, (ir.Var, ir.Scalar, ir.Add, ir.Mul, ir.Pow, ir.Func, ir.Ones))
               and (not isinstance(v, ir.Var) or v.role == "param") for v in nodes)


def norm_factors(e: ir.Mul) -> tuple[ir.Mul, tuple[Expr, ...]] | None:
    """(the norm's two factors as a product of their own, the other factors) when two of e's three or more
    factors are a norm: `g * rmsnorm(x)` reaches the IR as one product g (1/n x·x + ε)^(-1/2) x. The pair
    is built as `rmsnorm` builds it, so it is the same expression (and printed value) as the norm alone."""
    if len(e.factors) < 3:
        return None
    for i, scale in enumerate(e.factors):
        for j, y in enumerate(e.factors):
            if i != j and _inverse_root_of_mean_square(scale, y) is not None:
                return ir.mul(scale, y), tuple(f for n, f in enumerate(e.factors) if n not in (i, j))
    return None


def _inverse_root_of_mean_square(scale: Expr, y: Expr) -> float | None:
    """ε when `scale` is (1/n y·y + ε)^(-1/2) for y's n entries and a constant ε > 0."""
    if not (isinstance(scale, ir.Pow) and scale.exponent == sp.Rational(-1, 2) and isinstance(scale.base, ir.Add)
            and len(scale.base.terms) == 2 and y.shape):
        return None
    for mean_square, eps in (scale.base.terms, scale.base.terms[::-1]):
        if not (isinstance(eps, ir.Scalar) and eps.value.is_number and eps.value > 0):
            continue
        dot = _scaled(mean_square, ir.Dot, 1 / sp.Mul(*y.shape))
        if dot is not None and dot.a == y and dot.b == y:
            return float(eps.value)
    return None


def _centred(y: Expr) -> Expr | None:
    """x when y is x − (1/n) Σ x · 1 (layernorm's centring), else None."""
    if not (isinstance(y, ir.Add) and len(y.terms) == 2):
        return None
    for x, mean in (y.terms, y.terms[::-1]):
        if not (isinstance(mean, ir.Mul) and len(mean.factors) == 3 and x.shape):
            continue
        ones = [f for f in mean.factors if isinstance(f, ir.Ones)]
        rest = [f for f in mean.factors if not isinstance(f, ir.Ones)]
        total = _scaled(ir.Mul(tuple(rest)), ir.SumAll, -1 / sp.Mul(*x.shape))
        if len(ones) == 1 and ones[0].shape == x.shape and total is not None and total.a == x:
            return x
    return None


def _scaled(e: Expr, kind: type, coefficient: sp.Expr) -> Expr | None:
    """The node when `e` is c · node for the given constant c and a node of `kind`, else None."""
    if not (isinstance(e, ir.Mul) and len(e.factors) == 2):
        return None
    for c, node in (e.factors, e.factors[::-1]):
        if isinstance(c, ir.Scalar) and isinstance(node, kind) and sp.simplify(c.value - coefficient) == 0:
            return node
    return None


def emit_norm(em: Emitter, norm: Norm) -> Val:
    """An rmsnorm or layernorm as torch's fused op over the token's own axes (a vector's, or a matrix state's
    two)."""
    from .torch_expr import Val  # torch_expr imports this module

    x = em.emit(norm.x)
    shape = norm.x.shape
    dims = ", ".join(em._dim(s) for s in shape)
    args = [x.code, f"({dims},)" if len(shape) == 1 else f"({dims})"]
    for name, part in (("weight", norm.weight), ("bias", norm.bias)):
        if part is not None:
            v = em.emit(part)  # of the normalised shape, or a scalar (a tensor or a number) spread over it
            if v.rank == 0 and is_number(v.code):  # a learned gain is a tensor already
                v = Val(f"torch.as_tensor({v.code}, dtype={x.code}.dtype, device={x.code}.device)", scalar=True)
            args.append(f"{name}={v.code}" if v.rank == len(shape) else f"{name}={v.code}.expand({dims})")
    return em.tmp(f"F.{norm.function}({', '.join(args)}, eps={norm.eps!r})", x.axes, x.rank,
                  norm.function.replace("_", ""))

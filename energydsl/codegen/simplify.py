"""Codegen-only rewrites of an update's IR before it is printed: each one a saving the derivation has no
reason to make (it keeps the formulas as derived, for `energy derive` and the checks)."""

from __future__ import annotations

from collections.abc import Callable

import sympy as sp

from .. import ir
from ..ir import Expr


def simplify(e: Expr, numbers: dict[sp.Symbol, float] | None = None) -> Expr:
    """Codegen-only rewrites: abs(x) * sign(x) = x (everywhere, 0 included), from d|x|²/dx; and, given the
    values of the fixed hyper-parameters (`numbers`), a constant times a sum distributed over it where a term
    then cancels (`x - η (x - a)` is `a` at η = 1: the modern Hopfield step). Each shared node once."""
    memo: dict[int, Expr] = {}

    def visit(x: Expr) -> Expr:
        hit = memo.get(id(x))
        if hit is None:
            hit = memo[id(x)] = _simplified(x, numbers, visit) if x.children else x
        return hit

    return visit(e)


def _simplified(e: Expr, numbers: dict[sp.Symbol, float] | None, visit: Callable[[Expr], Expr]) -> Expr:
    """`simplify` at one node, its children simplified by `visit`."""
    e = ir.rebuild(e, [visit(c) for c in e.children])
    if isinstance(e, ir.Add) and numbers is not None and (cancelled := _distributed_if_it_cancels(e, numbers)):
        return cancelled
    if isinstance(e, ir.Mul):
        factors = list(e.factors)
        for a in factors:
            if isinstance(a, ir.Func) and a.name == "abs":
                partner = next((b for b in factors if isinstance(b, ir.Func) and b.name == "sign" and b.arg == a.arg),
                               None)
                if partner is not None:
                    factors.remove(a)
                    factors.remove(partner)
                    return ir.mul(a.arg, *factors)
    return e


def _distributed_if_it_cancels(e: ir.Add, numbers: dict[sp.Symbol, float]) -> Expr | None:
    """e with a term `c (u + v + ...)`, c a number (with `numbers` put in), written `c u + c v + ...`, when a
    term then cancels against another of e; None otherwise (distributing alone trades one scaling for several)."""
    for t in e.terms:
        if not (isinstance(t, ir.Mul) and len(t.factors) == 2 and isinstance(t.factors[0], ir.Scalar)
                and isinstance(t.factors[1], ir.Add)):
            continue
        c = t.factors[0].value.subs(numbers)
        if not c.is_number:
            continue
        terms = [u for u in e.terms if u is not t] + [ir.mul(ir.Scalar(c), u) for u in t.factors[1].terms]
        out = ir.add(*terms)
        left = len(out.terms) if isinstance(out, ir.Add) else 0 if ir.is_zero(out) else 1
        if left < len({ir.split_coefficient(u)[1] for u in terms}):
            return out
    return None

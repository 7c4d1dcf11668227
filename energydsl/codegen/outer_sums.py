"""Σ_j of outer products whose query side is a matrix times a key's vector: the matrix out of the sum.

The delta rule's energy, ½ Σ_j |Zᵀ k_j − v_j|² over a matrix state Z, has the gradient Σ_j (Zᵀ k_j − v_j) k_jᵀ.
Emitted as written it is a (B, T, T, dv, dk) tensor of pair products. Distributed and regrouped it is

    Zᵀ (Σ_j k_j k_jᵀ) − Σ_j v_j k_jᵀ

two sums of key-only values, which the emitter turns into prefix sums along j ((B, T, dk, dk) and
(B, T, dv, dk): linear in T), and one matrix product per token. The rewrite applies to every term of
`Σ_j outer(a, b)`, with `a` and `b` key-only values, one of them a vector of the query token, or one of them
`Q @ c_j` for a matrix Q of the query token:

    Σ_j outer(Q c_j, b_j) = Q (Σ_j outer(c_j, b_j))        Σ_j outer(a_j, Q c_j) = (Σ_j outer(a_j, c_j)) Qᵀ

and a term that is neither leaves the sum as it was (None). Scalar factors are distributed first, so that a
per-key weight (DeltaNet's write strength β_j) goes with the key: Σ_j β_j (Zᵀ k_j − v_j) k_jᵀ =
Zᵀ (Σ_j β_j k_j k_jᵀ) − Σ_j β_j v_j k_jᵀ; a scalar of the query alone (a mean's 1/|j|) leaves the sum.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import ir
from ..ir import Expr


def query_factored_sum(e: ir.Reduce, side: Callable[[Expr], str | None]) -> Expr | None:
    """`e` = Σ_j body rewritten with each query-side matrix outside its sum, or None if some term does not fit
    or no term has one. `side(t)`: "query" (no j), "key" (j but not the query token) or None (both)."""
    j = e.index
    terms = _outer_terms(e.body)
    if terms is None:
        return None
    out: list[Expr] = []
    moved = False
    for coef, a, b in terms:
        ca, a = _query_scalars_out(a, side)
        cb, b = _query_scalars_out(b, side)
        coef, a, b = ir.mul(coef, ca, cb), _matrix_in_front(a), _matrix_in_front(b)
        if side(a) == "key" and side(b) == "key":
            out.append(ir.mul(coef, ir.reduce("sum", j, ir.outer(a, b))))
        elif side(a) == "query" and side(b) == "key":  # Σ_j outer(q, b_j) = outer(q, Σ_j b_j)
            out.append(ir.mul(coef, ir.outer(a, ir.reduce("sum", j, b))))
            moved = True
        elif side(a) == "key" and side(b) == "query":
            out.append(ir.mul(coef, ir.outer(ir.reduce("sum", j, a), b)))
            moved = True
        elif isinstance(a, ir.MatMul) and side(a.a) == "query" and len(a.a.shape) == 2 and side(a.b) == "key" \
                and side(b) == "key":
            out.append(ir.mul(coef, ir.matmul(a.a, ir.reduce("sum", j, ir.outer(a.b, b)))))
            moved = True
        elif isinstance(b, ir.MatMul) and side(b.a) == "query" and len(b.a.shape) == 2 and side(b.b) == "key" \
                and side(a) == "key":
            out.append(ir.mul(coef, ir.matmul(ir.reduce("sum", j, ir.outer(a, b.b)), ir.transpose(b.a))))
            moved = True
        else:
            return None
    return ir.add(*out) if moved else None


def _query_scalars_out(x: Expr, side: Callable[[Expr], str | None]) -> tuple[Expr, Expr]:
    """(c, y) with x = c · y and c the scalar factors that do not vary with j (a mean's 1/|j|), which leave the
    sum."""
    if isinstance(x, ir.Mul):
        out: list[Expr] = []
        rest: list[Expr] = []
        for f in x.factors:
            (out if f.shape == () and side(f) == "query" else rest).append(f)
        if out and rest:
            return ir.mul(*out), ir.mul(*rest)
    return ir.ONE, x


def _matrix_in_front(x: Expr) -> Expr:
    """s · (Q @ c), with s scalars, as Q @ (s · c): the form whose matrix leaves the sum (s a key's weight)."""
    if isinstance(x, ir.Mul):
        matrices = [f for f in x.factors if isinstance(f, ir.MatMul) and len(f.a.shape) == 2]
        scalars = [f for f in x.factors if f.shape == ()]
        if len(matrices) == 1 and len(scalars) == len(x.factors) - 1:
            return ir.matmul(matrices[0].a, ir.mul(*scalars, matrices[0].b))
    return x


def _terms(x: Expr) -> list[Expr]:
    """The terms of x, with scalar factors distributed over a sum: s (u + v) is [s u, s v]."""
    if isinstance(x, ir.Add):
        return list(x.terms)
    if isinstance(x, ir.Mul):
        sums = [f for f in x.factors if isinstance(f, ir.Add)]
        if len(sums) == 1 and all(f.shape == () for f in x.factors if f is not sums[0]):
            others = [f for f in x.factors if f is not sums[0]]
            return [ir.mul(*others, t) for t in sums[0].terms]
    return [x]


def _outer_terms(body: Expr) -> list[tuple[Expr, Expr, Expr]] | None:
    """`body` as Σ c · outer(a, b) with every sum inside an outer product distributed: (c, a, b) triples (c a
    scalar without tokens), or None if it is not of that form."""
    if isinstance(body, ir.Add):
        out = []
        for t in body.terms:
            part = _outer_terms(t)
            if part is None:
                return None
            out += part
        return out
    if isinstance(body, ir.Mul) and len(body.factors) == 2 and isinstance(body.factors[0], ir.Scalar):
        inner = _outer_terms(body.factors[1])
        return None if inner is None else [(ir.mul(body.factors[0], c), a, b) for c, a, b in inner]
    if isinstance(body, ir.Outer):
        lefts, rights = _terms(body.a), _terms(body.b)
        out = []
        for (ca, a), (cb, b) in ((_split_scalar(a), _split_scalar(b)) for a in lefts for b in rights):
            out.append((ir.mul(ca, cb), a, b))
        return out
    return None


def _split_scalar(x: Expr) -> tuple[Expr, Expr]:
    """(c, y) with x = c · y and c the number in front of x (a minus sign, say), or 1."""
    if isinstance(x, ir.Mul) and isinstance(x.factors[0], ir.Scalar):
        return x.factors[0], ir.mul(*x.factors[1:])
    return ir.ONE, x

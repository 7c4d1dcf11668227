"""Products of weights first: `Σ_k (c_k ⊙ W_kᵀ a_k + U_k V_kᵀ W_kᵀ a_k + …)` as `Σ_k M_k a_k`, one GEMM.

A derived update applies weights to a token's vector one after another, right to left, as the derivation
writes it: CEM's DPLR preconditioner multiplies each head's `t_k = W_Qkᵀ a_k` (a_k the head's attention
output) by `diag(softplus(d_k)) + U_k V_kᵀ + V_k U_kᵀ`, five token-sized products per head on vectors of the
model width, an element-wise chain over (batch, seq, heads, d), then a sum over the heads. Everything but
a_k is a weight, so the whole is `Σ_k M_k a_k` with `M_k = -(diag(c_k) + U_k V_kᵀ + V_k U_kᵀ) W_Qkᵀ`: a
(d x d/heads) matrix per head, made from the weights alone, and then one GEMM over the concatenated heads
(the emitter's "sum over k in one matmul").

The rewrite is associativity and distributivity over matrix products, so it changes no value; it is taken
only where the token-side product it leaves costs no more per token than those it saves (`U (Vᵀ x)` with a
thin rank is cheaper than `(U Vᵀ) x`, and stays). A scalar in front, `s (M v)`, goes into the weights the same
way, `(s M) v`. Codegen only: `energy derive` prints the derivation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import lru_cache

import sympy as sp

from .. import ir
from ..ir_nodes import Expr
from .lowering import narrowed_value
from .torch_expr import TOKEN_ROLES

__all__ = ["weights_first"]

_Form = tuple[Expr, Expr, frozenset[Expr]]  # (M, v, the token-side products replaced): e = M v


@lru_cache(maxsize=4096)  # one update walks each node from every node above it
def _token_free(e: Expr) -> bool:
    """e is the same for every token: no state, input, context or buffer in it, and no position."""
    return not any((isinstance(n, ir.Var) and (n.role in TOKEN_ROLES or n.role == "context"))
                   or isinstance(n, (ir.Pos, ir.Count)) for n in ir.nodes(e))


def _linear_form(e: Expr) -> _Form | None:
    """e as M v, M a token-free matrix and v a token-dependent vector, or None."""
    if len(e.shape) != 1 or _token_free(e):
        return None
    match e:
        case ir.MatMul(a=a, b=b) if len(a.shape) == 2 and _token_free(a):
            inner = _linear_form(b)
            if inner is None:
                return a, b, frozenset([e])
            m, v, products = inner
            return ir.MatMul(a, m), v, products | {e}
        case ir.Mul(factors=factors):
            varying = [f for f in factors if not _token_free(f)]
            fixed = [f for f in factors if _token_free(f)]
            if len(varying) != 1 or any(len(f.shape) > 1 for f in fixed) or (inner := _linear_form(varying[0])) is None:
                return None
            m, v, products = inner
            for w in (f for f in fixed if len(f.shape) == 1):  # w ⊙ (M v) = (w 1ᵀ ⊙ M) v: M's rows scaled
                m = ir.Mul((ir.Outer(w, ir.Ones((m.shape[1],))), m))
            scalars = [f for f in fixed if not f.shape]
            return _scaled_weight(scalars, m), v, products
        case ir.Add(terms=terms):
            forms = [_linear_form(t) for t in terms]
            if any(f is None for f in forms) or len({f[1] for f in forms}) != 1:
                return None
            return ir.Add(tuple(f[0] for f in forms)), forms[0][1], frozenset().union(*(f[2] for f in forms))
    return None


def _map_out_of_context_sum(e: Expr, size: Callable[[sp.Expr], int]) -> Expr | None:
    """`Σ_j w_ij (A b_j)` as `A Σ_j w_ij b_j` for a weight A that widens (more rows than columns) and weights
    w_ij that are numbers per pair, or None. The lowering does the same inside the sum it lowers (CEM's tied
    attention: the stored pattern `W_Qᵀ W_K h_j` is summed at the head width, then mapped); done here, before
    it, the map is outside the sum where an enclosing sum over the heads sees it, and makes one GEMM of them
    where the map was applied head by head to (batch, seq, heads, d) and then summed."""
    if not (isinstance(e, ir.Reduce) and e.op == "sum" and isinstance(e.body, ir.Mul)):
        return None
    vectors = [f for f in e.body.factors if f.shape]
    if len(vectors) != 1:
        return None
    value = vectors[0]
    mapped = ir.bare(value)
    if not isinstance(mapped, ir.MatMul) or len(mapped.a.shape) != 2 or not _token_free(mapped.a):
        return None
    a, b = mapped.a, mapped.b
    if e.index in a.free or size(a.shape[1]) >= size(a.shape[0]):
        return None
    weights = [f for f in e.body.factors if not f.shape]  # b named as the lowering names the score's key
    return ir.MatMul(a, ir.Reduce("sum", e.index, ir.Mul((*weights, narrowed_value(value, b)))))


def _scalars_into_weights(e: Expr, original: Expr, context: frozenset[str], uses: Counter) -> Expr | None:
    """`s (M v)` as `(s M) v`, `s Σ_k M_k v_k` as `Σ_k (s M_k) v_k` and `s (M a + N b)` as
    `(s M) a + (s N) b`, for scalars s and weights M, N the same for every token, or None: the scalar then
    scales a matrix (once, hoisted out of a `steps` loop) instead of every token's vector, forward and backward
    (the `0.5 *` of MHA's `η / heads`, the `-1.0 *` of `x - η D`, the Energy Transformer's step on the sum of
    its two forces). Not where the product (or the sum, or a term of it) is used elsewhere in the update
    (`uses` counts `original`'s nodes, e before its children were rewritten): that one would then be computed
    twice."""
    if not isinstance(e, ir.Mul):
        return None

    def scalar(f: Expr) -> bool:
        return not f.shape and _token_free(f)

    scalars, rest = [f for f in e.factors if scalar(f)], [f for f in e.factors if not scalar(f)]
    if not scalars or len(rest) != 1:
        return None
    target, before = rest[0], next(f for f in original.factors if not scalar(f))
    if uses[before] > 1:
        return None
    if isinstance(target, ir.Add):  # s (M a + N b): each product scaled, (s M) a + (s N) b
        if not isinstance(before, ir.Add) or len(before.terms) != len(target.terms) or any(
                uses[t] > 1 for t in before.terms):  # terms merged by the rewrite below: no pairs to go by
            return None
        terms = [_scaled_product(t, b, scalars, context, uses) for t, b in zip(target.terms, before.terms,
                                                                               strict=True)]
        return None if None in terms else ir.Add(tuple(terms))
    return _scaled_product(target, before, scalars, context, uses)


def _scaled_product(target: Expr, before: Expr, scalars: list[Expr], context: frozenset[str],
                    uses: Counter) -> Expr | None:
    """`M v` as `(s M) v`, or `Σ_k M_k v_k` as `Σ_k (s M_k) v_k`, for the product s of `scalars`; None unless
    M is a matrix the same for every token and v a token's vector, or where the sum's product (`before`,
    as in the update before its children were rewritten) is used elsewhere."""
    summed = isinstance(target, ir.Reduce) and target.op == "sum" and target.index not in context
    product = target.body if summed else target
    if not (isinstance(product, ir.MatMul) and len(product.a.shape) == 2 and _token_free(product.a)
            and not _token_free(product.b)):
        return None
    if isinstance(before, ir.Reduce) and uses[before.body] > 1:
        return None
    scaled = ir.MatMul(_scaled_weight(scalars, product.a), product.b)
    return ir.Reduce("sum", target.index, scaled) if summed else scaled


def _scaled_weight(scalars: list[Expr], m: Expr) -> Expr:
    """The weight `s m`, with constants multiplied out: `-1 (-0.125 M)` is `0.125 M`, and a sum of weights
    whose terms carry constants of their own takes s into them (`-1 (-A - B - C)` is `A + B + C`: CEM DPLR's
    preconditioner) where that scales no more terms than it saves."""
    if not scalars:
        return m
    if isinstance(m, ir.Add) and all(isinstance(f, ir.Scalar) for f in scalars):
        bare = sum(not (isinstance(t, ir.Mul) and isinstance(t.factors[0], ir.Scalar)) for t in m.terms)
        if bare <= 1:
            return ir.add(*(ir.mul(*scalars, t) for t in m.terms))
    return ir.mul(*scalars, m)


def weights_first(e: Expr, size: Callable[[sp.Expr], int], context: frozenset[str]) -> Expr:
    """e with each largest sub-expression `M v` (weights M, one token vector v) computed as `(M) v`, where
    that costs no more token-side multiply-adds (`size` gives a dim's value) than the products it saves: those
    of the sub-expression that nothing else in e uses (the emitter computes an expression used twice once).

    Sums over the context (the indices in `context`) are left whole: there the lowering moves a weight out of
    the sum instead (`Σ_j p_ij W_Qᵀ W_K h_j = W_Qᵀ Σ_j p_ij W_K h_j`, attention at the head width), which
    joining W_Qᵀ W_K into one matrix would undo."""
    everywhere = ir.occurrences([e])
    memo: dict[int, Expr] = {}  # each shared node rewritten once (the IR is a DAG)

    def rewrite(e: Expr) -> Expr:
        hit = memo.get(id(e))
        if hit is None:
            hit = memo[id(e)] = rewritten(e)
        return hit

    def rewritten(e: Expr) -> Expr:
        if isinstance(e, (ir.Reduce, ir.Softmax)) and e.index in context:
            return _map_out_of_context_sum(e, size) or e
        form = _linear_form(e) if not e.free & context else None
        if form is not None:
            m, v, products = form
            inside = ir.occurrences([e])
            saved = sum(size(p.a.shape[0]) * size(p.a.shape[1]) for p in products
                        if inside[p] == everywhere[p])
            if len(products) > 1 and size(m.shape[0]) * size(m.shape[1]) <= saved:
                return ir.MatMul(m, v)
        if not e.children:
            return e
        kids = [rewrite(c) for c in e.children]
        new = e if all(k is c for k, c in zip(kids, e.children, strict=True)) else ir.rebuild(e, kids)
        return _scalars_into_weights(new, e, context, everywhere) or new

    return rewrite(e)

"""Context sums that no attention form fits, without a (pairs x features) tensor.

A generic context sum builds its whole summand for every pair (i, j) and then reduces over j (`masked_reduce`):
for `Σ_j w_ij v_j` with a weight per pair and a vector per key (sigmoid or squared-ReLU attention, an RBF
kernel) that is a (B, T, T, ..., d) tensor, d times the size of the T x T weights, which autograd keeps for
the backward. Here such a sum is the masked weights contracted with the values in one einsum (a batched
matmul), after two regroupings that only move terms:

* a dot product of two sums whose terms each lie on one side (the query's: no context index; the key's: no
  query position) is multiplied out, `⟨a_i − b_j, a_i − b_j⟩ = ⟨a_i, a_i⟩ − 2 ⟨a_i, b_j⟩ + ⟨b_j, b_j⟩`, whose
  cross term is one T x T matmul;
* a vector per pair that is such a sum is distributed over the sum, `Σ_j w_ij (a_i − b_j) = a_i Σ_j w_ij −
  Σ_j w_ij b_j`, each part a T x T reduction or weights times values.

On the triton backend a sum whose weight is an element-wise function of one score runs on the pointwise
kernels instead (`pointwise_weights.py`), with no T x T tensor at all, a split pair vector's two sums in one
call; the einsum is what the others get.

The first trades the difference's exactness for the usual cancellation of the expanded square (as the l2
softmax lowering does); the float64 tests hold either form to 1e-10.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import ir
from ..ir import Expr
from .torch_expr import POS, Val, canonical

if TYPE_CHECKING:
    from .torch_expr import Emitter


def weighted_context_sum(em: Emitter, e: ir.Reduce, strict: bool) -> Val | None:
    """`Σ_j w_ij v_j` as the masked weights times the values (one einsum), its dots and pair vectors regrouped
    first; None where the sum is not of that shape (the caller emits the masked form)."""
    j = e.index
    side = em.side(j)
    body = expand_pair_dots(e.body, side)
    factors = list(body.factors) if isinstance(body, ir.Mul) else [body]
    vectors = [f for f in factors if f.shape and side(f) is None]
    terms = one_sided_terms(vectors[0], side) if len(vectors) == 1 else None
    if terms is not None and len(terms) > 1:  # Σ_j w_ij (a_i − b_j) = a_i Σ_j w_ij − Σ_j w_ij b_j
        rest = [f for f in factors if f is not vectors[0]]
        if em.backend == "triton" and all(side(f) is None and not f.shape for f in rest):
            from .pointwise_weights import kernel_weighted_sum  # both sums in one call: values [1, b_j]

            out = kernel_weighted_sum(em, e, ir.mul(*rest), terms[1], strict, query_term=terms[0])
            if out is not None:
                return out
        return em.emit(ir.add(*(ir.reduce("sum", j, ir.mul(*rest, t)) for t in terms)))
    if body != e.body:  # the dots multiplied out: emitted anew (query-side factors leave the sum)
        return em.emit(ir.reduce("sum", j, body))
    pair = [f for f in factors if side(f) is None]
    key = [f for f in factors if side(f) == "key"]
    if not pair or any(f.shape for f in pair) or len(pair) + len(key) < len(factors):
        return None  # a value of the query too (pulled out of the sum when it has no j)
    if em.backend == "triton":  # the pointwise kernels, where the weight is a function of one score
        from .pointwise_weights import kernel_weighted_sum

        out = kernel_weighted_sum(em, e, ir.mul(*pair), ir.mul(*key) if key else None, strict)
        if out is not None:
            return out
    if not key:
        return None  # the weights alone: the masked form reduces them
    v = em.emit(ir.mul(*key))
    if not v.rank:
        return None  # a number per key: the masked form is the T x T weights already
    w = em.emit(ir.mul(*pair))
    mask = em.align(Val("mask_strict" if strict else "mask", (POS, j), 0), w.axes, 0)
    weights = em.tmp(f"torch.where({mask}, {w.code}, 0.0)", w.axes, 0, "pair weights, 0 outside the context")
    letters = string.ascii_uppercase[:v.rank]
    out_axes = canonical((set(w.axes) | set(v.axes)) - {j})
    sizes = {c: em.shape_size(size) for c, size in zip(letters, e.body.shape)}
    return em.einsum([(weights, ""), (v, letters)], out_axes, letters,
                     "sum over the causal context: weights times values", shape_sizes=sizes)


def one_sided_terms(e: Expr, side: Callable[[Expr], str | None]) -> list[Expr] | None:
    """`e` as its query side's terms summed and its key side's (`side` names a term's side, None for a pair
    term), each part left out where it has none; None if a term is a pair term."""
    terms = list(e.terms) if isinstance(e, ir.Add) else [e]
    sides = [side(t) for t in terms]
    if None in sides:
        return None
    return [ir.add(*(t for t, s in zip(terms, sides) if s == part)) for part in ("query", "key") if part in sides]


def expand_pair_dots(e: Expr, side: Callable[[Expr], str | None]) -> Expr:
    """`e` with each dot product of a pair whose two operands are sums of one-sided terms multiplied out."""
    mapping: dict[Expr, Expr] = {}
    for node in ir.nodes(e):
        if isinstance(node, ir.Dot) and node not in mapping and side(node) is None:
            a, b = one_sided_terms(node.a, side), one_sided_terms(node.b, side)
            if a is not None and b is not None and len(a) * len(b) > 1:
                # the query's part first, so that ⟨a_i, b_j⟩ and ⟨b_j, a_i⟩ collect into one term
                mapping[node] = ir.add(*(ir.dot(t, s) if side(s) == "key" and side(t) == "query" else ir.dot(s, t)
                                         for s in a for t in b))
    return ir.substitute(e, mapping) if mapping else e

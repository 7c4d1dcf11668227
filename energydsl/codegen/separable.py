"""Pair terms split into their query and key parts, for context sums that no attention form fits.

A generic context sum builds what its summand needs for every pair (i, j). Where a factor is a vector per
pair, such as the difference `a_i − b_j` of an RBF or l2 energy, that is a (pairs x features) tensor, d times
the size of the T x T weights, and autograd keeps it for the backward. Both rewrites here only regroup terms:

* a dot product of two sums whose terms each lie on one side (the query's: no context index; the key's: no
  query position) is multiplied out, `⟨a_i − b_j, a_i − b_j⟩ = ⟨a_i, a_i⟩ − 2 ⟨a_i, b_j⟩ + ⟨b_j, b_j⟩`, whose
  cross term is one T x T matmul;
* a vector per pair that is such a sum is distributed over the sum, `Σ_j w_ij (a_i − b_j) = a_i Σ_j w_ij −
  Σ_j w_ij b_j`, each part a T x T reduction or weights times values.

The first trades the difference's exactness for the usual cancellation of the expanded square (as the l2
softmax lowering does); the float64 tests hold either form to 1e-10.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import ir
from ..ir import Expr


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
    for node in ir.walk(e):
        if isinstance(node, ir.Dot) and node not in mapping and side(node) is None:
            a, b = one_sided_terms(node.a, side), one_sided_terms(node.b, side)
            if a is not None and b is not None and len(a) * len(b) > 1:
                # the query's part first, so that ⟨a_i, b_j⟩ and ⟨b_j, a_i⟩ collect into one term
                mapping[node] = ir.add(*(ir.dot(t, s) if side(s) == "key" and side(t) == "query" else ir.dot(s, t)
                                         for s in a for t in b))
    return ir.substitute(e, mapping) if mapping else e

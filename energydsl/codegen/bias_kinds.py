"""A softmax score's bias terms sorted into the kinds the attention kernels compute themselves.

`bias_kinds` splits the terms of s_ij that carry the context token but no state into an ALiBi distance
penalty (c |i - j|), a self-token bias (c [i = j]), per-key terms (no query position) and decay gates
(c log(decay(r)), the Forgetting Transformer's; the kernels take their key part as a per-key bias). The positional
forms are proven with SymPy for every admissible pair (i = j + n, n >= 0, n >= 1 when strict), not matched
by shape, so `-m * abs(i - j)` and CEM's `relu(1 - abs(i - j))` are recognised however the derivation or
the optimizer wrote them (terms that vanish on every admissible pair are dropped); a term no kind fits
leaves the score to the torch op.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sympy as sp

from .. import ir
from ..functions import REGISTRY, X
from ..ir import Expr
from .torch_expr import BATCH, POS, token_axes

if TYPE_CHECKING:
    from .torch_expr import Emitter


def bias_kinds(em: Emitter, terms: list[Expr], j: str, strict: bool) -> dict[str, list] | None:
    """Split bias terms into the kernel's kinds: coefficients of |i - j| and [i = j], per-key terms, and decay
    gates c log(decay(r)) as (c, the decay) pairs."""
    kinds: dict[str, list] = {"alibi": [], "self": [], "key": [], "gate": []}
    for t in terms:
        body = ir.bare(t)
        gate = _log_gate(em, body, j)
        if gate is not None:
            kinds["gate"].append(gate)
            continue
        if POS not in token_axes(body, em.indices) and not _key_position(body, j):
            if token_axes(body, em.indices) - {BATCH, j} - set(em.sizes):
                return _missed(em, t)
            kinds["key"].append(t)
            continue
        factors = _factors(body)
        positional = [f for f in factors if token_axes(f, em.indices) & {POS, j}]
        coef = [f for f in factors if f not in positional]
        if len(positional) != 1 or any(token_axes(f, em.indices) - set(em.sizes) for f in coef):
            return _missed(em, t)
        kind = distance_kind(positional[0], j, strict)
        if kind is None:
            return _missed(em, t)
        if kind == "-alibi":  # m (j - i) is -m |i - j|: ALiBi's with the sign in the coefficient
            kind, coef = "alibi", [ir.scalar(-1), *coef]
        if kind != "zero":  # a term that vanishes on every admissible pair adds nothing to the scores
            kinds[kind].append(ir.mul(*coef) if coef else ir.scalar(1))
    return kinds


def _key_position(e: Expr, j: str) -> bool:
    """Does e read the key's position j as a number (`0.3 * j`)? The generated code computes it per pair (a masked
    j reads as the last kept position), so such a term is no per-key bias; a rotation by j (rope) is per key."""
    if isinstance(e, ir.Pos):
        return e.index == j
    return not isinstance(e, ir.Rope) and any(_key_position(c, j) for c in e.children)


def _missed(em: Emitter, term: Expr) -> None:
    """Record why the scores took no kernel: this term is none of the kinds the kernels take."""
    from ..printing import show

    em.misses.append(f"the score term `{show(ir.bare(term))}` is not one the kernels take: c |i - j|, c [i = j], "
                     "a term of the key without i or j as a number, or c log(decay(r))")


def _log_gate(em: Emitter, e: Expr, j: str) -> tuple[Expr, ir.Decay] | None:
    """(c, γ) for e = c log γ with γ = decay(r) over j (the Forgetting Transformer's score term) and c a number
    or a value per head."""
    bare = ir.bare
    factors = _factors(e)
    logs = [f for f in factors if isinstance(bare(f), ir.Func) and bare(f).name == "log"
            and isinstance(bare(bare(f).arg), ir.Decay) and bare(bare(f).arg).index == j]
    coef = [f for f in factors if f not in logs]
    if len(logs) != 1 or any(token_axes(f, em.indices) - set(em.sizes) for f in coef):
        return None
    return (ir.mul(*coef) if coef else ir.scalar(1)), bare(bare(logs[0]).arg)


def _factors(e: Expr) -> list[Expr]:
    """The factors of a product, through the values computed once (`-1 * c1` with c1 = m[k] |i - j| hoisted
    is -1, m[k] and |i - j|), so that a bias's distance is found wherever the optimizer put it."""
    body = ir.bare(e)
    if isinstance(body, ir.Mul):
        return [g for f in body.factors for g in _factors(f)]
    return [e]


_I, _J = sp.symbols("_i _j", integer=True, nonnegative=True)
_N, _M = sp.symbols("_n _m", integer=True, nonnegative=True)


def distance_kind(e: Expr, j: str, strict: bool) -> str | None:
    """"alibi" if e = |i - j| ("-alibi" if e = -|i - j|, `j - i`), "self" if e = [i = j], "zero" if e = 0 (the
    self bias under a strict context), for every admissible pair (i, j): proven by SymPy with i = j + n, n >= 0
    (n >= 1 when strict). A small grid of pairs rejects most other forms quickly; what passes the grid but
    cannot be proven (a capped distance, a window) is None: the torch op stays."""
    f = _position_sympy(e, j)
    if f is None:
        return None
    pairs = [(a, b) for a in range(8) for b in range(a + (0 if strict else 1))]
    values = [complex(f.subs({_I: a, _J: b})) for a, b in pairs]
    if all(abs(val) < 1e-12 for val in values):
        return "zero" if _is_zero(f.subs(_I, _J + (_M + 1 if strict else _N))) else None
    for sign, kind in ((1, "alibi"), (-1, "-alibi")):  # |i - j|, or -|i - j| written `j - i`
        if all(abs(val - sign * abs(a - b)) < 1e-12 for val, (a, b) in zip(values, pairs, strict=True)):
            n = _M + 1 if strict else _N  # the distance i - j of an admissible pair
            return kind if _is_zero(f.subs(_I, _J + n) - sign * n) else None
    if not strict and all(abs(val - (a == b)) < 1e-12 for val, (a, b) in zip(values, pairs, strict=True)):
        at = f.subs(_I, _J + _N)
        return "self" if _is_zero(at.subs(_N, 0) - 1) and _is_zero(at.subs(_N, _M + 1)) else None
    return None


def _is_zero(e: sp.Expr) -> bool:
    """True when SymPy proves e = 0 (under the symbols' assumptions); unproven is False."""
    try:
        return sp.simplify(e) == 0
    except (TypeError, ValueError, NotImplementedError, RecursionError):
        return False


def _position_sympy(e: Expr, j: str) -> sp.Expr | None:
    """A position-only expression (positions i and j, numbers, element-wise functions) as SymPy in _i, _j."""
    match e:
        case ir.Pos(index=None):
            return _I
        case ir.Pos(index=index) if index == j:
            return _J
        case ir.Scalar():
            value = sp.sympify(e.value)
            return None if value.free_symbols else value
        case ir.Let():
            return _position_sympy(e.body, j)
        case ir.Add() | ir.Mul():
            parts = [_position_sympy(c, j) for c in e.children]
            if any(p is None for p in parts):
                return None
            return sp.Add(*parts) if isinstance(e, ir.Add) else sp.Mul(*parts)
        case ir.Pow():
            base = _position_sympy(e.base, j)
            return None if base is None else base ** sp.sympify(e.exponent)
        case ir.Func() if e.name in REGISTRY:
            arg = _position_sympy(e.arg, j)
            return None if arg is None else REGISTRY[e.name].formula.subs(X, arg)
    return None

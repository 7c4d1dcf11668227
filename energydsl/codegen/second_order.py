"""Second-order context sums: the covariance and Newton-Taylor updates of seed 004 (MHA2nd1st, LightMHA2nd1st).

Second-order and covariance-preconditioned updates (seed 004's MHA2nd1st, LightMHA2nd1st) weight a context
sum by the attention's own softmax and by a dot product of a query-side vector with the key side:

    r_i = Σ_j p_ij (u_i · x_j) y_j        (`kernels.weighted_second_moment`; x ≠ y over (x_j, y_j) side by side)

A centred form (d_ij = k_j - k̄_i, scores -|q_i - k_j|²/2T) is a sum of such terms once multiplied out, so a
summand that fits no primitive as written is expanded into monomials, each rewritten as a recognised sum:

    Σ_j p_ij a_i            = a_i (Σ_j p_ij: 1, or 0 on the empty strict row)
    Σ_j p_ij a_i b_j        = a_i Σ_j p_ij b_j              (first order: attention)
    Σ_j p_ij s_j (u_i·x_j)  = u_i · Σ_j p_ij s_j x_j         (first order)
    Σ_j p_ij (u_i·x_j) y_j                                  (second moment)

Scores are expanded alike (|q - k|² = |q|² - 2 q·k + |k|²: |q|² is constant over j and dropped, |k|² is a
per-key bias), so every term of one update shares one canonical softmax, one first-order attention and, in
the triton backend, its row log-sum-exp. The torch backend computes the second moment from the T x T
weights per head, (p ∘ (U Xᵀ)) Y: no T x T x d tensor. It computes those weights once: the first-order
attentions over the same scores become p @ v instead of calls of their own.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache
from typing import TYPE_CHECKING

import sympy as sp

from .. import ir
from ..ir import Expr, IndexInfo
from ..kernels import MAX_HEAD_DIM
from .bias_kinds import bias_kinds
from .lowering import (  # the first-order forms this builds on, and their shape helpers
    AttentionCall,
    Scores,
    _as_bhtd,
    _flat,
    _from_bhtd,
    _heads,
    _numel,
    _split,
    _state_dependent,
    _unflat,
    bias_heads,
    kernel_score_args,
    score_bias,
    score_operands,
    step_cache,
)
from .torch_expr import BATCH, POS, Val, canonical, token_axes
from .triton_source import KernelRequest

if TYPE_CHECKING:
    from .torch_expr import Emitter

_MAX_MONOMIALS = 64  # a summand that multiplies out to more terms stays in the generic form
Monomial = tuple[sp.Expr, Expr]  # coefficient, product of factors that are not sums (ir.ONE for none)
def _shared_lse(em: Emitter, sm: ir.Softmax, strict: bool, heads: tuple[str, ...]) -> AttentionCall | None:
    """The first-order call over the same scores, rewritten once to return its log-sum-exp as well."""
    rec = step_cache(em).get(("attention call", sm, strict))
    if rec is None or rec.lines is not em.lines or rec.heads != heads:
        return None
    if rec.lse is None:
        n = next((n for n, line in enumerate(rec.lines) if rec.call in line), None)
        if n is None:
            return None
        o, lse = _fresh(em), _fresh(em)
        rec.lines[n] = rec.lines[n].replace(rec.call, o, 1)
        rec.lines.insert(n, f"{o}, {lse} = {rec.ops}.energy_attention_with_lse({', '.join(rec.args)})"
                            "  # the attention and its row log-sum-exp, which the second moment reuses")
        rec.lse = lse
    return rec


def second_order_sum(em: Emitter, e: ir.Reduce, info: IndexInfo) -> Val | None:
    """A softmax-weighted sum no first-order primitive took: a second moment, Σ_j p_ij, or expanded terms."""
    if not _has_own_softmax(e.body, e.index):
        return None
    return _second_moment(em, e, info) or _softmax_mass(em, e, info) or _expanded_sum(em, e, info)


def _has_own_softmax(e: Expr, j: str) -> bool:
    """Is there a softmax over j in e, not counting those of nested sums over j (which shadow it)? Each shared
    part is visited once: a truncated Newton step through a norm shares parts so deeply that walking it as a
    tree took minutes (taylor = 3 through layernorm)."""
    seen: set[int] = set()
    stack = [e]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, ir.Softmax) and node.index == j:
            return True
        if not (isinstance(node, ir.Reduce) and node.index == j):
            stack.extend(node.children)
    return False


def _second_moment(em: Emitter, e: ir.Reduce, info: IndexInfo) -> Val | None:
    """Σ_j p_ij (u_i·x_j) y_j: the fused kernels (triton), else (p ∘ (U Xᵀ)) Y from T x T weights."""
    j = e.index
    qs, ks, both = _split(em, e.body, j)
    if len(both) != 2 or not ks or not e.shape:
        return None
    sm = next((f for f in both if isinstance(f, ir.Softmax) and f.index == j), None)
    dot = _unwrap(both[1] if both[0] is sm else both[0])
    if sm is None or not isinstance(dot, ir.Dot):
        return None
    u, x = (dot.b, dot.a) if j in token_axes(dot.a, em.indices) else (dot.a, dot.b)
    if token_axes(u, em.indices) & {POS, j} != {POS} or token_axes(x, em.indices) & {POS, j} != {j}:
        return None
    value = ir.mul(*ks)
    uv, xv, yv = (_flat(em, em.emit(t)) for t in (u, x, value))  # u first: its own sums are emitted before
    if any(v.scalar or v.rank != 1 for v in (uv, xv, yv)) or POS in yv.axes:
        return None
    sm = canonical_softmax(em, sm, j)
    sc = score_operands(em, sm, j)
    if sc is None:
        return None
    heads = canonical(set(_heads(sc.q, sc.k, uv, xv, yv, j=j)) | set(bias_heads(em, list(sc.bias_terms), j)))
    if any(h not in em.sizes for h in heads):
        return None
    dx, dy = _numel(em, x.shape), _numel(em, value.shape)
    out, scored = None, True  # scored: the scores q.k are computed here (the kernel recomputes them)
    if em.backend == "triton":
        untied = yv if x != value else None
        wide = max(sc.width, dx + (dy if untied else 0)) > MAX_HEAD_DIM
        out = _kernel_second_moment(em, sc, sm, uv, xv, untied, heads, j, info.strict, wide)
    if out is None:
        out, scored = _torch_second_moment(em, sc, sm, uv, xv, yv if x != value else None, heads, j, info.strict)
    em.count_flops(2 * em.context_len * em._axes_flops(set(heads)) * (sc.width * scored + dx + dy))
    out = _unflat(em, out, e.shape)
    if qs:
        rest = em.emit(ir.mul(*qs))
        axes = canonical(set(out.axes) | set(rest.axes))
        out = em.tmp(f"{em.align(out, axes, out.rank)} * {em.align(rest, axes, out.rank)}", axes, out.rank)
    return out


def _kernel_second_moment(em: Emitter, sc: Scores, sm: ir.Softmax, u: Val, x: Val, y: Val | None,
                          heads: tuple[str, ...], j: str, strict: bool, wide: bool) -> Val | None:
    """The second-moment pass of the attention kernels (written into the file), over the scores and lse of
    the first-order attention when it was emitted, else over its own scores and a first pass for the lse.

    The kernels compute Σ_j p_ij (u_i·v_j) v_j. An untied y_j (y not None) runs them on v_j = (x_j, y_j) side
    by side and u_i padded with zeros, (u_i, 0)·(x_j, y_j) = u_i·x_j: the second half of their r_i is
    Σ_j p_ij (u_i·x_j) y_j (the first half, Σ_j p_ij (u_i·x_j) x_j, is computed and dropped), and autograd
    splits the gradient of (x, y) in two. Linear in T, where the torch form builds the T x T weights."""
    kinds = bias_kinds(em, list(sc.bias_terms), j, strict)
    if kinds is None:
        return None
    terms = dict(strict=strict, alibi=bool(kinds["alibi"]), self_bias=bool(kinds["self"]),
                 key_bias=bool(kinds["key"] or kinds["gate"]), wide=wide)
    shared = _shared_lse(em, sm, strict, heads)
    xc = _as_bhtd(em, x, heads, j)
    if shared is not None:  # exactly the attention's score operands: its lse is these scores' lse
        qc, kc, keywords, lse = shared.args[0], shared.args[1], shared.args[3:], shared.lse
    else:
        qc, kc, keywords = kernel_score_args(em, sc, kinds, heads, j, strict)
        first = em.kernel_set(KernelRequest.attention(**terms))
        lse = em.tmp(f"{first}.energy_attention_with_lse({qc}, {kc}, {xc}, {', '.join(keywords)})[1]", (), 0,
                     "the row log-sum-exp of these scores (first pass)").code
    uc = _as_bhtd(em, u, heads, POS)
    ops = em.kernel_set(KernelRequest.attention(**terms, second=True))
    if y is None:
        code = f"{ops}.weighted_second_moment({qc}, {kc}, {xc}, {lse}, {uc}, {', '.join(keywords)})"
        return _from_bhtd(em, code, heads, 1,
                          "sum over j of p_ij (u_i.v_j) v_j: the Triton second-moment kernels above")
    yc = _as_bhtd(em, y, heads, j)
    xy = em.tmp(f"torch.cat(({xc}, {yc}), dim=-1)", (), 4, "(x_j, y_j) side by side, as the kernels' v_j").code
    u0 = em.tmp(f"torch.nn.functional.pad({uc}, (0, {yc}.shape[-1]))", (), 4,
                "(u_i, 0): its dot with (x_j, y_j) is u_i.x_j").code
    code = f"{ops}.weighted_second_moment({qc}, {kc}, {xy}, {lse}, {u0}, {', '.join(keywords)})[..., {xc}.shape[-1]:]"
    return _from_bhtd(em, code, heads, 1, "sum over j of p_ij (u_i.x_j) y_j: the second half of the Triton "
                      "second-moment kernels' r over (x_j, y_j)")


def _torch_second_moment(em: Emitter, sc: Scores, sm: ir.Softmax, u: Val, x: Val, y: Val | None,
                         heads: tuple[str, ...], j: str, strict: bool) -> tuple[Val, bool]:
    """(p ∘ (U Xᵀ)) Y per head: T x T weights, no T x T x d tensor. y None: y = x. With it, whether the weights
    were computed here (not an attention's of the same scores)."""
    p, fresh = _softmax_weights(em, sc, sm, heads, j, strict)
    uc, xc = _as_bhtd(em, u, heads, POS), _as_bhtd(em, x, heads, j)
    yc = xc if y is None else _as_bhtd(em, y, heads, j)
    code = f"(({p} * ({uc} @ {xc}.transpose(-1, -2))) @ {yc})"
    return _from_bhtd(em, code, heads, 1, "sum over j of p_ij (u_i.x_j) y_j: second moment from the weights"), fresh


def _softmax_weights(em: Emitter, sc: Scores, sm: ir.Softmax, heads: tuple[str, ...], j: str,
                     strict: bool) -> tuple[str, bool]:
    """p_ij as a (B, H, T, T) tensor, once per softmax (and step); and whether it was computed here."""
    key = ("softmax weights", sm, strict, heads)
    hit = step_cache(em).get(key)
    if hit is not None:
        return hit, False
    shared = _weights_before_attention(em, sm, strict, heads)
    if shared is not None:
        step_cache(em)[key] = shared
        return shared, False
    qc, kc = (_as_bhtd(em, t, heads, p) for t, p in ((sc.q, POS), (sc.k, j)))
    scores = f"{em.scalar(sc.scale)} * ({qc} @ {kc}.transpose(-1, -2))"
    if sc.bias_terms:
        scores += f" + {score_bias(em, sc, heads, j)}"
    em.used_ops.add("masked_softmax")
    p = em.tmp(f"masked_softmax({scores}, {'mask_strict' if strict else 'mask'}, dim=-1)", (), 4,
               "softmax weights p_ij (B, H, T, T)")
    step_cache(em)[key] = p.code
    return p.code, True


def _weights_before_attention(em: Emitter, sm: ir.Softmax, strict: bool, heads: tuple[str, ...]) -> str | None:
    """p_ij written just before the first `softmax_attention` call over the same scores, and each such call
    turned into `p @ v`: the torch backend computes the weights once for the attentions and the second moment."""
    calls = [c for c in step_cache(em).get(("torch attention calls", sm, strict), [])
             if c.lines is em.lines and c.heads == heads]
    at = [next((n for n, line in enumerate(em.lines) if c.call in line), None) for c in calls]
    if not calls or None in at:
        return None
    first = calls[at.index(min(at))]
    p = _fresh(em)
    for c, n in zip(calls, at, strict=True):
        em.lines[n] = em.lines[n].replace(c.call, f"({p} @ {c.v})", 1).replace(": fused attention", ": p @ v")
    bias = f" + {first.bias}" if first.bias else ""
    em.used_ops.add("masked_softmax")
    em.lines.insert(min(at), f"{p} = masked_softmax({first.scale} * ({first.q} @ {first.k}.transpose(-1, -2)){bias}, "
                             f"{'mask_strict' if strict else 'mask'}, dim=-1)  # softmax weights p_ij (B, H, T, T), "
                             "for the attention and the second moment")
    del step_cache(em)[("torch attention calls", sm, strict)]
    return p


def _softmax_mass(em: Emitter, e: ir.Reduce, info: IndexInfo) -> Val | None:
    """Σ_j p_ij = 1, or 0 on the strict context's empty row i = 0."""
    body = _unwrap(e.body)
    if not (isinstance(body, ir.Softmax) and body.index == e.index):
        return None
    if not info.strict:
        return Val("1.0", scalar=True)
    return em.tmp("(count_strict > 0).to(dt)", (POS,), 0, "sum over j < i of softmax weights")


def _expanded_sum(em: Emitter, e: ir.Reduce, info: IndexInfo) -> Val | None:
    """The summand multiplied out, each monomial's sum a recognised form; None if one is not."""
    active = step_cache(em).setdefault("expanding", set())
    if e in active:
        return None
    new = _multiplied_out(em, e)
    if new is None:
        return None
    active.add(e)
    try:
        return em.emit(new)
    finally:
        active.discard(e)


def _multiplied_out(em: Emitter, e: ir.Reduce) -> Expr | None:
    """Σ_j of e's summand multiplied out, each monomial's sum a recognised form; None if one is not, or if e is
    one already."""
    j = e.index
    monomials = _expand(em, e.body, j)
    if monomials is None:
        return None
    terms = [_monomial_sum(em, c, m, j) for c, m in monomials]
    if any(t is None for t in terms):
        return None
    new = ir.add(*terms)
    return None if new == e else new


def collect_expanded_sums(em: Emitter, e: Expr) -> Expr:
    """e with each sum of query-side terms multiplied out, through the softmax-weighted sums in it, and like
    terms collected, where at least half of its terms cancel; elsewhere e as it was (codegen only).

    MHA2nd1st's Newton direction is `(2 - λ) m - Σ_j p_j ((c Σ_j' p_j' t_j' - c t_j) t1_j + m)` with
    t_j = 2 m·t1_j, t1_j = q - k_j and m = Σ_j p_j t1_j: multiplied out, it has twelve terms, and eight cancel.
    What is left, `(1 - λ) m + c (Σ_j p_j (m·k_j) k_j - (m·a) a)` (a = Σ_j p_j k_j), reads m and the
    attention's second pass; six token-sized products and one of the two dot products are gone.
    """
    done: dict[Expr, Expr] = {}
    polys: dict[Expr, Poly | None] = {}  # a context sum -> its multiplied-out form, like terms collected

    def visit(node: Expr) -> Expr:
        if node in done:
            return done[node]
        out = node if not node.children else ir.rebuild(node, [visit(c) for c in node.children])
        if isinstance(out, ir.Add) and not _context_indices(em, out) and any(
                isinstance(n, ir.Reduce) and _is_context_sum(em, n) for n in ir.nodes(out)):
            out = _collected(em, out, polys) or out
        done[node] = out
        return out

    return visit(e)


Poly = dict[frozenset, tuple[sp.Expr, tuple[Expr, ...]]]  # the multiset of factors -> (coefficient, factors)


def _collected(em: Emitter, e: ir.Add, polys: dict[Expr, Poly | None]) -> Expr | None:
    """e multiplied out, like terms collected and sums that reappear folded back, if that leaves at most half
    the terms it has multiplied out (so it cancels, and does not grow: (a + b)(c + d) - a c stays); else None."""
    raw = _polynomial(em, e, polys, 0)
    if raw is None:
        return None
    poly = _refolded(em, _collect(raw), polys)
    written = _polynomial(em, e, None, 0)  # nothing collected: as many terms as it is written with
    if written is None or 2 * len(poly) > len(written):
        return None
    try:
        return ir.add(*(ir.mul(ir.Scalar(c), *factors) for c, factors in poly.values()))
    except ir.ShapeError:  # a term left without the factor that gave it its shape: keep the written form
        return None


def _collect(raw: list[tuple[sp.Expr, tuple[Expr, ...]]]) -> Poly:
    """Like terms summed (their factors in any order), those that cancel dropped; first-met order kept."""
    like: dict[frozenset, list] = {}
    for c, factors in raw:
        seen = like.setdefault(frozenset(Counter(factors).items()), [sp.Integer(0), factors])
        seen[0] += c
    return {k: (sp.expand(c), factors) for k, (c, factors) in like.items() if sp.expand(c) != 0}


def _refolded(em: Emitter, poly: Poly, polys: dict[Expr, Poly | None]) -> Poly:
    """poly with the terms of a context sum that a factor reads (m in m·a) written as that sum again, when
    all of them are there in one proportion: `q + a` is `m` once more, which is computed anyway."""
    sums = dict.fromkeys(n for _, factors in poly.values() for f in factors for n in ir.nodes(f)
                         if isinstance(n, ir.Reduce) and _is_context_sum(em, n))  # in order met: reproducible
    for r in sums:
        part = _poly_of_sum(em, r, polys)
        if part is None or len(part) < 2 or not all(k in poly for k in part):
            continue
        ratios = {sp.simplify(poly[k][0] / c) for k, (c, _) in part.items()}
        if len(ratios) == 1:
            poly = {k: v for k, v in poly.items() if k not in part}
            key = frozenset({(r, 1)})
            c = ratios.pop() + (poly[key][0] if key in poly else 0)
            poly[key] = (c, (r,))
    return poly


def _polynomial(em: Emitter, e: Expr, polys: dict[Expr, Poly | None] | None,
                depth: int) -> list[tuple[sp.Expr, tuple[Expr, ...]]] | None:
    """e as Σ c_n Π f_n: sums distributed over products, and a softmax-weighted sum over the context taken as
    its multiplied-out form (`_multiplied_out`) where it has one, like terms collected (`polys`, the cache of
    those forms) or not (None); None past _MAX_MONOMIALS terms."""
    if isinstance(e, ir.Scalar):
        return [(e.value, ())]
    if isinstance(e, ir.Add):
        parts = [_polynomial(em, t, polys, depth) for t in e.terms]
        if any(p is None for p in parts) or sum(map(len, parts)) > _MAX_MONOMIALS:
            return None
        return [mono for p in parts for mono in p]
    if isinstance(e, ir.Mul):
        out: list[tuple[sp.Expr, tuple[Expr, ...]]] = [(sp.Integer(1), ())]
        for f in e.factors:
            part = _polynomial(em, f, polys, depth)
            if part is None or len(out) * len(part) > _MAX_MONOMIALS:
                return None
            out = [(c * d, _absorbed(em, m + n)) for c, m in out for d, n in part]
        return out
    if isinstance(e, ir.Reduce) and depth < 4 and _is_context_sum(em, e):
        if _is_mass(e) and not em.indices[e.index].strict:
            return [(sp.Integer(1), ())]  # Σ_j p_ij = 1
        if polys is None:  # multiplied out, nothing collected
            new = _multiplied_out(em, e)
            if new is not None:
                return _polynomial(em, new, None, depth + 1)
        elif (part := _poly_of_sum(em, e, polys, depth)) is not None:
            return list(part.values())
    return [(sp.Integer(1), (e,))]


def _poly_of_sum(em: Emitter, e: ir.Reduce, polys: dict[Expr, Poly | None], depth: int = 0) -> Poly | None:
    """A context sum multiplied out, like terms collected; None if it has no such form but itself."""
    if e not in polys:
        polys[e] = None  # while it is being worked out: a sum that reaches itself stays whole
        new = _multiplied_out(em, e)
        raw = None if new is None else _polynomial(em, new, polys, depth + 1)
        polys[e] = None if raw is None else _collect(raw)
    return polys[e]


def _absorbed(em: Emitter, factors: tuple[Expr, ...]) -> tuple[Expr, ...]:
    """A monomial's factors without the masses Σ_j p_ij (strict context: 1, or 0 on the empty first row) that
    another factor makes redundant: a second one, or a sum over the same j, which is 0 on that row too."""
    out = list(factors)
    for f in factors:
        if isinstance(f, ir.Reduce) and _is_mass(f):
            rest = list(out)
            rest.remove(f)
            if any(_vanishes_on_empty_row(em, g, f.index) for g in rest):
                out = rest
    return tuple(out)


def _vanishes_on_empty_row(em: Emitter, f: Expr, j: str) -> bool:
    """f is a sum over the context index j, or a dot product or product with one as a factor."""
    if isinstance(f, ir.Reduce):
        return f.index == j and _is_context_sum(em, f)
    if isinstance(f, (ir.Dot, ir.Mul)):
        return any(_vanishes_on_empty_row(em, c, j) for c in f.children)
    return False


def _is_mass(e: ir.Reduce) -> bool:
    """Σ_j p_ij: a sum of its own softmax alone."""
    return isinstance(e.body, ir.Softmax) and e.body.index == e.index


def _is_context_sum(em: Emitter, e: ir.Reduce) -> bool:
    """A sum over a context index of a summand with its own softmax over it."""
    info = em.indices.get(e.index)
    return e.op == "sum" and info is not None and info.context is not None and _has_own_softmax(e.body, e.index)


def _context_indices(em: Emitter, e: Expr) -> set[str]:
    return {k for k in e.free if (info := em.indices.get(k)) is not None and info.context is not None}


def _monomial_sum(em: Emitter, c: sp.Expr, m: Expr, j: str) -> Expr | None:
    """c Σ_j m as a product of factors outside the sum and one recognised sum, or None."""
    p, coupling, keys = None, None, []
    for f in m.factors if isinstance(m, ir.Mul) else [m]:
        ax = token_axes(f, em.indices)
        if j not in ax:
            continue  # query side or constant: ir.reduce moves it out of the sum
        if isinstance(f, ir.Softmax) and f.index == j and p is None:
            p = f
        elif POS not in ax:
            keys.append(f)
        elif isinstance(f, ir.Dot) and coupling is None and _coupling(em, f, j) is not None:
            coupling = f
        else:
            return None
    if p is None and coupling is not None:
        return None
    total = ir.reduce("sum", j, m)
    if coupling is not None and not ir.mul(*keys).shape:  # Σ_j p s_j (u·x_j) = u · Σ_j p s_j x_j
        u, x = _coupling(em, coupling, j)
        rest = [f for f in m.factors if f is not coupling and f not in keys and f is not p] \
            if isinstance(m, ir.Mul) else []
        total = ir.mul(*rest, ir.dot(u, ir.reduce("sum", j, ir.mul(p, *keys, x))))
    return ir.mul(ir.Scalar(c), total)


def _coupling(em: Emitter, d: ir.Dot, j: str) -> tuple[Expr, Expr] | None:
    """(u, x) for d = u_i · x_j (either order), u on the query side only and x on the key side only."""
    for u, x in ((d.a, d.b), (d.b, d.a)):
        if token_axes(u, em.indices) & {POS, j} == {POS} and token_axes(x, em.indices) & {POS, j} == {j}:
            return u, x
    return None


def canonical_softmax(em: Emitter, sm: ir.Softmax, j: str) -> ir.Softmax:
    """The softmax over its multiplied-out score, terms constant over j dropped (softmax ignores them)."""
    monomials = _expand(em, sm.body, j)
    if monomials is None:
        return sm
    kept = [ir.mul(ir.Scalar(c), m) for c, m in monomials if j in token_axes(m, em.indices)]
    return ir.Softmax(j, ir.add(*kept)) if kept else sm


def _expand(em: Emitter, e: Expr, j: str) -> list[Monomial] | None:
    """e as Σ c_n m_n, like terms collected; None if it cannot be multiplied out (or has too many terms).

    Only what mixes the query position and the context index is multiplied out: sums, products, dot
    products and token-independent matrices; anything on one side only is kept whole.
    """
    raw = _expand_raw(em, e, j)
    if raw is None:
        return None
    out: dict[Expr, sp.Expr] = {}
    for c, m in raw:
        out[m] = out.get(m, sp.Integer(0)) + c
    return [(c, m) for m, c in out.items() if c != 0]


def _expand_raw(em: Emitter, e: Expr, j: str) -> list[Monomial] | None:
    if isinstance(e, ir.Scalar):
        return [(e.value, ir.ONE)]
    if isinstance(e, ir.Softmax) and e.index == j:
        return [(sp.Integer(1), canonical_softmax(em, e, j))]
    ax = token_axes(e, em.indices)
    if POS not in ax or j not in ax:
        return [(sp.Integer(1), e)]
    if not e.shape and not _state_dependent(e):  # a score bias (m_k |i - j|): the kernels take it whole
        return [(sp.Integer(1), e)]
    parts: list[list[Monomial] | None]
    match e:
        case ir.Let() | ir.StopGrad():
            return _expand(em, e.children[0], j)
        case ir.Add():
            parts = [_expand(em, t, j) for t in e.terms]
            if any(p is None for p in parts):
                return None
            return [mono for p in parts for mono in p]
        case ir.Mul():
            out: list[Monomial] = [(sp.Integer(1), ir.ONE)]
            for f in e.factors:
                part = _expand(em, f, j)
                if part is None or len(out) * len(part) > _MAX_MONOMIALS:
                    return None
                out = [(c * d, ir.mul(m, n)) for c, m in out for d, n in part]
            return out
        case ir.Dot():
            a, b = _expand(em, e.a, j), _expand(em, e.b, j)
            if a is None or b is None or len(a) * len(b) > _MAX_MONOMIALS:
                return None
            return [(c * d, _dot_monomial(em, m, n, j)) for c, m in a for d, n in b]
        case ir.MatMul():
            fixed = [s for s in (e.a, e.b) if not token_axes(s, em.indices) & {BATCH, POS, j}]
            if not fixed:
                return None
            side = e.b if fixed[0] is e.a else e.a
            part = _expand(em, side, j)
            if part is None:
                return None
            out = []
            for c, m in part:
                scalars, vec = _scalars_and_rest(m)
                prod = ir.matmul(fixed[0], vec) if fixed[0] is e.a else ir.matmul(vec, fixed[0])
                out.append((c, ir.mul(*scalars, prod)))
            return out
    return None


# a dot's operands in a fixed order: by their text (`str(key)`, which is `repr(key)`), once per node; printing
# the keys at every comparison took 119 of 129 s compiling a Taylor-2 Newton step through a layer norm
_order_text = lru_cache(maxsize=1 << 16)(ir.stable_text)


def _dot_monomial(em: Emitter, m: Expr, n: Expr, j: str) -> Expr:
    """m · n for monomials: scalar factors out, query side first (one dot for u·x and x·u)."""
    sm, a = _scalars_and_rest(m)
    sn, b = _scalars_and_rest(n)

    def side(t: Expr) -> int:
        ax = token_axes(t, em.indices)
        return 0 if j not in ax and POS in ax else 2 if POS not in ax and j in ax else 1

    sa, sb = side(a), side(b)
    if sb < sa or (sa == sb and _order_text(b) < _order_text(a)):
        a, b = b, a
    return ir.mul(*sm, *sn, ir.dot(a, b))


def _scalars_and_rest(m: Expr) -> tuple[list[Expr], Expr]:
    """A monomial's scalar-shaped factors and the product of the others."""
    factors = list(m.factors) if isinstance(m, ir.Mul) else [m]
    scalars = [f for f in factors if not f.shape]
    rest = [f for f in factors if f.shape]
    return (scalars, ir.mul(*rest)) if rest else ([], m)


def _unwrap(e: Expr) -> Expr:
    while isinstance(e, (ir.Let, ir.StopGrad)):
        e = e.children[0]
    return e


def _fresh(em: Emitter) -> str:
    """A new temporary's name (for a line written without `em.tmp`)."""
    name = f"t{em.count}"
    em.count += 1
    return name

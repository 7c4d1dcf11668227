"""Recognised context sums lowered to attention primitives (torch ops or the fused Triton kernels).

The emitter (`torch_expr.Emitter`) calls `lower_context_sum` for every `sum[j](...)` over a causal
context. Two first-order forms are recognised here, whatever the energy they were derived from (the
second-order sums of covariance and Newton-Taylor updates are in `second_order.py`, built on these):

* softmax-weighted sums, `sum[j](softmax[j](s_ij) * v_j)` with
  `s_ij = Σ_c c_c (a_c(x_i) . b_c(h_j)) + bias_ij`: one or several state/context dot products (several are
  concatenated along the feature axis: q' = [c_1 a_1, c_2 a_2], k' = [b_1, b_2], so q'.k' = Σ_c c_c a_c.b_c;
  a learned factor with no token in it, a temperature per head, is moved into a_c) and state-independent
  biases;
* product-weighted sums, `sum[j](gamma_ij (a(x_i) . b(h_j)) v_j)` with gamma = 1, a^(i - j) or a gate
  `decay(r)`: linear attention, chunked, O(T d^2) (`linear_sums.py`).

The torch backend calls `softmax_attention` (SDPA, fused and linear in T for a per-key bias and a strict
context; a bias with the query's position becomes a T x T additive mask) and the chunked
`linear_attention` of `energydsl.runtime.ops`. The triton backend calls Triton kernels with the kernel's
flags read off the IR (for the softmax family, copies specialised by those flags and written into the
generated file: `triton_source.py`): causal or strict context, and each bias term classified
(`bias_kinds.py`) as an ALiBi distance penalty (c_h |i - j|), a self-token bias (c_h [i = j]) or a per-key
bias (no query position); terms constant over j are dropped (softmax ignores them), as are terms that vanish on
every admissible pair (the self bias under a strict context). Feature widths above 256 take
the feature-tiled (wide) copies of the kernels. A score the kernel cannot take (an unclassified bias) falls
back to the torch op, which is always correct.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import sympy as sp

from .. import ir
from ..ir import Expr, IndexInfo
from ..kernels import MAX_HEAD_DIM  # no triton imported: the kernels' package entry is light
from .bias_kinds import bias_kinds
from .gates import log_rate_prefix
from .scalar_src import exact_number, float_src
from .torch_expr import BATCH, POS, TOKEN_ROLES, Val, canonical, token_axes
from .triton_source import KernelRequest

if TYPE_CHECKING:
    from .torch_expr import Emitter


def lower_context_sum(em: Emitter, e: ir.Reduce, info: IndexInfo) -> Val | None:
    """The lowered value of a context sum, or None when no primitive fits (the caller emits it generically)."""
    from .linear_sums import linear_attention_sum
    from .second_order import second_order_sum  # it builds on the first-order forms below

    return _softmax_attention(em, e, info) or linear_attention_sum(em, e, info) or second_order_sum(em, e, info)


# ----------------------------------------------------------------------------- softmax-weighted sums


def _softmax_attention(em: Emitter, e: ir.Reduce, info: IndexInfo) -> Val | None:
    j = e.index
    qs, ks, both = _split(em, e.body, j)
    if qs or len(both) != 1 or not isinstance(both[0], ir.Softmax) or both[0].index != j:
        return None
    if not e.shape or not ks:
        return None
    plan = _score_terms(em, both[0], j)
    if plan is None:
        return None
    maps, value = _peel_maps(em, ks[0], j) if len(ks) == 1 else ([], ir.mul(*ks))
    v = _flat(em, em.emit(value))
    if POS in v.axes or v.rank != 1:
        return None
    sc, heads = _emit_scores(em, *plan, j, also=(v,))
    if any(h not in em.sizes for h in heads):
        return None
    dv = _numel(em, value.shape)
    per_width = 2 * em.context_len * em._axes_flops(set(heads))  # a T-long product per head, per unit of width
    if em.backend == "triton":
        kinds = bias_kinds(em, list(sc.bias_terms), j, strict=info.strict)
        if kinds is not None:
            wide = max(sc.width, dv) > MAX_HEAD_DIM
            out = _kernel_attention(em, sc, v, kinds, heads, j, info.strict, both[0], wide)
            em.count_flops(per_width * (sc.width + dv))
            return _unflat(em, _apply_maps(em, maps, out), e.shape)
    scale_src = em.scalar(sc.scale)
    bias, mask_bias = _torch_bias(em, sc, heads, j, info.strict)
    qc, kc, vc = (_as_bhtd(em, t, heads, p) for t, p in ((sc.q, POS), (sc.k, j), (v, j)))
    from .second_order import canonical_softmax

    sm = canonical_softmax(em, both[0], j)
    weights = step_cache(em).get(("softmax weights", sm, info.strict, heads))
    if weights is not None:  # a second moment over these scores already has the T x T weights
        out = _from_bhtd(em, f"({weights} @ {vc})", heads, 1, "softmax-weighted sum over j: p @ v")
        em.count_flops(per_width * dv)  # p @ v alone: the scores were counted with the weights
        return _unflat(em, _apply_maps(em, maps, out), e.shape)
    em.used_ops.add("softmax_attention")
    code = f"softmax_attention({qc}, {kc}, {vc}, scale={scale_src}, {bias}strict={info.strict})"
    out = _from_bhtd(em, code, heads, 1, "softmax-weighted sum over j: fused attention")
    step_cache(em).setdefault(("torch attention calls", sm, info.strict), []).append(TorchAttentionCall(
        em.lines, code, qc, kc, vc, scale_src, mask_bias, heads))
    em.count_flops(per_width * (sc.width + dv))
    return _unflat(em, _apply_maps(em, maps, out), e.shape)


@dataclass(frozen=True)
class Scores:
    """The operands of a softmax's scores: s_ij = scale q_i·k_j + Σ bias_terms (terms constant over j dropped)."""

    q: Val
    k: Val
    scale: sp.Expr
    bias_terms: tuple[Expr, ...]
    width: int  # of q and k


def _score_terms(em: Emitter, sm: ir.Softmax, j: str) -> tuple[list[tuple[sp.Expr, ir.Dot]], list[Expr]] | None:
    """(couplings c·(a_i · b_j), bias terms) of a softmax's scores, or None if they are not of that form.

    Emits nothing, so a score that does not fit leaves no dead code behind.
    """
    terms = _summands(sm.body)
    coupling = [t for t in terms if POS in token_axes(t, em.indices) and j in token_axes(t, em.indices)
                and _state_dependent(t)]
    # a term constant over j (the query's own norm, say) shifts every score of a row alike: softmax ignores it
    bias_terms = [t for t in terms if t not in coupling and j in token_axes(t, em.indices)]
    if any(_state_dependent(t) for t in bias_terms):
        return None
    oriented = [d for t in coupling for d in (oriented_couplings(em, t, j) or [None])]
    if not oriented or None in oriented:
        return None
    return oriented, bias_terms


def oriented_couplings(em: Emitter, e: Expr, j: str) -> list[tuple[sp.Expr, ir.Dot]] | None:
    """A score term as couplings c * (a_i . b_j) with the query's side first and the key's narrowed
    (`_couplings`, `_narrow_dot`), or None if it is not one or a side has both tokens."""
    found = _couplings(em, e, j)
    if found is None:
        return None
    out = []
    for c, d in found:
        if j in token_axes(d.a, em.indices):  # written k_j . q: swap
            d = ir.Dot(d.b, d.a)
        if j in token_axes(d.a, em.indices) or POS in token_axes(d.b, em.indices):
            return None
        out.append((c, _narrow_dot(em, d, j)))
    return out


def _emit_scores(em: Emitter, oriented: list[tuple[sp.Expr, ir.Dot]], bias_terms: list[Expr], j: str,
                 also: tuple[Val, ...] = ()) -> tuple[Scores, tuple[str, ...]]:
    """The scores' q and k (several dots: one dot of concatenated features), and the head axes of q, k and
    `also` (the value the attention will carry)."""
    parts = [(c, _flat(em, em.emit(d.a)), _flat(em, em.emit(d.b))) for c, d in oriented]
    heads = canonical(set(_heads(*also, *(p for _, a, b in parts for p in (a, b)), j=j))
                      | set(bias_heads(em, bias_terms, j)))
    width = sum(_numel(em, d.a.shape) for _, d in oriented)
    if len(parts) == 1:
        scale, q, k = parts[0]
    else:  # several dot products: one attention over the concatenated features; the first coefficient is the
        # kernel's scale (free there), the others relative to it scale their query parts (none where all agree)
        scale = parts[0][0]
        q = _concat(em, [_scaled(em, a, c / scale) for c, a, _ in parts], {BATCH, POS} | set(heads))
        k = _concat(em, [b for _, _, b in parts], {BATCH, j} | set(heads))
    return Scores(q, k, scale, tuple(bias_terms), width), heads


def score_operands(em: Emitter, sm: ir.Softmax, j: str) -> Scores | None:
    """The scores of `sm` as `_softmax_attention` reads them (for sums that reuse its softmax)."""
    plan = _score_terms(em, sm, j)
    return None if plan is None else _emit_scores(em, *plan, j)[0]


def _torch_bias(em: Emitter, sc: Scores, heads: tuple[str, ...], j: str, strict: bool) -> tuple[str, str | None]:
    """The bias keyword of a `softmax_attention` call (with its comma, or "" for none) and the bias as a term
    that broadcasts over (B, H, T, T) scores (for T x T weights computed from the same scores).

    Per-key terms alone (the l2 energy's -|k_j|^2 / 2T) are a (B, H, T) `key_bias`, which keeps the op fused
    and linear in T; any term with the query's position becomes a (B, H, T, T) additive mask.
    """
    if not sc.bias_terms:
        return "", None
    kinds = bias_kinds(em, list(sc.bias_terms), j, strict)
    # a decay gate's key part -c G_j is large (the log decay since the first token): a feature of k in bf16 would
    # round it away, so on this path it stays in the (T, T) bias, as the difference c (G_i - G_j)
    if kinds is not None and not kinds["alibi"] and not kinds["self"] and not kinds["gate"]:
        if not kinds["key"]:  # every term vanishes on the admissible pairs
            return "", None
        key = key_bias_arg(em, kinds, heads, j)
        return f"key_bias={key}, ", f"{key}[..., None, :]"
    full = score_bias(em, sc, heads, j)
    return f"bias={full}, ", full


def score_bias(em: Emitter, sc: Scores, heads: tuple[str, ...], j: str) -> str:
    """The bias terms as one (B, H, T, T) tensor (the torch ops' additive mask), (1, H, T, T) when no term
    depends on the batch (ALiBi, a self-token bias): SDPA broadcasts it, and autograd keeps one copy, not B."""
    b = em.emit(ir.add(*sc.bias_terms))
    batch = [BATCH] if BATCH in b.axes else []
    axes = canonical({*batch, POS, j} | set(heads))
    full = em.expand(b, axes)
    order = [axes.index(a) for a in (*batch, *heads, POS, j)]
    return em.tmp(f"{full.code}.permute({', '.join(map(str, order))})"
                  f".reshape({'B' if batch else 1}, {_n_heads(em, heads)}, T, T)", (), 0, "additive score bias").code


def _peel_maps(em: Emitter, e: Expr, j: str) -> tuple[list[Expr], Expr]:
    """v_j = A_1 @ (A_2 @ b_j) with token-independent A's that narrow the value: ([A_1, A_2], b_j).

    Σ_j p_ij (A b_j) = A Σ_j p_ij b_j, so the attention runs on the narrow b_j (CEM's tied value
    W_Qᵀ W_K h_j: head width instead of model width) and A is applied once to its output.
    """
    maps: list[Expr] = []
    while (step := _narrowing(em, e, j)) is not None:
        maps.append(step[0])
        e = step[1]
    return maps, e


def _narrow_dot(em: Emitter, d: ir.Dot, j: str) -> ir.Dot:
    """a . (A @ b_j) = (Aᵀ a) . b_j: the score's key at the narrow width (CEM's x . (W_Qᵀ W_K h_j))."""
    while (step := _narrowing(em, d.b, j)) is not None:
        d = ir.Dot(ir.matmul(ir.transpose(step[0]), d.a), step[1])
    return d


def _narrowing(em: Emitter, e: Expr, j: str) -> tuple[Expr, Expr] | None:
    """e = A @ b with A token-independent and b narrower than e: (A, b), b hoisted if e was; else None."""
    body = ir.bare(e)
    if not (isinstance(body, ir.MatMul) and len(body.b.shape) == 1 and len(body.a.shape) == 2
            and not token_axes(body.a, em.indices) & {BATCH, POS, j}
            and em.shape_size(body.b.shape[0]) < em.shape_size(body.shape[0])):
        return None
    return body.a, narrowed_value(e, body.b)


def narrowed_value(value: Expr, inner: Expr) -> Expr:
    """b of a value A b taken apart: named `<let>_v` when the value was a let (part of a hoisted value, hoisted
    too), so every place that takes the same let apart (the score's key, the summed value) gets one tensor."""
    if isinstance(value, ir.Let) and not isinstance(inner, ir.Let):
        return ir.Let(f"{value.name}_v", inner)
    return inner


def _apply_maps(em: Emitter, maps: list[Expr], out: Val) -> Val:
    """A_1 @ (A_2 @ out), per head where the A's carry a head axis."""
    for a in reversed(maps):
        m = em.emit(a)
        rows, cols = (em.shape_size(s) for s in a.shape)
        out = em.einsum([(m, "MN"), (out, "N")], canonical(set(m.axes) | set(out.axes)), "M",
                        "the value map, after the attention", shape_sizes={"M": rows, "N": cols})
    return out


def _kernel_attention(em: Emitter, sc: Scores, v: Val, kinds: dict[str, list[Expr]], heads: tuple[str, ...],
                      j: str, strict: bool, sm: ir.Softmax, wide: bool) -> Val:
    """The attention kernels (written into the file) with the biases they compute themselves: no T x T tensor.

    The call is recorded, so that a second moment over the same scores can reuse its log-sum-exp.
    """
    from .second_order import canonical_softmax

    qc, kc, keywords = kernel_score_args(em, sc, kinds, heads, j, strict)
    vc = _as_bhtd(em, v, heads, j)
    ops = em.kernel_set(KernelRequest.attention(strict=strict, alibi=bool(kinds["alibi"]),
                                                self_bias=bool(kinds["self"]),
                                                key_bias=bool(kinds["key"] or kinds["gate"]), wide=wide))
    args = [qc, kc, vc, *keywords]
    code = f"{ops}.energy_attention({', '.join(args)})"
    out = _from_bhtd(em, code, heads, 1, "softmax-weighted sum over j: the Triton attention kernels above")
    step_cache(em)[("attention call", canonical_softmax(em, sm, j), strict)] = AttentionCall(
        em.lines, code, ops, args, heads)
    return out


def kernel_score_args(em: Emitter, sc: Scores, kinds: dict[str, list[Expr]], heads: tuple[str, ...], j: str,
                      strict: bool) -> tuple[str, str, list[str]]:
    """q, k and the keyword arguments (scale, mask, biases) of a softmax-family kernel call for these scores."""
    number = _number(sc.scale, em.scalars)
    q = sc.q
    if number is None:  # a learned temperature: fold it into the queries
        q = em.tmp(f"{q.code} * {em.scalar(sc.scale)}", q.axes, q.rank)
        number = 1.0
    qc, kc = (_as_bhtd(em, t, heads, p) for t, p in ((q, POS), (sc.k, j)))
    keywords = [f"scale={number!r}", f"strict={strict}"]
    for kind, arg, sign in (("alibi", "alibi_slopes", -1), ("self", "self_bias", 1)):  # slopes m of -m |i - j|
        if kinds[kind]:
            keywords.append(f"{arg}={_per_head(em, em.emit(ir.mul(ir.scalar(sign), ir.add(*kinds[kind]))), heads)}")
    if kinds["key"] or kinds["gate"]:
        keywords.append(f"key_bias={key_bias_arg(em, kinds, heads, j)}")
    return qc, kc, keywords


def key_bias_arg(em: Emitter, kinds: dict[str, list], heads: tuple[str, ...], j: str) -> str:
    """The per-key bias terms as a (B, H, T) tensor, a decay gate's c log γ_ij = c (G_i - G_j) as its key part
    -c G_j (at least float32, which the kernels read): the query's part is the same for every key of a row,
    and a softmax drops it."""
    parts = [em.emit(ir.add(*kinds["key"]))] if kinds["key"] else []
    for coef, gate in kinds["gate"]:
        parts.append(_scaled_val(em, em.emit(ir.neg(coef)), log_rate_prefix(em, gate)[1]))
    kb = _sum_vals(em, parts)
    return _as_bhtd(em, _as_column(em, kb, named=True), heads, j) + "[..., 0]"


def _scaled_val(em: Emitter, c: Val, v: Val) -> Val:
    """c * v, c a scalar or a value per head, v a number per token."""
    if c.scalar and c.code == "1.0":
        return v
    axes = canonical(set(c.axes) | set(v.axes))
    return em.tmp(f"{em.align(c, axes, 0)} * {em.align(v, axes, 0)}", axes, 0)


def _sum_vals(em: Emitter, parts: list[Val]) -> Val:
    """The sum of numbers per token (or per key) with their axes joined."""
    if len(parts) == 1:
        return parts[0]
    axes = canonical(set().union(*(p.axes for p in parts)))
    return em.tmp(" + ".join(em.align(p, axes, 0) for p in parts), axes, 0)


@dataclass
class AttentionCall:
    """A first-order kernel call already emitted, whose row log-sum-exp a second moment can reuse."""

    lines: list[str]  # the list it was emitted into (prologue or body)
    call: str  # `ops.energy_attention(args)`, exactly as in the line
    ops: str  # the op set the method is called on
    args: list[str]  # its arguments: q, k, v, then keywords
    heads: tuple[str, ...]
    lse: str | None = None  # set once the call is rewritten to return the log-sum-exp too


@dataclass
class TorchAttentionCall:
    """A `softmax_attention` call already emitted (torch backend): a second moment over the same scores, which
    needs the T x T weights anyway, computes them before the first such call and turns each into `p @ v`."""

    lines: list[str]
    call: str  # exactly as in the line
    q: str
    k: str
    v: str
    scale: str
    bias: str | None
    heads: tuple[str, ...]


_STEP_CACHE = ("lowering: per-step cache",)


def _summands(e: Expr) -> list[Expr]:
    """e as a flat list of terms, a number in front of a sum distributed over it: -(c·(q·k) + m |i - j|) is
    -c·(q·k) and -m |i - j|, as the kernels take them (a coupling and an ALiBi bias)."""
    if isinstance(e, ir.Add):
        return [t for term in e.terms for t in _summands(term)]
    if isinstance(e, ir.Mul) and len(e.factors) == 2 and isinstance(e.factors[0], ir.Scalar) \
            and isinstance(e.factors[1], ir.Add):
        return [ir.mul(e.factors[0], t) for t in _summands(e.factors[1])]
    return [e]


def step_cache(em: Emitter) -> dict:
    """Entries that live as long as the emitter's memo.

    The memo is dropped when the state changes (`forget`) and is a separate one inside hoisted values
    (`emit_let`), so a recorded kernel call or weight matrix is only reused where its value is still valid.
    """
    return em.memo.setdefault(_STEP_CACHE, {})


def _couplings(em: Emitter, e: Expr, j: str) -> list[tuple[sp.Expr, ir.Dot]] | None:
    """A score term as a sum of c * (a . b): (c, a . b) pairs, or None if it is not one.

    A scalar factor without the context token moves into the query side's vector, so that such scores still run
    as attention: c (a . b_j) = (c a) . b_j, for a learned temperature per head (`(q_k . k_j) / t_k`) as for a
    factor of the query token (the rmsnorm scale r(x_i) of an l2 score on `u = rmsnorm(x)`, which the
    derivation writes r(x_i) (x_i . k_j)).
    `stopgrad` only matters to the derivation (done by now), so it is looked through.
    """
    match e:
        case ir.Dot():
            return [(sp.Integer(1), e)]
        case ir.StopGrad():
            return _couplings(em, e.a, j)
        case ir.Let():
            return _couplings(em, e.body, j)
        case ir.Add():
            out: list[tuple[sp.Expr, ir.Dot]] = []
            for t in e.terms:
                part = _couplings(em, t, j)
                if part is None:
                    return None
                out += part
            return out
        case ir.Mul():
            coef = sp.Integer(1)
            tensors: list[Expr] = []  # the scalar factors without the context token
            rest: list[Expr] = []
            for f in e.factors:
                if isinstance(f, ir.Scalar):
                    coef *= f.value
                elif not f.shape and j not in token_axes(f, em.indices):
                    tensors.append(f)
                else:
                    rest.append(f)
            inner = _couplings(em, rest[0], j) if len(rest) == 1 else None
            if inner is None:
                return None
            return [(coef * c, _fold_into_query(em, d, tensors, j)) for c, d in inner]
    return None


def _fold_into_query(em: Emitter, d: ir.Dot, factors: list[Expr], j: str) -> ir.Dot:
    """`factors` times a . b, with the factors on the side without the context token."""
    if not factors:
        return d
    if j in token_axes(d.a, em.indices):
        return ir.Dot(d.a, ir.mul(*factors, d.b))
    return ir.Dot(ir.mul(*factors, d.a), d.b)


# ----------------------------------------------------------------------------- layout helpers


def _split(em: Emitter, body: Expr, j: str) -> tuple[list[Expr], list[Expr], list[Expr]]:
    """Factors of a summand: (query side: no j, key side: no query position, coupling: both)."""
    factors = list(body.factors) if isinstance(body, ir.Mul) else [body]
    qs, ks, both = [], [], []
    for f in factors:
        ax = token_axes(f, em.indices)
        if j not in ax:
            qs.append(f)
        elif POS not in ax:
            ks.append(f)
        else:
            both.append(f)
    return qs, ks, both


def _state_dependent(e: Expr) -> bool:
    return any(isinstance(n, ir.Var) and n.role in TOKEN_ROLES for n in ir.nodes(e))


def bias_heads(em: Emitter, terms: list[Expr], j: str) -> tuple[str, ...]:
    """The head axes of score terms besides the dot products: a slope or gate per head over a q and k the heads
    share (`- m[k] |i - j|` with one W): the attention runs per head, its q and k broadcast over them."""
    return canonical({a for t in terms for a in token_axes(t, em.indices)} - {BATCH, POS, j})


def _heads(*vals: Val, j: str | None = None) -> tuple[str, ...]:
    return canonical(set().union(*(v.axes for v in vals)) - {BATCH, POS} - ({j} if j else set()))


def _numel(em: Emitter, shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= em.shape_size(s)
    return n


def _flat(em: Emitter, v: Val) -> Val:
    """A matrix-shaped value (RMT's dk x 1 reads) as a vector: a Frobenius dot is the dot of the flattened."""
    return em.tmp(f"{v.code}.flatten(-{v.rank})", v.axes, 1) if v.rank > 1 else v


def _unflat(em: Emitter, v: Val, shape: tuple) -> Val:
    if len(shape) == 1:
        return v
    sizes = ", ".join(str(em.shape_size(s)) for s in shape)
    return em.tmp(f"{v.code}.unflatten(-1, ({sizes}))", v.axes, len(shape))


def _n_heads(em: Emitter, heads: tuple[str, ...]) -> str:
    return " * ".join(em.size(h) for h in heads) or "1"


def _number(e: sp.Expr, scalars: dict[sp.Symbol, str]) -> float | None:
    """`e` as a float when every symbol in it stands for a number (not a learned tensor). The numbers go in
    exactly and the result is rounded once: 1/sqrt(4) is 0.5, not 0.5000000000000001."""
    values = {}
    for sym in sp.sympify(e).free_symbols:
        try:
            values[sym] = exact_number(scalars[sym])
        except (KeyError, ValueError):
            return None
    return float(float_src(sp.sympify(e).subs(values).evalf(30)))  # FloatOverflow beyond a float's range


def _scaled(em: Emitter, a: Val, c: sp.Expr) -> Val:
    return a if c == 1 else em.tmp(f"{a.code} * {em.scalar(c)}", a.axes, a.rank)


def _concat(em: Emitter, parts: list[Val], axes: set[str]) -> Val:
    """Vectors with the same named axes, concatenated along the feature axis."""
    axes_t = canonical(axes & set().union(*(p.axes for p in parts)))
    if len(parts) == 1:
        return parts[0]
    codes = ", ".join(em.expand(p, axes_t).code for p in parts)
    return em.tmp(f"torch.cat([{codes}], dim=-1)", axes_t, 1, "the score's dot products, side by side")


def _per_head(em: Emitter, coef: Val, heads: tuple[str, ...]) -> str:
    """A coefficient with no axes but head axes as a contiguous (H,) tensor."""
    n = _n_heads(em, heads)
    if coef.scalar or not coef.axes:
        return em.tmp(f"torch.as_tensor({coef.code}, dtype=dt, device=dev).reshape(1).expand({n}).contiguous()",
                      (), 1).code
    full = em.expand(coef, canonical(set(heads)))
    return em.tmp(f"{full.code}.reshape({n}).contiguous()", (), 1).code


def _as_column(em: Emitter, v: Val, named: bool = False) -> Val:
    """A number per token or key (rank 0) as a one-feature column, `x[..., None]`, for `_as_bhtd`; a Python number
    (a `- 1` in a score) becomes a tensor first. `named`: a line of its own rather than an expression."""
    if v.rank:
        return v
    code = f"torch.as_tensor({v.code}, dtype=dt, device=dev)[..., None]" if v.scalar else f"{v.code}[..., None]"
    return em.tmp(code, v.axes, 1) if named else Val(code, v.axes, 1)


def _as_bhtd(em: Emitter, v: Val, heads: tuple[str, ...], pos: str) -> str:
    """The name of a (batch, pos, heads..., D) value laid out as the (B, H, T, D) tensor attention ops take.

    Each layout is emitted once: a repeat (keys that are also the values) reuses it, and the layout of a value
    that the optimizer's steps do not change (a hoisted let, the context itself) goes to the prologue, so a
    T-step update lays its context out once, not once per step.
    """
    key = (v.code, heads, pos)
    if key in em.layouts or key in em.invariant_layouts:
        return em.layouts.get(key) or em.invariant_layouts[key]
    invariant = v.code in em.context_names or any(let.code == v.code for let in em.lets.values())
    saved, em.lines = em.lines, (em.prologue if invariant else em.lines)
    axes = canonical({BATCH, pos} | set(heads))
    full = em.expand(v, axes)
    order = [axes.index(BATCH)] + [axes.index(h) for h in heads] + [axes.index(pos), len(axes)]
    code = full.code if order == sorted(order) else f"{full.code}.permute({', '.join(map(str, order))})"
    if len(heads) != 1:  # several head axes merge into one, none becomes one (with one, it is already there)
        code = f"{code}.reshape(B, {_n_heads(em, heads)}, T, {full.code}.shape[-1])"
    name = em.tmp(code, (), 4).code
    em.lines = saved
    (em.invariant_layouts if invariant else em.layouts)[key] = name
    return name


def _from_bhtd(em: Emitter, code: str, heads: tuple[str, ...], rank: int, comment: str) -> Val:
    """Back from (B, H, T, D) to the layout (batch, i, heads..., D)."""
    sizes = ", ".join(em.size(h) for h in heads)
    axes = canonical({BATCH, POS} | set(heads))
    if heads:
        if len(heads) > 1:  # the one (B, H, T, D) head axis back to several
            code = f"{code}.reshape(B, {sizes}, T, -1)"
        code = f"{code}.movedim({len(heads) + 1}, 1)"
    else:
        code = f"{code}[:, 0]"
    if rank == 0:
        code += "[..., 0]"
    return em.tmp(code, axes, rank, comment)

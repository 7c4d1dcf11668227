"""Calculus on the tensor IR: gradients (reverse mode), directional derivatives (forward mode, for
Hessian-vector products), and the value-path rewriting behind `untie`.

Derivatives are taken symbolically, once, for symbolic dims: SymPy handles every scalar coefficient
(dims, temperatures, step sizes), the rules below handle tensors and named indices. We never ask
SymPy to differentiate a matrix-trace expression (its open bugs return 0 there).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import sympy as sp

from .functions import derivative
from .ir import (
    ZERO,
    Add,
    Count,
    Decay,
    Diag,
    Dot,
    Expr,
    Func,
    Identity,
    Index,
    Inverse,
    Let,
    MatMul,
    Mul,
    Ones,
    Outer,
    Pos,
    Pow,
    ProdOthers,
    Reduce,
    Rope,
    Scalar,
    ShapeError,
    Softmax,
    StopGrad,
    SumAll,
    Transpose,
    Var,
    add,
    dot,
    func,
    is_zero,
    matmul,
    mul,
    neg,
    nodes,
    outer,
    power,
    rebuild,
    reduce,
    rope,
    scalar,
    sum_all,
    transpose,
)


class NotDifferentiable(Exception):
    """A construct with no usable derivative where one is needed (e.g. `max`); `hint`: what to do instead."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


def _unbroadcast(g: Expr, target: Expr) -> Expr:
    """A scalar that was broadcast against a tensor receives the sum of the tensor's cotangent."""
    if not target.shape and g.shape:
        return sum_all(g)
    return g


def gradient(f: Expr, wrt: Var, keep: frozenset[str] = frozenset()) -> Expr:
    """∇_wrt f for a scalar `f`. Free indices of the result other than `keep` are summed out."""
    if f.shape:
        raise ShapeError("the energy must be a scalar")
    parts: list[tuple[Expr, frozenset[str]]] = []  # (a leaf's cotangent, the reduction indices around it)
    mentions: dict[int, bool] = {}  # id(node) -> whether `wrt` occurs in it (nodes live through the call)

    def depends(e: Expr) -> bool:
        if id(e) not in mentions:
            own = isinstance(e, Var) and e.name == wrt.name and e.role == wrt.role
            mentions[id(e)] = own or any(depends(c) for c in e.children)
        return mentions[id(e)]

    def visit(e: Expr, g: Expr, bound: frozenset[str] = frozenset()) -> None:
        """Push the cotangent `g` of `e` to the leaves; `bound`: the indices of the reductions around `e`.

        Subtrees without `wrt` are skipped: they contribute nothing, and may hold constructs with no
        derivative rule (a `diag(a)` or `max[j]` of parameters only)."""
        if is_zero(g) or not depends(e):
            return
        match e:
            case Var():
                if e.name == wrt.name and e.role == wrt.role:
                    parts.append((g, bound))
            case Scalar() | Pos() | Ones() | Identity() | Count() | StopGrad() | Decay():  # Decay: of the context
                return
            case Index():  # the language refuses it (semantics); never a silent zero
                raise NotDifferentiable(f"no derivative rule for an entry of a value of `{wrt.name}`")
            case Let():
                visit(e.body, g, bound)
            case Add():
                for t in e.terms:
                    visit(t, _unbroadcast(g, t), bound)
            case Mul():
                for i, fac in enumerate(e.factors):
                    others = mul(*(o for j, o in enumerate(e.factors) if j != i))
                    visit(fac, _unbroadcast(mul(g, others), fac), bound)
            case Pow():
                visit(e.base, mul(g, scalar(e.exponent), power(e.base, e.exponent - 1)), bound)
            case MatMul():
                a, b = e.a, e.b
                if len(a.shape) == 2 and len(b.shape) == 1:
                    visit(b, matmul(transpose(a), g), bound)
                    visit(a, outer(g, b), bound)
                elif len(a.shape) == 1 and len(b.shape) == 2:
                    visit(a, matmul(b, g), bound)
                    visit(b, outer(a, g), bound)
                else:
                    visit(a, matmul(g, transpose(b)), bound)
                    visit(b, matmul(transpose(a), g), bound)
            case Dot():
                visit(e.a, mul(g, e.b), bound)
                visit(e.b, mul(g, e.a), bound)
            case Outer():
                visit(e.a, matmul(g, e.b), bound)
                visit(e.b, matmul(transpose(g), e.a), bound)
            case Transpose():
                visit(e.a, transpose(g), bound)
            case Rope():  # a rotation: its transpose rotates back (the position holds no state)
                visit(e.a, rope(g, e.pos, e.base, -e.sign), bound)
            case Func():
                visit(e.arg, mul(g, func(derivative(e.name), e.arg)), bound)
            case SumAll():
                visit(e.a, mul(g, Ones(e.a.shape)), bound)
            case Diag():
                raise NotDifferentiable("diag(v) is differentiable only as `diag(v) @ x`")
            case Reduce():
                inner = bound | {e.index}
                if e.op == "sum":
                    visit(e.body, g, inner)
                elif e.op == "mean":
                    visit(e.body, mul(g, power(Count(e.index, at_least_one=True), -1)), inner)
                elif e.op == "logsumexp":
                    if e.body.shape:
                        raise ShapeError("logsumexp needs a scalar body")
                    visit(e.body, mul(g, Softmax(e.index, e.body)), inner)
                elif e.op == "prod":  # ∏_{m≠k} b_m, not ∏ b / b_k: finite where a factor is 0
                    visit(e.body, mul(g, ProdOthers(e.index, e.body)), inner)
                else:
                    raise NotDifferentiable(f"`{e.op}[{e.index}]` has no gradient; use logsumexp as a smooth max")
            case Softmax():
                # d p_j = p_j (ds_j - Σ_l p_l ds_l): the cotangent of s is p ∘ (g - Σ p g)
                p = e
                visit(e.body, mul(p, add(g, mul(scalar(-1), reduce("sum", e.index, mul(p, g))))), bound)
            case Inverse():
                raise NotDifferentiable("matrix inverse inside an energy")
            case _:
                raise NotDifferentiable(f"no derivative rule for {type(e).__name__}")

    visit(f, scalar(1))
    total: Expr = ZERO
    # the context's index innermost, whatever the indices are called: Σ_k W_kᵀ Σ_j p_kj v_kj, the form the
    # kernels recognise, for `sum[head](logsumexp[j](...))` as for `sum[k](...)`
    context = {x.index for x in nodes(f) if (isinstance(x, Pos) or isinstance(x, Var) and x.role == "context")
               and x.index}
    for part, bound in parts:
        # summed over its free indices and the reductions around it: a contribution without a reduction's
        # index (a term of sum[j](... + c z . z) without j) is the same for every term, and `reduce` makes
        # that |j| times it
        for idx in sorted((part.free | bound) - keep - wrt.free, key=lambda i: (i not in context, i)):
            part = reduce("sum", idx, part)
        total = add(total, part)
    if is_zero(total) and wrt.shape:
        return ZERO
    return total


def directional(e: Expr, wrt: Var, v: Expr) -> Expr:
    """The forward-mode derivative of `e` along `v` (d/dε e(wrt + ε v) at ε = 0)."""

    def tangent(x: Expr) -> Expr:
        match x:
            case Var():
                return v if (x.name == wrt.name and x.role == wrt.role) else ZERO
            case Scalar() | Pos() | Ones() | Identity() | Count() | StopGrad() | Decay():  # Decay: of the context
                return ZERO
            case Index():
                if any(isinstance(y, Var) and y.name == wrt.name and y.role == wrt.role for y in nodes(x)):
                    raise NotDifferentiable(f"no derivative rule for an entry of a value of `{wrt.name}`")
                return ZERO
            case Let():
                return tangent(x.body)
            case Add():
                return add(*(tangent(t) for t in x.terms))
            case Mul():
                terms = []
                for i, fac in enumerate(x.factors):
                    t = tangent(fac)
                    if not is_zero(t):
                        terms.append(mul(*(x.factors[:i]), t, *(x.factors[i + 1:])))
                return add(*terms) if terms else ZERO
            case Pow():
                return mul(scalar(x.exponent), power(x.base, x.exponent - 1), tangent(x.base))
            case MatMul():
                return add(matmul(tangent(x.a), x.b), matmul(x.a, tangent(x.b)))
            case Dot():
                return add(dot(tangent(x.a), x.b), dot(x.a, tangent(x.b)))
            case Outer():
                return add(outer(tangent(x.a), x.b), outer(x.a, tangent(x.b)))
            case Transpose():
                return transpose(tangent(x.a))
            case Rope():
                return rope(tangent(x.a), x.pos, x.base, x.sign)
            case Func():
                t = tangent(x.arg)
                return ZERO if is_zero(t) else mul(func(derivative(x.name), x.arg), t)
            case SumAll():
                return sum_all(tangent(x.a))
            case Reduce():
                t = tangent(x.body)
                if is_zero(t):
                    return ZERO
                if x.op == "sum":
                    return reduce("sum", x.index, t)
                if x.op == "mean":
                    return reduce("mean", x.index, t)
                if x.op == "logsumexp":
                    return reduce("sum", x.index, mul(Softmax(x.index, x.body), t))
                raise NotDifferentiable(f"`{x.op}` has no directional derivative")
            case Softmax():
                t = tangent(x.body)
                if is_zero(t):
                    return ZERO
                return mul(x, add(t, mul(scalar(-1), reduce("sum", x.index, mul(x, t)))))
            case Diag():
                t = tangent(x.a)
                return ZERO if is_zero(t) else Diag(t)
            case ProdOthers():
                raise NotDifferentiable(f"`prod[{x.index}]` has no directional derivative")
            case _:
                raise NotDifferentiable(f"no directional derivative rule for {type(x).__name__}")

    return tangent(e)


def substitute_var(e: Expr, name: str, role: str, value: Expr, memo: dict[int, Expr] | None = None) -> Expr:
    """Replace a variable by an expression (u := N(x), or the state by a look-ahead point).

    A sub-expression shared in `e` stays one node in the result, and one without the variable is kept as
    it is; pass the same `memo` to several calls to keep what their expressions share shared too
    (hoisted values are cached by node identity)."""
    memo = {} if memo is None else memo

    def sub(x: Expr) -> Expr:
        hit = memo.get(id(x))
        if hit is None:
            if isinstance(x, Var):
                hit = value if (x.name == name and x.role == role) else x
            else:
                kids = [sub(c) for c in x.children]
                hit = x if all(a is b for a, b in zip(kids, x.children)) else rebuild(x, kids)
            memo[id(x)] = hit
        return hit

    return sub(e)


# ----------------------------------------------------------------------------- value path (untie)


def untie(e: Expr, rules: list[tuple[Expr, Expr]]) -> tuple[Expr, list[int]]:
    """Replace pattern occurrences on the *value path* of an update direction.

    The value path is reached from the root through sums, matrix products, transposes and the
    tensor side of scalar×tensor products; it never enters a function argument, a softmax or a
    scalar weight. Returns the rewritten expression and the number of replacements each rule made (one
    per path to an occurrence, as written out). Each shared node is visited once per side of the path:
    a Newton direction written out as a tree has millions of nodes (`energy derive` spent 48 s here).
    """
    memo: dict[tuple[int, bool], tuple[Expr, Counter, Expr]] = {}  # the node kept alive: its id stays its own

    def visit(x: Expr, on_path: bool) -> tuple[Expr, Counter]:
        hit = memo.get((id(x), on_path))
        if hit is None:
            hit = memo[(id(x), on_path)] = (*rewrite(x, on_path), x)
        return hit[0], hit[1]

    def total(counts) -> Counter:
        return sum(counts, Counter())

    def rewrite(x: Expr, on_path: bool) -> tuple[Expr, Counter]:
        if on_path:
            for n, (pattern, replacement) in enumerate(rules):
                if x == pattern:
                    return replacement, Counter({n: 1})
        match x:
            case Add():
                parts = [visit(t, on_path) for t in x.terms]
                return add(*(p for p, _ in parts)), total(n for _, n in parts)
            case MatMul() | Outer():  # an RMT write, (C_jᵀ rk_k) rq_kᵀ: linear in both sides
                (a, na), (b, nb) = visit(x.a, on_path), visit(x.b, on_path)
                return (matmul(a, b) if isinstance(x, MatMul) else outer(a, b)), na + nb
            case Transpose():
                a, n = visit(x.a, on_path)
                return transpose(a), n
            case Rope():
                a, n = visit(x.a, on_path)
                return rope(a, x.pos, x.base, x.sign), n
            case Reduce() if x.op in ("sum", "mean"):
                body, n = visit(x.body, on_path)
                return reduce(x.op, x.index, body), n
            case Mul() if any(f.shape != () for f in x.factors):
                parts = [visit(f, on_path and f.shape != ()) for f in x.factors]
                return mul(*(p for p, _ in parts)), total(n for _, n in parts)
        return x, Counter()

    untied, counts = visit(e, True)
    return untied, [counts[n] for n in range(len(rules))]


def _terms(e: Expr, coef: object = 1) -> list[tuple[object, Expr]]:
    """`e` as Σ c_t X_t: its top-level sums with their constant factors distributed (SymPy values)."""
    if isinstance(e, Add):
        return [t for term in e.terms for t in _terms(term, coef)]
    if isinstance(e, Mul) and isinstance(e.factors[0], Scalar):
        return _terms(mul(*e.factors[1:]), coef * e.factors[0].value)
    if isinstance(e, Mul):  # a constant that is not a number (mean[k]'s |k|⁻¹) stays with each term of the rest
        fixed = [f for f in e.factors if not f.shape and not any(isinstance(v, Var) for v in nodes(f))]
        rest = [f for f in e.factors if all(f is not c for c in fixed)]
        if fixed and rest:
            return [(c, mul(*fixed, t)) for c, t in _terms(mul(*rest), coef)]
    if isinstance(e, Reduce) and e.op in ("sum", "mean"):  # Σ_k (c X_k + c Y_k) = c Σ_k (X_k + Y_k): per head
        inner = _terms(e.body)
        if len(inner) == 1 and inner[0][0] == 1:
            return [(coef, e)]  # nothing to take out: the node as it is (shared with the tied direction)
        if len({c for c, _ in inner}) == 1:
            return [(coef * inner[0][0], reduce(e.op, e.index, add(*(t for _, t in inner))))]
        return [(coef * c, reduce(e.op, e.index, t)) for c, t in inner]
    return [(coef, e)]


def _linear_in(e: Expr, name: str) -> bool:
    """Whether `e` is linear in the parameter `name` (scaling the parameter scales `e`): every part of it reads
    the parameter once, through sums, products with parameter-free factors, reductions and transposes.
    `t (z - Wv c)` is not: its `t z` holds no Wv, and absorbing the term's factor into Wv would flip that part."""
    def free(x: Expr) -> bool:
        return not any(isinstance(v, Var) and v.name == name for v in nodes(x))

    match e:
        case Var():
            return e.name == name
        case Add():
            return all(_linear_in(t, name) for t in e.terms)
        case Mul() | MatMul() | Dot() | Outer():
            parts = e.factors if isinstance(e, Mul) else (e.a, e.b)
            holding = [p for p in parts if not free(p)]
            return len(holding) == 1 and _linear_in(holding[0], name)
        case Reduce() if e.op in ("sum", "mean"):
            return _linear_in(e.body, name)
        case SumAll():
            return _linear_in(e.a, name)
        case Transpose() | Rope():
            return _linear_in(e.a, name)
        case Index():
            return _linear_in(e.base, name)
        case Let():
            return _linear_in(e.body, name)
    return False


def absorb_constants(direction: Expr, new_params: list[str], learned: Iterable[sp.Symbol] = ()
                     ) -> tuple[Expr, dict[str, object]]:
    """An untied direction with each term that holds a new parameter written without its constant factor
    (sign included), which that parameter absorbs: the update reads `z + η (Σ …)`, as the papers write
    untied layers. Terms without a new parameter are kept as derived. A factor of `learned` scalar params
    stays in its term: absorbed, such a param would drop out of the update and never train.

    Returns the direction and, for each absorbing parameter, `scale` with which the untied update equals
    the tied one when the parameter is `scale` × its tied value. A term's first new parameter (in rule
    order) absorbs; when one parameter's terms have different factors, a parameter absorbs a term's factor and
    rides in another's term, or a term is not linear in it (part of it holds no new parameter: `t (z - Wv c)`),
    nothing is absorbed."""
    learned = tuple(learned)
    kept: list[Expr] = []
    free: list[Expr] = []  # the terms whose factor is absorbed, without it
    absorbed: dict[str, object] = {}
    factors: dict[str, object] = {}  # the factor of every new parameter's terms, absorber or not: one each
    riders: set[str] = set()  # new parameters in a term another one absorbs: they keep their tied scale, 1
    for coef, rest in _terms(direction):
        names = {v.name for v in nodes(rest) if isinstance(v, Var)}
        absorber = next((n for n in new_params if n in names), None)
        if absorber is None:
            kept.append(mul(scalar(coef), rest))
            continue
        constant, learned_part = sp.sympify(coef).as_independent(*learned, as_Add=False) if learned else (coef, 1)
        absorbed.setdefault(absorber, constant)
        if any(factors.setdefault(n, constant) != constant for n in new_params if n in names) \
                or not _linear_in(rest, absorber):
            return direction, {}
        free.append(mul(scalar(learned_part), rest))
        riders.update(n for n in new_params if n in names and n != absorber)
    if riders & absorbed.keys():  # `Wo … Wv` beside `Wv` alone: Wv's scale would reach the first term twice
        return direction, {}
    return add(neg(add(*free)), *kept), {name: -coef for name, coef in absorbed.items()}


__all__ = ["gradient", "directional", "untie", "substitute_var", "NotDifferentiable", "absorb_constants"]

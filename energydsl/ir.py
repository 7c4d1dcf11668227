"""The tensor IR: a small expression language with named indices, shared by every later stage.

An expression has a *shape* (positional sizes, SymPy expressions in the dims) and a set of *free
indices* (named loop indices such as the head `k` or the context token `j`). Reductions bind an index.
Scalar sub-expressions that depend on nothing but dims and scalar parameters are folded into one
`Scalar` node holding a SymPy expression: SymPy is the scalar engine, this IR is the tensor engine.

Nodes are built through the smart constructors here (`add`, `mul`, `matmul`, ...), which
check shapes, fold constants and drop zeros, so every pass can stay small; `substitute` and `rebuild`
rewrite through them, `walk` visits. The node types are in `ir_nodes.py`, re-exported here: `ir.X` names
the whole IR.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable

import sympy as sp
from mpmath.libmp import repr_dps
from mpmath.libmp import to_str as mlib_to_str
from sympy.printing.str import StrPrinter

from .ir_nodes import (
    Add,
    Count,
    Decay,
    Diag,
    Dot,
    Expr,
    Func,
    Identity,
    Index,
    IndexInfo,
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
    Shape,
    ShapeError,
    Softmax,
    StopGrad,
    SumAll,
    Transpose,
    Var,
)
from .number_text import short_closed_form

__all__ = [  # the node types are re-exported: codegen, api and the tests name them `ir.X`
    "Add", "Count", "Decay", "Diag", "Dot", "Expr", "Func", "Identity", "Index", "IndexInfo", "Inverse", "Let",
    "MatMul", "Mul", "Ones", "Outer", "Pos", "Pow", "ProdOthers", "Reduce", "Rope", "Scalar", "Shape", "ShapeError",
    "Softmax", "StopGrad", "SumAll", "Transpose", "Var",
    "ONE", "ZERO", "add", "add_broadcast", "count_nodes", "dot", "fmt_shape", "func", "is_one", "is_zero",
    "log_rate", "matmul", "mul", "neg", "outer", "power", "rebuild", "reduce", "rope", "same_shape", "scalar",
    "substitute", "sum_all", "transpose", "walk",
]


# ----------------------------------------------------------------------------- smart constructors

ZERO = Scalar(sp.Integer(0))
ONE = Scalar(sp.Integer(1))


def scalar(value) -> Scalar:
    return Scalar(sp.sympify(value))


def is_zero(e: Expr) -> bool:
    return isinstance(e, Scalar) and e.value == 0


def is_one(e: Expr) -> bool:
    return isinstance(e, Scalar) and e.value == 1


def same_shape(a: Shape, b: Shape) -> bool:
    """Sizes agree as expressions in the dims (`d/heads*heads` is `d`); equal objects skip simplify."""
    return len(a) == len(b) and all(x == y or sp.simplify(x - y) == 0 for x, y in zip(a, b))


def fmt_shape(s: Shape) -> str:
    return "scalar" if not s else "[" + ", ".join(str(x) for x in s) + "]"


def split_coefficient(term: Expr) -> tuple[sp.Expr, Expr]:
    """A term as (scalar coefficient, the rest): `1/2 x` is (1/2, x)."""
    if isinstance(term, Mul) and isinstance(term.factors[0], Scalar):
        rest = term.factors[1:]
        return term.factors[0].value, rest[0] if len(rest) == 1 else Mul(rest)
    return sp.Integer(1), term


def add(*terms: Expr) -> Expr:
    """A flat sum with like terms collected (`1/2 x + 1/2 x` is `x`) and constants summed."""
    like: dict[Expr, list] = {}  # rest -> [summed coefficient, the first term, how many terms]
    const = sp.Integer(0)
    for t in terms:
        for u in (t.terms if isinstance(t, Add) else (t,)):
            if isinstance(u, Scalar):
                const += u.value
            else:
                coef, rest = split_coefficient(u)
                seen = like.setdefault(rest, [sp.Integer(0), u, 0])
                seen[0] += coef
                seen[2] += 1
    # a term met once is kept as it was (the memos of later passes go by node identity)
    flat = [u if n == 1 else rest if coef == 1 else mul(Scalar(coef), rest)
            for rest, (coef, u, n) in like.items() if coef != 0]
    shapes = [u.shape for u in flat if u.shape]
    for s in shapes[1:]:
        if not same_shape(s, shapes[0]):
            raise ShapeError(f"cannot add tensors of shapes {fmt_shape(shapes[0])} and {fmt_shape(s)}")
    if const != 0:
        if shapes:
            raise ShapeError(f"cannot add a scalar to a tensor of shape {fmt_shape(shapes[0])}; "
                             "multiply by ones or use a reduction")
        flat.append(Scalar(const))
    if not flat:
        return ZERO
    if len(flat) == 1:
        return flat[0]
    return Add(tuple(flat))


def add_broadcast(a: Expr, b: Expr) -> Expr:
    """`a + b` where a scalar term broadcasts over a tensor (x - mean(x))."""
    if a.shape and not b.shape and not is_zero(b):
        return add(a, mul(b, Ones(a.shape)))
    if b.shape and not a.shape and not is_zero(a):
        return add(mul(a, Ones(b.shape)), b)
    return add(a, b)


def mul(*factors: Expr) -> Expr:
    coef = sp.Integer(1)
    flat: list[Expr] = []
    for f in factors:
        for u in (f.factors if isinstance(f, Mul) else (f,)):
            if isinstance(u, Scalar):
                coef *= u.value
            else:
                flat.append(u)
    if coef == 0:
        return ZERO
    shapes = [u.shape for u in flat if u.shape]
    for s in shapes[1:]:
        if not same_shape(s, shapes[0]):
            raise ShapeError(f"element-wise product of shapes {fmt_shape(shapes[0])} and {fmt_shape(s)}")
    flat = _drop_steps_under_relus(_square_roots_squared(cancel_reciprocals(flat)))
    if shapes and len(flat) > 1:
        flat = [u for u in flat if not isinstance(u, Ones)] or flat  # ones times x is x
    if shapes and not any(u.shape for u in flat):
        flat.append(Ones(shapes[0]))  # the shape stays: x[d] / x[d], or ones times a scalar, is a vector of ones
    if coef != 1 or not flat:
        # a folded float as the short number it is (0.5 * 0.2: 1/10), else kept a float (not rounded to one)
        simple = short_closed_form(coef) if coef.is_Float else None
        flat.insert(0, Scalar(coef if simple is None else simple))
    return flat[0] if len(flat) == 1 else Mul(tuple(flat))


def cancel_reciprocals(flat: list[Expr]) -> list[Expr]:
    """Drop each pair of factors `x^p`, `x^-p` (`tau * (1/tau)` from differentiating `tau * lse(s / tau)`), as
    SymPy does for its symbols; other powers of one base are left apart (lowering matches products as written)."""
    def split(u: Expr) -> tuple[Expr, sp.Expr]:
        return (u.base, u.exponent) if isinstance(u, Pow) else (u, sp.Integer(1))

    def reciprocal(u: Expr, w: Expr) -> list[Expr] | None:
        base, exponent = split(u)
        return [] if split(w) == (base, -exponent) else None

    return _merge_pairs(flat, reciprocal)


def _square_roots_squared(flat: list[Expr]) -> list[Expr]:
    """`sqrt(x) ∘ sqrt(x)` as `x`, as `power` takes `sqrt(x)^2`: `norm(v) * norm(v)` is `v . v`, whose gradient
    is finite at v = 0 (the chain rule through each norm is 0/0 there)."""
    return _merge_pairs(flat, lambda u, w: [u.arg] if isinstance(u, Func) and u.name == "sqrt" and w == u else None)


def _merge_pairs(flat: list[Expr], merge: Callable[[Expr, Expr], list[Expr] | None]) -> list[Expr]:
    """Each factor with the first later one `merge` pairs it with, replaced by what `merge` gives (none: both go)."""
    out = list(flat)
    i = 0
    while i < len(out):
        found = next(((j, m) for j in range(i + 1, len(out)) if (m := merge(out[i], out[j])) is not None), None)
        if found is None:
            i += 1
        else:
            del out[found[0]]
            out[i:i + 1] = found[1]
    return out


def _drop_steps_under_relus(flat: list[Expr]) -> list[Expr]:
    """`relu(z) ∘ step(z)` as `relu(z)`, everywhere equal (0 at z <= 0): the chain rule writes it for the
    gradient of `relu(z) . relu(z)` (the Energy Transformer's Hopfield term, a ReLU² MLP)."""
    relu_args = {u.arg for u in flat if isinstance(u, Func) and u.name == "relu"}
    return [u for u in flat if not (isinstance(u, Func) and u.name == "step" and u.arg in relu_args)]


def neg(a: Expr) -> Expr:
    return mul(scalar(-1), a)


def power(a: Expr, exponent) -> Expr:
    exponent = sp.sympify(exponent)
    if isinstance(a, Scalar):
        return Scalar(a.value ** exponent)
    if exponent == 1:
        return a
    if exponent == 0:
        return ONE if not a.shape else Ones(a.shape)
    if isinstance(a, Pow):
        # (b^p)^q is b^(pq) but where an even p has hidden b's sign and q is not whole: (x^2)^0.5 is |x|; an
        # exponent that is a name (a param, a dim) may be even, so the power stays as written then: (z^a)^0.5
        if _whole(exponent) or a.exponent.is_number and not _even(a.exponent):
            return power(a.base, a.exponent * exponent)
        if _even(a.exponent):
            return power(func("abs", a.base), a.exponent * exponent)
        return Pow(a, exponent)
    if isinstance(a, Func) and a.name == "sqrt":  # norm(v)^2 is v.v: its gradient is finite at v = 0
        return power(a.arg, exponent / 2)  # (sqrt's argument is not negative where it is real)
    return Pow(a, exponent)


def _whole(e: sp.Expr) -> bool:
    """A whole number (`2`, `2.0`); not a symbol such as a learned exponent, whose value may be any."""
    return bool(e.is_number and e.is_real and e == sp.floor(e))


def _even(e: sp.Expr) -> bool:
    return _whole(e) and int(e) % 2 == 0


def matmul(a: Expr, b: Expr) -> Expr:
    if is_zero(a) or is_zero(b):
        return ZERO
    if not a.shape or not b.shape:
        raise ShapeError(f"`@` needs a matrix or vector on each side, got {fmt_shape(a.shape)} @ {fmt_shape(b.shape)};"
                         " use `*` to scale")
    if len(a.shape) > 2 or len(b.shape) > 2:
        raise ShapeError(f"`@` takes vectors and matrices, got {fmt_shape(a.shape)} @ {fmt_shape(b.shape)}")
    if not same_shape(a.shape[-1:], b.shape[:1]):
        raise ShapeError(f"inner sizes differ in {fmt_shape(a.shape)} @ {fmt_shape(b.shape)}")
    if len(a.shape) == 1 and len(b.shape) == 1:
        return dot(a, b)
    if isinstance(a, Identity):
        return b
    if isinstance(b, Identity):
        return a
    if isinstance(a, Diag) and len(b.shape) == 1:
        return mul(a.a, b)
    return _scalars_out(matmul, a, b) or MatMul(a, b)


def _scalars_out(product, a: Expr, b: Expr) -> Expr | None:
    """`(c x) ∘ y` as `c (x ∘ y)` for a bilinear product (matmul, dot, outer): the constant stays in front,
    where sums, `untie` and the printers find it. None when neither side has a constant factor."""
    for side in (a, b):
        if isinstance(side, Mul) and isinstance(side.factors[0], Scalar) and len(side.factors) > 1:
            rest = mul(*side.factors[1:])
            return mul(side.factors[0], product(rest, b) if side is a else product(a, rest))
    return None


def dot(a: Expr, b: Expr) -> Expr:
    if is_zero(a) or is_zero(b):
        return ZERO
    if not same_shape(a.shape, b.shape):
        raise ShapeError(f"`.` needs two tensors of one shape, got {fmt_shape(a.shape)} . {fmt_shape(b.shape)}")
    if not a.shape:
        return mul(a, b)
    return _scalars_out(dot, a, b) or Dot(a, b)


def outer(a: Expr, b: Expr) -> Expr:
    if is_zero(a) or is_zero(b):
        return ZERO
    if len(a.shape) != 1 or len(b.shape) != 1:
        raise ShapeError(f"outer(a, b) takes two vectors, got {fmt_shape(a.shape)} and {fmt_shape(b.shape)}")
    return _scalars_out(outer, a, b) or Outer(a, b)


def transpose(a: Expr) -> Expr:
    if is_zero(a):
        return ZERO
    if len(a.shape) == 1:
        return a  # a vector's transpose is itself (z^T W h reads as z . (W @ h))
    if len(a.shape) != 2:
        raise ShapeError(f"^T takes a matrix, got {fmt_shape(a.shape)}")
    if isinstance(a, Transpose):
        return a.a
    if isinstance(a, Mul) and isinstance(a.factors[0], Scalar):
        return mul(a.factors[0], transpose(mul(*a.factors[1:])))
    if isinstance(a, (Identity, Diag)):
        return a
    return Transpose(a)


def bare(e: Expr) -> Expr:
    """A named value (`Let`) as its expression; anything else as it is: what a rule matches on."""
    return e.body if isinstance(e, Let) else e


def func(name: str, a: Expr) -> Expr:
    from .functions import REGISTRY, scalar_value

    if isinstance(a, Scalar):
        return Scalar(scalar_value(name, a.value))
    if name not in REGISTRY:
        raise ShapeError(f"unknown function `{name}`")
    if name == "log" and (split := _log_of_gates(a)) is not None:
        return split
    return Func(name, a)


def _log_of_gates(a: Expr) -> Expr | None:
    """log of a product with decay gates, term by term: log(γ b) = log γ + log b, log(γ^n) = n log γ (a gate is
    positive, so this holds wherever the log is real) and log(exp(x)) = x in such a product, so that every gate's
    log is a term of its own: the kernels take c log γ as a bias (`codegen/bias_kinds.py`), and the torch code
    forms it without the exp, which underflows to 0 at long sequences (a log of that is -inf, its gradient NaN)."""
    def gate(f: Expr) -> bool:
        f = bare(f)
        return isinstance(f, Decay) or isinstance(f, Pow) and gate(f.base)

    body = bare(a)
    if isinstance(body, Pow) and gate(body.base):
        return mul(Scalar(body.exponent), func("log", body.base))
    if not (isinstance(body, Mul) and any(gate(f) for f in body.factors)):
        return None
    logs = []
    for f in body.factors:
        value = bare(f)
        if isinstance(value, Func) and value.name == "exp":
            logs.append(value.arg)
        else:
            logs.append(func("log", f) if gate(f) else None)
    rest = [f for f, g in zip(body.factors, logs, strict=True) if g is None]
    return add(*(g for g in logs if g is not None), *([func("log", mul(*rest))] if rest else []))


def log_rate(r: Expr) -> Expr | None:
    """log r for a rate positive by its form, None for any other: `decay(r)` accumulates log r over the tokens
    (γ_ij = exp(Σ_{j<s≤i} log r_s)), and only these forms have a log that is finite wherever r is.

    sigmoid(x) gives logsigmoid(x) (finite where sigmoid underflows to 0 in float32), exp(y) gives y (and
    exp(-softplus(u)), Mamba-2's rate, which is sigmoid(-u), logsigmoid(-u)); products, powers and positive
    numbers follow."""
    match r:
        case Let():
            return log_rate(r.body)
        case Func(name="sigmoid"):
            return func("logsigmoid", r.arg)
        case Func(name="exp") if isinstance(r.arg, Mul) and len(r.arg.factors) == 2 and r.arg.factors[0] == Scalar(-1) \
                and isinstance(r.arg.factors[1], Func) and r.arg.factors[1].name == "softplus":
            return func("logsigmoid", neg(r.arg.factors[1].arg))
        case Func(name="exp"):
            return r.arg
        case Scalar() if r.value.is_positive:
            return Scalar(sp.log(r.value))
        case Pow() if log_rate(r.base) is not None:
            return mul(Scalar(r.exponent), log_rate(r.base))
        case Mul():
            logs = [log_rate(f) for f in r.factors]
            return None if any(g is None for g in logs) else add(*logs)
    return None


def rope(a: Expr, pos: Expr, base: sp.Expr, sign: int = 1) -> Expr:
    """`a` rotated by its position (`Rope`); the rotation of 0 is 0. A rotation is linear: a constant factor
    goes in front (`rope(c x) = c rope(x)`), where `untie` and the printers find it."""
    if is_zero(a):
        return ZERO
    if isinstance(a, Mul) and isinstance(a.factors[0], Scalar) and len(a.factors) > 1:
        return mul(a.factors[0], rope(mul(*a.factors[1:]), pos, base, sign))
    return Rope(a, pos, base, sign)


def sum_all(a: Expr) -> Expr:
    if is_zero(a):
        return ZERO
    if not a.shape:
        return a
    if isinstance(a, Mul) and not a.factors[0].shape and len(a.factors) > 1:
        return mul(a.factors[0], sum_all(mul(*a.factors[1:])))
    if isinstance(a, Ones):
        n = sp.Integer(1)
        for s in a.shape:
            n *= s
        return Scalar(n)
    return SumAll(a)


def reduce(op: str, index: str, body: Expr) -> Expr:
    """Build a reduction, pushing index-free factors out of sums (Σ_j c·x_j = c·Σ_j x_j)."""
    if op == "sum":
        if is_zero(body):
            return ZERO
        if index not in body.free:
            return mul(Count(index), body)
        if isinstance(body, Mul):
            out = [f for f in body.factors if index not in f.free]
            inner = [f for f in body.factors if index in f.free]
            if out:
                return mul(*out, reduce("sum", index, mul(*inner)))
        if isinstance(body, MatMul):
            if index not in body.a.free:
                return matmul(body.a, reduce("sum", index, body.b))
            if index not in body.b.free:
                return matmul(reduce("sum", index, body.a), body.b)
        if isinstance(body, Transpose):
            return transpose(reduce("sum", index, body.a))
        if isinstance(body, Rope) and index not in body.pos.free:  # Σ_j R_i x_j = R_i Σ_j x_j
            return rope(reduce("sum", index, body.a), body.pos, body.base, body.sign)
    if op == "mean" and index not in body.free:
        return body
    return Reduce(op, index, body)


def walk(e: Expr):
    """Pre-order traversal of `e` written out as a tree: a shared sub-expression once per path to it."""
    yield e
    for c in e.children:
        yield from walk(c)


def nodes(e: Expr):
    """Each distinct sub-expression of `e` once, pre-order: for what `walk` would only test or collect,
    without its cost on a DAG (see `occurrences`)."""
    seen: set[Expr] = set()

    def visit(x: Expr):
        if x not in seen:
            seen.add(x)
            yield x
            for c in x.children:
                yield from visit(c)

    return visit(e)


def occurrences(roots: list[Expr]) -> Counter[Expr]:
    """How often each sub-expression occurs in `roots` written out as trees (what counting `walk` gives, in
    the order `walk` first meets them), computed over the DAG: a Newton direction shares its gradient
    between Taylor terms, and its tree is exponentially larger than its distinct nodes."""
    first: dict[Expr, int] = {}  # pre-order of first occurrence, as `walk` meets them
    finished: list[Expr] = []  # children before parents

    def visit(x: Expr) -> None:
        if x not in first:
            first[x] = 0
            for c in x.children:
                visit(c)
            finished.append(x)

    for r in roots:
        visit(r)
    for r in roots:
        first[r] += 1
    for x in reversed(finished):  # each node's count is complete before it passes it on
        for c in x.children:
            first[c] += first[x]
    return Counter(first)


TEXT_NODES = 20_000  # an expression up to this size written out is keyed by its text (`stable_text`)


class _ExactPrinter(StrPrinter):
    """SymPy's `str`, except for a Float its 15 digits do not give back: written with the digits that do."""

    def _print_Float(self, expr: sp.Float) -> str:
        shown = super()._print_Float(expr)
        if sp.Float(shown, precision=expr._prec)._mpf_ == expr._mpf_:
            return shown
        return mlib_to_str(expr._mpf_, repr_dps(expr._prec))


def key_text(value: object) -> str:
    """`repr(value)` of a key (nested tuples of names, numbers and SymPy values) in which no two constants read
    alike: `repr` rounds a SymPy Float to 15 digits, so `0.1234567890123456` and `…457` keyed one cached layer
    (the second ran the first's code). Where 15 digits hold a Float, the text is `repr`'s, and so are the hashes
    that checkpoints and search results recorded before."""
    if isinstance(value, tuple):
        inner = ", ".join(key_text(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(key_text(v) for v in value) + "]"
    if isinstance(value, sp.Basic):
        return _ExactPrinter({"order": None}).doprint(value)
    return repr(value)


def stable_text(e: Expr) -> str:
    """A text for content hashes (cache keys, equation hashes), the same in every process: `key_text(e.key)` for
    an expression of at most `TEXT_NODES` nodes written out (the form hashes held before), its DAG's
    `fingerprint` beyond (written out, a Taylor-2 Newton direction through a norm took minutes)."""
    return key_text(e.key) if e.tree_size <= TEXT_NODES else f"dag:{fingerprint(e)}"


def tree_size(roots: list[Expr]) -> int:
    """The number of nodes `roots` have written out as trees (what `walk` would visit)."""
    return sum(r.tree_size for r in roots)


def fingerprint(e: Expr) -> str:
    """A digest of `e`'s structure that is the same in every process (unlike `hash`), computed over the DAG:
    each node's from its type, its plain fields and its children's digests."""
    memo: dict[int, str] = {}

    def digest(x: Expr) -> str:
        hit = memo.get(id(x))
        if hit is None:
            fields = [digest(c) if isinstance(c, Expr) else [digest(y) for y in c] if isinstance(c, tuple)
                      and c and isinstance(c[0], Expr) else key_text(c) for c in x._fields()]
            hit = memo[id(x)] = hashlib.sha256(repr((type(x).__name__, fields)).encode()).hexdigest()
        return hit

    return digest(e)


def substitute(e: Expr, mapping: dict[Expr, Expr]) -> Expr:
    """Replace sub-expressions (structural match), rebuilding through the smart constructors; each shared
    sub-expression once."""
    memo: dict[int, Expr] = {}

    def visit(x: Expr) -> Expr:
        hit = memo.get(id(x))
        if hit is None:
            if x in mapping:
                hit = mapping[x]
            elif not x.children:
                hit = x
            else:  # an unchanged subtree stays the same object (its cached hash, size and equalities kept)
                kids = [visit(c) for c in x.children]
                hit = x if all(k is c for k, c in zip(kids, x.children)) else rebuild(x, kids)
            memo[id(x)] = hit
        return hit

    return visit(e)


def rebuild(e: Expr, kids: list[Expr]) -> Expr:
    """`e` with new children, through the smart constructors."""
    match e:
        case Add():
            return add(*kids)
        case Mul():
            return mul(*kids)
        case Pow():
            return power(kids[0], e.exponent)
        case MatMul():
            return matmul(*kids)
        case Dot():
            return dot(*kids)
        case Outer():
            return outer(*kids)
        case Transpose():
            return transpose(kids[0])
        case Func():
            return func(e.name, kids[0])
        case SumAll():
            return sum_all(kids[0])
        case Reduce():
            return reduce(e.op, e.index, kids[0])
        case Softmax():
            return Softmax(e.index, kids[0])
        case ProdOthers():
            return ProdOthers(e.index, kids[0])
        case Decay():
            return Decay(e.index, kids[0])
        case Rope():
            return rope(kids[0], kids[1], e.base, e.sign)
        case StopGrad():
            return StopGrad(kids[0])
        case Diag():
            return Diag(kids[0])
        case Inverse():
            return Inverse(kids[0])
        case Index():
            return Index(kids[0], e.index)
        case Let():
            return Let(e.name, kids[0])
    raise TypeError(f"cannot rebuild {type(e).__name__}")


def count_nodes(e: Expr) -> int:
    return e.tree_size

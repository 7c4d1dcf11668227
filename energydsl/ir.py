"""The tensor IR: a small expression language with named indices, shared by every later stage.

An expression has a *shape* (positional sizes, SymPy expressions in the dims) and a set of *free
indices* (named loop indices such as the head `k` or the context token `j`). Reductions bind an index.
Scalar sub-expressions that depend on nothing but dims and scalar parameters are folded into one
`Scalar` node holding a SymPy expression: SymPy is the scalar engine, this IR is the tensor engine.

Nodes are built through the smart constructors at the bottom (`add`, `mul`, `matmul`, ...), which
check shapes, fold constants and drop zeros, so every pass can stay small.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import sympy as sp


class ShapeError(Exception):
    """A shape or index mismatch; semantics attaches the source span."""


Shape = tuple[sp.Expr, ...]


@dataclass(frozen=True, eq=False)
class Expr:
    """Base class. Equality is structural (via `key`), hashing is cached.

    Nodes are immutable, so `key`, `children`, `shape` and `free` are computed once per node and kept
    in its `__dict__` (not dataclass fields: equality and hashing are unchanged). Without this every
    smart constructor re-walked the whole subtree to recompute shapes and free indices.
    """

    @cached_property
    def key(self) -> tuple:
        return (type(self).__name__,) + tuple(
            (c.key if isinstance(c, Expr) else tuple(x.key for x in c) if isinstance(c, tuple)
             and c and isinstance(c[0], Expr) else c)
            for c in self._fields()
        )

    def _fields(self) -> tuple:
        return tuple(getattr(self, f) for f in self.__dataclass_fields__)

    @cached_property
    def _hash(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return isinstance(other, Expr) and self._hash == other._hash and self.key == other.key

    def __hash__(self) -> int:
        return self._hash

    def __getstate__(self) -> dict:
        """Pickle without the cached hash: string hashes differ between processes (PYTHONHASHSEED)."""
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    @cached_property
    def children(self) -> tuple[Expr, ...]:
        out: list[Expr] = []
        for c in self._fields():
            if isinstance(c, Expr):
                out.append(c)
            elif isinstance(c, tuple):
                out.extend(x for x in c if isinstance(x, Expr))
        return tuple(out)

    @property
    def shape(self) -> Shape:
        raise NotImplementedError

    @cached_property
    def free(self) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for c in self.children:
            out |= c.free
        return out

    @property
    def is_scalar(self) -> bool:
        return len(self.shape) == 0


@dataclass(frozen=True, eq=False)
class Scalar(Expr):
    """A scalar built from numbers, dims and scalar parameters (SymPy symbols named like them)."""

    value: sp.Expr

    @cached_property
    def shape(self) -> Shape:
        return ()

    @cached_property
    def free(self) -> frozenset[str]:
        return frozenset()


@dataclass(frozen=True, eq=False)
class Var(Expr):
    """A named tensor. role: state | leaf | context | input | param. A context var carries its index."""

    name: str
    role: str
    var_shape: Shape
    index: str | None = None

    @cached_property
    def shape(self) -> Shape:
        return self.var_shape

    @cached_property
    def free(self) -> frozenset[str]:
        return frozenset([self.index]) if self.index else frozenset()


@dataclass(frozen=True, eq=False)
class Index(Expr):
    """`base[k]`: the first axis of `base` becomes the free index `k`."""

    base: Expr
    index: str

    @cached_property
    def shape(self) -> Shape:
        return self.base.shape[1:]

    @cached_property
    def free(self) -> frozenset[str]:
        return self.base.free | {self.index}


@dataclass(frozen=True, eq=False)
class Pos(Expr):
    """The position of token i (index None) or of context token j, as a number."""

    index: str | None

    @cached_property
    def shape(self) -> Shape:
        return ()

    @cached_property
    def free(self) -> frozenset[str]:
        return frozenset([self.index]) if self.index else frozenset()


@dataclass(frozen=True, eq=False)
class Ones(Expr):
    var_shape: Shape

    @cached_property
    def shape(self) -> Shape:
        return self.var_shape

    @cached_property
    def free(self) -> frozenset[str]:
        return frozenset()


@dataclass(frozen=True, eq=False)
class Identity(Expr):
    size: sp.Expr

    @cached_property
    def shape(self) -> Shape:
        return (self.size, self.size)

    @cached_property
    def free(self) -> frozenset[str]:
        return frozenset()


@dataclass(frozen=True, eq=False)
class Add(Expr):
    terms: tuple[Expr, ...]

    @cached_property
    def shape(self) -> Shape:
        return max((t.shape for t in self.terms), key=len)


@dataclass(frozen=True, eq=False)
class Mul(Expr):
    """Element-wise product; scalar factors broadcast."""

    factors: tuple[Expr, ...]

    @cached_property
    def shape(self) -> Shape:
        return max((f.shape for f in self.factors), key=len)


@dataclass(frozen=True, eq=False)
class Pow(Expr):
    base: Expr
    exponent: sp.Expr

    @cached_property
    def shape(self) -> Shape:
        return self.base.shape


@dataclass(frozen=True, eq=False)
class MatMul(Expr):
    a: Expr
    b: Expr

    @cached_property
    def shape(self) -> Shape:
        return self.a.shape[:-1] + self.b.shape[1:]


@dataclass(frozen=True, eq=False)
class Dot(Expr):
    """Full contraction of two tensors of one shape (vector dot, Frobenius for matrices)."""

    a: Expr
    b: Expr

    @cached_property
    def shape(self) -> Shape:
        return ()


@dataclass(frozen=True, eq=False)
class Outer(Expr):
    a: Expr
    b: Expr

    @cached_property
    def shape(self) -> Shape:
        return self.a.shape + self.b.shape


@dataclass(frozen=True, eq=False)
class Transpose(Expr):
    a: Expr

    @cached_property
    def shape(self) -> Shape:
        return (self.a.shape[1], self.a.shape[0])


@dataclass(frozen=True, eq=False)
class Func(Expr):
    """An element-wise function from `functions.REGISTRY` (SymPy knows its formula)."""

    name: str
    arg: Expr

    @cached_property
    def shape(self) -> Shape:
        return self.arg.shape


@dataclass(frozen=True, eq=False)
class SumAll(Expr):
    """Sum of all elements: a tensor to a scalar."""

    a: Expr

    @cached_property
    def shape(self) -> Shape:
        return ()


@dataclass(frozen=True, eq=False)
class Reduce(Expr):
    """`op[index](body)`: sum, logsumexp, mean, prod or max over a named index."""

    op: str
    index: str
    body: Expr

    @cached_property
    def shape(self) -> Shape:
        return self.body.shape

    @cached_property
    def free(self) -> frozenset[str]:
        return self.body.free - {self.index}


@dataclass(frozen=True, eq=False)
class Softmax(Expr):
    """The softmax weights over `index` of a scalar body; keeps `index` free."""

    index: str
    body: Expr

    @cached_property
    def shape(self) -> Shape:
        return ()


@dataclass(frozen=True, eq=False)
class Count(Expr):
    """The number of terms a reduction over `index` has (context size for j).

    `at_least_one`: max(count, 1), the divisor of a mean, so that an empty context (a strict mask at the
    first token) gives 0 / 1 = 0 rather than 0 / 0.
    """

    index: str
    at_least_one: bool = False

    @cached_property
    def shape(self) -> Shape:
        return ()

    @cached_property
    def free(self) -> frozenset[str]:
        return frozenset()


@dataclass(frozen=True, eq=False)
class StopGrad(Expr):
    a: Expr

    @cached_property
    def shape(self) -> Shape:
        return self.a.shape


@dataclass(frozen=True, eq=False)
class Diag(Expr):
    a: Expr

    @cached_property
    def shape(self) -> Shape:
        return (self.a.shape[0], self.a.shape[0])


@dataclass(frozen=True, eq=False)
class Inverse(Expr):
    a: Expr

    @cached_property
    def shape(self) -> Shape:
        return self.a.shape


@dataclass(frozen=True, eq=False)
class Let(Expr):
    """A named value computed once (hoisted); `body` is its definition."""

    name: str
    body: Expr

    @cached_property
    def shape(self) -> Shape:
        return self.body.shape

    @cached_property
    def free(self) -> frozenset[str]:
        return self.body.free


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


def _coefficient(term: Expr) -> tuple[sp.Expr, Expr]:
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
                coef, rest = _coefficient(u)
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
    if shapes and any(isinstance(u, Ones) for u in flat) and len(flat) > 1:
        flat = [u for u in flat if not isinstance(u, Ones)] or flat
        if not any(u.shape for u in flat):
            flat.append(Ones(shapes[0]))
    if coef != 1 or not flat:
        flat.insert(0, Scalar(sp.nsimplify(coef) if coef.is_Float else coef))
    return flat[0] if len(flat) == 1 else Mul(tuple(flat))


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
        return power(a.base, a.exponent * exponent)
    if isinstance(a, Func) and a.name == "sqrt":  # norm(v)^2 is v.v: its gradient is finite at v = 0
        return power(a.arg, exponent / 2)
    return Pow(a, exponent)


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


def func(name: str, a: Expr) -> Expr:
    from .functions import REGISTRY, scalar_value

    if isinstance(a, Scalar):
        return Scalar(scalar_value(name, a.value))
    if name not in REGISTRY:
        raise ShapeError(f"unknown function `{name}`")
    return Func(name, a)


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
    if op == "mean" and index not in body.free:
        return body
    return Reduce(op, index, body)


@dataclass
class IndexInfo:
    """What a named index ranges over: a dim size (heads), or a causal context (`j <= i`)."""

    name: str
    size: sp.Expr | None = None  # for a range index
    context: str | None = None  # the context variable for a context index
    strict: bool = False  # j < i rather than j <= i
    aliases: list[str] = field(default_factory=list)


def walk(e: Expr):
    """Pre-order traversal."""
    yield e
    for c in e.children:
        yield from walk(c)


def substitute(e: Expr, mapping: dict[Expr, Expr]) -> Expr:
    """Replace sub-expressions (structural match), rebuilding through the smart constructors."""
    if e in mapping:
        return mapping[e]
    if not e.children:
        return e
    return rebuild(e, [substitute(c, mapping) for c in e.children])


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
    return sum(1 for _ in walk(e))

"""The tensor IR's node types: `Expr` and one frozen dataclass per node, with `Shape`, `ShapeError` and
`IndexInfo` (what a named index ranges over).

Each node computes its own shape and free indices, once (see `ir.py` for what those are). Nodes are built
through the smart constructors in `ir.py`, which re-exports these types; kept apart so that the types read
on their own and the constructors' file is about building.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import sympy as sp


class ShapeError(Exception):
    """A shape or index mismatch; semantics attaches the source span."""


Shape = tuple[sp.Expr, ...]


KEY_COMPARE_NODES = 10_000  # larger expressions are compared node pair by node pair (`_same_dag`)


def _same_dag(a: Expr, b: Expr) -> bool:
    """Structural equality visiting each pair of nodes once: comparing `key`s compares two DAGs built apart
    as trees, exponential in their depth of sharing (a Newton direction loaded twice)."""
    equal: set[tuple[int, int]] = set()

    def same(x: Expr, y: Expr) -> bool:
        if x is y or (id(x), id(y)) in equal:
            return True
        if type(x) is not type(y) or x._hash != y._hash:
            return False
        for f, g in zip(x._fields(), y._fields(), strict=True):
            if isinstance(f, Expr):
                if not (isinstance(g, Expr) and same(f, g)):
                    return False
            elif isinstance(f, tuple) and f and isinstance(f[0], Expr):
                if not (isinstance(g, tuple) and len(f) == len(g) and all(same(p, q) for p, q in zip(f, g))):
                    return False
            elif f != g:
                return False
        equal.add((id(x), id(y)))
        return True

    return same(a, b)


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
        """From the children's cached hashes: `hash(self.key)` would rehash the whole nested key, every
        shared subtree once per path to it (exponential in a Newton direction's depth of sharing)."""
        return hash((type(self).__name__,) + tuple(
            (c._hash if isinstance(c, Expr) else tuple(x._hash for x in c) if isinstance(c, tuple)
             and c and isinstance(c[0], Expr) else c)
            for c in self._fields()
        ))

    @cached_property
    def tree_size(self) -> int:
        """Nodes written out as a tree: each shared sub-expression once per path to it."""
        return 1 + sum(c.tree_size for c in self.children)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Expr) or self._hash != other._hash:
            return False
        if self.tree_size <= KEY_COMPARE_NODES:
            return self.key == other.key  # at C speed
        return _same_dag(self, other)

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
class ProdOthers(Expr):
    """∏ of `body` over the other values of `index` (all but the one `index` takes here); keeps `index` free.

    The gradient of `prod[k](b_k)` is Σ_k (∏_{m≠k} b_m) δb_k. Written ∏_m b_m / b_k it is NaN where a factor is 0,
    which a relu, a sigmoid that underflows or a zero-initialised param makes exactly 0."""

    index: str
    body: Expr

    @cached_property
    def shape(self) -> Shape:
        return self.body.shape


@dataclass(frozen=True, eq=False)
class Decay(Expr):
    """`decay(r[j])`: γ_ij = ∏ r_s over the context tokens s after j (j < s ≤ i; s < i under `j < i`, which reads
    no rate of token i itself): the cumulative gate of GLA, Mamba-2 or the Forgetting Transformer, RetNet's
    a^(i−j) made data-dependent. 1 at the last context token.

    `body` (r) is a scalar of context token `index` alone, so γ is a constant of the calculus: it depends on the
    context, not on the state. Keeps `index` free, and depends on the query's position as Softmax does."""

    index: str
    body: Expr

    @cached_property
    def shape(self) -> Shape:
        return ()


@dataclass(frozen=True, eq=False)
class Rope(Expr):
    """`rope(a, p)`: the vector a with each feature pair (m, m + D/2) rotated by the angle p θ_m, θ_m = base^(−2m/D)
    (rotary position embedding, in GPT-NeoX's and Hugging Face Llama's rotate-half pairing). `pos` is a position,
    the token's own i or a context token's j (ir.Pos); `sign` −1 rotates back by −p θ_m, the transpose, which a
    gradient through rope needs. Linear in a: the calculus and `untie` see through it."""

    a: Expr
    pos: Expr
    base: sp.Expr
    sign: int = 1

    @cached_property
    def shape(self) -> Shape:
        return self.a.shape


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


@dataclass
class IndexInfo:
    """What a named index ranges over: a dim size (heads), or a causal context (`j <= i`)."""

    name: str
    size: sp.Expr | None = None  # for a range index
    context: str | None = None  # the context variable for a context index
    strict: bool = False  # j < i rather than j <= i
    aliases: list[str] = field(default_factory=list)

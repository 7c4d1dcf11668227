"""The syntax tree: the typed, position-carrying nodes a parsed spec is made of.

`syntax.py` reads spec files and `syntax_build.py` turns lark's parse tree into these nodes; later stages
(`semantics.py`, `merge.py`, `composition.py`) read them. Kept apart so that a reader of the tree needs neither
lark nor the parser.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import Span

EXPECT_NAMES = ("update", "gradient", "direction")  # what an `expect NAME = ...` clause may state


# ----------------------------------------------------------------------------- expressions


@dataclass(frozen=True)
class Node:
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True)
class Num(Node):
    value: float


@dataclass(frozen=True)
class Name(Node):
    name: str


@dataclass(frozen=True)
class BinOp(Node):
    op: str  # + - * / @ . ^
    left: Node
    right: Node


@dataclass(frozen=True)
class Neg(Node):
    operand: Node


@dataclass(frozen=True)
class Transpose(Node):
    operand: Node


@dataclass(frozen=True)
class Index(Node):
    base: Node
    indices: tuple[str, ...]


@dataclass(frozen=True)
class Reduce(Node):
    op: str  # sum logsumexp mean prod max softmax
    indices: tuple[str, ...]
    body: Node


@dataclass(frozen=True)
class Call(Node):
    func: str
    args: tuple[Node, ...]


@dataclass(frozen=True)
class Integral(Node):
    func: str
    arg: Node


@dataclass(frozen=True)
class Hole(Node):
    """A search hole: `choice{...}`, `int a..b`, `float a..b [log]`."""

    kind: str  # choice | int | float
    options: tuple[Any, ...] = ()
    low: float = 0.0
    high: float = 0.0
    log: bool = False


# ----------------------------------------------------------------------------- declarations


@dataclass
class KwArg:
    name: str
    value: Node
    flag: str | None  # learn | fixed | None
    span: Span


@dataclass
class OptCall:
    name: str
    kwargs: list[KwArg]
    span: Span
    has_parens: bool = False


@dataclass
class OptHole:
    options: list[OptCall]
    span: Span


@dataclass
class Clause:
    kind: str
    span: Span
    name: str = ""
    value: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class EnergyDecl:
    name: str
    header: list[tuple[str, Node]]
    clauses: list[Clause]
    span: Span
    source_text: str = ""


@dataclass
class StageRef:
    name: str
    args: list[tuple[str | None, Node]]
    span: Span


@dataclass
class BlockDecl:
    name: str
    pipeline: list[list[StageRef]]  # sequential stages, each a sum of energies
    span: Span


@dataclass
class ModelDecl:
    name: str
    header: list[tuple[str, Node]]
    clauses: list[Clause]
    span: Span


@dataclass
class SearchDecl:
    name: str
    clauses: list[Clause]
    span: Span


@dataclass
class Module:
    """One parsed file, imports already merged in (declarations carry their own file in spans)."""

    path: str
    energies: dict[str, EnergyDecl] = field(default_factory=dict)
    blocks: dict[str, BlockDecl] = field(default_factory=dict)
    models: dict[str, ModelDecl] = field(default_factory=dict)
    searches: dict[str, SearchDecl] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # declaration names in source order (this file only)
    text: str = ""  # this file's own text, as read
    base: str = "."  # the folder its imports resolve against
    files: list[str] = field(default_factory=list)  # every file read (this one, its imports), resolved

    def names(self) -> list[str]:
        return list(self.order)

"""Syntax: the lark grammar in `grammars/energy.lark` turned into a typed tree with source positions.

Nothing here knows what a name means; `semantics.py` does that. Imports are followed here, with
cycles reported at the offending `import`.
"""

from __future__ import annotations

import codecs
import functools
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lark
from lark import Lark, Transformer, v_args

from .errors import Span, SpecError, UserError

GRAMMAR_PATH = Path(__file__).resolve().parent.parent / "grammars" / "energy.lark"
EXPECT_NAMES = ("update", "gradient", "direction")  # what an `expect NAME = ...` clause may state
MAX_SOURCE_BYTES = 4 * 1024 * 1024
MAX_NESTING = 200  # brackets inside one another
MAX_TREE_DEPTH = 250  # levels of the parse tree: operators chained (`1 + 1 + ...`, `---x`) count too


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

    def names(self) -> list[str]:
        return list(self.order)


# ----------------------------------------------------------------------------- parsing


@functools.lru_cache(maxsize=1)
def _parser() -> Lark:
    return Lark(
        GRAMMAR_PATH.read_text(encoding="utf-8"),
        parser="lalr",
        propagate_positions=True,
        maybe_placeholders=True,
        cache=True,  # the built LALR tables, in the temp dir keyed by grammar and options: ~0.3 s per process
    )


def _binary(op: str):
    """A transformer callback building `BinOp(op)`."""

    @v_args(meta=True)
    def build(self, meta, children):
        return BinOp(self._span(meta), op, children[0], children[1])

    return build


class _ToAst(Transformer):
    """Bottom-up conversion of lark trees into the dataclasses above."""

    def __init__(self, file: str, text: str):
        super().__init__()
        self.file = file
        self.text = text

    def _span(self, meta_or_tok: Any) -> Span:
        line = getattr(meta_or_tok, "line", None)
        col = getattr(meta_or_tok, "column", None)
        end_col = getattr(meta_or_tok, "end_column", None)
        end_line = getattr(meta_or_tok, "end_line", None)
        if end_line != line:
            end_col = None
        return Span(self.file, line or 1, col or 1, self.text, end_col)

    # expressions ---------------------------------------------------------
    def _float(self, tok: Any) -> float:
        """A NUMBER token's value; one too large for a float (`1e999`) is an error at the literal."""
        value = float(tok)
        if not math.isfinite(value):
            raise SpecError(f"number too large: {tok}", self._span(tok),
                            f"numbers must be below {sys.float_info.max:.4g}")
        return value

    @v_args(meta=True)
    def number(self, meta, children):
        return Num(self._span(meta), self._float(children[0]))

    @v_args(meta=True)
    def name(self, meta, children):
        return Name(self._span(meta), str(children[0]))

    add, sub, mul, div, matmul, dot, pow = (_binary(o) for o in ["+", "-", "*", "/", "@", ".", "^"])

    @v_args(meta=True)
    def neg(self, meta, children):
        return Neg(self._span(meta), children[0])

    @v_args(meta=True)
    def transpose(self, meta, children):
        return Transpose(self._span(meta), children[0])

    @v_args(meta=True)
    def index(self, meta, children):
        return Index(self._span(meta), children[0], tuple(children[1]))

    def names(self, children):
        return [str(c) for c in children]

    @v_args(meta=True)
    def reduce(self, meta, children):
        return Reduce(self._span(meta), str(children[0]), tuple(children[1]), children[2])

    @v_args(meta=True)
    def call(self, meta, children):
        args = tuple(c for c in children[1:] if c is not None)
        return Call(self._span(meta), str(children[0]), args)

    @v_args(meta=True)
    def integral(self, meta, children):
        return Integral(self._span(meta), str(children[0]), children[1])

    @v_args(meta=True)
    def choice_hole(self, meta, children):
        return Hole(self._span(meta), "choice", tuple(children))

    @v_args(meta=True)
    def int_hole(self, meta, children):
        return Hole(self._span(meta), "int", (), children[0], children[1])

    @v_args(meta=True)
    def float_hole(self, meta, children):
        return Hole(self._span(meta), "float", (), children[0], children[1], children[2] is not None)

    def bound(self, children):
        sign, number = children
        return -self._float(number) if sign is not None else self._float(number)

    # energy clauses ------------------------------------------------------
    @v_args(meta=True)
    def header_item(self, meta, children):
        return (str(children[0]), children[1])

    def header(self, children):
        return [c for c in children if c is not None]

    def dims(self, children):
        return list(children)

    @v_args(meta=True)
    def dim_clause(self, meta, c):
        return Clause("dim", self._span(meta), str(c[0]), c[1])

    @v_args(meta=True)
    def state_clause(self, meta, c):
        extra = {}
        if c[2] is not None:
            extra = {"via": str(c[3]), "via_expr": c[4]}
        return Clause("state", self._span(meta), str(c[0]), c[1], extra)

    @v_args(meta=True)
    def input_clause(self, meta, c):
        return Clause("input", self._span(meta), str(c[0]), c[1])

    @v_args(meta=True)
    def context_clause(self, meta, c):
        return Clause(
            "context", self._span(meta), str(c[0]), c[2],
            {"index": str(c[1]), "lhs": str(c[3]), "relation": str(c[4]), "rhs": str(c[5]),
             "index_span": self._span(c[1])},
        )

    @v_args(meta=True)
    def param_clause(self, meta, c):
        options = [o for o in c[2:] if o is not None]
        return Clause("param", self._span(meta), str(c[0]), c[1] or [], {"options": options})

    @v_args(meta=True)
    def init_call(self, meta, c):
        return ("init", str(c[0]), [a for a in c[1:] if a is not None], self._span(meta))

    @v_args(meta=True)
    def init_value(self, meta, c):
        return ("value", c[0], self._span(meta))

    @v_args(meta=True)
    def constraint_interval(self, meta, c):
        return ("interval", c[0], c[1], self._span(meta))

    def flag(self, c):
        return ("flag", str(c[0]), self._span(c[0]))

    @v_args(meta=True)
    def let_clause(self, meta, c):
        return Clause("let", self._span(meta), str(c[0]), c[2], {"indices": c[1] or []})

    @v_args(meta=True)
    def local_clause(self, meta, c):
        return Clause("local", self._span(meta), str(c[0]), c[2], {"indices": c[1] or []})

    @v_args(meta=True)
    def global_clause(self, meta, c):
        return Clause("global", self._span(meta), str(c[0]), c[1])

    @v_args(meta=True)
    def kwarg(self, meta, c):
        return KwArg(str(c[0]), c[1], str(c[2]) if c[2] is not None else None, self._span(meta))

    @v_args(meta=True)
    def opt_call(self, meta, c):
        kwargs = [k for k in c[1:] if k is not None]
        return OptCall(str(c[0]), kwargs, self._span(meta), has_parens=len(c) > 1)

    @v_args(meta=True)
    def opt_hole(self, meta, c):
        return OptHole(list(c), self._span(meta))

    @v_args(meta=True)
    def steps(self, meta, c):
        return ("steps", c[0], self._span(meta))

    @v_args(meta=True)
    def per_head(self, meta, c):
        return ("per_head", True, self._span(meta))

    @v_args(meta=True)
    def wrt(self, meta, c):
        return ("wrt", str(c[0]), self._span(meta))

    @v_args(meta=True)
    def precondition(self, meta, c):
        return ("precondition", c[0], self._span(meta))

    @v_args(meta=True)
    def optimizer_clause(self, meta, c):
        mods: dict[str, Any] = {}
        spans: dict[str, Span] = {}  # each modifier's own span, for errors about it (`wrt h`)
        for kind, value, span in c[1:]:
            if kind in mods:
                raise SpecError(f"`{kind.replace('_', ' ')}` given twice in one optimizer clause", span)
            mods[kind] = value
            spans[kind] = span
        mods["spans"] = spans
        return Clause("optimizer", self._span(meta), "", c[0], mods)

    @v_args(meta=True)
    def untie_rule(self, meta, c):
        return (c[0], c[1], self._span(meta))

    @v_args(meta=True)
    def untie_clause(self, meta, c):
        return Clause("untie", self._span(meta), "", [r for r in c[1:]], {"value_only": True})

    @v_args(meta=True)
    def expect_clause(self, meta, c):
        return Clause("expect", self._span(meta), str(c[0]), c[1])

    @v_args(meta=True)
    def energy_decl(self, meta, c):
        header = c[1] or []
        clauses = list(c[2:])
        src = self.text[meta.start_pos : meta.end_pos] if hasattr(meta, "start_pos") else ""
        return EnergyDecl(str(c[0]), header, clauses, self._span(c[0]), src)

    # composition ---------------------------------------------------------
    @v_args(meta=True)
    def named_arg(self, meta, c):
        return (str(c[0]), c[1])

    def arg(self, c):
        return (None, c[0])

    @v_args(meta=True)
    def stage_ref(self, meta, c):
        return StageRef(str(c[0]), [a for a in c[1:] if a is not None], self._span(meta))

    def summed(self, c):
        return list(c)

    def pipeline(self, c):
        return list(c)

    @v_args(meta=True)
    def block_decl(self, meta, c):
        return BlockDecl(str(c[0]), c[1], self._span(c[0]))

    @v_args(meta=True)
    def stream(self, meta, c):
        return Clause("stream", self._span(meta), "", c[0])

    def rank_option(self, c):
        return c[0]

    @v_args(meta=True)
    def embed(self, meta, c):
        return Clause("embed", self._span(meta), "", c[0], {"rank": c[1]})

    @v_args(meta=True)
    def layer(self, meta, c):
        return Clause("layer", self._span(meta), "", c[0])

    @v_args(meta=True)
    def repeat(self, meta, c):
        return Clause("repeat", self._span(meta), "", c[0], {"shared": c[1] is not None})

    @v_args(meta=True)
    def across(self, meta, c):
        return Clause("across", self._span(meta), "", c[0])

    def norm_where(self, c):
        return "stage"

    @v_args(meta=True)
    def norm(self, meta, c):
        where = "layer" if re.search(r"each\s+layer", self.text[meta.start_pos : meta.end_pos]) else "stage"
        return Clause("norm", self._span(meta), str(c[0]), where)

    @v_args(meta=True)
    def final_norm(self, meta, c):
        return Clause("final_norm", self._span(meta), str(c[0]))

    @v_args(meta=True)
    def head(self, meta, c):
        return Clause("head", self._span(meta), "", str(c[0]), {"rank": c[1]})

    @v_args(meta=True)
    def model_decl(self, meta, c):
        return ModelDecl(str(c[0]), c[1] or [], list(c[2:]), self._span(c[0]))

    # search --------------------------------------------------------------
    @v_args(meta=True)
    def search_model(self, meta, c):
        return Clause("model", self._span(meta), "", c[0])

    @v_args(meta=True)
    def search_energy(self, meta, c):
        return Clause("energy", self._span(meta), "", c[0])

    @v_args(meta=True)
    def search_optimizer(self, meta, c):
        return Clause("optimizer", self._span(meta), str(c[0]), c[1])

    @v_args(meta=True)
    def search_precondition(self, meta, c):
        return Clause("precondition", self._span(meta), str(c[0]), c[1])

    @v_args(meta=True)
    def search_data(self, meta, c):
        return Clause("data", self._span(meta), str(c[0]), c[1])

    @v_args(meta=True)
    def search_train(self, meta, c):
        return Clause("train", self._span(meta), "", list(c))

    def objective(self, c):
        return (str(c[0]), str(c[1]))

    @v_args(meta=True)
    def objectives(self, meta, c):
        return Clause("objective", self._span(meta), "", list(c))

    @v_args(meta=True)
    def trials(self, meta, c):
        return Clause("trials", self._span(meta), "", c[0])

    @v_args(meta=True)
    def search_decl(self, meta, c):
        return SearchDecl(str(c[0]), list(c[1:]), self._span(c[0]))

    @v_args(meta=True)
    def import_decl(self, meta, c):
        return ("import", str(c[0])[1:-1], self._span(meta))

    def start(self, c):
        return list(c)


def _check_depth(tree: lark.Tree, text: str, file: str) -> None:
    """Refuse a parse tree deeper than MAX_TREE_DEPTH (`----...x`, a sum of a thousand terms) before
    anything recursive walks it: the bracket count in `_check_text` doesn't see operator chains."""
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_TREE_DEPTH:
            line, col = getattr(node.meta, "line", 1), getattr(node.meta, "column", 1)
            raise SpecError(f"expression nested too deeply (more than {MAX_TREE_DEPTH} operators inside one another)",
                            Span(file, line, col, text), "split it with `let` bindings")
        stack.extend((c, depth + 1) for c in node.children if isinstance(c, lark.Tree))


def _position(text: str, offset: int) -> tuple[int, int]:
    """The 1-based line and column of `offset` in `text`, as the parser counts them (lines end at \\n)."""
    start = text.rfind("\n", 0, offset) + 1
    return text.count("\n", 0, offset) + 1, offset - start + 1


def _check_text(text: str, file: str) -> None:
    if "\x00" in text:
        line, col = _position(text, text.index("\x00"))
        shown = text.replace("\x00", "\u2400")  # the source line quoted with ␀ where a NUL is (a NUL prints nothing)
        raise SpecError("this is not a text file (it contains NUL bytes)", Span(file, line, col, shown),
                        "a .energy spec is UTF-8 text (a file saved as UTF-16 has a NUL after every ASCII character)")
    if len(text.encode("utf-8", "ignore")) > MAX_SOURCE_BYTES:
        raise SpecError(f"the spec is larger than {MAX_SOURCE_BYTES // (1024 * 1024)} MiB", Span(file, 1, 1))
    depth = 0
    line, col = 1, 0
    for ch in text:
        col += 1
        if ch == "\n":
            line, col = line + 1, 0
        elif ch in "([{":
            depth += 1
            if depth > MAX_NESTING:
                raise SpecError(f"expression nested deeper than {MAX_NESTING} levels", Span(file, line, col, text),
                                "split it with `let` bindings")
        elif ch in ")]}":
            depth = max(0, depth - 1)


def parse_text(text: str, file: str = "<string>") -> list[Any]:
    """Parse one source text into a list of declarations and ("import", path, span) tuples."""
    text = _lines(text.removeprefix("\ufeff"))  # a byte-order mark some editors write: not part of the spec
    _check_text(text, file)
    try:
        tree = _parser().parse(text)
    except lark.exceptions.UnexpectedInput as e:
        from .syntax_errors import syntax_error  # the error path only: it reads the grammar's terminals

        raise syntax_error(e, text, file) from None
    except RecursionError:
        raise SpecError("expression too deeply nested", Span(file, 1, 1, text)) from None
    _check_depth(tree, text, file)
    try:
        return _ToAst(file, text).transform(tree)
    except lark.exceptions.VisitError as e:
        if isinstance(e.orig_exc, SpecError):
            raise e.orig_exc from None
        raise


def _lines(text: str) -> str:
    """Lines ended by \\n: a lone \\r (old Mac OS line ends) becomes one, so that the parser counts lines as an
    editor shows them and a `#` comment ends at its line's end. \\r\\n stays as it is (the parser reads the \\r as
    a space)."""
    return re.sub(r"\r(?!\n)", "\n", text) if "\r" in text else text


def _read(path: Path, span: Span | None, name: str | None = None) -> str:
    """The text of a spec file; `span` is the `import` that names it, `name` how its own spans name it."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SpecError(f"no such file: {path}", span) from None
    except IsADirectoryError:
        raise SpecError(f"{path} is a directory, not a .energy file", span) from None
    except OSError as e:
        raise SpecError(f"cannot read {path}: {e.strerror}", span) from None
    data = data.removeprefix(codecs.BOM_UTF8)  # a byte-order mark (some Windows editors write one) is dropped
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:  # located as the parser would locate it: the text before the bad byte is UTF-8
        text = _lines(data.decode("utf-8", "replace"))
        line, col = _position(text, len(_lines(data[: e.start].decode("utf-8"))))
        imported = f"; it is imported at {span}" if span else ""
        raise SpecError(f"this is not UTF-8 text: byte 0x{data[e.start]:02X} cannot start or continue a character "
                        "here", Span(name or str(path), line, col, text), "a .energy spec is UTF-8 text: save it as "
                        f"UTF-8 (a Latin-1 `é` is the single byte 0xE9){imported}") from None


def parse_module(source: str | Path, *, name: str | None = None, base: Path | None = None) -> Module:
    """Parse a file (or text) and everything it imports into one `Module`.

    `source` is a path when it is one line without a `{` (every declaration has one; a mistyped path
    then reads "no such file", not a syntax error in its text) and not an `import` line; otherwise it is
    spec text, whose imports resolve against `base` (default: the working directory).
    """
    if not isinstance(source, str | Path):
        raise TypeError(f"expected a path or spec text (str or pathlib.Path), got {type(source).__name__}")
    if isinstance(source, str) and not source.strip():
        raise UserError("empty spec: give a path to a .energy file or spec text")
    if isinstance(source, Path) or ("\n" not in source and "{" not in source
                                    and not source.lstrip().startswith("import ")):
        path = Path(source).expanduser()
        text = _read(path, None)
        module = Module(str(path))
        _load(text, str(path), path.parent, module, stack=[str(path.resolve())], seen=set(), top=True)
    else:
        module = Module(name or "<string>")
        _load(str(source), name or "<string>", base or Path.cwd(), module, stack=[], seen=set(), top=True)
    return module


def _load(text: str, file: str, base: Path, module: Module, stack: list[str], seen: set[str], top: bool) -> None:
    items = parse_text(text, file)
    for item in items:
        if isinstance(item, tuple) and item[0] == "import":
            _, rel, span = item
            target = (base / rel).resolve()
            if str(target) in stack:
                chain = " -> ".join(Path(p).name for p in stack[stack.index(str(target)):] + [str(target)])
                raise SpecError(f"import cycle: {chain}", span, "remove one of these imports")
            if str(target) in seen:
                continue
            seen.add(str(target))
            sub = _read(target, span, str(base / rel))
            _load(sub, str(base / rel), target.parent, module, stack + [str(target)], seen, top=False)
            continue
        table = {EnergyDecl: module.energies, BlockDecl: module.blocks, ModelDecl: module.models,
                 SearchDecl: module.searches}[type(item)]
        for other in (module.energies, module.blocks, module.models, module.searches):
            if item.name in other:
                prev = other[item.name]
                raise SpecError(f"`{item.name}` is declared twice (first at {prev.span})", item.span)
        table[item.name] = item
        if top:
            module.order.append(item.name)

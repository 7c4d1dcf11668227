"""Syntax: the lark grammar in `grammars/energy.lark` turned into a typed tree with source positions.

Nothing here knows what a name means; `semantics.py` does that. Imports are followed here, with
cycles reported at the offending `import`.

This module reads: files and text, the size and nesting limits, the parser, `import`s. The tree's node types
are in `syntax_tree.py` (re-exported here, so `syntax.Module`, `syntax.EnergyDecl`, ... still name them) and
the conversion of lark's parse tree into them in `syntax_build.py`.
"""

from __future__ import annotations

import codecs
import errno
import functools
import os
import re
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import lark
from lark import Lark

from .errors import Span, SpecError, UserError
from .files import PATH_LIMITS
from .syntax_build import _ToAst
from .syntax_tree import (
    EXPECT_NAMES,
    BinOp,
    BlockDecl,
    Call,
    Clause,
    EnergyDecl,
    Hole,
    Index,
    Integral,
    KwArg,
    ModelDecl,
    Module,
    Name,
    Neg,
    Node,
    Num,
    OptCall,
    OptHole,
    Reduce,
    SearchDecl,
    StageRef,
    Transpose,
)

__all__ = [  # the tree's types are re-exported: cli, api and composition name them `syntax.X`
    "EXPECT_NAMES", "GRAMMAR_PATH", "MAX_NESTING", "MAX_SOURCE_BYTES", "MAX_TREE_DEPTH",
    "BinOp", "BlockDecl", "Call", "Clause", "EnergyDecl", "Hole", "Index", "Integral", "KwArg", "ModelDecl", "Module",
    "Name", "Neg", "Node", "Num", "OptCall", "OptHole", "Reduce", "SearchDecl", "StageRef", "Transpose",
    "parse_module", "parse_text",
]

# `grammars/energy.lark` at the top of the repository, through the package's `grammars` link to it (a wheel copies
# the file in: an installed package has no repository around it)
GRAMMAR_PATH = Path(__file__).resolve().parent / "grammars" / "energy.lark"
MAX_SOURCE_BYTES = 4 * 1024 * 1024
MAX_NESTING = 200  # brackets inside one another
MAX_TREE_DEPTH = 250  # levels of the parse tree: operators chained (`1 + 1 + ...`, `---x`) count too


# ----------------------------------------------------------------------------- parsing


@functools.lru_cache(maxsize=1)
def _parser() -> Lark:
    grammar = GRAMMAR_PATH.read_text(encoding="utf-8")
    return Lark(
        grammar,
        parser="lalr",
        propagate_positions=True,
        maybe_placeholders=True,
        cache=True,  # the built LALR tables, in the temp dir keyed by grammar and options: ~0.3 s per process
        lexer_callbacks=dict.fromkeys(keyword_terminals(grammar), _stands_alone),
    )


def keyword_terminals(grammar: str) -> set[str]:
    """The lexer's names for the grammar's words: its quoted words (lark names such a terminal after its word,
    upper-cased) and its named terminals, less those of names, numbers and strings."""
    quoted = {word.upper() for word in re.findall(r'"([^\W\d]\w*)"', grammar)}
    named = set(re.findall(r"^([A-Z][A-Z_]*)(?:\.\d+)?\s*:", grammar, re.MULTILINE))
    return (quoted | named) - {"NAME", "NUMBER", "STRING", "COMMENT"}


_SOURCE: ContextVar[str | None] = ContextVar("energydsl_source", default=None)  # the text `parse_text` parses
_WORD = re.compile(r"\w")


class _GluedKeyword(Exception):
    """A keyword the lexer read off the front of a longer word; raised through lark, reported by `parse_text`."""

    def __init__(self, token: lark.Token) -> None:
        super().__init__(token.value)
        self.token = token


def _stands_alone(token: lark.Token) -> lark.Token:
    """A keyword ends where its word does. Where the grammar takes no name, the lexer has only keywords to match
    (lark's contextual lexer) and read `repeats layers` as `repeat s layers`, `statez[d]` as `state z[d]`."""
    text, end = _SOURCE.get(), token.end_pos
    if text is not None and end is not None and end < len(text) and _WORD.match(text[end]) \
            and _WORD.match(token.value[-1:]):
        raise _GluedKeyword(token)
    return token


def without_comments(text: str) -> str:
    """`text` with the grammar's comments blanked; a `#` inside one of its strings stays."""
    grammar = _parser()
    string, comment = (grammar.get_terminal(t).pattern.to_regexp() for t in ("STRING", "COMMENT"))
    return re.sub(f"({string})|{comment}", lambda m: m.group(1) or " ", text)


def tokens(text: str) -> str:
    """`text` as its tokens one space apart: spacing and comments gone (`beta=0.5` is `beta = 0.5`); text the
    lexer cannot read keeps its words, one space apart."""
    try:
        return " ".join(t.value for t in _parser().lex(text))
    except lark.exceptions.LarkError:
        return " ".join(without_comments(text).split())


def same_source(a: str, b: str) -> bool:
    """Whether two spec texts say the same thing: the same tokens (comments and spacing aside)."""
    return tokens(a) == tokens(b)


def _check_depth(tree: lark.Tree, text: str, file: str) -> None:
    """Refuse a parse tree deeper than MAX_TREE_DEPTH (`----...x`, a sum of a thousand terms) before
    anything recursive walks it: the bracket count in `_check_text` doesn't see operator chains."""
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_TREE_DEPTH:
            line, col = getattr(node.meta, "line", 1), getattr(node.meta, "column", 1)
            raise SpecError(f"expression nested too deeply: more than {MAX_TREE_DEPTH} levels of operators, counting "
                            "a chain too (each `+` of a long sum nests in the next, as each `-` of `---x` does)",
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
    reading = _SOURCE.set(text)
    try:
        tree = _parser().parse(text)
    except _GluedKeyword as e:
        _SOURCE.set(None)  # the error path parses parts of the text again: as they are, no check
        from .syntax_errors import glued_keyword

        raise glued_keyword(e.token, text, file) from None
    except lark.exceptions.UnexpectedInput as e:
        _SOURCE.set(None)
        from .syntax_errors import syntax_error  # the error path only: it reads the grammar's terminals

        raise syntax_error(e, text, file) from None
    except RecursionError:
        raise SpecError("expression too deeply nested", Span(file, 1, 1, text)) from None
    finally:
        _SOURCE.reset(reading)
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
        if path.exists() and not path.is_dir() and not path.is_file():  # /dev/zero never ends, a pipe may block
            raise SpecError(f"{path} is not a regular file (a device, pipe or socket), not a .energy file", span)
        with path.open("rb") as f:
            data = f.read(MAX_SOURCE_BYTES + 1)  # more is refused where the text is parsed
    except FileNotFoundError:
        raise SpecError(f"no such file: {path}", span) from None
    except IsADirectoryError:
        raise SpecError(f"{path} is a directory, not a .energy file", span) from None
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:  # as the CLI says it of any path
            raise SpecError(f"a path is too long: {path} ({e.strerror})", span, hint=PATH_LIMITS) from None
        raise SpecError(f"cannot read {path}: {e.strerror}", span) from None
    if len(data) > MAX_SOURCE_BYTES:
        raise SpecError(f"{path} is larger than {MAX_SOURCE_BYTES // (1024 * 1024)} MiB: not a spec", span)
    data = data.removeprefix(codecs.BOM_UTF8)  # a byte-order mark (some Windows editors write one) is dropped
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:  # located as the parser would locate it: the text before the bad byte is UTF-8
        text = _lines(data.decode("utf-8", "replace"))
        line, col = _position(text, len(_lines(data[: e.start].decode("utf-8"))))
        imported = f"; it is imported at {span}" if span else ""
        where = Span(name or str(path), line, col, text)
        if e.reason == "unexpected end of data":  # the file stops inside a character: cut short, not misencoded
            message = "the file ends inside a character: its last bytes begin a UTF-8 character that does not end"
            hint = f"was it copied or saved whole?{imported}"
            raise SpecError(f"{message}, as in a file cut short", where, hint) from None
        raise SpecError(f"this is not UTF-8 text: byte 0x{data[e.start]:02X} cannot start or continue a character "
                        "here", where, "a .energy spec is UTF-8 text: save it as "
                        f"UTF-8 (a Latin-1 `é` is the single byte 0xE9){imported}") from None


_DECLARATION_START = re.compile(r"\s*(energy|block|model|search)\s")  # spec text, when no such file exists


def parse_module(source: str | Path, *, name: str | None = None, base: Path | None = None) -> Module:
    """Parse a file (or text) and everything it imports into one `Module`.

    `source` is a path when it is one line without a `{` (an energy, model or search declaration has one; a
    mistyped path then reads "no such file", not a syntax error in its text) and not an `import` line, the line's
    surrounding whitespace dropped (a path read from a file keeps its newline). A line that names no file and
    begins with a declaration's keyword (`energy X(`, cut short) is text too, so its syntax error is shown.
    Otherwise it is spec text, whose imports resolve against `base` (default: the working directory).
    """
    if not isinstance(source, str | Path):
        raise TypeError(f"expected a path or spec text (str or pathlib.Path), got {type(source).__name__}")
    if isinstance(source, str) and not source.strip():
        raise UserError("empty spec: give a path to a .energy file or spec text")
    if isinstance(source, str) and "\n" not in source.strip() and "{" not in source \
            and not source.lstrip().startswith("import "):
        path = Path(source.strip())
        if path.expanduser().exists() or not _DECLARATION_START.match(source):
            source = path
    if isinstance(source, Path):
        path = source.expanduser()
        text = _read(path, None)
        module = Module(str(path), text=text, base=str(path.parent), files=[str(path.resolve())])
        _load(text, str(path), path.parent, module, stack=[str(path.resolve())], seen=set(), top=True)
    else:
        module = Module(name or "<string>", text=str(source), base=str(base or Path.cwd()))
        _load(str(source), name or "<string>", base or Path.cwd(), module, stack=[], seen=set(), top=True)
    return module


def shown_path(base: Path, rel: str) -> str:
    """How messages name `rel` read from `base`: `examples/models/gpt.energy`, not `bad/../examples/...`, unless
    a linked folder before a `..` makes the shorter path another file."""
    shown = os.path.normpath(base / rel)
    return shown if Path(shown).resolve() == (base / rel).resolve() else str(base / rel)


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
            module.files.append(str(target))
            shown = shown_path(base, rel)
            sub = _read(target, span, shown)
            _load(sub, shown, target.parent, module, stack + [str(target)], seen, top=False)
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

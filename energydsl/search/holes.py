"""Holes in a search space's source: where they stand in the files, what they may take, and the text of a
candidate with them filled (the machinery behind `energydsl.search.dsl`, which imports what it needs).

A hole keeps the source span it replaces, so a filled candidate is the original text with each hole's
span swapped for the sampled value's text: comments, layout and every other position stay as written.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import lark

from energydsl import syntax
from energydsl.errors import Span, SpecError
from energydsl.number_text import plain_number

INT_SETTINGS = {"steps", "batch_size", "block_size", "warmup_steps", "eval_interval", "eval_iters", "seed", "trials"}
STR_SETTINGS = {"data", "dtype"}
DEFAULT_OPTIMIZER = "gd(eta = 1)"  # what `none` means in an optimizer choice (the language's default)
_EXPR_ATOMS = {"number", "name", "call", "reduce", "index", "integral", "choice_hole", "int_hole", "float_hole"}
# names that land parenthesised all the same: beside the text around them they lex as another token (`a^T` is a
# transpose, `max[i]` a reduction), where `a^(T)` and `(max)[i]` are what the option means
_NAMES_LEXED_OTHERWISE = {"T", "sum", "logsumexp", "mean", "prod", "max", "softmax"}


# ----------------------------------------------------------------------------- source files and positions


@dataclass
class _File:
    path: str
    text: str
    tree: lark.Tree
    _lines: list[int] = field(default_factory=list, repr=False)

    def span(self, node: Any) -> Span:
        return self.span_at(*_pos(node))

    def span_at(self, start: int, end: int) -> Span:
        if not self._lines:
            self._lines = [0] + [i + 1 for i, ch in enumerate(self.text) if ch == "\n"]
        line = bisect.bisect_right(self._lines, start)
        col = start - self._lines[line - 1] + 1
        end_line = bisect.bisect_right(self._lines, max(start, end - 1))
        end_col = end - self._lines[line - 1] + 1 if end_line == line else None
        return Span(self.path, line, col, self.text, end_col)

    def slice(self, node: Any) -> str:
        s, e = _pos(node)
        return self.text[s:e]


def _pos(node: Any) -> tuple[int, int]:
    if isinstance(node, lark.Token):
        return int(node.start_pos), int(node.end_pos)
    return int(node.meta.start_pos), int(node.meta.end_pos)


def _kids(node: lark.Tree) -> list[Any]:
    return [c for c in node.children if c is not None]


def _norm(text: str) -> str:
    return " ".join(text.split())


def _same_text(a: Any, b: Any) -> bool:
    """Two options' labels, equal but for white space (`a+b` and `a + b`)."""
    return a == b or isinstance(a, str) and isinstance(b, str) and "".join(a.split()) == "".join(b.split())


def _same_call(a: lark.Tree, b: lark.Tree, f: _File) -> bool:
    """Two calls in a clause choice with the same name and the same keywords, in any order and spacing."""
    def key(call: lark.Tree) -> tuple[str, frozenset]:
        return str(call.children[0]), frozenset("".join(f.slice(kw).split()) for kw in _kids(call)[1:])
    return key(a) == key(b)


def _read_files(path: Path) -> list[_File]:
    """The file and everything it imports (depth first, each once): text and parse tree."""
    syntax.parse_module(path)  # the language's own checks first: syntax, duplicates, import cycles
    files: list[_File] = []
    seen: set[Path] = set()

    def visit(p: Path, shown: str) -> None:
        real = p.resolve()
        if real in seen:
            return
        seen.add(real)
        text = syntax._read(p, None)  # as the parser reads it (a byte-order mark dropped)
        f = _File(shown, text, syntax._parser().parse(text))
        files.append(f)
        for item in _kids(f.tree):
            if item.data == "import_decl":
                rel = str(item.children[0])[1:-1]
                visit(p.parent / rel, syntax.shown_path(Path(shown).parent, rel))

    visit(path, str(path))
    return files


# ----------------------------------------------------------------------------- holes


@dataclass
class _Option:
    label: Any  # the Optuna categorical value: a number, an optimizer name or the option's text
    start: int
    end: int
    holes: list[_Hole]
    none: bool = False
    wrap: bool = False  # an expression that needs parentheses where it is substituted


@dataclass
class _Hole:
    name: str
    kind: str  # int | float | choice | clause
    file: _File
    start: int
    end: int
    span: Span
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    options: list[_Option] = field(default_factory=list)
    outer: tuple[int, int] | None = None  # clause holes: the clause `none` removes
    none_text: str | None = None  # clause holes: what `none` stands for (None: remove `outer`)

    @property
    def place(self) -> tuple[int, int]:
        return self.outer or (self.start, self.end)

    def describe(self) -> str:
        if self.kind == "int":
            return f"int {plain_number(self.low)}..{plain_number(self.high)}"
        if self.kind == "float":
            return f"float {plain_number(self.low)}..{plain_number(self.high)}" + (" log" if self.log else "")
        return "choice{" + ", ".join(str(o.label) for o in self.options) + "}"

    def walk(self) -> list[_Hole]:
        out = [self]
        for o in self.options:
            for h in o.holes:
                out += h.walk()
        return out


def _bound(node: lark.Tree, exact: bool = False) -> Any:
    """A hole's end (grammar rule `bound`): a number with an optional minus sign; `exact`: as a Fraction."""
    sign, number = node.children
    value = Fraction(str(number)) if exact else float(number)
    return -value if sign is not None else value


def _fmt_float(v: float, low: float | None = None, high: float | None = None) -> str:
    """`v` with six significant digits, or as many more as keep it inside [low, high] when given: rounded to six, a
    momentum sampled at 0.9999996 in `float 0.9..0.9999999` trained as 1, a value the hole does not hold."""
    for digits in range(6, 18):
        text = f"{v:.{digits}g}"
        if low is None or low <= float(text) <= high:
            break
    return text if re.fullmatch(r"-?\d+(\.\d+)?([eE][+-]?\d+)?", text) else repr(float(v))


def _signed(text: str) -> str:
    """A hole is an atom: a negative value lands parenthesised (`(-0.5) ^ 2`, not `-0.5 ^ 2`)."""
    return f"({text})" if text.startswith("-") else text


class _Collector:
    """Finds the holes under a parse-tree node and names them from where they stand."""

    def __init__(self, file: _File):
        self.file = file

    def holes(self, node: Any, name: str) -> list[_Hole]:
        if node is None or isinstance(node, lark.Token):
            return []
        if node.data in ("choice_hole", "int_hole", "float_hole"):
            return [self.expr_hole(node, name)]
        if node.data == "opt_hole":
            return [self.clause_hole(node, name, None, None)]
        if node.data == "opt_call":
            return self.call_holes(node, name)
        out: list[_Hole] = []
        for c in _kids(node):
            out += self.holes(c, name)
        return out

    def call_holes(self, call: lark.Tree, name: str) -> list[_Hole]:
        out: list[_Hole] = []
        for kw in _kids(call)[1:]:
            out += self.holes(kw.children[1], f"{name}.{kw.children[0]}")
        return out

    def expr_hole(self, node: lark.Tree, name: str) -> _Hole:
        f = self.file
        s, e = _pos(node)
        span = f.span(node)
        if node.data == "int_hole":
            exact = [_bound(b, exact=True) for b in node.children[:2]]  # 2^53 + 1 read as a float is 2^53
            lo, hi = (float(b) for b in exact)
            if not all(b.denominator == 1 for b in exact) or lo > hi:
                raise SpecError(f"`{f.slice(node)}`: need whole numbers, low <= high", span)
            if max(abs(b) for b in exact) > 2**53:  # past it a float bound is no exact whole number: every trial failed
                raise SpecError(f"`{f.slice(node)}`: a bound is larger than 2^53 (9,007,199,254,740,992), past which "
                                "it is not an exact whole number", span, "give bounds of a size a trial can take")
            return _Hole(name, "int", f, s, e, span, lo, hi)
        if node.data == "float_hole":
            lo, hi, log = _bound(node.children[0]), _bound(node.children[1]), node.children[2] is not None
            if lo > hi or (log and lo <= 0):
                raise SpecError(f"`{f.slice(node)}`: need low <= high" + (" and low > 0 for `log`" if log else ""),
                                span)
            return _Hole(name, "float", f, s, e, span, lo, hi, log)
        options: list[_Option] = []
        for i, opt in enumerate(_kids(node), start=1):
            os_, oe = _pos(opt)
            label: Any = _number_label(opt)
            if label is None:
                label = _norm(f.slice(opt))
            if any(_same_text(o.label, label) for o in options):
                raise SpecError(f"`{label}` is listed twice in this choice", span)
            wrap = opt.data not in _EXPR_ATOMS or opt.data == "name" and f.slice(opt) in _NAMES_LEXED_OTHERWISE
            options.append(_Option(label, os_, oe, self.holes(opt, f"{name}.{i}"), wrap=wrap))
        return _Hole(name, "choice", f, s, e, span, options=options)

    def clause_hole(self, node: lark.Tree, name: str, outer: tuple[int, int] | None,
                    none_text: str | None) -> _Hole:
        f = self.file
        calls = _kids(node)
        names = [str(c.children[0]) for c in calls]
        unique = len(set(names)) == len(names)
        options = []
        for i, c in enumerate(calls):
            label = names[i] if unique else _norm(f.slice(c))
            if any(_same_call(calls[n], c, f) for n in range(i)):
                raise SpecError(f"`{label}` is listed twice in this choice", f.span(c))
            none = names[i] == "none"
            if none and len(c.children) > 1 and c.children[1] is not None:
                raise SpecError("`none` takes no arguments", f.span(c))
            s, e = _pos(c)
            options.append(_Option(label, s, e, self.call_holes(c, f"{name}.{label if unique else i + 1}"),
                                   none=none))
        s, e = _pos(node)
        return _Hole(name, "clause", f, s, e, f.span(node), options=options, outer=outer, none_text=none_text)

    # -- declarations --------------------------------------------------------------------------------

    def optimizer_clause(self, node: lark.Tree, energy: str) -> list[_Hole]:
        call, *mods = _kids(node)
        out = self.optimizer_call(call, energy)
        for m in mods:
            out += self.modifier(m, energy)
        return out

    def optimizer_call(self, call: lark.Tree, energy: str) -> list[_Hole]:
        if call.data == "opt_hole":
            return [self.clause_hole(call, f"{energy}.optimizer", None, DEFAULT_OPTIMIZER)]
        return self.call_holes(call, f"{energy}.optimizer")

    def modifier(self, m: lark.Tree, energy: str) -> list[_Hole]:
        if m.data != "precondition":
            return self.holes(m, f"{energy}.{m.data}")
        p = m.children[0]
        if p.data == "opt_hole":
            return [self.clause_hole(p, f"{energy}.precondition", _pos(m), None)]
        return self.call_holes(p, f"{energy}.precondition")

    def decl(self, node: lark.Tree) -> list[_Hole]:
        name = str(node.children[0])
        out: list[_Hole] = []
        if node.data == "block_decl":
            return self.pipeline(node.children[1], name)
        for c in _kids(node)[1:]:
            if c.data == "header":
                for item in _kids(c):
                    out += self.holes(item.children[1], f"{name}.{item.children[0]}")
            elif c.data == "optimizer_clause":
                out += self.optimizer_clause(c, name)
            elif c.data == "across":
                v = c.children[0]
                if v.data == "opt_hole":
                    out.append(self.clause_hole(v, f"{name}.across", _pos(c), None))
                else:
                    out += self.call_holes(v, f"{name}.across")
            elif c.data == "layer":
                out += self.pipeline(c.children[0], f"{name}.layer")
            else:
                first = c.children[0] if c.children else None
                label = str(first) if isinstance(first, lark.Token) and first.type == "NAME" else (
                    c.data.removesuffix("_clause"))
                out += self.holes(c, f"{name}.{label}")
        return out

    def pipeline(self, node: lark.Tree, name: str) -> list[_Hole]:
        out: list[_Hole] = []
        for summed in _kids(node):
            for ref in _kids(summed):
                out += self.stage_args(ref, f"{name}.{ref.children[0]}")
        return out

    def stage_args(self, ref: lark.Tree, name: str) -> list[_Hole]:
        out: list[_Hole] = []
        for i, arg in enumerate(_kids(ref)[1:], start=1):
            if arg.data == "named_arg":
                out += self.holes(arg.children[1], f"{name}.{arg.children[0]}")
            else:
                out += self.holes(arg.children[0], f"{name}.{i}")
        return out


# ----------------------------------------------------------------------------- filling holes


class _AnyValues:
    """A stand-in Optuna trial that takes each hole's low bound or first option: a candidate for checks whose
    outcome is the same in every candidate."""

    def suggest_int(self, name: str, low: int, high: int, **kw: Any) -> int:
        return low

    def suggest_float(self, name: str, low: float, high: float, **kw: Any) -> float:
        return low

    def suggest_categorical(self, name: str, choices: list[Any]) -> Any:
        return choices[0]


class _Filler:
    """Samples holes (trial.suggest_*) as they are met and renders their text."""

    def __init__(self, trial: Any):
        self.trial = trial
        self.params: dict[str, Any] = {}

    def value(self, h: _Hole) -> str:
        t = self.trial
        if h.kind == "int":
            v = t.suggest_int(h.name, int(h.low), int(h.high))
            self.params[h.name] = v
            return _signed(str(int(v)))
        if h.kind == "float":
            v = t.suggest_float(h.name, h.low, h.high, log=h.log)
            self.params[h.name] = v
            return _signed(_fmt_float(float(v), h.low, h.high))
        label = t.suggest_categorical(h.name, [o.label for o in h.options])
        self.params[h.name] = label
        opt = next(o for o in h.options if o.label == label and isinstance(o.label, str) == isinstance(label, str))
        if opt.none:
            if h.none_text is None:
                return ""  # with `outer`: the whole clause goes
            text = h.none_text
        else:
            text = _render(h.file, opt.start, opt.end, opt.holes, self)
            if opt.wrap:
                text = f"({text})"
        if h.outer is not None:  # `across layers <choice>`, `, precondition <choice>`: the clause around it
            s, e = h.outer
            text = h.file.text[s : h.start] + text + h.file.text[h.end : e]
        return text


def _number_label(opt: lark.Tree) -> int | float | None:
    """A choice's option that is a number, `2`, `0.5` or `-1`, as that number (a whole one as an int): recorded
    as numbers alike (`-1` was the text '-1' beside the int 2); None for any other option."""
    sign = 1
    if opt.data == "neg" and isinstance(opt.children[0], lark.Tree):
        sign, opt = -1, opt.children[0]
    if opt.data != "number":
        return None
    text = str(opt.children[0])
    value = sign * float(text)
    return int(value) if value.is_integer() and "." not in text else value


def _render(file: _File, start: int, end: int, holes: list[_Hole], filler: _Filler) -> str:
    out, pos = [], start
    for h in sorted(holes, key=lambda h: h.place):
        s, e = h.place
        if s < start or e > end:
            continue
        out.append(file.text[pos:s])
        out.append(filler.value(h))
        pos = e
    out.append(file.text[pos:end])
    return "".join(out)


@dataclass
class _Placement:
    """Text that replaces file[start:end] in a candidate: a hole, a search-level override, a deletion."""

    file: _File
    start: int
    end: int
    holes: list[_Hole]  # the holes it may sample (top level)
    render: Callable[[_Filler], str]
    origin: str = "hole"  # hole | search | delete


@dataclass
class _Value:
    """A setting or override written in the search: source text with holes, or a fixed value."""

    file: _File | None = None
    start: int = 0
    end: int = 0
    holes: list[_Hole] = field(default_factory=list)
    fixed: Any = None
    span: Span | None = None  # where a fixed value is written in the search (None: from --set)
    given: str | None = None  # how the user gave it when not in the search, e.g. `--set steps=2`

    def text(self, filler: _Filler) -> str:
        if self.file is None:
            return str(self.fixed)
        return _render(self.file, self.start, self.end, self.holes, filler)


def _value(col: _Collector, node: Any, name: str) -> _Value:
    s, e = _pos(node)
    return _Value(col.file, s, e, col.holes(node, name))


def _setting(col: _Collector, node: Any, key: str, name: str) -> _Value:
    """A training setting: fixed (and checked now) unless it holds holes."""
    v = _value(col, node, name)
    if v.holes:
        return v
    span = col.file.span(node)
    return _Value(fixed=_convert(key, col.file.slice(node), span), span=span)


def _convert(key: str, text: str, where: Span | None) -> Any:
    text = text.strip()
    if key in STR_SETTINGS:
        return text
    try:
        v = float(text)
    except ValueError:
        raise SpecError(f"`{key}` must be a number, got `{text}`", where) from None
    if key in INT_SETTINGS:
        if not v.is_integer():
            raise SpecError(f"`{key}` must be a whole number, got `{text}`", where)
        return int(v)
    return v

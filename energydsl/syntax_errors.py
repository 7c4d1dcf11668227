"""How a syntax error reads: what could come next, in the user's words, derived from the grammar.

`syntax.parse_text` hands lark's `UnexpectedInput` to `syntax_error`, which turns it into a located
`SpecError` with a hint: the expected terminals as they are written (or "an expression", "a clause"),
which bracket is still open, an unknown reducer with a did-you-mean, a keyword read as a name because
the line before is unfinished.
"""

from __future__ import annotations

import difflib
import functools
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

import lark

from .errors import Span, SpecError
from .syntax import _parser
from .syntax_tree import EXPECT_NAMES

# ----------------------------------------------------------------------------- syntax errors
#
# Everything a syntax error says about what could come next is derived from the grammar: how each
# terminal is written (its literal, or the finite set of words its regex matches), which terminals
# start an expression or a clause (FIRST sets of the rules), which are binary operators. Only the
# terminals that stand for open-ended text (names, numbers, paths) and the labels of a few rules
# are written here.

_DESCRIBED = {"NAME": "a name", "NUMBER": "a number", "STRING": 'a quoted path such as "lib.energy"',
              "$END": "end of file"}
_GROUPS = (("expr", "an expression"), ("clause", "a clause"), ("model_clause", "a model clause"),
           ("search_clause", "a search clause"))  # rule, what a user calls the things that start it
MAX_EXPECTED = 8  # alternatives listed in a hint before "…"
_CLOSERS = {"(": ")", "[": "]", "{": "}"}


@dataclass(frozen=True)
class _Vocabulary:
    spellings: dict[str, tuple[str, ...]]  # terminal -> how it is written, when that is a fixed set of texts
    first: dict[str, tuple[str, ...]]  # rule -> the terminals that can start it, in grammar order
    operators: frozenset[str]  # terminals written between two expressions (`+`, `@`, `^`, ...)


def _regex_words(pattern: str, limit: int = 16) -> list[str] | None:
    """Every text a regex matches when that is a small finite set (lookarounds ignored), else None."""
    try:
        from re import _parser as sre  # Python >= 3.11
    except ImportError:  # pragma: no cover
        import sre_parse as sre  # type: ignore[no-redef]
    try:
        parsed = sre.parse(pattern)
    except Exception:
        return None

    def words(items: Any) -> list[str] | None:
        out = [""]
        for op, av in items:
            kind = str(op)
            if kind in ("ASSERT", "ASSERT_NOT", "AT"):
                continue
            if kind == "LITERAL":
                alts: list[str] | None = [chr(av)]
            elif kind == "SUBPATTERN":
                alts = words(av[-1])
            elif kind == "BRANCH":
                branches = [words(b) for b in av[1]]
                alts = None if any(b is None for b in branches) else [w for b in branches for w in b]  # type: ignore[union-attr]
            elif kind == "IN" and all(str(o) == "LITERAL" for o, _ in av):
                alts = [chr(v) for _, v in av]
            else:
                return None
            if alts is None:
                return None
            out = [a + b for a in out for b in alts]
            if len(out) > limit:
                return None
        return out

    return words(parsed)


@functools.lru_cache(maxsize=1)
def _vocabulary() -> _Vocabulary:
    parser = _parser()
    spellings: dict[str, tuple[str, ...]] = {}
    for term in parser.terminals:
        if isinstance(term.pattern, lark.lexer.PatternStr):
            spellings[term.name] = (term.pattern.value,)
        elif (found := _regex_words(term.pattern.value)) and all(found):
            spellings[term.name] = tuple(dict.fromkeys(found))
    # FIRST sets (dicts as ordered sets, so that examples come out in grammar order)
    nullable: set[str] = set()
    first: dict[str, dict[str, None]] = {}
    changed = True
    while changed:
        changed = False
        for rule in parser.rules:
            origin = rule.origin.name
            into = first.setdefault(origin, {})
            before = len(into)
            for sym in rule.expansion:
                if sym.is_term:
                    into.setdefault(sym.name, None)
                    break
                into.update(first.get(sym.name, {}))
                if sym.name not in nullable:
                    break
            else:
                if origin not in nullable:
                    nullable.add(origin)
                    changed = True
            changed = changed or len(into) != before
    operators = frozenset(
        r.expansion[1].name for r in parser.rules
        if r.alias and len(r.expansion) == 3 and r.expansion[1].is_term
        and not r.expansion[0].is_term and not r.expansion[2].is_term
    )
    return _Vocabulary(spellings, {k: tuple(v) for k, v in first.items()}, operators)


def _terminal_words(name: str) -> list[str] | None:
    """How a terminal reads in a message (`tied`, `untied`; a name), or None when the grammar doesn't say."""
    if name in _DESCRIBED:
        return [_DESCRIBED[name]]
    spelled = _vocabulary().spellings.get(name)
    return [f"`{w}`" for w in sorted(spelled)] if spelled else None


def _describe_expected(expected: set[str]) -> str:
    """What could come next, in the user's words: `an expression, `)` or `,``, at most MAX_EXPECTED of them."""
    vocab = _vocabulary()
    expected = set(expected)
    labels: list[tuple[int, str]] = []
    covered: set[str] = set()
    for rule, label in _GROUPS:
        starts = vocab.first.get(rule)
        if starts and set(starts) <= expected:
            if rule == "expr":
                labels.append((0, label))
            else:
                examples = ", ".join(f"`{w}`" for t in starts[:3] for w in (vocab.spellings.get(t) or ())[:1])
                labels.append((3, f"{label} ({examples}, …)"))
            covered |= set(starts)
    if vocab.operators and vocab.operators <= expected:
        labels.append((0, "an operator"))
        covered |= vocab.operators
    for name in sorted(expected - covered):
        for word in _terminal_words(name) or [f"a {name.lower().strip('_').replace('_', ' ')}"]:
            if name == "$END":
                rank = 4
            elif not word.startswith("`"):
                rank = 0
            elif word.strip("`")[:1].isalpha():
                rank = 2  # keywords
            else:
                rank = 1  # symbols
            labels.append((rank, word))
    ordered = sorted(set(labels), key=lambda rw: (rw[0], rw[1].strip("`")))
    words = [w for rank, w in ordered if rank < 3]
    tail = [w for rank, w in ordered if rank >= 3]  # clause kinds and end of file: always said
    if len(words) + len(tail) > MAX_EXPECTED:
        words = words[: max(1, MAX_EXPECTED - len(tail))] + ["…"]
    words += tail
    if len(words) == 1 or words[-1] == "…":
        return ", ".join(words)
    return ", ".join(words[:-1]) + " or " + words[-1]


def _expected_terminals(e: lark.exceptions.UnexpectedInput) -> set[str]:
    """The terminals the parser would accept at the error: exact (lark's own list is a merged LALR state's)."""
    ip = getattr(e, "interactive_parser", None)
    if ip is not None:
        try:
            return set(ip.accepts())
        except Exception:  # noqa: BLE001 - fall back on lark's coarser list
            pass
    return set(getattr(e, "expected", None) or getattr(e, "allowed", None) or ())


def _open_brackets(text: str, upto: int) -> list[tuple[str, int, int, int]]:
    """The brackets still open at offset `upto`, innermost last: (bracket, line, column, offset).

    Comments and strings are skipped; a closer that matches nothing open is ignored."""
    stack: list[tuple[str, int, int, int]] = []
    line, line_start, i = 1, 0, 0
    while i < upto:
        ch = text[i]
        if ch == "\n":
            line, line_start = line + 1, i + 1
        elif ch == "#" or ch == '"':
            stop = text.find("\n" if ch == "#" else '"', i + 1)
            nl = text.find("\n", i + 1)
            if ch == '"' and (stop < 0 or (0 <= nl < stop)):
                stop = nl  # an unterminated string ends at the line's end
            if stop < 0:
                break
            i = stop if text[stop] == "\n" else stop + 1
            continue
        elif ch in _CLOSERS:
            stack.append((ch, line, i - line_start + 1, i))
        elif ch in ")]}" and stack and _CLOSERS[stack[-1][0]] == ch:
            stack.pop()
        i += 1
    return stack


def _opener_hint(text: str, opener: tuple[str, int, int, int]) -> str:
    ch, line, col, pos = opener
    decl = None
    if ch == "{":  # name the declaration it opens: `energy MHA`
        vocab = _vocabulary()
        keywords = "|".join(w for t in vocab.first.get("item", ()) for w in vocab.spellings.get(t, ()) if w.isalpha())
        found = list(re.finditer(rf"\b({keywords})\s+([^\W\d]\w*)", text[text.rfind("\n", 0, pos) + 1 : pos]))
        decl = f"`{found[-1].group(1)} {found[-1].group(2)}`" if found and keywords else None
    where = f"of {decl} (line {line})" if decl else f"at line {line}, column {col}"
    return f"the `{ch}` {where} is never closed: add `{_CLOSERS[ch]}`"


def _describe_char(ch: str) -> str:
    if ch.isprintable() and not ch.isspace():
        return f"`{ch}`"
    return f"U+{ord(ch):04X} ({unicodedata.name(ch, 'a control character').lower()})"


_REDUCER_ALIASES = {"lse": "logsumexp", "avg": "mean", "average": "mean", "product": "prod", "amax": "max"}


def _unknown_reducer(e: lark.exceptions.UnexpectedToken, text: str, file: str, expected: set[str]) -> SpecError | None:
    """`logsumexpp[j](x)`: a name with indices then `(` after a complete expression reads as a mistyped reducer."""
    tok = e.token
    if tok.type != "LPAR" or tok.start_pos is None or not (expected & _vocabulary().operators):
        return None
    line_start = text.rfind("\n", 0, tok.start_pos) + 1
    m = re.search(r"(?<!\w)([^\W\d]\w*)\s*\[[^\[\]]*\]\s*\Z", text[line_start : tok.start_pos])
    if not m:
        return None
    name = m.group(1)
    col = m.start(1) + 1
    span = Span(file, tok.line, col, text, col + len(name))
    reducers = _vocabulary().spellings.get("REDUCER", ())
    listed = ", ".join(f"`{r}`" for r in reducers)
    close = [_REDUCER_ALIASES[name]] if name in _REDUCER_ALIASES else difflib.get_close_matches(name, reducers, n=1,
                                                                                               cutoff=0.6)
    if close:
        hint = f"did you mean `{close[0]}`? The reducers are {listed}."
    else:
        hint = (f"only a reducer takes `[indices](...)`: {listed}; to multiply, write "
                f"`{name}[...] * (...)`")
    return SpecError(f"no reducer named `{name}`", span, hint)


def _unfinished_clause(tok: lark.Token, text: str, file: str) -> SpecError | None:
    """`global F = z .` with `optimizer gd(...)` on the next line: the unfinished expression took the
    keyword for a name, and the parser stumbles on the word after it. Say what the line before lacks."""
    before = text[: tok.start_pos]
    m = re.search(r"(?<!\w)([^\W\d]\w*)\s*\Z", before)
    if not m or before[before.rfind("\n", 0, m.start(1)) + 1 : m.start(1)].strip():
        return None  # no word just before the token, or not the first on its line
    vocab = _vocabulary()
    starters = {t for rule in ("item", "clause", "model_clause", "search_clause") for t in vocab.first.get(rule, ())}
    kinds = {t for t in starters if m.group(1) in vocab.spellings.get(t, ())}
    if not kinds:
        return None
    try:
        _parser().parse(text[: m.start(1)])
        return None
    except lark.exceptions.UnexpectedToken as e:
        if e.token.type != "$END":
            return None
        expected = _expected_terminals(e)
        if not expected or kinds & expected:
            return None  # the keyword could start here: the mistake is elsewhere
        last_line = getattr(e.token, "end_line", None) or e.token.line
    except lark.exceptions.UnexpectedInput:
        return None
    line = text.count("\n", 0, m.start(1)) + 1
    col = m.start(1) - (text.rfind("\n", 0, m.start(1)) + 1) + 1
    return SpecError(f"unexpected `{m.group(1)}`", Span(file, line, col, text, col + len(m.group(1))),
                     f"line {last_line} is unfinished: expected {_describe_expected(expected)} there")


def glued_keyword(keyword: lark.Token, text: str, file: str) -> SpecError:
    """A keyword the lexer read off the front of a longer word (`repeats`, `statez`), which is no keyword and
    stood where no name may: an unfinished line before it if that is the mistake, else the word and its parts."""
    word = re.match(r"\w+", text[keyword.start_pos:]).group(0)  # type: ignore[arg-type, union-attr]
    as_name = lark.Token("NAME", word, keyword.start_pos, keyword.line, keyword.column)
    unfinished = _unfinished_clause(as_name, text, file)
    if unfinished is not None:
        return unfinished
    rest = word[len(keyword):]
    return SpecError(f"unknown word `{word}`", Span(file, keyword.line, keyword.column, text,
                                                   keyword.column + len(word)),
                     f"did you mean `{keyword}` alone, or `{keyword} {rest}` as two words?")


def _call_hint(before: str, tok: lark.Token) -> str | None:
    """Slips in an optimizer clause or a header that the grammar's "expected ..." explains badly: the optimizer
    left out (`optimizer precondition diag`), an option by position (`dplr(2)`), a comma with nothing after it."""
    from .clause_calls import OPTIMIZER, PRECONDITIONER

    modifier = re.search(r"\boptimizer\s+(precondition|per|steps|wrt)\s*\Z", before)
    if modifier:
        return (f"`optimizer` names its optimizer first ({', '.join(OPTIMIZER.takes)}): "
                f"`optimizer gd(eta = 1), {modifier[1]} …`")
    call = re.search(r"(?<!\w)(\w+)\s*\(\s*(?:\w+\s*=\s*[^,()]*,\s*)*\Z", before)
    takes = (OPTIMIZER.takes.get(call[1]) or PRECONDITIONER.takes.get(call[1])) if call else None
    if tok.type == "NUMBER" and call and takes:
        given = re.findall(r"(\w+)\s*=", before[call.end(1):])
        free = [k for k in takes if k not in given]
        example = f": `{free[0]} = {tok}`" if free else ""
        return f"`{call[1]}` takes its options by name ({', '.join(takes)}){example}"
    if str(tok) in (")", "]") and re.search(r",\s*\Z", before):
        return f"nothing follows the comma before this `{tok}`: remove the comma"
    return None


def syntax_error(e: lark.exceptions.UnexpectedInput, text: str, file: str) -> SpecError:
    """A lark parse error as the user should read it."""
    expected = _expected_terminals(e)
    if isinstance(e, lark.exceptions.UnexpectedCharacters):
        ch = text[e.pos_in_stream]
        kind = unicodedata.category(ch)
        if kind in ("Zs", "Cf", "Cc"):  # a space that isn't one, or an invisible character
            hint = "replace it with a plain space" if kind == "Zs" else "delete it (it is invisible)"
        else:
            hint = f"expected {_describe_expected(expected)}" if expected else None
        return SpecError(f"unexpected character {_describe_char(ch)}", Span(file, e.line, e.column, text), hint)
    if isinstance(e, lark.exceptions.UnexpectedToken) and e.token.type != "$END":
        tok = e.token
        better = _unknown_reducer(e, text, file, expected) or _unfinished_clause(tok, text, file)
        if better is not None:
            return better
        line = tok.line if tok.line is not None else text.count("\n") + 1
        col = tok.column if tok.column is not None else 1
        hint = f"expected {_describe_expected(expected)}"
        words = {w for t in expected for w in _vocabulary().spellings.get(t, ()) if w.isalpha()}
        close = difflib.get_close_matches(str(tok), words, n=1, cutoff=0.65) if tok.type == "NAME" else []
        if close:  # a misspelt keyword: `globl`, `setps`, `precondtion`
            hint = f"did you mean `{close[0]}`? ({hint})"
        before = text.split("\n")[line - 1][:col - 1]
        shapeless = re.search(r"\b(state|input)\s+(\w+)\s*$", text[:tok.start_pos or 0])
        if shapeless:  # `state s`: the grammar wants its shape next
            kind, name = shapeless[1], shapeless[2]
            hint = (f"a{'n' if kind == 'input' else ''} `{kind}` declares its shape: `{kind} {name}[1]` for one "
                    f"number, `{kind} {name}[d]` for a vector")
        if re.fullmatch(r"\s*expect\s+\w+\s*", before) and before.split()[1] not in EXPECT_NAMES:
            hint = f"an `expect` clause names what it states first: `expect update = {before.split()[1]} …` " \
                   "(or gradient, direction)"
        hint = _call_hint(text[: tok.start_pos or 0], tok) or hint
        stack = _open_brackets(text, tok.start_pos) if tok.start_pos is not None else []
        inner = stack[-1] if stack else None
        still_open = f"the `{inner[0]}` at line {inner[1]}, column {inner[2]} is still open" if inner else ""
        if str(tok) in _OPENER_OF:  # a closing bracket
            if not any(b == _OPENER_OF[str(tok)] for b, *_ in stack):
                hint = f"no `{_OPENER_OF[str(tok)]}` is open here for this `{tok}` to close; {hint}"
            elif inner and _CLOSERS[inner[0]] != str(tok):
                hint += f"; {still_open}"
        elif inner and inner[0] in "([" and inner[1] != line and _terminal_of(_CLOSERS[inner[0]]) in expected:
            # a bracket left open on an earlier line: most likely the mistake
            if expected == {_terminal_of(_CLOSERS[inner[0]])}:
                hint += f" to close the `{inner[0]}` at line {inner[1]}, column {inner[2]}"
            else:
                hint += f"; {still_open}"
        return SpecError(f"unexpected `{tok}`", Span(file, line, col, text, col + len(str(tok))), hint)
    # the end of the file came too early: say which bracket is still open, if one is
    tok = getattr(e, "token", None)
    lines = text.split("\n")
    line = getattr(tok, "end_line", None) or len(lines)
    col = getattr(tok, "end_column", None) or len(lines[line - 1]) + 1
    stack = _open_brackets(text, len(text))
    hint = _opener_hint(text, stack[-1]) if stack else f"expected {_describe_expected(expected)}" if expected else None
    return SpecError("unexpected end of file", Span(file, line, col, text), hint)


_OPENER_OF = {v: k for k, v in _CLOSERS.items()}


def _terminal_of(text: str) -> str | None:
    """The terminal written exactly `text` (`)` -> its terminal's name), if there is one."""
    return next((t for t, words in _vocabulary().spellings.items() if words == (text,)), None)



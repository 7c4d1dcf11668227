"""Syntax errors in the user's terms: what could come next as it is written in a spec (never a grammar
terminal's name), mistyped reducers named, carets under the right character, byte-order marks ignored."""

import re

import pytest
from conftest import energy_in_process

from energydsl import syntax, syntax_errors
from energydsl.errors import Span, SpecError
from energydsl.syntax import parse_module, parse_text

ENERGY = """energy A(d = 2) {
  state   z[d]
  context h[j, d] where j <= i
  global  F = z . z
  optimizer gd(eta = 1)
}
"""

MODEL = """model M(d = 8) {
  stream [d]
  embed tokens
  layer = A
  repeat 2
  head weird
}
"""

SEARCH = """search S {
  model M(d = 8)
  objective shrink val_loss
}
"""


def syntax_error(text: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_text(text, "t.energy")
    return info.value


def assert_user_terms(hint: str) -> None:
    """No grammar internals: no terminal names (`PRECONDITION`, `__ANON_0`, `head_kind`), and every
    backquoted word is something one can type in a spec (or a clause written out from its keyword)."""
    assert "__anon" not in hint.lower(), hint
    assert not re.search(r"\b[A-Z][A-Z_]{2,}\b", hint), hint
    typed = {w for words in syntax_errors._vocabulary().spellings.values() for w in words}
    for word in re.findall(r"`([^`]+)`", hint):
        example = " " in word and word.split()[0] in typed  # a clause written out: `state z[1]`
        assert word in typed or example, (word, hint)


# ----------------------------------------------------------------------------- 1. expected tokens


def test_every_terminal_reads_in_user_terms():
    """The description of each terminal comes from the grammar (its literal or the words its regex
    matches), or from the short list for open-ended ones: a new terminal without either fails here."""
    parser = syntax._parser()
    for term in parser.terminals:
        if term.name in parser.lexer_conf.ignore:
            continue
        words = syntax_errors._terminal_words(term.name)
        assert words, f"terminal {term.name} has no description for error messages"
        assert all("_" not in w.strip("`") or w.startswith("a ") for w in words), words
    vocab = syntax_errors._vocabulary()
    for rule, _ in syntax_errors._GROUPS:
        assert vocab.first.get(rule), f"rule {rule} named in syntax_errors._GROUPS is not in the grammar"
    assert {"+", "-", "*", "/", "@", ".", "^"} == {vocab.spellings[t][0] for t in vocab.operators}
    assert vocab.spellings["HEAD_KIND"] and set(vocab.spellings["DIRECTION"]) == {"minimize", "maximize"}


def test_lark_coarse_expected_set_is_described_briefly():
    """Even the merged LALR lookahead set lark used to hand us reads as a short list in user terms."""
    everything = {t.name for t in syntax._parser().terminals} - set(syntax._parser().lexer_conf.ignore)
    text = syntax_errors._describe_expected(everything)
    assert "an expression" in text and "an operator" in text and "…" in text
    assert "a ws" not in text and "comment" not in text
    hint = syntax_errors._describe_expected({"PRECONDITION", "RPAR", "COMMA", "EQUAL", "LSQB", "RSQB", "__ANON_0",
                                      "ACROSS", "MINUS", "REDUCER", "HEAD_KIND"})
    assert_user_terms(hint)
    assert len(hint.split(", ")) <= syntax_errors.MAX_EXPECTED + 1  # and "…"


@pytest.mark.parametrize(
    "text, message, hint",
    [
        (MODEL, "unexpected `weird`", "expected `tied` or `untied`"),
        (SEARCH, "unexpected `shrink`", "expected `maximize` or `minimize`"),
        (ENERGY.replace("z . z", "z . z → 2"), "unexpected character `→`",
         "expected an operator, `(`, `[`, `^T`, `}` or a clause (`dim`, `state`, `input`, …)"),
        (ENERGY.replace("z . z", "z . "), "unexpected `optimizer`",
         "line 4 is unfinished: expected an expression there"),
        (ENERGY.replace("j <= i", "j <= i + 1"), "unexpected `+`",
         "expected `}` or a clause (`dim`, `state`, `input`, …)"),
        (ENERGY.replace("j <= i", "j > i"), "unexpected character `>`", "expected `<` or `<=`"),
        (ENERGY.replace("gd(eta = 1)", "gd(eta = 1"), "unexpected `}`",
         "expected `)` or `,`; the `(` at line 5, column 15 is still open"),
        (ENERGY + "}\n", "unexpected `}`", "no `{` is open here for this `}` to close; expected `block`, "
         "`energy`, `import`, `model`, `search` or end of file"),
        # a state without a shape (a scalar state is written `[1]`): the hint was `expected `[``
        (ENERGY.replace("z[d]", "z"), "unexpected `context`",
         "a `state` declares its shape: `state z[1]` for one number, `state z[d]` for a vector"),
    ],
    ids=["head-kind", "objective-direction", "arrow-in-expression", "missing-operand", "relation-rhs",
         "bad-relation", "unclosed-paren", "extra-brace", "shapeless-state"],
)
def test_expected_lists_in_user_terms(text, message, hint):
    err = syntax_error(text)
    assert err.message == message
    assert err.hint == hint
    assert_user_terms(err.hint)


@pytest.mark.parametrize("typo, word", [("globl F = z . z", "global"), ("contxt g[j, d] where j <= i", "context"),
                                        ("optimizer gd(eta = 1) setps 2", "steps"),
                                        ("optimizer gd(eta = 1) wtr z", "wrt"),
                                        ("optimizer gd(eta = 1), precondtion diag", "precondition")])
def test_a_misspelt_keyword_is_named(typo: str, word: str) -> None:
    err = syntax_error(ENERGY.replace("optimizer gd(eta = 1)", typo))
    assert err.message.startswith("unexpected `")
    assert err.hint.startswith(f"did you mean `{word}`? (expected "), err.hint
    assert_user_terms(err.hint)


@pytest.mark.parametrize("text, word, split", [
    (ENERGY.replace("state   z[d]", "statez[d]"), "statez", "state z"),
    (MODEL.replace("repeat 2", "repeats"), "repeats", "repeat s"),
    (MODEL.replace("embed tokens", "embedtokens"), "embedtokens", "embed tokens"),
    (ENERGY + "blockB = A\n", "blockB", "block B"),
    (ENERGY.replace("optimizer gd(eta = 1)", "optimizer gd(eta = 1) per heads"), "heads", "head s"),  # `head` alone
])
def test_a_keyword_glued_to_the_next_word_is_refused(text: str, word: str, split: str) -> None:
    """Where the grammar takes no name, the lexer saw only keywords and read a keyword off the front of a longer
    word: `statez[d]` was `state z[d]`, and `repeats` (a header dim `s`) repeated the layers s times."""
    err = syntax_error(text)
    assert err.message == f"unknown word `{word}`"
    assert err.hint == f"did you mean `{split.split()[0]}` alone, or `{split}` as two words?"
    assert err.span.end_column - err.span.column == len(word)


def test_a_glued_keyword_after_an_unfinished_line_names_the_line() -> None:
    """`layer = A ->` then `repeat layers`: `repeat` was taken as the missing stage and `layers` read as `layer s`;
    the mistake is the line before, as for any other word there."""
    err = syntax_error(MODEL.replace("layer = A", "layer = A ->").replace("repeat 2", "repeat layers"))
    assert err.message == "unexpected `repeat`" and err.hint.startswith("line 4 is unfinished"), err.render()


def test_keywords_stand_alone_where_names_may_follow_too() -> None:
    """Names that begin with a keyword stay names (`stateful`, `layers`, `repeat2`), as before."""
    assert parse_text(ENERGY.replace("z . z", "z . z + stateful").replace("d = 2", "d = 2, stateful = 1"))
    model = MODEL.replace("head weird", "head tied").replace("M(d = 8)", "M(d = 8, layers = 2)")
    assert parse_text(model.replace("repeat 2", "repeat layers"))


def test_every_word_of_the_grammar_is_checked_to_stand_alone() -> None:
    """The lexer callbacks are keyed by the names lark gives the grammar's words: a word the naming missed would
    be read off the front of a longer one again."""
    words = {t.name for t in syntax._parser().terminals if re.fullmatch(r"[^\W\d]\w*", t.pattern.value)
             or t.name in ("DIRECTION", "HEAD_KIND")}  # alternatives of words: patterns of their own
    assert words - {"NAME"} <= syntax.keyword_terminals(syntax.GRAMMAR_PATH.read_text())


def test_a_reducer_by_another_name_is_named() -> None:
    err = syntax_error(ENERGY.replace("optimizer gd(eta = 1)", "global G = lse[j](z . h[j])"))
    assert err.message == "no reducer named `lse`" and err.hint.startswith("did you mean `logsumexp`?")


def test_long_expected_list_is_cut_short():
    err = syntax_error(ENERGY.replace("optimizer gd(eta = 1)", "param W[d, d] ~ normal(0, 1) bogus"))
    assert err.message == "unexpected `bogus`"
    assert_user_terms(err.hint)
    listed = err.hint.removeprefix("expected ").replace(" or ", ", ").split(", ")
    assert "…" in listed and len(listed) <= syntax_errors.MAX_EXPECTED + 4  # the clause kinds' examples count here
    assert "a clause (`dim`" in err.hint  # what belongs there is always said


@pytest.mark.parametrize(
    "text, where",
    [
        (ENERGY.rstrip().removesuffix("}"), "the `{` of `energy A` (line 1) is never closed: add `}`"),
        (ENERGY.replace("optimizer gd(eta = 1)\n}\n", "global G = sum[j](z . h[j]"),
         "the `(` at line 5, column 20 is never closed: add `)`"),
        (SEARCH.replace("objective shrink val_loss\n}\n", "trials 4\n"),
         "the `{` of `search S` (line 1) is never closed: add `}`"),
    ],
    ids=["energy", "reducer-paren", "search"],
)
def test_unterminated_block_says_which_bracket_is_open(text, where):
    err = syntax_error(text)
    assert err.message == "unexpected end of file"
    assert err.hint == where
    # the caret sits right after the last thing written
    last = text.rstrip().split("\n")
    assert (err.span.line, err.span.column) == (len(last), len(last[-1]) + 1)


# ----------------------------------------------------------------------------- 2. unknown reducer


def test_unknown_reducer_is_named_with_a_suggestion():
    err = syntax_error(ENERGY.replace("z . z", "sum[k](logsumexpp[j](z . h[j]))"))
    assert err.message == "no reducer named `logsumexpp`"
    assert (err.span.line, err.span.column, err.span.end_column) == (4, 22, 32)
    assert err.hint.startswith("did you mean `logsumexp`?")
    assert "^^^^^^^^^^" in err.render()


def test_indexed_name_called_like_a_reducer():
    err = syntax_error(ENERGY.replace("z . z", "h[j](z)"))
    assert err.message == "no reducer named `h`"
    assert "`sum`" in err.hint and "`softmax`" in err.hint and "*" in err.hint


def test_indexed_let_followed_by_paren_is_not_called_a_reducer():
    err = syntax_error(ENERGY.replace("global  F = z . z", "let E[k, j] (z)"))
    assert err.message == "unexpected `(`" and err.hint == "expected `=`"


# ----------------------------------------------------------------------------- 3. the caret


def caret_column(rendered: str, tabsize: int) -> tuple[str, int]:
    src, caret = rendered.split("\n")[1:3]
    return src.expandtabs(tabsize), caret.expandtabs(tabsize).index("^")


@pytest.mark.parametrize("tabsize", [8, 4])
def test_caret_sits_under_the_error_in_tab_indented_source(tabsize):
    err = syntax_error("energy A(d = 2) {\n\tstate\tz[d]\n\tglobal\tF = z .\t@ z\n}\n")
    assert (err.span.line, err.span.column) == (3, 17)
    src, col = caret_column(err.render(), tabsize)
    assert src[col] == "@"


def test_caret_under_wide_and_invisible_characters():
    rendered = SpecError("boom", Span("f", 1, 5, "日本 \u200bx = 1")).render()
    src, caret = rendered.split("\n")[1:3]
    assert caret == "  " + " " * 5 + "^"  # two columns per wide character, none for the zero-width space


def test_quoted_line_is_the_line_the_parser_counted():
    """A form feed is whitespace to the parser but a line break to str.splitlines()."""
    err = syntax_error("# page one\x0cpage two\nenergy A(d = 2) {\n  global F = z . \n}\n")
    assert err.span.line == 4
    assert err.render().split("\n")[1] == "  }"


# ----------------------------------------------------------------------------- 4. byte-order mark


def test_byte_order_mark_is_ignored(tmp_path):
    bom = b"\xef\xbb\xbf"
    (tmp_path / "lib.energy").write_bytes(bom + ENERGY.encode())
    (tmp_path / "main.energy").write_bytes(bom + b'import "lib.energy"\nblock B = A -> A\n')
    module = parse_module(tmp_path / "main.energy")
    assert set(module.energies) == {"A"} and set(module.blocks) == {"B"}
    assert parse_module("\ufeff" + ENERGY).energies["A"].name == "A"


def test_byte_order_mark_keeps_columns(tmp_path):
    path = tmp_path / "bad.energy"
    path.write_bytes(b"\xef\xbb\xbf" + b"energy {\n}\n")
    with pytest.raises(SpecError) as info:
        parse_module(path)
    assert (info.value.span.line, info.value.span.column) == (1, 8)
    assert info.value.message == "unexpected `{`"


# ----------------------------------------------------------------------------- nesting by operators


@pytest.mark.parametrize("expr", ["-" * 1000 + "1", " + ".join(["1"] * 600)], ids=["negations", "sum"])
def test_long_operator_chain_is_a_located_error(expr):
    err = syntax_error(ENERGY.replace("z . z", expr))
    assert "nested too deeply: more than 250 levels of operators, counting a chain too" in err.message
    assert err.span.line == 4
    assert err.hint == "split it with `let` bindings"


def test_moderate_operator_chain_parses():
    parse_text(ENERGY.replace("z . z", " + ".join(["z . z"] * 100)))


# ----------------------------------------------------------------------------- end to end


def test_cli_prints_located_message_with_hint(tmp_path):
    path = tmp_path / "m.energy"
    path.write_text(MODEL)
    res = energy_in_process("derive", path)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().split("\n")
    assert lines[0] == f"{path}:6:8: error: unexpected `weird`"
    assert lines[1:4] == ["    head weird", "         ^^^^^", "hint: expected `tied` or `untied`"]


def test_keyword_taken_for_a_name_points_at_the_keyword():
    """`global F = z .` then `optimizer ...`: the parser reads `optimizer` as an operand and trips on `gd`."""
    err = syntax_error(ENERGY.replace("z . z", "z . "))
    assert (err.span.line, err.span.column, err.span.end_column) == (5, 3, 12)
    complete = syntax_error(ENERGY.replace("optimizer gd(eta = 1)", "optimizer gd(eta = 1) bogus"))
    assert complete.message == "unexpected `bogus`"  # a finished clause before: the usual message


def test_an_unnamed_expect_clause_is_told_to_name_what_it_states():
    e = syntax_error("energy Q(d = 4) {\n state z[d]\n global E = 0.5 * z . z\n expect z + z\n}\n")
    assert e.span.line == 4 and "`expect update = z …`" in (e.hint or "")
    named = syntax_error("energy Q(d = 4) {\n state z[d]\n global E = 0.5 * z . z\n expect update z\n}\n")
    assert named.hint == "expected `=`"


def test_the_words_expressions_reserve_are_refused_as_names() -> None:
    """`param int = 2` parsed, but `int * z` could not (the parser reads `int` as a hole): refuse the
    declaration, for exactly the words the grammar's `atom` rule spells out."""
    from pathlib import Path

    from energydsl import load
    from energydsl.semantics import EXPRESSION_WORDS

    grammar = (Path(__file__).resolve().parent.parent / "grammars" / "energy.lark").read_text()
    atom = grammar.split("?atom:", 1)[1].split("\n\n", 1)[0]
    assert set(re.findall(r'\|\s*"([a-z]+)"', atom)) == set(EXPRESSION_WORDS)
    for word in EXPRESSION_WORDS:
        with pytest.raises(SpecError) as info:
            load(f"energy A(d = 4) {{\n  state z[d]\n  param {word} = 2\n  global F = z . z\n}}\n").energy()
        assert str(info.value).startswith(f"<string>:3:3: error: `{word}` is a word of expressions")


def test_the_grammar_ships_inside_the_package() -> None:
    """A non-editable install (a wheel) has no repository around the package: the grammar was read from
    `../grammars/`, which a wheel does not hold. The package reads it through its `grammars` link to that folder,
    and its package data names the file, so a wheel copies it in (checked by building one, 2026-11-30)."""
    import tomllib
    from pathlib import Path

    import energydsl

    root = Path(__file__).resolve().parent.parent
    package = Path(energydsl.__file__).resolve().parent
    assert syntax.GRAMMAR_PATH.parent.parent == package
    assert syntax.GRAMMAR_PATH.read_text() == (root / "grammars" / "energy.lark").read_text()
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["energydsl"]
    assert any(syntax.GRAMMAR_PATH.relative_to(package).match(pattern) for pattern in data), data


OPTIMIZED = "energy E(d = 4) {\n  state z[d]\n  global F = 0.5 * z . z\n  LINE\n}\n"


@pytest.mark.parametrize("line,at,hint", [
    # the grammar's hint listed `precondition` among what may follow `optimizer precondition`
    ("optimizer precondition diag", (4, 26), "`optimizer` names its optimizer first (gd, momentum, nag, newton): "
                                             "`optimizer gd(eta = 1), precondition …`"),
    ("optimizer per head", (4, 17), "`optimizer gd(eta = 1), per …`"),
    # "expected a name or `)`" for an option given by position
    ("optimizer gd(eta = 1), precondition dplr(2)", (4, 44), "`dplr` takes its options by name (rank): `rank = 2`"),
    ("optimizer newton(eta = 0.5, 2)", (4, 31), "`newton` takes its options by name (eta, taylor, damping): "
                                                "`taylor = 2`"),
    ("optimizer gd(eta = 1, 2)", (4, 25), "`gd` takes its options by name (eta)"),
])
def test_an_optimizer_clause_slip_is_named(line: str, at: tuple[int, int], hint: str) -> None:
    e = syntax_error(OPTIMIZED.replace("LINE", line))
    assert (e.span.line, e.span.column) == at and hint in e.hint, (e.span, e.hint)


def test_a_trailing_comma_is_named() -> None:
    """`E(d = 4,)` said only "expected a name"."""
    e = syntax_error("energy E(d = 4,) {\n  state z[d]\n  global F = z . z\n}\n")
    assert (e.span.line, e.span.column) == (1, 16)
    assert e.hint == "nothing follows the comma before this `)`: remove the comma"

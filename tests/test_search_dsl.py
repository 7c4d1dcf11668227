"""Search spaces written in the language (`energydsl.search.dsl`): holes and their names, filled sources,
search-level overrides, validity before cost, deduplication, the shipped spaces and `energy search` /
`energy report` end to end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import textwrap
from pathlib import Path

import optuna
import pytest
from conftest import energy_in_process

import energydsl
from energydsl.errors import SpecError, UserError
from energydsl.search import load_study, run_search
from energydsl.search.dsl import DslSpace, load_search

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def shakespeare_or_stand_in(tmp_path_factory: pytest.TempPathFactory):
    """Tiny Shakespeare when it is on disk, else a small stand-in with fewer than 65 characters."""
    from energydsl.training.data import find_shakespeare

    try:
        find_shakespeare()
        yield
        return
    except UserError:
        pass
    path = tmp_path_factory.mktemp("data") / "input.txt"
    words = ["to", "be", "or", "not", "that", "is", "the", "Question", "Whether", "tis", "nobler", "in", "mind"]
    path.write_text(" ".join(words[(i * 7) % len(words)] for i in range(40_000)) + ".\n")
    os.environ["ENERGYDSL_SHAKESPEARE"] = str(path)
    yield
    os.environ.pop("ENERGYDSL_SHAKESPEARE", None)


@pytest.fixture(autouse=True, scope="module")
def check_cache(tmp_path_factory: pytest.TempPathFactory):
    """Check verdicts of this module's own (also for `energy search` subprocesses): none read from earlier
    runs, none left in the user's cache. tests/test_search_cache.py tests the cache itself."""
    old = os.environ.get("ENERGYDSL_CHECK_CACHE")
    os.environ["ENERGYDSL_CHECK_CACHE"] = str(tmp_path_factory.mktemp("checks"))
    yield
    if old is None:
        os.environ.pop("ENERGYDSL_CHECK_CACHE", None)
    else:
        os.environ["ENERGYDSL_CHECK_CACHE"] = old

# A small, cheap space: attention and a ReLU MLP (checks take a fraction of a second at d = 4).
TINY = """
energy Mix(d = 4, heads = 2) {
  dim     dh = d / heads
  state   z[d]
  context h[j, d] where j <= i
  param   W1[heads, dh, d] ~ normal(0, 0.02)
  param   W2[heads, dh, d] ~ normal(0, 0.02)
  let     T = sqrt(dh)
  local   s[k, j] = (W1[k] @ z) . (W2[k] @ h[j]) / T
  global  F = -(T / heads) * sum[k](logsumexp[j](s[k, j]))
  optimizer gd(eta = 1)
}

energy FF(d = 4, hidden = 8) {
  state   z[d]
  param   W1[hidden, d] ~ normal(0, 0.02)
  global  F = -sum(integral(relu)(W1 @ z))
  optimizer gd(eta = 1)
}

model Tiny(vocab = 65, context = 16, d = 8, layers = 1, heads = 2) {
  embed tokens, positions
  layer = Mix(d, heads) -> FF(d, hidden = 2 * d)
  repeat layers
  norm layernorm before each stage
  final norm layernorm
  head tied
}
"""

SEARCH = """
search T {
  model Tiny(d = choice{8, 16})
  optimizer Mix: choice{ gd(eta = 1), gd, momentum(beta = 0.5, eta = 1) }
  data shakespeare_char, steps 4
  train lr = float 1e-3..1e-2 log, batch = 4, eval_interval = 2, eval_iters = 1
  objective minimize val_loss
  trials 4
}
"""


def write(tmp_path: Path, text: str, name: str = "space.energy") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def fill(space: DslSpace, **params: object):
    """The candidate for these hole values (names with dots are passed as a dict)."""
    return space.suggest(optuna.trial.FixedTrial(dict(params)))


def names(space: DslSpace) -> list[str]:
    return [n for n, _, _ in space.describe()]


# ----------------------------------------------------------------------------- holes and filled sources

HOLES = """
energy E(d = 8, heads = 2, r = choice{4, 8}) {
  dim     dh = d / heads
  state   z[d]
  context h[j, d] where j <= i
  param   W[heads, dh, d] ~ normal(0, float 0.01..0.1 log)
  param   a = float 0.1..0.9
  let     T = sqrt(dh)
  global  F = -(T / heads) * sum[k](logsumexp[j](choice{1, 2 + 1} * (W[k] @ z) . (W[k] @ h[j]) / T))
  optimizer choice{ gd(eta = 1), nag(beta = float 0.5..0.9, eta = 1) } steps int 1..2, precondition choice{ none, diag }
}

block B = E(d = choice{4, 8})

model M(vocab = 65, context = 16, d = 8, layers = int 1..3, heads = 2) {
  embed tokens, positions
  layer = E(d, heads)
  repeat layers
  across layers choice{ none, momentum(beta = float 0.5..0.9) }
  head tied
}

search S {
  data shakespeare_char, steps int 2..3
  train lr = float 1e-4..1e-2 log
}
"""


def test_holes_are_named_by_where_they_stand(tmp_path: Path) -> None:
    space = load_search(write(tmp_path, HOLES))
    assert names(space) == [
        "E.r", "E.W", "E.a", "E.F", "E.optimizer", "E.optimizer.nag.beta", "E.steps", "E.precondition",
        "B.E.d", "M.layers", "M.across", "M.across.momentum.beta", "steps", "train.lr",
    ]
    described = dict((n, v) for n, v, _ in space.describe())
    assert described["E.W"] == "float 0.01..0.1 log" and described["M.layers"] == "int 1..3"
    assert described["E.precondition"] == "choice{none, diag}"
    where = dict((n, w) for n, _, w in space.describe())
    assert where["E.a"].endswith("space.energy:7:15")  # file:line:col of the hole itself
    assert space.model_name == "M" and space.budget["steps"] == 3


def test_filled_source_is_plain_energy_text(tmp_path: Path) -> None:
    space = load_search(write(tmp_path, HOLES))
    params = {"E.r": 8, "E.W": 0.02, "E.a": 0.5, "E.F": "2 + 1", "E.optimizer": "nag", "E.optimizer.nag.beta": 0.75,
              "E.steps": 2, "E.precondition": "none", "B.E.d": 4, "M.layers": 2, "M.across": "momentum",
              "M.across.momentum.beta": 0.6, "steps": 3, "train.lr": 0.001}
    cand = fill(space, **params)
    text = cand.source()
    assert not any(hole in text for hole in ("choice{", "int 1", "int 2", "float 0", "search S"))
    assert "energy E(d = 8, heads = 2, r = 8)" in text
    assert "~ normal(0, 0.02)" in text and "param   a = 0.5" in text
    assert "(2 + 1) * (W[k] @ z)" in text  # a compound choice is parenthesised where it lands
    assert "optimizer nag(beta = 0.75, eta = 1) steps 2\n" in text  # `none`: the precondition modifier is gone
    assert "block B = E(d = 4)" in text and "M(vocab = 65, context = 16, d = 8, layers = 2, heads = 2)" in text
    assert "across layers momentum(beta = 0.6)" in text
    assert "# trained with: data shakespeare_char, steps 3;" in text and "lr = 0.001" in text
    assert cand.settings["steps"] == 3 and cand.settings["lr"] == 0.001
    assert cand.params == params
    spec = energydsl.load(text)  # plain .energy: it parses and derives
    assert spec.energy("E").spec.optimizer.kind == "nag"
    # the other branch of each clause choice
    params.update({"E.optimizer": "gd", "E.precondition": "diag", "M.across": "none"})
    for key in ("E.optimizer.nag.beta", "M.across.momentum.beta"):
        params.pop(key)
    text = fill(space, **params).source()
    assert "optimizer gd(eta = 1) steps 2, precondition diag" in text
    assert "across layers" not in text
    assert energydsl.load(text).energy("E").spec.optimizer.precondition == "diag"


def test_a_hole_the_model_always_overrides_is_refused_where_it_stands(tmp_path: Path) -> None:
    # composition gives an energy every dim of the model's header it declares, and the arguments its use writes:
    # a hole in the energy's own default for such a dim would be sampled and never change the candidate
    dead = {
        "Mix(d = 4, heads = int 1..2)": ("Mix.heads", "`model Tiny(heads = int 1..2)` in the search"),
        "FF(d = 4, hidden = choice{8, 16})": ("FF.hidden", "`FF(..., hidden = choice{8, 16})`"),
    }
    for header, (hole, where) in dead.items():
        energy = header.split("(")[0]
        text = re.sub(rf"energy {energy}\([^)]*\)", f"energy {header}", TINY)
        with pytest.raises(SpecError, match=f"the hole `{re.escape(hole)}` never takes effect") as e:
            load_search(write(tmp_path, text + SEARCH))
        assert where in e.value.hint and "space.energy:" in str(e.value)
    # through a block whose use names the dim
    text = TINY.replace("energy FF(d = 4, hidden = 8)", "energy FF(d = 4, hidden = int 8..16)") \
        .replace("FF(d, hidden = 2 * d)", "FF(d)")
    assert "FF.hidden" in names(load_search(write(tmp_path, text + SEARCH)))  # FF's own default applies
    blocked = text.replace("model Tiny", "block B = FF(hidden = 8)\n\nmodel Tiny").replace("-> FF(d)", "-> B")
    with pytest.raises(SpecError, match="`FF.hidden` never takes effect"):
        load_search(write(tmp_path, blocked + SEARCH))
    # a search-level default for a dim the model gives: pointed at in the search
    over = SEARCH.replace("  data shakespeare_char", "  energy Mix(heads = choice{1, 2})\n  data shakespeare_char")
    with pytest.raises(SpecError, match="`Mix.heads` never takes effect") as e:
        load_search(write(tmp_path, TINY + over))
    assert e.value.span.line == TINY.count("\n") + over.count("\n", 0, over.index("energy Mix")) + 1


def test_a_float_hole_where_a_whole_number_is_needed_is_refused(tmp_path: Path) -> None:
    # every candidate but those at whole values would be invalid: refused at the hole, before any trial
    cases = {"model Tiny(d = choice{8, 16})": ("model Tiny(d = float 8..16)", "`Tiny.d`", "int 8..16"),
             "layer = Mix(d, heads)": ("layer = Mix(d, heads = float 1..2)", "`Tiny.layer.Mix.heads`", "int 1..2")}
    for old, (new, hole, fix) in cases.items():
        with pytest.raises(SpecError, match=f"the `float` hole {re.escape(hole)} stands where a whole number") as e:
            load_search(write(tmp_path, (TINY + SEARCH).replace(old, new)))
        assert fix in e.value.hint and e.value.span.line == (TINY + SEARCH).split(old)[0].count("\n") + 1
    # a float hole that is not its choice's first option: the check took each choice's first option, never
    # reached it, and its candidates were pruned as invalid one by one
    for choice in ("choice{1, float 1..2}", "choice{float 1..2, 1}"):
        with pytest.raises(SpecError, match="the `float` hole `Tiny.layers.[12]` stands where a whole number"):
            load_search(write(tmp_path, TINY + SEARCH.replace("Tiny(d = choice{8, 16})", f"Tiny(layers = {choice})")))
    # a float where any number will do (an initial value, a fixed scale) is a float hole as written
    text = TINY.replace("param   W1[hidden, d] ~ normal(0, 0.02)", "param   W1[hidden, d] ~ normal(0, float 0.01..0.1)")
    assert "FF.W1" in names(load_search(write(tmp_path, text + SEARCH)))


def test_hole_bounds_may_be_negative_and_land_as_atoms(tmp_path: Path) -> None:
    holes = "param   W1[hidden, d] ~ normal(0, 0.02)\n  param   a = float -1..1\n  let     c = int -3..-1"
    text = TINY.replace("param   W1[hidden, d] ~ normal(0, 0.02)", holes) \
               .replace("-sum(integral(relu)(W1 @ z))", "-float -2..-1 ^ 2 * c * sum(integral(relu)(W1 @ z))")
    space = load_search(write(tmp_path, text + SEARCH))
    described = dict((n, v) for n, v, _ in space.describe())
    assert described["FF.a"] == "float -1..1" and described["FF.c"] == "int -3..-1"
    assert described["FF.F"] == "float -2..-1"
    source = fill(space, **{"Tiny.d": 8, "Mix.optimizer": "gd", "train.lr": 1e-3,
                            "FF.a": -0.5, "FF.c": -2, "FF.F": -1.5}).source()
    assert "param   a = (-0.5)" in source and "let     c = (-2)" in source
    # the hole is an atom: (-1.5)^2 = 2.25, where an unparenthesised -1.5 ^ 2 would read -(1.5^2)
    assert "-(-1.5) ^ 2 * c * sum(" in source
    ff = energydsl.load(source).energy("FF")
    assert ff.spec.params["a"].init == ("value", [-0.5])
    assert "F = 9/2 (" in ff.equations()  # -(-1.5)^2 * (-2); the unparenthesised text would give -9/2
    with pytest.raises(SpecError, match="need whole numbers, low <= high"):
        load_search(write(tmp_path, TINY.replace("layers = 1", "layers = int -1..-3") + SEARCH))
    # a choice of signed numbers records numbers (`-1` was the text '-1' beside the int 2), filled as atoms
    signed = load_search(write(tmp_path, text.replace("let     c = int -3..-1", "let     c = choice{-1, 2, -0.5}")
                               + SEARCH, "signed.energy"))
    assert [o.label for h in signed.holes() if h.name == "FF.c" for o in h.options] == [-1, 2, -0.5]
    filled = fill(signed, **{"Tiny.d": 8, "Mix.optimizer": "gd", "train.lr": 1e-3, "FF.a": -0.5, "FF.c": -1,
                             "FF.F": -1.5})
    assert "let     c = (-1)" in filled.source() and filled.params["FF.c"] == -1
    # accepted, and then every trial was invalid (`got 1.12441e+19`)
    with pytest.raises(SpecError, match="a bound is larger than 2\\^53") as err:
        load_search(write(tmp_path, TINY.replace("layers = 1", "layers = int 1..100000000000000000000") + SEARCH))
    assert err.value.span is not None
    with pytest.raises(SpecError, match="a bound is larger than 2\\^53"):  # 2^53 + 1 read as a float is 2^53
        load_search(write(tmp_path, TINY.replace("layers = 1", "layers = int 1..9007199254740993") + SEARCH))


def test_search_level_overrides_are_written_into_the_declarations(tmp_path: Path) -> None:
    text = TINY.replace("  optimizer gd(eta = 1)\n}\n\nenergy FF", "  optimizer gd(eta = 1) steps 2 per head\n}\n\n"
                        "energy FF").replace("  optimizer gd(eta = 1)\n}\n\nmodel", "}\n\nmodel") \
        .replace("FF(d, hidden = 2 * d)", "FF(d)")  # FF's own `hidden` default applies: the search may set it
    text += """
search T {
  model Tiny(65, 16, 16, layers = int 1..2)
  energy FF(hidden = choice{8, 12})
  optimizer Mix: choice{ gd(eta = 1), nag(beta = float 0.5..0.9, eta = 1) }
  precondition Mix: choice{ none, scalar }
  precondition FF: diag
  across layers choice{ none, nag(beta = 0.9) }
  data shakespeare_char, steps 4
}
"""
    space = load_search(write(tmp_path, text))
    assert names(space) == ["Mix.optimizer", "Mix.optimizer.nag.beta", "Mix.precondition", "FF.hidden",
                            "Tiny.layers", "Tiny.across"]
    src = fill(space, **{"Mix.optimizer": "nag", "Mix.optimizer.nag.beta": 0.5, "Mix.precondition": "scalar",
                         "FF.hidden": 12, "Tiny.layers": 2, "Tiny.across": "nag"}).source()
    assert "optimizer nag(beta = 0.5, eta = 1) steps 2 per head, precondition scalar" in src  # modifiers kept
    assert "  optimizer gd(eta = 1), precondition diag\n}" in src  # FF had no optimizer clause
    assert "energy FF(d = 4, hidden = 12)" in src
    assert "model Tiny(vocab = 65, context = 16, d = 16, layers = 2, heads = 2)" in src  # positional: in header order
    assert "  across layers nag(beta = 0.9)\n}" in src
    spec = energydsl.load(src)
    plan = spec.plan("Tiny")
    assert plan.layers == 2 and plan.across[0] == "nag" and plan.d == 16
    src = fill(space, **{"Mix.optimizer": "gd", "Mix.precondition": "none", "FF.hidden": 8, "Tiny.layers": 1,
                         "Tiny.across": "none"}).source()
    assert "optimizer gd(eta = 1) steps 2 per head\n" in src and "across layers" not in src


def test_an_optimizer_the_search_replaces_drops_the_claims_about_the_old_one(tmp_path: Path) -> None:
    """`expect update` states what the declared optimizer does: with `optimizer FF: choice{...}` every candidate
    with another step was refuted, so the whole search was invalid. The search drops it (and `expect direction`)
    from such an energy; `expect gradient`, which no optimizer changes, stays and is still checked."""
    claims = ("  expect  update = z + W1^T @ relu(W1 @ z)\n  expect  direction = -(W1^T @ relu(W1 @ z))\n"
              "  expect  gradient = -(W1^T @ relu(W1 @ z))\n")
    text = TINY.replace("  global  F = -sum(integral(relu)(W1 @ z))\n  optimizer gd(eta = 1)\n",
                        "  global  F = -sum(integral(relu)(W1 @ z))\n  optimizer gd(eta = 1)\n" + claims)
    text += """
search T {
  optimizer FF: choice{ gd(eta = 0.5), gd(eta = 0.25) }
  data shakespeare_char, steps 4
}
"""
    space = load_search(write(tmp_path, text))
    candidate = fill(space, **{"FF.optimizer": "gd(eta = 0.5)"})
    src = candidate.source()
    assert "optimizer gd(eta = 0.5)" in src and "expect  gradient = -(W1^T @ relu(W1 @ z))" in src
    assert "expect  update" not in src and "expect  direction" not in src
    assert candidate.invalid_reason() is None
    assert "expect  update" in (tmp_path / "space.energy").read_text()  # the file itself is as written
    wrong = load_search(write(tmp_path, text.replace("expect  gradient = -(", "expect  gradient = (")))
    assert "`expect gradient` is refuted" in fill(wrong, **{"FF.optimizer": "gd(eta = 0.5)"}).invalid_reason()


def test_imports_are_inlined(tmp_path: Path) -> None:
    write(tmp_path, TINY, "parts.energy")
    space = load_search(write(tmp_path, 'import "parts.energy"\n' + SEARCH))
    src = fill(space, **{"Tiny.d": 8, "Mix.optimizer": "gd", "train.lr": 0.005}).source()
    assert 'import "' not in src and "(imported)" in src
    assert energydsl.load(src).model_names == ["Tiny"]


def test_paths_through_an_import_are_shown_normalised(tmp_path: Path) -> None:
    """An error in a space imported as `sub/../parts.energy`, and a dataset `chars:sub/../c.txt`, were named with
    the `sub/..` (the spec's own imports were already shown as `parts.energy`)."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "c.txt").write_text("abc abd\n" * 40)
    write(tmp_path, TINY.replace("choice{", "").replace("d = 8,", "d = choice{8, 8},"), "parts.energy")
    path = write(tmp_path, 'import "sub/../parts.energy"\n' + SEARCH)
    with pytest.raises(SpecError) as e:
        load_search(path)
    assert str(e.value.span) == f"{tmp_path / 'parts.energy'}:21:42", e.value.render()
    write(tmp_path, TINY, "parts.energy")
    space = load_search(write(tmp_path, 'import "sub/../parts.energy"\n'
                              + SEARCH.replace("data shakespeare_char", 'data "chars:sub/../c.txt"')))
    assert space.settings["data"].fixed == f"chars:{tmp_path / 'c.txt'}"


def test_a_filled_hole_means_what_was_sampled(tmp_path: Path) -> None:
    """A float rounded to six digits left its range (0.9999996 in `float 0.9..0.9999999` trained as beta = 1, a
    momentum that never decays); a name option `T` after `^` landed as a transpose, and one named like a reduction
    before `[` as that reduction (a syntax error)."""
    energy = """
    energy E(d = 8) {
      state z[d]
      param W[d, d] ~ normal(0, 0.02)
      param v[d] ~ normal(0, 0.02)
      let T = 2
      param a = 0.5
      let max = 2 * v
      let s[n] = choice{max, v}[n]
      global F = -sum((W @ z) * (W @ z)) * sum[n](s[n]) * a^choice{T, 3}
      optimizer momentum(beta = float 0.9..0.9999999)
    }
    model M(vocab = 65, context = 16, d = 8, layers = 1, heads = 2) {
      embed tokens, positions
      layer = E(d)
      head tied
    }
    search S {
      model M
      data shakespeare_char, steps 4
      train batch = 4, eval_interval = 2, eval_iters = 1
    }
    """
    space = load_search(write(tmp_path, energy))
    assert set(names(space)) == {"E.s", "E.F", "E.optimizer.beta"}, names(space)
    candidate = fill(space, **{"E.s": "max", "E.F": "T", "E.optimizer.beta": 0.9999996})
    text = candidate.source()
    assert "beta = 0.9999996" in text and "(max)[n]" in text and "a^(T)" in text, text
    # `max`, a name no indexing can take, is now refused for what it is rather than as a syntax error
    assert "`max` takes 0 indices" in candidate.invalid_reason(), candidate.invalid_reason()
    valid = fill(space, **{"E.s": "v", "E.F": "T", "E.optimizer.beta": 0.9999996})
    assert valid.invalid_reason() is None, valid.invalid_reason()
    assert "a^2" in energydsl.load(valid.source()).energy("E").equations("text").replace("(a^2)", "a^2")


def test_without_a_model_clause_the_files_own_model_is_trained(tmp_path: Path) -> None:
    """`energy info` and `train` take the file's own model; the search counted an imported one too and refused."""
    write(tmp_path, TINY, "parts.energy")
    own = "model Own(vocab = 65, context = 16, d = 8) {\n  embed tokens\n  layer = FF(d)\n  head tied\n}\n"
    search = SEARCH.replace("  model Tiny(d = choice{8, 16})\n", "").replace("trials 4", "trials 1")
    space = load_search(write(tmp_path, 'import "parts.energy"\n' + own + search))
    assert space.model_name == "Own"
    only_imported = load_search(write(tmp_path, 'import "parts.energy"\n' + search, "imports.energy"))
    assert only_imported.model_name == "Tiny"  # none of its own: the one its imports declare
    with pytest.raises(energydsl.SpecError, match=r"must name the model it trains \(it declares Own, Two\)"):
        load_search(write(tmp_path, 'import "parts.energy"\n' + own + own.replace("Own", "Two") + search, "two.energy"))


@pytest.mark.parametrize("bad, message", [
    ("objective minimize accuracy", "unknown objective `accuracy`"),
    ("model Tiny(width = 4)", "`width` is not a dim of model `Tiny`"),
    ("optimizer Nope: gd", "no energy named `Nope`"),
    ("train momentum = 0.9", "unknown training setting `momentum`"),
    ("train batch = 2.5", "`batch_size` must be a whole number"),
    ("trials int 1..4", "`trials` takes a whole number"),
    ("model Tiny(d = int 9..3)", "low <= high"),
    ("model Tiny(d = float 0..1 log)", "low > 0"),
    ("optimizer Mix: choice{ gd, gd }", "listed twice"),
    ("across layers choice{ none(beta = 1), nag }", "`none` takes no arguments"),
    # settings training would refuse (every trial would fail): found before any trial runs
    ("trials 0", "`trials` must be at least 1"),
    ("data nope", "unknown dataset 'nope'"),
    ("data shakespeare_char, steps -5", "steps must be at least 1, got -5"),
    ("data shakespeare_char, steps 0", "steps must be at least 1, got 0"),
    ("data shakespeare_char, steps float 2..4", "`steps` must be a whole number"),
    ("train lr = -1", "lr must be above 0"),
    ("train batch = 0", "batch_size must be at least 1"),
    ("train dtype = foo", "unknown dtype 'foo'"),
    ("train lr = float 0..1e-2", "lr must be above 0"),  # a hole: its bounds are checked
    ("train batch = choice{4, 0}", "batch_size must be at least 1"),  # ... and each option of a choice
    ("train eval_iters = int 0..3", "eval_iters must be at least 1"),
    ("train lr = 2 * float 1e-3..1e-2", "takes a number or one hole"),
    ("data mqar", "dataset mqar has 8192 tokens, more than model `Tiny`'s vocab 65"),
    # a dim given twice: by name (the parser), by position and name (an internal error, exit 70, before)
    ("model Tiny(d = choice{16, 32}, d = 8)", "`d` is given twice in `Tiny(...)`"),
    ("model Tiny(65, choice{16, 32}, context = 8)", "`context` is given twice in `Tiny(...)`: by position"),
    ("energy Mix(heads = 2, heads = 4)", "`heads` is given twice in `Mix(...)`"),
    ("model Tiny(context = 32, 99)", "a dim of `Tiny` given by position after one given by name"),
    # clause options the language would refuse in every trial: found at load, not trial by trial as pruned
    ("optimizer Mix: choice{ foo, gd }", "unknown optimizer `foo`"),
    ("optimizer Mix: choice{ gd, momentum(beta = 0.9, zeta = 1) }", "`momentum` has no parameter `zeta`"),
    ("optimizer Mix: nag(gamma = 1)", "`nag` has no parameter `gamma`"),
    ("optimizer Mix: gd(eta = 1, eta = 2)", "`eta` is given twice in `gd(...)`"),
    ("precondition Mix: choice{ none, foo }", "unknown preconditioner `foo`"),
    ("precondition Mix: choice{ dplr(rank = 2, tau = 1) }", "`dplr` has no parameter `tau`"),
    ("across layers choice{ none, adam(beta = 0.9) }", "unknown optimizer across layers `adam`"),
    ("across layers momentum(beta = 0.9 learn, eta = 1 learn, beta = 0.1)", "`beta` is given twice"),
    ("optimizer Mix: choice{ gd(eta=1), gd(eta = 1) }", "listed twice"),  # the same call, spaced otherwise
    ("optimizer Mix: choice{ nag(beta = 0.5, eta = 1), nag(eta = 1, beta = 0.5) }", "listed twice"),
    ("model Tiny(d = choice{2*8, 2 * 8})", "listed twice"),
    ("train lr = 1e-3 learn", "`learn` does not apply to a training setting"),  # it was ignored
])
def test_mistakes_in_a_search_are_located(tmp_path: Path, bad: str, message: str) -> None:
    path = write(tmp_path, TINY + f"search T {{\n  {bad}\n}}\n")
    with pytest.raises(SpecError) as e:
        load_search(path)
    assert message in e.value.message
    assert e.value.span is not None and e.value.span.line == TINY.count("\n") + 2


@pytest.mark.parametrize(("clause", "written"), [("objective minimize val_loss", "objective"),
                                                ("across layers none", "across layers"), ("trials 3", "trials")])
def test_a_clause_given_twice_is_named_as_the_spec_writes_it(tmp_path: Path, clause: str, written: str) -> None:
    """`objective` and `across layers` were named by their grammar rules: `objectives`, `across`."""
    path = write(tmp_path, TINY + f"search T {{\n  {clause}\n  {clause}\n}}\n")
    with pytest.raises(SpecError) as e:
        load_search(path)
    assert e.value.message.startswith(f"`{written}` is given twice in search `T`"), e.value.message
    assert e.value.span.line == TINY.count("\n") + 3


def test_which_search_and_settings(tmp_path: Path) -> None:
    path = write(tmp_path, TINY + SEARCH + SEARCH.replace("search T", "search U"))
    with pytest.raises(UserError, match="declares 2 searches"):
        load_search(path)
    assert load_search(path, search="U").name == "U"
    with pytest.raises(UserError, match="no search named `V`"):
        load_search(path, search="V")
    space = load_search(path, search="T", steps="7", lr="0.003", batch="2", trials="9", timeout="60")
    assert space.budget == {"trials": 9, "steps": 7, "min_steps": 2, "timeout": 60.0}
    assert "train.lr" not in names(space)  # a setting given on the command line is no longer a hole
    cand = fill(space, **{"Tiny.d": 8, "Mix.optimizer": "gd"})
    assert (cand.settings["steps"], cand.settings["lr"], cand.settings["batch_size"]) == (7, 0.003, 2)
    with pytest.raises(UserError, match="unknown search setting `colour`"):
        load_search(path, search="T", colour="red")
    with pytest.raises(SpecError, match="declares no `search`"):
        load_search(write(tmp_path, TINY, "plain.energy"))
    with pytest.raises(SpecError, match="declares no `model`"):
        load_search(write(tmp_path, TINY.split("model Tiny")[0] + "search S { trials 2 }", "nomodel.energy"))


@pytest.mark.parametrize("key, value, message", [
    ("steps", "-1", "steps must be at least 1"), ("steps", "0", "steps must be at least 1"),
    ("lr", "-1", "lr must be above 0"), ("batch", "0", "batch_size must be at least 1"),
    ("data", "nope", "unknown dataset 'nope'"), ("data", "chars:/nonexistent/x.txt", "text file not found"),
    ("dtype", "foo", "unknown dtype 'foo'"), ("timeout", "-1", "timeout must be a positive number"),
    ("trials", "0", "trials must be at least 1"), ("seed", "1.5", "`seed` must be a whole number"),
])
def test_bad_settings_given_with_set_name_the_set(tmp_path: Path, key: str, value: str, message: str) -> None:
    path = write(tmp_path, TINY + SEARCH)
    with pytest.raises(UserError) as e:
        load_search(path, **{key: value})
    assert message in e.value.message and e.value.message.startswith(f"--set {key}={value}: "), e.value.message


def test_good_settings_and_datasets_are_accepted(tmp_path: Path) -> None:
    path = write(tmp_path, TINY + SEARCH)
    text = tmp_path / "text.txt"
    text.write_text("abc abd\n" * 100)  # a val split of 80 tokens serves blocks of 16 and 64
    assert load_search(path, data=f"chars:{text}").settings["data"].fixed == f"chars:{text}"
    long_context = write(tmp_path, TINY + SEARCH.replace("model Tiny(", "model Tiny(context = 65, "), "ctx.energy")
    assert load_search(long_context, data="listops").settings["data"].fixed == "listops"  # rows of 65 tokens
    for data, tokens in ((f"bytes:{text}", 256), ("mqar", 8192)):  # more tokens than the model's vocab 65
        with pytest.raises(UserError) as e:
            load_search(path, data=data)
        assert e.value.message == f"--set data={data}: dataset {data} has {tokens} tokens, more than model `Tiny`'s " \
                                  "vocab 65" and e.value.hint == f"write `model Tiny(vocab = {tokens})` in the search"
        big = write(tmp_path, TINY + SEARCH.replace("model Tiny(", f"model Tiny(vocab = {tokens}, context = 64, "),
                    "big.energy")
        assert load_search(big, data=data).settings["data"].fixed == data
    searched = write(tmp_path, TINY + SEARCH.replace("model Tiny(", "model Tiny(vocab = choice{65, 300}, "), "v.energy")
    assert load_search(searched, data=f"bytes:{text}")  # a searched vocab: each trial checks its own
    assert load_search(path, steps="1", lr="0.5", min_lr="0.9", dtype="bfloat16").budget["steps"] == 1
    no_trials = write(tmp_path, TINY + SEARCH.replace("  trials 4\n", ""), "default.energy")
    assert load_search(no_trials).budget["trials"] == 20


def test_a_dataset_that_cannot_serve_the_block_is_refused_before_any_trial(tmp_path: Path) -> None:
    """Training refuses a block a text file's splits cannot serve and a task whose examples are longer than the
    block; the search found out in every trial (each failed the same way): it is an error at load time, located
    at the data clause, or at the `block` that asks too much, or named by its --set."""
    small = tmp_path / "small.txt"
    small.write_text("abc abd\n" * 10)  # val split: 8 tokens
    path = write(tmp_path, TINY + SEARCH)
    with pytest.raises(UserError) as e:
        load_search(path, data=f"chars:{small}")
    assert e.value.message == (f"--set data=chars:{small}: data chars:{small} with model `Tiny`'s context 16: "
                               f"block_size 16 needs at least 17 tokens in the val split of chars:{small}, which "
                               "has 8") and e.value.hint == "use a block size below 8, or a larger text file"
    assert load_search(path, data=f"chars:{small}", block="7")  # a shorter block fits
    with pytest.raises(UserError, match=r"--set data=listops: data listops with block 100, capped at model "
                                        r"`Tiny`'s context 16: listops examples are 65 tokens long but block_size "
                                        r"is 16"):
        load_search(path, data="listops", block="100")

    written = SEARCH.replace("data shakespeare_char", f'data "chars:{small}"')
    with pytest.raises(SpecError) as e:
        load_search(write(tmp_path, TINY + written, "data.energy"))
    assert "with model `Tiny`'s context 16: block_size 16 needs at least 17 tokens" in e.value.message
    assert e.value.span.line == (TINY + written).splitlines().index(f'  data "chars:{small}", steps 4') + 1
    blocks = SEARCH.replace("batch = 4,", "batch = 4, block = choice{8, 12},")
    blocks = blocks.replace("data shakespeare_char", "data mqar").replace("model Tiny(", "model Tiny(vocab = 8192, ")
    with pytest.raises(SpecError) as e:  # the block's option that asks too much is named
        load_search(write(tmp_path, TINY + blocks, "block.energy"))
    assert e.value.message.startswith("data mqar with block 8: mqar examples are 64 tokens long")
    assert "data mqar" in (TINY + blocks).splitlines()[e.value.span.line - 1]
    searched = SEARCH.replace("model Tiny(", "model Tiny(context = choice{16, 65}, ")
    assert load_search(write(tmp_path, TINY + searched, "searched.energy"), data="listops")  # each trial checks


def test_a_data_file_that_is_not_text_is_located_at_the_data_clause(tmp_path: Path) -> None:
    """Reading the file (not UTF-8 text) failed unlocated, where an empty or missing file is located."""
    binary = tmp_path / "binary.bin"
    binary.write_bytes(bytes(range(128, 256)) * 4)
    written = SEARCH.replace("data shakespeare_char", f'data "chars:{binary}"')
    with pytest.raises(SpecError) as e:
        load_search(write(tmp_path, TINY + written, "data.energy"))
    assert e.value.message.startswith("text file is not UTF-8 text") and e.value.hint == f"use bytes:{binary}"
    assert e.value.span.line == (TINY + written).splitlines().index(f'  data "chars:{binary}", steps 4') + 1
    with pytest.raises(UserError) as e:
        load_search(write(tmp_path, TINY + SEARCH), data=f"chars:{binary}")
    assert e.value.message.startswith(f"--set data=chars:{binary}: text file is not UTF-8 text"), e.value.message


def test_a_file_dataset_is_written_quoted_in_the_data_clause(tmp_path: Path, monkeypatch) -> None:
    """docs/search.md names `chars:PATH` datasets, which the clause refused ("unexpected `:`"): quoted, a relative
    path is read from the search file's folder, wherever the search runs from."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "text.txt").write_text("abc abd\n" * 40)
    path = write(tmp_path, TINY + SEARCH.replace("data shakespeare_char", 'data "chars:corpus/text.txt"'))
    monkeypatch.chdir("/")
    assert load_search(path).settings["data"].fixed == f"chars:{tmp_path / 'corpus' / 'text.txt'}"
    absolute = write(tmp_path, TINY + SEARCH.replace("data shakespeare_char", f'data "bytes:{tmp_path}/x.txt"'), "a.e")
    with pytest.raises(UserError, match=f"file not found: {tmp_path}/x.txt"):
        load_search(absolute)
    listops = SEARCH.replace("data shakespeare_char", 'data "listops"').replace("Tiny(", "Tiny(context = 65, ")
    assert load_search(write(tmp_path, TINY + listops, "l.energy")).settings["data"].fixed == "listops"


def test_a_set_file_dataset_is_read_from_where_the_command_runs(tmp_path: Path, monkeypatch) -> None:
    """`--set data=chars:../corpus.txt` was recorded as written: from another folder it named another corpus,
    and the study took it; the same file from a third folder was refused as a change."""
    from energydsl.search.space import SpaceRef, absolute

    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    for given, made in (("chars:../corpus.txt", f"chars:{tmp_path / 'corpus.txt'}"),
                        (f"bytes:{tmp_path}/c.txt", f"bytes:{tmp_path}/c.txt"), ("listops", "listops")):
        assert absolute(SpaceRef("toy", {"data": given})).sets["data"] == made
        assert absolute(SpaceRef(str(tmp_path / "s.energy"), {"data": given, "d": "8"})).sets == {"data": made,
                                                                                                   "d": "8"}


def test_an_output_over_the_dataset_is_refused(tmp_path: Path) -> None:
    """`--export corpus.txt` (and `energy report -o corpus.txt`) replaced the corpus the space trains on with
    a candidate's source (HTML), exit 0; every later run then refused the 68-token dataset."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 60)
    text = SEARCH.replace("data shakespeare_char", 'data "chars:corpus.txt"').replace("trials 4", "trials 1")
    path, journal = write(tmp_path, TINY + text.replace("d = choice{8, 16}", "d = 8, vocab = 29")), tmp_path / "j"
    before = corpus.read_bytes()
    r = energy_in_process("search", path, "--storage", journal, "--json", "--export", corpus)
    assert r.returncode == 2 and f"--export {corpus} is the dataset the trials train on" in r.stderr, r.stderr
    r = energy_in_process("report", journal, "-o", corpus)
    assert r.returncode == 2 and f"-o/--output {corpus} is the dataset the trials train on" in r.stderr, r.stderr
    assert corpus.read_bytes() == before


def test_a_device_the_trials_cannot_use_is_refused_before_any_trial(tmp_path: Path) -> None:
    import torch

    path, journal = write(tmp_path, TINY + SEARCH), tmp_path / "s.journal"
    devices = ["foo", "tpu"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:0"])
    for device in devices:
        with pytest.raises(UserError, match="device"):
            run_search(path, device=device, storage=str(journal), trials=1, progress=False, json=True)
    assert not journal.exists()


def test_workers_spread_over_the_gpus_with_cuda_or_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from energydsl.search.local import worker_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [worker_device("cuda", i, 3) for i in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]
    assert [worker_device("auto", i, 2) for i in range(2)] == ["cuda:0", "cuda:1"]
    assert worker_device("cuda:1", 0, 2) == "cuda:1" and worker_device("auto", 1, 1) == "auto"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert worker_device("auto", 1, 2) == "auto"  # no GPU: each worker resolves auto to the CPU


def test_a_changed_hole_is_refused_before_any_trial(tmp_path: Path) -> None:
    """Optuna cannot change a choice's options within a study: a rerun of an edited space stops at the hole."""
    from energydsl.search import open_study

    path, journal = write(tmp_path, TINY + SEARCH), str(tmp_path / "s.journal")
    space = load_search(path)
    study = open_study(journal, "T", space)
    trial = study.ask()
    space.suggest(trial)  # what a trial of the search records: every hole's distribution
    study.tell(trial, 1.0)
    edited = (TINY + SEARCH).replace("choice{8, 16}", "choice{8, 12}")
    write(tmp_path, edited)
    with pytest.raises(UserError) as e:
        run_search(path, storage=journal, study_name="T", trials=2, progress=False, json=True)
    line = next(i for i, text in enumerate(edited.splitlines(), 1) if "model Tiny(d = choice{8, 12})" in text)
    assert "`Tiny.d`" in e.value.message and "choice{8, 16}" in e.value.message and e.value.span is not None
    assert e.value.span.line == line and "--study" in (e.value.hint or "") and "--storage" in (e.value.hint or "")
    assert len(load_study(journal, "T").trials) == 1  # nothing ran
    write(tmp_path, TINY + SEARCH.replace("1e-3..1e-2", "1e-3..2e-2"))  # a new range: Optuna takes it
    open_study(journal, "T", load_search(path))


def test_a_rerun_with_other_training_settings_is_refused(tmp_path: Path) -> None:
    """Trials trained with other settings (steps, lr, data, the space's text) are not comparable: a rerun that
    changes them is refused, naming each change; the budget, a timeout, comments and a hole's range may change."""
    from energydsl.search import open_study

    path, journal = write(tmp_path, TINY + SEARCH), str(tmp_path / "s.journal")
    study = open_study(journal, "T", load_search(path, steps="3"))
    study.add_trial(optuna.trial.create_trial(value=1.0))
    with pytest.raises(UserError) as e:
        open_study(journal, "T", load_search(path, steps="2", lr="0.05"))
    assert "steps: 3 → 2" in e.value.message and "lr: float 1e-3..1e-2 log → 0.05" in e.value.message
    assert "--study" in (e.value.hint or "") and "steps = 3" in (e.value.hint or "")
    assert load_study(journal, "T").user_attrs["settings"]["steps"] == "3"  # the record is not overwritten
    harmless = (TINY + SEARCH).replace("trials 4", "trials 9").replace("1e-3..1e-2", "1e-3..2e-2")
    write(tmp_path, "# a comment\n" + harmless.replace("  repeat layers", "  repeat   layers  # again"))
    open_study(journal, "T", load_search(path, steps="3", trials="12", timeout="60"))
    write(tmp_path, harmless.replace("vocab = 65", "vocab = 80"))  # outside the holes: other models
    with pytest.raises(UserError, match=r"text outside its holes was edited \(model `Tiny`\)"):
        open_study(journal, "T", load_search(path, steps="3"))
    write(tmp_path, harmless.replace("  head tied", "  head tied\n}\n\nenergy New(d = 4) {\n  state z[d]\n"
                                     "  global F = z . z\n  optimizer gd(eta = 1)"))
    with pytest.raises(UserError, match=r"was edited \(energy `New` added\)"):
        open_study(journal, "T", load_search(path, steps="3"))
    legacy = dict(load_study(journal, "T").user_attrs["settings"])
    del legacy["declarations"]  # a study recorded before declarations were hashed: the edit is not located
    load_study(journal, "T").set_user_attr("settings", legacy)
    with pytest.raises(UserError, match=r"text outside its holes was edited;"):
        open_study(journal, "T", load_search(path, steps="3"))


def test_a_run_with_other_settings_is_refused_while_a_trial_trains(tmp_path: Path) -> None:
    """A second `energy search` with other settings was accepted while the first one's first trial was still
    RUNNING (only COMPLETE and PRUNED trials counted): it overwrote the recorded settings, and trials of 3 and of 2
    steps were ranked together. A trial whose worker died does not hold the settings."""
    import subprocess

    from energydsl.search import open_study
    from energydsl.search.report import OWNER, owner_info

    path, journal = write(tmp_path, TINY + SEARCH), str(tmp_path / "s.journal")
    study = open_study(journal, "T", load_search(path, steps="3"))
    trial = study.ask()
    study._storage.set_trial_system_attr(trial._trial_id, OWNER, owner_info())  # this process: alive
    with pytest.raises(UserError) as e:
        open_study(journal, "T", load_search(path, steps="2"))
    assert "steps: 3 → 2" in e.value.message and "(trial #0 is training with them now)" in e.value.message
    assert load_study(journal, "T").user_attrs["settings"]["steps"] == "3"
    gone = subprocess.Popen(["true"])
    gone.wait()
    study._storage.set_trial_system_attr(trial._trial_id, OWNER, {**owner_info(), "pid": gone.pid})
    assert open_study(journal, "T", load_search(path, steps="2")).user_attrs["settings"]["steps"] == "2"


def test_a_retry_outside_a_narrowed_range_samples_that_hole_afresh(tmp_path: Path, capsys, recwarn) -> None:
    """A lost trial is put back with its parameters; after the range was narrowed the retry trained outside it,
    and Optuna printed its raw UserWarning. It keeps the parameters the edited space can still sample."""
    from energydsl.search import open_study
    from energydsl.search.report import RETRY_OF

    path, journal = write(tmp_path, TINY + SEARCH), str(tmp_path / "s.journal")
    study = open_study(journal, "T", load_search(path))
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.WAITING, system_attrs={
        RETRY_OF: 3, "fixed_params": {"train.lr": 8e-3, "Tiny.d": 16, "Mix.optimizer": "gd"}}))
    open_study(journal, "T", load_search(path))  # nothing edited: the retry is left as it was
    assert capsys.readouterr().err == ""
    write(tmp_path, TINY + SEARCH.replace("1e-3..1e-2", "1e-3..5e-3"))
    space = load_search(path)
    study = open_study(journal, "T", space)
    assert capsys.readouterr().err == ("note: the retry of trial #3 keeps its other parameters, but `train.lr` = 0.008 "
                                       "(now float 0.001..0.005 log) is outside the edited space: sampled afresh\n")
    (waiting,) = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert waiting.system_attrs["fixed_params"] == {"Tiny.d": 16, "Mix.optimizer": "gd"}
    trial = study.ask()
    space.suggest(trial)
    assert trial.params["Tiny.d"] == 16 and 1e-3 <= trial.params["train.lr"] <= 5e-3
    assert not [w for w in recwarn if "out of range" in str(w.message)]
    # a waiting trial that is no retry, all of whose values are out: named by its number; one whose fixed
    # parameters are not a mapping (another writer's) is left alone
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.WAITING,
                                              system_attrs={"fixed_params": {"train.lr": 0.5}}))
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.WAITING,
                                              system_attrs={"fixed_params": [1, 2]}))
    open_study(journal, "T", space)
    assert capsys.readouterr().err == ("note: waiting trial #1 is sampled afresh: `train.lr` = 0.5 (now float "
                                       "0.001..0.005 log) is outside the edited space\n")


def a_trial_whose_worker_died(tmp_path: Path) -> tuple[str, str, optuna.Study, optuna.Trial]:
    """Study `T` of TINY + SEARCH in a journal, with one RUNNING trial whose owner process is gone (a kill -9)."""
    import subprocess

    from energydsl.search import open_study
    from energydsl.search.report import OWNER, owner_info

    gone = subprocess.Popen(["true"])
    gone.wait()
    path, journal = write(tmp_path, TINY + SEARCH), str(tmp_path / "s.journal")
    study = open_study(journal, "T", load_search(path))
    trial = study.ask()
    load_search(path).suggest(trial)
    study._storage.set_trial_system_attr(trial._trial_id, OWNER, {**owner_info(), "pid": gone.pid})
    return path, journal, study, trial


def test_a_killed_trials_retry_outside_a_narrowed_range_samples_that_hole_afresh(tmp_path: Path, capsys) -> None:
    """A trial whose worker was killed (-9) is put back only when a run recovers it, which came after the refit:
    its retry trained outside the narrowed range, with Optuna's raw warning and no note."""
    from energydsl.search import open_study

    path, journal, study, trial = a_trial_whose_worker_died(tmp_path)
    study._storage.set_trial_param(trial._trial_id, "train.lr", 8e-3,
                                   optuna.distributions.FloatDistribution(1e-3, 1e-2, log=True))
    write(tmp_path, TINY + SEARCH.replace("1e-3..1e-2", "1e-3..5e-3"))
    study = open_study(journal, "T", load_search(path))
    assert "`train.lr` = 0.008 (now float 0.001..0.005 log) is outside the edited space" in capsys.readouterr().err
    (waiting,) = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert "train.lr" not in waiting.system_attrs["fixed_params"]


def test_a_reruns_summary_counts_the_killed_trials_it_put_back(tmp_path: Path) -> None:
    """The trials of a killed run are put back as the rerun opens the study, before its backend counts what it
    recovers: the summary said `"recovered": 0` while the rerun retried them."""
    path, journal, _, _ = a_trial_whose_worker_died(tmp_path)
    summary = run_search(path, storage=journal, study_name="T", trials=1, progress=False, json=True)
    assert summary["recovered"] == 1 and summary["lost"] == 1, summary


def test_a_rerun_that_edits_what_a_choices_option_fixes_is_refused(tmp_path: Path) -> None:
    """`momentum(beta = 0.5, eta = 1)` edited to `beta = 0.9`: Optuna records the option as `momentum` either way,
    and the text hash leaves the whole choice out, so trials of two optimizers were ranked as one. A study
    recorded before options were hashed is not compared on them."""
    from energydsl.search import open_study

    path, journal = write(tmp_path, TINY + SEARCH), str(tmp_path / "s.journal")
    study = open_study(journal, "T", load_search(path))
    study.add_trial(optuna.trial.create_trial(value=1.0))
    write(tmp_path, TINY + SEARCH.replace("momentum(beta = 0.5, eta = 1)", "momentum(beta=0.5,  eta = 1)"))
    open_study(journal, "T", load_search(path))  # spacing only
    for edit in ("momentum(beta = 0.9, eta = 1)", "momentum(beta = float 0.5..0.9, eta = 1)",
                 "momentum(beta = 0.5, eta = 2)", "momentum(beta = 0.5)"):
        write(tmp_path, TINY + SEARCH.replace("momentum(beta = 0.5, eta = 1)", edit))
        with pytest.raises(UserError, match="what a choice's options fix was edited") as e:
            open_study(journal, "T", load_search(path))
        assert "restore the space file" in (e.value.hint or ""), edit
        # the choice is named, and the error points at it (it had no place: which of a space's choices?)
        assert "(the options of `Mix.optimizer`)" in e.value.message, e.value.message
        line = next(n for n, text in enumerate(Path(path).read_text().splitlines(), 1) if "optimizer Mix:" in text)
        assert e.value.span is not None and (e.value.span.file, e.value.span.line) == (path, line), e.value.span
    legacy = dict(load_study(journal, "T").user_attrs["settings"])
    del legacy["options"]
    load_study(journal, "T").set_user_attr("settings", legacy)
    open_study(journal, "T", load_search(path))  # not compared: the study never recorded them


def test_a_rerun_whose_set_replaces_a_choice_names_only_the_setting(tmp_path: Path) -> None:
    """`--set batch=8` over `batch = choice{4, 8}` also said the choice's options were edited, with a hint to
    restore a space file that nobody had touched."""
    from energydsl.search import open_study

    path = write(tmp_path, TINY + SEARCH.replace("batch = 4", "batch = choice{4, 8}"))
    journal = str(tmp_path / "s.journal")
    open_study(journal, "T", load_search(path)).add_trial(optuna.trial.create_trial(value=1.0))
    with pytest.raises(UserError) as e:
        open_study(journal, "T", load_search(path, batch="8"))
    assert "batch_size: choice{4, 8} → 8; its trials" in e.value.message, e.value.message
    assert "options" not in e.value.message and "restore the space file" not in (e.value.hint or ""), e.value


def test_cli_bad_settings_exit_2_located(tmp_path: Path) -> None:
    path = write(tmp_path, TINY + SEARCH.replace("batch = 4", "batch = 0"))
    r = energy("search", path, "--trials", "1", cwd=tmp_path)
    assert r.returncode == 2 and "space.energy:" in r.stderr and "batch_size must be at least 1" in r.stderr
    assert "^" in r.stderr and "Traceback" not in r.stderr
    r = energy("search", write(tmp_path, TINY + SEARCH, "ok.energy"), "--set", "lr=-1", "--trials", "1",
               cwd=tmp_path)
    assert r.returncode == 2 and "--set lr=-1: lr must be above 0" in r.stderr, r.stderr
    assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------- validity, dedup, the engine


def test_invalid_candidates_are_pruned_with_their_reason(tmp_path: Path) -> None:
    newton = TINY.replace("local   s[k, j] = (W1[k] @ z) . (W2[k] @ h[j]) / T",
                          "local   s[k, j] = (W1[k] @ z) . (W2[k] @ h[j]) / T + z . z").replace(
        "  optimizer gd(eta = 1)\n}\n\nenergy FF", "  optimizer gd(eta = 1) per head\n}\n\nenergy FF")
    space = load_search(write(tmp_path, newton + """
search Bad {
  optimizer Mix: choice{ gd(eta = 1), newton(taylor = 1) }
  precondition FF: choice{ none, covariance(tau = 0.01) }
  model Tiny(d = choice{8, 6})
}
"""))
    base = {"Mix.optimizer": "gd", "FF.precondition": "none", "Tiny.d": 8}
    assert fill(space, **base).invalid_reason() is None
    why = fill(space, **{**base, "FF.precondition": "covariance"}).invalid_reason()
    assert why and "covariance(tau) needs a softmax-weighted sum" in why and "precondition covariance" in why
    why = fill(space, **{**base, "Mix.optimizer": "newton"}).invalid_reason()
    assert why and "needs each head's energy to see the state only through one linear map" in why
    why = fill(space, **{**base, "Tiny.d": 6}).invalid_reason()  # 6 / heads(2) = 3, FF hidden 12: fine ...
    assert why is None
    space6 = load_search(write(tmp_path, TINY + "search S { model Tiny(d = choice{6, 12}, heads = 4) }",
                               "shape.energy"))
    why = fill(space6, **{"Tiny.d": 6}).invalid_reason()
    assert why and "positive whole number" in why  # ... 6 / 4 heads is not
    # the reason points at the space file's line (line 3 of the dedented text: `dim dh = d / heads`), and at the
    # model's layer line that builds the energy, not at lines of the filled candidate (`<string>:41:11`)
    assert "shape.energy:3:" in why and "shape.energy:23:" in why and "<string>" not in why, why


def test_an_error_in_text_no_hole_changes_is_refused_at_its_line_before_any_trial(tmp_path: Path) -> None:
    """A typo in an energy every candidate uses made every trial invalid and the search exit 0; the mended text
    was then refused as an edit of the study. Now the space does not load: the error at its line, with a caret.
    An error of some candidates only (a hole's value) is left to the trials."""
    typo = TINY.replace("global  F = -sum(integral(relu)(W1 @ z))", "global  F = -sum(integral(relu)(W1 @ q))")
    with pytest.raises(SpecError, match="undefined name `q`") as e:
        load_search(write(tmp_path, typo + SEARCH))
    assert (e.value.span.file, e.value.span.line) == (str(tmp_path / "space.energy"), 17), e.value.span
    assert "no hole changes this line up to here" in e.value.hint
    # a hole after the error on its line (`W1 @ q)) * float 1..2`) changes none of the text up to it: refused too
    # (every trial was invalid, exit 0, where `energy check` refused the file)
    late = typo.replace("(W1 @ q))", "(W1 @ q)) * float 1..2")
    with pytest.raises(SpecError, match="undefined name `q`") as e:
        load_search(write(tmp_path, late + SEARCH, "late.energy"))
    assert (e.value.span.file, e.value.span.line) == (str(tmp_path / "late.energy"), 17), e.value.span
    (tmp_path / "lib.energy").write_text(textwrap.dedent(typo))  # in an imported file: located there
    with pytest.raises(SpecError, match="undefined name `q`") as e:
        load_search(write(tmp_path, 'import "lib.energy"\n' + SEARCH, "imports.energy"))
    assert (e.value.span.file, e.value.span.line) == (str(tmp_path / "lib.energy"), 17), e.value.span
    r = energy("search", str(tmp_path / "space.energy"), "--trials", "1", cwd=tmp_path)
    assert r.returncode == 2 and "space.energy:17:" in r.stderr and "^" in r.stderr, r.stderr
    assert not (tmp_path / "runs").exists()
    # d = 6 or 12 over 4 heads: 6 fails (6 / 4), 12 builds; with a middle value that builds, the same
    some = "search S { model Tiny(d = choice{6, 12}, heads = 4) }"
    load_search(write(tmp_path, TINY + some, "some.energy"))
    load_search(write(tmp_path, TINY + "search S { model Tiny(d = choice{6, 12, 10}, heads = 4) }", "mid.energy"))
    # the first, middle and last options fail alike at a line no hole changes, the second builds: not refused
    let = "let     v = choice{W1 @ z, z, 2 * (W1 @ z), 3 * (W1 @ z)}\n  global  F = -sum(integral(relu)(W1 @ v))"
    probed = TINY.replace("global  F = -sum(integral(relu)(W1 @ z))", let)
    assert "FF.v" in names(load_search(write(tmp_path, probed + SEARCH, "probed.energy")))
    # every value fails, each with its own numbers: a hole's business still, left to the trials
    load_search(write(tmp_path, TINY + "search S { model Tiny(d = choice{6, 10, 14}, heads = 4) }", "all.energy"))


def test_invalid_and_duplicate_candidates_cost_no_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    trained: list[str] = []

    def fake_evaluate(self: DslSpace, cand, report, device):  # the engine runs workers=1 in this process
        trained.append(cand.equation_hash())
        report(1, 3.0)
        return {"val_loss": 3.0 + len(trained) / 10, "params": 1.0}

    monkeypatch.setattr(DslSpace, "evaluate", fake_evaluate)
    path = write(tmp_path, TINY + """
search D {
  optimizer Mix: choice{ gd(eta = 1), gd, gd(eta = 2 / 2) }
  precondition FF: choice{ none, covariance }
  data shakespeare_char, steps 4
  trials 8
}
""")
    s = run_search(path, trials=8, storage=str(tmp_path / "s.journal"), study_name="d", progress=False, json=True,
                   sampler="random", seed=1, pruner="none")
    assert s["finished"] == 8
    ts = load_study(str(tmp_path / "s.journal"), "d").get_trials()
    kinds = [t.user_attrs["kind"] for t in ts]
    invalid = [t for t in ts if t.user_attrs["kind"] == "invalid"]
    assert all(t.params["FF.precondition"] == "covariance" for t in invalid)
    assert len(invalid) == sum(t.params["FF.precondition"] == "covariance" for t in ts)
    assert all("covariance" in t.user_attrs["reason"] for t in invalid)
    # the three ways of writing gd(eta = 1) derive the same equations: one training run in all
    assert len(trained) == 1 and kinds.count("complete") == 1
    assert kinds.count("duplicate") == 8 - len(invalid) - 1


def test_equation_hash_sees_what_training_depends_on(tmp_path: Path) -> None:
    space = load_search(write(tmp_path, TINY + """
search H {
  optimizer Mix: choice{ gd(eta = 1), gd, gd(eta = 0.5), momentum(beta = 0.5 learn, eta = 1),
                         momentum(beta = 0.9 learn, eta = 1) }
  data shakespeare_char, steps 4
  train lr = choice{0.001, 0.002}
}
"""))

    def h(opt: str, lr: float = 0.001) -> str:
        return fill(space, **{"Mix.optimizer": opt, "train.lr": lr}).equation_hash()

    assert h("gd(eta = 1)") == h("gd")
    assert h("gd(eta = 1)") != h("gd(eta = 0.5)")
    assert h("momentum(beta = 0.5 learn, eta = 1)") != h("momentum(beta = 0.9 learn, eta = 1)")  # learned init
    assert h("gd") != h("gd", 0.002)  # training settings too
    cand = fill(space, **{"Mix.optimizer": "gd", "train.lr": 0.001})
    assert cand.equations_mathml().count("<math") >= 4 and "<h5>Mix</h5>" in cand.equations_mathml()


# ----------------------------------------------------------------------------- the shipped spaces


def test_quickstart_space() -> None:
    space = load_search(ROOT / "search" / "quickstart.energy")
    assert space.name == "Quickstart" and space.objectives == [("val_loss", "minimize")]
    assert space.budget["trials"] == 4 and space.budget["steps"] <= 100
    assert set(names(space)) == {"TinyGPT.d", "TinyGPT.layers", "MHA.optimizer", "TinyGPT.across",
                                 "TinyGPT.across.momentum.beta", "TinyGPT.across.nag.beta", "train.lr"}
    cand = fill(space, **{"TinyGPT.d": 32, "TinyGPT.layers": 1, "MHA.optimizer": "momentum",
                          "TinyGPT.across": "nag", "TinyGPT.across.nag.beta": 0.8, "train.lr": 0.003})
    plan = energydsl.load(cand.source()).plan("TinyGPT")
    assert plan.across[0] == "nag" and plan.d == 32


def test_attention_zoo_has_the_rotary_score() -> None:
    """RoFormer's score is one of the zoo's: a candidate with it passes its checks and runs as fused attention."""
    from energydsl.codegen import energy_source

    space = load_search(ROOT / "search" / "attention-zoo.energy")
    score = "rope(q[k], i) . rope(key[k, j], j)"
    assert score in dict((n, v) for n, v, _ in space.describe())["Attention.s"]
    cand = fill(space, **{"Attention.s": score, "Attention.steps": 1, "Attention.optimizer": "gd",
                          "Attention.precondition": "none", "MLP.F": "-sum(integral(gelu)(W1 @ z))",
                          "ZooGPT.d": 256, "ZooGPT.layers": 4, "ZooGPT.heads": 4, "ZooGPT.across": "none",
                          "train.lr": 0.001})
    derived = energydsl.load(cand.source()).energy("Attention")
    assert all(r.status != "fail" for r in derived.check())
    forward = energy_source(derived).split("def forward")[1]
    assert "softmax_attention(" in forward and "rope(" in forward and "masked_" not in forward


def test_attention_zoo_space() -> None:
    space = load_search(ROOT / "search" / "attention-zoo.energy")
    assert space.objectives == [("val_loss", "minimize"), ("params", "minimize")]
    assert space.budget["steps"] >= 1000
    holes = dict((n, v) for n, v, _ in space.describe())
    assert holes["Attention.optimizer"] == "choice{gd, momentum, nag, newton}"
    assert holes["Attention.precondition"] == "choice{none, scalar, diag, psd, dplr, covariance}"
    assert holes["ZooGPT.across"] == "choice{none, momentum, nag}" and "Attention.steps" in holes
    cand = fill(space, **{"Attention.s": "-0.5 * (q[k] - key[k, j]) . (q[k] - key[k, j])", "Attention.steps": 1,
                          "Attention.optimizer": "newton", "Attention.optimizer.newton.taylor": 1,
                          "Attention.precondition": "none", "MLP.F": "-sum(integral(silu)(W1 @ z))",
                          "ZooGPT.d": 384, "ZooGPT.layers": 6, "ZooGPT.heads": 8, "ZooGPT.across": "none",
                          "train.lr": 0.001})
    spec = energydsl.load(cand.source())
    assert spec.energy("Attention").spec.optimizer.kind == "newton"
    assert spec.plan("ZooGPT").d == 384
    # the l2 score with Newton per head is seed 004's MHA2nd1st (Eq 23 with its sign erratum), at T = sqrt(dh)
    # and with the space's untie: Wo = -W1^T (untie absorbs the sign), Wv = W2 give the tied layer
    import math

    import torch

    B, T, d, H = 2, 6, 8, 4
    torch.manual_seed(0)
    layer = spec.module("Attention", d=d, heads=H).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
        layer.Wo.copy_(-layer.W1.transpose(1, 2))
        layer.Wv.copy_(layer.W2)
    x = torch.randn(B, T, d, dtype=torch.float64)
    W1, W2, tau = layer.W1.detach(), layer.W2.detach(), math.sqrt(d / H)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    want = x.clone()
    for k in range(H):
        q, key = x @ W1[k].T, x @ W2[k].T
        scores = -0.5 * ((q[:, :, None] - key[:, None]) ** 2).sum(-1) / tau
        p = torch.softmax(scores.masked_fill(~causal, -math.inf), -1)
        u = q - p @ key  # q - kbar
        centred = key[:, None] - (p @ key)[:, :, None]  # k_j - kbar_i
        Su = torch.einsum("bij,bijm,bijn,bin->bim", p, centred, centred, u)
        want -= (u + Su / tau) @ (W1[k].T @ torch.linalg.inv(W1[k] @ W1[k].T)).T / H
    got = layer(x).detach()
    assert (got - want).norm() / want.norm() < 1e-12
    # covariance on a Newton step is refused by the language: pruned before any training, with the reason
    covariant = fill(space, **{**cand.params, "Attention.precondition": "covariance"})
    assert "`precondition covariance` needs a first-order optimizer" in covariant.invalid_reason()


# ----------------------------------------------------------------------------- command line



def energy(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return energy_in_process(*args, cwd=cwd)


def test_cli_errors_exit_2(tmp_path: Path) -> None:
    r = energy("search", "nope.energy", cwd=tmp_path)
    assert r.returncode == 2 and "no such search space file" in r.stderr
    r = energy("search", "tooy", cwd=tmp_path)  # a registered space's name, misspelt
    assert r.returncode == 2 and "did you mean the registered space `toy`?" in r.stderr, r.stderr
    path = write(tmp_path, TINY + "search T {\n  objective minimize accuracy\n}\n")
    r = energy("search", path, "--json", cwd=tmp_path)
    assert r.returncode == 2 and "unknown objective `accuracy`" in r.stderr and "space.energy:" in r.stderr
    r = energy("search", write(tmp_path, TINY + SEARCH, "ok.energy"), "--set", "steps", cwd=tmp_path)
    assert r.returncode == 2 and "expected KEY=VALUE" in r.stderr
    r = energy("report", "NoSuchStudy", cwd=tmp_path)
    assert r.returncode == 2 and "no study 'NoSuchStudy'" in r.stderr
    r = energy("report", "runs/gone", cwd=tmp_path)  # a path: it said "looked for runs/runs_gone/optuna.journal"
    assert r.returncode == 2 and "no study journal at runs/gone: no such file or run directory" in r.stderr, r.stderr
    r = energy("search", "os:path", cwd=tmp_path)  # an importable object that is not a search space
    assert r.returncode == 2 and "is not a search space: it has no name, objectives, budget" in r.stderr, r.stderr


def test_cli_lists_holes(tmp_path: Path) -> None:
    r = energy("search", str(ROOT / "search" / "quickstart.energy"), "--holes", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert {"name": "TinyGPT.layers", "values": "int 1..2"} == {k: rows[2][k] for k in ("name", "values")}


def test_cli_search_runs_resumes_and_reports(tmp_path: Path) -> None:
    path = write(tmp_path, TINY + SEARCH)
    r = energy("search", path, "--trials", "2", "--json", "--sampler", "random", "--seed", "3", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["finished"] == 2 and s["completed"] + s["pruned"] + s["failed"] == 2 and s["failed"] == 0
    assert {"completed", "pruned", "failed", "best"} <= set(s)
    run = tmp_path / "runs" / "T"
    assert s["storage"] == str(run / "optuna.journal") and Path(s["report"]) == run / "report.html"
    assert (run / "report.html").read_text().count("<details") == 2
    best = Path(s["best_source"]).read_text()
    assert "search T" not in best and energydsl.load(best).model_names == ["Tiny"]
    r = energy("search", path, "--trials", "3", "--json", cwd=tmp_path)  # continues the same study
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["finished"] == 3 and len(load_study(s["storage"], "T").get_trials()) == 3
    r = energy("report", "T", "-o", "out.html", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out.html").exists() and "top" in r.stdout and "top" not in r.stderr  # `> board.txt` keeps it
    r = energy("report", str(run / "optuna.journal"), "--export", "best.energy", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (run / "report.html").exists() and (tmp_path / "best.energy").exists()
    r = energy("report", "runs/T", "-o", "dir.html", cwd=tmp_path)  # the run directory: its journal
    assert r.returncode == 0 and (tmp_path / "dir.html").exists(), r.stderr
    r = energy("report", "runs", cwd=tmp_path)  # a directory without a journal in it
    assert r.returncode == 2 and "runs is a directory without a study journal" in r.stderr, r.stderr


def test_quickstart_end_to_end(tmp_path: Path) -> None:
    """`energy search search/quickstart.energy --trials 2 --json`, then once more: the study continues."""
    space = str(ROOT / "search" / "quickstart.energy")
    tiny = ["--set", "steps=6", "--set", "eval_interval=3", "--set", "eval_iters=2"]
    r = energy("search", space, "--trials", "2", "--json", *tiny, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["finished"] == 2 and s["failed"] == 0 and s["best"] is not None
    r = energy("search", space, "--trials", "3", "--json", *tiny, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["finished"] == 3 and s["study"] == "Quickstart"
    metrics = [t.user_attrs.get("metrics", {}) for t in load_study(s["storage"], "Quickstart").get_trials()]
    assert any({"val_loss", "params", "flops_per_token", "step_time"} <= set(m) for m in metrics)



IDLE = """
search Idle {
  model Tiny(d = 8)
  optimizer Mix: momentum(beta = 0.5 learn, eta = 1)
  data shakespeare_char, steps 6
  train lr = 1e-3, batch = 4, eval_interval = 3, eval_iters = 1
  trials 1
}
"""


def test_a_trials_training_notices_are_kept_on_it_and_in_the_report(tmp_path: Path) -> None:
    """A learned momentum beta with one step never trains (the velocity starts at 0): training's notice was a raw
    Python warning on stderr, lost with workers or Ray, and neither the trial nor the report kept it."""
    path = write(tmp_path, TINY + IDLE)
    r = energy("search", path, "--json", cwd=tmp_path)
    assert r.returncode == 0 and "UserWarning" not in r.stderr, r.stderr
    s = json.loads(r.stdout)
    trial = next(t for t in load_study(s["storage"], "Idle").get_trials() if t.user_attrs.get("metrics"))
    notes = trial.user_attrs["metrics"]["notes"]
    assert any("got no gradient" in note and "opt_beta" in note for note in notes), notes
    page = Path(s["report"]).read_text()
    assert "<b>note:</b>" in page and "opt_beta" in page
    assert trial.user_attrs["metrics"]["threads"] >= 1  # what a bit-for-bit rerun on the CPU needs

"""What a search remembers between candidates: shared derivations (`energydsl.derived.derive`) and check
verdicts (`energydsl.search.stagecheck`). Reused results must be exactly what a fresh derivation gives
the candidate that reads them, down to the source positions its error messages cite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import optuna
import pytest

import energydsl
from energydsl import derived
from energydsl.derived import Derived, declaration_key, derive
from energydsl.errors import SpecError
from energydsl.optimizers import build_program
from energydsl.search import stagecheck
from energydsl.search.dsl import DslSpace, load_search
from energydsl.semantics import lower_energy

ROOT = Path(__file__).resolve().parents[1]

# `Mix.T` has a short and a long option: the long one takes an extra line in the candidate's header
# comment, so `FF` (the same text in both) stands one line lower. FF's `expect` is false on purpose.
SPACE = """
energy Mix(d = 4, heads = 2) {
  dim     dh = d / heads
  state   z[d]
  context h[j, d] where j <= i
  param   W1[heads, dh, d] ~ normal(0, 0.02)
  param   W2[heads, dh, d] ~ normal(0, 0.02)
  let     T = choice{sqrt(dh), sqrt(dh) * (1 + 0 * (dh + dh + dh + dh + dh + dh + dh + dh + dh + dh + dh + dh + dh))}
  local   s[k, j] = (W1[k] @ z) . (W2[k] @ h[j]) / T
  global  F = -(T / heads) * sum[k](logsumexp[j](s[k, j]))
  optimizer gd(eta = 1)
}

energy FF(d = 4, hidden = 8) {
  state   z[d]
  param   W1[hidden, d] ~ normal(0, 0.02)
  global  F = -sum(integral(relu)(W1 @ z))
  optimizer gd(eta = 1)
  expect  gradient = z
}

model Tiny(vocab = 8192, context = 64, d = 8, layers = 1, heads = 2) {
  embed tokens, positions
  layer = Mix(d, heads) -> FF(d, hidden = 2 * d)
  repeat layers
  head tied
}

search S {
  data mqar, steps 4
  train lr = choice{0.001, 0.002}
}
"""

MIX = textwrap.dedent(SPACE.split("energy FF")[0].replace(
    "choice{sqrt(dh), sqrt(dh) * (1 + 0 * (dh + dh + dh + dh + dh + dh + dh + dh + dh + dh + dh + dh + dh))}",
    "sqrt(dh)"))
FF = "energy FF" + SPACE.split("energy FF")[1].split("model Tiny")[0]


@pytest.fixture(autouse=True)
def fresh_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Empty memories and a check cache of this test's own."""
    where = tmp_path / "checks"
    monkeypatch.setenv("ENERGYDSL_CHECK_CACHE", str(where))
    monkeypatch.setattr(stagecheck, "_MEMORY", {})
    monkeypatch.setattr(derived, "_DERIVED", type(derived._DERIVED)())
    return where


@pytest.fixture
def check_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The energies `Derived.check` really ran on."""
    calls: list[str] = []
    real = Derived.check
    monkeypatch.setattr(Derived, "check", lambda self: calls.append(self.name) or real(self))
    return calls


@pytest.fixture
def space(tmp_path: Path) -> DslSpace:
    path = tmp_path / "space.energy"
    path.write_text(SPACE)
    return load_search(str(path))


def candidate(space: DslSpace, long_t: bool = False, lr: float = 0.001) -> Any:
    labels = [o.label for h in space.holes() if h.name == "Mix.T" for o in h.options]
    return space.suggest(optuna.trial.FixedTrial({"Mix.T": labels[int(long_t)], "train.lr": lr}))


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), start=1) if needle in line)


def fresh(decl: Any, dims: dict[str, float]) -> Derived:
    spec = lower_energy(decl, dims)
    return Derived(spec, build_program(spec))


def spans(d: Derived) -> list[Any]:
    spec = d.spec
    out = [spec.span, spec.optimizer.span]
    out += [(n, p.span) for n, p in sorted(spec.params.items())]
    out += [(n, p.span) for n, p in sorted(d.program.params.items())]
    out += [(n, s) for n, (_, s) in sorted(spec.expects.items())]
    return [(x, str(x)) for x in out]


# ----------------------------------------------------------------------------- shared derivations


def test_a_shared_derivation_is_what_a_fresh_one_gives(space: DslSpace) -> None:
    """The second candidate repeats the first one's energies at the same places: it gets the same Derived
    objects, equal (equations, hash, spans) to deriving its own declarations afresh."""
    a, b = candidate(space, lr=0.001), candidate(space, lr=0.002)
    assert a.source() != b.source()
    da, db = a.model().derived, b.model().derived
    assert [x is y for x, y in zip(da, db, strict=True)] == [True, True]  # reused, not re-derived
    for stage, shared in zip(b.model().plan.stages, db, strict=True):
        new = fresh(stage.decl, stage.dims)
        assert shared.equations("text") == new.equations("text")
        assert shared.equations("mathml") == new.equations("mathml")
        assert shared.equation_hash() == new.equation_hash()
        assert shared.spec.dims() == new.spec.dims()
        assert spans(shared) == spans(new)
    # the candidate's hash (what deduplication compares) does not depend on what was cached before
    warm = b.equation_hash()
    derived._DERIVED.clear()
    b2 = candidate(space, lr=0.002)
    assert b2.model().derived[0] is not db[0] and b2.equation_hash() == warm


def test_the_same_text_elsewhere_is_derived_again_with_its_own_spans(space: DslSpace) -> None:
    a, b = candidate(space), candidate(space, long_t=True)
    ff_a, ff_b = a.model().derived[1], b.model().derived[1]
    assert ff_a.spec.source == ff_b.spec.source  # the same declaration text ...
    assert line_of(b.source(), "energy FF") == line_of(a.source(), "energy FF") + 1  # ... one line lower
    assert ff_a is not ff_b
    assert ff_a.spec.span.line == line_of(a.source(), "energy FF")
    assert ff_b.spec.span.line == line_of(b.source(), "energy FF")
    stage = b.model().plan.stages[1]
    assert spans(ff_b) == spans(fresh(stage.decl, stage.dims))


def test_dims_are_part_of_the_key() -> None:
    decl = energydsl.load(MIX).syntax.energies["Mix"]
    d8, d16 = derive(decl, {"d": 8}), derive(decl, {"d": 16})
    assert d8 is not d16 and d8 is derive(decl, {"d": 8.0})
    assert d8.spec.dim_values["d"] == 8 and d16.spec.dim_values["d"] == 16
    assert d8.equation_hash() == fresh(decl, {"d": 8}).equation_hash() != d16.equation_hash()


def test_declaration_key_sees_positions_not_just_text() -> None:
    one = energydsl.load(MIX).syntax.energies["Mix"]
    same = energydsl.load(MIX).syntax.energies["Mix"]
    lower = energydsl.load("\n" + MIX).syntax.energies["Mix"]
    right = energydsl.load(MIX.replace("\nenergy Mix", "\n  energy Mix")).syntax.energies["Mix"]
    assert declaration_key(one) == declaration_key(same)
    assert one.source_text == lower.source_text == right.source_text
    assert declaration_key(one) != declaration_key(lower)
    assert declaration_key(one) != declaration_key(right)


def test_failures_are_not_remembered_and_cite_their_own_place() -> None:
    bad = FF.replace("optimizer gd(eta = 1)", "optimizer gd(eta = 1), precondition covariance(tau = 0.01)")
    lines = []
    for pad in ("", "\n\n\n"):
        decl = energydsl.load(pad + bad).syntax.energies["FF"]
        with pytest.raises(SpecError) as e:
            derive(decl, {})
        lines.append(e.value.span.line)
    assert lines[1] == lines[0] + 3 and not derived._DERIVED


def test_the_memo_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(derived, "DERIVE_MEMO_SIZE", 2)
    decl = energydsl.load(MIX).syntax.energies["Mix"]
    first = derive(decl, {"d": 4})
    derive(decl, {"d": 8})
    derive(decl, {"d": 16})
    assert len(derived._DERIVED) == 2 and derive(decl, {"d": 4}) is not first


# ----------------------------------------------------------------------------- check verdicts


def test_an_invalid_candidate_quotes_its_clause(space: DslSpace, check_calls: list[str]) -> None:
    """FF's false `expect` is refuted in both candidates, whose clause sits on different lines of the filled
    text. The reason quotes the clause: `<string>:10:3` named a line of a text the search file does not have."""
    a, b = candidate(space), candidate(space, long_t=True)
    why_a, why_b = a.invalid_reason(), b.invalid_reason()
    at_a, at_b = line_of(a.source(), "expect  gradient"), line_of(b.source(), "expect  gradient")
    assert at_b == at_a + 1
    assert why_a and "`expect gradient` is refuted at `expect gradient = z`: seed" in why_a
    assert why_a == why_b and "<string>" not in why_a
    # a third candidate with FF where the first one had it reads the first one's verdict
    before = list(check_calls)
    assert candidate(space, lr=0.002).invalid_reason() == why_a
    assert check_calls == before


def test_verdicts_are_shared_through_the_disk(fresh_caches: Path, check_calls: list[str]) -> None:
    decl = energydsl.load(FF).syntax.energies["FF"]
    reason = stagecheck.stage_check(decl, {"d": 32.0, "hidden": 64.0})
    assert reason and "refuted" in reason and check_calls == ["FF"]
    files = list(fresh_caches.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["reason"] == reason
    stagecheck.forget()  # as another process would start
    assert stagecheck.stage_check(decl, {"d": 32.0, "hidden": 64.0}) == reason
    assert check_calls == ["FF"]
    # a fresh check, nothing cached anywhere, says the same
    stagecheck.forget()
    for f in files:
        f.unlink()
    assert stagecheck.stage_check(decl, {"d": 32.0, "hidden": 64.0}) == reason
    assert check_calls == ["FF", "FF"]


def test_a_verdict_written_by_another_process_is_read(fresh_caches: Path, check_calls: list[str]) -> None:
    script = (f"import energydsl; from energydsl.search.stagecheck import stage_check; "
              f"d = energydsl.load({MIX!r}).syntax.energies['Mix']; print(stage_check(d, {{'d': 16.0}}))")
    env = {**os.environ, "ENERGYDSL_CHECK_CACHE": str(fresh_caches)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stderr[-2000:]
    assert len(list(fresh_caches.glob("*.json"))) == 1
    decl = energydsl.load(MIX).syntax.energies["Mix"]
    assert stagecheck.stage_check(decl, {"d": 16.0}) is None
    assert check_calls == []


def test_unreadable_or_foreign_files_are_ignored(fresh_caches: Path, check_calls: list[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    decl = energydsl.load(MIX).syntax.energies["Mix"]
    assert stagecheck.stage_check(decl, {"d": 8.0}) is None
    (file,) = fresh_caches.glob("*.json")
    file.write_text('{"format": 1, "fits": true, "reason": "planted"')  # cut short
    stagecheck.forget()
    assert stagecheck.stage_check(decl, {"d": 8.0}) is None
    assert len(check_calls) == 2
    # a well-formed file is trusted by its name, a hash that covers the compiler's version: another
    # version (here another file format) looks under another name
    file.write_text(json.dumps({"format": 1, "energy": "Mix", "fits": True, "reason": "planted"}))
    stagecheck.forget()
    assert stagecheck.stage_check(decl, {"d": 8.0}) == "planted"
    stagecheck.code_version.cache_clear()
    monkeypatch.setattr(stagecheck, "FORMAT", 2)
    stagecheck.forget()
    try:
        assert stagecheck.stage_check(decl, {"d": 8.0}) is None
    finally:
        stagecheck.code_version.cache_clear()
    assert len(check_calls) == 3


def test_off_keeps_verdicts_in_memory_only(fresh_caches: Path, check_calls: list[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENERGYDSL_CHECK_CACHE", "off")
    decl = energydsl.load(MIX).syntax.energies["Mix"]
    assert stagecheck.stage_check(decl, {"d": 8.0}) is None
    assert stagecheck.stage_check(decl, {"d": 8.0}) is None
    assert check_calls == ["Mix"] and not fresh_caches.exists()


def test_widths_that_shrink_alike_share_one_check(check_calls: list[str]) -> None:
    """Checks run at shrunk dims, so d = 32 and d = 64 prove the same derivation: it is checked once."""
    decl = energydsl.load(MIX).syntax.energies["Mix"]
    assert stagecheck.stage_check(decl, {"d": 32.0, "heads": 2.0}) is None
    assert stagecheck.stage_check(decl, {"d": 64.0, "heads": 2.0}) is None
    assert len(check_calls) == 1
    # d = 6 shrinks to 3, which 2 heads do not divide: checked at d = 6 itself, another check ...
    assert stagecheck.stage_check(decl, {"d": 6.0, "heads": 2.0}) is None
    assert len(check_calls) == 2
    # ... and what does not derive is remembered too: from the disk, no check and no new verdict
    stagecheck.forget()
    assert stagecheck.stage_check(decl, {"d": 6.0, "heads": 2.0}) is None
    assert len(check_calls) == 2


def test_real_dims_that_do_not_derive_raise_with_the_candidates_place() -> None:
    decl = energydsl.load("\n\n" + MIX).syntax.energies["Mix"]
    for _ in range(2):  # the second time the shrunk dims are known not to fit: the real ones still raise
        with pytest.raises(SpecError) as e:
            stagecheck.stage_check(decl, {"d": 3.0, "heads": 2.0})
        assert e.value.span is not None and e.value.span.line == line_of("\n\n" + MIX, "dim     dh")


def test_a_verdict_depends_on_the_code_generator() -> None:
    """The `compiled` row runs the generated layer: a verdict read back after a change to the code generator or
    the ops its layers call would be one the new compiler never gave (only the top level was hashed)."""
    names = {path.relative_to(Path(stagecheck.__file__).parent.parent).as_posix()
             for path in stagecheck.verdict_sources()}
    assert {"codegen/torch_module.py", "runtime/ops.py", "checks.py", "search/stagecheck.py"} <= names

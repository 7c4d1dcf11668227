"""The search engine on the toy space: budgets, validity, deduplication, failures, resume, kill -9,
several processes on one study, Ray (local runtime and a simulated two-node cluster), the report.

Evaluate calls are counted through a file the toy appends to, since workers are other processes.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from energydsl.search import (
    SpaceRef,
    export_best,
    load_study,
    open_storage,
    resolve_space,
    run_search,
    write_report,
)
from energydsl.search.report import OWNER, ledger

TOY = "energydsl.search.toy:make_space"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def ray_started_here():
    """For a test that starts Ray itself (`ray.init`, a `Cluster`): Ray's SIGTERM handler, which `ray.shutdown`
    leaves behind, is taken away with it, so that a later test in this process (training's SIGTERM) sees its own."""
    from energydsl.search.ray_backend import TUNE_SIGNALS
    from energydsl.signal_handlers import handlers_restored

    with handlers_restored(*TUNE_SIGNALS):
        yield pytest.importorskip("ray")


def toy(tmp_path: Path, **sets: object) -> SpaceRef:
    base = {"calls": str(tmp_path / "calls.txt"), "sleep": "0.01"}
    base.update({k: str(v) for k, v in sets.items()})
    return SpaceRef(TOY, base)


def search(tmp_path: Path, ref: SpaceRef, **kw: object) -> dict:
    kw.setdefault("storage", str(tmp_path / "study.journal"))
    kw.setdefault("study_name", "t")
    kw.setdefault("progress", False)
    kw.setdefault("json", True)
    return run_search(ref, **kw)  # type: ignore[arg-type]


def trials(tmp_path: Path, name: str = "t") -> list[optuna.trial.FrozenTrial]:
    return load_study(str(tmp_path / "study.journal"), name).get_trials()


def calls(tmp_path: Path) -> list[list[str]]:
    f = tmp_path / "calls.txt"
    return [line.split() for line in f.read_text().splitlines()] if f.exists() else []


def test_space_ref_pickles_and_resolves(tmp_path: Path) -> None:
    ref = toy(tmp_path)
    space = resolve_space(pickle.loads(pickle.dumps(ref)))
    assert space.objectives == [("val_loss", "minimize")]
    assert resolve_space(SpaceRef("toy")).name == "toy"  # registered name


def test_local_search_counts(tmp_path: Path) -> None:
    s = search(tmp_path, toy(tmp_path), trials=10, pruner="none", sampler="random", seed=3)
    ts = trials(tmp_path)
    assert len(ts) == 10 and s["finished"] == 10
    assert s["completed"] == sum(t.state == TrialState.COMPLETE for t in ts)
    assert s["pruned"] == sum(t.state == TrialState.PRUNED for t in ts)
    assert s["failed"] == sum(t.state == TrialState.FAIL for t in ts)
    assert s["completed"] >= 1 and s["best"]["params"] and "val_loss" in s["best"]["values"]
    for t in ts:
        assert t.user_attrs["kind"] in {"complete", "duplicate", "invalid", "error"}
        if t.user_attrs["kind"] == "complete":
            assert {"source", "equations_mathml", "equation_hash", "curve", "metrics"} <= set(t.user_attrs)
            assert len(t.user_attrs["curve"]) == 4 and t.user_attrs["metrics"]["val_loss"] == t.values[0]


def test_invalid_candidates_are_never_evaluated(tmp_path: Path) -> None:
    ref = toy(tmp_path, mixers="ssm,bogus")
    s = search(tmp_path, ref, trials=10, pruner="none", sampler="random", seed=1)
    ts = trials(tmp_path)
    invalid = [t for t in ts if t.user_attrs.get("kind") == "invalid"]
    assert invalid and s["invalid"] == len(invalid)
    assert all(t.state == TrialState.PRUNED and "bogus" in t.user_attrs["reason"] for t in invalid)
    evaluated = calls(tmp_path)
    assert all(c[2] != "bogus" for c in evaluated)
    assert len(evaluated) == sum(t.user_attrs.get("kind") in ("complete", "error") for t in ts)


def test_duplicates_share_one_result(tmp_path: Path) -> None:
    s = search(tmp_path, toy(tmp_path, mixers="attn,attn_alias", depth=2, lr=0.01), trials=5, pruner="none")
    ts = trials(tmp_path)
    assert len(calls(tmp_path)) == 1  # one training for five candidates with the same equations
    assert s["completed"] == 5 and s["duplicates"] == 4
    first = ts[0]
    assert {t.values[0] for t in ts} == {first.values[0]}
    assert all(t.user_attrs["duplicate_of"] == first.number for t in ts[1:])


def test_parallel_workers_train_a_candidate_once(tmp_path: Path) -> None:
    """With two workers, a candidate drawn while the other worker trained the same equations trained again: the
    later trial now waits for the earlier one and takes its result."""
    s = search(tmp_path, toy(tmp_path, mixers="attn,attn_alias", depth=2, lr=0.01, sleep=0.3), trials=4,
               workers=2, pruner="none")
    assert len(calls(tmp_path)) == 1, calls(tmp_path)
    assert s["completed"] == 4 and s["duplicates"] == 3


def test_a_later_trial_waits_for_an_earlier_one_still_deriving_its_equations(tmp_path: Path) -> None:
    """The race behind a candidate trained twice: the earlier trial had not yet recorded its equation hash when
    the later one (same equations, derived faster) looked for a running twin, so neither waited for the other."""
    import threading

    from energydsl.search.local import same_when_done
    from energydsl.search.report import HASH, owner_info

    storage = open_storage(str(tmp_path / "study.journal"))
    study = optuna.create_study(storage=storage, study_name="t")
    for _ in range(2):
        study.add_trial(optuna.trial.create_trial(state=TrialState.WAITING))
    earlier, later = (t._trial_id for t in study.get_trials())
    for tid in (earlier, later):
        storage.set_trial_state_values(tid, TrialState.RUNNING)
        storage.set_trial_system_attr(tid, OWNER, owner_info())
    storage.set_trial_user_attr(later, HASH, "h")

    def earlier_derives_then_trains() -> None:
        time.sleep(0.3)
        storage.set_trial_user_attr(earlier, HASH, "h")
        time.sleep(0.3)
        study.tell(0, [1.0])

    worker = threading.Thread(target=earlier_derives_then_trains)
    worker.start()
    same = same_when_done(study, storage, "h", 1, poll=0.05)
    worker.join()
    assert same is not None and same.number == 0 and same.values == [1.0]


def test_pruned_duplicates_are_counted_as_duplicates(tmp_path: Path) -> None:
    """A duplicate of a pruned trial is pruned too, and counted among the pruned trials' duplicates."""
    study = optuna.create_study(storage=open_storage(str(tmp_path / "study.journal")), study_name="t")
    C, P = TrialState.COMPLETE, TrialState.PRUNED
    for state, kind in [(C, "complete"), (C, "duplicate"), (P, "pruned"), (P, "duplicate"), (P, "duplicate"),
                        (P, "invalid")]:
        study.add_trial(optuna.trial.create_trial(state=state, value=1.0 if state == C else None,
                                                  intermediate_values={} if state == C else {10: 2.0},
                                                  user_attrs={"kind": kind}))
    led = ledger(study.get_trials())
    assert (led.completed, led.duplicates, led.pruned, led.invalid, led.pruned_duplicates) == (2, 1, 4, 1, 2)
    page = write_report(str(tmp_path / "study.journal"), "t", tmp_path / "r.html").read_text()
    assert "2 complete (1 duplicates), 4 pruned (1 invalid, 2 duplicates)" in page


def test_failing_trial_is_recorded_and_study_continues(tmp_path: Path) -> None:
    ref = toy(tmp_path, mixers="diverge,ssm")
    s = search(tmp_path, ref, trials=8, pruner="none", sampler="random", seed=0)
    ts = trials(tmp_path)
    failed = [t for t in ts if t.state == TrialState.FAIL]
    assert failed and s["failed"] == len(failed) and s["completed"] >= 1
    assert all("diverged" in t.user_attrs["reason"] and t.user_attrs["kind"] == "error" for t in failed)
    assert any(t.number > failed[0].number for t in ts)  # trials went on after the first failure


def test_pruning_records_pruned_trials(tmp_path: Path) -> None:
    s = search(tmp_path, toy(tmp_path, mixers="ssm,attn"), trials=12, pruner="asha", seed=0)
    ts = trials(tmp_path)
    pruned = [t for t in ts if t.user_attrs.get("kind") == "pruned"]
    assert s["finished"] == 12 and s["pruned"] == len(pruned)
    assert all(t.intermediate_values and len(t.user_attrs["curve"]) < 4 for t in pruned)
    # the pruner sees what the trial measured: its curve, step by step, and a pruned trial's value is its last
    assert all(t.intermediate_values == {step: v for step, v in t.user_attrs["curve"]} for t in ts)
    assert all(t.user_attrs["curve"][-1][1] == t.intermediate_values[max(t.intermediate_values)] for t in pruned)


@pytest.mark.parametrize(("objectives", "prunes"), [
    ([("val_loss", "minimize")], True), ([("best_val_loss", "minimize")], True),
    ([("params", "minimize")], False),  # ASHA compared val_loss curves and stored a val_loss as the params value
    ([("flops_per_token", "minimize")], False), ([("val_loss", "maximize")], False),
    ([("val_loss", "minimize"), ("params", "minimize")], False),
])
def test_pruning_applies_only_where_the_reports_stand_for_the_objective(objectives, prunes) -> None:
    from energydsl.search.local import pruning_plan

    prune, note = pruning_plan(objectives, "asha")
    assert prune is prunes and (note is None) is prunes
    assert pruning_plan(objectives, "none") == (False, None)


def test_resume_continues_the_study(tmp_path: Path) -> None:
    ref = toy(tmp_path)
    search(tmp_path, ref, trials=4, pruner="none", seed=0)
    before = {t.number: (t.state, t.values, t.params) for t in trials(tmp_path)}
    s = search(tmp_path, ref, trials=7, pruner="none", seed=1)
    ts = trials(tmp_path)
    assert s["finished"] == 7 and [t.number for t in ts] == list(range(7))
    assert {t.number: (t.state, t.values, t.params) for t in ts if t.number in before} == before
    assert search(tmp_path, ref, trials=7)["finished"] == 7  # reached already: nothing more runs


def test_sqlite_url_storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # nothing of the study goes to the working directory (the lock: next to the db)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    ref = toy(tmp_path, mixers="ssm,attn")
    assert run_search(ref, storage=url, study_name="q", trials=3, progress=False, json=True)["finished"] == 3
    s = run_search(ref, storage=url, study_name="q", trials=5, progress=False, json=True)
    ts = optuna.load_study(study_name="q", storage=url).get_trials()
    assert s["finished"] == 5 and len(ts) == 5 and ledger(ts).finished == 5


def test_timeout_stops_starting_trials(tmp_path: Path) -> None:
    ref = toy(tmp_path, mixers="ssm,attn", sleep=0.05)
    s = search(tmp_path, ref, trials=1000, timeout=1.0, pruner="none")
    ts = trials(tmp_path)
    assert 1 <= s["finished"] < 20 and s["running"] == 0 and s["elapsed_s"] < 5
    assert len(ts) <= s["finished"] + 2  # only a few slots were opened ahead, not the whole budget
    assert search(tmp_path, ref, trials=s["finished"] + 2, pruner="none")["finished"] == s["finished"] + 2


def test_other_objectives_on_the_same_study_are_refused(tmp_path: Path) -> None:
    from energydsl.errors import UserError

    search(tmp_path, toy(tmp_path), trials=1)
    with pytest.raises(UserError, match="searches"):
        search(tmp_path, toy(tmp_path, objectives="val_loss,params"), trials=2)


@pytest.mark.slow
def test_a_candidate_that_kills_its_worker_is_retried_then_failed(tmp_path: Path) -> None:
    s = search(tmp_path, toy(tmp_path, mixers="crash"), trials=1, workers=2, pruner="none")
    ts = trials(tmp_path)
    assert s["finished"] == 1 and s["failed"] == 1 and s["lost"] == 2 and s["worker_crashes"] == 3
    assert "given up after 3 lost attempts" in ts[-1].user_attrs["reason"]


def test_stale_trials_are_recognized(tmp_path: Path) -> None:
    from energydsl.search.local import recover_stale
    from energydsl.search.report import CLAIMER, owner_info, stale_reason

    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = {**owner_info(), "pid": gone.pid}
    storage = open_storage(str(tmp_path / "study.journal"))
    study = optuna.create_study(storage=storage, study_name="t")
    cases = {"alive": {OWNER: owner_info()}, "dead": {OWNER: dead}, "died claiming": {CLAIMER: dead},
             "claiming": {CLAIMER: owner_info()}}
    for attrs in cases.values():
        study.add_trial(optuna.trial.create_trial(state=TrialState.WAITING, system_attrs={"energy:slot": 0}))
        t = study.get_trials()[-1]
        for k, v in attrs.items():
            storage.set_trial_system_attr(t._trial_id, k, v)
        storage.set_trial_state_values(t._trial_id, TrialState.RUNNING)
    stale = {name: stale_reason(t) is not None for name, t in zip(cases, study.get_trials(), strict=True)}
    assert stale == {"alive": False, "dead": True, "died claiming": True, "claiming": False}
    assert recover_stale(study, storage) == 2
    assert [t.user_attrs.get("kind") for t in study.get_trials()[:4]] == [None, "lost", "lost", None]
    retries = study.get_trials(states=(TrialState.WAITING,))
    assert [t.system_attrs["energy:retry_of"] for t in retries] == [1, 2]


def _script(tmp_path: Path, ref: SpaceRef, trials_: int, workers: int = 1) -> str:
    return textwrap.dedent(f"""
        from energydsl.search import SpaceRef, run_search
        run_search(SpaceRef({ref.spec!r}, {ref.sets!r}), storage={str(tmp_path / "study.journal")!r},
                   study_name="t", trials={trials_}, workers={workers}, pruner="none", progress=False,
                   json=True)
    """)


def _spawn(tmp_path: Path, code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_kill_9_loses_no_completed_trial(tmp_path: Path) -> None:
    ref = toy(tmp_path, mixers="ssm,attn", sleep=0.1)
    proc = _spawn(tmp_path, _script(tmp_path, ref, 12))
    storage = tmp_path / "study.journal"
    deadline = time.time() + 120
    done: dict[int, tuple] = {}
    while time.time() < deadline:
        if storage.exists():
            try:
                st = optuna.load_study(study_name="t", storage=open_storage(str(storage)))
                done = {t.number: (t.values, t.params) for t in st.get_trials(states=(TrialState.COMPLETE,))}
            except KeyError:
                pass
        if len(done) >= 3:
            break
        assert proc.poll() is None, "the search ended before it could be killed"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(done) >= 3
    s = search(tmp_path, ref, trials=12, pruner="none")
    ts = trials(tmp_path)
    state = [(t.number, t.state.name, t.user_attrs.get("kind"), t.system_attrs) for t in ts]
    assert s["finished"] == 12 and s["running"] == 0 and s["waiting"] == 0, state
    now = {t.number: (t.values, t.params) for t in ts if t.state == TrialState.COMPLETE}
    assert all(now[n] == v for n, v in done.items())  # every trial completed before the kill survived
    lost = [t for t in ts if t.user_attrs.get("kind") == "lost"]
    assert s["lost"] == len(lost) <= 1
    for t in lost:  # the trial the kill interrupted ran again, with the same parameters
        retry = [r for r in ts if r.system_attrs.get("energy:retry_of") == t.number]
        # a trial killed while still sampling has only some params; its retry keeps them and samples the rest
        assert len(retry) == 1 and retry[0].state.is_finished()
        assert all(retry[0].params.get(name) == value for name, value in t.params.items())


def test_two_commands_share_one_study_exactly(tmp_path: Path) -> None:
    ref = toy(tmp_path, mixers="ssm,attn", sleep=0.1)
    procs = [_spawn(tmp_path, _script(tmp_path, ref, 10)) for _ in range(2)]
    assert [p.wait(timeout=180) for p in procs] == [0, 0]
    ts = trials(tmp_path)
    assert len(ts) == 10 and sorted(t.number for t in ts) == list(range(10))
    assert all(t.state.is_finished() for t in ts)
    assert len(calls(tmp_path)) == 10  # no trial ran twice, none was lost


def test_two_worker_processes_run_exactly_the_budget(tmp_path: Path) -> None:
    ref = toy(tmp_path, mixers="ssm,attn", sleep=0.15)
    s = search(tmp_path, ref, trials=10, workers=2, pruner="none")
    ts = trials(tmp_path)
    assert s["finished"] == 10 and len(ts) == 10 and len({t.number for t in ts}) == 10
    assert len({t.system_attrs[OWNER]["pid"] for t in ts}) == 2  # both processes took trials
    assert os.getpid() not in {t.system_attrs[OWNER]["pid"] for t in ts}


def test_multi_objective_report_and_export(tmp_path: Path) -> None:
    s = search(tmp_path, toy(tmp_path, objectives="val_loss,params"), trials=10, seed=2, pruner="asha")
    assert isinstance(s["best"], list) and s["best"] and any("pruning disabled" in n for n in s["notes"])
    out = write_report(str(tmp_path / "study.journal"), "t", tmp_path / "report.html")
    page = out.read_text()
    assert "Pareto front" in page and "<math" in page and "layer toy" in page
    assert not re.search(r"<script[^>]*\bsrc\s*=\s*['\"]?(https?:)?//", page)  # no CDN: works offline
    number = export_best(str(tmp_path / "study.journal"), "t", tmp_path / "best.energy")
    best = next(t for t in trials(tmp_path) if t.number == number)
    assert (tmp_path / "best.energy").read_text() == best.user_attrs["source"]


def test_an_output_over_the_storage_or_the_space_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`energy report S -o runs/S/optuna.journal` replaced the study with HTML (then exit 70), and `--export`
    over the journal or the space file (`search/quickstart.energy`) replaced them with a candidate's source."""
    import subprocess
    import sys

    from energydsl.errors import UserError
    from energydsl.search.report import not_an_input

    monkeypatch.chdir(tmp_path)
    (tmp_path / "search").mkdir()
    (tmp_path / "search" / "s.energy").write_text("search S {}\n")
    (tmp_path / "s.spec").write_text("search S {}\n")
    with pytest.raises(UserError, match="--export s.spec is the search space: writing there would replace it"):
        not_an_input("s.spec", "--export", None, "s.spec")  # a space file of any name
    with pytest.raises(UserError, match="is the search space"):
        not_an_input(tmp_path / "search" / "s.energy", "--export", None, "search/s.energy")  # as a study records it
    not_an_input(tmp_path / "best.energy", "--export", None, "search/s.energy")
    not_an_input(tmp_path / "pkg.spaces:toy", "--export", None, "pkg.spaces:toy")  # a Python space: no file
    # a file the space imports (an energy it searches), however the import spells its path
    (tmp_path / "search" / "lib").mkdir()
    (tmp_path / "search" / "lib" / "e.energy").write_text("energy E(d = 2) {\n  state z[d]\n  global F = z . z\n"
                                                          "  optimizer gd\n}\n")
    (tmp_path / "search" / "i.energy").write_text('import "./lib/../lib/e.energy"\nsearch S {}\n')
    with pytest.raises(UserError, match="--export search/lib/e.energy is a file the search space imports"):
        not_an_input("search/lib/e.energy", "--export", None, "search/i.energy")
    (tmp_path / "search" / "broken.energy").write_text('import "nowhere.energy"\nsearch S {\n')
    not_an_input(tmp_path / "best.energy", "--export", None, "search/broken.energy")  # the search says why
    search(tmp_path, toy(tmp_path), trials=2, pruner="none")
    journal = tmp_path / "study.journal"
    with pytest.raises(UserError, match="is the study's storage: writing there would replace it"):
        not_an_input(journal, "-o/--output", f"sqlite:///{journal}", None)  # a storage URL names it too
    before = journal.read_bytes()
    for flags in (["-o", str(journal)], ["-o", str(tmp_path / "r.html"), "--export", str(journal)]):
        proc = subprocess.run([sys.executable, "-m", "energydsl", "report", str(journal), *flags],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "is the study's storage: writing there would replace it" in proc.stderr, \
            proc.stderr
    assert journal.read_bytes() == before


def test_single_objective_report(tmp_path: Path) -> None:
    search(tmp_path, toy(tmp_path), trials=6, pruner="none", seed=0)
    page = write_report(str(tmp_path / "study.journal"), "t", tmp_path / "r.html").read_text()
    assert "Optimization history" in page and "Learning curves" in page and "<math" in page
    assert not re.search(r"<script[^>]*\bsrc\s*=", page)


def test_parallel_coordinates_keep_a_conditional_hole_numeric() -> None:
    from energydsl.search.report import _axis

    # `nag.beta` exists only in the trials that chose nag: its values stay on a numeric axis, the others on a tick
    axis = _axis("MHA.optimizer.nag.beta", [0.5, None, 0.9, None])
    assert axis["values"][0] == 0.5 and axis["values"][2] == 0.9
    assert axis["values"][1] == axis["values"][3] == axis["tickvals"][0] < 0.5 and axis["ticktext"][0] == "not sampled"
    assert axis["range"] == [axis["tickvals"][0], 0.9] and axis["ticktext"][1:] == ["0.5", "0.6", "0.7", "0.8", "0.9"]
    assert _axis("d", [32, 64]) == {"label": "d", "values": [32, 64]}
    assert _axis("b", [2, None])["tickvals"][0] < 2  # one value: below it still
    names = _axis("MHA.optimizer", ["nag", "gd", "nag"])
    assert names["values"] == [1, 0, 1] and names["ticktext"] == ["gd", "nag"]


@pytest.mark.slow
def test_one_worker_and_one_seed_draw_the_same_candidates_on_both_backends(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    drawn = {}
    for backend in ("local", "ray", "local"):
        d = tmp_path / f"{backend}-{len(drawn)}"
        d.mkdir()
        search(d, toy(d, sleep=0), backend=backend, workers=1, trials=4, seed=7, pruner="none",
               **({"cpus_per_trial": 1} if backend == "ray" else {}))
        drawn[d.name] = [t.params for t in sorted(trials(d), key=lambda t: t.number)]
    assert len({repr(v) for v in drawn.values()}) == 1, drawn
    assert len({repr(p) for p in drawn["local-0"]}) > 1  # the trials differ from each other


def test_ray_backend_local_runtime(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    from energydsl.search.ray_backend import TUNE_SIGNALS

    handlers = [signal.getsignal(s) for s in TUNE_SIGNALS]
    s = search(tmp_path, toy(tmp_path, sleep=0.02), backend="ray", trials=8, workers=2, cpus_per_trial=1)
    assert not ray.is_initialized()  # the runtime it started is shut down
    # and Tune's SIGINT and SIGUSR1 handlers (Ray's SIGTERM one) are gone: Ctrl-C after the search is the caller's
    assert signal.SIGUSR1 in TUNE_SIGNALS
    assert [signal.getsignal(s) for s in TUNE_SIGNALS] == handlers
    ts = trials(tmp_path)
    assert s["finished"] == 8 and len(ts) == 8 and ledger(ts).running == 0
    for t in ts:
        if t.user_attrs.get("kind") == "complete":
            assert {"source", "equations_mathml", "curve", "metrics", "ray"} <= set(t.user_attrs)
    trained = {t.user_attrs["equation_hash"] for t in ts if t.user_attrs.get("kind") in ("complete", "error")}
    assert all(c[2] not in ("bogus",) for c in calls(tmp_path)) and len(calls(tmp_path)) >= len(trained)
    assert write_report(str(tmp_path / "study.journal"), "t", tmp_path / "r.html").exists()


def test_ray_does_not_prune_a_python_spaces_trial_at_its_final_step(tmp_path: Path) -> None:
    """The last step was known only from a DSL candidate's settings: a Python space's trial (the toy's) that
    trained every step was stopped at its final evaluation when that step was an ASHA rung (3), and recorded
    pruned where the local backend records it complete."""
    pytest.importorskip("ray")
    states = {}
    for backend in ("local", "ray"):
        d = tmp_path / backend
        d.mkdir()
        search(d, toy(d, mixers="ssm", depth=3, steps=3, sleep=0), backend=backend, workers=1, trials=12,
               sampler="random", seed=4, **({"cpus_per_trial": 1} if backend == "ray" else {}))
        ordered = sorted(trials(d), key=lambda t: t.number)
        states[backend] = [(t.state.name, t.user_attrs.get("reason")) for t in ordered]
    assert states["ray"] == states["local"]
    assert not any("at step 3" in str(reason) for _, reason in states["ray"]), states["ray"]
    pruned = [reason for state, reason in states["ray"] if state == "PRUNED"]
    assert pruned and all(re.fullmatch(r"pruned at step 1 \(val_loss \d+\.\d{4}\)", r) for r in pruned), pruned
    # ASHA does prune, at its first rung, and says at what loss, as the local backend does


@pytest.mark.slow
def test_ray_trains_a_candidate_once_while_its_twin_runs(tmp_path: Path) -> None:
    """As on the local backend: a candidate drawn while another Ray trial trains the same equations waits for it
    and takes its result (it trained a second time)."""
    pytest.importorskip("ray")
    s = search(tmp_path, toy(tmp_path, mixers="attn,attn_alias", depth=2, lr=0.01, sleep=0.3), backend="ray",
               trials=4, workers=2, cpus_per_trial=1, pruner="none")
    assert len(calls(tmp_path)) == 1, calls(tmp_path)
    assert s["completed"] == 4 and s["duplicates"] == 3 and ledger(trials(tmp_path)).running == 0


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_a_candidate_whose_twin_failed_trains_itself(tmp_path: Path, backend: str) -> None:
    """A trial that waited for a running twin which then failed (no result to share) trains after all: the
    search ends with every trial settled, none left running."""
    if backend == "ray":
        pytest.importorskip("ray")
    extra = {"cpus_per_trial": 1} if backend == "ray" else {}
    s = search(tmp_path, toy(tmp_path, mixers="diverge", depth=2, lr=0.01, sleep=1.0), backend=backend, trials=3,
               workers=2, pruner="none", **extra)
    assert s["failed"] == 3 and ledger(trials(tmp_path)).running == 0
    assert len(calls(tmp_path)) == 3  # each trained: a failure is not a result to share


@pytest.mark.slow
def test_ray_folders_go_beside_an_sqlite_storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tune's trial folders and log sit with the study's other files, as for a journal; they went under
    runs/STUDY in whatever directory the search was started from."""
    pytest.importorskip("ray")
    (tmp_path / "db").mkdir()
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    url = f"sqlite:///{tmp_path / 'db' / 'study.db'}"
    s = search(tmp_path, toy(tmp_path, sleep=0.02), backend="ray", trials=2, workers=1, storage=url)
    assert s["finished"] == 2
    assert (tmp_path / "db" / "ray" / "tune-output.log").exists() and list(elsewhere.iterdir()) == []


@pytest.mark.slow
def test_ray_records_a_lost_attempt_as_the_local_backend_does(tmp_path: Path,
                                                               capfd: pytest.CaptureFixture[str]) -> None:
    """Tune retries a trial whose worker died inside one Optuna trial; the attempts left no trace (the local
    backend's `lost` records: counted, with their reason), and Ray's loggers put each one's traceback on the
    terminal: it goes to the run's log."""
    pytest.importorskip("ray")
    s = search(tmp_path, toy(tmp_path, mixers="crash"), backend="ray", trials=1, workers=1, pruner="none")
    assert "Traceback" not in capfd.readouterr().err
    assert "ActorDiedError" in (tmp_path / "ray" / "tune-output.log").read_text()
    ts = trials(tmp_path)
    assert s["finished"] == 1 and s["failed"] == 1 and s["lost"] == 2, s
    lost = [t for t in ts if t.user_attrs.get("kind") == "lost"]
    failed = next(t for t in ts if t.user_attrs.get("kind") == "error")
    assert len(lost) == 2 and all(t.params == failed.params for t in lost)
    assert all(f"retried as trial #{failed.number}" in t.user_attrs["reason"] for t in lost)
    # Ray's error as the reason (it read "its worker failed": Tune's error file was read before it was written)
    assert all("The actor died unexpectedly before finishing this task." in t.user_attrs["reason"] for t in lost)
    assert "given up after 3 lost attempts" in failed.user_attrs["reason"]


@pytest.mark.slow
def test_ray_pruned_trials_are_recorded_as_local_ones(tmp_path: Path) -> None:
    """A trial the pruner stops has the step it was stopped on as its last intermediate value and as its value,
    a timing and its Ray record; a trial that trained every step is complete, not stopped at its final
    evaluation."""
    pytest.importorskip("ray")
    s = search(tmp_path, toy(tmp_path, mixers="ssm,attn", steps=10, sleep=0.02), backend="ray", trials=12,
               workers=2, cpus_per_trial=1, sampler="random", seed=3)
    ts = trials(tmp_path)
    stopped = [t for t in ts if t.user_attrs.get("kind") == "pruned"]
    assert s["finished"] == 12 and stopped, [(t.state.name, t.user_attrs.get("reason")) for t in ts]
    for t in stopped:
        last_step, last_value = t.user_attrs["curve"][-1]
        assert t.state == TrialState.PRUNED and f"at step {last_step}" in t.user_attrs["reason"]
        assert max(t.intermediate_values) == last_step and t.value == pytest.approx(last_value)
        assert t.user_attrs["timing"]["total_s"] > 0 and t.user_attrs["timing"]["evaluate_s"] is not None
        assert last_step < 10  # a trial's final evaluation is not reported to the pruner
        assert t.user_attrs["ray"]["trial_id"] and t.user_attrs["ray"]["node"]
        assert any(k.startswith("completed_rung_") for k in t.system_attrs)  # the study's own rungs
    for t in ts:
        if t.user_attrs.get("kind") == "complete":
            assert t.user_attrs["curve"][-1][0] == 10 and "timing" in t.user_attrs


@pytest.mark.slow
def test_ray_prunes_against_the_study_history_a_local_run_left(tmp_path: Path) -> None:
    """The study's own pruner judges Ray's trials: continued on Ray, hopeless trials (lr 1e-4, far worse than
    the local run's lr 1e-2) are pruned at once. Tune's ASHA, built empty per run, let them all train."""
    pytest.importorskip("ray")
    search(tmp_path, toy(tmp_path, mixers="ssm", lr=0.01, steps=10, sleep=0.0), trials=6, sampler="random", seed=1)
    s = search(tmp_path, toy(tmp_path, mixers="ssm", lr=0.0001, steps=10, sleep=0.02), backend="ray", trials=9,
               workers=1, cpus_per_trial=1, sampler="random", seed=2)
    new = [t for t in trials(tmp_path) if t.number >= 6]
    assert s["finished"] == 9 and len(new) == 3
    assert all(t.state == TrialState.PRUNED for t in new), [(t.state.name, t.user_attrs.get("reason")) for t in new]
    trained = [t for t in new if t.user_attrs.get("kind") == "pruned"]
    assert trained and all(t.user_attrs["curve"][-1][0] < 10 for t in trained)


@pytest.mark.slow
def test_ray_running_trials_finish_after_the_timeout(tmp_path: Path, ray_started_here) -> None:
    """--timeout stops new trials, as on the local backend; Tune's own time budget killed the running ones,
    and a trial longer than the timeout could never finish."""
    ray = ray_started_here
    ray.init(address="local", num_cpus=1, include_dashboard=False)  # up before the clock starts
    try:
        s = search(tmp_path, toy(tmp_path, mixers="ssm", sleep=3.0), backend="ray", trials=3, workers=1,
                   cpus_per_trial=1, pruner="none", timeout=8)
    finally:
        ray.shutdown()
    ts = trials(tmp_path)
    assert s["completed"] >= 1 and all(t.state != TrialState.RUNNING for t in ts)
    assert not [t for t in ts if t.user_attrs.get("kind") in ("interrupted", "lost")]


def test_a_worker_refuses_a_space_that_is_not_the_drivers(tmp_path: Path) -> None:
    """A search file edited during the search (or a node's stale copy) must not train silently in its new form
    while the study records the old one."""
    from energydsl.errors import UserError
    from energydsl.search.local import worker_loop
    from energydsl.search.space import resolve_as

    ref = toy(tmp_path, steps=4)
    assert resolve_as(ref, {"steps": "4"}).steps == 4
    with pytest.raises(UserError, match=r"not the one the search started with \(steps differ\)"):
        resolve_as(ref, {"steps": "6"})
    with pytest.raises(UserError, match="not the one the search started with"):
        worker_loop(ref, str(tmp_path / "study.journal"), "t", 1, None, "random", "none", "cpu", 0,
                    fingerprint={"steps": "6"})


def test_ray_two_node_cluster(tmp_path: Path, ray_started_here) -> None:
    ray = ray_started_here
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    try:
        cluster.wait_for_nodes()  # on a loaded machine the second raylet registered late: every trial ran on one
        s = search(tmp_path, toy(tmp_path, mixers="ssm,attn", sleep=0.3), backend="ray", trials=4, workers=2,
                   address=cluster.address, pruner="none")
    finally:
        ray.shutdown()
        cluster.shutdown()
    ts = trials(tmp_path)
    assert s["finished"] == 4 and s["completed"] == 4
    nodes = {t.user_attrs["ray"]["node"] for t in ts if "ray" in t.user_attrs}
    assert len(nodes) == 2  # 1 CPU per node and 2 concurrent trials: both nodes trained


def test_a_trial_larger_than_every_node_of_the_cluster_is_warned_of(ray_started_here) -> None:
    """Tune waited forever, without a word, for a node with --cpus-per-trial 2 on a cluster of 1-CPU nodes."""
    ray = ray_started_here
    from ray.cluster_utils import Cluster

    from energydsl.search.ray_backend import _warn_unless_a_node_fits

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        with pytest.warns(UserWarning, match="no node of the cluster at A has 2 CPUs and 0 GPUs for a trial "
                                             r"\(the largest has 1 and 0\): the trials wait"):
            _warn_unless_a_node_fits(ray, "A", 2, 0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _warn_unless_a_node_fits(ray, "A", 1, 0)  # fits: no word
    finally:
        ray.shutdown()
        cluster.shutdown()

@pytest.mark.slow
def test_ray_local_search_starts_its_own_runtime_beside_a_running_cluster(tmp_path: Path, ray_started_here) -> None:
    """Without --address the search must not attach to another cluster on the machine (two Ray tests in
    parallel pytest workers once collided this way: "When connecting to an existing cluster, num_cpus ...")."""
    ray = ray_started_here
    from ray.cluster_utils import Cluster

    other = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 1})
    try:
        s = search(tmp_path, toy(tmp_path, sleep=0.02), backend="ray", trials=2, workers=2, cpus_per_trial=1,
                   pruner="none")
    finally:
        ray.shutdown()
        other.shutdown()
    assert s["finished"] == 2


def test_relative_space_path_is_made_absolute_for_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ray worker runs in its own directory: `search/quickstart.energy` must reach it as an absolute path
    (the benchmark's relative path made every Ray trial fail before); names and import paths stay as given."""
    from energydsl.search.space import absolute

    root = Path(__file__).resolve().parent.parent
    monkeypatch.chdir(root)
    ref = absolute(SpaceRef("search/quickstart.energy", {"steps": "2"}))
    assert ref.spec == str(root / "search/quickstart.energy") and ref.sets == {"steps": "2"}
    monkeypatch.chdir(tmp_path)
    assert resolve_space(ref).name == "Quickstart"  # resolves from anywhere
    for spec in ("toy", "energydsl.search.toy:make_space"):
        assert absolute(SpaceRef(spec)).spec == spec


def test_a_candidate_file_says_how_to_train_it_as_its_trial_trained(tmp_path: Path, corpus: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`best.energy` ends with an `energy train` command: it must give training the trial's TrainConfig."""
    from dataclasses import asdict

    import energydsl.training as training
    from energydsl import cli
    from energydsl.search.dsl import load_search

    space = load_search(Path(__file__).parents[1] / "search" / "quickstart.energy", data=f"chars:{corpus}",
                        weight_decay="0.012345678", grad_clip="0.5", warmup="3", seed="7", block="4096")
    cand = space.suggest(optuna.create_study().ask())
    configs = []

    class Captured(Exception):
        pass

    def capture(model, data, config, *args, **kwargs):
        configs.append(asdict(config))
        raise Captured

    monkeypatch.setattr(training, "train", capture)
    with pytest.raises(Captured):
        space.evaluate(cand, lambda step, value: False, "cpu")
    (tmp_path / "best.energy").write_text(cand.source())
    command = cand.source().rsplit("# train it again so: ", 1)[1].split()
    assert command[:3] == ["energy", "train", "THIS_FILE"]
    monkeypatch.setattr(sys, "argv", ["energy", "train", str(tmp_path / "best.energy"), *command[3:],
                                      "--out", str(tmp_path / "run")])
    with pytest.raises(SystemExit):
        cli.main()  # Captured is an internal error to the CLI: exit 70, after the config was captured
    trial, again = ({k: v for k, v in c.items() if k not in ("device", "log_interval")} for c in configs)
    assert trial == again and trial["grad_clip"] == 0.5 and trial["seed"] == 7
    assert trial["weight_decay"] == 0.012345678  # not rounded to 6 digits on the way
    assert trial["block_size"] == 64  # `block` past the model's context is capped, in the command too


def test_a_trial_that_trained_all_its_steps_is_complete_even_if_the_pruner_says_stop(tmp_path: Path,
                                                                                    corpus: Path) -> None:
    """A pruner asked at a trial's final evaluation may say stop; the trial trained every step, so it completed
    (it was recorded pruned, its result lost to the ranking)."""
    from energydsl.search.dsl import load_search

    space = load_search(Path(__file__).parents[1] / "search" / "quickstart.energy", data=f"chars:{corpus}",
                        steps="2", eval_interval="2")
    cand = space.suggest(optuna.create_study().ask())
    asked: list[int] = []
    metrics = space.evaluate(cand, lambda step, value: asked.append(step) or step > 0, "cpu")
    assert asked[-1] == 2 and math.isfinite(metrics["val_loss"])
    s = search(tmp_path, toy(tmp_path, mixers="ssm,attn", steps=1), trials=8, pruner="asha", seed=0)
    assert s["pruned"] == 0 and s["finished"] == 8


def _leaderboard_text(study: optuna.Study, width: int) -> str:
    import io

    from rich.console import Console

    from energydsl.search.display import print_leaderboard

    out = io.StringIO()
    print_leaderboard(study, console=Console(file=out, width=width, color_system=None))
    return out.getvalue()


def test_the_leaderboard_turns_rather_than_cut_names_in_a_narrow_terminal() -> None:
    """In 80 columns the leaderboard (a row per trial) cut every parameter name to `Tiny…`: it now turns, a
    row per parameter with its full name and a column per trial, as many trials as fit, the rest counted. A
    wide terminal keeps a row per trial; the note (a duplicate's original) shows only where a trial has one."""
    study = optuna.create_study(study_name="narrow")
    study.set_user_attr("objectives", ["val_loss"])
    names = ["TinyGPT.across.momentum.beta", "TinyGPT.blocks.attention.optimizer", "train.learning_rate"]
    for n in range(12):
        study.add_trial(optuna.trial.create_trial(
            params={names[0]: 0.5 + n / 100, names[1]: ["gd", "momentum"][n % 2], names[2]: 1e-3 * (n + 1)},
            distributions={names[0]: optuna.distributions.FloatDistribution(0, 1),
                           names[1]: optuna.distributions.CategoricalDistribution(["gd", "momentum"]),
                           names[2]: optuna.distributions.FloatDistribution(1e-4, 1)},
            value=3.0 + n / 10, user_attrs={"duplicate_of": 0} if n == 5 else {}))
    narrow = _leaderboard_text(study, 80)
    assert "…" not in narrow and all(name in narrow for name in names), narrow
    assert max(len(line) for line in narrow.splitlines()) <= 80, narrow
    shown = re.findall(r"#(\d+)\b", narrow)
    assert shown[0] == "0" and 2 <= len(shown) < 10, narrow  # best first; the trials that fit
    assert f"{10 - len(shown)} more trial(s) in the report" in narrow, narrow
    assert re.search(r"^│ val_loss ↓ +│ 3 +│ 3\.1 ", narrow, re.M), narrow

    wide = _leaderboard_text(study, 300)
    header = next(line for line in wide.splitlines() if "val_loss" in line)
    assert all(name in header for name in names) and "note" in header, wide
    assert re.search(r"│ +5 │ .*│ = #0 +│", wide), wide
    study_without_notes = optuna.create_study(study_name="plain")
    study_without_notes.add_trials([t for t in study.trials if t.number != 5])
    assert "note" not in _leaderboard_text(study_without_notes, 300)


def test_the_leaderboard_says_why_candidates_were_invalid() -> None:
    """Pruned-as-invalid trials showed only as a count (their reasons were in the HTML report alone): a space
    whose every candidate the language refused ended with an empty leaderboard and exit 0, saying nothing."""
    study = optuna.create_study(study_name="refused")
    study.set_user_attr("objectives", ["val_loss"])
    reasons = ["`precondition covariance` needs a first-order optimizer (at `optimizer newton, precondition "
               "covariance`)", "`precondition covariance` needs a first-order optimizer (at `optimizer newton "
               "steps 2, precondition covariance`)", "`taylor` is the number of Neumann-series terms (at `x`)"]
    for reason in reasons:
        study.add_trial(optuna.trial.create_trial(state=TrialState.PRUNED,
                                                  user_attrs={"kind": "invalid", "reason": reason}))
    text = " ".join(_leaderboard_text(study, 200).split())
    assert "invalid candidates (3)" in text, text
    assert "│ 2 │ `precondition covariance` needs a first-order optimizer │" in text, text  # grouped without the line
    assert "│ 1 │ `taylor` is the number of Neumann-series terms │" in text, text
    assert "no trial has completed" in text
    study.add_trial(optuna.trial.create_trial(value=3.0))
    assert "no trial has completed" not in _leaderboard_text(study, 200)


def test_reasons_are_shown_as_written_not_as_rich_markup() -> None:
    """`softmax[j](...)` in an invalid candidate's reason lost its `[j]` to Rich's markup; a failure too."""
    import optuna
    from rich.console import Console

    from energydsl.search.display import failures_table, invalid_table
    from energydsl.search.report import KIND, REASON

    reason = "`expect update` is refuted at `expect update = z + sum[j](softmax[j](z . h[j]) * h[j])`"
    invalid = optuna.trial.create_trial(state=optuna.trial.TrialState.PRUNED,
                                        user_attrs={KIND: "invalid", REASON: reason})
    failed = optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL, user_attrs={REASON: "bad h[j] [bold]x"})
    console = Console(width=400, record=True)
    console.print(invalid_table([invalid]), failures_table([failed]))
    text = console.export_text()
    assert reason in text and "bad h[j] [bold]x" in text


def test_a_study_with_no_reason_to_show_does_not_point_above(tmp_path: Path) -> None:
    """After a Ctrl-C that stopped every trial, the leaderboard said "the reasons are above" with none above."""
    from rich.console import Console

    from energydsl.search.display import print_leaderboard

    study = optuna.create_study(storage=open_storage(str(tmp_path / "study.journal")), study_name="t")
    study.add_trial(optuna.trial.create_trial(state=TrialState.FAIL, user_attrs={"kind": "interrupted"}))
    console = Console(record=True, width=120)
    print_leaderboard(study, console=console)
    text = console.export_text()
    assert "no trial has completed: none finished" in text and "reasons are above" not in text, text


def test_a_second_ctrl_c_does_not_cut_the_hand_back_of_an_interrupted_trial(tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C hands a running trial back (failed as interrupted, its slot queued again). A second Ctrl-C while
    that was written left the trial RUNNING, found lost on the next run (held against its retries). Here the
    second one arrives as the hand-back starts."""
    import os
    import signal

    from energydsl.search import local, open_study

    space = resolve_space(toy(tmp_path, mixers="ssm"))
    journal = str(tmp_path / "study.journal")
    study = open_study(journal, "t", space)
    storage = local.open_storage(journal)
    local.ensure_slots(study, 1)
    trial_id = local.claim(study, storage, 1)

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    real_abandon = local.abandon

    def second_ctrl_c(*args: object, **kwargs: object) -> bool:
        os.kill(os.getpid(), signal.SIGINT)  # delivered at once: in the main thread, before the next bytecode
        return real_abandon(*args, **kwargs)

    monkeypatch.setattr(space, "evaluate", interrupted)
    monkeypatch.setattr(local, "abandon", second_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        local.run_trial(study, storage, trial_id, space, "cpu", prune=False)
    states = [(t.state.name, t.user_attrs.get("kind")) for t in load_study(journal, "t").get_trials()]
    assert states == [("FAIL", "interrupted"), ("WAITING", None)], states
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back


def test_a_held_hand_back_absorbs_one_ctrl_c_and_yields_to_the_next() -> None:
    """Holding off a second Ctrl-C must not trap the user if the hand-back hangs (a storage that does not
    answer): the third Ctrl-C (the second inside) stops it."""
    import os
    import signal

    from energydsl.signal_handlers import interruptions_held

    with pytest.raises(KeyboardInterrupt), interruptions_held():
        os.kill(os.getpid(), signal.SIGINT)  # absorbed
        os.kill(os.getpid(), signal.SIGTERM)  # ignored
        os.kill(os.getpid(), signal.SIGINT)  # stops it
        pytest.fail("the second Ctrl-C inside did not stop the held step")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_report_draws_finite_values_and_shows_a_strange_duplicate_of_as_text(tmp_path: Path) -> None:
    """A `duplicate_of` that is no trial number (another writer's) made `energy report` exit 70; an infinite
    objective was drawn as a gap, and a best of -inf hid the "best so far" line."""
    from energydsl.search import open_storage
    from energydsl.search.report import _figures

    study = optuna.create_study(storage=open_storage(str(tmp_path / "s.journal"), append=True), study_name="t")
    for value, attrs in ((2.0, {}), (float("-inf"), {}), (1.0, {"duplicate_of": "<b>x</b>"}), (0.5, {})):
        study.add_trial(optuna.trial.create_trial(value=value, user_attrs=attrs))
    page = write_report(str(tmp_path / "s.journal"), "t", tmp_path / "r.html").read_text()
    assert "same equations as &#x27;&lt;b&gt;x&lt;/b&gt;&#x27;" in page and "<b>x</b>" not in page
    (title, history), *_ = _figures(study)
    assert history.layout.title.text == "Optimization history (1 with a non-finite value not drawn)"
    assert list(history.data[0].y) == [2.0, 1.0, 0.5] and list(history.data[1].y) == [2.0, 1.0, 0.5]

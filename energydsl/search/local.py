"""Local backend: worker processes on this machine share one Optuna study through its storage.

The budget is handed out as numbered WAITING "slots", added a few at a time under a file lock, and a
worker only ever runs a trial by atomically claiming a slot. So N workers, or several `energy search`
commands on the same study, run exactly `trials` trials between them, and a rerun continues the study.
A trial whose process died (kill -9, OOM killer, lost node) is found by its owner record (host, boot,
pid, start time) or its heartbeat, marked lost and its slot put back with the same parameters.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Mapping
from typing import Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState

from energydsl.errors import UserError
from energydsl.search.report import (
    CLAIMER,
    CURVE,
    DUPLICATE_OF,
    HASH,
    KIND,
    METRICS,
    OWNER,
    REASON,
    RETRY_OF,
    SLOT,
    SOURCE,
    TIMING,
    TRACEBACK,
    Heartbeat,
    finite,
    is_counted,
    ledger,
    owner_info,
    stale_reason,
    trial_kind,
)
from energydsl.search.space import SearchSpace, SpaceRef, candidate_info, check_metrics, resolve_as
from energydsl.search.storage import open_storage, study_lock
from energydsl.signal_handlers import Terminated, interruptions_held, sigterm_interrupts

MAX_RETRIES = 2  # a slot whose worker died this often is failed, not retried (it may be what kills it)
SAMPLERS = ("auto", "tpe", "nsga2", "random", "cmaes", "qmc")
PRUNERS = ("asha", "hyperband", "none")
# trials run at once on this machine, per CPU, that --workers may ask for: each local worker is a process that
# imports torch and trains with (CPUs // workers) threads, so more only adds processes fighting for the cores
WORKERS_PER_CPU = 4


def max_local_workers() -> int:
    """The most trials `--workers` may run at once on this machine: WORKERS_PER_CPU per CPU (`os.cpu_count()`, as
    `_run_workers` divides the threads by)."""
    return WORKERS_PER_CPU * (os.cpu_count() or 1)


# ----------------------------------------------------------------------------- samplers, pruners


# objectives the intermediate reports (validation losses during training) stand for
PRUNABLE = ("val_loss", "best_val_loss")


def pruning_plan(objectives: list[tuple[str, str]], pruner: str) -> tuple[bool, str | None]:
    """Whether to prune, and a note when the user asked for pruning that cannot apply."""
    if pruner == "none":
        return False, None
    if len(objectives) > 1:
        return False, "pruning disabled: Optuna pruners do not support several objectives"
    metric, direction = objectives[0]
    if metric not in PRUNABLE:  # its value is known only at the end: pruning on val_loss would optimise that
        return False, f"pruning disabled: intermediate reports are val_loss, the objective is {metric}"
    if direction != "minimize":
        return False, "pruning disabled: intermediate reports are val_loss, the objective is maximized"
    return True, None


def make_sampler(name: str | None, n_objectives: int, seed: int | None = None) -> optuna.samplers.BaseSampler:
    """TPE for one objective, NSGA-II for several, unless a name is given."""
    import importlib.util

    if name in (None, "", "auto"):
        name = "tpe" if n_objectives == 1 else "nsga2"
    name = name.lower()
    s = optuna.samplers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if name == "tpe":
            return s.TPESampler(seed=seed, constant_liar=True)  # liar: parallel workers spread out
        if name == "nsga2":
            return s.NSGAIISampler(seed=seed)
        if name == "random":
            return s.RandomSampler(seed=seed)
        if name == "cmaes":
            if n_objectives > 1:
                raise UserError("sampler cmaes handles one objective only; use nsga2 or tpe")
            if importlib.util.find_spec("cmaes") is None:
                raise UserError("sampler cmaes needs the `cmaes` package", hint="pip install cmaes, or the "
                                "project's extra: pip install -e '.[samplers]'")
            return s.CmaEsSampler(seed=seed, warn_independent_sampling=False)
        if name == "qmc":
            if importlib.util.find_spec("scipy") is None:
                raise UserError("sampler qmc needs scipy", hint="pip install scipy, or the project's extra: "
                                "pip install -e '.[samplers]'")
            return s.QMCSampler(seed=seed, warn_independent_sampling=False)
    raise UserError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLERS)}")


def make_pruner(name: str, budget: Mapping[str, Any]) -> optuna.pruners.BasePruner:
    """ASHA (asynchronous successive halving) or Hyperband over the reported steps."""
    if name == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=budget.get("min_steps", "auto"),
                                                      reduction_factor=3)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=int(budget.get("min_steps", 1)),
                                              max_resource=budget.get("steps", "auto"), reduction_factor=3)
    if name == "none":
        return optuna.pruners.NopPruner()
    raise UserError(f"unknown pruner {name!r}; choose one of {', '.join(PRUNERS)}")


# ----------------------------------------------------------------------------- slots and recovery


def _busy_slots(trials: list[FrozenTrial]) -> set[int]:
    return {t.system_attrs[SLOT] for t in trials
            if SLOT in t.system_attrs and (t.state == TrialState.RUNNING or is_counted(t))}


def _next_slot(trials: list[FrozenTrial]) -> int:
    return max((int(t.system_attrs[SLOT]) for t in trials if SLOT in t.system_attrs), default=-1) + 1


def _open_waiting(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """WAITING trials that still stand for unused budget (one per slot, lowest number first)."""
    busy, seen, out = _busy_slots(trials), set(), []
    for t in sorted((t for t in trials if t.state == TrialState.WAITING), key=lambda t: t.number):
        slot = t.system_attrs.get(SLOT)
        if slot is not None and (slot in busy or slot in seen):
            continue
        seen.add(slot)
        out.append(t)
    return out


def ensure_slots(study: optuna.Study, target: int, ahead: int | None = None) -> int:
    """Add WAITING slots until finished + running + waiting reaches `target` (but keep at most `ahead`
    open ones: a slot costs a storage write, slow on SQL databases); returns how many were added.
    Callers hold `study_lock`, so commands on this host never add the same budget twice."""
    trials = study.get_trials(deepcopy=False)
    led = ledger(trials)
    waiting = len(_open_waiting(trials))
    missing = target - (led.finished + led.running + waiting)
    if ahead is not None:
        missing = min(missing, ahead - waiting)
    first = _next_slot(trials)
    for i in range(max(missing, 0)):
        study.add_trial(optuna.trial.create_trial(state=TrialState.WAITING, system_attrs={SLOT: first + i}))
    return max(missing, 0)


def abandon(study: optuna.Study, storage: BaseStorage, t: FrozenTrial, reason: str,
            interrupted: bool = False) -> bool:
    """Fail a trial that cannot finish and put its slot back (same parameters) for another worker.

    A slot whose worker died MAX_RETRIES times is failed for good (the candidate may be what kills
    it); interruptions are not held against it. Returns False when someone else finished it first."""
    trials = study.get_trials(deepcopy=False)
    slot = t.system_attrs.get(SLOT, _next_slot(trials))
    losses = sum(1 for o in trials if o.system_attrs.get(SLOT) == slot and trial_kind(o) == "lost")
    retry = interrupted or losses < MAX_RETRIES
    kind = "interrupted" if interrupted else ("lost" if retry else "error")
    try:
        storage.set_trial_user_attr(t._trial_id, KIND, kind)
        storage.set_trial_user_attr(t._trial_id, REASON, f"{reason}; " + (
            "retried" if retry else f"given up after {losses + 1} lost attempts"))
        if not storage.set_trial_state_values(t._trial_id, TrialState.FAIL):
            return False
    except UpdateFinishedTrialError:
        return False
    if retry:
        study.add_trial(optuna.trial.create_trial(state=TrialState.WAITING, system_attrs={
            SLOT: slot, RETRY_OF: t.number, "fixed_params": dict(t.params)}))
    return True


def recover_stale(study: optuna.Study, storage: BaseStorage) -> int:
    """Abandon every RUNNING trial whose worker is gone; returns how many were put back."""
    now, n = time.time(), 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        why = stale_reason(t, now)
        if why and abandon(study, storage, t, why):
            n += 1
    return n


def claim(study: optuna.Study, storage: BaseStorage, target: int) -> int | None:
    """Atomically take one open slot; None when the budget is used up or being used by others."""
    trials = study.get_trials(deepcopy=False)
    led = ledger(trials)
    if led.finished + led.running >= target:  # also guards slots left over from a larger earlier budget
        return None
    me = owner_info()
    for t in _open_waiting(trials):
        try:
            storage.set_trial_system_attr(t._trial_id, CLAIMER, me)  # may be overwritten by a racing loser
            if storage.set_trial_state_values(t._trial_id, TrialState.RUNNING):
                return t._trial_id
        except UpdateFinishedTrialError:
            continue
    return None


# ----------------------------------------------------------------------------- one trial


def _describe(e: BaseException) -> str:
    msg = str(e).strip()
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def free_memory() -> None:
    """After a failure (OOM above all) give memory back before the next trial in this process."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()


def find_same(study: optuna.Study, equation_hash: str, number: int) -> FrozenTrial | None:
    """An earlier finished trial with the same equations: a complete one first, else a pruned one."""
    found = None
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        if t.number == number or t.user_attrs.get(HASH) != equation_hash or trial_kind(t) == "invalid":
            continue
        if t.state == TrialState.COMPLETE:
            return t
        found = found or t
    return found


def same_when_done(study: optuna.Study, storage: BaseStorage, equation_hash: str, number: int,
                   poll: float = 0.5) -> FrozenTrial | None:
    """`find_same`, once no earlier trial with these equations is still running: with several workers, the
    sampler can draw a candidate that another worker is training, which then trained twice at once. An earlier
    running trial that has not yet recorded its equations (it is still deriving them) is waited for too: it may
    be the same candidate, and it would not wait for this later one. An earlier trial whose worker is gone is
    recovered while waiting (and then this one trains); a later one is never waited for, so two workers never
    wait for each other."""
    while any(t.number < number and t.user_attrs.get(HASH, equation_hash) == equation_hash
              for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))):
        recover_stale(study, storage)
        time.sleep(poll)
    return find_same(study, equation_hash, number)


def run_trial(study: optuna.Study, storage: BaseStorage, trial_id: int, space: SearchSpace, device: str,
              prune: bool, heartbeat: Heartbeat | None = None) -> TrialState:
    """Run one claimed trial: check, deduplicate, evaluate, record. Never raises for a bad candidate."""
    t0 = time.perf_counter()
    eval_s = 0.0
    curve: list[list[float]] = []
    names = [n for n, _ in space.objectives]
    storage.set_trial_system_attr(trial_id, OWNER, owner_info())
    if heartbeat is not None:
        heartbeat.add(trial_id)
    if hasattr(study, "_thread_local"):  # as Study.ask does: let the sampler see the latest trials
        study._thread_local.cached_all_trials = None
    trial = optuna.Trial(study, trial_id)

    def finish(state: TrialState, values: list[float] | None = None, **attrs: Any) -> TrialState:
        attrs[TIMING] = {"evaluate_s": round(eval_s, 6), "total_s": round(time.perf_counter() - t0, 6)}
        if curve:
            attrs.setdefault(CURVE, curve)
        for k, v in attrs.items():
            trial.set_user_attr(k, v)
        study.tell(trial, values, state=None if state == TrialState.COMPLETE else state)
        return state

    def fail(reason: str, with_tb: bool = True, kind: str = "error") -> TrialState:
        extra = {TRACEBACK: traceback.format_exc(limit=-12)} if with_tb else {}
        return finish(TrialState.FAIL, kind=kind, reason=reason, **extra)

    try:
        try:
            cand = space.suggest(trial)
        except optuna.TrialPruned as e:
            return finish(TrialState.PRUNED, kind="invalid", reason=str(e) or "rejected while sampling")
        except Exception as e:
            return fail(f"suggest failed: {_describe(e)}")
        try:
            reason = cand.invalid_reason()
        except Exception as e:
            return fail(f"invalid_reason() raised {_describe(e)}")
        if reason:
            extra = {}
            with contextlib.suppress(Exception):
                extra[SOURCE] = str(cand.source())
            return finish(TrialState.PRUNED, kind="invalid", reason=str(reason), **extra)
        try:
            info = candidate_info(cand)
        except Exception as e:
            return fail(f"describing the candidate failed: {_describe(e)}")
        for k, v in info.items():  # recorded before training, so a crash still shows what ran
            trial.set_user_attr(k, v)
        same = same_when_done(study, storage, info[HASH], trial.number)
        if same is not None:
            origin = int(same.user_attrs.get(DUPLICATE_OF, same.number))
            curve.extend(same.user_attrs.get(CURVE) or [])
            if prune:
                for step, value in curve:
                    if finite(value):
                        trial.report(float(value), int(step))
            attrs = {KIND: "duplicate", DUPLICATE_OF: origin, REASON: f"same equations as trial #{origin}"}
            if same.state == TrialState.COMPLETE:
                return finish(TrialState.COMPLETE, list(same.values),
                              metrics=same.user_attrs.get(METRICS, {}), **attrs)
            return finish(TrialState.PRUNED, **attrs)

        def report(step: int, value: float) -> bool:
            curve.append([int(step), float(value)])
            if not prune or not finite(value):
                return False
            trial.report(float(value), int(step))
            return trial.should_prune()

        t_eval = time.perf_counter()
        try:
            metrics = space.evaluate(cand, report, device)
        except optuna.TrialPruned as e:
            eval_s = time.perf_counter() - t_eval
            at = f" at step {curve[-1][0]}" if curve else ""
            return finish(TrialState.PRUNED, kind="pruned", reason=str(e) or f"pruned{at}")
        except Exception as e:
            eval_s = time.perf_counter() - t_eval
            free_memory()
            return fail(_describe(e))
        eval_s = time.perf_counter() - t_eval
        values, clean, why = check_metrics(metrics, names)
        if why is not None:
            finish_state = fail(why, with_tb=False)
            return finish_state
        return finish(TrialState.COMPLETE, values, kind="complete", metrics=clean)
    except BaseException as e:  # interrupted (Ctrl-C, SIGTERM): the trial goes back to the queue
        if not isinstance(e, Exception):
            with contextlib.suppress(Exception), interruptions_held():  # a second Ctrl-C: not halfway
                abandon(study, storage, storage.get_trial(trial_id), f"interrupted ({type(e).__name__})",
                        interrupted=True)
        raise
    finally:
        if heartbeat is not None:
            heartbeat.discard(trial_id)


# ----------------------------------------------------------------------------- workers


def quiet_optuna() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def worker_loop(ref: SpaceRef, storage_spec: str, study_name: str, target: int, deadline: float | None,
                sampler: str | None, pruner: str, device: str, seed: int | None, ahead: int = 2,
                fingerprint: dict[str, str] | None = None) -> int:
    """Claim and run trials until the budget or the deadline is reached; returns trials run here."""
    quiet_optuna()
    space = resolve_as(ref, fingerprint)
    storage = open_storage(storage_spec)
    objectives = list(space.objectives)
    prune, _ = pruning_plan(objectives, pruner)
    chosen = make_pruner(pruner, space.budget) if prune else optuna.pruners.NopPruner()
    study = optuna.load_study(study_name=study_name, storage=storage, pruner=chosen,
                              sampler=make_sampler(sampler, len(objectives), seed))
    hb = Heartbeat(storage)
    n = 0
    try:
        while deadline is None or time.time() < deadline:
            tid = claim(study, storage, target)
            if tid is None:
                with study_lock(storage_spec, study_name):
                    added = ensure_slots(study, target, ahead)
                if added or recover_stale(study, storage):
                    continue
                break
            run_trial(study, storage, tid, space, device, prune, hb)
            n += 1
    finally:
        hb.close()
    return n


def _die_with_parent() -> None:
    """Linux: get SIGTERM when the driver dies, so a killed search leaves no orphan workers."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


USER_ERROR = 2  # a worker's exit status for a UserError (its message printed to stderr)


def _worker_entry(kwargs: dict[str, Any]) -> None:
    """Main of a worker process: a fresh interpreter (spawn semantics) that runs `worker_loop`."""
    _die_with_parent()
    signal.signal(signal.SIGTERM, _sigterm)
    try:
        worker_loop(**kwargs)
    except KeyboardInterrupt:
        sys.exit(130)
    except UserError as e:  # the driver stops the search on this status, the message above it
        print(e.render(), file=sys.stderr)
        sys.exit(USER_ERROR)
    finally:  # a SIGTERM during the interpreter's shutdown (the driver killed, PR_SET_PDEATHSIG) ends it quietly:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # raised in an atexit callback, it printed a traceback


# The worker reads the parent's sys.path (one JSON line), then its pickled arguments, from stdin. A plain
# interpreter, unlike multiprocessing's spawn, never re-imports the caller's __main__: workers start the
# same from a script, `python -`, a notebook or a script without a __main__ guard.
_BOOT = ("import json, pickle, sys; path = json.loads(sys.stdin.buffer.readline()); "
         "sys.path[:0] = [p for p in path if p not in sys.path]; "
         "from energydsl.search.local import _worker_entry; _worker_entry(pickle.load(sys.stdin.buffer))")


def _start_worker(kwargs: dict[str, Any], threads: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # N workers must not each take every core
        env.setdefault(var, str(threads))
    proc = subprocess.Popen([sys.executable, "-c", _BOOT], stdin=subprocess.PIPE, env=env)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps([p for p in sys.path if p]).encode() + b"\n" + pickle.dumps(kwargs))
    proc.stdin.close()
    return proc


def worker_seed(seed: int | None, history: int, start: int) -> int | None:
    """Deterministic for a given study history, yet different for each worker start and each resume
    (a sampler seeded the same way would propose the same candidates again)."""
    if seed is None:
        return None
    return (seed * 1_000_003 + history * 7_919 + start) % (2**31 - 1)


def worker_device(device: str, index: int, workers: int) -> str:
    """Worker `index`'s device: `cuda` and `auto` spread several workers over this machine's GPUs."""
    if workers == 1 or device not in ("cuda", "auto"):
        return device
    import torch

    count = torch.cuda.device_count()
    return f"cuda:{index % count}" if count else device


def run_local(ref: SpaceRef, study: optuna.Study, storage_spec: str, *, target: int, deadline: float | None,
              workers: int, sampler: str | None, pruner: str, device: str,
              seed: int | None, fingerprint: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the local backend to the budget; returns extra summary fields."""
    storage = open_storage(storage_spec)
    with study_lock(storage_spec, study.study_name):
        recovered = recover_stale(study, storage)
        history = len(study.get_trials(deepcopy=False))  # before this run's slots: the seeds are Ray's too
        ensure_slots(study, target, ahead=2 * workers)
    starts = 0

    def kwargs(i: int) -> dict[str, Any]:
        nonlocal starts
        starts += 1  # a seed per worker start and per resume: a replaced worker must not replay samples
        return {"ref": ref, "storage_spec": storage_spec, "study_name": study.study_name, "target": target,
                "deadline": deadline, "sampler": sampler, "pruner": pruner,
                "device": worker_device(device, i, workers), "seed": worker_seed(seed, history, starts),
                "ahead": 2 * workers, "fingerprint": fingerprint}

    with sigterm_interrupts():
        if workers <= 1:
            worker_loop(**kwargs(0))
            return {"recovered": recovered, "workers": 1}
        return _run_workers(kwargs, storage, study, target=target, deadline=deadline, workers=workers,
                            recovered=recovered)


def _run_workers(kwargs: Any, storage: BaseStorage, study: optuna.Study, *, target: int, deadline: float | None,
                 workers: int, recovered: int) -> dict[str, Any]:
    """Keep `workers` worker processes running (replacing crashed ones) until they run out of budget."""
    warn: list[str] = []
    threads = max(1, (os.cpu_count() or 1) // workers)
    procs: dict[int, subprocess.Popen[bytes]] = {}
    crashed = 0
    try:
        for i in range(workers):
            procs[i] = _start_worker(kwargs(i), threads)
        while procs:
            time.sleep(0.2)
            for i, p in list(procs.items()):
                if p.poll() is None:
                    continue
                del procs[i]
                if p.returncode == 0:
                    continue
                if p.returncode == USER_ERROR:  # not a crash another worker would escape: stop the search
                    raise UserError(f"worker {i} stopped with the error above", hint="the study keeps what "
                                    "finished; fix what the error names and run the search again to resume")
                crashed += 1  # a worker died (segfault, OOM kill): put its trial back, start another
                recovered += recover_stale(study, storage)
                time_left = deadline is None or time.time() < deadline
                led = ledger(study.get_trials(deepcopy=False))
                if time_left and led.finished + led.running < target:
                    if crashed <= 2 * workers:
                        procs[i] = _start_worker(kwargs(i), threads)
                    elif not warn:
                        warn.append(f"{crashed} worker processes died; not replacing them any more "
                                    "(see the lost trials' reasons); run again to continue")
    except BaseException as e:  # Ctrl-C (the workers got it too) or an error here: let them hand back their trials
        if isinstance(e, (Terminated, UserError)):  # SIGTERM, or a worker's error, reached this process only:
            # the other workers hand back their trials as interrupted
            for p in procs.values():
                with contextlib.suppress(OSError):
                    p.terminate()
        for p in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)
        raise
    return {"recovered": recovered, "workers": workers, "worker_crashes": crashed, "warnings": warn}

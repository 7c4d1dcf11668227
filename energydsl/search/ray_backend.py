"""Ray backend: Ray Tune runs the trials (on a cluster, with fractional GPUs); OptunaSearch samples them
from the very Optuna study the local backend writes; the study's own pruner (ASHA or Hyperband, as on the local
backend, with the study's history) stops weak ones early.

The searcher works directly on the engine's storage, so a trial is RUNNING there while Ray trains it
and every result lands in the usual format (same user attrs), whichever backend ran it. Cheap work stays
on the driver: invalid and duplicate candidates are settled inside `suggest` and never reach Ray.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import optuna
from optuna.trial import FrozenTrial, TrialState

from energydsl.errors import UserError
from energydsl.search.local import (
    MAX_RETRIES,
    Heartbeat,
    find_same,
    free_memory,
    make_pruner,
    make_sampler,
    owner_info,
    pruning_plan,
    recover_stale,
    worker_seed,
)
from energydsl.search.report import (
    CURVE,
    DUPLICATE_OF,
    HASH,
    KIND,
    METRICS,
    OWNER,
    REASON,
    SOURCE,
    TIMING,
    TRACEBACK,
    finite,
    ledger,
)
from energydsl.search.space import (
    SearchSpace,
    SpaceRef,
    candidate_info,
    check_metrics,
    plain,
    resolve_as,
    space_fingerprint,
)
from energydsl.search.storage import file_tag, open_storage, study_dir, study_lock
from energydsl.signal_handlers import Terminated, handlers_restored

try:  # this module is imported only for the ray backend (and by Ray workers)
    from ray.tune import Callback
    from ray.tune.schedulers import FIFOScheduler
    from ray.tune.search import Searcher
    from ray.tune.search.optuna import OptunaSearch
except ImportError:  # pragma: no cover - reported by run_ray
    Callback = Searcher = OptunaSearch = FIFOScheduler = None  # type: ignore[assignment,misc]

# Keys of the config a trial gets and of the results it reports.
PARAMS = "_energy_params"
NUMBER = "_energy_trial"
PROGRESS = "_energy_val_loss"  # the value the pruner watches (always val_loss, whatever the objectives)
RKIND = "_energy_kind"  # progress | complete | pruned | error
FINAL = "_energy_final"

_SPACES: dict[str, SearchSpace] = {}  # one resolved space per Ray worker process


def _node_id() -> str:
    with contextlib.suppress(Exception):
        import ray

        return str(ray.get_runtime_context().get_node_id())
    return ""


def _trainable(config: dict[str, Any], ref: SpaceRef, fingerprint: dict[str, str] | None, device: str,
               objectives: list[tuple[str, str]], cache_root: str) -> None:
    """Runs inside a Ray worker: rebuild the space (the driver's, by its fingerprint), rebuild the candidate from
    its params, train."""
    from ray import tune

    trial_key = tune.get_context().get_trial_id() or f"pid{os.getpid()}"
    cache = os.path.join(cache_root, trial_key)  # private compile caches: no races between trials
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
    key = repr((ref.spec, sorted(ref.sets.items()), fingerprint))
    pad = {name: math.nan for name, _ in objectives}  # Tune wants every metric in every result
    node = _node_id()
    curve: list[list[float]] = []
    last_step = math.inf  # the candidate's own steps, where it has them

    def report(step: int, value: float) -> bool:
        curve.append([int(step), float(value)])
        if step < last_step:  # the pruner must not stop a trial at its final evaluation: it completed
            tune.report({**pad, PROGRESS: float(value), "step": int(step), RKIND: "progress", "_energy_node": node})
        return False  # the driver prunes a trial by stopping its actor (StudyPruning), not through this value

    final: dict[str, Any] = {**pad, FINAL: True, RKIND: "complete"}
    t0 = time.perf_counter()
    try:
        if key not in _SPACES:
            _SPACES[key] = resolve_as(ref, fingerprint)
        space = _SPACES[key]
        cand = space.suggest(optuna.trial.FixedTrial(config[PARAMS]))
        # its own steps (a DSL candidate's settings), else the space's (`budget["steps"]`, as a Python space's)
        own_steps = getattr(cand, "settings", {}).get("steps") or space.budget.get("steps")
        last_step = int(own_steps) if own_steps else math.inf
        metrics = {str(k): plain(v) for k, v in dict(space.evaluate(cand, report, device)).items()}
        final["_energy_metrics"] = json.dumps(metrics)
        final.update({n: metrics[n] for n in pad if isinstance(metrics.get(n), float)})
    except optuna.TrialPruned as e:
        final.update({RKIND: "pruned", "_energy_reason": str(e) or "pruned"})
    except Exception as e:
        final.update({RKIND: "error", "_energy_reason": f"{type(e).__name__}: {e}",
                      "_energy_traceback": traceback.format_exc(limit=-12)})
    final.update({PROGRESS: curve[-1][1] if curve else math.nan, "_energy_curve": json.dumps(curve),
                  "_energy_eval_s": time.perf_counter() - t0, "_energy_node": node})
    cand = None  # the candidate (and whatever model it holds) goes before the next trial in this actor
    free_memory()
    shutil.rmtree(cache, ignore_errors=True)  # compiled kernels stay loaded; thousands of trials fill disks
    tune.report(final)


if OptunaSearch is not None:

    class StudySearch(OptunaSearch):
        """OptunaSearch on the engine's study, with the engine's bookkeeping around each trial."""

        def __init__(self, space: SearchSpace, study: optuna.Study, storage: Any, target: int,
                     sampler: optuna.samplers.BaseSampler, pruner: optuna.pruners.BasePruner | None,
                     deadline: float | None) -> None:
            names = [n for n, _ in space.objectives]
            modes = ["min" if d == "minimize" else "max" for _, d in space.objectives]
            self._energy_space, self._energy_storage, self._energy_target = space, storage, target
            self._energy_names, self._energy_prune, self._energy_deadline = names, pruner is not None, deadline
            self._energy_pruner = pruner or optuna.pruners.NopPruner()
            self._energy_pruned: set[str] = set()  # Tune trials the pruner stopped (StudyPruning)
            self._energy_curves: dict[str, list[list[float]]] = {}
            self._energy_started: dict[str, float] = {}  # Tune trial id -> when it was handed to Ray
            self._energy_waiting: list[Any] = []  # Optuna trials waiting for a running twin's result
            self._energy_hb = Heartbeat(storage)
            super().__init__(space=self._define, metric=names if len(names) > 1 else names[0],
                             mode=modes if len(modes) > 1 else modes[0], sampler=sampler,
                             study_name=study.study_name, storage=storage)

        def _setup_study(self, mode: Any) -> None:
            """OptunaSearch opens the study with no pruner: give it the search's, so that trials are judged
            against the study's own rungs, those of earlier runs and of the local backend included."""
            super()._setup_study(mode)
            self._ot_study.pruner = self._energy_pruner

        def _define(self, trial: Any) -> dict[str, Any]:
            """Define-by-run: sample, then settle on the driver whatever needs no training."""
            self._energy_storage.set_trial_system_attr(trial._trial_id, OWNER, owner_info())
            self._energy_hb.add(trial._trial_id)
            try:
                cand = self._energy_space.suggest(trial)
                reason = cand.invalid_reason()
                if reason:
                    with contextlib.suppress(Exception):
                        trial.set_user_attr(SOURCE, str(cand.source()))
                    return {RKIND: "invalid", "_energy_reason": str(reason)}
                info = candidate_info(cand)
            except optuna.TrialPruned as e:  # the space rejected the values while sampling
                return {RKIND: "invalid", "_energy_reason": str(e) or "rejected while sampling"}
            except Exception as e:
                trial.set_user_attr(TRACEBACK, traceback.format_exc(limit=-12))
                return {RKIND: "error", "_energy_reason": f"sampling failed: {type(e).__name__}: {e}"}
            for k, v in info.items():
                trial.set_user_attr(k, v)
            same = find_same(self._ot_study, info[HASH], trial.number)
            if same is not None:
                return {RKIND: "duplicate", "_energy_same": same.number}
            if self._running_twin(info[HASH], trial.number) is not None:  # its result comes: wait for it
                return {RKIND: "wait"}
            return {RKIND: "train"}

        def _running_twin(self, equation_hash: str, number: int) -> FrozenTrial | None:
            """An earlier trial with these equations still running (never a later one: none waits for another)."""
            return next((t for t in self._ot_study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                         if t.number < number and t.user_attrs.get(HASH) == equation_hash), None)

        def _settle_waiting(self) -> Any:
            """Settle the trials that waited for a running twin whose trial has ended: a duplicate of its result,
            or, where it left none (failed, lost), the first such trial back (it trains)."""
            for ot_trial in list(self._energy_waiting):
                equation_hash = self._energy_storage.get_trial(ot_trial._trial_id).user_attrs.get(HASH)
                if self._running_twin(equation_hash, ot_trial.number) is not None:
                    continue
                self._energy_waiting.remove(ot_trial)
                same = find_same(self._ot_study, equation_hash, ot_trial.number)
                if same is None:
                    return ot_trial
                self._settle_duplicate(ot_trial, same)
            return None

        def _settle_duplicate(self, ot_trial: Any, same: FrozenTrial) -> None:
            origin = int(same.user_attrs.get(DUPLICATE_OF, same.number))
            curve = same.user_attrs.get(CURVE) or []
            if self._energy_prune:  # as the local backend does: a pruned duplicate gets the same value
                for step, value in curve:
                    self._report(ot_trial, value, step)
            attrs = {KIND: "duplicate", DUPLICATE_OF: origin, CURVE: curve,
                     REASON: f"same equations as trial #{origin}"}
            if same.state == TrialState.COMPLETE:
                self._finish(ot_trial, TrialState.COMPLETE, list(same.values),
                             metrics=same.user_attrs.get(METRICS, {}), **attrs)
            else:
                self._finish(ot_trial, TrialState.PRUNED, **attrs)

        def _finish(self, ot_trial: Any, state: TrialState, values: list[float] | None = None,
                    **attrs: Any) -> None:
            for k, v in attrs.items():
                ot_trial.set_user_attr(k, v)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._ot_study.tell(ot_trial, values, state=None if state == TrialState.COMPLETE else state)
            self._energy_hb.discard(ot_trial._trial_id)

        def _train(self, trial_id: str, ot_trial: Any) -> dict[str, Any]:
            self._ot_trials[trial_id] = ot_trial
            self._energy_started[trial_id] = time.perf_counter()
            return {PARAMS: dict(ot_trial.params), NUMBER: ot_trial.number}

        def suggest(self, trial_id: str) -> dict[str, Any] | str | None:
            while True:
                back = self._settle_waiting()
                if back is not None:  # its twin left no result: it trains after all
                    return self._train(trial_id, back)
                led = ledger(self._ot_study.get_trials(deepcopy=False))
                late = self._energy_deadline is not None and time.time() >= self._energy_deadline
                if late or led.finished + led.running >= self._energy_target:
                    # trials waiting for a twin count as running: ask again until they are settled
                    return None if self._energy_waiting else Searcher.FINISHED
                config = super().suggest(trial_id)
                ot_trial = self._ot_trials[trial_id]
                kind = config.get(RKIND)
                if kind == "train":
                    return self._train(trial_id, ot_trial)
                del self._ot_trials[trial_id]  # settled here; ask again for the same Tune trial
                reason = config.get("_energy_reason", "")
                if kind == "invalid":
                    self._finish(ot_trial, TrialState.PRUNED, kind="invalid", reason=reason)
                elif kind == "error":
                    self._finish(ot_trial, TrialState.FAIL, kind="error", reason=reason)
                elif kind == "wait":  # an earlier trial trains the same equations: settled when it ends
                    self._energy_waiting.append(ot_trial)
                else:
                    same = next(t for t in self._ot_study.get_trials(deepcopy=False)
                                if t.number == config["_energy_same"])
                    self._settle_duplicate(ot_trial, same)

        def progress(self, trial_id: str, result: dict[str, Any]) -> bool:
            """A trial's evaluation (StudyPruning hands it over): record it, report it to the study, and say
            whether the study's pruner stops the trial here, as `should_prune` does on the local backend."""
            ot_trial = self._ot_trials.get(trial_id)
            if result.get(RKIND) != "progress" or ot_trial is None:
                return False
            curve = self._energy_curves.setdefault(trial_id, [])
            step, value = int(result["step"]), float(result[PROGRESS])
            if curve and step <= curve[-1][0]:
                curve.clear()  # the trial restarted after its worker was lost
            curve.append([step, value])
            if not (self._energy_prune and finite(value)):
                return False
            self._report(ot_trial, value, step)
            if not ot_trial.should_prune():
                return False
            self._energy_pruned.add(trial_id)
            return True

        def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
            pass  # `progress` has it (OptunaSearch's own would report every result a second time)

        @staticmethod
        def _report(ot_trial: Any, value: float, step: int) -> None:
            if finite(value):
                with warnings.catch_warnings(), contextlib.suppress(Exception):
                    warnings.simplefilter("ignore")  # a step already reported (a retried trial) is ignored
                    ot_trial.report(float(value), int(step))

        def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None,
                              error: bool = False) -> None:
            ot_trial = self._ot_trials.get(trial_id)
            if ot_trial is None or trial_id in self._completed_trials:
                return
            self._completed_trials.add(trial_id)
            curve = self._energy_curves.pop(trial_id, [])
            result = result or {}
            if result.get(RKIND) == "progress" and (not curve or int(result["step"]) > curve[-1][0]):
                curve.append([int(result["step"]), float(result[PROGRESS])])  # the result it was pruned on
            total_s = round(time.perf_counter() - self._energy_started.pop(trial_id, time.perf_counter()), 6)
            if result.get(FINAL):
                curve = json.loads(result.get("_energy_curve") or "[]") or curve
                attrs: dict[str, Any] = {CURVE: curve, TIMING: {"evaluate_s": result.get("_energy_eval_s"),
                                                                "total_s": total_s},
                                         "ray": {"node": result.get("_energy_node"), "pid": result.get("pid"),
                                                 "trial_id": trial_id}}
                kind = result.get(RKIND)
                if kind == "complete":
                    metrics = json.loads(result.get("_energy_metrics") or "{}")
                    values, clean, why = check_metrics(metrics, self._energy_names)
                    if why is None:
                        self._finish(ot_trial, TrialState.COMPLETE, values, kind="complete", metrics=clean,
                                     **attrs)
                    else:
                        self._finish(ot_trial, TrialState.FAIL, kind="error", reason=why, metrics=clean,
                                     **attrs)
                elif kind == "pruned":
                    self._report_last(ot_trial, curve)
                    self._finish(ot_trial, TrialState.PRUNED, kind="pruned",
                                 reason=result.get("_energy_reason"), **attrs)
                else:
                    self._finish(ot_trial, TrialState.FAIL, kind="error", reason=result.get("_energy_reason"),
                                 traceback=result.get("_energy_traceback", ""), **attrs)
            elif error:
                self._finish(ot_trial, TrialState.FAIL, kind="error", curve=curve,
                             reason=f"its Ray worker was lost or crashed; given up after {MAX_RETRIES + 1} lost "
                                    "attempts")
            elif trial_id not in self._energy_pruned:
                self._completed_trials.discard(trial_id)  # stopped otherwise (the run ended): left for abandon()
            else:  # pruned on its last result: recorded as a local pruned trial is (value, timing)
                at = f" at step {curve[-1][0]} (val_loss {curve[-1][1]:.4f})" if curve else ""  # as the local one
                self._report_last(ot_trial, curve)
                evaluate_s = result.get("time_total_s")  # Tune's clock of the trainable, start to that report
                timing = {"evaluate_s": round(float(evaluate_s), 6) if finite(evaluate_s) else None,
                          "total_s": total_s}
                self._finish(ot_trial, TrialState.PRUNED, kind="pruned", curve=curve, reason=f"pruned{at}",
                             ray={"node": result.get("_energy_node"), "pid": result.get("pid"), "trial_id": trial_id},
                             **{TIMING: timing})

        def _report_last(self, ot_trial: Any, curve: list[list[float]]) -> None:
            """Report the last point of a pruned trial's curve: Optuna records a pruned trial's value as its last
            intermediate value (a trial that raised TrialPruned itself reported nothing yet)."""
            if curve:
                self._report(ot_trial, curve[-1][1], curve[-1][0])

        def record_lost(self, trial_id: str, why: str) -> None:
            """Tune retries a trial whose worker died (`FailureConfig`) in the same Optuna trial: the lost attempt
            gets a record of its own, as on the local backend, so the ledger counts it and its reason is kept."""
            ot_trial = self._ot_trials.get(trial_id)
            if ot_trial is None:
                return
            self._energy_curves.pop(trial_id, None)  # the retry starts its curve over
            self._ot_study.add_trial(optuna.trial.create_trial(
                state=TrialState.FAIL, params=ot_trial.params, distributions=ot_trial.distributions,
                user_attrs={KIND: "lost", REASON: f"{why}; retried as trial #{ot_trial.number}",
                            "ray": {"trial_id": trial_id}}))

        def abandon_unfinished(self) -> int:
            """Trials Ray never finished (time limit, Ctrl-C) go back to the queue for the next run."""
            from energydsl.search.local import abandon

            n = 0
            unfinished = [ot for trial_id, ot in self._ot_trials.items() if trial_id not in self._completed_trials]
            for ot_trial in unfinished + self._energy_waiting:  # those waiting for a twin too
                frozen = self._energy_storage.get_trial(ot_trial._trial_id)
                if frozen.state == TrialState.RUNNING:
                    n += abandon(self._ot_study, self._energy_storage, frozen, "the Ray run ended first",
                                 interrupted=True)
            self._energy_hb.close()
            return n

        def save(self, checkpoint_path: str) -> None:  # state lives in the Optuna storage, not in pickles
            pass

        def restore(self, checkpoint_path: str) -> None:
            pass

        def __getstate__(self) -> dict[str, Any]:  # Tuner pickles its config; nothing here is needed back
            return {"_metric": self._metric, "_mode": self._mode}


    class StudyPruning(FIFOScheduler):
        """Tune's scheduler: trials run in order, and each evaluation goes to the study's pruner (through
        `StudySearch.progress`), which stops a weak trial as it would on the local backend."""

        def __init__(self, searcher: StudySearch) -> None:
            super().__init__()
            self._searcher = searcher

        def on_trial_result(self, tune_controller: Any, trial: Any, result: dict[str, Any]) -> str:
            return self.STOP if self._searcher.progress(trial.trial_id, result) else self.CONTINUE


    class LostAttempts(Callback):
        """Tune's callback for a trial it retries (the searcher is not told): the study records the attempt."""

        def __init__(self, searcher: StudySearch) -> None:
            self._searcher = searcher

        def on_trial_recover(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
            why = _last_failure(trial.error_file) or "its worker failed"
            self._searcher.record_lost(trial.trial_id, f"Ray attempt {trial.num_failures} failed ({why[:300]})")


def _last_failure(error_file: str | None) -> str | None:
    """Ray's words for a trial's latest failure, from the error file Tune has just written beside the trial
    (`trial.get_error()` reads the copy in the run's storage, not there yet): its lines, without the actor's
    ids and Ray's list of common causes."""
    if not error_file or not os.path.isfile(error_file):
        return None
    block = Path(error_file).read_text(errors="replace").rsplit("Failure # ", 1)[-1].splitlines()[1:]
    text = " ".join(line.strip() for line in block if line.strip() and not line.startswith("\t"))
    return text.split(" Some common causes")[0] or None


# the signals Ray and Tune set handlers for (SIGUSR1 is Tune's "stop the run"; Windows has none)
TUNE_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1") if hasattr(signal, name))


def run_ray(ref: SpaceRef, space: SearchSpace, study: optuna.Study, storage_spec: str, *, target: int,
            deadline: float | None, workers: int, sampler: str | None, pruner: str, device: str,
            seed: int | None, address: str | None, gpus_per_trial: float, cpus_per_trial: float) -> dict[str, Any]:
    """Run the search on Ray: a local runtime when `address` is None, else the cluster at `address`."""
    # Tune may install its own SIGINT and SIGUSR1 handlers (and Ray its SIGTERM one, _run_ray ours) and leave them:
    # the caller's come back, so that Ctrl-C in what runs after a search in this process (a training, a second
    # search) is its own
    with handlers_restored(*TUNE_SIGNALS):
        return _run_ray(ref, space, study, storage_spec, target=target, deadline=deadline, workers=workers,
                        sampler=sampler, pruner=pruner, device=device, seed=seed, address=address,
                        gpus_per_trial=gpus_per_trial, cpus_per_trial=cpus_per_trial)


def _run_ray(ref: SpaceRef, space: SearchSpace, study: optuna.Study, storage_spec: str, *, target: int,
             deadline: float | None, workers: int, sampler: str | None, pruner: str, device: str,
             seed: int | None, address: str | None, gpus_per_trial: float, cpus_per_trial: float) -> dict[str, Any]:
    try:
        import ray
        from ray import tune
    except ImportError as e:
        raise UserError("the ray backend needs Ray Tune: pip install 'ray[tune]'") from e
    storage = open_storage(storage_spec)
    with study_lock(storage_spec, study.study_name):
        recovered = recover_stale(study, storage)
    objectives = list(space.objectives)
    prune, _ = pruning_plan(objectives, pruner)
    base = study_dir(storage_spec, study.study_name)
    seed = worker_seed(seed, len(study.get_trials(deepcopy=False)), 1)  # the local backend's first worker's
    cache_root = os.path.join(tempfile.gettempdir(), "energydsl-compile-cache", file_tag(study.study_name))
    # each worker rebuilds the space and must find this one (`resolve_as`)
    trainable = tune.with_parameters(_trainable, ref=ref, fingerprint=space_fingerprint(space),
                                     device="cuda" if gpus_per_trial > 0 else device, objectives=objectives,
                                     cache_root=cache_root)
    trainable = tune.with_resources(trainable, {"cpu": cpus_per_trial, "gpu": gpus_per_trial})
    (base / "ray").mkdir(parents=True, exist_ok=True)
    started_ray = not ray.is_initialized()
    sigterm: list[int] = []

    def on_sigterm(signum: int, frame: Any) -> None:
        sigterm.append(signum)
        raise Terminated(signum)

    tune_log = logging.getLogger("ray.tune")
    level = tune_log.level
    searcher = None
    # Tune prints tables, and Ray's thread for workers' errors (a trial's worker that died) prints to stdout from
    # ray.init to ray.shutdown, and Ray's loggers write notices and a lost worker's traceback to stderr: keep them
    # off stdout (JSON), off the terminal and off the live panel; the study records what happened
    with open(base / "ray" / "tune-output.log", "a") as log, contextlib.redirect_stdout(log), _ray_logs_to(log):
        main = threading.current_thread() is threading.main_thread()
        try:
            if started_ray:
                if main:  # SIGTERM as the local backend takes it, from the start
                    signal.signal(signal.SIGTERM, on_sigterm)
                try:
                    _init_ray(ray, address, workers, cpus_per_trial)
                except SystemExit as e:  # Ray's own handler, set for the span of ray.init: sys.exit(SIGTERM)
                    if e.code != signal.SIGTERM:
                        raise
                    sigterm.append(signal.SIGTERM)
                    raise Terminated(signal.SIGTERM) from None
            if main:  # again: ray.init set Ray's handler (which exits with status 1 after it)
                signal.signal(signal.SIGTERM, on_sigterm)
            if address is not None:
                _warn_unless_a_node_fits(ray, address, cpus_per_trial, gpus_per_trial)
            searcher = StudySearch(space, study, storage, target, make_sampler(sampler, len(objectives), seed),
                                   make_pruner(pruner, space.budget) if prune else None, deadline)
            # no time budget for Tune: at the deadline `suggest` starts no new trial and the running ones finish,
            # as on the local backend (Tune's `time_budget_s` would kill them mid-training)
            tuner = tune.Tuner(
                trainable,
                tune_config=tune.TuneConfig(search_alg=searcher, scheduler=StudyPruning(searcher), num_samples=-1,
                                            max_concurrent_trials=workers,
                                            reuse_actors=True),  # a worker pays the import of torch & co once
                run_config=tune.RunConfig(name=f"{file_tag(study.study_name)}-{time.strftime('%Y%m%d-%H%M%S')}",
                                          storage_path=str((base / "ray").resolve()), verbose=0,
                                          callbacks=[LostAttempts(searcher)],
                                          failure_config=tune.FailureConfig(max_failures=MAX_RETRIES)),
            )
            tune_log.setLevel(logging.WARNING)
            # Ctrl-C as on the local backend: a KeyboardInterrupt. Tune's own SIGINT handler (set in `fit` unless
            # this variable is 1) would end the run quietly, `fit` returning as if the search were done
            with mock.patch.dict(os.environ, {"TUNE_DISABLE_SIGINT_HANDLER": "1"}):
                tuner.fit()
        except KeyboardInterrupt as e:  # Ctrl-C; or SIGTERM's Terminated, which Ray's wait (C++) may make a plain one
            if sigterm and not isinstance(e, Terminated):
                raise Terminated(sigterm[0]) from None
            raise
        finally:
            tune_log.setLevel(level)
            requeued = searcher.abandon_unfinished() if searcher is not None else 0
            if started_ray:  # also after a ray.init cut short, whose processes were already started
                ray.shutdown()
    return {"recovered": recovered, "requeued": requeued, "workers": workers}


@contextlib.contextmanager
def _ray_logs_to(stream: Any) -> Any:
    """Ray's and Tune's log records go to `stream` (the run's log file) instead of the terminal."""
    ray_log = logging.getLogger("ray")
    saved = ray_log.handlers[:]
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    ray_log.handlers = [handler]
    try:
        yield
    finally:
        ray_log.handlers = saved


CONNECT_TIMEOUT_S = 10.0  # to reach a cluster's address before Ray tries (its own retries last many minutes)


def _init_ray(ray: Any, address: str | None, workers: int, cpus_per_trial: float) -> None:
    """Start a local runtime, or join the cluster at `address`; a cluster that cannot be reached is the user's
    to fix (exit 2), not an internal error, and not a hang."""
    if not address:
        # "local": a runtime of our own, never a cluster someone else started on this machine
        ray.init(address="local", num_cpus=max(1, math.ceil(workers * cpus_per_trial)), include_dashboard=False,
                 log_to_driver=False, logging_level=logging.WARNING)
        return
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, ValueError, RuntimeError, TimeoutError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"cannot join the Ray cluster at --address {address}: {first}", hint=_join_hint(address)) \
            from None


def _join_hint(address: str) -> str:
    """Why a cluster that answered the probe (`check_reachable`) may still refuse this process: most often its
    token authentication (on by default for `ray start` since Ray 2.59), which a process joining by HOST:PORT
    takes part in only with RAY_AUTH_MODE=token and the cluster's token; `auto` finds a local head's token."""
    start = "start it with `ray start --head` (then `--address auto` on that machine, or HEAD_IP:6379 elsewhere)"
    if address == "auto" or address.startswith("ray://"):
        return f"{start}, or leave --address out for a Ray runtime on this machine"
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return ("a Ray cluster answers there but did not let this process join: one with token authentication (`ray "
                "start` says 'Token authentication is enabled') needs RAY_AUTH_MODE=token here, and its token in "
                "RAY_AUTH_TOKEN or in ~/.ray/auth_token (`ray get-auth-token` on the head prints it); on the head "
                "itself `--address auto` finds it")
    return ("a Ray cluster answers there but did not let this process join: check that RAY_AUTH_TOKEN (or "
            "RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token) holds the token the cluster was started with (`ray "
            "get-auth-token` on the head), and that this machine's Ray version is the cluster's")


# an HTTP/2 client's connection preface and an empty SETTINGS frame: a gRPC server (Ray's GCS) answers with a
# SETTINGS frame of its own (frame type 4, the fourth byte of its 9-byte header)
_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def check_reachable(address: str) -> None:
    """A cluster's HOST:PORT that does not answer, or where something other than a gRPC server (Ray's GCS)
    answers, is the user's to fix, said before a storage opens or Ray starts (Ray's own retries last many
    minutes, printing C++ warnings); `auto` and `ray://` addresses are left to `ray.init`. A malformed address
    is refused."""
    hint = ("start it with `ray start --head` there, or give the head's address and port (default 6379); "
            "`--address auto` finds a cluster started on this machine")
    if address == "auto" or address.startswith("ray://"):
        return
    host, sep, port = address.rpartition(":")
    if "://" in address or not (sep and host and port.isdigit() and 0 < int(port) < 65536):  # http://: no
        raise UserError(f"--address {address!r} is not a Ray cluster's address",
                        hint="give auto (on a node of the cluster), HEAD_IP:6379, or ray://HEAD_IP:10001 (Ray Client)")
    try:
        conn = socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S)
    except OSError as e:
        raise UserError(f"cannot reach the Ray cluster at --address {address}: {e}", hint=hint) from None
    with conn:
        if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
            return  # a TLS server waits for a TLS hello: the plain probe below would fail it
        try:
            conn.sendall(_HTTP2_HELLO)
            answer = conn.recv(9)
        except OSError:  # silence until the timeout, or a reset: no gRPC server there
            answer = b""
    if answer[3:4] != b"\x04":
        raise UserError(f"--address {address}: something answers there that is not a Ray cluster (no gRPC "
                        "server: a wrong port?)", hint=hint)


def _warn_unless_a_node_fits(ray: Any, address: str, cpus: float, gpus: float) -> None:
    """A trial larger than every node of the cluster waits, silently, until one that fits joins (which an
    autoscaler may do): say so."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if nodes and not any(r.get("CPU", 0) >= cpus and r.get("GPU", 0) >= gpus for r in nodes):
        largest = max(nodes, key=lambda r: (r.get("GPU", 0), r.get("CPU", 0)))
        warnings.warn(f"no node of the cluster at {address} has {cpus:g} CPUs and {gpus:g} GPUs for a trial (the "
                      f"largest has {largest.get('CPU', 0):g} and {largest.get('GPU', 0):g}): the trials wait until "
                      "such a node joins (an autoscaler may add one); Ctrl-C to stop", stacklevel=2)


def check_local_gpus(gpus_per_trial: float) -> None:
    """A local runtime has this machine's GPUs: a trial that asks for more could never start (Tune would wait)."""
    if gpus_per_trial <= 0:
        return
    import torch

    count = torch.cuda.device_count()
    if gpus_per_trial > count:
        have = "no GPU" if count == 0 else f"{count} GPU{'s' if count > 1 else ''}"
        raise UserError(f"--gpus-per-trial {gpus_per_trial:g}: this machine has {have}, so no trial could start "
                        "on a local Ray runtime",
                        hint="leave --gpus-per-trial out (CPU trials), or give --address of a cluster with GPUs")

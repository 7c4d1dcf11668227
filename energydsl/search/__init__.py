"""Search engine: explores a space of model compositions with Optuna, locally or on Ray.

The engine is independent of the DSL: it only sees the `SearchSpace`/`Candidate` protocols of
`energydsl.search.space`. Results live in an Optuna study (journal file under `runs/<study>/` by
default, or any Optuna storage URL), which both backends write in the same format, so a search can be
stopped, killed or moved between backends and continued, and `write_report` reads any of them.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import sys
import time
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from energydsl.errors import UserError
from energydsl.number_text import is_whole
from energydsl.search.display import LiveProgress, print_leaderboard
from energydsl.search.local import (
    PRUNERS,
    SAMPLERS,
    WORKERS_PER_CPU,
    make_sampler,
    max_local_workers,
    pruning_plan,
    quiet_optuna,
    run_local,
)
from energydsl.search.report import RETRY_OF, export_best, ledger, study_dataset, summarize, write_report
from energydsl.search.settings import (
    DECLARATIONS,
    HOLE,
    OPTION_HOLES,
    OPTIONS,
    edited_declarations,
    edited_option_holes,
)
from energydsl.search.space import (
    Candidate,
    SearchSpace,
    SpaceRef,
    absolute,
    register_space,
    registered_spaces,
    resolve_space,
    space_fingerprint,
)
from energydsl.search.storage import (
    check_storage_given,
    default_storage_path,
    load_study,
    open_storage,
    storage_lock,
    study_lock,
)
from energydsl.signal_handlers import Terminated

__all__ = [
    "Candidate", "SearchSpace", "SpaceRef", "register_space", "registered_spaces", "resolve_space",
    "run_search", "open_study", "write_report", "export_best", "load_study", "hole_rows",
    "BACKENDS", "SAMPLERS", "PRUNERS",
]

BACKENDS = ("local", "ray")
# what each Ray trial reserves when --gpus-per-trial / --cpus-per-trial are not given (None: "not given", so that
# a value given to the local backend, which reserves nothing, can be refused)
RAY_GPUS_PER_TRIAL = 0.0
RAY_CPUS_PER_TRIAL = 1.0


def open_study(storage: str, study_name: str, space: SearchSpace,
               ref: SpaceRef | None = None) -> optuna.Study:
    """Create the study, or load it when it exists (a rerun continues it) after checking it is the same
    search: same objectives, same directions."""
    return _open_study(storage, study_name, space, ref)[0]


def _open_study(storage: str, study_name: str, space: SearchSpace,
                ref: SpaceRef | None = None) -> tuple[optuna.Study, int]:
    """`open_study`, and how many trials of a killed run it put back (the run's summary counts them)."""
    quiet_optuna()
    names = [n for n, _ in space.objectives]
    directions = [d for _, d in space.objectives]
    with storage_lock(storage):
        study = optuna.create_study(storage=open_storage(storage, append=True), study_name=study_name,
                                    directions=directions, load_if_exists=True)
    have = ["minimize" if d == optuna.study.StudyDirection.MINIMIZE else "maximize" for d in study.directions]
    recorded = study.user_attrs.get("objectives")
    if have != directions or (recorded is not None and recorded != names):
        raise UserError(
            f"study {study_name!r} in {storage} searches {recorded or '?'} ({', '.join(have)}), not "
            f"{names} ({', '.join(directions)})",
            hint="pick another --study name or --storage for a different search")
    with study_lock(storage, study_name):  # two commands starting at once: one records, the other compares
        from .local import recover_stale  # a trial whose worker was killed (-9) is put back before the refit

        recovered = recover_stale(study, study._storage)
        trials = study.get_trials(deepcopy=False)  # once: on an RDB storage a listing is a full query
        listed = getattr(space, "distributions", None)  # name -> (distribution, where), if the space lists them
        holes = listed() if callable(listed) else None
        check_distributions(study, trials, holes, storage)
        for note in refit_retries(study, trials, holes):
            print(f"note: {note}", file=sys.stderr)
        wanted: dict[str, Any] = {"objectives": names}
        settings = check_settings_unchanged(study, trials, space, storage)
        if settings is not None:
            wanted[SETTINGS] = settings
        if ref is not None:
            wanted.update(space=ref.spec, sets=dict(ref.sets))
        for key, value in wanted.items():
            if study.user_attrs.get(key) != value:
                study.set_user_attr(key, value)
    return study, recovered


def _compared(value: str | None) -> str | None:
    """A hole's range may change as any hole's may (check_distributions guards its kind); a hole become a value,
    or a value become a hole, may not."""
    return HOLE if value is not None and value.startswith(HOLE) else value


def _shown(value: str | None) -> str:
    return "(not set)" if value is None else value.removeprefix(HOLE)


SETTINGS = "settings"  # the study's user attr: the space's fingerprint when it was searched


def check_settings_unchanged(study: optuna.Study, trials: list[FrozenTrial], space: SearchSpace,
                             storage: str) -> dict[str, str] | None:
    """A rerun must train as the study's trials were trained (same training settings, data, space text), or
    its results would be ranked against incomparable ones; what does not change results (the trials budget,
    workers, timeout, device, backend) may change. Returns the space's fingerprint (`fingerprint()`: name ->
    text) to record, None for a space without one."""
    now = space_fingerprint(space)
    if now is None:
        return None
    old = study.user_attrs.get(SETTINGS)
    # a RUNNING trial here has a live worker (`recover_stale` ran first): it trains with the recorded settings
    running = [t.number for t in trials if t.state == TrialState.RUNNING]
    trained = running or any(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
    if not isinstance(old, dict) or not trained:
        return now  # a study from before fingerprints, or nothing trained yet (only waiting or failed trials)
    # options: not compared with a study recorded before they were hashed; declarations: they only name what an
    # edit of `text` touched
    changed = [k for k in dict.fromkeys([*old, *now]) if _compared(old.get(k)) != _compared(now.get(k))
               and (k in old or k != OPTIONS) and k not in (DECLARATIONS, OPTION_HOLES)]
    if not changed:
        return now
    texts = ("text", OPTIONS)
    diffs = [f"{k}: {_shown(old.get(k))} → {_shown(now.get(k))}" for k in changed if k not in texts]
    back = ", ".join(f"{k} = {_shown(old[k])}" for k in changed if k not in texts and k in old)
    hints = []
    if "text" in changed:
        diffs.append(f"the space's text outside its holes was edited{edited_declarations(old, now)}")
    where = None
    holes = edited_option_holes(old, now) if OPTIONS in changed else []
    if OPTIONS in changed and holes is not None and not holes and diffs:
        changed.remove(OPTIONS)  # only holes a --set replaced (or the text added): the diffs above say so
    if OPTIONS in changed:
        named = f" (the options of {', '.join(f'`{h}`' for h in holes)})" if holes else ""
        diffs.append("what a choice's options fix was edited (an optimizer's or preconditioner's arguments, say)"
                     + named)
        spans = space.distributions() if holes and callable(getattr(space, "distributions", None)) else {}
        where = spans[holes[0]][1] if holes and holes[0] in spans else None
    if "text" in changed or OPTIONS in changed:
        hints.append("restore the space file as the study searched it")
    if back:
        hints.append(f"give the study's settings again ({back})")
    raise UserError(
        f"study {study.study_name!r} in {storage} was searched with other settings: {'; '.join(diffs)}; "
        "its trials would not be comparable with these"
        + (f" (trial{'s' if len(running) > 1 else ''} {', '.join(f'#{n}' for n in running)} "
           f"{'are' if len(running) > 1 else 'is'} training with them now)" if running else ""), where,
        hint="to search with these settings, start a new study (another --study name or --storage); to "
             f"continue this one, {' and '.join(hints)}")


def _show(d: optuna.distributions.BaseDistribution) -> str:
    """A distribution as a hole is written."""
    if isinstance(d, optuna.distributions.CategoricalDistribution):
        return "choice{" + ", ".join(str(c) for c in d.choices) + "}"
    if isinstance(d, optuna.distributions.IntDistribution):
        return f"int {d.low}..{d.high}" + (" log" if d.log else "")
    if isinstance(d, optuna.distributions.FloatDistribution):
        return f"float {d.low:g}..{d.high:g}" + (" log" if d.log else "")
    return repr(d)


def hole_rows(space: SearchSpace) -> list[tuple[str, str, str]] | None:
    """(name, values, where) for every hole, as `energy search --holes` prints them: a `.energy` space's from
    its `describe()`, a Python space's from its `distributions()`; None for a space that lists neither."""
    describe = getattr(space, "describe", None)
    if callable(describe):
        return describe()
    listed = getattr(space, "distributions", None)
    if not callable(listed):
        return None
    return [(name, _show(dist), str(where) if where else space.name) for name, (dist, where) in listed().items()]


Holes = dict[str, tuple[optuna.distributions.BaseDistribution, Any]]  # a space's `distributions()`


def check_distributions(study: optuna.Study, trials: list[FrozenTrial], holes: Holes | None, storage: str) -> None:
    """Before a rerun samples anything: every hole must still be sampled as the study recorded it (Optuna
    refuses to change a choice's options, or a hole's kind or log scale, within a study; every trial
    would fail). `holes`: the space's `distributions()` (name -> (distribution, where)); None for a space that
    lists none, which is not checked."""
    if holes is None:
        return
    recorded: dict[str, optuna.distributions.BaseDistribution] = {}
    for t in trials:
        for name, dist in t.distributions.items():
            recorded.setdefault(name, dist)
    for name, (dist, where) in holes.items():
        old = recorded.get(name)
        if old is None:
            continue
        try:
            optuna.distributions.check_distribution_compatibility(old, dist)
        except ValueError:
            raise UserError(
                f"hole `{name}` is now {_show(dist)}, but study {study.study_name!r} in {storage} sampled it "
                f"as {_show(old)}, and a study cannot change that", where,
                hint=f"to search the edited space, start a new study (another --study name or --storage); "
                     f"to continue this one, write the hole as {_show(old)} again") from None


def refit_retries(study: optuna.Study, trials: list[FrozenTrial], listed: Holes | None) -> list[str]:
    """A waiting retry (a lost or interrupted trial put back with its parameters) keeps the parameters the edited
    space can still sample; one outside a hole's narrowed range is sampled afresh. Optuna would train it
    outside the range, with a raw UserWarning. `listed`: as for `check_distributions`. Returns a note for each
    retry changed."""
    if listed is None:
        return []
    holes = {name: dist for name, (dist, _) in listed.items()}
    notes = []
    for t in trials:
        fixed = t.system_attrs.get("fixed_params")
        if t.state != TrialState.WAITING or not isinstance(fixed, dict) or not fixed:
            continue
        outside = [name for name, value in fixed.items() if name in holes and not _samples(holes[name], value)]
        if not outside:
            continue
        try:  # another command may have taken the trial meanwhile: it then trains as it was queued
            study._storage.set_trial_system_attr(
                t._trial_id, "fixed_params", {k: v for k, v in fixed.items() if k not in outside})
        except optuna.exceptions.UpdateFinishedTrialError:
            continue
        what = f"the retry of trial #{t.system_attrs[RETRY_OF]}" if RETRY_OF in t.system_attrs else \
            f"waiting trial #{t.number}"
        kept = "keeps its other parameters, but" if len(outside) < len(fixed) else "is sampled afresh:"
        shown = ", ".join(f"`{name}` = {fixed[name]!r} (now {_show(holes[name])})" for name in outside)
        notes.append(f"{what} {kept} {shown} {'is' if len(outside) == 1 else 'are'} outside the edited space"
                     + (": sampled afresh" if len(outside) < len(fixed) else ""))
    return notes


def _samples(dist: optuna.distributions.BaseDistribution, value: Any) -> bool:
    """Whether `dist` can sample `value` (in its range, on its step, among its choices)."""
    try:
        return bool(dist._contains(dist.to_internal_repr(value)))
    except (ValueError, TypeError):
        return False


def _check_types(**options: Any) -> None:
    """From Python, `run_search(trials=2.5)` ran 2 trials and `workers="2"` failed in a comparison: each option
    must be of its kind (a whole number, a number or a string; None where it may be left out)."""
    kinds = {"trials": "whole", "workers": "whole", "seed": "whole", "timeout": "number", "gpus_per_trial": "number",
             "cpus_per_trial": "number"}
    for name, value in options.items():
        kind = kinds.get(name, "string")
        if value is None and name not in ("workers", "backend", "pruner", "device"):
            continue
        ok = (isinstance(value, str) if kind == "string" else
              is_whole(value) if kind == "whole" else
              isinstance(value, numbers.Real) and not isinstance(value, bool))  # its range: check_options
        if not ok:
            wanted = {"whole": "a whole number", "number": "a number", "string": "a string"}[kind]
            raise UserError(f"run_search's {name} must be {wanted}, not {value!r} ({type(value).__name__})")


def check_options(*, backend: str, trials: int | None, timeout: float | None, workers: int, storage: str | None,
                  study_name: str | None, pruner: str, device: str, address: str | None,
                  gpus_per_trial: float | None, cpus_per_trial: float | None, seed: int | None) -> None:
    """Refuse `run_search`'s options (the `energy search` flags, named as the command line spells them) that are
    out of range or meaningless together, before the space loads, a storage opens or a backend starts.
    `gpus_per_trial` / `cpus_per_trial` are None when not given; given, they need the ray backend."""
    _check_types(trials=trials, workers=workers, seed=seed, timeout=timeout, gpus_per_trial=gpus_per_trial,
                 cpus_per_trial=cpus_per_trial, storage=storage, study_name=study_name, address=address,
                 backend=backend, pruner=pruner, device=device)
    if backend not in BACKENDS:
        raise UserError(f"unknown --backend {backend!r}; choose one of {', '.join(BACKENDS)}",
                        hint="local: worker processes on this machine; ray: Ray Tune trials, on a local Ray "
                             "runtime or the cluster at --address")
    if pruner not in PRUNERS:
        raise UserError(f"unknown pruner {pruner!r}; choose one of {', '.join(PRUNERS)}")
    if workers < 1:
        raise UserError(f"--workers must be at least 1, not {workers}", hint="the number of trials run at once")
    if trials is not None and trials < 1:
        raise UserError(f"--trials must be at least 1, not {trials}",
                        hint="the number of finished trials the study should hold")
    if seed is not None and not 0 <= seed <= 2**32 - 1:
        raise UserError(f"--seed: the seed must be between 0 and 2**32 - 1, not {seed}")
    if timeout is not None and not timeout > 0:
        raise UserError(f"--timeout: the timeout must be a positive number of seconds, not {timeout}",
                        hint="leave --timeout out for no time limit")
    if storage is not None:
        check_storage_given(storage)
    if study_name is not None and not study_name.strip():
        raise UserError("--study is empty", hint="give a study name, or leave --study out for the search's name")
    resources = "each Ray trial reserves gpus_per_trial >= 0 and cpus_per_trial > 0 (fractions allowed), e.g. " \
                "--gpus-per-trial 0.5 --cpus-per-trial 2"
    if gpus_per_trial is not None and not (math.isfinite(gpus_per_trial) and gpus_per_trial >= 0):
        raise UserError(f"--gpus-per-trial must be a number at least 0, not {gpus_per_trial:g}", hint=resources)
    if cpus_per_trial is not None and not (math.isfinite(cpus_per_trial) and cpus_per_trial > 0):
        raise UserError(f"--cpus-per-trial must be a number above 0, not {cpus_per_trial:g}", hint=resources)
    for flag, value in (("--gpus-per-trial", gpus_per_trial), ("--cpus-per-trial", cpus_per_trial)):
        if value is not None and round(value, 4) != value:  # Ray's own error came from inside tuner.fit(): exit 70
            raise UserError(f"{flag} {value!r}: Ray counts resources in steps of 0.0001", hint=resources)
    if address is not None and backend != "ray":
        raise UserError(f"--address {address!r} names a Ray cluster, and the {backend} backend does not use one",
                        hint="add --backend ray to run the trials on that cluster, or leave --address out to run "
                             "them on this machine")
    if address is not None and not address.strip():
        raise UserError("--address is empty", hint="give auto (on a node of the cluster) or HEAD_IP:6379; without "
                                                   "--address, the ray backend starts a Ray runtime of its own")
    for flag, value in (("--gpus-per-trial", gpus_per_trial), ("--cpus-per-trial", cpus_per_trial)):
        if value is not None and backend != "ray":
            raise UserError(f"{flag} {value:g} reserves resources for each Ray trial, and the {backend} backend does "
                            "not use it", hint=f"add --backend ray to run the trials as Ray trials, or leave {flag} "
                                               "out (the local backend runs --workers processes, on --device)")
    here = os.cpu_count() or 1
    if backend == "ray" and address is None and cpus_per_trial is not None and cpus_per_trial > here:
        raise UserError(f"--cpus-per-trial {cpus_per_trial:g}: this machine has {here} CPU{'s' if here > 1 else ''}, "
                        "and a local Ray runtime runs every trial here (each would train with that many threads)",
                        hint=f"give at most --cpus-per-trial {here}, or --address of a cluster with larger nodes")
    if backend == "local" or address is None:  # the trials run on this machine: worker processes, or a local Ray
        most = max_local_workers()
        if workers > most:
            cpus = most // WORKERS_PER_CPU
            elsewhere = "--backend ray --address HEAD_IP:6379" if backend == "local" else "--address HEAD_IP:6379"
            raise UserError(f"--workers {workers} is more than this machine runs at once: at most {most} "
                            f"({WORKERS_PER_CPU} per CPU, {cpus} CPU{'s' if cpus != 1 else ''} here)",
                            hint=f"these trials all run on this machine: give --workers {most} or fewer ({cpus}, "
                                 f"one per CPU, trains fastest), or run them on a Ray cluster ({elsewhere})")
    if backend == "ray" and device.startswith("cuda") and not gpus_per_trial:
        raise UserError(f"--device {device} on the ray backend needs GPUs reserved per trial",
                        hint="give --gpus-per-trial, e.g. 0.5 (two trials per GPU)")
    if backend == "ray":  # what needs this machine or the cluster: still before the study is created
        from .ray_backend import check_local_gpus, check_reachable

        if address is None:
            check_local_gpus(gpus_per_trial or 0.0)
        else:
            check_reachable(address)


def run_search(
    ref: SpaceRef | str,
    *,
    backend: str = "local",
    trials: int | None = None,
    timeout: float | None = None,
    workers: int = 1,
    storage: str | None = None,
    study_name: str | None = None,
    sampler: str | None = None,
    pruner: str = "asha",
    device: str = "cpu",
    json: bool = False,
    address: str | None = None,
    gpus_per_trial: float | None = None,
    cpus_per_trial: float | None = None,
    progress: bool = True,
    seed: int | None = None,
) -> dict[str, Any]:
    """Run (or continue) a search until the study holds `trials` finished trials or `timeout` seconds
    have passed (no new trial starts after it; running ones finish).

    `trials` counts every finished trial, invalid and duplicate ones included (they are cheap); trials
    lost with their worker are retried and not counted. Defaults come from the space's budget.
    Returns a summary: completed, pruned, failed, invalid, duplicates, lost, best (params and objective
    values; the Pareto front list with several objectives), study, storage, ...

    `gpus_per_trial` and `cpus_per_trial` are for the ray backend only (given to the local one, they are refused);
    left out, each Ray trial reserves RAY_GPUS_PER_TRIAL GPUs and RAY_CPUS_PER_TRIAL CPUs."""
    if isinstance(storage, os.PathLike):  # a journal's path as a Path
        storage = os.fspath(storage)
    check_options(backend=backend, trials=trials, timeout=timeout, workers=workers, storage=storage,
                  study_name=study_name, pruner=pruner, device=device, address=address,
                  gpus_per_trial=gpus_per_trial, cpus_per_trial=cpus_per_trial, seed=seed)
    ref = ref if isinstance(ref, SpaceRef) else SpaceRef(str(ref))
    ref = absolute(ref)  # workers (Ray's above all) may run in another directory
    quiet_optuna()
    space = resolve_space(ref)
    objectives = list(space.objectives)
    name = study_name or space.name
    storage_spec = storage or default_storage_path(name)
    if "://" not in storage_spec:
        storage_spec = str(Path(storage_spec).resolve())
    target = int(trials if trials is not None else space.budget.get("trials", 20))
    if target < 1:
        raise UserError(f"trials must be at least 1, not {target}")
    if timeout is None:
        timeout = space.budget.get("timeout")
    check_device = getattr(space, "check_device", None)  # a device the trials cannot use: fail now
    if callable(check_device):
        check_device(device, local=backend == "local")
    make_sampler(sampler, len(objectives), seed)  # unknown/unusable sampler: fail before any work
    _, note = pruning_plan(objectives, pruner)
    study, recovered = _open_study(storage_spec, name, space, ref)
    notes = [note] if note else []
    held = ledger(study.get_trials(deepcopy=False)).finished
    if held >= target:  # the panel would show `6/3 trials` and nothing would say why none ran
        notes.append(f"the study already holds {held} finished trials, at least the {target} asked for: no trial ran "
                     f"(--trials {held + target} runs {target} more)")
        if progress and not json:
            print(f"note: {notes[-1]}", file=sys.stderr)
    started = time.time()
    deadline = started + float(timeout) if timeout else None
    show = progress and not json
    display = LiveProgress(storage_spec, name, target, note) if show else contextlib.nullcontext()
    common = dict(target=target, deadline=deadline, workers=workers, sampler=sampler, pruner=pruner,
                  device=device, seed=seed)
    extra: dict[str, Any] = {}
    interrupted: str | None = None
    try:
        with display:
            if backend == "local":
                extra = run_local(ref, study, storage_spec, fingerprint=space_fingerprint(space), **common)
            else:
                from energydsl.search.ray_backend import run_ray

                extra = run_ray(ref, space, study, storage_spec, address=address,
                                gpus_per_trial=RAY_GPUS_PER_TRIAL if gpus_per_trial is None else gpus_per_trial,
                                cpus_per_trial=RAY_CPUS_PER_TRIAL if cpus_per_trial is None else cpus_per_trial,
                                **common)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM to the local backend (`Terminated`)
        interrupted = "SIGTERM" if isinstance(e, Terminated) else "SIGINT"
    elapsed = round(time.time() - started, 3)
    extra["recovered"] = recovered + int(extra.get("recovered", 0))  # put back on opening, and while it ran
    extra["dataset"] = study_dataset(study)  # what the trials train on (the CLI keeps outputs off it)
    summary = summarize(study, storage_spec, target, backend=backend, elapsed_s=elapsed,
                        interrupted=interrupted is not None, notes=notes, **extra)
    if interrupted:
        summary["interrupted_by"] = interrupted
    if show:
        print_leaderboard(study)
    return summary

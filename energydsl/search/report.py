"""The study format both backends write, summaries of it, and the self-contained HTML report.

Everything the engine knows about a trial lives in the Optuna storage (user attrs for people, system
attrs for the engine), so `energy report` and a resumed search need nothing else: no pickles, no logs.
"""

from __future__ import annotations

import contextlib
import html
import math
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState

from energydsl.errors import UserError
from energydsl.files import write_atomic
from energydsl.number_text import is_whole
from energydsl.search.storage import load_study

# --- user attrs (what a person reads in the report) ---
KIND = "kind"  # complete | duplicate | invalid | pruned | error | lost | interrupted
REASON = "reason"
SOURCE = "source"
MATHML = "equations_mathml"
HASH = "equation_hash"
CURVE = "curve"  # [[step, val_loss], ...]
METRICS = "metrics"
NOTES = "notes"  # a metric that is not one: what training said of the trial (parameters that never train)
DUPLICATE_OF = "duplicate_of"
TIMING = "timing"  # {"evaluate_s": ..., "total_s": ...}: the benchmark's overhead measure
TRACEBACK = "traceback"
# --- system attrs (engine bookkeeping) ---
SLOT = "energy:slot"  # which of the `trials` budget slots this trial fills
OWNER = "energy:owner"  # {"host", "boot", "pid", "start"} of the process running it
CLAIMER = "energy:claimer"  # the same, written just before claiming: covers a death before OWNER is set
HEARTBEAT = "energy:heartbeat"  # unix time, refreshed while running
RETRY_OF = "energy:retry_of"
# A lost trial (its worker died) or an interrupted one (Ctrl-C, SIGTERM) is replaced by a retry with the
# same parameters and does not count toward the budget.
UNCOUNTED_KINDS = frozenset({"lost", "interrupted"})
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def objectives_of(study: optuna.Study) -> list[tuple[str, str]]:
    """The (name, direction) pairs recorded when the study was created by the engine."""
    dirs = ["minimize" if d == optuna.study.StudyDirection.MINIMIZE else "maximize" for d in study.directions]
    names = study.user_attrs.get("objectives") or [f"value{i}" for i in range(len(dirs))]
    return list(zip(names, dirs, strict=False))


def trial_kind(t: FrozenTrial) -> str:
    kind = t.user_attrs.get(KIND)
    if kind:
        return str(kind)
    return {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned", TrialState.FAIL: "error"}.get(
        t.state, t.state.name.lower()
    )


def is_counted(t: FrozenTrial) -> bool:
    """Does this finished trial use up one of the `trials` budget?"""
    return t.state in FINISHED and trial_kind(t) not in UNCOUNTED_KINDS


@dataclass
class Ledger:
    """Trial counts as the engine sees them (lost/void trials are replaced, so counted apart)."""

    completed: int = 0
    pruned: int = 0
    failed: int = 0
    invalid: int = 0  # included in pruned
    duplicates: int = 0  # included in completed
    pruned_duplicates: int = 0  # included in pruned: a duplicate of a pruned trial is pruned too
    lost: int = 0  # lost or interrupted, and retried
    running: int = 0
    waiting: int = 0

    @property
    def finished(self) -> int:
        return self.completed + self.pruned + self.failed


def ledger(trials: Sequence[FrozenTrial]) -> Ledger:
    led = Ledger()
    for t in trials:
        kind = trial_kind(t)
        if t.state == TrialState.RUNNING:
            led.running += 1
        elif t.state == TrialState.WAITING:
            led.waiting += 1
        elif kind in UNCOUNTED_KINDS:
            led.lost += 1
        elif t.state == TrialState.COMPLETE:
            led.completed += 1
            led.duplicates += kind == "duplicate"
        elif t.state == TrialState.PRUNED:
            led.pruned += 1
            led.invalid += kind == "invalid"
            led.pruned_duplicates += kind == "duplicate"
        elif t.state == TrialState.FAIL:
            led.failed += 1
    return led


def _trial_brief(t: FrozenTrial, names: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"number": t.number, "params": dict(t.params)}
    if t.values is not None:
        out["values"] = dict(zip(names, t.values, strict=False))
    if DUPLICATE_OF in t.user_attrs:
        out[DUPLICATE_OF] = t.user_attrs[DUPLICATE_OF]
    return out


def ranked(study: optuna.Study) -> list[FrozenTrial]:
    """Complete trials, best first: by the objective, or Pareto front first, then by the first objective."""
    objectives = objectives_of(study)
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.values]
    sign = [1.0 if d == "minimize" else -1.0 for _, d in objectives]
    front = {t.number for t in pareto(done, sign)} if len(objectives) > 1 else set()
    return sorted(done, key=lambda t: (t.number not in front, sign[0] * t.values[0], t.number))


def pareto(trials: Sequence[FrozenTrial], sign: Sequence[float]) -> list[FrozenTrial]:
    """The non-dominated trials (vectorized in blocks: the live display calls this every second)."""
    import numpy as np

    if not trials:
        return []
    pts = np.asarray([t.values for t in trials], dtype=float) * np.asarray(sign, dtype=float)
    dominated = np.zeros(len(pts), dtype=bool)
    for lo in range(0, len(pts), 256):
        blk = pts[lo : lo + 256, None, :]
        dominated[lo : lo + 256] = ((pts[None] <= blk).all(-1) & (pts[None] < blk).any(-1)).any(1)
    return [t for t, d in zip(trials, dominated, strict=True) if not d]


def best_of(study: optuna.Study) -> dict[str, Any] | list[dict[str, Any]] | None:
    """The best trial (one objective) or the Pareto front, duplicates left out (multi-objective)."""
    objectives = objectives_of(study)
    names = [n for n, _ in objectives]
    order = ranked(study)
    if len(objectives) == 1:
        return _trial_brief(order[0], names) if order else None
    sign = [1.0 if d == "minimize" else -1.0 for _, d in objectives]
    front = pareto([t for t in order if DUPLICATE_OF not in t.user_attrs], sign)
    return [_trial_brief(t, names) for t in front]


def summarize(study: optuna.Study, storage: str, target: int | None = None, **extra: Any) -> dict[str, Any]:
    """The summary `run_search` returns (and the CLI prints as JSON)."""
    led = ledger(study.get_trials(deepcopy=False))
    out: dict[str, Any] = {"study": study.study_name, "storage": storage}
    out.update(asdict(led))
    out["finished"] = led.finished
    if target is not None:
        out["target"] = target
    out["objectives"] = [list(o) for o in objectives_of(study)]
    out["best"] = best_of(study)
    out.update(extra)
    return out


# ----------------------------------------------------------------------------- who runs a trial
# A RUNNING trial records its owner; on the same host a dead owner is seen at once (pid, start time,
# boot id), elsewhere by a heartbeat gone silent. That is how a killed search is recovered.

HEARTBEAT_S = 30.0  # how often a running trial says it is alive
STALE_AFTER_S = 180.0  # silence after which a trial owned by another host counts as lost
OWNERLESS_AFTER_S = 60.0  # OWNER is written milliseconds after the claim; much later, nobody will

HOST = socket.gethostname()


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


BOOT = (_read("/proc/sys/kernel/random/boot_id") or "").strip()


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) of a process, from /proc; None when it does not exist."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # the command name may contain spaces and parentheses
    return fields[0], int(fields[19])


def owner_info() -> dict[str, Any]:
    stat = _proc_stat(os.getpid())
    return {"host": HOST, "boot": BOOT, "pid": os.getpid(), "start": stat[1] if stat else None}


def pid_alive(pid: int, start: int | None) -> bool:
    """Is the process that claimed a trial still running (not a zombie, not a reused pid)?"""
    if os.path.isdir("/proc"):
        stat = _proc_stat(pid)
        return stat is not None and stat[0] not in ("Z", "X") and (start is None or stat[1] == start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_reason(t: FrozenTrial, now: float | None = None) -> str | None:
    """Why a RUNNING trial can no longer finish, or None while its worker may still be at work."""
    now = time.time() if now is None else now
    owner = t.system_attrs.get(OWNER) or {}
    if not owner:  # killed between claiming and recording itself: the claimer tells who it was
        claimer = t.system_attrs.get(CLAIMER) or {}
        if claimer.get("host") == HOST and (claimer.get("boot") != BOOT or not pid_alive(
                int(claimer["pid"]), claimer.get("start"))):
            return f"the process running it (pid {claimer['pid']} on {HOST}) died as it took this trial"
        started = t.datetime_start.timestamp() if t.datetime_start else None
        if started is not None and now - started > OWNERLESS_AFTER_S:
            return f"no worker took ownership in {now - started:.0f}s"
        return None
    if owner.get("host") == HOST:
        if owner.get("boot") != BOOT:
            return f"host {HOST} restarted while the trial ran"
        if not pid_alive(int(owner["pid"]), owner.get("start")):
            return f"the process running it (pid {owner['pid']} on {HOST}) died while running this trial"
        return None
    last = t.system_attrs.get(HEARTBEAT) or (t.datetime_start.timestamp() if t.datetime_start else None)
    if last is not None and now - float(last) > STALE_AFTER_S:
        where = owner.get("host", "its worker")
        return f"no heartbeat from {where} for {now - float(last):.0f}s"
    return None


class Heartbeat:
    """A daemon thread stamping the trials this process runs, so other hosts can tell they are alive."""

    def __init__(self, storage: BaseStorage, interval: float = HEARTBEAT_S) -> None:
        self._storage, self._interval = storage, interval
        self._ids: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="energy-heartbeat", daemon=True)
        self._thread.start()

    def add(self, trial_id: int) -> None:  # first beat after one interval; datetime_start till then
        with self._lock:
            self._ids.add(trial_id)

    def discard(self, trial_id: int) -> None:
        with self._lock:
            self._ids.discard(trial_id)

    def close(self) -> None:
        self._stop.set()

    def _beat(self, trial_id: int) -> None:
        with contextlib.suppress(Exception):  # finished meanwhile, or a storage blip: the next beat retries
            self._storage.set_trial_system_attr(trial_id, HEARTBEAT, time.time())

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                ids = list(self._ids)
            for tid in ids:
                self._beat(tid)


# ----------------------------------------------------------------------------- HTML report


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _axis(label: str, values: list[Any]) -> dict[str, Any]:
    """A parallel-coordinates axis: numbers on a numeric axis, a conditional hole's trials without it on a tick of
    their own below the range; anything else (an optimizer's name, an expression's text) as categories."""
    present = [v for v in values if v is not None]
    if not present or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in present):
        cats = sorted({str(v) for v in values})
        return {"label": label, "values": [cats.index(str(v)) for v in values],
                "tickvals": list(range(len(cats))), "ticktext": cats}
    if len(present) == len(values):
        return {"label": label, "values": values}
    low, high = min(present), max(present)
    absent = low - (0.2 * (high - low) or 0.2 * abs(low) or 1.0)
    ticks = [low + (high - low) * n / 4 for n in range(5)] if high > low else [low]
    return {"label": label, "values": [absent if v is None else v for v in values], "range": [absent, high],
            "tickvals": [absent, *ticks], "ticktext": ["not sampled", *(f"{t:.3g}" for t in ticks)]}


def _figures(study: optuna.Study) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go

    objectives = objectives_of(study)
    names = [n for n, _ in objectives]
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.values]
    done = [t for t in complete if all(finite(v) for v in t.values)]  # plotly draws inf as a gap, -inf hid the best
    left_out = len(complete) - len(done)
    aside = f" ({left_out} with a non-finite value not drawn)" if left_out else ""
    figs: list[tuple[str, Any]] = []
    if done and len(objectives) == 1:
        xs = [t.number for t in done]
        ys = [t.values[0] for t in done]
        better = min if objectives[0][1] == "minimize" else max
        best, run = [], None
        for y in ys:
            run = y if run is None else better(run, y)
            best.append(run)
        fig = go.Figure([go.Scatter(x=xs, y=ys, mode="markers", name=names[0]),
                         go.Scatter(x=xs, y=best, mode="lines", name="best so far")])
        fig.update_layout(title="Optimization history" + aside, xaxis_title="trial", yaxis_title=names[0])
        figs.append(("Optimization history", fig))
    elif done:
        sign = [1.0 if d == "minimize" else -1.0 for _, d in objectives]
        front = {t.number for t in pareto(done, sign)}
        fig = go.Figure()
        for on_front, label in ((False, "dominated"), (True, "Pareto front")):
            sel = [t for t in done if (t.number in front) == on_front]
            fig.add_trace(go.Scatter(
                x=[t.values[0] for t in sel], y=[t.values[1] for t in sel], mode="markers", name=label,
                text=[f"trial #{t.number}" for t in sel], marker={"size": 10 if on_front else 7},
            ))
        title = "Pareto front" + (f" (first two of {len(names)} objectives)" if len(names) > 2 else "") + aside
        fig.update_layout(title=title, xaxis_title=names[0], yaxis_title=names[1])
        figs.append(("Pareto front", fig))
    if done:
        dims = []
        keys = sorted({k for t in done for k in t.params})
        for k in keys:
            dims.append(_axis(k, [t.params.get(k) for t in done]))
        for i, n in enumerate(names):
            dims.append({"label": n, "values": [t.values[i] for t in done]})
        color = [t.values[0] for t in done]
        fig = go.Figure(go.Parcoords(dimensions=dims, line={"color": color, "colorscale": "Viridis",
                                                            "showscale": True}))
        fig.update_layout(title="Parameters (complete trials)" + aside)
        figs.append(("Parameters", fig))
    curves = [t for t in trials if t.user_attrs.get(CURVE)]
    if curves:
        fig = go.Figure()
        for t in curves:
            pts = t.user_attrs[CURVE]
            fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines",
                                     name=f"#{t.number} {trial_kind(t)}", opacity=0.8))
        fig.update_layout(title="Learning curves", xaxis_title="step", yaxis_title="val_loss")
        figs.append(("Learning curves", fig))
    return figs


_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.2em .5em;text-align:left}
th{background:#f3f3f3}pre{background:#f7f7f7;padding:.6em;overflow-x:auto}
details{margin:.4em 0;border:1px solid #ddd;padding:.3em .6em}.COMPLETE{color:#070}.PRUNED{color:#a60}
.FAIL{color:#b00}.math{overflow-x:auto;font-size:1.1em}
"""


def _trial_section(t: FrozenTrial, names: Sequence[str]) -> str:
    e = html.escape
    ua = t.user_attrs
    vals = ", ".join(f"{n}={_fmt(v)}" for n, v in zip(names, t.values or [], strict=False))
    rows = "".join(f"<tr><th>{e(str(k))}</th><td>{e(_fmt(v))}</td></tr>" for k, v in sorted(t.params.items()))
    parts = [f'<details id="trial-{t.number}"><summary>#{t.number} <span class="{t.state.name}">'
             f"{t.state.name}</span> ({e(trial_kind(t))}) {e(vals)}</summary>"]
    parts.append(f"<table>{rows}</table>" if rows else "<p>(no parameters)</p>")
    if ua.get(REASON):
        parts.append(f"<p><b>reason:</b> {e(str(ua[REASON]))}</p>")
    if DUPLICATE_OF in ua:  # a number, as a search writes it; another writer's value is shown, not linked
        first = ua[DUPLICATE_OF]
        link = f'<a href="#trial-{first}">#{first}</a>' if is_whole(first) else e(repr(first))
        parts.append(f"<p>same equations as {link}; its result was reused.</p>")
    if ua.get(METRICS):
        m = ", ".join(f"{e(str(k))}={e(_fmt(v))}" for k, v in sorted(ua[METRICS].items()) if k != NOTES)
        parts.append(f"<p><b>metrics:</b> {m}</p>")
        parts += [f"<p><b>note:</b> {e(str(note))}</p>" for note in ua[METRICS].get(NOTES) or []]
    if ua.get(SOURCE):
        parts.append(f"<h4>Composition</h4><pre>{e(str(ua[SOURCE]))}</pre>")
    if ua.get(MATHML):
        parts.append(f'<h4>Equations</h4><div class="math">{ua[MATHML]}</div>')  # MathML as-is
    if ua.get(TRACEBACK):
        parts.append(f"<h4>Traceback</h4><pre>{e(str(ua[TRACEBACK]))}</pre>")
    parts.append("</details>")
    return "\n".join(parts)


def render_report(study: optuna.Study) -> str:
    """The report page as a string: plotly.js is inlined once, so the file opens with no network."""
    e = html.escape
    objectives = objectives_of(study)
    names = [n for n, _ in objectives]
    trials = study.get_trials(deepcopy=False)
    led = ledger(trials)
    figs = _figures(study)
    body = [f"<h1>Search report: {e(study.study_name)}</h1>"]
    body.append(f"<p>objectives: {e(', '.join(f'{n} ({d})' for n, d in objectives))}<br>"
                f"trials: {led.finished} finished: {led.completed} complete ({led.duplicates} duplicates), "
                f"{led.pruned} pruned ({led.invalid} invalid, {led.pruned_duplicates} duplicates), "
                f"{led.failed} failed, {led.lost} lost and retried; {led.running} running, {led.waiting} waiting<br>"
                f"generated {datetime.now().isoformat(timespec='seconds')}</p>")
    for i, (title, fig) in enumerate(figs):
        body.append(f"<h2>{e(title)}</h2>")
        body.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0), include_mathjax=False))
    order = ranked(study)
    if order:
        head = "".join(f"<th>{e(n)}</th>" for n in names)
        keys = sorted({k for t in order for k in t.params})
        head += "".join(f"<th>{e(k)}</th>" for k in keys)
        rows = []
        for t in order[:50]:
            cells = "".join(f"<td>{_fmt(v)}</td>" for v in t.values)
            cells += "".join(f"<td>{e(_fmt(t.params.get(k, '')))}</td>" for k in keys)
            rows.append(f'<tr><td><a href="#trial-{t.number}">#{t.number}</a></td>{cells}</tr>')
        body.append(f"<h2>Leaderboard</h2><table><tr><th>trial</th>{head}</tr>{''.join(rows)}</table>")
    body.append("<h2>Trials</h2>")
    body.extend(_trial_section(t, names) for t in trials)
    return (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{e(study.study_name)}</title>"
            f"<style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def write_report(storage: str | BaseStorage, study_name: str, out_html: str | os.PathLike[str], *,
                 study: optuna.Study | None = None) -> Path:
    """Write one self-contained HTML file (no CDN, no network) describing the whole study (`study`, when the
    caller has loaded it already: a large journal is replayed once, not once per output)."""
    study = study or load_study(storage, study_name)
    out = Path(out_html)
    write_atomic(out, render_report(study))
    return out


def trial_rows(study: optuna.Study) -> list[dict[str, Any]]:
    """Every trial as plain JSON (`energy report --json`): number, state, kind, parameters, objective values,
    metrics, why it did not complete, the trial it duplicates and its equation hash."""
    names = [n for n, _ in objectives_of(study)]
    rows = []
    for t in study.get_trials(deepcopy=False):
        ua = t.user_attrs
        rows.append(_strict({"number": t.number, "state": t.state.name, "kind": trial_kind(t),
                             "params": dict(t.params),
                             "values": dict(zip(names, t.values, strict=False)) if t.values else None,
                             "metrics": ua.get(METRICS), "reason": ua.get(REASON),
                             "duplicate_of": ua.get(DUPLICATE_OF), "equation_hash": ua.get(HASH)}))
    return rows


def _strict(value: Any) -> Any:
    """`value` with NaN and infinities as None, as strict JSON parsers (jq, JavaScript) take it."""
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def study_dataset(study: optuna.Study) -> str | None:
    """The dataset a study's trials train on, as its settings record it (`chars:/abs/corpus.txt`)."""
    from . import SETTINGS

    settings = study.user_attrs.get(SETTINGS)
    return str(settings["data"]) if isinstance(settings, dict) and "data" in settings else None


def not_an_input(path: str | os.PathLike[str], flag: str, storage: str | None, space: str | None,
                 data: str | None = None) -> None:
    """Refuse an output path (a report, an exported candidate) that is the study's storage file, its search
    space (a study records it as `space`), a file the space imports or the dataset its trials train on:
    `-o runs/S/optuna.journal` replaced the study with HTML, `--export search/quickstart.energy` the space
    with one of its candidates, and `--export corpus.txt` the corpus."""
    from ..errors import UserError as SpaceUnread
    from ..files import not_an_input as refuse
    from ..syntax import parse_module
    from ..training.data import file_dataset
    from .storage import local_file

    _, corpus = file_dataset(data or "") or ("", "")
    inputs = [("the study's storage", local_file(storage) if storage else None),
              ("the search space", Path(space) if space else None),
              ("the dataset the trials train on", Path(corpus).expanduser() if corpus else None)]
    if space and space.endswith(".energy") and Path(space).is_file():
        try:  # and what it imports: `--export` over one replaced an energy the space searches
            inputs += [("a file the search space imports", Path(f)) for f in parse_module(Path(space)).files[1:]]
        except SpaceUnread:
            pass  # a space that does not parse: the search says why
    refuse(path, flag, inputs)


def export_best(storage: str | BaseStorage, study_name: str, path: str | os.PathLike[str],
                trial: int | None = None, *, study: optuna.Study | None = None) -> int:
    """Write the best trial's composition (or trial number `trial`'s) as a plain .energy file.

    With several objectives "best" is the Pareto-front trial best on the first objective. `study`: as in
    `write_report`. Returns the trial number written."""
    study = study or load_study(storage, study_name)
    if trial is None:
        order = ranked(study)
        if not order:
            raise UserError(f"study {study_name!r} has no complete trial yet")
        chosen = order[0]
    else:
        matches = [t for t in study.get_trials(deepcopy=False) if t.number == trial]
        if not matches:
            raise UserError(f"study {study_name!r} has no trial #{trial}")
        chosen = matches[0]
    source = chosen.user_attrs.get(SOURCE)
    if not source:
        raise UserError(f"trial #{chosen.number} recorded no source")
    not_an_input(path, "the export", None, str(study.user_attrs.get("space") or ""), study_dataset(study))
    text = str(source)  # as-is: the comment syntax of .energy is the DSL's business, not the engine's
    write_atomic(Path(path), text if text.endswith("\n") else text + "\n")
    return chosen.number


def finite(x: float) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)

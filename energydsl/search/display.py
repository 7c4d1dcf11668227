"""Terminal display: a live progress panel while a search runs and a leaderboard when it ends.

The panel reads the study from its own storage handle every second, so it shows the same thing
whichever backend or however many processes are writing (and costs the workers nothing).
Everything goes to stderr, leaving stdout to the JSON summary.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections import Counter
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState
from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from energydsl.search.report import DUPLICATE_OF, REASON, best_of, ledger, objectives_of, pareto, ranked, trial_kind
from energydsl.search.storage import open_storage


def _fmt(v: Any) -> str:
    return f"{v:.5g}" if isinstance(v, float) else str(v)


def _best_text(study: optuna.Study) -> str:
    best = best_of(study)
    if not best:
        return "best: -"
    if isinstance(best, dict):
        vals = " ".join(f"{k}={_fmt(v)}" for k, v in best.get("values", {}).items())
        return f"best: {vals} (#{best['number']})"
    return f"Pareto front: {len(best)} trials"


def progress_panel(study: optuna.Study, target: int | None, started: float, note: str | None = None) -> Panel:
    trials = study.get_trials(deepcopy=False)
    led = ledger(trials)
    total = target or max(led.finished, 1)
    head = Table.grid(padding=(0, 1))
    head.add_row(ProgressBar(total=total, completed=min(led.finished, total), width=40),
                 Text(f"{led.finished}/{total} trials", style="bold"),
                 Text(time.strftime("%H:%M:%S", time.gmtime(time.time() - started)), style="dim"))
    line = Text.assemble(
        f"running {led.running}  ",
        ("complete ", "green"), f"{led.completed} ({led.duplicates} dup)  ",
        ("pruned ", "yellow"), f"{led.pruned} ({led.invalid} invalid, {led.pruned_duplicates} dup)  ",
        ("failed ", "red"), f"{led.failed}",
        f"  lost {led.lost}" if led.lost else "",
    )
    parts: list[Any] = [head, line, Text(_best_text(study))]
    if note:
        parts.append(Text(note, style="dim"))
    return Panel(Group(*parts), title=f"search {escape(study.study_name)}", expand=False)


class LiveProgress:
    """Context manager showing `progress_panel` refreshed from the storage by a background thread."""

    def __init__(self, storage_spec: str, study_name: str, target: int | None, note: str | None = None,
                 interval: float = 1.0, console: Console | None = None) -> None:
        self.storage_spec, self.study_name, self.target, self.note = storage_spec, study_name, target, note
        self.interval = interval
        self.console = console or Console(stderr=True)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = time.time()

    def __enter__(self) -> LiveProgress:
        self._thread = threading.Thread(target=self._run, name="energy-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if exc[0] is not None:  # the error the caller prints starts on a line of its own, not on the panel's border
            self.console.line()

    def _run(self) -> None:
        from rich.live import Live

        study = optuna.load_study(study_name=self.study_name, storage=open_storage(self.storage_spec))
        with Live(console=self.console, refresh_per_second=4, transient=False) as live:
            while True:
                with contextlib.suppress(Exception):  # a display hiccup must never stop a search
                    live.update(progress_panel(study, self.target, self._started, self.note))
                if self._stop.wait(self.interval):
                    with contextlib.suppress(Exception):
                        live.update(progress_panel(study, self.target, self._started, self.note))
                    return


def leaderboard_table(study: optuna.Study, top: int = 10, width: int | None = None) -> Table:
    """The top complete trials (Pareto front first with several objectives), their params and objectives.

    One row per trial; where that is wider than `width` (a terminal's columns), one row per objective or
    parameter and one column per trial, as many trials as fit: full parameter names rather than `Tiny…`."""
    objectives = objectives_of(study)
    order = ranked(study)[:top]
    keys = sorted({k for t in order for k in t.params})
    sign = [1.0 if d == "minimize" else -1.0 for _, d in objectives]
    front = {t.number for t in pareto(order, sign)} if len(objectives) > 1 else set()
    notes = {t.number: (("Pareto " if t.number in front else "")
                        + (f"= #{t.user_attrs[DUPLICATE_OF]}" if DUPLICATE_OF in t.user_attrs else "")).strip()
             for t in order}
    heads = [f"{name} {'↓' if direction == 'minimize' else '↑'}" for name, direction in objectives] + keys
    columns = {}  # trial number -> its cells, in the order of `heads`
    for t in order:
        columns[t.number] = [*(_fmt(v) for v in t.values), *(_fmt(t.params.get(k, "")) for k in keys)]
    if any(notes.values()):  # Pareto membership, duplicates
        heads.append("note")
        for number, cells in columns.items():
            cells.append(notes[number])
    title = f"{escape(study.study_name)}: top {len(order)} trials"  # a name's `[/]` as written
    table = Table(title=title)
    table.add_column("#", justify="right")
    for n, head in enumerate(heads):
        table.add_column(head, justify="right" if n < len(objectives) else "left")
    for number, cells in columns.items():
        table.add_row(str(number), *map(Text, cells))  # as written: a param's `W[k]` is not markup
    if width is None or _natural_width(table) <= width:
        return table
    return _by_parameter(title, heads, columns, width)


def _natural_width(table: Table) -> int:
    return Console(width=10_000).measure(table).maximum


def _by_parameter(title: str, heads: list[str], columns: dict[int, list[str]], width: int) -> Table:
    """The leaderboard turned: a row per objective or parameter, a column per trial (best first), the trials
    that fit in `width`, and a caption naming how many were left out."""
    shown = []
    used = max(len(h) for h in heads) + 4  # the names' column and the borders
    for number, cells in columns.items():
        used += max(len(str(number)) + 1, *(len(c) for c in cells)) + 3
        if shown and used > width:
            break
        shown.append(number)
    left = len(columns) - len(shown)
    table = Table(title=title, caption=f"{left} more trial(s) in the report" if left else None)
    table.add_column("")
    for number in shown:
        table.add_column(f"#{number}", overflow="fold")
    for n, head in enumerate(heads):
        table.add_row(Text(head), *(Text(columns[number][n]) for number in shown))
    return table


def failures_table(trials: list[FrozenTrial], top: int = 5) -> Table | None:
    """The most recent failed trials with their reasons, so a broken space is noticed at once."""
    bad = [t for t in trials if t.state == TrialState.FAIL and trial_kind(t) == "error"][-top:]
    if not bad:
        return None
    table = Table(title="recent failures")
    table.add_column("#", justify="right")
    table.add_column("reason", overflow="fold")
    for t in bad:
        table.add_row(str(t.number), Text(str(t.user_attrs.get(REASON, ""))))  # `h[j]` is not markup
    return table


def invalid_table(trials: list[FrozenTrial], top: int = 5) -> Table | None:
    """Why candidates were invalid, the most frequent reasons first: a combination the language refuses now
    and then is expected (the attention zoo has some), one refused in every trial is a broken space."""
    reasons = Counter(re.sub(r" \(at `[^`]*`\)", "", str(t.user_attrs.get(REASON, "")))  # the candidate's line
                      for t in trials if trial_kind(t) == "invalid")
    if not reasons:
        return None
    table = Table(title=f"invalid candidates ({sum(reasons.values())})")
    table.add_column("trials", justify="right")
    table.add_column("reason", overflow="fold")
    for reason, count in reasons.most_common(top):
        table.add_row(str(count), Text(reason))  # as written: `softmax[j]` is not markup
    if len(reasons) > top:
        table.caption = f"and {len(reasons) - top} other reasons (`energy report` lists every trial)"
    return table


def print_leaderboard(study: optuna.Study, top: int = 10, console: Console | None = None) -> None:
    console = console or Console(stderr=True)
    console.print()
    console.print(leaderboard_table(study, top, console.width))
    trials = study.get_trials(deepcopy=False)
    shown = [table for table in (failures_table(trials), invalid_table(trials)) if table is not None]
    for table in shown:
        console.print(table)
    if trials and not any(t.state == TrialState.COMPLETE for t in trials):
        why = "the reasons are above" if shown else "none finished (interrupted, or still running elsewhere)"
        console.print(f"no trial has completed: {why}; the report lists every trial")

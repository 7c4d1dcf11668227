"""A candidate of a search written in the language: one filled-in spec, its model, its checks and its key.

`DslSpace.suggest` (energydsl.search.dsl) makes them; the engine (energydsl.search.local, ray_backend)
builds, checks, deduplicates (`equation_hash`) and trains them through the `Candidate` protocol.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import re
import shlex
from typing import Any

from energydsl.errors import Span, UserError
from energydsl.number_text import plain_number
from energydsl.search.holes import _norm
from energydsl.search.stagecheck import stage_check

_CANDIDATE_PLACE = re.compile(r"<string>:(\d+):(\d+)")  # a place in a candidate's text, as composition cites it


def space_location(text: str, line: int, column: int, sources: list[tuple[str, str]],
                   end_column: int | None = None) -> Span | None:
    """Where line `line` of a candidate's `text` stands in the space's files ((path, text) each), when no hole
    changed it (or, given the place's `end_column`, none changed the line up to there: `W1 @ q) * float 1..2`'s
    `q`): the file line that agrees whose neighbours agree best with the candidate's (a `state z[d]` line is in
    every energy); None for a place a hole changed, or where two places agree as well."""
    lines = text.split("\n")
    if not 1 <= line <= len(lines) or not lines[line - 1].strip():
        return None
    wanted = lines[line - 1]
    upto = end_column - 1 if end_column and end_column > column else None  # the place's text, and what is before it
    found: list[tuple[int, str, int, str]] = []  # (neighbours that agree, path, line, file text)
    for path, source in sources:
        file_lines = source.split("\n")
        for n, same in enumerate(file_lines):
            if same != wanted and (upto is None or len(same) < upto or same[:upto] != wanted[:upto]):
                continue
            agree = sum(1 for k in range(-6, 7) if k and 0 <= line - 1 + k < len(lines)
                        and 0 <= n + k < len(file_lines) and lines[line - 1 + k] == file_lines[n + k])
            found.append((agree, path, n + 1, source))
    found.sort(key=lambda f: -f[0])
    if not found or (len(found) > 1 and found[1][0] == found[0][0]):
        return None
    _, path, number, source = found[0]
    return Span(path, number, column, source, end_column)


def in_space(e: UserError, sources: list[tuple[str, str]]) -> UserError:
    """`e`, raised by a candidate (its places `<string>:L:C`, lines of the filled text, which the search file
    does not have and which move from candidate to candidate), with each place moved into the space's files
    where no hole changed its line, so that the error points at the line to edit."""
    def moved(m: re.Match) -> str:
        at = space_location(text, int(m.group(1)), int(m.group(2)), sources) if text else None
        return str(at) if at is not None else m.group(0)

    text = e.span.source if e.span is not None and e.span.source else ""
    out = copy.copy(e)
    out.message = _CANDIDATE_PLACE.sub(moved, e.message)
    out.args = (out.message,)
    out.hint = _CANDIDATE_PLACE.sub(moved, e.hint) if e.hint else e.hint
    if e.span is not None and text:
        out.span = space_location(text, e.span.line, e.span.column, sources, e.span.end_column) or e.span
    return out


def _reason(e: BaseException, sources: list[tuple[str, str]]) -> str:
    """One line: the message, where it points (the space file's line, or the candidate's source line where a
    hole changed it), the hint."""
    if not isinstance(e, UserError):
        return f"{type(e).__name__}: {e}"
    located = in_space(e, sources)
    where = ""
    if located.span is not None and located.span is not e.span:
        where = f" (at {located.span})"
    elif e.span is not None and e.span.source:
        lines = e.span.source.splitlines()
        if 1 <= e.span.line <= len(lines) and lines[e.span.line - 1].strip():
            where = f" (at `{_norm(lines[e.span.line - 1])[:120]}`)"
    hint = located.hint
    return f"{located.message}{where}" + (f"; hint: {hint}" if hint else "")


class DslCandidate:
    """One filled-in spec: implements `energydsl.search.space.Candidate`."""

    def __init__(self, model_name: str, params: dict[str, Any], text: str, settings: dict[str, Any],
                 sources: list[tuple[str, str]] | None = None):
        self.model_name = model_name  # the model the search trains
        self.params = params
        self.text = text
        self.settings = settings
        self.sources = sources or []  # the space's files, (path, text): where a reason's lines are
        self._spec: Any = None
        self._model: Any = None
        self._hash: str | None = None
        self._mathml: str | None = None
        self._trained: dict[str, Any] | None = None

    def trained_settings(self) -> dict[str, Any]:
        """The settings the trial trains with: a `block` longer than the model's context is capped at it (as
        given while the model does not build: such a candidate never trains)."""
        if self._trained is None:
            s = dict(self.settings)
            if s.get("block_size"):
                try:
                    s["block_size"] = min(int(s["block_size"]), int(self.model().block_size))
                except (UserError, NotImplementedError):
                    return s
            self._trained = s
        return self._trained

    def source(self) -> str:
        """The filled spec, ending with how its trial trains it and the `energy train` command that trains it so."""
        s = self.trained_settings()
        train = ", ".join(f"{k} = {plain_number(v) if isinstance(v, float) else v}"  # as trained, every digit
                          for k, v in sorted(s.items()) if k not in ("data", "steps"))
        return (f"{self.text}\n\n# trained with: data {s['data']}, steps {s['steps']}; {train}\n"
                f"# train it again so: {retrain_command(s)}\n")

    def spec(self) -> Any:
        if self._spec is None:
            from energydsl.api import load

            self._spec = load(self.text)
        return self._spec

    def model(self) -> Any:
        """The language model (built once, initialised from the training seed)."""
        if self._model is None:
            import torch

            spec = self.spec()
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(self.settings["seed"]))
                self._model = spec.model(self.model_name)
        return self._model

    def release(self) -> None:
        self._model = None

    def invalid_reason(self) -> str | None:
        try:
            model = self.model()
        except (UserError, NotImplementedError) as e:
            return _reason(e, self.sources)
        plan = getattr(model, "plan", None)
        stages = [(s.label, s.decl, s.dims) for s in plan.stages] if plan is not None else []
        try:
            for label, decl, dims in stages:
                why = stage_check(decl, dims)
                if why:
                    return f"{label}: {why}"
        except (UserError, NotImplementedError) as e:
            return _reason(e, self.sources)
        return None

    def equation_hash(self) -> str:
        if self._hash is None:
            model = self.model()
            stages = [_derived_key(d) for d in model.derived]
            key = {"model": model.equation_hash(), "stages": stages, "train": self.trained_settings()}
            self._hash = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return self._hash

    def equations_mathml(self) -> str:
        if self._mathml is None:
            model = self.model()
            infos = getattr(model, "stage_info", None)
            labels = [s.label for s in infos] if infos else [d.name for d in model.derived]
            self._mathml = "\n".join(f"<h5>{label}</h5>\n{d.equations('mathml')}"
                                     for label, d in zip(labels, model.derived, strict=False))
        return self._mathml


def retrain_command(settings: dict[str, Any]) -> str:
    """The `energy train` command that trains a candidate as its trial trained it (`settings` complete)."""
    from energydsl.training.config import TRAIN_FLAGS

    flags = [f"--data {shlex.quote(str(settings['data']))}"]
    for key, flag in TRAIN_FLAGS.items():
        value = settings.get(key)
        # the device and --compile are the user's machine's business, not the trial's result
        if value is not None and key not in ("device", "compile"):
            flags.append(f"{flag} {repr(value) if isinstance(value, float) else shlex.quote(str(value))}")  # exact
    return "energy train THIS_FILE " + " ".join(flags)


def _derived_key(d: Any) -> list[Any]:
    """What the update equations do not show but training depends on: initial values and flags of the
    parameters (also those an optimizer or preconditioner creates)."""
    prog = d.program
    params = getattr(prog, "params", None) or d.spec.params
    out: list[Any] = [d.equation_hash()]
    out.append(sorted((n, str(getattr(p, "shape", "")), str(getattr(p, "init", "")), str(getattr(p, "constraint", "")),
                       bool(getattr(p, "learn", True))) for n, p in params.items()))
    opt = d.spec.optimizer
    out.append([opt.kind, opt.steps, opt.per_head, opt.wrt, opt.precondition,
                sorted((k, str(v)) for k, v in opt.precondition_options.items()),
                sorted((k, str(h.value), h.learn) for k, h in opt.hyper.items())])
    with contextlib.suppress(Exception):
        out.append(sorted((str(k), str(v)) for k, v in prog.hyper_values.items()))
    return out

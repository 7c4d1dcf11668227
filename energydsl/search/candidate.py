"""A candidate of a search written in the language: one filled-in spec, its model, its checks and its key.

`DslSpace.suggest` (energydsl.search.dsl) makes them; the engine (energydsl.search.local, ray_backend)
builds, checks, deduplicates (`equation_hash`) and trains them through the `Candidate` protocol.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shlex
from typing import Any

from energydsl.errors import UserError
from energydsl.search.holes import _fmt_float, _norm
from energydsl.search.stagecheck import stage_check


def _reason(e: BaseException) -> str:
    """One line: the message, the candidate's source line it points at, the hint."""
    if not isinstance(e, UserError):
        return f"{type(e).__name__}: {e}"
    where = ""
    if e.span is not None and e.span.source:
        lines = e.span.source.splitlines()
        if 1 <= e.span.line <= len(lines) and lines[e.span.line - 1].strip():
            where = f" (at `{_norm(lines[e.span.line - 1])[:120]}`)"
    return f"{e.message}{where}" + (f"; hint: {e.hint}" if e.hint else "")


class DslCandidate:
    """One filled-in spec: implements `energydsl.search.space.Candidate`."""

    def __init__(self, model_name: str, params: dict[str, Any], text: str, settings: dict[str, Any]):
        self.model_name = model_name  # the model the search trains
        self.params = params
        self.text = text
        self.settings = settings
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
        train = ", ".join(f"{k} = {_fmt_float(v) if isinstance(v, float) else v}"
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
            return _reason(e)
        plan = getattr(model, "plan", None)
        stages = [(s.label, s.decl, s.dims) for s in plan.stages] if plan is not None else []
        try:
            for label, decl, dims in stages:
                why = stage_check(decl, dims)
                if why:
                    return f"{label}: {why}"
        except (UserError, NotImplementedError) as e:
            return _reason(e)
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

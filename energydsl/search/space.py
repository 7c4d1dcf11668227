"""The contract between the search engine and whatever defines a search space.

The engine never looks inside a space: it asks for a `Candidate` (one filled-in composition), checks it
cheaply, deduplicates it by the hash of its derived equations and only then pays for `evaluate`. The
DSL implements these two protocols; `energydsl.search.toy` is a tiny stand-in used by tests.

Spaces travel between processes (spawned workers, Ray actors) as a picklable `SpaceRef` and are
rebuilt in each process by `resolve_space`, so a space object itself never needs to pickle.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from energydsl.errors import UserError
from energydsl.search.report import HASH, MATHML, SOURCE, finite

if TYPE_CHECKING:
    import optuna

#: report(step, val_loss) -> True when the pruner says stop (evaluate then raises optuna.TrialPruned).
ReportFn = Callable[[int, float], bool]

DIRECTIONS = ("minimize", "maximize")


@runtime_checkable
class Candidate(Protocol):
    """One point of a search space: the sampled hole values and what they derive to."""

    params: dict[str, Any]  # the sampled hole values, by hole name

    def invalid_reason(self) -> str | None:
        """Parse/derive/check the candidate; None when valid. Must be cheap next to training."""
        ...

    def equation_hash(self) -> str:
        """Identical derived equations (and training settings) give the same hash and share one result."""
        ...

    def source(self) -> str:
        """A plain .energy text with the holes filled, so a result can be reproduced without the engine."""
        ...

    def equations_mathml(self) -> str:
        """The derived update equations as MathML, embedded as-is in the HTML report."""
        ...


@runtime_checkable
class SearchSpace(Protocol):
    """A family of candidates plus how to score one.

    Optional, checked before any trial runs when a space has them: `check_device(device, local)` raises
    UserError for a device its trials could not use; `distributions()` returns {hole name: (Optuna
    distribution, where it is written or None)}, so that a rerun of an edited space whose hole the study
    cannot continue is refused at that hole, and `energy search --holes` lists them."""

    name: str
    objectives: list[tuple[str, str]]  # e.g. [("val_loss", "minimize"), ("params", "minimize")]
    budget: dict[str, Any]  # defaults from the spec: trials, steps, timeout, ...

    def suggest(self, trial: optuna.Trial) -> Candidate:
        """Call trial.suggest_* once per hole and return the candidate those values describe."""
        ...

    def evaluate(self, candidate: Candidate, report: ReportFn, device: str) -> dict[str, float]:
        """Train the candidate; call report(step, val_loss) as it goes and raise optuna.TrialPruned when
        it returns True. Return the metrics, including every objective by name."""
        ...


@dataclass
class SpaceRef:
    """A picklable way to name a space: `package.module:attr` (called with **sets) or a `.energy` path
    (loaded by `energydsl.api.load_search(spec, **sets)`), or a name registered with `register_space`."""

    spec: str
    sets: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in sorted(self.sets.items()))
        return f"{self.spec}{extra}"


# name -> "module:attr": strings, not callables, so that every worker process can rebuild the space.
_REGISTRY: dict[str, str] = {"toy": "energydsl.search.toy:make_space"}
_BUILT_IN = frozenset(_REGISTRY)
_IMPORT_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def register_space(name: str, target: str | Callable[..., SearchSpace]) -> None:
    """Make `name` usable as a SpaceRef spec. A callable is recorded by its import path, because the
    registry itself is not shared with worker processes: the target must be importable there."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"register_space: the name must be a non-empty string, not {name!r}")
    if name in _BUILT_IN:
        raise ValueError(f"register_space({name!r}): that name is the engine's own space; choose another")
    if callable(target):
        module, qual = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
        if not module or module == "__main__" or "<" in qual:
            raise ValueError(f"space factory {target!r}: not a module-level function workers can import")
        target = f"{module}:{qual}"
    if not isinstance(target, str) or not _IMPORT_RE.match(target):
        raise ValueError(f"register_space({name!r}): {target!r} is not of the form package.module:attr")
    _REGISTRY[name] = target


def registered_spaces() -> dict[str, str]:
    """The registered names and the import paths they stand for."""
    return dict(_REGISTRY)


def is_import_path(spec: str) -> bool:
    """True for `package.module:attr`, False for a file path such as `model.energy`."""
    return bool(_IMPORT_RE.match(spec)) and not spec.endswith(".energy")


def absolute(ref: SpaceRef) -> SpaceRef:
    """The same space with a `.energy` path made absolute, so that it resolves from any working directory, and
    a `--set data=chars:PATH` read from here, as the `data` clause's path is from its file: recorded as
    written, `chars:../corpus.txt` named another corpus from another directory in the same study."""
    from energydsl.training.data import file_dataset

    sets = ref.sets
    kind, rest = file_dataset(str(sets.get("data", ""))) or ("", "")
    if rest and not Path(rest).expanduser().is_absolute():
        sets = {**sets, "data": f"{kind}:{os.path.abspath(rest)}"}
    if ref.spec in _REGISTRY or is_import_path(ref.spec) or not Path(ref.spec).exists():
        return SpaceRef(ref.spec, sets)
    return SpaceRef(str(Path(ref.spec).resolve()), sets)


def resolve_space(ref: SpaceRef | str) -> SearchSpace:
    """Build the space a SpaceRef names, in this process. Raises UserError for what a user can fix."""
    if isinstance(ref, str | os.PathLike):  # a .energy file given as a Path too
        ref = SpaceRef(os.fspath(ref))
    if not isinstance(ref, SpaceRef):
        raise UserError(f"a search space is a .energy path, a registered name or package.module:attr (or a "
                        f"SpaceRef), not {type(ref).__name__}")
    spec = _REGISTRY.get(ref.spec, ref.spec)
    if is_import_path(spec):
        module_name, attr = spec.split(":", 1)
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise UserError(f"cannot import search space {spec!r}: {e}") from e
        except (Exception, SystemExit) as e:  # the module's own code failed as it ran: a SyntaxError, a raise
            raise UserError(f"importing the search space {spec!r} failed: {_said(e)}",
                            hint=f"`{module_name}` is imported to find `{attr}`: run `python -c \"import "
                                 f"{module_name}\"` to see the traceback") from None
        space = _call_factory(obj, spec, ref.sets) if callable(obj) else obj
    else:
        if not Path(spec).exists():
            raise UserError(f"no search spec {spec!r}",
                            hint="give a .energy file, a registered name or package.module:attr")
        from energydsl.api import load_search  # lazy: the DSL side is optional for the engine

        space = load_search(spec, **ref.sets)
    check_space(space)
    return space


def _call_factory(factory: Any, spec: str, sets: dict[str, Any]) -> Any:
    """The space a `package.module:attr` callable builds; its failure, the user's code's, is a UserError that
    names it (not a traceback of the search driver), an `exit()` in it included."""
    try:
        return factory(**sets)
    except UserError:
        raise
    except (Exception, SystemExit) as e:
        raise UserError(f"building the search space {spec!r} failed: {_said(e)}",
                        hint="the attribute after `:` is called with the --set values as keywords and must return "
                             "a search space (see docs/search.md)") from None


def _said(e: BaseException) -> str:
    """The user's code's failure in a line: `RuntimeError: boom`, or the bare type (`SystemExit`)."""
    return (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)[:300]


def space_fingerprint(space: SearchSpace) -> dict[str, str] | None:
    """What a trial's result depends on besides its hole values (a space's optional `fingerprint()`), as text."""
    get = getattr(space, "fingerprint", None)
    return {str(k): str(v) for k, v in get().items()} if callable(get) else None


def resolve_as(ref: SpaceRef, expected: dict[str, str] | None) -> SearchSpace:
    """`resolve_space` in a worker, which must rebuild the space the driver started with (`expected`, its
    fingerprint): a search file edited during the search, or a node's stale copy of it, would otherwise train
    something else than what the study records for the trial, silently."""
    space = resolve_space(ref)
    now = space_fingerprint(space)
    if expected is not None and now is not None and now != expected:
        changed = [k for k in dict.fromkeys([*expected, *now]) if expected.get(k) != now.get(k)]
        raise UserError(f"the search space read here from {ref.spec} is not the one the search started with "
                        f"({', '.join(changed)} differ): the file was edited during the search, or this node's "
                        "copy of it is out of date",
                        hint="restore the file (on a cluster: on every node) as it was when the search started, "
                             "and run the search again; the study resumes")
    return space


def check_space(space: Any) -> None:
    """Fail early, with a readable message, when a space does not meet the protocol."""
    missing = [a for a in ("name", "objectives", "budget", "suggest", "evaluate") if not hasattr(space, a)]
    if missing:
        raise UserError(f"{space!r} is not a search space: it has no {', '.join(missing)}",
                        hint="a search space has name, objectives, budget, suggest and evaluate "
                             "(energydsl.search.space.SearchSpace)")
    if not isinstance(space.name, str) or not space.name:
        raise UserError(f"{space!r} is not a search space: its name must be a non-empty string, not {space.name!r}")
    for method in ("suggest", "evaluate"):
        if not callable(getattr(space, method)):
            raise UserError(f"search space {space.name!r}: {method} must be a method, not "
                            f"{type(getattr(space, method)).__name__}")
    try:
        objectives = [(name, direction) for name, direction in space.objectives]
    except (TypeError, ValueError):
        raise UserError(f"search space {space.name!r}: objectives must be (name, direction) pairs, not "
                        f"{space.objectives!r}") from None
    if not objectives:
        raise UserError(f"search space {space.name!r} declares no objective")
    names = [name for name, _ in objectives]
    if len(set(names)) != len(names):
        raise UserError(f"search space {space.name!r} repeats an objective: {names}")
    for name, direction in objectives:
        if direction not in DIRECTIONS:
            raise UserError(f"objective {name!r}: direction must be minimize or maximize, not {direction!r}")
    if not isinstance(space.budget, dict):
        raise UserError(f"search space {space.name!r}: budget must be a dict, not {type(space.budget).__name__}",
                        hint="the search's defaults, such as {\"trials\": 20, \"steps\": 300} (docs/search.md)")


# ----------------------------------------------------------------------------- reading what a space returns


def candidate_info(cand: Candidate) -> dict[str, str]:
    """What the report shows of a valid candidate, keyed by the user attrs it is stored under."""
    return {HASH: str(cand.equation_hash()), SOURCE: str(cand.source()), MATHML: str(cand.equations_mathml())}


def plain(v: Any) -> float | str | list[str]:
    """A metric as JSON can store it (numpy and 0-d torch numbers become floats; a list, such as training's
    `notes`, a list of strings)."""
    if isinstance(v, str):
        return v
    if isinstance(v, list | tuple):
        return [str(x) for x in v]
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


def check_metrics(metrics: Any, names: list[str]) -> tuple[list[float] | None, dict[str, Any], str | None]:
    """(objective values, metrics to store, reason it failed)."""
    if not isinstance(metrics, Mapping):
        return None, {}, f"evaluate returned {type(metrics).__name__}, expected a dict of metrics"
    clean = {str(k): plain(v) for k, v in metrics.items()}
    missing = [n for n in names if n not in metrics]
    if missing:
        return None, clean, f"evaluate returned no {', '.join(missing)} (objectives: {', '.join(names)})"
    try:
        values = [float(metrics[n]) for n in names]
    except (TypeError, ValueError) as e:
        return None, clean, f"objective is not a number: {e}"
    bad = [f"{n}={v}" for n, v in zip(names, values, strict=True) if not finite(v)]
    if bad:
        return None, clean, f"diverged: {', '.join(bad)}"
    return values, clean, None

"""The Python API: `energydsl.load(path_or_text)` and the objects it returns.

    spec = energydsl.load("examples/intrinsic-optimizers/mha.energy")
    layer = spec.energy("MHA", d=16, heads=2)      # sizes as keyword arguments
    print(layer.equations("text"))
    results = layer.check()
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import syntax
from .checks import CheckResult
from .derived import Derived, declaration_key, derive, derive_stage, placed
from .errors import HoleError, SpecError, UnknownName
from .optimizers import build_program
from .semantics import lower_energy
from .sizing import allocation_named

MAX_CHECK_LAYERS = 10_000  # `energy check` of a model deeper than this is refused (10,000 layers: about 9 s)

__all__ = ["Derived", "Spec", "declaration_key", "derive", "load", "load_search", "model_of_plan"]


class Spec:
    """A parsed `.energy` file (with its imports): declarations by name."""

    def __init__(self, module: syntax.Module):
        self.syntax = module
        self.path = module.path
        # where the spec is, absolute now: a notebook's os.chdir must not move it (a run records it; a search
        # file is read again). Spec text: `<string>` in the folder its imports resolve against.
        self._file = Path(module.path).resolve() if Path(module.path).is_file() else None
        self._source = self._file or (Path(module.base) / "<string>").resolve()

    @property
    def names(self) -> list[str]:
        return self.syntax.names()

    @property
    def block_names(self) -> list[str]:
        return [n for n in self.syntax.names() if n in self.syntax.blocks]

    @property
    def energy_names(self) -> list[str]:
        return [n for n in self.syntax.names() if n in self.syntax.energies]

    def energy(self, name: str | None = None, **dims: float) -> Derived:
        """One energy's derivation at these dims (an imported energy may be named; left out, the file's one).

        A block of one summed stage (`block B = Attention + FF`) may be named too: its energies are summed
        under the first one's optimizer, as a model's layer runs them."""
        _check_name(name)
        if name in self.syntax.blocks:
            from .composition import expand_block

            stages = expand_block(self.syntax, name, dims)  # resolved, not derived: a pipeline is refused first
            if len(stages) != 1:
                raise SpecError(f"block `{name}` is a pipeline of {len(stages)} stages, not one energy", None,
                                f"use .block(\"{name}\") for each stage's derivation")
            return derive(stages[0].decl, stages[0].dims)
        decl = self.syntax.energies[self._pick(name, self.energy_names, ("energy", "energies"), self.syntax.energies)]
        spec = lower_energy(decl, dims)
        return Derived(spec, build_program(spec))

    def derivations(self, name: str | None = None, **dims: float) -> list[Derived]:
        """What `energy derive` and `energy compile` show: the named energy, each stage of the named block, each
        distinct stage of the named model's layer (at the model's dims), or every energy of the file."""
        _check_name(name)
        if name is None:
            return self.derive(**dims)
        every = [*self.syntax.energies, *self.syntax.blocks, *self.syntax.models]
        if name not in every:  # any of the three may be named here: the error lists them all
            close = difflib.get_close_matches(name, every, n=1, cutoff=0.6)
            raise SpecError(f"no energy, block or model named `{name}` in {self.path} (it has: "
                            f"{', '.join(every) or 'none'})", None, f"did you mean `{close[0]}`?" if close else None)
        if name in self.syntax.models:
            return self.stages(name, **dims)
        return self.block(name, **dims) if name in self.syntax.blocks else [self.energy(name, **dims)]

    def stages(self, name: str | None = None, **dims: float) -> list[Derived]:
        """Each distinct stage of a model's layer, derived at the dims the model passes it: the layers
        `energy train` builds, imported energies included. A stage that repeats (same energies, same dims) is
        derived once."""
        from .composition import check_stage_state

        seen: dict[tuple[str, tuple[tuple[str, float], ...]], Derived] = {}
        plan = self.plan(name, **dims)
        for stage in plan.stages:
            key = (stage.label, tuple(sorted(stage.dims.items())))
            if key not in seen:
                seen[key] = derive_stage(stage, plan.name)
                check_stage_state(plan, stage, seen[key].spec)  # it fits the stream, as training needs
        return list(seen.values())

    def block(self, name: str | None = None, **dims: float) -> list[Derived]:
        """Each stage of a block, derived: its energies summed under the first one's optimizer. `dims` go to
        every energy that declares them, as a block's named arguments do in a model; `name` may be left out when
        the file declares one block."""
        from .composition import expand_block, given_by_running_blocks

        _check_name(name)
        name = self._pick(name, self.block_names, ("block", "blocks"), self.syntax.blocks)
        try:
            stages = expand_block(self.syntax, name, dims)
        except UnknownName as e:
            given = given_by_running_blocks(self.syntax, name, e.name)
            if given is None:
                raise
            raise SpecError(e.message, e.span, given) from None
        return [derive(stage.decl, stage.dims) for stage in stages]

    def derive(self, **dims: float) -> list[Derived]:
        """Every energy declared in the file itself (not its imports)."""
        self._refuse_unknown_dims(dims)
        return [self.energy(n, **_dims_for(self.syntax.energies[n], dims)) for n in self.energy_names]

    def _refuse_unknown_dims(self, dims: dict[str, float]) -> None:
        """Refuse a dim no energy of the file declares."""
        known = {n for e in self.energy_names for n, _ in self.syntax.energies[e].header}
        unknown = sorted(set(dims) - known)
        if unknown:
            raise SpecError(f"`{unknown[0]}` is not a dim of any energy in {self.path} (dims: "
                            f"{', '.join(sorted(known)) or 'none'})", None)

    def check(self, **dims: float) -> dict[str, list[CheckResult]]:
        """The checks of every energy, block, model and search declared in the file itself, by name (a pipeline
        block's stages as `B stage 2 (MLP)`). A dim goes to each energy and model that declares it (`energy check
        --set`)."""
        energy_dims, model_dims = self._split_dims(dims)
        if self.energy_names:
            self._refuse_unknown_dims(energy_dims)
        results = {n: self._unless_template(lambda n=n: self.energy(
            n, **_dims_for(self.syntax.energies[n], energy_dims)).check()) for n in self.energy_names}
        for name in self.block_names:
            results |= self._unless_template(lambda name=name: self._check_block(name, energy_dims, model_dims),
                                             label=name)
        models = {name: self._unless_template(lambda name=name: self.check_model(name, **model_dims[name]))
                  for name in self.model_names}
        return results | models | {name: self.check_search(name) for name in self.search_names}

    def _check_block(self, name: str, energy_dims: dict[str, float],
                     model_dims: dict[str, dict[str, float]]) -> dict[str, list[CheckResult]]:
        """Each stage of a block, as a model's layer runs it (a sum: one energy), by label."""
        from .composition import block_arguments, blocks_running, expand_block, models_running, plan_model

        try:
            stages, where = expand_block(self.syntax, name, energy_dims), ""
        except SpecError:  # it reads a model's dims (`MLP(d, hidden = 8)`), or the arguments the model's layer
            users = models_running(self.syntax, name)  # gives it (`Pair(h = 4)`): checked as one model runs it
            if not users:
                raise
            plans = {user: plan_model(self.syntax, user, model_dims.get(user, {})) for user in users}
            given = {user: block_arguments(self.syntax, user, name, plan.dims) for user, plan in plans.items()}
            user = next((u for u in users if given[u] is not None), users[0])  # one that names it, if any does
            try:
                stages = expand_block(self.syntax, name, energy_dims, outer=plans[user].dims | (given[user] or {}))
            except SpecError:
                if given[user] is not None:
                    raise
                # only other blocks run it, with arguments of their own: their checks run its stages with them
                outers = ", ".join(f"`{b}`" for b in blocks_running(self.syntax, name))
                return {name: [CheckResult("stages", "skip", f"it reads arguments that block {outers} gives it "
                                           "(in model " + ", ".join(users) + "): checked there, with them")]}
            where = f" at model {user}'s dims"
        return {(name if len(stages) == 1 else f"{name} stage {n + 1} ({stage.label})") + where:
                derive(stage.decl, stage.dims).check() for n, stage in enumerate(stages)}

    def _unless_template(self, check: Callable[[], Any], label: str | None = None) -> Any:
        """`check()`, unless what it checks holds a search hole of this file's `search`: a template that only its
        candidates fill, checked each before it trains (its checks as a `holes` row, under `label` for a block).
        Without a search in the file a hole is an error, as everywhere."""
        try:
            return check()
        except HoleError:
            if not self.search_names:
                raise
            row = [CheckResult("holes", "skip", f"a template of this file's search ({', '.join(self.search_names)}): "
                               "`energy search` checks each candidate before it trains it")]
            return row if label is None else {label: row}

    @property
    def search_names(self) -> list[str]:
        return [n for n in self.syntax.names() if n in self.syntax.searches]

    def check_search(self, name: str) -> list[CheckResult]:
        """A `search` declaration loads as `energy search` loads it: the model and energies it names, its holes
        and settings, its data against the model, and the text no hole changes (a located `SpecError` if not).
        The candidates' own checks are left to the search, which runs them on each before it trains."""
        here = Path(self.path).resolve() == self._file  # as given, unless the working directory has changed
        space = load_search(self.path if here else self._file or self.path, search=name)
        holes = space.holes()
        return [CheckResult("space", "ok", f"model {space.model_name}, {len(holes)} hole"
                            f"{'' if len(holes) == 1 else 's'} ({', '.join(h.name for h in holes) or 'none'}); "
                            "the names, settings and data load as `energy search` loads them")]

    def check_model(self, name: str | None = None, **dims: float) -> list[CheckResult]:
        """A model's own checks (`energydsl.model_checks`): causality of the composed model and parameters that
        never get a gradient, in float64 on the torch backend; and header dims that nothing reads."""
        from .composition import unread_dims
        from .instance import MAX_INSTANCE_BYTES
        from .model_checks import check_model, dims_row
        from .sizing import sized_model

        sized, layers = sized_model(self, name, "torch", dims)  # on the meta device: sized before it is built
        needed = sized.num_params(layers=layers) * 8  # float64
        if needed > MAX_INSTANCE_BYTES:  # `layer = MLP(d, hidden = 1e8)`: minutes of float64, then the checks
            biggest, p = max(sized.named_parameters(), key=lambda item: item[1].numel())
            raise SpecError(f"model `{sized.plan.name}` is too large to check at its dims: its weights take "
                            f"{needed / 2**30:,.3g} GiB in float64 (`{biggest}` [{', '.join(map(str, p.shape))}] "
                            f"alone has {p.numel():,} entries), more than {MAX_INSTANCE_BYTES / 2**30:g} GiB",
                            sized.plan.span, "check it at smaller dims (--set): the checks prove the composition "
                            "and the derivations, which do not depend on the sizes")
        if layers > MAX_CHECK_LAYERS:  # `repeat layers shared` at 1e9: small weights, days of forward
            raise SpecError(f"model `{sized.plan.name}` is too deep to check at its dims: {layers:,} "
                            f"layers, more than {MAX_CHECK_LAYERS:,} (the checks run it forward and backward in "
                            "float64, about a millisecond a layer)", sized.plan.span,
                            "check it at fewer layers (--set layers=2): every layer is the same composition")
        model = self.model(name, **dims)
        return [*check_model(model), dims_row(model.plan.name, unread_dims(self.syntax, model.plan.name))]

    def _split_dims(self, dims: dict[str, float]) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        """`--set` dims for the file's energies, and for each of its models; one neither declares is refused."""
        energy_known = {n for e in self.energy_names for n, _ in self.syntax.energies[e].header}
        model_known = {m: {n for n, _ in self.syntax.models[m].header} for m in self.model_names}
        known = energy_known.union(*model_known.values())
        unknown = sorted(set(dims) - known)
        if unknown:
            raise SpecError(f"`{unknown[0]}` is not a dim of any energy or model in {self.path} (dims: "
                            f"{', '.join(sorted(known)) or 'none'})", None)
        return ({k: v for k, v in dims.items() if k in energy_known},
                {m: {k: v for k, v in dims.items() if k in names} for m, names in model_known.items()})

    @property
    def model_names(self) -> list[str]:
        return [n for n in self.syntax.names() if n in self.syntax.models]

    def model(self, name: str | None = None, backend: str = "torch", *, device: Any = None, dtype: Any = None,
              **dims: float):
        """The language model a `model` declaration describes (`energydsl.runtime.model.LanguageModel`), moved to
        `device` and `dtype` when given."""
        from .codegen import check_backend

        check_backend(backend)
        plan = self.plan(name, **dims)
        with allocation_named(f"model `{plan.name}`"):
            model = model_of_plan(plan, backend)
        model.run_metadata = self._run_metadata(model, backend)
        return placed(model, device, dtype)

    def _run_metadata(self, model: Any, backend: str) -> dict[str, Any]:
        """What a training run records to rebuild `model` (`energy sample`, `load_trained`): the spec's text
        as trained and where its imports resolve, the model's name and dims, and the backend it runs on."""
        from .codegen import runnable_backend
        from .number_text import plain_value

        return {"spec_path": str(self._source), "spec_source": self.syntax.text, "model": model.plan.name,
                "dims": {k: plain_value(v) for k, v in model.plan.dims.items()}, "context": model.block_size,
                "equation_hash": model.equation_hash(), "backend": runnable_backend(backend)}

    def module(self, name: str | None = None, backend: str = "torch", *, device: Any = None, dtype: Any = None,
               **dims: float):
        """An nn.Module for an energy (its update) or a model (a language model), moved to `device` and `dtype`
        when given; `name` may be left out when the file declares exactly one energy or model."""
        from .codegen import check_backend

        _check_name(name)
        check_backend(backend)
        if name is None:
            names = self.energy_names + self.model_names
            name = self._pick(None, names, ("energy or model", "energies or models"), {}, "module")
        if name in self.syntax.models:
            return self.model(name, backend, device=device, dtype=dtype, **dims)
        return self.energy(name, **dims).module(backend, device=device, dtype=dtype)

    def plan(self, name: str | None = None, **dims: float):
        """A model declaration resolved at these dims (`composition.ModelPlan`): its stages, stream, layers and
        what `.model(...)` builds from them, before any weight is."""
        from .composition import plan_model

        _check_name(name)
        name = self._pick(name, self.model_names, ("model", "models"), self.syntax.models)
        return plan_model(self.syntax, name, dims)

    def _pick(self, name: str | None, names: list[str], what: tuple[str, str], every: dict[str, Any],
              method: str | None = None) -> str:
        """`name`, which may be any of `every` (imported declarations too); left out, the one of `names`
        (this file's own). `what`: the kind, singular and plural, for messages; `method`: the Python call that
        takes the name (default: the kind's own, `.energy(...)`)."""
        one, many = what
        if name is None:
            if not names:
                imported = [n for n in every if n not in self.syntax.order]  # the imports' own
                raise SpecError(f"{self.path} declares no {one}", None, f"it imports {', '.join(imported)}: "
                                f"`--name {imported[0]}` (in Python, .{method or one}(\"{imported[0]}\")) takes one"
                                if imported else None)
            if len(names) != 1:
                raise SpecError(f"{self.path} declares {len(names)} {many} ({', '.join(names)}); name one", None,
                                f"`--name {names[0]}` on the command line; in Python, .{method or one}(\"{names[0]}\")")
            return names[0]
        if name not in every:
            kinds = {"model": self.syntax.models, "block": self.syntax.blocks, "energy": self.syntax.energies}
            other = next((k for k, decls in kinds.items() if name in decls), None)
            hint = {"model": f"`{name}` is a model: `energy info`, `graph`, `train`, `derive` and `compile` take "
                             "it; in Python, .model(...), .plan(...) or .stages(...)",
                    "block": f"`{name}` is a block: .energy(\"{name}\") or .block(...) derives it, a model's "
                             "`layer = ...` uses it",
                    "energy": f"`{name}` is an energy: `energy derive`, `check` and `compile` take it; in Python, "
                              ".energy(...) or .module(...)"}.get(other or "")
            raise SpecError(f"no {one} named `{name}` in {self.path} (it has: "
                            f"{', '.join(every) or 'none'})", None, hint)
        return name


def _check_name(name: object) -> None:
    """`spec.energy(["MHA"])` failed as `unhashable type: 'list'`."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"a declaration's name is a string (or None: the file's one), not {type(name).__name__}")


def _dims_for(decl: syntax.EnergyDecl, dims: dict[str, float]) -> dict[str, float]:
    """`--set` applies to every energy that has that dim."""
    names = {n for n, _ in decl.header}
    return {k: v for k, v in dims.items() if k in names}


def load(source: str | Path, *, base: str | Path | None = None) -> Spec:
    """Parse a `.energy` file (a path) or spec text (whose imports resolve against `base`, default the working
    directory)."""
    if base is not None and not isinstance(base, str | os.PathLike):
        raise TypeError(f"base is the folder a spec text's imports resolve against (a path), not {type(base).__name__}")
    return Spec(syntax.parse_module(source, base=None if base is None else Path(base)))


def load_search(path: str | Path, **sets: object):
    """The search space of a `.energy` file's `search` declaration (`energydsl.search.dsl.load_search`)."""
    from .search.dsl import load_search as _load_search

    return _load_search(path, **sets)


def model_of_plan(plan: Any, backend: str = "torch"):
    """The `LanguageModel` of a composition plan (`Spec.plan`). Every layer's weights have the first layer's
    shapes, so a plan with `layers=1` sizes a model of any depth (`LanguageModel.info(layers=...)`)."""
    from .codegen import module_class, runnable_backend
    from .runtime.model import LanguageModel, StageInfo

    classes, infos = [], []
    for stage in plan.stages:
        derived = derive_stage(stage, plan.name)
        classes.append(module_class(derived, backend))
        infos.append(StageInfo(stage.label, derived, derived.flops_per_token(plan.context)))
    fused = runnable_backend(backend) == "triton"  # as module_class: no kernels here means plain torch
    return LanguageModel(plan, classes, infos, fused_momentum=fused)

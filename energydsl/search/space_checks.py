"""Checks of a search space before any trial: holes that could not do what they say.

A hole the model always overrides (an energy's default for a dim the model gives it) would be sampled and change
nothing; a `float` hole where a whole number is needed would make nearly every candidate invalid. Both are refused
at the hole, when the space loads (`energydsl.search.dsl.DslSpace`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import lark

from energydsl.errors import SpecError, UserError
from energydsl.search.holes import _AnyValues, _File, _fmt_float, _Hole, _kids, _Placement, _pos

if TYPE_CHECKING:
    from energydsl.search.candidate import DslCandidate
    from energydsl.search.dsl import DslSpace


def refuse_float_holes_needing_whole_numbers(space: DslSpace) -> None:
    """A `float` hole where a whole number is needed (a width, a head count, a layer count) makes nearly every
    candidate invalid: refused at the hole before any trial, not as a study of invalid trials. Seen by moving
    one float hole from its low bound (where a candidate builds) to a value inside its range."""
    def refused(candidate: DslCandidate) -> SpecError | None:
        try:
            candidate.spec().stages(space.model_name)  # composition and each stage's dims; no SymPy
        except SpecError as e:
            return e
        except UserError:
            pass
        return None

    floats = [h for h in space.holes() if h.kind == "float" and h.high > h.low]
    if not floats:
        return
    routes = _routes(space)
    bases: dict[tuple[tuple[str, Any], ...], str | None] = {}  # by route: the base's source, None if refused
    for hole in floats:
        route = tuple(sorted(routes[hole.name].items(), key=lambda item: item[0]))
        if route not in bases:  # the floats at their low bounds, where a candidate builds: once per route
            base = space.suggest(_Steered(routes[hole.name]))
            bases[route] = None if refused(base) is not None else base.source()
        if bases[route] is None:
            continue
        inside = _Inside(hole, routes[hole.name])
        candidate = space.suggest(inside)
        e = None if candidate.source() == bases[route] else refused(candidate)  # unchanged: not sampled there
        if e is not None and "whole number" in e.message:
            raise SpecError(f"the `float` hole `{hole.name}` stands where a whole number is needed: at "
                            f"{_fmt_float(inside.value)} the candidate is refused ({e.message})", hole.span,
                            f"sample whole numbers: `int {_fmt_float(math.ceil(hole.low))}.."
                            f"{_fmt_float(math.floor(hole.high))}`, or a `choice{{...}}` of the values")


def refuse_errors_no_hole_changes(space: DslSpace) -> None:
    """An error in text no hole changes (a typo in an energy every candidate uses) makes every candidate
    invalid: a study of invalid trials, exit 0, and a study that then refuses the mended text. Refused at its
    line in the space's files before any trial, when the candidates with every hole at its first, its middle
    and its last value, and those with one hole at each of its other options (`_probes`), fail alike: one
    message at one line that stands unchanged in the space's files. Only the composition and each stage's
    semantics run (no SymPy), and only until a candidate builds (the first, in a space that works); an error of
    one candidate alone is a hole's, left to the trials."""
    from energydsl.composition import stage_named
    from energydsl.search.candidate import in_space
    from energydsl.semantics import lower_energy

    found: list[UserError] = []
    for values in _probes(space):
        candidate = space.suggest(values)
        try:
            plan = candidate.spec().plan(space.model_name)
            for stage in plan.stages:
                with stage_named(stage, plan.name):
                    lower_energy(stage.decl, stage.dims)
        except SpecError as e:
            found.append(in_space(e, candidate.sources))
            continue
        except UserError:
            return
        return  # a candidate builds
    first = found[0]
    if first.span is None or first.span.file == "<string>":  # no place in the space's files: a hole's line
        return
    if any((e.message, str(e.span)) != (first.message, str(first.span)) for e in found[1:]):
        return
    why = "no hole changes this line up to here: every candidate would be invalid"
    raise SpecError(first.message, first.span, f"{first.hint}; {why}" if first.hint else why)


MAX_PROBES = 64  # candidates `refuse_errors_no_hole_changes` builds at most, each a composition and its semantics


def _probes(space: DslSpace) -> Iterator[_AnyValues]:
    """Values for the candidates that decide whether an error is every candidate's: every hole at its first, its
    middle, its last value; then one hole at a time at each of its other options (a choice's) or its high bound
    (an int's), the choices around it at the options that hold it. `let v = choice{W1 @ z, z, 2 * (W1 @ z),
    3 * (W1 @ z)}` fails at its first, middle and last options alike, where `z` builds."""
    yield from (_AnyValues(), _Middle(), _Last())
    routes = _routes(space)
    probes = 3
    for hole in space.holes():
        picks = ([{hole.name: index} for index in range(1, len(hole.options))] if hole.options else
                 [{hole.name: int(hole.high)}] if hole.kind == "int" and hole.high > hole.low else [])
        for pick in picks:
            if probes >= MAX_PROBES:
                return
            probes += 1
            yield _Steered(routes[hole.name], pick)


class _Middle(_AnyValues):
    """Each hole's middle option, or the middle of its whole numbers (a float hole's low bound: a float where a
    whole number is needed is `refuse_float_holes_needing_whole_numbers`'s)."""

    def suggest_int(self, name: str, low: int, high: int, **kw: Any) -> int:
        return (low + high) // 2

    def suggest_categorical(self, name: str, choices: list[Any]) -> Any:
        return choices[len(choices) // 2]


class _Last(_AnyValues):
    """Each hole's high bound or last option."""

    def suggest_int(self, name: str, low: int, high: int, **kw: Any) -> int:
        return high

    def suggest_float(self, name: str, low: float, high: float, **kw: Any) -> float:
        return high

    def suggest_categorical(self, name: str, choices: list[Any]) -> Any:
        return choices[-1]


def _routes(space: DslSpace) -> dict[str, dict[str, Any]]:
    """For each hole, the option each enclosing choice must take for the hole to be sampled at all (`choice{1,
    float 1..2}`'s float hole: the second option), by the choice's name."""
    routes: dict[str, dict[str, Any]] = {}

    def visit(hole: _Hole, route: dict[str, Any]) -> None:
        routes[hole.name] = route
        for option in hole.options:
            for inner in option.holes:
                visit(inner, {**route, hole.name: option.label})

    holes = space.holes()
    nested = {inner.name for h in holes for o in h.options for inner in o.holes}
    for hole in holes:
        if hole.name not in nested:
            visit(hole, {})
    return routes


class _Steered(_AnyValues):
    """`_AnyValues`, but the choices in `route` take the options given there (and a choice named in `pick` the
    option at that index, an int hole that value)."""

    def __init__(self, route: dict[str, Any], pick: dict[str, Any] | None = None):
        self.route = route
        self.pick = pick or {}

    def suggest_int(self, name: str, low: int, high: int, **kw: Any) -> int:
        return self.pick.get(name, low)

    def suggest_categorical(self, name: str, choices: list[Any]) -> Any:
        if name in self.pick:
            return choices[self.pick[name]]
        return self.route.get(name, choices[0])


class _Inside(_Steered):
    """One float hole takes a value inside its range, not a whole number; the choices around it take the options
    that hold it, the other holes their first value."""

    def __init__(self, hole: _Hole, route: dict[str, Any]):
        super().__init__(route)
        self.hole = hole
        fraction = 0.381966  # the golden section: not a whole number for any range a search writes
        self.value = (hole.low * (hole.high / hole.low) ** fraction if hole.log else
                      hole.low + (hole.high - hole.low) * fraction)

    def suggest_float(self, name: str, low: float, high: float, **kw: Any) -> float:
        return self.value if name == self.hole.name else low


def _dims_given(decls: dict[str, tuple[_File, lark.Tree]], model: str) -> dict[str, set[str]]:
    """For each energy the model's layer reaches: the header dims that every use of it gives, so that the energy's
    own defaults for them never apply. Composition gives an energy each dim of the model's header (and of a block's
    arguments) that it declares, and the arguments its use writes (`composition._stage_dims`)."""
    given: dict[str, set[str]] = {}

    def header(decl: lark.Tree) -> list[str]:
        items = next((_kids(c) for c in _kids(decl)[1:] if c.data == "header"), [])
        return [str(i.children[0]) for i in items]

    def walk(pipeline: lark.Tree, env: set[str], seen: tuple[str, ...]) -> None:
        for summed in _kids(pipeline):
            for ref in _kids(summed):
                name, args = str(ref.children[0]), _kids(ref)[1:]
                named = {str(a.children[0]) for a in args if a.data == "named_arg"}
                if name not in decls or name in seen:
                    continue  # composition names what is missing, or the cycle
                decl = decls[name][1]
                if decl.data == "block_decl":
                    walk(decl.children[1], env | named, (*seen, name))
                elif decl.data == "energy_decl":
                    dims = header(decl)
                    positional = [a for a in args if a.data != "named_arg"]
                    here = (env | named | set(dims[:len(positional)])) & set(dims)
                    given[name] = given[name] & here if name in given else here
    model_decl = decls[model][1]
    layer = next((c for c in _kids(model_decl)[1:] if c.data == "layer"), None)
    if layer is not None:
        walk(layer.children[0], set(header(model_decl)), ())
    return given


def refuse_dead_holes(placements: list[_Placement], decls: dict[str, tuple[_File, lark.Tree]], model: str) -> None:
    """A hole in the default of an energy's header dim that the model always gives would be sampled and never
    change the candidate: each trial would train the same model under another name."""
    given = _dims_given(decls, model)
    model_dims = {str(i.children[0]) for c in _kids(decls[model][1])[1:] if c.data == "header" for i in _kids(c)}
    for energy, dims in given.items():
        f, decl = decls[energy]
        header = next((c for c in _kids(decl)[1:] if c.data == "header"), None)
        for item in _kids(header) if header is not None else []:
            dim = str(item.children[0])
            s, e = _pos(item.children[1])
            hole = next((p.holes[0] for p in placements if p.holes and p.file is f and s <= p.start and p.end <= e),
                        None)
            if dim not in dims or hole is None:
                continue
            where = (f"`model {model}({dim} = {hole.describe()})` in the search" if dim in model_dims else
                     f"in the model's layer: `{energy}(..., {dim} = {hole.describe()})`")
            raise SpecError(f"the hole `{hole.name}` never takes effect: model `{model}` gives `{energy}` its `{dim}` "
                            f"wherever it uses it, so `{energy}`'s default for `{dim}` is never read", hole.span,
                            f"put the hole where the model sets it ({where}), or write a number")

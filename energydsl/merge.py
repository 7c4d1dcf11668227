"""Summed stages (`A + B`): two energies over one state merged into one declaration, F = F_A + F_B.

The merged energy is an ordinary `energy` declaration, so everything downstream (derivation, checks,
code generation) treats it like any other. Clauses declared in both must be the same; the optimizer is
the first energy's (NRGPT's shared learned η: one step on the sum), with a warning where a later one differs.
"""

from __future__ import annotations

import dataclasses
import warnings

from . import syntax_tree as ast
from .errors import Span, SpecError

SHARED_KINDS = ("state", "context", "input", "param", "let", "local", "dim")


def _shape(x: object) -> object:
    """A clause's content without source positions (two files declare the same thing at different lines)."""
    if isinstance(x, Span):
        return None
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__name__,) + tuple(_shape(getattr(x, f.name)) for f in dataclasses.fields(x))
    if isinstance(x, (list, tuple)):
        return tuple(_shape(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, repr(_shape(v))) for k, v in x.items()))
    return x


def _same(a: ast.Clause, b: ast.Clause) -> bool:
    return _shape(a) == _shape(b)


def _header_values(decl: ast.EnergyDecl, values: dict[str, float]) -> dict[str, float]:
    """An energy's dims at its reference: those set there, the others at their defaults (in order, so that
    `hidden = 4 * d` follows a set d). A default this cannot evaluate is left out, for lowering to report."""
    from .composition import evaluate_number

    out: dict[str, float] = {}
    for name, node in decl.header:
        if name in values:
            out[name] = values[name]
            continue
        try:
            out[name] = evaluate_number(node, out, f"the default of `{name}`")
        except SpecError:
            continue
    return out


def merge_energies(parts: list[tuple[ast.EnergyDecl, dict[str, float]]], refs: list[Span] | None = None
                   ) -> tuple[ast.EnergyDecl, dict[str, float]]:
    """One declaration for `A + B + …`, with the dims each part has at its reference (`refs`: where each part
    is named, for errors about the sum; else at the declarations)."""
    first = parts[0][0]
    header: list[tuple[str, ast.Node]] = []
    dims: dict[str, float] = {}
    seen: dict[tuple[str, str], ast.Clause] = {}
    clauses: list[ast.Clause] = []
    globals_: list[ast.Clause] = []
    optimizer: ast.Clause | None = None
    owner = first.name  # the energy whose optimizer the sum takes
    summed = " + ".join(d.name for d, _ in parts)
    owners: dict[str, tuple[str, bool]] = {}  # each dim's first energy, and whether it was set there
    for n, (decl, _) in enumerate(parts):
        if any(other is decl for other, _ in parts[:n]):  # its params and untie rules would all clash with its own
            raise SpecError(f"`{decl.name}` is summed with itself", refs[n] if refs else decl.span,
                            "a sum's energies share their params by name: declare a copy under another name, "
                            "with params of its own names")
    for n, (decl, values) in enumerate(parts):
        for name, value in _header_values(decl, values).items():
            if name in dims and dims[name] != value:
                where = [f"`{owners[name][0]}`" + ("" if owners[name][1] else " (its default)"),
                         f"`{decl.name}`" + ("" if name in values else " (its default)")]
                raise SpecError(f"`{first.name} + {decl.name}`: dim `{name}` is {dims[name]:g} in {where[0]} and "
                                f"{value:g} in {where[1]}", refs[n] if refs else decl.span,
                                f"summed energies share their dims by name: give `{name}` one value in both, or "
                                "rename it in one")
            dims.setdefault(name, value)
            owners.setdefault(name, (decl.name, name in values))
        for name, node in decl.header:
            if all(name != have for have, _ in header):
                header.append((name, node))
        for c in decl.clauses:
            if c.kind == "global":
                globals_.append(c)
            elif c.kind == "optimizer":
                if n > 0 and optimizer is None:  # the first has none: the sum takes its default, gd(eta = 1)
                    warnings.warn(f"`{decl.name}`'s optimizer (at {c.span}) is not used in `{summed}`: a sum takes "
                                  f"one step, with `{first.name}`'s optimizer, the default gd(eta = 1) (it declares "
                                  f"none); declare the optimizer in `{first.name}` too to silence this", stacklevel=3)
                elif optimizer is None:
                    optimizer, owner = c, decl.name
                elif not _same(optimizer, c):  # one step on the sum: this one is not taken, and it says so
                    warnings.warn(f"`{decl.name}`'s optimizer (at {c.span}) is not used in `{summed}`: a sum takes "
                                  f"one step, with `{owner}`'s optimizer (at {optimizer.span}); declare the same "
                                  "optimizer in both to silence this", stacklevel=3)
            elif c.kind == "expect":
                continue  # an expectation about one energy alone says nothing about the sum
            elif c.kind in SHARED_KINDS:
                # one state, context and input per energy, whatever their names; other clauses by name
                key = (c.kind, "" if c.kind in ("state", "context", "input") else c.name)
                if key in seen:
                    if not _same(seen[key], c):
                        shared = c.kind in ("state", "context", "input")  # one each, whatever their names
                        raise SpecError(f"`{first.name} + {decl.name}`: `{c.kind} {c.name}` is declared differently "
                                        f"in the two energies (first at {seen[key].span})", c.span,
                                        f"summed energies share one {c.kind}: declare it alike in both (its shape"
                                        + (", its `where` relation)" if c.kind == "context" else ")") if shared else
                                        "summed energies share their names: rename one")
                    continue
                seen[key] = c
                clauses.append(c)
            else:
                clauses.append(c)
    if len(globals_) != len(parts):
        raise SpecError(f"every energy in `{summed}` needs a `global` energy",
                        first.span)
    total: ast.Node = globals_[0].value
    for g in globals_[1:]:
        total = ast.BinOp(g.span, "+", total, g.value)
    name = "_".join(d.name for d, _ in parts)
    clauses.append(ast.Clause("global", globals_[0].span, "F_sum", total))
    if optimizer is not None:
        clauses.append(optimizer)
    source = "\n".join(d.source_text for d, _ in parts)
    return ast.EnergyDecl(name, header, clauses, first.span, source), dims

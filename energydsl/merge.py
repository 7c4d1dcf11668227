"""Summed stages (`A + B`): two energies over one state merged into one declaration, F = F_A + F_B.

The merged energy is an ordinary `energy` declaration, so everything downstream (derivation, checks,
code generation) treats it like any other. Clauses declared in both must be the same; the optimizer is
the first energy's (NRGPT's shared learned η: one step on the sum).
"""

from __future__ import annotations

import dataclasses

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


def merge_energies(parts: list[tuple[ast.EnergyDecl, dict[str, float]]]) -> tuple[ast.EnergyDecl, dict[str, float]]:
    first = parts[0][0]
    header: list[tuple[str, ast.Node]] = []
    dims: dict[str, float] = {}
    seen: dict[tuple[str, str], ast.Clause] = {}
    clauses: list[ast.Clause] = []
    globals_: list[ast.Clause] = []
    optimizer: ast.Clause | None = None
    for decl, values in parts:
        for name, node in decl.header:
            if name in dims and dims[name] != values.get(name, dims[name]):
                raise SpecError(f"`{first.name} + {decl.name}`: dim `{name}` is {dims[name]:g} in one energy and "
                                f"{values[name]:g} in the other", decl.span)
            if all(name != have for have, _ in header):  # shared and not given: the first energy's default
                header.append((name, node))
            if name in values:
                dims[name] = values[name]
        for c in decl.clauses:
            if c.kind == "global":
                globals_.append(c)
            elif c.kind == "optimizer":
                optimizer = optimizer or c
            elif c.kind == "expect":
                continue  # an expectation about one energy alone says nothing about the sum
            elif c.kind in SHARED_KINDS:
                # one state, context and input per energy, whatever their names; other clauses by name
                key = (c.kind, "" if c.kind in ("state", "context", "input") else c.name)
                if key in seen:
                    if not _same(seen[key], c):
                        raise SpecError(f"`{first.name} + {decl.name}`: `{c.kind} {c.name}` is declared differently "
                                        f"in the two energies (first at {seen[key].span})", c.span,
                                        "summed energies share their state, context and names; rename one")
                    continue
                seen[key] = c
                clauses.append(c)
            else:
                clauses.append(c)
    if len(globals_) != len(parts):
        raise SpecError(f"every energy in `{' + '.join(d.name for d, _ in parts)}` needs a `global` energy",
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

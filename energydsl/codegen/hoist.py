"""Loop-invariant code motion for a generated forward: what every optimizer step recomputes alike goes first.

The emitter hoists what the IR marks as state-independent (a `let`, the context's keys and their layout). The
lowering rules also write lines of their own around a sum, and some read only parameters and hoisted values:
a constrained weight (`softplus(P_d)`), a transposed projection, the concatenated key features of CEM's
diagonal term and their (B, H, T, D) layout. In a `steps T` loop each would run T times, forward and backward.
This pass moves such lines before the loop, on the generated lines themselves: a line is invariant when it
reads no name that the steps change. Every line is a pure assignment (the generated code has no randomness
and no in-place updates), so moving it changes no value.
"""

from __future__ import annotations

import ast

__all__ = ["hoist_invariants", "line_names"]


def line_names(line: list[ast.stmt]) -> tuple[set[str], set[str]]:
    """(names read, names assigned) by one line's statements."""
    reads, writes = set(), set()
    for node in (n for stmt in line for n in ast.walk(stmt)):
        if isinstance(node, ast.Name):
            (reads if isinstance(node.ctx, ast.Load) else writes).add(node.id)
    return reads, writes


def _plain(stmt: ast.stmt) -> bool:
    """`name = ...` or `a, b = ...`: an assignment that binds names and mutates nothing."""
    return isinstance(stmt, ast.Assign) and all(
        isinstance(t, ast.Name) or (isinstance(t, ast.Tuple) and all(isinstance(e, ast.Name) for e in t.elts))
        for t in stmt.targets
    )


def hoist_invariants(body: list[str], carried: set[str]) -> tuple[list[str], list[str]]:
    """(hoisted, kept): the lines of a step body (one statement each) whose value is the same at every step,
    and the others, each in their original order.

    `carried` names what each step reassigns (the state, the optimizer's buffers). A line stays in the loop
    when it is not a plain assignment to names, or reads or assigns a carried name, or reads a line that
    stays; a name the body reads before assigning it, or assigns twice, is carried whatever the caller said.
    """
    lines = [ast.parse(line.strip()).body for line in body]
    names = [line_names(line) for line in lines]
    variant, read_first, assigned = set(carried), set(), set()
    for reads, writes in names:
        read_first |= reads - assigned
        variant |= writes & (assigned | read_first)
        assigned |= writes
    hoisted, kept = [], []
    for text, line, (reads, writes) in zip(body, lines, names, strict=True):
        if line and all(_plain(stmt) for stmt in line) and not (reads | writes) & variant:
            hoisted.append(text)
        else:
            variant |= writes
            kept.append(text)
    return hoisted, kept

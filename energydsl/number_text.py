"""Numbers as a user wrote them: dims and constants are floats inside (SymPy, the IR), `8` outside."""

from __future__ import annotations

import numbers


def plain_value(v: float) -> int | float:
    """An integral float as an int (`65.0` → `65`), for JSON and messages; others unchanged."""
    return int(v) if float(v).is_integer() and abs(v) < 1e16 else v


def plain_number(v: float) -> str:
    """`8`, `0.5`, `1e+30` (not its 31 digits): a number in a message, a header or a generated docstring."""
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e16 else f"{v:g}"


def is_whole(value: object) -> bool:
    """A whole number: an int, numpy's too; not a bool, nor a float like 2.5."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_count(value: object, least: int = 1) -> bool:
    """A whole number of at least `least`: layers, tokens, a batch."""
    return is_whole(value) and value >= least

"""Numbers as a user wrote them: dims and constants are floats inside (SymPy, the IR), `8` outside."""

from __future__ import annotations

import numbers


def plain_value(v: float) -> int | float:
    """An integral float as an int (`65.0` → `65`), for JSON and messages; others unchanged."""
    return int(v) if float(v).is_integer() and abs(v) < 1e16 else v


def plain_number(v: float) -> str:
    """`8`, `0.5`, `1e+30` (not its 31 digits): a number in a message, a header or a generated docstring; every
    digit a short form would drop kept (`0.1234567`, which `g` rounded to 0.123457)."""
    if float(v).is_integer() and abs(v) < 1e16:
        return str(int(v))
    short = f"{v:g}"
    return short if float(short) == float(v) else repr(float(v))


def is_whole(value: object) -> bool:
    """A whole number: an int, numpy's too; not a bool, nor a float like 2.5."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_count(value: object, least: int = 1) -> bool:
    """A whole number of at least `least`: layers, tokens, a batch."""
    return is_whole(value) and value >= least


def exact_number(value: float) -> object:
    """The SymPy number a user wrote, exactly (`0.1` is 1/10, `1e-100` is 10⁻¹⁰⁰): `sympy.nsimplify` alone
    rounds to a nearby simple number (0.999999999999 became 1, a momentum that never decays; 1e-100 became 0).
    A float that is a short closed form exactly (`sqrt(2)`, from a constant expression a spec wrote) keeps it."""
    import sympy as sp

    if is_whole(value):
        return sp.Integer(value)
    if isinstance(value, sp.Basic) and not value.is_Float:
        return value  # already exact
    decimal = sp.Rational(repr(float(value)))
    if decimal.q <= 10**6:
        return decimal
    simple = short_closed_form(value)
    return decimal if simple is None else simple


def short_closed_form(value: object) -> object | None:
    """The short closed form (`1/3`, `sqrt(2)/2`) that equals the float `value` exactly, or None: nsimplify's
    guess only where it is not a rounding (0.999999999999 is not 1) nor a long product of powers."""
    import sympy as sp

    simple = sp.nsimplify(value)
    return simple if float(simple) == float(value) and sp.count_ops(simple) <= 4 else None


def number_shown(value: object) -> str:
    """A SymPy number as an equation's reader wants it: `9/10`, `sqrt(2)`, and `0.999999999999` (not its
    fraction over 10¹²)."""
    import sympy as sp

    v = sp.sympify(value)
    if v.is_Float:
        v = exact_number(v)
    if v.is_Rational and v.q > 1000:
        return repr(float(v))
    if v.is_Integer and round_digits(int(v)) is not None:
        return plain_number(float(v))  # `1e300` as written, not its 301 digits
    return str(v)


def round_digits(n: int) -> int | None:
    """The digits before the trailing zeros of an integer such as the spec's `1e300` (kept exact): more than 16
    digits, at most 15 before its zeros; printed as 1e+300 rather than its 301 digits. None for any other
    (12345678901234567890 keeps every digit)."""
    digits = str(abs(n))
    mantissa = digits.rstrip("0")
    return len(mantissa) if len(digits) > 16 and len(mantissa) <= 15 else None

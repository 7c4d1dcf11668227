"""SymPy scalars and the registry's element-wise functions as PyTorch source (the generated code's numbers,
hyper-parameters and activations)."""

from __future__ import annotations

import math

import sympy as sp

from ..functions import REGISTRY, X

# SymPy's function classes (a square root is a Pow in SymPy, printed as `** 0.5` by `sympy_src`)
_SP_FUNCS = {sp.exp: "exp", sp.log: "log", sp.tanh: "tanh", sp.erf: "erf", sp.Abs: "abs", sp.sign: "sign",
             sp.cosh: "cosh", sp.sinh: "sinh", sp.sin: "sin", sp.cos: "cos"}


class FloatOverflow(ValueError):
    """A number of the derived update that no float holds (`1e300 * (z . z)` stepped with η = 1e300: -2e600 z):
    SymPy keeps it exactly, the generated Python cannot (it printed `inf`, a NameError when the module ran)."""

    def __init__(self, value: sp.Expr) -> None:
        super().__init__(str(sp.Float(value, 3)).lower())  # -2.00e+600
        self.value = value


def float_src(value: sp.Expr) -> str:
    """A number as a Python float literal; FloatOverflow where it is beyond a float's range."""
    try:
        out = float(value)
    except OverflowError:
        out = math.inf
    if not math.isfinite(out):
        raise FloatOverflow(value)
    return repr(out)


def sympy_src(expr: sp.Expr, names: dict[sp.Symbol, str]) -> str:
    """Python source for a SymPy scalar; `names` maps symbols to the tensors or numbers they stand for.

    Numeric sub-expressions are folded to floats; functions of tensors use torch.
    """
    expr = sp.sympify(expr)
    numbers = {s: exact_number(v) for s, v in names.items() if is_number(v)}
    if numbers and expr.free_symbols & set(numbers):
        expr = expr.subs(numbers)
    if not (expr.free_symbols & set(names)):
        if expr.free_symbols:
            raise KeyError(f"no value for {sorted(map(str, expr.free_symbols))}")
        return float_src(expr)
    if expr in names:
        return names[expr]
    if isinstance(expr, sp.Add):
        return "(" + " + ".join(sympy_src(a, names) for a in expr.args) + ")"
    if isinstance(expr, sp.Mul):
        return "(" + " * ".join(sympy_src(a, names) for a in expr.args) + ")"
    if isinstance(expr, sp.Pow):
        return f"({sympy_src(expr.base, names)} ** {sympy_src(expr.exp, names)})"
    if isinstance(expr, sp.Max):
        a, b = expr.args
        return f"torch.maximum(torch.as_tensor({sympy_src(a, names)}), torch.as_tensor({sympy_src(b, names)}))"
    if isinstance(expr, sp.Heaviside):
        a = sympy_src(expr.args[0], names)
        return f"({a} > 0).to(torch.get_default_dtype())"
    softplus_of = _softplus_argument(expr)
    if softplus_of is not None:  # log(1 + exp(a)) overflows past a = 88 in float32; softplus does not
        return f"F.softplus(torch.as_tensor({sympy_src(softplus_of, names)}))"
    for cls, fn in _SP_FUNCS.items():
        if isinstance(expr, cls):
            return f"torch.{fn}(torch.as_tensor({sympy_src(expr.args[0], names)}))"
    raise NotImplementedError(f"cannot print {expr.func.__name__} as torch code")


def _softplus_argument(expr: sp.Expr) -> sp.Expr | None:
    """a, when `expr` is log(1 + exp(a)): a preconditioner's softplus of a scalar param, folded into SymPy."""
    if not isinstance(expr, sp.log) or not isinstance(expr.args[0], sp.Add) or len(expr.args[0].args) != 2:
        return None
    one, other = sorted(expr.args[0].args, key=lambda t: t != 1)
    return other.args[0] if one == 1 and isinstance(other, sp.exp) else None


def exact_number(text: str) -> sp.Expr:
    """A number's source as an exact SymPy number, so that folding rounds once at the end: sqrt(2)/sqrt(8) is
    0.5, not the 0.5000000000000001 of float arithmetic."""
    value = float(text)
    return sp.Rational(text) if math.isfinite(value) else sp.Float(value)


def is_number(text: str) -> bool:
    """Whether generated source `text` is a plain number (a dim or fixed hyper-parameter put in)."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def function_src(name: str, x: str) -> str:
    """Source for an element-wise function applied to the value named `x`."""
    fn = REGISTRY[name]
    if fn.torch_src is not None:
        return fn.torch_src.format(x=x)
    return sympy_src(fn.formula, {X: x})

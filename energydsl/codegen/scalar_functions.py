"""Scalar functions of one variable, printed for fused kernels: a weight G(s) of the pointwise family
(`pointwise_weights.py`), an activation G(x) of the gated epilogue (`gated_epilogue.py`).

The IR gives G as an expression in the variable `VAR`; its derivative G' comes from the IR's own calculus
(`calculus.gradient`). Both are printed as the statements of a `@triton.jit` function of one fp32 tile `x`,
one local per node, and G is printed in torch too, for the exact float64 path:

    printed = scalar_function(em, G)   # a ScalarFunction, or None where G holds something not printable
    printed.value, printed.grad        # bodies of G(x) and G'(x)
    printed.pair                       # the body of (G(x), G'(x)), locals shared
    printed.torch                      # G as a torch expression in `x`

An element-wise function is printed from `TRITON_FUNCTIONS` where it has a hand-written stable form there
(softplus, tanh, ∫sigmoid, ∫tanh), and otherwise from its SymPy formula in the registry (`functions.py`): a
derivative SymPy derived (GELU'', SiLU'') or a closed-form antiderivative (∫GELU) prints as written there, as
the torch backend evaluates it. What cannot be printed (a learned scalar inside G, a formula SymPy left as an
integral or a piecewise one) gives None, and the caller keeps the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import sympy as sp

from .. import ir
from ..calculus import NotDifferentiable, gradient
from ..functions import REGISTRY, X
from ..ir import Expr
from .lowering import _number
from .scalar_src import float_src, function_src, is_number

if TYPE_CHECKING:
    from .torch_expr import Emitter

#: the variable of a printed function: a scalar of no token (`x` in the printed code)
VAR = ir.Var("s", "param", ())


@dataclass(frozen=True)
class ScalarFunction:
    """G printed: the Triton bodies of G(x), G'(x) and of the pair, and G as a torch expression in x."""

    value: str
    grad: str
    pair: str
    torch: str


def scalar_function(em: Emitter, g: Expr) -> ScalarFunction | None:
    """G and G' printed (`ScalarFunction`), or None if G holds something the printers do not take (a learned
    scalar, a formula with an integral or cases, a power of a learned exponent)."""
    try:
        dg = gradient(g, VAR)
    except (NotDifferentiable, ir.ShapeError):
        return None
    # a derivative that is 0 everywhere (step's, in relu(s)^2 step(s)) drops out of its product and sum
    dg = ir.substitute(dg, {n: ir.ZERO for n in ir.nodes(dg) if isinstance(n, ir.Func) and n.name == "zero"})
    torch_src = _torch_src(em, g)
    if torch_src is None:
        return None
    try:
        value, grad = _TritonPrinter(em).body(g), _TritonPrinter(em).body(dg)
        pair = _TritonPrinter(em).body(g, dg)
    except _Unprintable:
        return None
    return ScalarFunction(value, grad, pair, torch_src)


#: element-wise functions in Triton, `{x}` a name (each argument is bound to a local first); numerically
#: stable forms where the naive one overflows (softplus, log sigmoid, tanh, the antiderivatives of sigmoid and
#: tanh). A function not listed prints from its formula.
TRITON_FUNCTIONS = {
    "exp": "tl.exp({x})",
    "log": "tl.log({x})",
    "inv": "1.0 / {x}",
    "sqrt": "tl.sqrt({x})",
    "abs": "tl.abs({x})",
    "sign": "tl.where({x} > 0.0, 1.0, tl.where({x} < 0.0, -1.0, 0.0))",
    "zero": "0.0 * {x}",
    "one": "0.0 * {x} + 1.0",
    "identity": "{x}",
    "square": "{x} * {x}",
    "relu": "tl.maximum({x}, 0.0)",
    "step": "tl.where({x} > 0.0, 1.0, 0.0)",
    "sigmoid": "tl.sigmoid({x})",
    "dsigmoid": "tl.sigmoid({x}) * (1.0 - tl.sigmoid({x}))",
    "tanh": "2.0 * tl.sigmoid(2.0 * {x}) - 1.0",
    "dtanh": "1.0 - (2.0 * tl.sigmoid(2.0 * {x}) - 1.0) * (2.0 * tl.sigmoid(2.0 * {x}) - 1.0)",
    "softplus": "tl.maximum({x}, 0.0) + tl.log(1.0 + tl.exp(-tl.abs({x})))",
    "logsigmoid": "tl.minimum({x}, 0.0) - tl.log(1.0 + tl.exp(-tl.abs({x})))",
    "dlogsigmoid": "tl.sigmoid(-{x})",
    "int_sigmoid": "tl.maximum({x}, 0.0) + tl.log(1.0 + tl.exp(-tl.abs({x}))) - 0.6931471805599453",
    "int_tanh": "tl.abs({x}) + tl.log(1.0 + tl.exp(-2.0 * tl.abs({x}))) - 0.6931471805599453",
    "silu": "{x} * tl.sigmoid({x})",
    "dsilu": "tl.sigmoid({x}) * (1.0 + {x} * (1.0 - tl.sigmoid({x})))",
    "gelu": "{x} * 0.5 * (1.0 + tl.math.erf({x} * 0.7071067811865476))",
    "dgelu": "0.5 * (1.0 + tl.math.erf({x} * 0.7071067811865476)) + {x} * tl.exp(-0.5 * {x} * {x}) * "
             "0.3989422804014327",
    "dsigmoid'": "tl.sigmoid({x}) * (1.0 - tl.sigmoid({x})) * (1.0 - 2.0 * tl.sigmoid({x}))",
    "dtanh'": "-8.0 * (2.0 * tl.sigmoid(2.0 * {x}) - 1.0) * tl.sigmoid(2.0 * {x}) * (1.0 - tl.sigmoid(2.0 * {x}))",
    "dsilu'": "tl.sigmoid({x}) * (1.0 - tl.sigmoid({x})) * (2.0 + {x} * (1.0 - 2.0 * tl.sigmoid({x})))",
    "dgelu'": "tl.exp(-0.5 * {x} * {x}) * 0.3989422804014327 * (2.0 - {x} * {x})",
}

#: SymPy's functions of one argument in Triton (a formula's `tanh` in the stable form above)
_SYMPY_TRITON = {sp.exp: "tl.exp({x})", sp.log: "tl.log({x})", sp.erf: "tl.math.erf({x})", sp.Abs: "tl.abs({x})",
                 sp.sign: TRITON_FUNCTIONS["sign"], sp.tanh: TRITON_FUNCTIONS["tanh"],
                 sp.cosh: "0.5 * (tl.exp({x}) + tl.exp(-{x}))", sp.sinh: "0.5 * (tl.exp({x}) - tl.exp(-{x}))",
                 sp.sin: "tl.sin({x})", sp.cos: "tl.cos({x})", sp.Heaviside: TRITON_FUNCTIONS["step"]}


class _TritonPrinter:
    """Scalar expressions in `VAR` as the statements of a `@triton.jit` function of `x`, one local per node
    (shared by the expressions printed together)."""

    def __init__(self, em: Emitter):
        self.em = em
        self.lines: list[str] = []
        self.memo: dict[Expr, str] = {}

    def body(self, *exprs: Expr) -> str:
        """The statements ending in `return` of the expressions' values (a tuple for several); a number is
        returned as a tile of x's shape, as a kernel's store needs."""
        results = [self.visit(e) for e in exprs]
        results = [f"0.0 * x + {r}" if is_number(r) else r for r in results]
        return "\n".join([*self.lines, f"return {', '.join(results)}"])

    def local(self, code: str) -> str:
        name = f"t{len(self.lines)}"
        self.lines.append(f"{name} = {code}")
        return name

    def visit(self, e: Expr) -> str:
        if e in self.memo:
            return self.memo[e]
        match e:
            case ir.Var() if e == VAR:
                out = "x"
            case ir.Scalar():
                out = repr(_float(self.em, e.value))
            case ir.Let() | ir.StopGrad():
                out = self.visit(e.body if isinstance(e, ir.Let) else e.a)
            case ir.Add():
                out = self.local(" + ".join(self.visit(t) for t in e.terms))
            case ir.Mul():
                out = self.local(" * ".join(self.visit(f) for f in e.factors))
            case ir.Pow():
                out = self.local(_triton_power(self.visit(e.base), _float(self.em, e.exponent)))
            case ir.Func() if e.name in TRITON_FUNCTIONS:
                out = self.local(TRITON_FUNCTIONS[e.name].format(x=self.visit(e.arg)))
            case ir.Func() if e.name in REGISTRY:
                out = _SympyTritonPrinter(self, self.visit(e.arg)).visit(REGISTRY[e.name].formula)
            case _:
                raise _Unprintable
        self.memo[e] = out
        return out


class _SympyTritonPrinter:
    """A registry formula in SymPy's `X`, printed into the locals of a `_TritonPrinter` with X bound to `arg`."""

    def __init__(self, out: _TritonPrinter, arg: str):
        self.out, self.arg = out, arg
        self.memo: dict[sp.Expr, str] = {}

    def visit(self, e: sp.Expr) -> str:
        if e in self.memo:
            return self.memo[e]
        if e == X:
            code = self.arg
        elif e.is_number:
            if not e.is_real:
                raise _Unprintable
            code = float_src(e)
        elif isinstance(e, (sp.Add, sp.Mul)):  # its numbers folded into one (SymPy keeps sqrt(2) / 2 apart)
            numbers = [a for a in e.args if a.is_number]
            parts = [a for a in e.args if not a.is_number]
            if numbers:
                parts.insert(0, e.func(*numbers))
            code = self.out.local((" + " if isinstance(e, sp.Add) else " * ").join(self.visit(a) for a in parts))
        elif isinstance(e, sp.Pow) and e.exp.is_number:
            code = self.out.local(_triton_power(self.visit(e.base), float(e.exp)))
        elif isinstance(e, sp.Max) and len(e.args) == 2:
            code = self.out.local("tl.maximum({}, {})".format(*(self.visit(a) for a in e.args)))
        elif isinstance(e, sp.Heaviside) and (len(e.args) == 1 or e.args[1] == 0):  # H(0) = 0, as `step`
            code = self.out.local(_SYMPY_TRITON[sp.Heaviside].format(x=self.visit(e.args[0])))
        elif type(e) in _SYMPY_TRITON and len(e.args) == 1:
            code = self.out.local(_SYMPY_TRITON[type(e)].format(x=self.visit(e.args[0])))
        else:  # an integral SymPy left unevaluated, cases (Piecewise), a function with no Triton form
            raise _Unprintable
        self.memo[e] = code
        return code


def _triton_power(base: str, p: float) -> str:
    """base ** p: a product for small integer powers, sqrt for 1/2, exp(p log base) otherwise (base > 0)."""
    if p == int(p) and 1 <= abs(p) <= 4:
        product = " * ".join([base] * int(abs(p)))
        return product if p > 0 else f"1.0 / ({product})"
    if p == 0.5:
        return f"tl.sqrt({base})"
    if p == -0.5:
        return f"1.0 / tl.sqrt({base})"
    return f"tl.exp({p!r} * tl.log({base}))"


def _torch_src(em: Emitter, e: Expr) -> str | None:
    """G as one torch expression in `x` (the reference path's), or None."""
    match e:
        case ir.Var() if e == VAR:
            return "x"
        case ir.Scalar():
            value = _number(e.value, em.scalars)
            return None if value is None else repr(value)
        case ir.Let():
            return _torch_src(em, e.body)
        case ir.StopGrad():
            return _torch_src(em, e.a)
        case ir.Add() | ir.Mul():
            parts = [_torch_src(em, t) for t in e.children]
            return None if None in parts else "(" + (" + " if isinstance(e, ir.Add) else " * ").join(parts) + ")"
        case ir.Pow():
            base, p = _torch_src(em, e.base), _number(e.exponent, em.scalars)
            return None if base is None or p is None else f"({base} ** {p!r})"
        case ir.Func() if e.name in REGISTRY:
            arg = _torch_src(em, e.arg)
            if arg is None:
                return None
            try:
                return "(" + function_src(e.name, arg) + ")"
            except (NotImplementedError, KeyError):  # a formula torch cannot print
                return None
    return None


class _Unprintable(Exception):
    pass


def _float(em: Emitter, value: sp.Expr) -> float:
    number = _number(value, em.scalars)
    if number is None:
        raise _Unprintable
    return number

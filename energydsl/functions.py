"""Element-wise functions: their SymPy formula (for derivatives, antiderivatives and printing) and a
numerically stable torch implementation (for evaluation and generated code).

A derivative is looked up in the table when a stable form is known, otherwise SymPy differentiates
the formula. `integral(f)` asks SymPy for a closed form; when the closed form needs functions torch
lacks (∫SiLU needs the dilogarithm), evaluation uses Gauss-Legendre quadrature whose gradient is f
itself, exactly.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import sympy as sp
import torch

from .files import write_whole

X = sp.Symbol("x", real=True)


@dataclass
class Function:
    name: str
    formula: sp.Expr  # in X
    torch_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
    derivative: str | None = None  # name of the derivative's entry, when a stable one is known
    latex: str | None = None
    torch_src: str | None = None  # how generated code spells it; `{x}` is the argument

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.torch_fn is not None:
            return self.torch_fn(x)
        return sympy_to_torch(self.formula, {X: x})


def _phi(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.erf(x / math.sqrt(2)))


def _npdf(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _d2sigmoid(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1 - s) * (1 - 2 * s)


def _log_cosh(x: torch.Tensor) -> torch.Tensor:
    a = torch.abs(x)
    return a + torch.nn.functional.softplus(-2 * a) - math.log(2)


def _d2silu(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1 - s) * (2 + x * (1 - 2 * s))


_sig = sp.Integer(1) / (1 + sp.exp(-X))
_Phi = (1 + sp.erf(X / sp.sqrt(2))) / 2
_npdf_sym = sp.exp(-X**2 / 2) / sp.sqrt(2 * sp.pi)

REGISTRY: dict[str, Function] = {}


def register(fn: Function) -> Function:
    REGISTRY[fn.name] = fn
    return fn


for _f in [
    Function("exp", sp.exp(X), torch.exp, "exp", torch_src="torch.exp({x})"),
    Function("log", sp.log(X), torch.log, "inv", torch_src="torch.log({x})"),
    Function("inv", 1 / X, torch.reciprocal, None, torch_src="torch.reciprocal({x})"),
    Function("sqrt", sp.sqrt(X), torch.sqrt, None, torch_src="torch.sqrt({x})"),
    Function("abs", sp.Abs(X), torch.abs, "sign", torch_src="torch.abs({x})"),
    Function("sign", sp.sign(X), torch.sign, "zero", torch_src="torch.sign({x})"),
    Function("zero", sp.Integer(0) * X, torch.zeros_like, "zero", torch_src="torch.zeros_like({x})"),
    Function("relu", sp.Max(0, X), torch.relu, "step", torch_src="torch.relu({x})"),
    Function("step", sp.Heaviside(X, 0), lambda x: (x > 0).to(x.dtype), "zero",
             torch_src="({x} > 0).to({x}.dtype)"),
    Function("sigmoid", _sig, torch.sigmoid, "dsigmoid", latex="\\sigma", torch_src="torch.sigmoid({x})"),
    Function("dsigmoid", _sig * (1 - _sig), lambda x: torch.sigmoid(x) * (1 - torch.sigmoid(x)), "dsigmoid'",
             latex="\\sigma'", torch_src="(torch.sigmoid({x}) * (1 - torch.sigmoid({x})))"),
    Function("tanh", sp.tanh(X), torch.tanh, "dtanh", torch_src="torch.tanh({x})"),
    Function("dtanh", 1 - sp.tanh(X) ** 2, lambda x: 1 - torch.tanh(x) ** 2, "dtanh'", latex="\\tanh'",
             torch_src="(1 - torch.tanh({x}) ** 2)"),
    # sin and cos: rotary position encodings (`cos(theta * i)`), periodic energies
    Function("sin", sp.sin(X), torch.sin, "cos", torch_src="torch.sin({x})"),
    Function("cos", sp.cos(X), torch.cos, "dcos", torch_src="torch.cos({x})"),
    Function("dcos", -sp.sin(X), lambda x: -torch.sin(x), "dcos'", latex="\\cos'", torch_src="(-torch.sin({x}))"),
    Function("dcos'", -sp.cos(X), lambda x: -torch.cos(x), "sin", latex="\\cos''", torch_src="(-torch.cos({x}))"),
    Function("softplus", sp.log(1 + sp.exp(X)), torch.nn.functional.softplus, "sigmoid",
             torch_src="F.softplus({x})"),
    # log sigmoid: the log of a `decay` rate (ir.log_rate), finite where sigmoid underflows to 0
    Function("logsigmoid", -sp.log(1 + sp.exp(-X)), torch.nn.functional.logsigmoid, "dlogsigmoid",
             latex="\\log\\sigma", torch_src="F.logsigmoid({x})"),
    Function("dlogsigmoid", 1 / (1 + sp.exp(X)), lambda x: torch.sigmoid(-x), None, latex="(\\log\\sigma)'",
             torch_src="torch.sigmoid(-{x})"),
    Function("silu", X * _sig, torch.nn.functional.silu, "dsilu", latex="\\operatorname{SiLU}",
             torch_src="F.silu({x})"),
    Function("dsilu", sp.diff(X * _sig, X),
             lambda x: torch.sigmoid(x) * (1 + x * (1 - torch.sigmoid(x))), "dsilu'",
             latex="\\operatorname{SiLU}'",
             torch_src="(torch.sigmoid({x}) * (1 + {x} * (1 - torch.sigmoid({x}))))"),
    Function("gelu", X * _Phi, lambda x: torch.nn.functional.gelu(x), "dgelu", latex="\\operatorname{GELU}",
             torch_src="F.gelu({x})"),
    Function("dgelu", _Phi + X * _npdf_sym, lambda x: _phi(x) + x * _npdf(x), "dgelu'",
             latex="\\operatorname{GELU}'",
             torch_src="(0.5 * (1 + torch.erf({x} * 0.7071067811865476)) + {x} * torch.exp(-0.5 * {x} ** 2)"
                       " * 0.3989422804014327)"),
    # second derivatives in stable forms (SymPy's own, as rational functions of e^x, overflow in float32)
    Function("dsigmoid'", _sig * (1 - _sig) * (1 - 2 * _sig), _d2sigmoid, None, latex="\\sigma''",
             torch_src="(torch.sigmoid({x}) * (1 - torch.sigmoid({x})) * (1 - 2 * torch.sigmoid({x})))"),
    Function("dtanh'", -2 * sp.tanh(X) * (1 - sp.tanh(X) ** 2), lambda x: -2 * torch.tanh(x) * (1 - torch.tanh(x) ** 2),
             None, latex="\\tanh''",
             torch_src="(-2 * torch.tanh({x}) * (1 - torch.tanh({x}) ** 2))"),
    Function("dsilu'", _sig * (1 - _sig) * (2 + X * (1 - 2 * _sig)), _d2silu, None,
             latex="\\operatorname{SiLU}''",
             torch_src="(torch.sigmoid({x}) * (1 - torch.sigmoid({x})) * (2 + {x} * (1 - 2 * torch.sigmoid({x}))))"),
    Function("dgelu'", _npdf_sym * (2 - X**2), lambda x: _npdf(x) * (2 - x * x), None, latex="\\operatorname{GELU}''",
             torch_src="(torch.exp(-0.5 * {x} ** 2) * 0.3989422804014327 * (2 - {x} ** 2))"),
    # antiderivatives in stable forms (`integral(tanh)`, `integral(sigmoid)`): SymPy's closed forms,
    # x - log(1 + tanh x) and log(1 + e^x) - log 2, are inf where tanh x rounds to -1 (x < -9 in float32, -19 in
    # float64) or e^x overflows (x > 88 in float32); same constants (0 at x = 0)
    Function("int_tanh", sp.log(sp.cosh(X)), _log_cosh, "tanh", latex="{\\textstyle\\int}\\tanh",
             torch_src="(torch.abs({x}) + F.softplus(-2 * torch.abs({x})) - 0.6931471805599453)"),
    Function("int_sigmoid", sp.log(1 + sp.exp(X)) - sp.log(2),
             lambda x: torch.nn.functional.softplus(x) - math.log(2), "sigmoid", latex="{\\textstyle\\int}\\sigma",
             torch_src="(F.softplus({x}) - 0.6931471805599453)"),
    Function("square", X**2, torch.square, None, torch_src="torch.square({x})"),
    Function("identity", X, lambda x: x, "one", torch_src="{x}"),
    Function("one", sp.Integer(1) + 0 * X, torch.ones_like, "zero", torch_src="torch.ones_like({x})"),
]:
    register(_f)


def derivative(name: str) -> str:
    """The registry name of f', creating it from SymPy's derivative when no stable form is listed."""
    fn = REGISTRY[name]
    if fn.derivative:
        return fn.derivative
    dname = f"d{name}" if not name.startswith("d") else f"{name}'"
    if dname not in REGISTRY:
        register(Function(dname, sp.simplify(sp.diff(fn.formula, X)), None, None,
                          latex=(fn.latex or f"\\operatorname{{{name}}}") + "'"))
    fn.derivative = dname
    return dname


# ----------------------------------------------------------------------------- antiderivatives

_GL_NODES, _GL_WEIGHTS = (torch.tensor(a, dtype=torch.float64, device="cpu") for a in
                          __import__("numpy").polynomial.legendre.leggauss(64))


class _QuadratureIntegral(torch.autograd.Function):
    """φ(x) = ∫_0^x f(t) dt by 64-point Gauss-Legendre on [0, x]; dφ/dx = f(x) exactly."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, name: str):  # type: ignore[override]
        f = REGISTRY[name]
        nodes = _GL_NODES.to(x.device, x.dtype)
        weights = _GL_WEIGHTS.to(x.device, x.dtype)
        t = x.unsqueeze(-1) * (nodes + 1) / 2
        out = (f(t) * weights).sum(-1) * x / 2
        ctx.save_for_backward(x)
        ctx.fname = name
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return grad * REGISTRY[ctx.fname](x), None


_TORCHABLE = (sp.exp, sp.log, sp.tanh, sp.erf, sp.Abs, sp.sign, sp.cosh, sp.sinh)


def _torchable(expr: sp.Expr) -> bool:
    for node in sp.preorder_traversal(expr):
        if isinstance(node, sp.Function) and not isinstance(node, _TORCHABLE):
            return False
        if isinstance(node, (sp.Integral, sp.Piecewise)):
            return False
    return True


_INTEGRAL_FORMAT = 3  # of the files below; part of their names


_T = sp.Symbol("_t", real=True)  # the variable of integration of an integral SymPy leaves unevaluated


def _closed_form_integral(formula: sp.Expr) -> sp.Expr:
    """∫_0^x formula (the indefinite integral where it has no finite value at 0), kept on disk.

    SymPy takes 0.2-0.6 s for ∫GELU or ∫SiLU, in every process that meets it (each search worker, each CLI
    run); the result depends only on the formula and SymPy's version, so it is stored under the codegen
    cache (`$ENERGYDSL_CACHE`) as `srepr` text, when that text reads back as the same expression. A file
    that cannot be read or written is recomputed."""
    from .codegen import cache_dir

    key = hashlib.sha256(f"{_INTEGRAL_FORMAT}|{sp.__version__}|{sp.srepr(formula)}".encode()).hexdigest()[:20]
    path = cache_dir() / "integrals" / f"{key}.txt"
    try:
        kept = sp.sympify(path.read_text())
        if isinstance(kept, sp.Expr) and kept.free_symbols <= {X}:
            return kept
    except (OSError, sp.SympifyError, SyntaxError, TypeError, ValueError):
        pass
    closed = sp.integrate(formula, X)
    if closed.has(sp.Integral):  # no closed form (∫SiLU): ∫_0^x, as the torch side's quadrature, which evalf
        # computes (an indefinite Integral at a point has no value: `check`'s sympy row failed on it)
        closed = sp.Integral(formula.subs(X, _T), (_T, 0, X))
    else:
        closed = sp.simplify(closed - closed.subs(X, 0)) if closed.subs(X, 0).is_finite else closed
    text = sp.srepr(closed)
    try:
        if sp.sympify(text) != closed:  # a form whose text does not read back: not kept
            return closed
    except (sp.SympifyError, SyntaxError, TypeError, ValueError):
        return closed
    write_whole(path, text)  # whole or not at all: concurrent workers never read half a file
    return closed


def antiderivative(name: str) -> str:
    """The registry name of φ with φ' = f (`integral(f)`); SymPy finds the closed form."""
    iname = f"int_{name}"
    if iname in REGISTRY:
        return iname
    f = REGISTRY[name]
    closed = _closed_form_integral(f.formula)
    head = f.latex or f"\\operatorname{{{name}}}"
    latex = "{\\textstyle\\int}" + head  # the braces keep \textstyle to the sign
    if _torchable(closed) and not closed.has(sp.Integral):
        fn = Function(iname, closed, None, name, latex=latex)
    else:
        fn = Function(iname, closed, lambda x, _n=name: _QuadratureIntegral.apply(x, _n), name, latex=latex,
                      torch_src=f"integral_quadrature({{x}}, {name!r})")
    return register(fn).name


# ----------------------------------------------------------------------------- SymPy -> torch

_SP_TORCH: dict[type, Callable] = {
    sp.exp: torch.exp, sp.log: torch.log, sp.tanh: torch.tanh, sp.erf: torch.erf, sp.Abs: torch.abs,
    sp.sign: torch.sign, sp.cosh: torch.cosh, sp.sinh: torch.sinh, sp.sin: torch.sin, sp.cos: torch.cos,
}  # (a square root is a Pow in SymPy; `sp.sqrt`, a function, made `isinstance` raise for sin and cos)


def sympy_to_torch(expr: sp.Expr, values: dict[sp.Symbol, torch.Tensor | float]):
    """Evaluate a SymPy expression with tensors (a tiny interpreter; `values` maps symbols)."""
    if expr in values:
        return values[expr]
    if expr.is_Number or expr is sp.pi or expr is sp.E:
        return float(expr)
    if not expr.free_symbols:  # a constant (`integral(silu)(2)`, whose quadrature has its own variable): evalf
        value = expr.evalf()
        if value.is_real and value.is_finite:
            return float(value)
    if isinstance(expr, sp.Symbol):
        raise KeyError(f"no value for `{expr}`")
    args = [sympy_to_torch(a, values) for a in expr.args]
    if isinstance(expr, sp.Add):
        out = args[0]
        for a in args[1:]:
            out = out + a
        return out
    if isinstance(expr, sp.Mul):
        out = args[0]
        for a in args[1:]:
            out = out * a
        return out
    if isinstance(expr, sp.Pow):
        base, ex = args
        if isinstance(base, float) and isinstance(ex, float):
            return base**ex
        return base**ex if not isinstance(base, float) else torch.as_tensor(base) ** ex
    if isinstance(expr, sp.Max):
        return torch.clamp(args[1], min=args[0]) if isinstance(args[0], float) else torch.maximum(*args)
    if isinstance(expr, sp.Heaviside):
        return (args[0] > 0).to(args[0].dtype)
    for cls, fn in _SP_TORCH.items():
        if isinstance(expr, cls):
            a = args[0]
            return fn(a if isinstance(a, torch.Tensor) else torch.tensor(a, dtype=torch.float64))
    raise NotImplementedError(f"cannot evaluate {expr.func.__name__} with torch")


def scalar_value(name: str, value: sp.Expr) -> sp.Expr:
    """f(c) for a SymPy scalar c (constant folding through an element-wise function)."""
    fn = REGISTRY.get(name)
    if fn is None:
        raise KeyError(name)
    return fn.formula.subs(X, value)

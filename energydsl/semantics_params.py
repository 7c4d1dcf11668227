"""Semantics of `param` declarations: shape, initialiser, value, constraint, learned or fixed, each checked
where it is written (a mixin of `semantics._Lowering`, which holds the scope and evaluates constants)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sympy as sp

from . import ir
from . import syntax_tree as ast
from .errors import Span, SpecError
from .ir_nodes import Var
from .number_text import plain_number

if TYPE_CHECKING:
    from .semantics import _Scope


@dataclass
class ParamSpec:
    name: str
    shape: tuple[sp.Expr, ...]
    init: tuple[str, list[Any]] | None = None  # ("normal", [0, 0.02]) | ("value", Expr)
    constraint: tuple | None = None  # ("interval", lo, hi) | ("positive",) | ("psd",)
    learn: bool = True
    span: Span | None = None
    origin: str = "spec"  # spec | optimizer | precondition | untie



class ParamLowering:
    """`param` clauses; the scope, dims and constants are the subclass's (`semantics._Lowering`)."""

    scope: _Scope
    scalar_params: dict[str, sp.Symbol]

    _constant: Callable[..., float]  # a number from numbers and dims, or a located error
    _dims: Callable[[list[ast.Node], str], tuple[sp.Expr, ...]]  # a shape, checked
    _size: Callable[[sp.Expr], int]  # a size at this instance's dims

    def _param(self, c: ast.Clause) -> None:
        self.scope.declare(c.name, c.span, attribute=True)
        shape = self._dims(c.value, "a param")
        spec = ParamSpec(c.name, shape, span=c.span)
        given: dict[str, Span] = {}
        for opt in c.extra["options"]:
            kind = opt[0]
            role = {"init": "initial value", "value": "initial value", "interval": "constraint"}.get(kind) or (
                "`learn` or `fixed`" if opt[1] in ("learn", "fixed") else "constraint")
            if role in given:  # `learn fixed`, `= 1 = 2`, `positive psd`: which one was meant?
                raise SpecError(f"`{c.name}` has a second {role} (the first is at {given[role]})", opt[-1],
                                "a param takes at most one initialiser or value, one constraint, and `learn` or "
                                "`fixed`")
            given[role] = opt[-1]
            if kind == "init":
                name, args = opt[1], opt[2]
                if name not in ("normal", "uniform", "zeros", "ones", "orthogonal"):
                    raise SpecError(f"unknown initialiser `{name}`", opt[3],
                                    "use normal(mean, std), uniform(a, b), zeros(), ones() or orthogonal()")
                spec.init = (name, self._init_args(name, args, opt[3], shape))
            elif kind == "value":
                spec.init = ("value", opt[1])
            elif kind == "interval":
                lo, hi = self._constant(opt[1], "a bound"), self._constant(opt[2], "a bound")
                if lo >= hi:
                    raise SpecError(f"the interval ({plain_number(lo)}, {plain_number(hi)}) is empty: its lower "
                                    "bound must be below its upper bound", opt[3])
                for bound, node in ((lo, opt[1]), (hi, opt[2])):  # the module computes lo + (hi - lo) sigmoid(raw)
                    check_fits_float32(bound, "a bound of the interval", c.name, node.span)
                if hi - lo > FLOAT32_MAX:
                    raise SpecError(f"the interval ({plain_number(lo)}, {plain_number(hi)}) is wider than float32's "
                                    "range (at most about 3.4e38), in which a module's parameters are built", opt[3],
                                    "narrow it")
                spec.constraint = ("interval", lo, hi)
            elif kind == "flag":
                if opt[1] == "fixed":
                    spec.learn = False
                elif opt[1] == "learn":
                    spec.learn = True
                else:
                    spec.constraint = (opt[1],)
        if spec.init and spec.init[0] == "value":
            node = spec.init[1]
            if isinstance(node, ast.Call) and node.func == "alibi_slopes":
                self._check_alibi(c.name, node, shape)
                spec.init = ("alibi_slopes", [])
            else:  # numbers and dims (`= sqrt(dh)`), evaluated at this instance's dims
                spec.init = ("value", [self._constant(
                    node, "a param's initial value", "numbers and dims (`= sqrt(dh)`), or `= alibi_slopes(heads)`")])
                check_fits_float32(spec.init[1][0], "the initial value", c.name, node.span)
                self._check_in_constraint(spec, spec.init[1][0], node.span)
        elif spec.init and spec.init[0] == "ones":
            init_span = next(o[3] for o in c.extra["options"] if o[0] == "init")
            self._check_in_constraint(spec, 1.0, init_span, " (`ones()`)")
        if spec.constraint == ("psd",) and (len(shape) < 2 or self._size(shape[-1]) != self._size(shape[-2])):
            raise SpecError(f"`psd` needs a square matrix (or a stack of them), but `{c.name}` is "
                            f"{ir.fmt_shape(shape) if shape else 'a scalar'}", given["constraint"],
                            "declare it [n, n], e.g. `param S[d, d] ~ normal(0, 1) psd`")
        self.scope.params[c.name] = spec
        if not shape:
            sym = sp.Symbol(c.name, real=True)
            self.scalar_params[c.name] = sym
        else:
            self.scope.vars[c.name] = Var(c.name, "param", shape)

    def _check_alibi(self, name: str, call: ast.Call, shape: tuple) -> None:
        """`m[heads] = alibi_slopes(heads)`: one slope per entry of a vector, as many as the argument says."""
        if len(call.args) != 1:
            raise SpecError("`alibi_slopes` takes one argument, the number of slopes", call.span,
                            "write `= alibi_slopes(heads)`")
        if len(shape) != 1:
            raise SpecError(f"`alibi_slopes(n)` is a vector of n slopes, but `{name}` is "
                            f"{ir.fmt_shape(shape) if shape else 'a scalar'}", call.span,
                            f"declare `{name}[heads] = alibi_slopes(heads)`")
        n = self._constant(call.args[0], "the number of slopes")
        if n != self._size(shape[0]):
            raise SpecError(f"`alibi_slopes({plain_number(n)})` gives {plain_number(n)} slopes, but `{name}` has "
                            f"{self._size(shape[0])}", call.span, f"give it the size of `{name}`: "
                            f"`alibi_slopes({shape[0]})`")

    def _init_args(self, name: str, args: list[ast.Node], span: Span, shape: tuple) -> list[float]:
        """An initialiser's arguments, checked as its implementation (`instance.init_param`) needs them."""
        usage = {"normal": "normal(mean, std)", "uniform": "uniform(a, b)", "zeros": "zeros()", "ones": "ones()",
                 "orthogonal": "orthogonal()"}[name]
        arity = 2 if name in ("normal", "uniform") else 0
        if len(args) != arity:
            took = "no arguments" if arity == 0 else f"{arity} arguments"
            raise SpecError(f"`{name}` takes {took}, but {len(args)} {'is' if len(args) == 1 else 'are'} given",
                            span, f"write `~ {usage}`")
        values = [self._constant(a, "an initialiser argument") for a in args]
        for value, arg in zip(values, args, strict=True):
            check_fits_float32(value, f"`{name}`'s argument", None, arg.span)
        if name == "normal" and values[1] < 0:
            raise SpecError("the standard deviation of `normal(mean, std)` must be >= 0, not "
                            f"{plain_number(values[1])}", args[1].span)
        if name == "uniform" and values[0] >= values[1]:
            raise SpecError(f"`uniform(a, b)` needs a < b, not uniform({plain_number(values[0])}, "
                            f"{plain_number(values[1])})", span)
        if name == "orthogonal" and not shape:
            raise SpecError("`orthogonal()` initialises a vector or a matrix, not a scalar param", span,
                            "use `normal(mean, std)`, or `= value` for a scalar")
        return values

    @staticmethod
    def _check_in_constraint(spec: ParamSpec, value: float, span: Span, what: str = "") -> None:
        """An initial value that the energy sees must lie inside the param's constraint: it starts there."""
        if spec.constraint and spec.constraint[0] == "interval":
            lo, hi = spec.constraint[1], spec.constraint[2]
            if not lo < value < hi:
                raise SpecError(f"the initial value{what} {plain_number(value)} of `{spec.name}` is outside its "
                                f"interval ({plain_number(lo)}, {plain_number(hi)})", span,
                                "a constrained param can only take values strictly inside its interval")
        elif spec.constraint and spec.constraint[0] == "positive" and value <= 0:
            raise SpecError(f"the initial value{what} {plain_number(value)} of `{spec.name}` is not positive", span,
                            "a `positive` param can only take values > 0")


FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max: a module's parameters are built in float32


def check_fits_float32(value: float, what: str, name: str | None, span: Span) -> None:
    """A param's value (or an initialiser's argument) that float32 cannot hold: the module failed to build
    (`fill_(1e308)`: "value cannot be converted to type float without overflow") or drew infinities."""
    if abs(value) > FLOAT32_MAX:
        of = f" of `{name}`" if name else ""
        raise SpecError(f"{what}{of}, {plain_number(value)}, is beyond float32's range (at most about 3.4e38), in "
                        "which a module's parameters are built", span, "give a smaller number")

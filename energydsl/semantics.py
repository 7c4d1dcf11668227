"""Semantics: from the syntax tree of an `energy` declaration to its IR (`EnergyIR`).

Resolves names (dims, params, lets, locals, state, input, context, positions), checks every shape
and index, records the causal relation of the context, and inlines `local`/`let` definitions. Dims
stay symbolic (SymPy symbols); their values (defaults or `--set` overrides) are checked for
consistency here but are only used when something is evaluated.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import sympy as sp

from . import ir
from . import syntax_tree as ast
from .clause_calls import OPTIMIZER, PRECONDITIONER
from .composition import MAX_SIZE, SIZE_LIMIT_HINT, dim_override
from .errors import HoleError, Span, SpecError
from .ir_nodes import Expr, IndexInfo, Var
from .number_text import exact_number, plain_number
from .python_names import name_problem
from .semantics_expr import ExpressionLowering
from .semantics_params import ParamLowering, ParamSpec, check_fits_float32


@dataclass
class Hyper:
    """An optimizer hyper-parameter: a SymPy symbol with its initial value, learnable or fixed."""

    symbol: sp.Symbol
    value: sp.Expr
    learn: bool


@dataclass
class OptimizerSpec:
    kind: str = "gd"  # gd | momentum | nag | newton
    hyper: dict[str, Hyper] = field(default_factory=dict)
    steps: int = 1
    per_head: bool = False
    wrt: str | None = None
    precondition: str | None = None  # scalar | diag | dplr | psd | full | covariance
    precondition_options: dict[str, Any] = field(default_factory=dict)
    span: Span | None = None


@dataclass
class EnergyIR:
    """One optimisation stage, fully resolved. Later stages (derive, check, codegen) consume this."""

    name: str
    span: Span
    dim_symbols: dict[str, sp.Symbol]
    dim_values: dict[str, float]  # header dims, defaults or overrides
    derived_dims: dict[str, sp.Expr]
    state: Var
    via: tuple[Var, Expr, str] | None  # (u, N(x), norm name)
    input: Var | None
    context: Var | None
    indices: dict[str, IndexInfo]
    params: dict[str, ParamSpec]
    energy: Expr  # the global energy F, scalar, in terms of the state (or `u` when via)
    energy_name: str
    optimizer: OptimizerSpec
    untie_rules: list[tuple[Expr, Expr]] = field(default_factory=list)
    untie_span: Span | None = None  # the first `untie` clause, where errors about untying point
    untie_rule_spans: list[Span | None] = field(default_factory=list)  # each rule's pattern, as written
    energy_span: Span | None = None  # the clause defining the global energy, where derivative errors point
    expects: dict[str, tuple[Expr, Span]] = field(default_factory=dict)
    scalar_params: dict[str, sp.Symbol] = field(default_factory=dict)
    source: str = ""
    # the names the spec gives values: a `let` without indices and the `via` variable (its N(x)), by the lowered
    # expression; generated code calls these values by them where it can (`codegen.torch_module`)
    user_names: dict[Expr, str] = field(default_factory=dict, compare=False, repr=False)

    def dims(self) -> dict[str, float]:
        """All dim values (header and derived)."""
        out = dict(self.dim_values)
        subs = {self.dim_symbols[k]: v for k, v in self.dim_values.items()}
        for k, e in self.derived_dims.items():
            out[k] = float(e.subs(subs))
        return out

    def size(self, e: sp.Expr) -> int:
        subs = {self.dim_symbols[k]: v for k, v in self.dim_values.items()}
        return int(round(float(sp.sympify(e).subs(subs))))


# Words the expression grammar reads as its own (grammars/energy.lark, `atom`), with what they start
EXPRESSION_WORDS = {"int": "`int 2..6`, a search hole", "float": "`float 0..1`, a search hole",
                    "choice": "`choice{1, 2}`, a search hole", "integral": "`integral(gelu)(s)`"}


class _Scope:
    """Names visible inside one energy declaration."""

    def __init__(self) -> None:
        self.dims: dict[str, sp.Expr] = {}
        self.lets: dict[str, tuple[list[str], Expr]] = {}
        self.vars: dict[str, Var] = {}
        self.params: dict[str, ParamSpec] = {}
        self.decl_spans: dict[str, Span] = {}
        # names expressions read as positions: `i`, the token being updated, and the context's index
        self.positions: dict[str, str] = {"i": "the position of the token being updated"}

    def declare(self, name: str, span: Span, attribute: bool = False) -> None:
        """`attribute`: the name becomes one of the generated nn.Module's (a parameter's)."""
        if name in self.positions:  # `param i` silently replaced the position in abs(i - j)
            raise SpecError(f"`{name}` is {self.positions[name]}, so it cannot name something the energy declares",
                            span, f"rename it (`{name}{name}`, say)")
        if name in EXPRESSION_WORDS:  # the parser reads `int` in an expression as a hole, never as this name
            raise SpecError(f"`{name}` is a word of expressions ({EXPRESSION_WORDS[name]}), so it cannot name "
                            "something the energy uses", span, f"rename `{name}`")
        if (problem := name_problem(name, attribute)) is not None:
            raise SpecError(problem[0], span, problem[1])
        if name in self.decl_spans:
            raise SpecError(f"`{name}` is already defined (at {self.decl_spans[name]})", span)
        self.decl_spans[name] = span


def _sym(name: str) -> sp.Symbol:
    return sp.Symbol(name, positive=True)


def lower_energy(decl: ast.EnergyDecl, overrides: dict[str, float] | None = None,
                 holes: dict[str, Any] | None = None) -> EnergyIR:
    """Resolve one `energy` declaration. `overrides` sets header dims (from `--set` or keywords)."""
    return _Lowering(decl, overrides or {}, holes or {}).run()


class _Lowering(ExpressionLowering, ParamLowering):
    """The clauses of one declaration: dims, state, input, context, params, lets, optimizer, untie, expect."""

    def __init__(self, decl: ast.EnergyDecl, overrides: dict[str, float], holes: dict[str, Any]):
        self.decl = decl
        self.overrides = overrides
        self.holes = holes
        self.scope = _Scope()
        self.indices: dict[str, IndexInfo] = {}
        self.dim_symbols: dict[str, sp.Symbol] = {}
        self.dim_values: dict[str, float] = {}
        self.derived: dict[str, sp.Expr] = {}
        self.state: Var | None = None
        self.via: tuple[Var, Expr, str] | None = None
        self.input: Var | None = None
        self.context: Var | None = None
        self.scalar_params: dict[str, sp.Symbol] = {}
        self.untied: list[tuple[Expr, Span]] = []  # the untie rules' patterns so far, where each is written
        self.optimizer_names: dict[str, str] = {}  # what the optimizer adds, by name (`_check_optimizer_names`)

    # ------------------------------------------------------------------ driver
    def run(self) -> EnergyIR:
        d = self.decl
        header = [name for name, _ in d.header]
        if (problem := name_problem(d.name)) is not None:  # the generated module's class is named after it
            raise SpecError(problem[0], d.span, problem[1])
        for key in self.overrides:
            if key not in header:
                known = ", ".join(header) or "none"
                raise SpecError(f"`{key}` is not a dim of energy `{d.name}` (its dims: {known})", d.span)
        for name, node in d.header:  # in order, a set dim replacing its default: `hidden = 4 * d` follows d
            self.scope.declare(name, node.span)
            if name in self.overrides:
                self.dim_values[name] = dim_override(name, self.overrides[name], f"energy `{d.name}`", d.span)
            else:
                self.dim_values[name] = self._header_default(name, node, header)
            self.dim_symbols[name] = _sym(name)
            self.scope.dims[name] = self.dim_symbols[name]
        by_kind: dict[str, list[ast.Clause]] = {}
        for c in d.clauses:
            by_kind.setdefault(c.kind, []).append(c)
        for c in by_kind.get("dim", []):
            self._dim(c)
        for kind in ("state", "input", "context"):
            if len(by_kind.get(kind, [])) > 1:
                raise SpecError(f"an energy has at most one `{kind}`", by_kind[kind][1].span)
        if not by_kind.get("state"):
            raise SpecError(f"energy `{d.name}` has no `state`", d.span, "declare the variable the optimizer moves: "
                            "`state z[d]`")
        for c in by_kind.get("input", []):
            self._input(c)
        for c in by_kind.get("context", []):
            self._context(c)
        for c in by_kind.get("param", []):
            self._param(c)
        opt = self._optimizer(by_kind.get("optimizer", []))
        self._state(by_kind["state"][0], opt)
        for c in d.clauses:
            if c.kind in ("let", "local"):
                self._let(c)
        self._check_optimizer_names(opt)
        globals_ = by_kind.get("global", [])
        locals_ = by_kind.get("local", [])
        if len(globals_) > 1:
            raise SpecError("an energy has one `global`", globals_[1].span)
        if globals_:
            gclause = globals_[0]
            energy = self.expr(gclause.value)
            ename = gclause.name
        elif len(locals_) == 1 and not locals_[0].extra.get("indices"):
            gclause = locals_[0]
            energy = self.scope.lets[gclause.name][1]
            ename = gclause.name
        else:
            raise SpecError(f"energy `{d.name}` has no `global` energy", d.span,
                            "add `global F = ...` combining the local energies")
        if energy.shape:
            raise SpecError(f"the global energy must be a scalar, but it has shape {ir.fmt_shape(energy.shape)}",
                            gclause.span, "contract it with `.` or a reduction")
        if energy.free:
            idx = ", ".join(sorted(energy.free))
            raise SpecError(f"index {idx} is used outside a reduction in the global energy", gclause.span,
                            f"wrap it in sum[{idx}](...) or logsumexp[{idx}](...)")
        self._check_wrt(opt, by_kind.get("optimizer", []))
        self._check_seen_through_via(opt, energy, gclause)
        untie = [self._untie_rule(r) for c in by_kind.get("untie", []) for r in c.value]
        expects = {}
        for c in by_kind.get("expect", []):
            if c.name not in ast.EXPECT_NAMES:
                raise SpecError(f"`expect {c.name}`: expected `update`, `gradient` or `direction`", c.span)
            try:
                claim = self.expr(c.value)
            except SpecError as e:  # `eta` of `gd(eta = 0.5 learn)`: a symbol of the optimizer, not of the spec
                hyper = next((k for k in opt.hyper if e.message == f"undefined name `{k}`"), None)
                if hyper is None:
                    raise
                learned = "learned " if opt.hyper[hyper].learn else ""
                raise SpecError(f"an `expect` cannot name the optimizer's {learned}`{hyper}`: the claim is proven at "
                                f"its {'initial ' if learned else ''}value", e.span,
                                f"write its value, {plain_number(float(opt.hyper[hyper].value))}") from None
            if claim.free:  # a per-token vector: a context or head index must be reduced, as in the energy
                idx = ", ".join(sorted(claim.free))
                raise SpecError(f"index {idx} is used outside a reduction in `expect {c.name}`", c.value.span,
                                f"wrap it in sum[{idx}](...) or mean[{idx}](...)")
            wrt_via = self.via is not None and opt.wrt == self.via[0].name
            want = self.via[0].shape if c.name == "gradient" and wrt_via else self.state.shape
            if claim.shape and not ir.same_shape(claim.shape, want):  # a scalar stands for every entry
                raise SpecError(f"`expect {c.name}` has shape {ir.fmt_shape(claim.shape)}, but the {c.name} has "
                                f"shape {ir.fmt_shape(want)}", c.value.span,
                                f"the claim is the whole {c.name}, one entry per entry of "
                                f"`{self.via[0].name if c.name == 'gradient' and wrt_via else self.state.name}`")
            if c.name in expects:  # the last one would silently win: a false first claim never checked
                raise SpecError(f"a second `expect {c.name}`: an energy states each kind once", c.span,
                                f"the first is at {expects[c.name][1]}; keep the one you mean")
            expects[c.name] = (claim, c.span)
        self._check_dims_named_like_hypers(opt, energy)
        _refuse_a_reduction_inside_its_own_index(energy, gclause.span)
        return EnergyIR(
            name=d.name, span=d.span, dim_symbols=self.dim_symbols, dim_values=self.dim_values,
            derived_dims=self.derived, state=self.state, via=self.via, input=self.input, context=self.context,
            indices=self.indices, params=self.scope.params, energy=energy, energy_name=ename,
            optimizer=opt, untie_rules=untie,
            untie_span=by_kind["untie"][0].span if by_kind.get("untie") else None,
            untie_rule_spans=[span for _, span in self.untied], energy_span=gclause.span,
            expects=expects,
            scalar_params=self.scalar_params, source=d.source_text, user_names=self._user_names(by_kind),
        )

    # ------------------------------------------------------------------ clauses
    def _constant(self, node: ast.Node, what: str, hint: str | None = None) -> float:
        """A number built from numbers and dims, at this instance's dims."""
        try:
            e = self.expr(node)
        except SpecError as err:  # a name declared here but not a constant: said so, not "did you mean `d`"
            kinds = {c.name: c.kind for c in self.decl.clauses if getattr(c, "name", None)}
            name = next((n for n in kinds if err.message == f"undefined name `{n}`"), None)
            if name is None or kinds[name] == "dim":  # a body dim read too early: the caller says where it is
                raise
            kind = {"let": "a `let`", "local": "a `local`", "state": "the state", "input": "the input",
                    "context": "the context", "global": "the energy"}.get(kinds[name], f"a `{kinds[name]}`")
            raise SpecError(f"{what} must be a constant, of numbers and dims; `{name}` is {kind}", err.span,
                            f"write the number, or declare it as a dim (`dim {name} = ...` of numbers and dims)"
                            if kinds[name] == "let" else hint) from None
        if not isinstance(e, ir.Scalar) or e.value.free_symbols - set(self.dim_symbols.values()):
            names = [x.name for x in ir.nodes(e) if isinstance(x, Var)] if not isinstance(e, ir.Scalar) else \
                sorted(str(v) for v in e.value.free_symbols - set(self.dim_symbols.values()))
            kind = next(((n, k) for n in names if (k := self._kind_of(n))), None)
            if kind is not None:
                raise SpecError(f"{what} must be a constant, of numbers and dims; `{kind[0]}` is {kind[1]}",
                                node.span, f"a learned value is written {what[:-1]} = 0.5 learn`"
                                if kind[1] == "a param" and re.fullmatch(r"`\w+`", what) else hint)
            raise SpecError(f"{what} must be a number", node.span, hint)
        v = e.value.subs({self.dim_symbols[k]: val for k, val in self.dim_values.items()})
        try:
            out = float(v)
        except TypeError:
            raise SpecError(f"{what} must be a number", node.span, hint) from None
        except OverflowError:
            out = math.inf
        if not math.isfinite(out):  # `1e300 * 1e300`: finite to SymPy, not to a float
            raise SpecError(f"{what} is a number too large for a float", node.span)  # (not printed: 2^20000)
        return out

    def _header_default(self, name: str, node: ast.Node, header: list[str]) -> float:
        """A header dim's default, from the dims before it: one that reads a later dim says so (`did you mean
        `i`?` was the hint for `E(hidden = 4 * d, d = 8)`)."""
        try:
            return self._constant(node, f"the default of `{name}`")
        except SpecError as e:
            later = header[header.index(name) + 1:] + [c.name for c in self.decl.clauses if c.kind == "dim"]
            used = next((n for n in later if e.message == f"undefined name `{n}`"), None)
            if used is None:
                raise
            where, fix = (("later in the header", f"move `{used}` before `{name}`") if used in header else
                          ("in the body (`dim`)", f"declare `{used}` in the header, before `{name}`"))
            raise SpecError(e.message, e.span, f"`{used}` is declared {where}: a default may use only the header "
                            f"dims before it ({fix})") from None

    def _dim(self, c: ast.Clause) -> None:
        self.scope.declare(c.name, c.span)
        e = self.expr(c.value)
        if not isinstance(e, ir.Scalar):
            raise SpecError(f"dim `{c.name}` must be built from numbers and other dims", c.value.span)
        self.derived[c.name] = e.value
        self.scope.dims[c.name] = e.value
        self._check_size(e.value, c.value.span, f"dim `{c.name}`")

    def _check_size(self, e: sp.Expr, span: Span, what: str) -> None:
        subs = {self.dim_symbols[k]: v for k, v in self.dim_values.items()}
        value = sp.sympify(e).subs(subs)
        if value.free_symbols:
            raise SpecError(f"{what} is not a size", span)
        given = ", ".join(f"{k}={plain_number(x)}" for k, x in self.dim_values.items())
        if value.has(sp.zoo, sp.nan, sp.oo, -sp.oo) or not value.is_real:  # e.g. d / heads with heads = 0
            raise SpecError(f"{what} = {e} is not a size with {given}: it divides by zero or is not a real "
                            "number", span, "choose dims that divide evenly")
        v = float(value)
        if not math.isfinite(v) or v < 1 or abs(v - round(v)) > 1e-9:
            if sp.sympify(e).is_number:  # written as a number: no dims to choose
                raise SpecError(f"{what} is {plain_number(v)}, not a positive whole number", span,
                                "a size is a whole number of at least 1")
            named = f"{what} {e}" if isinstance(e, sp.Symbol) else f"{what} = {e}"  # `this size d`, not `= d`
            fractional = math.isfinite(v) and v > 0 and abs(v - round(v)) > 1e-9  # a negative one: not a division
            hint = (f"`{e}` is used as a size here: give it a whole number of at least 1" if isinstance(e, sp.Symbol)
                    else "choose dims that divide evenly" if fractional
                    else "a size is a whole number of at least 1: choose dims that make it one")
            raise SpecError(f"{named} = {plain_number(v)} is not a positive whole number (with {given})", span, hint)
        if round(v) > MAX_SIZE:  # `this size hidden = 1e+30`, `dim dh = d/heads = 5e+29`, `eye's size = 1e+18`
            shown = (f"{what} = {plain_number(v)}" if sp.sympify(e).is_number else
                     f"{what} {e} = {plain_number(v)}" if isinstance(e, sp.Symbol) else
                     f"{what} = {e} = {plain_number(v)}")
            raise SpecError(f"{shown} is too large (with {given})", span, SIZE_LIMIT_HINT)

    def _dims(self, nodes: list[ast.Node], what: str) -> tuple[sp.Expr, ...]:
        out = []
        for n in nodes:
            e = self.expr(n)
            if not isinstance(e, ir.Scalar):
                raise SpecError(f"a size in {what} must be built from numbers and dims", n.span)
            self._check_size(e.value, n.span, "this size")
            out.append(e.value)
        entries = math.prod(self._size(e) for e in out)
        if entries > MAX_SIZE:  # each axis fits, their product does not: [d, d] at d = 2**40
            first, last = nodes[0].span, nodes[-1].span
            end = last.end_column if last.line == first.line else None
            given = ", ".join(f"{k}={plain_number(x)}" for k, x in self.dim_values.items())
            raise SpecError(f"{what} of shape {ir.fmt_shape(tuple(out))} has {entries:.3g} entries (with {given})",
                            Span(first.file, first.line, first.column, first.source, end), SIZE_LIMIT_HINT)
        return tuple(out)

    def _size(self, e: sp.Expr) -> int:
        """A size (checked by `_check_size`) at this instance's dims."""
        return int(round(float(sp.sympify(e).subs({self.dim_symbols[k]: v for k, v in self.dim_values.items()}))))

    def _state(self, c: ast.Clause, opt: OptimizerSpec) -> None:
        self.scope.declare(c.name, c.span)
        shape = self._dims(c.value, "a state")
        if len(shape) > 2:
            raise SpecError("a state is a vector `x[d]` or a matrix `Z[dk, dv]`", c.span)
        self.state = Var(c.name, "state", shape)
        self.scope.vars[c.name] = self.state
        if "via" in c.extra:
            uname = c.extra["via"]
            self.scope.declare(uname, c.span)
            nexpr = self.expr(c.extra["via_expr"])
            if not ir.same_shape(nexpr.shape, shape):
                raise SpecError(f"`via {uname} = ...` must keep the state's shape {ir.fmt_shape(shape)}",
                                c.extra["via_expr"].span)
            fn = c.extra["via_expr"].func if isinstance(c.extra["via_expr"], ast.Call) else "custom"
            u = Var(uname, "leaf", shape)
            self.via = (u, nexpr, fn)
            self.scope.vars[uname] = u

    def _input(self, c: ast.Clause) -> None:
        self.scope.declare(c.name, c.span)
        self.input = Var(c.name, "input", self._dims(c.value, "an input"))
        self.scope.vars[c.name] = self.input

    def _context(self, c: ast.Clause) -> None:
        x = c.extra
        if x["lhs"] != x["index"] or x["rhs"] != "i":
            raise SpecError(f"the context relation must read `{x['index']} <= i` or `{x['index']} < i`", c.span,
                            "the token being updated is `i`; its context tokens are indexed by the context's index")
        shape = self._dims(c.value, "a context")
        if self.input is not None and self.input.name == c.name:
            # input h[d] and context h[j, d] may share a name: the token's own and the others, one stream
            if not ir.same_shape(shape, self.input.shape):
                raise SpecError(f"context `{c.name}` shares its name with the input, so both are the same tokens; "
                                f"their shapes differ: {ir.fmt_shape(shape)} here, "
                                f"{ir.fmt_shape(self.input.shape)} for the input", c.span,
                                "give both one shape, or rename one of them")
        else:
            self.scope.declare(c.name, c.span)
        idx = x["index"]
        if idx == "i" or idx in self.scope.decl_spans:  # `h[i, d] where i < i`; a dim or an input named j
            taken = ("the position of the token being updated" if idx == "i" else
                     f"already defined (at {self.scope.decl_spans[idx]})")
            raise SpecError(f"the context's index `{idx}` is {taken}", c.span,
                            "index the context by a name of its own: `h[j, d] where j <= i`")
        self.scope.positions[idx] = f"the context's index (at {c.span})"
        self.context = Var(c.name, "context", shape, idx)
        self.indices[idx] = IndexInfo(idx, context=c.name, strict=x["relation"] == "<")
        self.scope.vars.setdefault(c.name, self.context)

    def _user_names(self, by_kind: dict[str, list[ast.Clause]]) -> dict[Expr, str]:
        """The expression of each `let` without indices, and the `via` variable's N(x), by name: the first name
        of an expression given two."""
        named = [(c.name, self.scope.lets[c.name][1]) for c in by_kind.get("let", [])
                 if c.name in self.scope.lets and not self.scope.lets[c.name][0]]
        if self.via is not None:
            named.append((self.via[0].name, self.via[1]))
        out: dict[Expr, str] = {}
        for name, body in named:
            out.setdefault(body, name)
        return out

    def _let(self, c: ast.Clause) -> None:
        self.scope.declare(c.name, c.span)
        idx = list(c.extra.get("indices") or [])
        body = self.expr(c.value)
        extra = body.free - set(idx)
        if extra:
            raise SpecError(f"index {', '.join(sorted(extra))} is used in `{c.name}` but not declared in its "
                            f"brackets", c.value.span,
                            f"write `{c.kind} {c.name}[{', '.join(sorted(set(idx) | extra))}]"
                            " = ...` or reduce over it")
        self.scope.lets[c.name] = (idx, body)

    def _optimizer(self, clauses: list[ast.Clause]) -> OptimizerSpec:
        if len(clauses) > 1:
            raise SpecError("an energy has one `optimizer`", clauses[1].span)
        if not clauses:
            spec = OptimizerSpec(hyper={"eta": Hyper(_hyper_symbol("eta"), sp.Integer(1), False)})
            return spec
        c = clauses[0]
        call = c.value
        if isinstance(call, ast.OptHole):
            raise HoleError("`choice{...}` of optimizers belongs in a `search`", call.span)
        OPTIMIZER.check(call.name, call.span, [(k.name, k.span) for k in call.kwargs])
        spec = OptimizerSpec(kind=call.name, span=c.span)
        given = {k.name: k for k in call.kwargs}
        for name, default in sorted(OPTIMIZER.takes[call.name].items()):
            kw = given.get(name)
            value = sp.sympify(default) if kw is None else exact_number(self._constant(kw.value, f"`{name}`"))
            learn = kw is not None and kw.flag == "learn"
            if learn:  # a parameter of the module
                check_fits_float32(float(value), f"the learned `{name}`", None, kw.value.span)
            spec.hyper[name] = Hyper(_hyper_symbol(name), value, learn)
        damping = spec.hyper.get("damping")
        if damping is not None and damping.value.is_number and damping.value < 0:
            raise SpecError(f"`damping` must be at least 0, got {plain_number(float(damping.value))}",
                            given["damping"].value.span, "the λ of H + λI, added to make the Hessian positive-definite")
        if "taylor" in spec.hyper:
            t = spec.hyper["taylor"].value
            where = given["taylor"].span if "taylor" in given else c.span
            if spec.hyper["taylor"].learn:
                raise SpecError("`taylor` cannot be learned: it is the order of the Neumann series (taylor + 1 "
                                "terms), which fixes the shape of the derived update", where,
                                "drop `learn` from `taylor`")
            if not (t.is_integer and 0 <= int(t) <= 4):
                raise SpecError(f"`taylor` is the order of the Neumann series (taylor + 1 terms): a whole number "
                                f"0..4, got {plain_number(float(t))}", where)
            if t == 0 and damping is not None and "damping" in given and (damping.learn or damping.value != 0):
                warnings.warn(f"`damping` (at {given['damping'].span}) has no effect with `taylor = 0`: the series is "
                              "∇F alone, a gradient step; drop it, or take `taylor` of 1 or more", stacklevel=2)
        mods = c.extra
        if "steps" in mods:
            steps = self._constant(mods["steps"], "`steps`")
            if steps < 1 or steps != int(steps) or steps > 64:
                raise SpecError(f"`steps` must be a whole number from 1 to 64, got {plain_number(steps)}", c.span)
            spec.steps = int(steps)
        spec.per_head = bool(mods.get("per_head"))
        spec.wrt = mods.get("wrt")
        pre = mods.get("precondition")
        if pre is not None:
            if isinstance(pre, ast.OptHole):
                raise HoleError("`choice{...}` of preconditioners belongs in a `search`", pre.span)
            PRECONDITIONER.check(pre.name, pre.span, [(kw.name, kw.span) for kw in pre.kwargs])
            spec.precondition = pre.name
            for kw in pre.kwargs:
                value = self._constant(kw.value, f"`{kw.name}`")
                if kw.name == "rank" and kw.flag is not None:  # only a value (covariance's tau) is learned
                    raise SpecError(f"`rank` cannot be {'learned' if kw.flag == 'learn' else 'fixed'}: it is the "
                                    "width of the low-rank factor, a shape", kw.span, f"drop `{kw.flag}` from `rank`")
                if kw.name == "rank" and (value < 1 or value != int(value)):
                    raise SpecError(f"`rank` must be a positive whole number, not {plain_number(value)}", kw.value.span,
                                    "the number of columns of the low-rank factor: 1, 2, ...")
                if kw.flag != "fixed" and kw.name != "rank":  # learned: a parameter of the module
                    check_fits_float32(value, f"the learned `{kw.name}`", None, kw.value.span)
                spec.precondition_options[kw.name] = (value, kw.flag != "fixed")
            for key, default in PRECONDITIONER.takes[pre.name].items():
                spec.precondition_options.setdefault(key, (float(default), True))
            if pre.name == "covariance":
                if call.name == "newton":
                    raise SpecError("`precondition covariance` needs a first-order optimizer: it is seed 004's "
                                    "first-order stand-in for a Newton step, and on `newton` it would rewrite the "
                                    "softmax sums of the Hessian terms too, an update with no defined meaning",
                                    pre.span, "use gd, momentum or nag with covariance, or give newton another "
                                    "preconditioner (scalar, diag, psd, dplr, full)")
        return spec

    def _check_optimizer_names(self, opt: OptimizerSpec) -> None:
        """The optimizer adds names of its own (η, β, λ, a learned `opt_eta`, its preconditioner's parameters,
        momentum's `m_z`). A spec name equal to one would be merged with it, silently: refuse it where declared."""
        made = {h.symbol.name: f"the symbol of the optimizer's `{key}`" for key, h in opt.hyper.items()}
        made |= {f"opt_{key}": f"the optimizer's learned `{key}`" for key, h in opt.hyper.items() if h.learn}
        made |= {name: f"a parameter of `precondition {opt.precondition}`"
                 for name in PRECONDITIONER_PARAMS.get(opt.precondition, ())}
        if opt.kind in ("momentum", "nag"):
            made[f"m_{self.state.name}"] = "the momentum of the state"
        self.optimizer_names = made  # an untie rule's new parameter may not take one either (`_untie_rule`)
        for name, span in self.scope.decl_spans.items():
            # a let is inlined and a dim is a number at each instance (`gd(eta = eta)` sets η from a dim)
            if name in made and name not in self.scope.lets and name not in self.dim_symbols:
                raise SpecError(f"`{name}` is also {made[name]} here, and the two would be one symbol", span,
                                f"rename `{name}`")

    def _check_dims_named_like_hypers(self, opt: OptimizerSpec, energy: Expr) -> None:
        """A dim in the energy prints as its name, Greek where it has one: `eta` as η. Beside an optimizer whose
        η is another number (`gd(eta = 0.1)`, or a learned one that moves away) every equation would show two
        values under one name: refuse it where declared. `gd(eta = eta)`, η set from the dim, stays allowed."""
        used = {s for node in ir.nodes(energy) if isinstance(node, ir.Scalar) for s in node.value.free_symbols}
        for key, h in opt.hyper.items():
            name = h.symbol.name
            if self.dim_symbols.get(name) in used and (h.learn or float(h.value) != self.dim_values[name]):
                raise SpecError(f"the dim `{name}` is used in the energy, where it would print as the symbol of the "
                                f"optimizer's `{key}`, which is {'learned' if h.learn else 'another number'}",
                                self.scope.decl_spans[name], f"rename `{name}`")

    def _check_wrt(self, opt: OptimizerSpec, clauses: list[ast.Clause]) -> None:
        """`wrt` names the point the gradient is taken at: the state, or its `via` variable."""
        state, via = self.state.name, self.via[0].name if self.via else None
        if not opt.wrt or opt.wrt in (state, via):
            return
        span = clauses[0].extra.get("spans", {}).get("wrt", clauses[0].span) if clauses else opt.span
        allowed = f"the state `{state}`" + (f" or its `via` variable `{via}`" if via else "")
        what = self._kind_of(opt.wrt)
        found = f"`{opt.wrt}` is {what}" if what else "no variable of that name"
        hint = None if via else f"to take the gradient at a normalised point, declare `state {state}[...] via " \
            f"u = rmsnorm({state})` and write `wrt u`"
        raise SpecError(f"`wrt {opt.wrt}`: {found}; `wrt` must name {allowed}", span, hint)

    def _check_seen_through_via(self, opt: OptimizerSpec, energy: Expr, clause: ast.Clause) -> None:
        """Under `wrt u` the gradient is taken at u = N(x): an energy that reads x too has no gradient in u alone
        (x moves with u), and holding x fixed would derive a direction that is not F's."""
        if not (self.via and opt.wrt == self.via[0].name):
            return
        if any(isinstance(v, Var) and v.name == self.state.name for v in ir.nodes(energy)):
            u, x = self.via[0].name, self.state.name
            raise SpecError(f"under `wrt {u}` the energy must see the state only through `{u}`, but it reads "
                            f"`{x}` itself", clause.span,
                            f"write `{u}` where it reads `{x}`, or take the gradient at `{x}` (leave `wrt {u}` out)")

    def _kind_of(self, name: str) -> str | None:
        """What a declared name is, in words (for errors about a name used in the wrong place)."""
        if self.input is not None and self.input.name == name:
            return "the input" + (" (and the context)" if self.context is not None and self.context.name == name
                                  else "")
        if self.context is not None and self.context.name == name:
            return "the context"
        if name in self.scope.params:
            return "a param"
        if name in self.scope.lets:
            return "a `let` or `local`"
        if name in self.scope.dims:
            return "a dim"
        return None

    def _untie_rule(self, rule) -> tuple[Expr, Expr]:
        lhs_node, rhs_node, span = rule
        lhs = self.expr(lhs_node)
        token = next((x for x in ir.nodes(lhs) if isinstance(x, Var) and x.role != "param"), None)
        if token is not None:
            what = {"state": "the state", "leaf": "the `via` variable", "input": "the input",
                    "context": "the context"}.get(token.role, "a token's value")
            raise SpecError(f"an untie pattern is built from params only; `{token.name}` is {what}, which changes "
                            "from token to token and cannot become a parameter", lhs_node.span,
                            "untie a weight as it appears in the update, e.g. `untie value W1[k]^T -> Wo[k]`")
        if (first := next((at for seen, at in self.untied if seen == lhs), None)) is not None:
            raise SpecError(f"this pattern is untied twice (first at {first})", lhs_node.span,
                            "one rule per pattern: its place in the update gets one new parameter")
        self.untied.append((lhs, lhs_node.span))
        rhs_base = rhs_node
        idx: list[str] = []
        while isinstance(rhs_base, ast.Index):
            idx = list(rhs_base.indices) + idx
            rhs_base = rhs_base.base
        if not isinstance(rhs_base, ast.Name):
            raise SpecError("the right side of an untie rule is a new parameter, e.g. `Wo[k]`", rhs_node.span)
        name = rhs_base.name
        if (problem := name_problem(name, attribute=True)) is not None:
            raise SpecError(problem[0], rhs_node.span, problem[1])
        if name in self.scope.decl_spans:
            raise SpecError(f"`{name}` already exists (declared at {self.scope.decl_spans[name]}); untie introduces "
                            "a new parameter", rhs_node.span)
        if name in self.optimizer_names:  # `-> opt_eta[k]` had the optimizer's scalar stand for the new weights
            raise SpecError(f"`{name}` is also {self.optimizer_names[name]} here, and the two would be one symbol",
                            rhs_node.span, f"rename `{name}`")
        earlier = self.scope.params.get(name)  # another rule's new parameter (untie's names are not declarations)
        if earlier is not None and earlier.origin == "untie":
            raise SpecError(f"`{name}` is already the new parameter of an untie rule (at {earlier.span})",
                            rhs_node.span, "each rule introduces a parameter of its own: give this one another name")
        if len(set(idx)) < len(idx):  # `Wo[k, k]`: one index on two axes would be the diagonal of a weight
            raise SpecError(f"an untie rule's new parameter has one axis per index; `{rhs_base.name}` repeats one "
                            f"({', '.join(idx)})", rhs_node.span, "name each of its axes by another index")
        sizes = []
        for i in idx:
            info = self.indices.get(i)
            if info is None or info.size is None:
                raise SpecError(f"index `{i}` must range over a size (like heads) in an untie rule", rhs_node.span)
            sizes.append(info.size)
        shape = tuple(sizes) + lhs.shape
        self.scope.params[name] = ParamSpec(name, shape, ("normal", [0.0, 0.02]), span=span, origin="untie")
        rhs: Expr = Var(name, "param", shape)
        for i in idx:
            rhs = ir.Index(rhs, i)
        return lhs, rhs


# The parameters each preconditioner adds (optimizers._pre_params creates them).
PRECONDITIONER_PARAMS = {"scalar": ("P_s",), "diag": ("P_d",), "dplr": ("P_d", "P_U", "P_V"), "psd": ("P_d", "P_L"),
                         "full": ("P_M",), "covariance": ("P_tau",)}


def _hyper_symbol(name: str) -> sp.Symbol:
    return sp.Symbol({"eta": "eta", "beta": "beta", "damping": "lambda", "taylor": "taylor"}[name], real=True)


def _refuse_a_reduction_inside_its_own_index(energy: Expr, span: Span) -> None:
    """`logsumexp[j](z·h_j + 0.1 sum[j](z·h_j))`: the derivation takes the two j for one, and its gradient came
    out 1.1 m where it is m + 0.1 Σ_j h_j (`energy check` caught it). Refused until the calculus renames bound
    indices; `expect` claims, which are only evaluated, may nest them."""
    for outer in ir.nodes(energy):
        if isinstance(outer, ir.Reduce):
            inner = next((x for x in ir.nodes(outer.body) if isinstance(x, ir.Reduce) and x.index == outer.index),
                         None)
            if inner is not None:
                raise SpecError(f"the energy reduces over `{outer.index}` inside a reduction over `{outer.index}` "
                                f"({inner.op}[{outer.index}] within {outer.op}[{outer.index}], written so or through "
                                "a `let`): not supported yet", span)

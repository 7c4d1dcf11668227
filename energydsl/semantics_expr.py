"""Semantics of expressions: the syntax tree of an expression to the tensor IR, inside one energy's scope.

`ExpressionLowering` is the half of `semantics._Lowering` that lowers expressions. Names resolve against
what the clause half has declared (dims, scalar params, lets, the state and its `via`, the input, the
context and the indices); shapes and indices are checked by the IR's smart constructors, whose
`ShapeError`s become `SpecError`s located at the expression.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING

import sympy as sp

from . import ir
from . import syntax_tree as ast
from .errors import HoleError, SpecError
from .functions import antiderivative
from .ir_nodes import Expr, IndexInfo, ShapeError, Var
from .number_text import exact_number, plain_number

if TYPE_CHECKING:
    from collections.abc import Callable

    from .errors import Span
    from .semantics import _Scope

FUNCTIONS = {"exp", "log", "sqrt", "abs", "sign", "relu", "gelu", "silu", "sigmoid", "tanh", "softplus", "sin", "cos"}
SPECIAL = {"norm", "rmsnorm", "layernorm", "diag", "stopgrad", "outer", "huber", "mean", "sum", "eye", "decay", "rope"}
EPS = sp.Rational(1, 10**6)
ROPE_USAGE = "rope(v, i) or rope(v, j, base): a vector, a position (`i` or the context index) and a base"
_ROLE_WORDS = {"state": "the state", "leaf": "the `via` variable", "input": "the input"}  # what a rate may not read


class ExpressionLowering:
    """Expression lowering; the names in scope are the subclass's (`semantics._Lowering`)."""

    scope: _Scope
    indices: dict[str, IndexInfo]
    scalar_params: dict[str, sp.Symbol]
    dim_symbols: dict[str, sp.Symbol]
    dim_values: dict[str, float]
    input: Var | None
    context: Var | None
    via: tuple[Var, Expr, str] | None
    _check_size: Callable[[sp.Expr, Span, str], None]  # a positive whole number, not too large

    def expr(self, n: ast.Node) -> Expr:
        try:
            out = self._expr(n)
        except ShapeError as e:
            raise SpecError(str(e), n.span) from None
        # Checked where it first goes wrong: the innermost such node. A tensor's constants (the 1/0 of
        # `(z . z) / 0`, the 1/p of `norm(x, 0)`) are made at the node that builds it: its own factors
        # and exponent are enough, its children were checked when they were lowered.
        if isinstance(out, ir.Scalar):
            constants = [out.value]
        else:
            constants = [c.value for c in out.children if isinstance(c, ir.Scalar)]
            if isinstance(out, ir.Pow):
                constants.append(sp.sympify(out.exponent))
        for value in constants:
            if value.has(sp.zoo, sp.nan, sp.oo, -sp.oo):
                raise SpecError("this is not a finite number (a division by zero, or log(0)?)", n.span)
            if value.is_real is False:
                raise SpecError(f"this is not a real number: {value}", n.span,
                                "dims are positive; a square root or log of a negative value is complex")
            if value.is_number and value.is_real and not _fits_a_float(value):
                raise SpecError("number too large for a float", n.span,
                                f"numbers must be below {sys.float_info.max:.4g} in size")
        return out

    def _expr(self, n: ast.Node) -> Expr:
        match n:
            case ast.Num():
                # a short literal exactly as written (0.1 is 1/10; 1e-100 is not 0), a long one as a Float
                return ir.Scalar(exact_number(n.value) if n.value == int(n.value) or len(str(n.value)) < 8
                                 else sp.Float(n.value))
            case ast.Name():
                return self._name(n)
            case ast.Hole():
                raise HoleError("a search hole (choice/int/float) can only be filled by `energy search`", n.span)
            case ast.Neg():
                return ir.neg(self.expr(n.operand))
            case ast.Transpose():
                return ir.transpose(self.expr(n.operand))
            case ast.BinOp():
                return self._binop(n)
            case ast.Index():
                return self._index(n)
            case ast.Reduce():
                return self._reduce(n)
            case ast.Call():
                return self._call(n)
            case ast.Integral():
                if n.func not in FUNCTIONS:
                    raise SpecError(f"integral({n.func}): `{n.func}` is not an element-wise function", n.span)
                return ir.func(antiderivative(n.func), self.expr(n.arg))
        raise SpecError(f"unsupported expression {type(n).__name__}", n.span)

    def _name(self, n: ast.Name) -> Expr:
        name = n.name
        s = self.scope
        if name in s.dims:
            return ir.Scalar(s.dims[name])
        if name in self.scalar_params:
            return ir.Scalar(self.scalar_params[name])
        if name in s.lets:
            idx, body = s.lets[name]
            if idx:
                raise SpecError(f"`{name}` is indexed by {', '.join(idx)}: write `{name}[{', '.join(idx)}]`", n.span)
            return body
        if name == "i":
            return ir.Pos(None)
        if name in self.indices and self.indices[name].context is not None:
            return ir.Pos(name)
        if name in s.vars:
            v = s.vars[name]
            if v.role == "context" and (self.input is None or self.input.name != name):
                raise SpecError(f"context `{name}` must be indexed by its token index: `{name}[{v.index}]`", n.span)
            if v.role == "context":
                return self.input
            return v
        if self.via and name == self.via[0].name:
            return self.via[0]
        hint = None
        known = sorted(set(s.decl_spans) | {"i"})
        close = [k for k in known if _close(k, name)]
        if close:
            hint = f"did you mean `{close[0]}`?"
        raise SpecError(f"undefined name `{name}`", n.span, hint)

    def _binop(self, n: ast.BinOp) -> Expr:
        a, b = self.expr(n.left), self.expr(n.right)
        match n.op:
            case "+":
                return ir.add_broadcast(a, b)
            case "-":
                return ir.add_broadcast(a, ir.neg(b))
            case "*":
                return ir.mul(a, b)
            case "/":
                return ir.mul(a, ir.power(b, -1))
            case "@":
                return ir.matmul(a, b)
            case ".":
                return ir.dot(a, b)
            case "^":
                if b.shape:
                    raise SpecError("an exponent must be a scalar", n.right.span)
                if isinstance(b, ir.Scalar):
                    return ir.power(a, b.value)
                if a.shape:
                    raise SpecError("a tensor power needs a constant exponent", n.right.span)
                self._check_positive_base(n.left, a)
                log_a = ir.Scalar(sp.log(a.value)) if isinstance(a, ir.Scalar) else ir.func("log", a)
                return ir.func("exp", ir.mul(b, log_a))  # a^b = exp(b log a): a > 0
        raise SpecError(f"unknown operator {n.op}", n.span)

    def _check_positive_base(self, base: ast.Node, value: Expr) -> None:
        """A non-constant exponent is computed as a^b = exp(b log a), real only for a > 0: a number or a param
        that is not positive is refused here (`energy check` would only find NaN), naming the constraint."""
        if isinstance(value, ir.Scalar) and value.value.is_number and not value.value.is_positive:
            raise SpecError(f"the base of a power with a non-constant exponent must be positive, it is "
                            f"{plain_number(float(value.value))}", base.span, "a^b is computed as exp(b log a)")
        node = base.base if isinstance(base, ast.Index) else base
        param = self.scope.params.get(node.name) if isinstance(node, ast.Name) else None
        if param is None or param.constraint in (("positive",),) or (
                param.constraint and param.constraint[0] == "interval" and param.constraint[1] >= 0):
            return
        if not param.learn and param.init is not None and (
                param.init[0] in ("alibi_slopes", "ones") or param.init[0] == "value" and param.init[1][0] > 0
                or param.init[0] == "uniform" and param.init[1][0] > 0):
            return  # fixed positive numbers (a uniform(a, b) draw with a > 0 among them)
        what = "a learned param that nothing keeps positive" if param.learn else "a fixed param that is not positive"
        raise SpecError(f"the base of a power with a non-constant exponent must be positive, and `{node.name}` "
                        f"is {what}", base.span,
                        f"a^b is computed as exp(b log a): declare `param {node.name} in (0, 1)` (a decay per "
                        f"step) or `param {node.name} positive`")

    def _index(self, n: ast.Index) -> Expr:
        base = n.base
        if isinstance(base, ast.Name):
            name = base.name
            if name in self.scope.lets:
                idx, body = self.scope.lets[name]
                if len(idx) != len(n.indices):
                    takes = f"{len(idx)} {'index' if len(idx) == 1 else 'indices'}"
                    raise SpecError(f"`{name}` takes {takes}, got {len(n.indices)}", n.span)
                _refuse_an_index_twice(n)
                for old, new in zip(idx, n.indices):
                    self._rename_index(name, old, new, n.span)
                captured = _captured(body, dict(zip(idx, n.indices)))
                if captured is not None:
                    raise SpecError(f"`{name}[{', '.join(n.indices)}]` puts `{captured}` where `{name}` reduces over "
                                    f"an index `{captured}` of its own: the reduction would take it for its own",
                                    n.span, f"name the index `let {name}` reduces over something else")
                return _rename(body, dict(zip(idx, n.indices)))
            v = self.scope.vars.get(name)
            if v is not None and v.role == "context" or (self.context is not None and name == self.context.name):
                ctx = self.context
                if len(n.indices) != 1:
                    raise SpecError(f"context `{name}` takes one index", n.span)
                i = n.indices[0]
                if i != ctx.index:
                    raise SpecError(f"context `{name}` is indexed by `{ctx.index}`, not `{i}`", n.span,
                                    f"its relation is declared as `{ctx.index} <= i` or `{ctx.index} < i`")
                return ctx
        out = self.expr(base)
        moving = next((x for x in ir.nodes(out) if isinstance(x, Var) and x.role in ("state", "leaf")), None)
        if moving is not None:
            name = f"the state `{moving.name}`" if moving.role == "state" else f"the `via` variable `{moving.name}`"
            what = name if out is moving else f"a value of {name}"
            raise SpecError(f"cannot index {what} by `{n.indices[0]}`: indexing by a name takes the leading axis of a "
                            "param (or of a value of params and the frozen tokens)", n.span, _state_index_hint(out))
        if len(n.indices) <= len(out.shape):
            _refuse_an_index_twice(n)
        for i in n.indices:
            if not out.shape:
                raise SpecError("too many indices: this is a scalar", n.span)
            self._bind_index(i, out.shape[0], n.span, _token_index_message(i, self.context))
            out = ir.Index(out, i)
        return out

    def _bind_index(self, i: str, size: sp.Expr, span, token_message: str, hint: str | None = None) -> None:
        """`i` ranges over `size`: a new index is declared so, a known one must range over the same; a token
        index (`i`, the context's) cannot."""
        if i == "i" or (i in self.indices and self.indices[i].context is not None):
            raise SpecError(token_message, span, hint)
        info = self.indices.get(i)
        if info is None:
            self.indices[i] = IndexInfo(i, size=size)
        elif info.size is not None and sp.simplify(info.size - size) != 0:
            raise SpecError(f"index `{i}` ranges over {info.size} elsewhere but over {size} here", span)

    def _rename_index(self, name: str, old: str, new: str, span) -> None:
        """`E[h, j]` for `local E[k, j]`: `h` ranges over what `k` does (the context's index stays as it is)."""
        info = self.indices.get(old)
        if old == new or info is None:
            return
        if info.context is not None:
            raise SpecError(f"`{name}[…]` renames the token index `{old}` to `{new}`; token indices keep their names",
                            span, f"write `{old}` in that place")
        self._bind_index(new, info.size, span, f"`{new}` is a token index; `{name}[…]` uses it where `{old}` "
                         f"ranges over {info.size}", "name that index something else, e.g. `k`")

    def _reduce(self, n: ast.Reduce) -> Expr:
        body = self.expr(n.body)
        twice = next((i for i in n.indices if n.indices.count(i) > 1), None)
        if twice is not None:  # reduced once, the body no longer uses it: `sum[j, j]` would count |j| times
            raise SpecError(f"the index `{twice}` is written twice in {n.op}[{', '.join(n.indices)}]", n.span,
                            f"reduce over `{twice}` once")
        for i in reversed(n.indices):
            self._check_reduced_index(n, i, body)
        if n.op == "softmax":
            if body.shape:
                raise SpecError("softmax[...] takes a scalar score", n.span)
            if len(n.indices) > 1:  # nested softmaxes would be another function; the joint one needs its own node
                raise SpecError(f"softmax[{', '.join(n.indices)}] over several indices is not supported yet", n.span,
                                "the joint weights exp(s) / Σ exp(s) over every pair are not nested softmaxes; "
                                "a softmax takes one index (`softmax[j]` per head)")
            return ir.Softmax(n.indices[0], body)
        if n.op in ("logsumexp", "max") and body.shape:
            raise SpecError(f"{n.op}[{n.indices[-1]}] takes a scalar body", n.span)
        for i in reversed(n.indices):
            body = ir.reduce(n.op, i, body)
        return body

    def _check_reduced_index(self, n: ast.Reduce, i: str, body: Expr) -> None:
        if i not in self.indices:
            raise SpecError(f"unknown index `{i}` in {n.op}[{i}]", n.span,
                            "an index comes from a context (`context h[j, d]`) or from indexing a param (`W[k]`)")
        if i not in body.free:
            zero = ir.is_zero(body)  # `0 * E[k, j]`: simplified away with everything it used
            raise SpecError(f"{n.op}[{i}] over an expression that does not use `{i}`", n.span,
                            "the expression is 0 (a factor 0 removed every term), so it uses no index; drop "
                            "the sum" if zero else None)

    def _call(self, n: ast.Call) -> Expr:
        f, args = n.func, n.args
        if f in FUNCTIONS:
            if len(args) != 1:
                raise SpecError(f"{f}(x) takes one argument", n.span)
            return ir.func(f, self.expr(args[0]))
        if f not in SPECIAL:
            if f == "alibi_slopes":
                raise SpecError("alibi_slopes(heads) is an initialiser: `param m[heads] = alibi_slopes(heads)`", n.span)
            hint = f"known functions: {', '.join(sorted(FUNCTIONS | SPECIAL))}"
            raise SpecError(f"unknown function `{f}`", n.span, hint)
        if f == "rope":
            return self._rope(args, n.span)
        vals = [self.expr(a) for a in args]
        if f == "norm":
            if len(vals) == 1:
                return ir.func("sqrt", ir.dot(vals[0], vals[0]))
            if len(vals) == 2 and isinstance(vals[1], ir.Scalar):
                p = vals[1].value
                if p.is_number and not p > 0:
                    raise SpecError(f"norm(x, p) needs p > 0, got {plain_number(float(p))}", args[1].span,
                                    "p = 2 is the Euclidean norm, p = 1 the sum of absolute values")
                return ir.power(ir.sum_all(ir.power(ir.func("abs", vals[0]), p)), 1 / p)
            raise SpecError("norm(x) or norm(x, p) with a constant p", n.span)
        if f in ("rmsnorm", "layernorm"):
            if len(vals) != 1 or len(vals[0].shape) != 1:
                raise SpecError(f"{f}(x) takes one vector", n.span)
            x = vals[0]
            size = x.shape[0]
            if f == "layernorm":
                x = ir.add_broadcast(x, ir.neg(ir.mul(ir.Scalar(1 / size), ir.sum_all(x))))
            scale = ir.power(ir.add(ir.mul(ir.Scalar(1 / size), ir.dot(x, x)), ir.Scalar(EPS)), sp.Rational(-1, 2))
            return ir.mul(scale, x)
        if f == "diag":
            if len(vals) != 1 or len(vals[0].shape) != 1:
                raise SpecError("diag(v) takes one vector", n.span)
            return ir.Diag(vals[0])
        if f == "stopgrad":
            return ir.StopGrad(vals[0])
        if f == "outer":
            if len(vals) != 2:
                raise SpecError("outer(a, b) takes two vectors", n.span)
            return ir.outer(*vals)
        if f == "huber":
            if len(vals) != 2 or not isinstance(vals[1], ir.Scalar):
                raise SpecError("huber(r, delta) takes a value and a constant threshold", n.span)
            threshold = vals[1].value
            if threshold.is_number and not threshold > 0:
                raise SpecError(f"huber(r, delta) needs a threshold delta > 0, got {plain_number(float(threshold))}",
                                args[1].span, "the quadratic part is |r| <= delta, the linear part beyond")
            r, delta = ir.func("abs", vals[0]), vals[1]
            over = ir.func("relu", ir.add_broadcast(r, ir.neg(delta)))
            clipped = ir.add(r, ir.neg(over))
            return ir.add(ir.mul(ir.Scalar(sp.Rational(1, 2)), ir.power(clipped, 2)), ir.mul(delta, over))
        if f in ("mean", "sum"):
            if len(vals) != 1:
                raise SpecError(f"{f}(x) takes one tensor; to reduce over an index write {f}[j](...)", n.span)
            total = _sum_of(vals[0])
            if f == "mean":
                size = sp.Integer(1)
                for s in vals[0].shape:
                    size *= s
                total = ir.mul(ir.Scalar(1 / size), total)
            return total
        if f == "decay":
            return self._decay(vals, n.span)
        if f == "eye":
            if len(vals) != 1 or not isinstance(vals[0], ir.Scalar):
                raise SpecError("eye(n) takes a size", n.span)
            self._check_size(vals[0].value, n.args[0].span, "eye's size")  # -3, 2.5: as a param's size
            self._check_size(vals[0].value ** 2, n.args[0].span, "eye's number of entries")  # 1e18: n² overflows
            return ir.Identity(vals[0].value)
        raise SpecError(f"unknown function `{f}`", n.span)

    def _rope(self, args: list[ast.Node], span) -> Expr:
        """`rope(v, p)` or `rope(v, p, base)`: a vector of even width rotated by a position, `i` or a context index
        (`-i` or `-j`: rotated back), by a positive constant base."""
        if len(args) not in (2, 3):
            raise SpecError(f"{ROPE_USAGE} (10000 by default)", span)
        v = self.expr(args[0])
        name = args[1].name if isinstance(args[1], ast.Name) else None
        if name is not None and name != "i" and name not in self.scope.lets \
                and not (name in self.indices and self.indices[name].context is not None):  # said before lookup
            what = "the index" if name in self.indices or name not in self.scope.decl_spans else "the name"
            raise SpecError(f"rope's position must be `i` or the context index, not {what} `{name}`: {ROPE_USAGE}",
                            span)
        vals = [v, *(self.expr(a) for a in args[1:])]
        pos = vals[1]
        if len(v.shape) != 1:
            raise SpecError(f"rope rotates the feature pairs of a vector; this is {ir.fmt_shape(v.shape)}", span)
        width = self._number(v.shape[0])
        if width is not None and int(width) % 2:
            raise SpecError(f"rope pairs feature m with m + D/2, so the vector's width must be even; it is "
                            f"{int(width)}", span)
        sign = 1
        if isinstance(pos, ir.Mul) and len(pos.factors) == 2 and pos.factors[0] == ir.Scalar(sp.Integer(-1)):
            sign, pos = -1, pos.factors[1]  # rope(v, -i): the rotation back, as `energy derive` prints it
        if not isinstance(pos, ir.Pos):
            raise SpecError(f"rope's position must be `i` or the context index: {ROPE_USAGE}", span)
        base = self._number(vals[2].value) if len(vals) == 3 and isinstance(vals[2], ir.Scalar) else None
        if len(vals) == 3 and (base is None or not base > 0):
            raise SpecError("rope's base must be a positive constant (10000 in RoFormer and Llama)", span)
        return ir.Rope(v, pos, exact_number(base) if base is not None else sp.Integer(10000), sign)

    def _number(self, e: sp.Expr) -> float | None:
        """e's value with the dims filled in, or None if it is not a number (a learned scalar in it)."""
        value = sp.sympify(e).subs({self.dim_symbols[k]: x for k, x in self.dim_values.items()})
        return float(value) if value.is_number and value.is_real else None

    def _decay(self, vals: list[Expr], span) -> Expr:
        """`decay(r)`: r must be a scalar of one context token and params, positive by its form."""
        example = "decay(sigmoid(w . h[j]))"
        if len(vals) != 1 or vals[0].shape:
            raise SpecError(f"decay(r) takes one scalar, the rate of a context token: `{example}`", span)
        r = vals[0]
        for x in ir.nodes(r):  # what r must not read, named before what it lacks
            if isinstance(x, Var) and x.role not in ("context", "param") or isinstance(x, ir.Pos):
                what = f"{_ROLE_WORDS.get(x.role, 'the ' + x.role)} `{x.name}`" if isinstance(x, Var) else "a position"
                raise SpecError(f"decay(r): r reads {what}; a rate may read only its context token and params", span,
                                "γ_ij multiplies the rates of the tokens between j and i, each from its own token")
            if isinstance(x, ir.Reduce | ir.Softmax | ir.Decay) and self.indices[x.index].context is not None:
                raise SpecError("decay(r): r must be the rate of one token, not a sum or product over the context",
                                span)
        tokens = sorted(k for k in r.free if self.indices[k].context is not None)
        if len(tokens) != 1:
            read = f"reads {len(tokens)} context indices" if tokens else "reads no context token"
            raise SpecError(f"decay(r) multiplies r over the tokens after context token j up to i, but this r {read}",
                            span, f"write the rate of token j, e.g. `{example}`; a rate the same for every token "
                            "is a power: `a^(i - j)`")
        if ir.log_rate(r) is None:
            raise SpecError("decay(r) needs a rate that is positive by its form", span,
                            "write it as sigmoid(...) or exp(...) (products and powers of them too), e.g. "
                            f"`{example}` or `exp(-softplus(a . h[j]))`")
        return ir.Decay(tokens[0], r)


def _rename(e: Expr, mapping: dict[str, str]) -> Expr:
    """Rename free indices (a `local E[k, j]` used as `E[h, j]`)."""
    mapping = {k: v for k, v in mapping.items() if k != v}
    if not mapping:
        return e
    match e:
        case Var() if e.index in mapping:
            return Var(e.name, e.role, e.var_shape, mapping[e.index])
        case ir.Pos() if e.index in mapping:
            return ir.Pos(mapping[e.index])
        case ir.Index():
            return ir.Index(_rename(e.base, mapping), mapping.get(e.index, e.index))
        case ir.Reduce() if e.index in mapping:  # binds its index: the same name outside is another index
            inner = {k: v for k, v in mapping.items() if k != e.index}
            return ir.rebuild(e, [_rename(e.body, inner)])
        case ir.Softmax():  # keeps its index free: `a[m]` for `let a[k] = softmax[k](…)` is softmax over m
            return ir.Softmax(mapping.get(e.index, e.index), _rename(e.body, mapping))
    if not e.children:
        return e
    return ir.rebuild(e, [_rename(c, mapping) for c in e.children])


def _refuse_an_index_twice(n: ast.Index) -> None:
    """`B[m, m]`, a diagonal: no index in the IR runs over two axes at once (it loaded, then crashed when run)."""
    twice = next((i for k, i in enumerate(n.indices) if i in n.indices[:k]), None)
    if twice is not None:
        raise SpecError(f"the index `{twice}` is written twice in one indexing: each axis takes an index of its own",
                        n.span, "a diagonal entry has no indexed form here; write one index per axis")


def _captured(e: Expr, mapping: dict[str, str]) -> str | None:
    """The index a reduction in `e` binds that `_rename` would give an index it reads: `let s[k] = sum[m](W[k] …)`
    used as `s[m]` (the sum would run over W's index too, and change what the spec wrote). None if there is none."""
    mapping = {k: v for k, v in mapping.items() if k != v}
    if not mapping:
        return None
    if isinstance(e, ir.Reduce):  # a softmax keeps its index free: renamed with it, nothing to capture
        inner = {k: v for k, v in mapping.items() if k != e.index}
        if any(v == e.index and k in e.body.free for k, v in inner.items()):
            return e.index
        return _captured(e.body, inner)
    return next((c for c in (_captured(child, mapping) for child in e.children) if c is not None), None)


def _fits_a_float(value: sp.Expr) -> bool:
    """Whether a real constant is below the largest float (SymPy's numbers have no such bound)."""
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _close(a: str, b: str) -> bool:
    if abs(len(a) - len(b)) > 1 or a == b:
        return False
    return sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b)) <= 1 or sorted(a) == sorted(b)


def _state_index_hint(base: Expr) -> str:
    """How to write without the index what indexing the state was meant to say (the calculus has no rule for
    picking one entry of a value that the optimizer moves)."""
    if len(base.shape) == 1:
        return "write the sum over entries as a dot product, e.g. `z . z` for sum[k](z[k] * z[k]), or " \
               "`sum(x * z)` for sum[k](x[k] * z[k])"
    return "write it with whole tensors: `@`, `.`, `*`, `^T` and `sum(...)`"


def _token_index_message(i: str, context: Var | None) -> str:
    """Why a tensor cannot be indexed by a token index: `i` only appears in positions, the context's index
    only on the context."""
    if i == "i":
        return ("`i` is the token being updated: it appears in position terms such as `abs(i - j)`, but no "
                "tensor is indexed by it")
    return f"`{i}` is the context's token index: only the context `{context.name}` is indexed by it" \
        if context is not None else f"`{i}` is a token index"


def _sum_of(x: ir.Expr) -> ir.Expr:
    """`sum(x)`, where `sum(a * b)` of two tensors of one shape is `a . b`: the same number, and the form the
    lowering recognises (a context sum over `sum(z * (W @ h[j]))` is attention then, not T × T weights)."""
    if isinstance(x, ir.Mul):
        tensors = [f for f in x.factors if f.shape]
        if len(tensors) == 2 and ir.same_shape(tensors[0].shape, tensors[1].shape):
            return ir.mul(*(f for f in x.factors if not f.shape), ir.dot(*tensors))
    return ir.sum_all(x)

"""An explicit SymPy instance of an energy: every tensor written out element by element.

`energy check` differentiates this scalar expression with plain `sympy.diff` (no matrix calculus,
so none of SymPy's matrix-trace bugs) and compares with the derived gradient at the same point.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable

import sympy as sp

from . import ir
from .functions import REGISTRY, X
from .number_text import exact_number
from .optimizers import UpdateProgram


def _rand(rng: random.Random) -> sp.Rational:
    return sp.Rational(rng.randint(-9, 9), 10)


def _in_constraint(rng: random.Random, constraint: tuple | None) -> sp.Rational | None:
    """A value inside a `positive` or `in (lo, hi)` constraint (None: unconstrained), so that an energy's
    log(a) or sqrt(a) is real on the check's instance as it is in the module."""
    if constraint is None or constraint[0] not in ("positive", "interval"):
        return None
    t = sp.Rational(rng.randint(2, 8), 10)
    if constraint[0] == "positive":
        return t
    lo, hi = (exact_number(b) for b in constraint[1:])
    return lo + (hi - lo) * t


def _psd(rng: random.Random, n: int) -> sp.Matrix:
    """L Lᵀ + I/10: symmetric positive definite, like the module's parametrisation of a `psd` param."""
    lower = sp.Matrix(n, n, lambda a, b: _rand(rng) if a >= b else 0)
    return lower * lower.T + sp.eye(n) / 10


def _param_value(rng: random.Random, shape: tuple[int, ...], constraint: tuple | None) -> object:
    if constraint is not None and constraint[0] == "psd":
        if len(shape) == 2:
            return _psd(rng, shape[0])
        return [_param_value(rng, shape[1:], constraint) for _ in range(shape[0])]
    if constraint is None or constraint[0] not in ("positive", "interval"):
        return _tensor(shape, lambda _i: _rand(rng))
    return _tensor(shape, lambda _i: _in_constraint(rng, constraint))


def _fixed_draw(rng: random.Random, p) -> Callable[[], sp.Expr] | None:
    """Entries as a `fixed` param's initialiser makes them (it keeps them, as in the module): `zeros() fixed` is
    0 and `uniform(0.5, 0.9) fixed` inside its range, where a free draw made log(a) complex. None for a learned
    param, a constrained one (`_in_constraint` draws inside it), and the other initialisers (drawn freely)."""
    if p.learn or not p.init or p.constraint is not None:
        return None
    kind, args = p.init
    if kind == "zeros":
        return lambda: sp.Integer(0)
    if kind == "ones":
        return lambda: sp.Integer(1)
    if kind == "value" and args and isinstance(args[0], float | int):
        return lambda: exact_number(args[0])
    if kind == "uniform":
        lo, hi = (exact_number(a) for a in args)
        return lambda: lo + (hi - lo) * sp.Rational(rng.randint(1, 9), 10)
    if kind == "normal":
        mean, std = (exact_number(a) for a in args)
        return lambda: mean + std * _rand(rng)
    return None


def _shape(prog: UpdateProgram, shape) -> tuple[int, ...]:
    return tuple(prog.spec.size(s) for s in shape)


def _tensor(shape: tuple[int, ...], make) -> object:
    if not shape:
        return make(())
    if len(shape) == 1:
        return sp.Matrix(shape[0], 1, lambda a, _: make((a,)))
    if len(shape) == 2:
        return sp.Matrix(shape[0], shape[1], lambda a, b: make((a, b)))
    return [_tensor(shape[1:], lambda rest, i=i: make((i,) + rest)) for i in range(shape[0])]


def instance_size(prog: UpdateProgram, seq: int) -> int:
    """How many numbers `build` makes into SymPy entries: the parameters, the state and `seq` context tokens."""
    spec = prog.spec
    shapes = [p.shape for p in prog.params.values() if p.shape] + [prog.point.shape]
    shapes += [spec.context.shape] * seq if spec.context is not None else []
    shapes += [spec.input.shape] if spec.input is not None else []
    return sum(math.prod(_shape(prog, s)) for s in shapes)


def state_symbols(prog: UpdateProgram) -> object:
    """The point's entries as real symbols `z_0, z_1, ...`: one Symbol, or a Matrix of them."""
    point = prog.point
    return _tensor(_shape(prog, point.shape),
                   lambda i: sp.Symbol(f"{point.name}_{'_'.join(map(str, i))}", real=True))


def build(prog: UpdateProgram, seed: int, seq: int, position: int,
          state: Callable[[sp.Symbol], sp.Expr] | None = None):
    """Return (F as a SymPy scalar in the state symbols, state symbols, numeric values, tensors).

    `state` maps each state symbol to the expression that stands in its place in F (default: the
    symbol itself, e.g. p + t·w for `gradient_at`); the values drawn from `seed` do not depend on it.
    """
    spec = prog.spec
    rng = random.Random(seed)
    values: dict[str, object] = {}
    scal: dict[sp.Symbol, sp.Expr] = {spec.dim_symbols[k]: exact_number(v) for k, v in spec.dim_values.items()}
    scal.update({s: v for s, v in prog.hyper_values.items()})
    for name, p in prog.params.items():
        fixed = _fixed_draw(rng, p)
        if not p.shape:
            sym = spec.scalar_params.get(name)
            if sym is not None:
                inside = _in_constraint(rng, p.constraint)
                scal[sym] = fixed() if fixed else inside if inside is not None else _rand(rng) + 1
            continue
        values[name] = _tensor(_shape(prog, p.shape), lambda _i, f=fixed: f()) if fixed else \
            _param_value(rng, _shape(prog, p.shape), p.constraint)
    point = prog.point
    syms = state_symbols(prog)
    values[point.name] = syms if state is None else _map_state(syms, state)
    if spec.context is not None:
        values[spec.context.name + "@ctx"] = [_tensor(_shape(prog, spec.context.shape), lambda _i: _rand(rng))
                                             for _ in range(seq)]
    if spec.input is not None and (spec.context is None or spec.input.name != spec.context.name):
        values[spec.input.name] = _tensor(_shape(prog, spec.input.shape), lambda _i: _rand(rng))
    elif spec.input is not None:
        values[spec.input.name] = values[spec.context.name + "@ctx"][position]
    energy = spec.energy
    if spec.via is not None and point is spec.state:
        from .calculus import substitute_var

        energy = substitute_var(energy, spec.via[0].name, spec.via[0].role, spec.via[1])
    f = evaluate(energy, prog, values, scal, {}, position, seq)
    if state is not None:
        values[point.name] = syms  # as without `state`: the returned tensors hold the state symbols
    return f, syms, scal, values


def _map_state(syms: object, state: Callable[[sp.Symbol], sp.Expr]) -> object:
    """The state tensor (a symbol or a Matrix of symbols) with every entry replaced by `state(entry)`."""
    if isinstance(syms, sp.Matrix):
        return syms.applyfunc(state)
    return state(syms)


def evaluate(e: ir.Expr, prog: UpdateProgram, values, scal, bind: dict[str, int], i: int, seq: int):
    """Evaluate an IR expression to SymPy objects at token position i with index bindings."""
    spec = prog.spec
    ev = lambda x: evaluate(x, prog, values, scal, bind, i, seq)  # noqa: E731
    match e:
        case ir.Scalar():
            return e.value.xreplace(scal)
        case ir.Var():
            if e.role == "context":
                return values[e.name + "@ctx"][bind[e.index]]
            return values[e.name]
        case ir.Index():
            base = ev(e.base)
            k = bind[e.index]
            if isinstance(base, list):
                return base[k]
            if isinstance(base, sp.Matrix) and base.shape[1] == 1:
                return base[k]
            return base.row(k).T
        case ir.Pos():
            return sp.Integer(i if e.index is None else bind[e.index])
        case ir.Ones():
            shp = _shape(prog, e.shape)
            return sp.ones(shp[0], shp[1] if len(shp) > 1 else 1)
        case ir.Identity():
            return sp.eye(prog.spec.size(e.size))
        case ir.Count():
            info = spec.indices[e.index]
            if info.size is not None:
                return info.size.xreplace(scal)
            n = i if info.strict else i + 1
            return sp.Integer(max(n, 1) if e.at_least_one else n)
        case ir.Add():
            out = ev(e.terms[0])
            for t in e.terms[1:]:
                out = out + ev(t)
            return out
        case ir.Mul():
            vals = [ev(f) for f in e.factors]
            out = vals[0]
            for v in vals[1:]:
                if isinstance(out, sp.Matrix) and isinstance(v, sp.Matrix):
                    out = out.multiply_elementwise(v)
                else:
                    out = out * v
            return out
        case ir.Pow():
            b = ev(e.base)
            ex = e.exponent.xreplace(scal)
            return b.applyfunc(lambda a: a**ex) if isinstance(b, sp.Matrix) else b**ex
        case ir.MatMul():
            if len(e.a.shape) == 1:  # vector @ matrix: (aᵀ M)ᵀ, kept as a column
                return (ev(e.a).T * ev(e.b)).T
            return ev(e.a) * ev(e.b)
        case ir.Dot():
            a, b = ev(e.a), ev(e.b)
            return sum(a.multiply_elementwise(b)) if isinstance(a, sp.Matrix) else a * b
        case ir.Outer():
            return ev(e.a) * ev(e.b).T
        case ir.Transpose():
            return ev(e.a).T
        case ir.Func():
            fn = REGISTRY[e.name]
            a = ev(e.arg)
            f = lambda t: fn.formula.subs(X, t)  # noqa: E731
            return a.applyfunc(f) if isinstance(a, sp.Matrix) else f(a)
        case ir.SumAll():
            return sum(ev(e.a))
        case ir.StopGrad() | ir.Let():
            return ev(e.a if isinstance(e, ir.StopGrad) else e.body)
        case ir.Diag():
            return sp.diag(*ev(e.a))
        case ir.Inverse():
            return ev(e.a).inv()
        case ir.Reduce() | ir.Softmax() | ir.ProdOthers():
            info = spec.indices[e.index]
            if info.context is not None:
                rng_ = range(i) if info.strict else range(i + 1)
            else:
                rng_ = range(prog.spec.size(info.size))
            terms = [evaluate(e.body, prog, values, scal, {**bind, e.index: j}, i, seq) for j in rng_]
            if isinstance(e, ir.Softmax):
                exps = [sp.exp(t) for t in terms]
                return exps[bind[e.index]] / sum(exps)
            if isinstance(e, ir.ProdOthers):
                return _product([t for m, t in zip(rng_, terms, strict=True) if m != bind[e.index]])
            if e.op == "sum":
                return sum(terms[1:], terms[0]) if terms else sp.Integer(0)
            if e.op == "mean":  # an empty context gives 0 (the count is clamped to 1)
                return sum(terms[1:], terms[0]) / len(terms) if terms else sp.Integer(0)
            if e.op == "logsumexp":
                return sp.log(sum(sp.exp(t) for t in terms)) if terms else sp.Integer(0)
            if e.op == "prod":
                return _product(terms)
            if e.op == "max":
                return sp.Max(*terms) if terms else sp.Integer(0)  # an empty context: 0, as the evaluator's
        case ir.Rope():  # feature m and m + D/2 turned by p θ_m, θ_m = base^(-2m/D)
            a, p = ev(e.a), ev(e.pos)
            width = a.shape[0]
            half = width // 2
            out = list(a)
            for m in range(half):
                angle = e.sign * p * sp.sympify(e.base) ** sp.Rational(-2 * m, width)
                c, s_ = sp.cos(angle), sp.sin(angle)
                out[m], out[m + half] = a[m] * c - a[m + half] * s_, a[m + half] * c + a[m] * s_
            return sp.Matrix(out)
        case ir.Decay():  # ∏ r_s over the context tokens after j: j < s ≤ i, or s < i when strict
            j, last = bind[e.index], i - 1 if spec.indices[e.index].strict else i
            return _product([evaluate(e.body, prog, values, scal, {**bind, e.index: s}, i, seq)
                             for s in range(j + 1, last + 1)])
    raise NotImplementedError(type(e).__name__)


def _product(terms: list) -> sp.Expr | sp.Matrix:
    """The element-wise product of scalars or of matrices of one shape (`sp.Mul` would multiply matrices)."""
    if terms and isinstance(terms[0], sp.MatrixBase):
        return functools.reduce(lambda a, b: a.multiply_elementwise(b), terms)
    return sp.Mul(*terms)


@functools.cache
def _generic_offsets(n: int) -> tuple[sp.Rational, ...]:
    """1/p for the first n primes above 1000. Every other value of the instance lies on the grid k/10, so a
    point shifted by these never meets it exactly: no `z_k - h_k` (nor a small integer combination of the
    entries against the grid) is 0, and no relu, sign or abs is differentiated at its kink, where SymPy's
    convention (Heaviside(0) = 1/2) and torch's (relu'(0) = 0) differ."""
    primes = [sp.nextprime(1000)]
    while len(primes) < n:
        primes.append(sp.nextprime(primes[-1]))
    return tuple(sp.Rational(1, q) for q in primes[:n])


class NotReal(ArithmeticError):
    """The explicit instance's gradient is complex at the sampled state."""


def gradient_at(prog: UpdateProgram, seed: int = 0, seq: int = 3) -> tuple[list[float], dict]:
    """∂F/∂state by `sympy.diff` at the last position of a small explicit instance.

    One `sympy.diff` gives every partial: on the line z = p + t·w through the point p, with a symbolic
    direction w, d/dt F(p + t·w) at t = 0 equals Σ_k ∂F/∂z_k(p)·w_k, so ∂F/∂z_k(p) is that derivative
    at w = e_k, exact and evaluated as before (bitwise the same partials on every example). One diff
    per state element instead rebuilt every node of the instance d times, and SymPy's assumption
    queries on new nodes made that d times as slow (≈9 s in a fresh process for the 8 × 32 GELU MLP
    of examples/models/gpt.energy; ≈1.5 s this way).
    """
    position = seq - 1
    syms = state_symbols(prog)
    flat = list(syms) if isinstance(syms, sp.Matrix) else [syms]
    rng = random.Random(seed + 1)
    point = {s: _rand(rng) + offset for s, offset in zip(flat, _generic_offsets(len(flat)), strict=True)}
    # named (not Dummy) so that a repeated check finds SymPy's cache; F has no other free symbols
    t = sp.Symbol("_line_t", real=True)
    w = {s: sp.Symbol(f"_line_w_{s.name}", real=True) for s in flat}
    f, _, scal, values = build(prog, seed, seq, position, state=lambda s: point[s] + t * w[s])
    slope = sp.diff(f, t).xreplace({t: sp.Integer(0)})  # Σ_k ∂F/∂z_k(p) w_k
    partials = [slope.xreplace({w[o]: sp.Integer(1 if o is s else 0) for o in flat}).evalf() for s in flat]
    for s, v in zip(flat, partials, strict=True):
        if sp.im(v).is_nonzero:  # NaN and zoo are left to the comparison (not finite)
            raise NotReal(f"sympy.diff's ∂F/∂{s} is {sp.N(v, 4)} at the sampled state, not a real number: a log, a "
                          "root or a non-integer power of a negative value (the energy is real only where that "
                          "value is positive)")
    grads = [float("inf") if v.has(sp.zoo) else float(v) for v in partials]  # 1/0 is zoo, which float() refuses
    return grads, {"point": point, "values": values, "scalars": scal, "position": position}

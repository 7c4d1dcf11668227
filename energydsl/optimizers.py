"""Optimizers: from an energy's gradient to the update program a layer runs.

The program is a list of assignments executed once per optimizer step (`steps T`), after the
state-independent values (keys, values, gates) have been hoisted out and computed once. Every later
stage (checks, printers, code generation) reads this program.

    gd        x ← x − η D(x)
    momentum  m ← β m + D(x);   x ← x − η m
    nag       x̃ = x − β m;  m ← β m + D(x̃);  x ← x − η m
    newton    D = Σ_{m≤k} (I − (H + λI))^m ∇F   (truncated Neumann series; per head in the head's
              own coordinates q = A_k x, mapped back with A_kᵀ(A_k A_kᵀ)⁻¹, as seed 004's MHA2nd1st)

where D is the (preconditioned) gradient ∇F, taken at u = N(x) and applied to x under `wrt u`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from functools import lru_cache

import sympy as sp

from . import ir
from .calculus import NotDifferentiable, absorb_constants, directional, gradient, substitute_var, untie
from .composition import MAX_SIZE, SIZE_LIMIT_HINT
from .errors import SpecError
from .ir_nodes import Expr, Let, Var
from .printing import show
from .semantics import EnergyIR, ParamSpec

SOFTPLUS_ONE = math.log(math.e - 1)  # softplus(SOFTPLUS_ONE) = 1: preconditioners start at the identity


@dataclass
class Assign:
    target: Var
    value: Expr


@dataclass
class UpdateProgram:
    spec: EnergyIR
    point: Var  # the variable the gradient is taken at (the state, or `u` under `wrt u`)
    gradient: Expr  # ∇F in terms of `point`
    direction: Expr  # the per-step direction D(x), in terms of the state (u := N(x) substituted)
    assigns: list[Assign]  # one optimizer step: the layer the module runs (untied when `untie` is given)
    aux: list[Var]  # optimizer state carried between steps (momentum), zero at the start
    hoisted: list[Let]
    preconditioner: Expr | None = None  # P as a matrix (or scalar), for the positive-definiteness check
    head_index: str | None = None
    tied_direction: Expr | None = None  # before `untie`
    untie_hits: int = 0
    params: dict[str, ParamSpec] = field(default_factory=dict)  # spec params + optimizer/preconditioner params
    hyper_values: dict[sp.Symbol, sp.Expr] = field(default_factory=dict)
    tied_assigns: list[Assign] = field(default_factory=list)  # the energy's own update (checks prove this)
    # untie: the new params whose value × this reproduces the tied update (they absorbed a constant factor)
    untie_scales: dict[str, sp.Expr] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return self.spec.optimizer.steps


def head_split(f: Expr, point: Var) -> tuple[Expr, str, Expr] | None:
    """Write F = Σ_k F_k (returns (1, k, F_k)) or F = mean_k F_k (returns (1/|k|, k, F_k)).

    The per-head energy F_k keeps every factor of the summand, so Newton per head runs on the head's own
    energy: seed 004's F = (1/H) Σ_h F_h is written `mean[k](F_k)`. A factor the simplifier took out of the
    sum goes back into each F_k when it does not read the point the optimizer moves (a constant, a learned
    scalar, a per-token step size of the input, `sigmoid(w . x)`); one that reads it is not a head's own.
    """
    factors = f.factors if isinstance(f, ir.Mul) else (f,)
    sums = [x for x in factors if isinstance(x, ir.Reduce) and x.op in ("sum", "mean")]
    if len(sums) > 1:  # the heads' sum reads the point; another (`sum[j](sigmoid(w . h[j]))`) is a step size
        sums = [x for x in sums if _reads(x, point)]
    if len(sums) != 1:
        return None
    (head_sum,) = sums
    rest = [x for x in factors if x is not head_sum]
    if any(head_sum.index in x.free or _reads(x, point) for x in rest):
        return None
    outer = ir.ONE if head_sum.op == "sum" else ir.power(ir.Count(head_sum.index), -1)
    return outer, head_sum.index, ir.mul(*rest, head_sum.body)


def _reads(e: Expr, v: Var) -> bool:
    return any(isinstance(x, Var) and x.name == v.name and x.role == v.role for x in ir.nodes(e))


def _not_a_head_sum(f: Expr, point: Var) -> str | None:
    """Why an energy is not a sum over heads: a term beside the sum (`mean[k](...) + c (z . z)`), or a factor
    that reads the state but not the head, taken out of the sum (sum[k](G_k * H(z)) is (sum[k] G_k) * H(z))."""
    def head_sum(e: Expr) -> bool:
        parts = e.factors if isinstance(e, ir.Mul) else (e,)
        return any(isinstance(x, ir.Reduce) and x.op in ("sum", "mean") for x in parts)

    if isinstance(f, ir.Add) and all(head_sum(t) for t in f.terms):
        return (f"this energy reads F = {show(f)}: `per head` splits one sum over heads into the heads' own "
                "energies; write these sums as one, sum[k](A_k + B_k) (a mean[k] is sum[k] / heads)")
    if isinstance(f, ir.Add) and any(head_sum(t) for t in f.terms):
        return (f"this energy reads F = {show(f)}: `per head` splits one sum over heads into the heads' own "
                "energies, and a term beside the sum belongs to no head; move it inside the sum "
                "(sum[k](... + c / heads) or mean[k](... + c)), or drop `per head`")
    if not isinstance(f, ir.Mul) or not head_sum(f):
        return None
    return (f"this energy reads F = {show(f)}: a factor that reads `{point.name}` but not the head is taken out "
            "of the sum over heads, and a head's own energy would hold the others' terms through it")


def build_program(spec: EnergyIR) -> UpdateProgram:
    """The update program of an energy: its optimizer's steps on the derived gradient (or Newton direction)."""
    try:
        return _build_program(spec)
    except NotDifferentiable as e:  # a construct of the user's energy, not a bug: say where
        raise SpecError(f"the energy cannot be differentiated: {e}", spec.energy_span or spec.span,
                        e.hint or "only constructs that do not depend on the state (or sit under stopgrad) may "
                        "lack a derivative") from None


def _build_program(spec: EnergyIR) -> UpdateProgram:
    opt = spec.optimizer
    params = dict(spec.params)
    x = spec.state
    energy = spec.energy
    point = x
    if spec.via is not None:
        u, norm_expr, _ = spec.via
        if opt.wrt == u.name:
            point = u
        else:
            energy = substitute_var(energy, u.name, u.role, norm_expr)

    def at_state(e: Expr) -> Expr:
        if point is not x:
            return substitute_var(e, point.name, point.role, spec.via[1])
        return e

    split = head_split(energy, point)
    head = split[1] if split else None
    needs_heads = opt.per_head
    if needs_heads and split is None:
        raise SpecError("`per head` needs a global energy of the form c * sum[k](...) or mean[k](...)",
                        opt.span, _not_a_head_sum(energy, point))
    if needs_heads and spec.indices[split[1]].size is None:  # `sum[j]` over the context: no heads to split into
        raise SpecError(f"`per head` needs a sum over heads, an index with a size (k over heads), but the global "
                        f"energy sums over `{split[1]}`, which runs over the context", opt.span,
                        "drop `per head`, or write the energy as sum[k](...) over a head index")

    grad_full = gradient(energy, point)
    if ir.is_zero(grad_full):  # `F = 3`, `0 * (z . z)`, `stopgrad(z . z)`: the update would be the identity
        raise SpecError(f"the energy does not depend on the state `{point.name}` (its gradient is zero), so the "
                        "optimizer would never move it", spec.energy_span or spec.span,
                        f"write the global energy in terms of `{point.name}`, outside stopgrad")
    if needs_heads:
        coef, k, g_body = split
        per_head = _per_head_direction(spec, g_body, point, k, params)
        direction = ir.mul(coef, ir.reduce("sum", k, per_head))
    else:
        direction = _neumann(spec, grad_full, point) if opt.kind == "newton" else grad_full
        direction, _ = _precondition(spec, direction, point, None, params)
    preconditioner = _preconditioner_matrix(spec, params, head if needs_heads else None)
    direction = at_state(direction)
    tied = direction
    hits = 0
    untie_scales: dict[str, sp.Expr] = {}
    if spec.untie_rules:
        untied, counts = untie(direction, spec.untie_rules)
        hits = sum(counts)
        if hits == 0:
            raise SpecError("untie: no pattern occurs on the value path of the derived update",
                            spec.untie_span or opt.span or spec.span,
                            "the left side must appear in the update exactly as written, e.g. `W1[k]^T`")
        for n, count in enumerate(counts):
            if count == 0:  # its new parameter would never be read, nor ever train
                at = spec.untie_rule_spans[n] if n < len(spec.untie_rule_spans) else None
                raise SpecError("untie: this pattern does not occur on the value path of the derived update (the "
                                "other rules do)", at or spec.untie_span or spec.span,
                                "the left side must appear in the update exactly as written (`energy derive` shows "
                                "the tied update); or drop the rule")
        for n, (pattern, new) in enumerate(spec.untie_rules):
            dropped = sorted(set(pattern.free) - set(new.free))
            if dropped:  # `W1[k]^T -> Wo`: one weight for every head would constrain the layer, not free it
                at = spec.untie_rule_spans[n] if n < len(spec.untie_rule_spans) else None
                raise SpecError(f"untie: the new parameter `{_base_name(new)}` must keep this pattern's "
                                f"{'index' if len(dropped) == 1 else 'indices'} {', '.join(dropped)}: untying gives "
                                "each place of the pattern a weight of its own, and one shared across them would "
                                "leave the untied layer unable to take the tied one's values",
                                at or spec.untie_span or spec.span,
                                f"index it too: `{_base_name(new)}[{', '.join([*sorted(new.free), *dropped])}]`")
        learned = [sym for name, sym in spec.scalar_params.items() if name in params and params[name].learn]
        learned += [h.symbol for h in opt.hyper.values() if h.learn]
        direction, untie_scales = absorb_constants(untied, [_base_name(new) for _, new in spec.untie_rules], learned)

    hyper = {h.symbol: h.value for h in opt.hyper.values()}
    for name, h in opt.hyper.items():
        if h.learn:
            params[f"opt_{name}"] = ParamSpec(f"opt_{name}", (), ("value", [h.value]), None, True, opt.span,
                                              origin="optimizer")
    aux = [Var(f"m_{x.name}", "aux", x.shape)] if opt.kind in ("momentum", "nag") else []
    hoisted: list[Let] = []
    steps, tied_steps = _step(spec, direction, aux), _step(spec, tied, aux)
    taken = _spec_names(spec) | {x.name for a in steps + tied_steps for x in ir.nodes(a.value) if isinstance(x, Var)}
    assigns = [Assign(a.target, _hoist(a.value, hoisted, taken)) for a in steps]
    tied_assigns = [Assign(a.target, _hoist(a.value, hoisted, taken)) for a in tied_steps]
    return UpdateProgram(spec, point, grad_full, direction, assigns, aux, hoisted, preconditioner, head, tied,
                         hits, params, hyper, tied_assigns, untie_scales)


def _base_name(e: Expr) -> str:
    """`Wo` for `Wo[k]`: an untie rule's new parameter."""
    while isinstance(e, ir.Index):
        e = e.base
    assert isinstance(e, Var)
    return e.name


def _step(spec: EnergyIR, direction: Expr, aux: list[Var]) -> list[Assign]:
    """One optimizer step as assignments, given the direction D(x)."""
    opt, x = spec.optimizer, spec.state
    eta = ir.Scalar(opt.hyper["eta"].symbol)
    if opt.kind in ("gd", "newton"):
        return [Assign(x, ir.add(x, ir.neg(ir.mul(eta, direction))))]
    beta = ir.Scalar(opt.hyper["beta"].symbol)
    m = aux[0]
    d_at = direction
    if opt.kind == "nag":
        d_at = substitute_var(direction, x.name, x.role, ir.add(x, ir.neg(ir.mul(beta, m))))
    return [Assign(m, ir.add(ir.mul(beta, m), d_at)), Assign(x, ir.add(x, ir.neg(ir.mul(eta, m))))]


def _per_head_direction(spec: EnergyIR, g_body: Expr, point: Var, k: str,
                        params: dict[str, ParamSpec]) -> Expr:
    opt = spec.optimizer
    if opt.kind == "newton":
        lin = linear_map(g_body, point)
        if lin is None:
            raise SpecError("`newton ... per head` needs each head's energy to see the state only through one "
                            "linear map `A[k] @ z`", opt.span)
        rows, cols = (spec.size(n) for n in lin.shape)
        if rows > cols:  # A Aᵀ is then singular: the head's coordinates q = A z are not free
            raise SpecError(f"`newton ... per head` steps in each head's coordinates q = A[k] @ {point.name}, which "
                            f"needs A[k] to have no more rows than {point.name} has entries; its shape is "
                            f"[{lin.shape[0]}, {lin.shape[1]}] = [{rows}, {cols}]", opt.span,
                            "make the head width at most the state's (dh <= d), or use newton without `per head`")
        q = Var(f"q_{point.name}", "leaf", lin.shape[:1], None)
        g_q_body = ir.substitute(g_body, {ir.matmul(lin, point): q})
        gq = gradient(g_q_body, q, keep=frozenset([k]))
        dq = _neumann(spec, gq, q)
        dq = substitute_var(dq, q.name, q.role, ir.matmul(lin, point))
        pinv = ir.matmul(ir.transpose(lin), ir.Inverse(ir.matmul(lin, ir.transpose(lin))))
        d = ir.matmul(pinv, dq)
    else:
        d = gradient(g_body, point, keep=frozenset([k]))
    d, _ = _precondition(spec, d, point, k, params)
    return d


def linear_map(e: Expr, point: Var) -> Expr | None:
    """The matrix A when `point` occurs in `e` only as `A @ point` (one A)."""
    found: set[Expr] = set()
    bare = False

    def visit(x: Expr) -> None:
        nonlocal bare
        if isinstance(x, ir.MatMul) and x.b == point and len(x.a.shape) == 2:
            found.add(x.a)
            visit(x.a)  # a map that reads the point itself (`outer(W z, z) @ z`) is not linear in it
            return
        if x == point:
            bare = True
            return
        for c in x.children:
            visit(c)

    visit(e)
    if bare or len(found) != 1:
        return None
    return next(iter(found))


def _neumann(spec: EnergyIR, g: Expr, point: Var) -> Expr:
    """Σ_{m=0}^{k} (I − (H + λI))^m g via Hessian-vector products (directional derivatives of g)."""
    opt = spec.optimizer
    k = int(opt.hyper["taylor"].value)
    lam = ir.Scalar(opt.hyper["damping"].symbol)
    r = g
    for _ in range(k):
        try:
            hv = directional(g, point, r)
        except NotDifferentiable as e:  # the gradient exists (gd takes this energy): its derivative does not
            raise NotDifferentiable(f"newton's Hessian-vector products differentiate the gradient once more, and "
                                    f"{e}", hint="a first-order optimizer (gd, momentum, nag), or newton(taylor = 0), "
                                    "needs no second derivative") from None
        r = ir.add(g, r, ir.neg(hv), ir.neg(ir.mul(lam, r)))
    return r


def _pre_params(spec: EnergyIR, head: str | None, params: dict[str, ParamSpec]) -> dict[str, Expr]:
    """Create the preconditioner's parameters; return them indexed by the head when per head."""
    opt = spec.optimizer
    kind = opt.precondition
    n = spec.state.shape[0] if spec.state.shape else sp.Integer(1)
    lead: tuple[sp.Expr, ...] = ()
    if head is not None:
        lead = (spec.indices[head].size,)
    rank = int(opt.precondition_options.get("rank", (1, True))[0])
    shapes: dict[str, tuple[tuple, tuple]] = {}
    if kind == "scalar":
        shapes["P_s"] = ((), ("value", [SOFTPLUS_ONE]))
    elif kind == "diag":
        shapes["P_d"] = ((n,), ("value", [SOFTPLUS_ONE]))
    elif kind == "dplr":
        shapes["P_d"] = ((n,), ("value", [SOFTPLUS_ONE]))
        shapes["P_U"] = ((n, rank), ("normal", [0.0, 0.02]))
        shapes["P_V"] = ((n, rank), ("zeros", []))
    elif kind == "psd":
        shapes["P_d"] = ((n,), ("value", [SOFTPLUS_ONE]))
        shapes["P_L"] = ((n, rank), ("normal", [0.0, 0.02]))
    elif kind == "full":
        shapes["P_M"] = ((n, n), ("eye", []))
    elif kind == "covariance":
        tau, learn = opt.precondition_options["tau"]
        shapes["P_tau"] = ((), ("value", [tau]))
    out: dict[str, Expr] = {}
    for name, (shape, init) in shapes.items():
        full = lead + tuple(shape)
        entries = math.prod(spec.size(s) for s in full)
        if entries > MAX_SIZE:  # `dplr(rank = 1e17)`: each size fits, the factor does not
            raise SpecError(f"the preconditioner's `{name}` {ir.fmt_shape(full)} would have {entries:.3g} entries "
                            f"(with {', '.join(f'{k}={v:g}' for k, v in spec.dim_values.items())})", opt.span,
                            SIZE_LIMIT_HINT)
        learn = True if kind != "covariance" else bool(opt.precondition_options["tau"][1])
        params[name] = ParamSpec(name, full, init, None, learn, opt.span, origin="precondition")
        if not full:
            sym = sp.Symbol(name, real=True)
            spec.scalar_params[name] = sym
            out[name] = ir.Scalar(sym)
        else:
            v: Expr = Var(name, "param", full)
            out[name] = ir.Index(v, head) if head is not None else v
    return out


def _precondition(spec: EnergyIR, d: Expr, point: Var, head: str | None,
                  params: dict[str, ParamSpec]) -> tuple[Expr, Expr | None]:
    kind = spec.optimizer.precondition
    if kind is None:
        return d, None
    if kind != "covariance" and len(spec.state.shape) != 1 and kind != "scalar":
        raise SpecError(f"precondition {kind} needs a vector state", spec.optimizer.span)
    p = _pre_params(spec, head, params)
    sp_ = lambda e: ir.func("softplus", e)  # noqa: E731
    if kind == "scalar":
        return ir.mul(sp_(p["P_s"]), d), None
    if kind == "diag":
        return ir.mul(sp_(p["P_d"]), d), None
    if kind == "dplr":
        u, v = p["P_U"], p["P_V"]
        low = ir.add(ir.matmul(u, ir.matmul(ir.transpose(v), d)), ir.matmul(v, ir.matmul(ir.transpose(u), d)))
        return ir.add(ir.mul(sp_(p["P_d"]), d), low), None
    if kind == "psd":
        lo = p["P_L"]
        return ir.add(ir.mul(sp_(p["P_d"]), d), ir.matmul(lo, ir.matmul(ir.transpose(lo), d))), None
    if kind == "full":
        return ir.matmul(p["P_M"], d), None
    if kind == "covariance":
        out, hits = _covariance(d, p["P_tau"])
        if hits == 0:
            matrix = len(spec.state.shape) == 2
            raise SpecError("precondition covariance(tau) needs a softmax-weighted sum of vectors in the gradient "
                            "(an attention energy)", spec.optimizer.span,
                            "a matrix state's gradient weights matrices (outer products), not vectors"
                            if matrix else None)
        return out, None
    raise AssertionError(kind)


def weighted_sums(e: Expr) -> list[tuple[ir.Reduce, ir.Softmax, Expr]]:
    """The outermost softmax-weighted sums of vectors v̄ = Σ_j p_j v_j in `e`, as (v̄, p, v)."""
    found: list[tuple[ir.Reduce, ir.Softmax, Expr]] = []

    def visit(x: Expr) -> None:
        if isinstance(x, ir.Reduce) and x.op == "sum" and isinstance(x.body, ir.Mul) and len(x.shape) == 1:
            weights = [f for f in x.body.factors if isinstance(f, ir.Softmax) and f.index == x.index]
            if weights:
                v = ir.mul(*(f for f in x.body.factors if f is not weights[0]))
                if len(v.shape) == 1:
                    found.append((x, weights[0], v))
                    return
        for c in x.children:
            visit(c)

    visit(e)
    return found


def _covariance(e: Expr, tau: Expr) -> tuple[Expr, int]:
    """Replace each v̄ = Σ_j p_j v_j by (I + τ Cov_p(v)) v̄ = v̄ + τ (Σ_j p_j (v_j·v̄) v_j − (v̄·v̄) v̄)."""
    sums = weighted_sums(e)
    mapping: dict[Expr, Expr] = {}
    for vbar, p, v in sums:
        second = ir.reduce("sum", vbar.index, ir.mul(p, ir.dot(v, vbar), v))
        mapping[vbar] = ir.add(vbar, ir.mul(tau, ir.add(second, ir.neg(ir.mul(ir.dot(vbar, vbar), vbar)))))
    return ir.substitute(e, mapping), len(sums)


def _preconditioner_matrix(spec: EnergyIR, params: dict[str, ParamSpec], head: str | None) -> Expr | None:
    """P as an explicit matrix (for checks and printing); None for data-dependent preconditioners."""
    kind = spec.optimizer.precondition
    if kind is None or kind == "covariance":
        return None
    def get(name: str) -> Expr:
        ps = params[name]
        if not ps.shape:
            return ir.Scalar(spec.scalar_params[name])
        v = Var(name, "param", ps.shape)
        return ir.Index(v, head) if head is not None else v
    n = spec.state.shape[0] if spec.state.shape else sp.Integer(1)
    if kind == "scalar":
        return ir.mul(ir.func("softplus", get("P_s")), ir.Identity(n))
    diag = ir.Diag(ir.func("softplus", get("P_d"))) if kind in ("diag", "dplr", "psd") else None
    if kind == "diag":
        return diag
    if kind == "dplr":
        u, v = get("P_U"), get("P_V")
        return ir.add(diag, ir.matmul(u, ir.transpose(v)), ir.matmul(v, ir.transpose(u)))
    if kind == "psd":
        lo = get("P_L")
        return ir.add(diag, ir.matmul(lo, ir.transpose(lo)))
    return get("P_M")


_STATE_ROLES = ("state", "leaf", "aux")


def _worth_hoisting(e: Expr) -> bool:
    return isinstance(e, (ir.MatMul, ir.Dot, ir.Func, ir.Outer, ir.SumAll, ir.Reduce, ir.Softmax, ir.ProdOthers,
                          ir.Decay, ir.Rope, ir.Inverse, ir.Mul, ir.Add, ir.Pow)) and e.free != frozenset() \
        or isinstance(e, (ir.MatMul, ir.Inverse)) \
        or isinstance(e, ir.Reduce) and any(  # a context sum without the state: per token (its body alone is T x T)
            isinstance(x, ir.Var) and x.role == "context" for x in ir.nodes(e))


def _spec_names(spec: EnergyIR) -> set[str]:
    """Every name the spec declares: a hoisted value named like one (`c0`, beside a `param c0`) would print as it."""
    names = {*spec.dim_symbols, *spec.derived_dims, *spec.params, *spec.indices, *spec.scalar_params,
             *spec.user_names.values(), spec.state.name, spec.energy_name}
    return names | {v.name for v in (spec.input, spec.context, spec.via and spec.via[0]) if v is not None}


def _hoist(e: Expr, hoisted: list[Let], taken: set[str]) -> Expr:
    """Name the largest state-independent sub-expressions (keys, values, gates): computed once, as `c0`, `c1`, ...
    (skipping `taken`, the spec's own names).

    Both walks are memoised per node: the IR is a DAG (a Newton direction shares its gradient between
    Taylor terms), and a tree walk of a Taylor-2 direction through a norm visited millions of nodes.
    """
    known = {h.body: h for h in hoisted}
    dependent: dict[int, bool] = {}
    memo: dict[int, Expr] = {}

    def state_dependent(x: Expr) -> bool:
        hit = dependent.get(id(x))
        if hit is None:
            hit = isinstance(x, Var) and x.role in _STATE_ROLES or any(state_dependent(c) for c in x.children)
            dependent[id(x)] = hit
        return hit

    def visit(x: Expr) -> Expr:
        if isinstance(x, (Var, ir.Scalar, ir.Pos, Let, ir.Index, ir.Ones, ir.Identity, ir.Count)):
            return x
        hit = memo.get(id(x))
        if hit is not None:
            return hit
        if not state_dependent(x) and _worth_hoisting(x):
            out = known.get(x)
            if out is None:
                name = next(f"c{n}" for n in itertools.count(len(hoisted)) if f"c{n}" not in taken)
                taken.add(name)
                out = known[x] = Let(name, x)
                hoisted.append(out)
        else:
            out = ir.rebuild(x, [visit(c) for c in x.children])
        memo[id(x)] = out
        return out

    return visit(e)


@lru_cache(maxsize=64)
def unhoist(e: Expr) -> Expr:
    """Inline hoisted values again (for printing and comparisons).

    Memoised per node within a call (a hoisted value is shared by many terms) and across calls by
    structure (printing and the tying report unhoist the same direction many times); `unhoist` is a
    pure function of the IR, and IR nodes are immutable.
    """
    memo: dict[int, Expr] = {}

    def visit(x: Expr) -> Expr:
        hit = memo.get(id(x))
        if hit is None:
            if isinstance(x, Let):
                hit = visit(x.body)
            elif not x.children:
                hit = x
            else:
                hit = ir.rebuild(x, [visit(c) for c in x.children])
            memo[id(x)] = hit
        return hit

    return visit(e)

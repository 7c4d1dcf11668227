"""The optimizer's properties, checked on a derived update: `descent` (a small step lowers F, the step as taken
does not overshoot everywhere, momentum decays) and `definite` (the preconditioner is positive-definite)."""

from __future__ import annotations

import torch

from . import ir
from .check_results import CheckResult, _non_finite
from .evaluate import evaluate
from .instance import Instance, bind_input, eval_tokens, evaluate_on, make_env, random_instance, run_program
from .number_text import plain_number
from .optimizers import UpdateProgram
from .replay import covariances, energy_at_point, energy_of_state, point_value
from .semantics import EnergyIR


def check_descent(prog: UpdateProgram) -> CheckResult:
    spec = prog.spec
    eta = spec.optimizer.hyper["eta"].value
    if not eta > 0:  # the first step is x − η D (momentum starts at 0): a small step along D says nothing then
        return CheckResult("descent", "fail", f"the step size η = {eta} is not positive: the update x − η D "
                           + ("does not move" if eta == 0 else "climbs F instead of descending"))
    momentum = _momentum_range(spec.optimizer)
    if momentum is not None and momentum.status == "fail":
        return momentum
    inst = random_instance(prog, seed=4)
    # the step is applied to x, so descent is judged on F as a function of x: under `via` (with or
    # without `wrt u`) that is F(N(x)), never the spec's F(u), which the state's value cannot bind
    energy = energy_of_state(prog)
    at = point_value(prog, inst, inst.x)
    d = eval_tokens(spec, prog.tied_direction, inst, {spec.state.name: inst.x})
    f0 = eval_tokens(spec, energy, inst, {spec.state.name: inst.x})
    where = _non_finite(d)
    if where is not None:
        return CheckResult("descent", "fail", f"not finite: the update direction is {where}")
    # a step of a millionth of the state's size, whatever the sizes of F and D (a fixed 1e-6 · D overshot a
    # minimum where D was large and moved F by less than its rounding error where F was small)
    size, along = _token_norms(inst.x).clamp_min(1.0), _token_norms(d)
    eps = torch.where(along > 0, 1e-6 * size / along.clamp_min(1e-300), 0.0)
    f1 = eval_tokens(spec, energy, inst, {spec.state.name: inst.x - eps.view(*eps.shape, *[1] * (d.dim() - 2)) * d})
    for what, t in (("F", f0), ("F after a small step", f1)):
        where = _non_finite(t)
        if where is not None:
            return CheckResult("descent", "fail", f"not finite: {what} is {where}")
    decreased = bool(_descends(spec, energy, inst, d, f1 - f0, torch.maximum(f0.abs(), f1.abs())).all())
    # curvature along random directions: all negative = concave, unbounded below
    curv = []
    for s in range(4):
        v = torch.randn(at.shape, generator=torch.Generator().manual_seed(50 + s), dtype=at.dtype)
        p = at.clone().requires_grad_(True)
        f = eval_tokens(spec, energy_at_point(prog), inst, {prog.point.name: p})
        (gr,) = torch.autograd.grad(f.sum(), p, create_graph=True)
        if not gr.requires_grad:  # F is linear in the state: zero curvature
            curv.append(0.0)
            continue
        (hv,) = torch.autograd.grad((gr * v).sum(), p, allow_unused=True)
        curv.append(0.0 if hv is None else float((hv * v).sum()))
    opt = spec.optimizer
    if not decreased and opt.kind == "newton" and opt.precondition is None and all(c > 0 for c in curv):
        return CheckResult("descent", "fail", "a small step raised F for some token, though F is convex here along "
                           "every probed direction: the truncated Newton step is not a descent direction, so its "
                           "Neumann series does not converge (it needs every eigenvalue of H + λI inside (0, 2); "
                           "a smaller λ, or an even `taylor`, may fix it)")
    if not decreased and (opt.precondition in ("dplr", "full", "covariance") or opt.kind == "newton"):
        if opt.precondition in ("dplr", "full"):
            why = f"the {opt.precondition} preconditioner is not positive-definite by construction"
        elif opt.precondition == "covariance":  # I + τC is positive-definite; it multiplies v̄, not ∇F = Σ_k A_kᵀ v̄_k
            why = ("`covariance` multiplies each softmax-weighted sum inside the gradient by its own I + τ·C, so "
                   "the direction is not one positive-definite matrix times ∇F (a head's weights, several heads)")
        else:
            why = ("a truncated Newton step need not descend (F may be non-convex here, or the Neumann series may "
                   "not converge: it needs every eigenvalue of H + λI inside (0, 2))")
        return CheckResult("descent", "warn", f"a small step raised F for some token here: {why}")
    if not decreased and prog.point is not spec.state and _via_jacobian_indefinite(prog, inst):
        name = prog.point.name
        return CheckResult("descent", "warn", f"a small step raised F for some token here: the step is taken in "
                           f"`{name}` and applied to `{spec.state.name}`, which descends only where d{name}/d"
                           f"{spec.state.name} is positive semi-definite, and here it is not (a per-channel gain "
                           f"breaks it; rmsnorm and layernorm alone keep it)")
    if not decreased and prog.point is not spec.state and opt.precondition not in (None, "scalar"):
        # F changes by -η ∇_uᵀ J P ∇_u with J = du/dx: J and P each positive semi-definite, their product need not be
        name = prog.point.name
        return CheckResult("descent", "warn", f"a small step raised F for some token here: the step is taken in "
                           f"`{name}`, preconditioned by {opt.precondition}, and applied to `{spec.state.name}`: "
                           f"d{name}/d{spec.state.name} times the preconditioner need not be positive semi-definite, "
                           "even where each is")
    if not decreased:
        return CheckResult("descent", "fail", "a small step along the update raises F for some token "
                           "(the preconditioner or optimizer is not a descent direction here)")
    if momentum is not None:
        return momentum
    overshoot = _overshoot(prog, inst, energy, f0)
    if overshoot is not None:
        return overshoot
    if all(c < 0 for c in curv):
        return CheckResult("descent", "warn", "small steps descend, but F is concave here along every probed "
                           "direction: no minimum near this point, and none at all where F stays concave (as "
                           "-logsumexp does; a term like ½ z·z can bound it); each step is one descent step, not a "
                           "solve")
    return CheckResult("descent", "ok", "a small step along the update lowers F for every token")


def _overshoot(prog: UpdateProgram, inst: Instance, energy: ir.Expr, f0: torch.Tensor) -> CheckResult | None:
    """Small steps descend, but does the update as taken (η, every step)? Where it raises F for every token,
    η overshoots (`gd(eta = 1000)` on ½|z − h|² multiplies z − h by −999 each step). Where only some tokens
    rise it says nothing: a non-convex F (attention, an MLP) rises at some points under any fixed step."""
    spec, opt = prog.spec, prog.spec.optimizer
    f1 = eval_tokens(spec, energy, inst, {spec.state.name: run_program(prog, inst, tied=True)})
    rose = ~(f1 <= f0 + 1e-12 * f0.abs())  # a non-finite F counts as a rise
    if not bool(rose.all()):
        return None
    return CheckResult("descent", "warn", f"small steps descend, but the update as taken ({opt.steps} × "
                       f"{opt.kind}, η = {plain_number(float(opt.hyper['eta'].value))}) raises F for every token "
                       "here: the step overshoots (a smaller η descends)")


def _descends(spec: EnergyIR, energy: ir.Expr, inst: Instance, d: torch.Tensor, rise: torch.Tensor,
              size_of_f: torch.Tensor) -> torch.Tensor:
    """Per token: does a small step x − εD lower F? By the slope dF/dε = −∇F·D (autograd, through `stopgrad`:
    descent is judged on F itself) where it is clear, and by the finite difference `rise` where D is about
    orthogonal to ∇F. The difference alone drowned in F's rounding once F was large: `1e8 + 2 (z − x)·(z − x)`
    hid a Newton step that climbs."""
    x = inst.x.detach().clone().requires_grad_(True)
    env = make_env(spec, inst, {spec.state.name: x})
    env.detach_stopgrad = False
    f = evaluate(bind_input(spec, inst, energy)[0], env).tensor
    (grad,) = torch.autograd.grad(f.sum(), x, allow_unused=True) if f.requires_grad else (None,)
    if grad is None:  # F does not depend on the state
        return rise <= 1e-12 * size_of_f
    slope = -(grad * d).flatten(2).sum(-1) if d.dim() > 2 else -(grad * d)
    clear = slope.abs() > 1e-9 * _token_norms(grad) * _token_norms(d)
    return torch.where(clear, slope < 0, rise <= 1e-12 * size_of_f)


def _token_norms(t: torch.Tensor) -> torch.Tensor:
    """The size of each token's value of a (B, T, *shape) tensor: (B, T)."""
    return t.flatten(2).norm(dim=-1) if t.dim() > 2 else t.abs()


def _momentum_range(opt) -> CheckResult | None:
    """β of momentum or nag over several steps, outside [0, 1). The first step starts from m = 0, where β does
    nothing, so the descent probe alone never sees it: β ≥ 1 never lets the momentum decay (the steps grow without
    bound), β < 0 reverses part of the last step (negative momentum: unusual, so a warning)."""
    if opt.kind not in ("momentum", "nag") or opt.steps < 2:
        return None
    beta = float(opt.hyper["beta"].value)
    if beta >= 1:
        return CheckResult("descent", "fail", f"β = {plain_number(beta)} ≥ 1: the momentum m = β m + D never decays "
                           f"over the {opt.steps} steps, which grow without bound; β must be in [0, 1)")
    if beta < 0:
        return CheckResult("descent", "warn", f"β = {plain_number(beta)} < 0: each step reverses part of the last "
                           "(negative momentum); small steps descend, but β is usually in [0, 1)")
    return None


def _via_jacobian_indefinite(prog: UpdateProgram, inst: Instance) -> bool:
    """Under `wrt u`: is the symmetric part of du/dx indefinite for some token? x − η ∇_u F changes F(N(x)) by
    −η ∇_u F · (du/dx) ∇_u F, a descent for every F only where du/dx is positive semi-definite."""
    x = inst.x.clone().requires_grad_(True)
    u = point_value(prog, inst, x).flatten(2)
    rows = [torch.autograd.grad(u[..., k].sum(), x, retain_graph=True)[0].flatten(2) for k in range(u.shape[-1])]
    jac = torch.stack(rows, -2)  # (B, T, n, n): `via` keeps the state's shape, and the norm is token-local
    return bool(torch.linalg.eigvalsh((jac + jac.mT) / 2).min() < -1e-10)


def check_definite(prog: UpdateProgram) -> CheckResult | None:
    spec = prog.spec
    kind = spec.optimizer.precondition
    if kind is None:
        return None
    if kind == "covariance":
        return _covariance_definite(prog)
    if prog.preconditioner is None:
        return None
    worst_min = float("inf")
    for seed in range(8):
        inst = random_instance(prog, seed=seed, scale=1.5)
        mat = evaluate_on(spec, prog.preconditioner, inst, {spec.state.name: inst.x}).tensor
        where = _non_finite(mat)
        if where is not None:
            return CheckResult("definite", "fail", f"not finite: the {kind} preconditioner is {where}, seed {seed}")
        mat = mat.reshape(-1, mat.shape[-2], mat.shape[-1])
        eig = torch.linalg.eigvalsh((mat + mat.transpose(-1, -2)) / 2)
        worst_min = min(worst_min, float(eig.min()))
    if kind in ("dplr", "full"):
        if worst_min < 0:
            form = "diag(softplus(d)) + UVᵀ + VUᵀ" if kind == "dplr" else "the learned matrix M"
            return CheckResult("definite", "warn", f"{kind} is possibly indefinite: found an eigenvalue "
                               f"{worst_min:.3g} < 0 ({form} is not PD by construction)")
        return CheckResult("definite", "warn", f"{kind} is not positive-definite by construction")
    ok = worst_min > 0
    return CheckResult("definite", "ok" if ok else "fail",
                       f"{kind} preconditioner positive-definite (min eigenvalue {worst_min:.3g} over 8 draws)")


def _covariance_definite(prog: UpdateProgram) -> CheckResult:
    """I + τ Cov_p(v) at the declared τ, over 8 draws of the energy's weights and values."""
    spec, opt = prog.spec, prog.spec.optimizer
    tau, learned = opt.precondition_options["tau"]
    worst_min = float("inf")
    for seed in range(8):
        inst = random_instance(prog, seed=seed, scale=1.5)
        at = point_value(prog, inst, inst.x)
        for _, _, cov, _, _ in covariances(prog, inst, {spec.state.name: inst.x, prog.point.name: at}, prog.gradient):
            where = _non_finite(cov)
            if where is not None:
                return CheckResult("definite", "fail", f"not finite: Cov_p(v) is {where}, seed {seed}")
            eye = torch.eye(cov.shape[-1], dtype=cov.dtype)
            worst_min = min(worst_min, float(torch.linalg.eigvalsh(eye + float(tau) * cov).min()))
    found = f"at τ = {float(tau):g} (min eigenvalue {worst_min:.3g} over 8 draws)"
    if worst_min <= 0:
        return CheckResult("definite", "fail", f"I + τ·Cov_p(v) is not positive-definite {found}: τ must be ≥ 0")
    if float(tau) < 0:  # Cov_p(v) grows as |v|²: large enough values break I + τ C, whatever these draws held
        return CheckResult("definite", "fail", f"I + τ·Cov_p(v) is positive-definite {found}, but not for values "
                           "large enough (Cov_p(v) grows as |v|², and τ < 0 subtracts it): τ must be ≥ 0")
    caveat = "; a learned τ < 0 may break it" if learned else ""
    return CheckResult("definite", "ok", f"I + τ·Cov_p(v) positive-definite {found}{caveat}")


def check_head_maps(prog: UpdateProgram) -> CheckResult | None:
    """A per-head Newton step inverts A_k A_kᵀ for each head's map A_k. A map the spec starts at zeros, ones or one
    value has rank below the head's width (above 1): the module's first forward fails. The other checks draw
    every learned weight at random, so only its initialiser shows it (a `fixed` map keeps its initialiser there,
    and those rows cannot run: this one says why)."""
    inverted = [n for n in ir.nodes(prog.direction) if isinstance(n, ir.Inverse)]
    if not inverted:
        return None
    names = {v.name for n in inverted for v in ir.nodes(n) if isinstance(v, ir.Var) and v.role == "param"}
    width = prog.spec.size(inverted[0].shape[0]) if inverted[0].shape else 1  # the head's
    for name in sorted(names):
        param = prog.spec.params.get(name)
        kind = param.init[0] if param is not None and param.init else None
        if kind == "zeros" or (kind in ("ones", "value") and width > 1):
            start = {"zeros": "zeros()", "ones": "ones()"}.get(kind, "one value")
            return CheckResult("head map", "fail", f"`{name}` starts at {start}, so a per-head Newton step's "
                               f"A_k A_kᵀ ({width} x {width}) is singular at the start: the module's first forward "
                               f"fails; initialise `{name}` at random (`~ normal(0, 0.02)`)")
    return CheckResult("head map", "ok", f"each head's map ({', '.join(sorted(names))}) starts at random: "
                       "A_k A_kᵀ is invertible almost surely")

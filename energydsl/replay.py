"""The optimizer replayed on autograd alone: what `energy check`'s update check compares the derived program with.

Directions come from torch.autograd's gradient and Hessian-vector products of the energy as written, never from
the derivation: for newton, the Neumann series Σ_{r=0}^{taylor} (I − (H + λI))^r ∇F; per head, each head's term
from its own energy (Newton in the head's coordinates); a preconditioner's matrix as declared; covariance's
(I + τ C) v̄ with C built as a matrix from the energy's weights and values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import ir
from .calculus import gradient, substitute_var
from .evaluate import Value, merge_values
from .instance import Instance, eval_tokens, evaluate_on
from .optimizers import UpdateProgram, head_split, linear_map, weighted_sums


def point_value(prog: UpdateProgram, inst: Instance, x: torch.Tensor) -> torch.Tensor:
    """The optimizer's variable at state x: x itself, or u = N(x) under `wrt u`."""
    spec = prog.spec
    if prog.point is spec.state:
        return x
    return eval_tokens(spec, spec.via[1], inst, {spec.state.name: x})


def energy_at_point(prog: UpdateProgram) -> ir.Expr:
    """F in the variable the optimizer moves: the state (F(N(x)) under `via`), or `u` itself under `wrt u`."""
    return energy_of_state(prog) if prog.point is prog.spec.state else prog.spec.energy


def autograd_gradient(prog: UpdateProgram, inst: Instance, at: torch.Tensor) -> torch.Tensor:
    p = at.clone().requires_grad_(True)
    f = eval_tokens(prog.spec, energy_at_point(prog), inst, {prog.point.name: p})
    (g,) = torch.autograd.grad(f.sum(), p)
    return g


def _grad_and_hvp(f: torch.Tensor, p: torch.Tensor
                  ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """autograd's ∇ of Σ f at the leaf p, and v ↦ H v by double backward (the graph kept for several products
    and for other energies of the same evaluation)."""
    (g,) = torch.autograd.grad(f.sum(), p, create_graph=True, retain_graph=True)
    if not g.requires_grad:  # f is linear in the point: H = 0
        return g.detach(), torch.zeros_like
    return g.detach(), lambda v: torch.autograd.grad((g * v.detach()).sum(), p, retain_graph=True)[0]


def autograd_hvp(prog: UpdateProgram, inst: Instance, at: torch.Tensor
                 ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """autograd's ∇F at `at`, and v ↦ H v."""
    p = at.clone().requires_grad_(True)
    return _grad_and_hvp(eval_tokens(prog.spec, energy_at_point(prog), inst, {prog.point.name: p}), p)


def _neumann_replay(g: torch.Tensor, hvp: Callable[[torch.Tensor], torch.Tensor], lam: float,
                    taylor: int) -> torch.Tensor:
    """Σ_{r=0}^{taylor} (I − (H + λI))^r g."""
    d = term = g
    for _ in range(taylor):
        term = term - hvp(term) - lam * term
        d = d + term
    return d


def _apply_preconditioner(kind: str, p: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """P d with P evaluated as declared: a (.., n, n) matrix, or for `scalar` softplus(P_s) I on any state."""
    if kind == "scalar":
        p = p.reshape(*p.shape[:2], -1)[..., 0]
        return p.reshape(*p.shape[:2], *(1,) * (d.dim() - 2)) * d
    flat = d.reshape(*d.shape[:2], -1, 1)
    return (p.expand(*d.shape[:2], *p.shape[2:]) @ flat).reshape(d.shape)


def _head(v: Value, k: str, h: int) -> torch.Tensor:
    """Head h of a value laid out over the head index k (the whole value when it does not vary with k)."""
    return v.tensor.select(2 + v.idx.index(k), h) if k in v.idx else v.tensor


def replayed_direction(prog: UpdateProgram, inst: Instance, x: torch.Tensor) -> torch.Tensor:
    """The direction at state x from autograd alone: ∇F, for newton Σ_{r=0}^{taylor} (I − (H + λI))^r ∇F
    with autograd's Hessian-vector products, then the preconditioner's matrix as the energy declares it."""
    spec, opt = prog.spec, prog.spec.optimizer
    at = point_value(prog, inst, x)
    if opt.precondition == "covariance":
        return _replayed_covariance(prog, inst, x, at)
    if opt.per_head and (opt.kind == "newton" or opt.precondition):
        return _replayed_per_head(prog, inst, x, at)
    if opt.kind == "newton":
        g, hvp = autograd_hvp(prog, inst, at)
        d = _neumann_replay(g, hvp, scalar_value(inst, opt.hyper["damping"].symbol), int(opt.hyper["taylor"].value))
    else:
        d = autograd_gradient(prog, inst, at)
    if prog.preconditioner is not None:
        p = evaluate_on(spec, prog.preconditioner, inst, {spec.state.name: x, prog.point.name: at}).tensor
        d = _apply_preconditioner(opt.precondition, p, d)
    return d


def _replayed_per_head(prog: UpdateProgram, inst: Instance, x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """`per head`: c Σ_k D_k, each D_k from autograd on the head's own energy F_k alone.

    For newton, head k sees the point z through q = A_k z. With M = (A Aᵀ)⁻¹, its coordinates' gradient and
    Hessian follow from autograd's in z, ∇_q = M A ∇_z and H_q = M A H_z Aᵀ M (A of full row rank), and the
    Neumann series in q is mapped back by Aᵀ M. Each head's preconditioner multiplies its own term."""
    spec, opt = prog.spec, prog.spec.optimizer
    split = head_split(energy_at_point(prog), prog.point)
    assert split is not None  # build_program refused the spec otherwise
    coef, k, body = split
    p = at.clone().requires_grad_(True)
    energies = evaluate_on(spec, body, inst, {prog.point.name: p})
    assert energies.idx == (k,), energies.idx
    per_token = energies.tensor.expand(*at.shape[:2], -1)
    bound = {spec.state.name: x, prog.point.name: at}
    maps = evaluate_on(spec, linear_map(body, prog.point), inst, bound) if opt.kind == "newton" else None
    pre = evaluate_on(spec, prog.preconditioner, inst, bound) if prog.preconditioner is not None else None
    total = torch.zeros_like(at)
    for h in range(per_token.shape[-1]):
        d, hvp = _grad_and_hvp(per_token[..., h], p)
        if maps is not None:
            a = _head(maps, k, h)
            m_a = torch.linalg.solve(a @ a.mT, a)  # M A

            def from_q(w: torch.Tensor, m_a: torch.Tensor = m_a) -> torch.Tensor:
                return (m_a.mT @ w.unsqueeze(-1)).squeeze(-1)  # Aᵀ M w (M is symmetric)

            def to_q(v: torch.Tensor, m_a: torch.Tensor = m_a) -> torch.Tensor:
                return (m_a @ v.unsqueeze(-1)).squeeze(-1)

            d = from_q(_neumann_replay(to_q(d), lambda w, hvp=hvp: to_q(hvp(from_q(w))),
                                       scalar_value(inst, opt.hyper["damping"].symbol),
                                       int(opt.hyper["taylor"].value)))
        if pre is not None:
            d = _apply_preconditioner(opt.precondition, _head(pre, k, h), d)
        total = total + d
    return float(evaluate_on(spec, coef, inst, bound).tensor.reshape(-1)[0]) * total


def covariances(prog: UpdateProgram, inst: Instance, bound: dict[str, torch.Tensor], e: ir.Expr
                 ) -> list[tuple[ir.Expr, torch.Tensor, torch.Tensor, torch.Tensor, tuple[str, ...]]]:
    """For each softmax-weighted sum v̄ = Σ_j p_j v_j in e: (its node, v̄, Cov_p(v), τ, v̄'s free indices), evaluated
    from the energy's own weights and values, the covariance as the explicit Σ_j p_j v_j v_jᵀ − v̄ v̄ᵀ."""
    spec = prog.spec
    tau_param = prog.params["P_tau"]
    tau_expr = ir.Index(ir.Var("P_tau", "param", tau_param.shape), prog.head_index) if tau_param.shape \
        else ir.Scalar(spec.scalar_params["P_tau"])  # per head: one τ per head
    out = []
    for node, p, v in weighted_sums(e):
        idx, (w, values, tau) = merge_values(*(evaluate_on(spec, part, inst, bound) for part in (p, v, tau_expr)))
        j = 2 + idx.index(node.index)
        w = w.unsqueeze(-1)
        vbar = (w * values).sum(j)
        cov = (w.unsqueeze(-1) * values.unsqueeze(-1) * values.unsqueeze(-2)).sum(j) - \
            vbar.unsqueeze(-1) * vbar.unsqueeze(-2)
        out.append((node, vbar, cov, tau.sum(j), tuple(i for i in idx if i != node.index)))
    return out


def _replayed_covariance(prog: UpdateProgram, inst: Instance, x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """`precondition covariance`: the gradient (per head: c Σ_k ∇F_k) with each softmax-weighted sum v̄ replaced by
    (I + τ Cov_p(v)) v̄, computed here with the covariance as an explicit matrix."""
    spec, opt = prog.spec, prog.spec.optimizer
    plain = prog.gradient
    if opt.per_head:
        coef, k, body = head_split(energy_at_point(prog), prog.point)
        plain = ir.mul(coef, ir.reduce("sum", k, gradient(body, prog.point, keep=frozenset([k]))))
    tensors = {spec.state.name: x, prog.point.name: at}
    mapping: dict[ir.Expr, ir.Expr] = {}
    for n, (node, vbar, cov, tau, free) in enumerate(covariances(prog, inst, tensors, plain)):
        name = f"covariance_replay_{n}"
        preconditioned = vbar + tau.unsqueeze(-1) * (cov @ vbar.unsqueeze(-1)).squeeze(-1)
        tensors[name] = preconditioned.expand(*at.shape[:2], *preconditioned.shape[2:])
        value: ir.Expr = ir.Var(name, "leaf", tuple(spec.indices[i].size for i in free) + tuple(node.shape))
        for i in free:  # the leading axes are v̄'s free indices, in order
            value = ir.Index(value, i)
        mapping[node] = value
    return eval_tokens(spec, ir.substitute(plain, mapping), inst, tensors)


def scalar_value(inst: Instance, sym) -> float:
    v = inst.scalars[sym]
    return float(v)


def energy_of_state(prog: UpdateProgram) -> ir.Expr:
    """F as a function of the state: `u` replaced by N(x) under `via`, as `build_program` does without `wrt u`."""
    spec = prog.spec
    if spec.via is None:
        return spec.energy
    return substitute_var(spec.energy, spec.via[0].name, spec.via[0].role, spec.via[1])

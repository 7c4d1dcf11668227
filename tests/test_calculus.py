"""Derived updates against torch.autograd in float64, and checks that catch wrong claims."""

import re

import pytest
import torch

from energydsl import load
from energydsl.checks import run_checks
from energydsl.instance import eval_tokens, instance_from_params, random_instance, run_program

ENERGIES = {
    "linear": ("state z[d]\n context h[j, d] where j <= i\n param W[d, d]\n param T = 2\n"
               " local E[j] = abs(z . (W @ h[j]))\n global F = -(T/2) * sum[j](E[j]^2)"),
    "l2": ("state z[d]\n context h[j, d] where j <= i\n param W[d, d]\n let T = 2\n"
           " global F = -T * logsumexp[j](-(1/2) * ((z - W @ h[j]) . (z - W @ h[j])) / T)"),
    "strict": ("state x[d] via g = layernorm(x)\n context h[j, d] where j < i\n param W[d, d]\n"
               " global F = -logsumexp[j](g . (W @ h[j]))"),
    "mlp": ("state x[d] via u = rmsnorm(x)\n input h[d]\n param W[m, d]\n param V[m, d]\n"
            " global F = -sum(W @ h * integral(silu)(V @ u))"),
    "matrix": ("state Z[d, m]\n context h[j, d] where j <= i\n param K[d, d]\n"
               " global F = -logsumexp[j]((K @ h[j]) . (Z @ (Z^T @ (K @ h[j]))))"),
    "huber": ("state z[d]\n context h[j, d] where j <= i\n param W[d, d]\n"
              " global F = sum[j](huber(norm(z - W @ h[j]), 0.5))"),
    # diag(a) has no derivative rule of its own; it needs none where it does not depend on the state
    "diag-params": "state z[d]\n input h[d]\n param a[d]\n global F = 0.5 * z . ((eye(d) + diag(a)) @ z) - h . z",
    # a softmax inside F (its own derivative rule) and a power of the state (the Hessian's power rule)
    "softmax-inside": ("state z[d]\n context h[j, d] where j <= i\n param W[d, d]\n"
                       " global F = -sum[j](softmax[j](z . (W @ h[j])) * (z . h[j]))"),
    "quartic": ("state z[d]\n context h[j, d] where j <= i\n param W[d, d]\n"
                " global F = sum[j]((z . (W @ h[j]))^4) / 4 + 0.5 * z . z"),
}

OPTIMIZERS = ["gd(eta = 0.5)", "momentum(beta = 0.8, eta = 0.7) steps 3", "nag(beta = 0.8, eta = 0.7) steps 2",
              "newton(taylor = 2, damping = 0.3, eta = 0.7)", "gd(eta = 1), precondition psd(rank = 2)",
              "gd(eta = 1), precondition dplr(rank = 2)", "momentum(beta = 0.5, eta = 0.5) steps 2, precondition diag",
              "gd(eta = 0.5), precondition scalar", "newton(taylor = 1, damping = 0.2), precondition full"]


def spec_text(body: str, opt: str, wrt: str = "") -> str:
    return f"energy E(d = 4, m = 3) {{\n {body}\n optimizer {opt}{wrt}\n}}"


@pytest.mark.parametrize("name", sorted(ENERGIES))
def test_gradient_matches_autograd(name):
    wrt = " wrt " + ENERGIES[name].split("via ")[1].split(" ")[0] if "via" in ENERGIES[name] else ""
    derived = load(spec_text(ENERGIES[name], "gd(eta = 1)", wrt)).energy()
    results = {r.name: r for r in run_checks(derived.program)}
    assert results["gradient"].status == "ok", results["gradient"].detail
    assert results["sympy"].status == "ok", results["sympy"].detail
    assert results.get("causality") is None or results["causality"].status == "ok"


@pytest.mark.parametrize("energy", ["l2", "quartic", "diag-params"])
@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_optimizers_verified(opt, energy):
    """Each optimizer's whole update against a replay on autograd alone (for newton, autograd's Hessian in
    the Neumann series; for a preconditioner, its matrix as declared), not only its gradient."""
    derived = load(spec_text(ENERGIES[energy], opt)).energy()
    results = run_checks(derived.program)
    failed = [r for r in results if not r.ok]
    assert not failed, failed
    assert {r.name: r.status for r in results}["update"] == "ok"


@pytest.mark.parametrize("opt", ["gd(eta = 0.5), precondition scalar", "newton(taylor = 2, damping = 0.3)"])
def test_update_replay_on_a_matrix_state(opt):
    """The replay flattens a matrix state for the Hessian and the preconditioner (scalar: softplus(P_s) I)."""
    results = {r.name: r for r in run_checks(load(spec_text(ENERGIES["matrix"], opt)).energy().program)}
    assert results["update"].status == "ok", results["update"].detail


def test_chain_rule_through_norm_differs_from_wrt():
    exact = load(spec_text(ENERGIES["strict"], "gd(eta = 1)")).energy()
    at_norm = load(spec_text(ENERGIES["strict"], "gd(eta = 1)", " wrt g")).energy()
    inst = random_instance(exact.program, seed=0)
    a = run_program(exact.program, inst)
    b = run_program(at_norm.program, inst)
    assert (a - b).abs().max() > 1e-6  # the Jacobian of the norm matters


def test_wrong_expect_is_refuted_with_counterexample():
    body = ENERGIES["linear"] + "\n expect update = z + T * sum[j]((z . (W @ h[j])) * (W^T @ h[j]))"
    derived = load(spec_text(body, "gd(eta = 1)")).energy()
    expect = [r for r in derived.check() if r.name == "expect"][0]
    assert expect.status == "fail" and "token" in expect.detail


def test_right_expect_holds():
    body = ENERGIES["linear"] + "\n expect update = z + T * sum[j]((z . (W @ h[j])) * (W @ h[j]))"
    derived = load(spec_text(body, "gd(eta = 1)")).energy()
    assert [r for r in derived.check() if r.name == "expect"][0].status == "ok"


def test_causality_check_catches_a_leak():
    """A deliberately acausal energy (reads the whole sequence through `i - j` of both signs) must fail."""
    derived = load(spec_text(ENERGIES["l2"], "gd(eta = 1)")).energy()
    prog = derived.program
    info = prog.spec.indices["j"]
    info.strict = False
    from energydsl import checks

    # widen the mask: every token sees every context token
    original = checks.run_program

    def leaky(p, inst, **kw):
        out = original(p, inst, **kw)
        return out + inst.context.sum(1, keepdim=True)

    checks.run_program = leaky
    try:
        assert checks.check_causality(prog).status == "fail"
    finally:
        checks.run_program = original


@pytest.mark.parametrize("leak", ["own token", "next token"])
def test_causality_check_catches_a_one_token_leak(leak, monkeypatch):
    """The smallest leaks: under `j < i` token i reading its own context token, and token i reading i + 1."""
    from energydsl import checks

    prog = load(spec_text(ENERGIES["strict" if leak == "own token" else "l2"], "gd(eta = 1)", " wrt g"
                          if leak == "own token" else "")).energy().program
    original = checks.run_program

    def leaky(p, inst, **kw):
        out = original(p, inst, **kw)
        if leak == "own token":
            return out + inst.context
        ahead = torch.roll(inst.context, -1, dims=1)
        ahead[:, -1] = 0
        return out + ahead

    monkeypatch.setattr(checks, "run_program", leaky)
    assert checks.check_causality(prog).status == "fail"


def test_descent_check_fails_when_some_tokens_step_uphill():
    """Every token must descend: a direction reversed on the later tokens only is caught."""
    import dataclasses

    from energydsl import ir
    from energydsl.checks import check_descent

    prog = load(spec_text(ENERGIES["l2"], "gd(eta = 1)")).energy().program
    assert check_descent(prog).status == "ok"
    late = ir.Func("relu", ir.add(ir.Pos(None), ir.scalar(-2.5)))  # 0 for tokens 0..2, positive after
    flipped = ir.mul(ir.add(ir.scalar(1), ir.mul(ir.scalar(-2), ir.func("step", late))), prog.tied_direction)
    result = check_descent(dataclasses.replace(prog, tied_direction=flipped))
    assert result.status == "fail" and "raises F for some token" in result.detail


VECTOR_GAIN = ("state x[d] via g = gamma * rmsnorm(x) + beta\n param gamma[d] ~ normal(0, 1) positive\n"
               " param beta[d] ~ normal(0, 0.1)\n input h[d]\n param W[d, d] ~ normal(0, 0.5)\n"
               " global E = 0.5 * (g - W @ h) . (g - W @ h)")


def test_a_step_in_u_through_a_per_channel_gain_is_warned_not_failed():
    """Under `wrt g`, x − η ∇_g E descends E(g(x)) only where dg/dx is positive semi-definite: a per-channel gain
    breaks that (a fact of the maths, warned), rmsnorm's Jacobian alone does not, and a wrong direction there
    still fails."""
    import dataclasses

    from energydsl import ir
    from energydsl.checks import check_descent

    prog = load(spec_text(VECTOR_GAIN, "gd(eta = 0.5)", " wrt g")).energy().program
    result = check_descent(prog)
    assert result.status == "warn" and "dg/dx is positive semi-definite, and here it is not" in result.detail
    plain = load(spec_text(VECTOR_GAIN.replace("gamma * rmsnorm(x) + beta", "rmsnorm(x)"), "gd(eta = 0.5)",
                           " wrt g")).energy().program
    assert check_descent(plain).status == "ok"
    uphill = dataclasses.replace(plain, tied_direction=ir.neg(plain.tied_direction))
    assert check_descent(uphill).status == "fail"


def test_dplr_reported_indefinite_psd_definite():
    dplr = load(spec_text(ENERGIES["l2"], "gd(eta = 1), precondition dplr(rank = 2)")).energy()
    psd = load(spec_text(ENERGIES["l2"], "gd(eta = 1), precondition psd(rank = 2)")).energy()
    r1 = [r for r in dplr.check() if r.name == "definite"][0]
    r2 = [r for r in psd.check() if r.name == "definite"][0]
    assert r1.status == "warn" and "indefinite" in r1.detail
    assert r2.status == "ok"


def test_concave_energy_warned():
    derived = load(spec_text(ENERGIES["linear"], "gd(eta = 1)")).energy()
    descent = [r for r in derived.check() if r.name == "descent"][0]
    assert descent.status == "warn" and "concave" in descent.detail


def test_gradient_symbolic_in_dims():
    """Derived once for symbolic dims: the same program evaluates at several sizes."""
    spec = load(spec_text(ENERGIES["l2"], "gd(eta = 1)"))
    for d in (2, 5):
        derived = spec.energy(d=d)
        inst = random_instance(derived.program, seed=1)
        x = inst.x.clone().requires_grad_(True)
        f = eval_tokens(derived.spec, derived.spec.energy, inst, {"z": x})
        (g,) = torch.autograd.grad(f.sum(), x)
        ours = eval_tokens(derived.spec, derived.program.gradient, inst, {"z": inst.x})
        assert torch.allclose(g, ours, rtol=1e-10, atol=1e-12)


def test_per_head_newton_is_the_pseudo_inverse_step():
    """On a quadratic head energy one Taylor term is exact: z − Σ_k W_kᵀ(W_k W_kᵀ)⁻¹ W_k z."""
    text = ("energy R(d = 4, heads = 2) { dim dh = d / heads  state z[d]  param W[heads, dh, d]\n"
            "  global F = sum[k](0.5 * (W[k] @ z) . (W[k] @ z))  optimizer newton(taylor = 1, damping = 0) per head }")
    derived = load(text).energy()
    inst = random_instance(derived.program, seed=0)
    ref = inst.x.clone()
    for w in inst.params["W"]:
        proj = w.T @ torch.linalg.inv(w @ w.T) @ w
        ref = ref - torch.einsum("ij,btj->bti", proj, inst.x)
    assert torch.allclose(run_program(derived.program, inst), ref, atol=1e-12)


def test_per_head_newton_needs_heads_no_wider_than_the_state():
    """A head map with more rows than the state has entries makes A Aᵀ singular: refused, with the shape
    (the update was numerical garbage, which only the update check caught)."""
    from energydsl.errors import SpecError

    text = ("energy R(d = 4, heads = 2) { dim dq = 2 * d  state z[d]  param W[heads, dq, d]\n"
            "  global F = sum[k](0.5 * (W[k] @ z) . (W[k] @ z))  optimizer newton(taylor = 1) per head }")
    with pytest.raises(SpecError, match=r"no more rows than z has entries; its shape is \[2\*d, d\] = \[8, 4\]"):
        load(text).energy()
    assert load(text.replace("dq = 2 * d", "dq = d")).energy()  # as wide as the state: allowed


@pytest.mark.parametrize("written, by_hand", [
    ("sum(((W @ z)^2)^0.5)", lambda z, h, W: (z @ W.T).abs().sum(-1)),
    ("sum(h * (z^2)^(-0.5))", lambda z, h, W: (h / z.abs()).sum(-1)),
    ("sum(h * sqrt(z^2)^3)", lambda z, h, W: (h * z.abs() ** 3).sum(-1)),
    ("sum(h * (z^4)^0.25)", lambda z, h, W: (h * z.abs()).sum(-1)),
    ("((z . h)^2)^0.5 - z . h", lambda z, h, W: (z * h).sum(-1).abs() - (z * h).sum(-1)),
    ("sum(h * (z^2)^c)", lambda z, h, W: (h * z.abs() ** 1.5).sum(-1)),  # a learned exponent, 0.75
    ("sum(h * (z^2)^3)", lambda z, h, W: (h * z ** 6).sum(-1)),  # a whole one keeps the sign: z^6
    ("sum(h * (z^a)^0.5)", lambda z, h, W: (h * z.abs()).sum(-1)),  # a fixed param a = 2: z^(a/2) was z
    ("sum(h * (z^e)^0.5)", lambda z, h, W: (h * z.abs()).sum(-1)),  # a dim e = d / 2 = 2, as well
    ("sum(h * sqrt(z^a)^3)", lambda z, h, W: (h * z.abs() ** 3).sum(-1)),
])
def test_a_power_of_an_even_power_keeps_the_absolute_value(written: str, by_hand) -> None:
    """`(x^2)^0.5` was built as `x` (and `(x^2)^c` as x^(2c), NaN for x < 0): the energy, hence every check's
    autograd of it, was another than the spec wrote, and every check passed. The layer's one gd step against
    autograd of the energy as written, in float64."""
    text = ("energy A(d = 4) {\n  dim e = d / 2\n  state z[d]\n  input h[d]\n  param W[d, d]\n  param c = 0.75 learn\n"
            "  param a = 2 fixed\n"
            f"  global F = {written} + 0.5 * z . z\n  optimizer gd(eta = 1)\n}}\n")
    module = load(text).module(dtype=torch.float64)
    torch.manual_seed(0)
    x, h = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)
    z = x.clone().requires_grad_()
    energy = by_hand(z, h, module.W.detach()) + 0.5 * (z * z).sum(-1)
    (grad,) = torch.autograd.grad(energy.sum(), z)
    assert torch.allclose(module(x, input=h), x - grad, rtol=1e-10, atol=1e-12)


def test_per_head_newton_refuses_a_head_map_that_reads_the_state():
    """`outer(W[k] @ z, z) @ z` sees z through A = (W_k z) zᵀ, which reads z itself: the step inverted that A Aᵀ
    as if it were linear, and only the update check's error of 1.0 showed it."""
    from energydsl.errors import SpecError

    text = ("energy R(d = 4, heads = 2) { dim dh = d / heads  state z[d]  context h[j, d] where j <= i\n"
            "  param W1[heads, dh, d]  param W2[heads, dh, d]\n"
            "  local E[k, j] = -(outer(W1[k] @ z, z) @ z) . (W2[k] @ h[j])\n"
            "  global F = sum[k](-logsumexp[j](-E[k, j]))  optimizer newton(taylor = 1) per head }")
    with pytest.raises(SpecError, match="only through one linear map"):
        load(text).energy()
    assert load(text.replace("outer(W1[k] @ z, z) @ z", "W1[k] @ z")).energy()  # linear in z: allowed


def test_per_head_on_a_product_with_the_heads_sum_says_what_the_energy_became():
    """sum[k](G_k * (z . z)) is a sum over heads as written, but the shared factor is taken out of the sum:
    the refusal shows the energy as it became, since "needs the form c * sum[k](...)" alone reads as wrong."""
    from energydsl.errors import SpecError

    text = ("energy R(d = 4, heads = 2) { state z[d]  param W[heads, 2, d]\n"
            "  global F = sum[k](sum(exp(W[k] @ z)) * (z . z))  optimizer newton(eta = 1) per head }")
    with pytest.raises(SpecError, match="needs a global energy of the form") as info:
        load(text).energy()
    assert info.value.hint.startswith("this energy reads F = ⟨z, z⟩ (Σ_{k} (Σ(exp(W_k z)))): a factor that reads "
                                      "`z` but not the head is taken out of the sum"), info.value.hint
    with pytest.raises(SpecError) as plain:  # no sum over heads at all: no hint to give
        load(text.replace("sum[k](sum(exp(W[k] @ z)) * (z . z))", "z . z")).energy()
    assert plain.value.hint is None


@pytest.mark.parametrize("opt", ["nag(beta = 0.5, eta = 0.4) steps 2 per head, precondition dplr(rank = 1)",
                                 "newton(taylor = 2, damping = 0.5) per head",
                                 "gd(eta = 0.4) per head, precondition covariance(tau = 0.1)"])
@pytest.mark.parametrize("size", ["sigmoid(w . x)", "sum[j](sigmoid(w . h[j]))"])
def test_per_head_keeps_a_per_token_step_size_in_each_heads_energy(opt: str, size: str) -> None:
    """sum[k](-sigmoid(w . x) * G_k): the token's step size (docs: a factor of the input) is taken out of the sum
    by the simplifier, and `per head` refused the energy as "not a sum of the heads' own energies". A factor that
    does not read the state goes back into each head's energy; the update replays on autograd per head. A step
    size that is a reduction over the context itself (`sum[j](...)`) is one too, not a second sum over heads."""
    text = ("energy S(d = 4, heads = 2) {\n  dim dh = d / heads\n  state z[d]\n  input x[d]\n"
            "  context h[j, d] where j < i\n  param W1[heads, dh, d] ~ normal(0, 0.4)\n"
            "  param W2[heads, dh, d] ~ normal(0, 0.4)\n  param w[d] ~ normal(0, 0.5)\n"
            f"  global F = sum[k](-{size} * logsumexp[j]((W1[k] @ z) . (W2[k] @ h[j])))\n"
            f"  optimizer {opt}\n}}\n")
    layer = load(text).energy()
    rows = {r.name: r for r in layer.check()}
    assert rows["update"].status == "ok" and rows["gradient"].status == "ok", rows["update"].detail
    assert not [r for r in rows.values() if not r.ok], rows
    module = load(text).module().double()  # and the compiled layer runs the program
    inputs = {k: v.double() for k, v in module.example_inputs(2, 5).items()}
    raw = dict(module.named_parameters())
    expected = run_program(layer.program, instance_from_params(layer.program, raw, inputs["x"], inputs.get("context"),
                                                               inputs.get("input")))
    torch.testing.assert_close(module(**inputs), expected)


def test_per_head_with_a_term_beside_the_heads_sum_says_to_move_it():
    from energydsl.errors import SpecError

    text = ("energy R(d = 4, heads = 2) { state z[d]  param W[heads, 2, d]\n"
            "  global F = mean[k](sum(exp(W[k] @ z))) + 0.1 * (z . z)  optimizer gd(eta = 1) per head }")
    with pytest.raises(SpecError, match="needs a global energy of the form") as info:
        load(text).energy()
    assert "a term beside the sum belongs to no head; move it inside the sum" in info.value.hint, info.value.hint
    with pytest.raises(SpecError) as two:  # two sums over heads: no term belongs to no head
        load(text.replace("0.1 * (z . z)", "sum[k](sum(W[k] @ z))")).energy()
    assert two.value.hint.endswith("write these sums as one, sum[k](A_k + B_k) (a mean[k] is sum[k] / heads)"), \
        two.value.hint


PER_HEAD = ("energy R(d = 4, heads = 2) {{ dim dh = d / heads  state z[d]\n"
            "  context h[j, d] where j <= i  param W[heads, dh, d]  param K[heads, dh, d]\n"
            "  global F = {reduce}[k](-logsumexp[j](-0.5 * (W[k] @ z - K[k] @ h[j]) . (W[k] @ z - K[k] @ h[j])))\n"
            "  optimizer {opt} }}")
PER_HEAD_OPTIMIZERS = ["newton(taylor = 2, damping = 0.3, eta = 0.7) per head",
                       "newton(taylor = 1, damping = 0) per head, precondition diag",
                       "gd(eta = 0.5) per head, precondition psd(rank = 2)",
                       "momentum(beta = 0.5, eta = 0.5) steps 2 per head, precondition dplr(rank = 1)",
                       "nag(beta = 0.5, eta = 0.5) steps 2 per head, precondition scalar"]


@pytest.mark.parametrize("reduce", ["sum", "mean"])
@pytest.mark.parametrize("opt", PER_HEAD_OPTIMIZERS)
def test_per_head_optimizers_are_replayed_on_autograd(opt, reduce):
    """`per head`: each head's Newton step in its own coordinates (from autograd's gradient and Hessian in z)
    and each head's preconditioner on its own term, replayed and compared with the derived program."""
    results = {r.name: r for r in run_checks(load(PER_HEAD.format(reduce=reduce, opt=opt)).energy().program)}
    assert results["update"].status == "ok", results["update"].detail
    assert "per head" in results["update"].detail


@pytest.mark.parametrize("opt, broken", [
    ("newton(taylor = 2, damping = 0.3) per head", "_neumann"),  # the Taylor terms dropped
    ("gd(eta = 1) per head, precondition dplr(rank = 1)", "_precondition"),  # each head's P dropped
])
def test_the_per_head_replay_catches_a_wrong_derivation(monkeypatch, opt, broken):
    from energydsl import optimizers
    from energydsl.checks import check_update

    if broken == "_neumann":
        monkeypatch.setattr(optimizers, "_neumann", lambda spec, g, point: g)
    else:
        made = optimizers._precondition  # it still makes P's params, then leaves d unmultiplied
        monkeypatch.setattr(optimizers, "_precondition", lambda *args: (made(*args), (args[1], None))[1])
    result = check_update(load(PER_HEAD.format(reduce="sum", opt=opt)).energy().program)
    assert result.status == "fail", result.detail


@pytest.mark.parametrize("opt", ["gd(eta = 0.5), precondition covariance(tau = 0.3)",
                                 "momentum(beta = 0.5, eta = 0.5) steps 2 per head, precondition covariance(tau = 0.2)",
                                 "nag(beta = 0.5, eta = 0.5) steps 2, precondition covariance(tau = 0.2 fixed)"])
def test_covariance_is_replayed_with_the_explicit_covariance_matrix(opt):
    results = {r.name: r for r in run_checks(load(PER_HEAD.format(reduce="sum", opt=opt)).energy().program)}
    assert results["update"].status == "ok", results["update"].detail
    assert results["definite"].status == "ok", results["definite"].detail


def test_the_covariance_replay_catches_a_dropped_mean_term(monkeypatch):
    """(I + τ Cov) v̄ without its − τ (v̄·v̄) v̄: the explicit matrix disagrees."""
    from energydsl import ir, optimizers
    from energydsl.checks import check_update

    def uncentred(e, tau):
        mapping = {vbar: ir.add(vbar, ir.mul(tau, ir.reduce("sum", vbar.index, ir.mul(p, ir.dot(v, vbar), v))))
                   for vbar, p, v in optimizers.weighted_sums(e)}
        return ir.substitute(e, mapping), len(mapping)

    monkeypatch.setattr(optimizers, "_covariance", uncentred)
    opt = "gd(eta = 1), precondition covariance(tau = 0.5)"
    result = check_update(load(PER_HEAD.format(reduce="sum", opt=opt)).energy().program)
    assert result.status == "fail", result.detail


def test_covariance_on_a_matrix_state_says_why_it_is_refused():
    from energydsl.errors import SpecError

    text = ("energy S(dk = 4, dv = 2) {\n state Z[dk, dv]\n context C[j, dk, dv] where j <= i\n param a[dk]\n"
            " param b[dk]\n global F = -logsumexp[j]((Z^T @ a) . (C[j]^T @ b))\n"
            " optimizer gd(eta = 0.5), precondition covariance(tau = 0.2)\n}")
    with pytest.raises(SpecError, match="needs a softmax-weighted sum of vectors") as info:
        load(text).energy()
    assert info.value.hint == "a matrix state's gradient weights matrices (outer products), not vectors"


@pytest.mark.parametrize("tau", ["-50", "-0.005 fixed"])
def test_a_negative_tau_fails_the_definite_check(tau: str):
    """A small τ < 0 held on the 8 draws (`positive-definite at τ = -0.005`), yet I + τ C turns indefinite once
    the values are large: any fixed τ < 0 fails."""
    opt = f"gd(eta = 1), precondition covariance(tau = {tau})"
    results = {r.name: r for r in run_checks(load(PER_HEAD.format(reduce="sum", opt=opt)).energy().program)}
    assert results["definite"].status == "fail" and "τ must be ≥ 0" in results["definite"].detail


def test_checks_handle_linear_energy_and_column_params():
    text = ("energy L(n = 3) { state z[n]  param a[n]  param M[n, 1]\n"
            "  global F = a . z + sum(M^T @ z) + (a @ (M @ M^T)) . z  optimizer gd(eta = 1) }")
    results = load(text).energy().check()
    assert all(r.ok for r in results), [r for r in results if not r.ok]


@pytest.mark.parametrize("name", ["linear", "mlp", "matrix", "huber"])
def test_sympy_line_derivative_gives_every_partial(name):
    """The sympy check differentiates once along z = p + t·w; each partial must equal sympy.diff per element."""
    import sympy as sp

    from energydsl import sympy_instance

    wrt = " wrt " + ENERGIES[name].split("via ")[1].split(" ")[0] if "via" in ENERGIES[name] else ""
    prog = load(spec_text(ENERGIES[name], "gd(eta = 1)", wrt)).energy().program
    grads, info = sympy_instance.gradient_at(prog, seed=7, seq=3)
    f, syms, _, _ = sympy_instance.build(prog, 7, 3, 2)
    flat = list(syms) if isinstance(syms, sp.Matrix) else [syms]
    point = info["point"]
    assert set(point) == set(flat)
    per_element = [float(sp.diff(f, s).xreplace(point).evalf()) for s in flat]
    assert grads == pytest.approx(per_element, rel=1e-13, abs=1e-13)


@pytest.mark.parametrize("energy", ["sum(relu(z - h))", "sum(integral(sign)(z - h))"])
def test_the_sympy_instance_is_not_drawn_on_a_kink(energy):
    """The instance's values lie on a grid of tenths; the point it differentiates at is shifted off that grid,
    so that z_k = h_k (relu's kink, where SymPy's Heaviside(0) = 1/2 and torch's relu'(0) = 0) never happens.
    On the grid it did, for this energy at the check's seed."""
    derived = load(f"energy E(d = 4) {{\n state z[d]\n input h[d]\n global F = {energy}\n}}").energy()
    results = {r.name: r for r in run_checks(derived.program)}
    assert results["sympy"].status == "ok", results["sympy"].detail


def test_sympy_check_catches_a_wrong_gradient():
    from energydsl import checks, ir

    prog = load(spec_text(ENERGIES["l2"], "gd(eta = 1)")).energy().program
    assert checks.check_sympy(prog).status == "ok"
    prog.gradient = ir.add(prog.gradient, ir.mul(ir.scalar("1/1000"), prog.point))
    assert checks.check_sympy(prog).status == "fail"


def test_checks_restore_torch_threads():
    """The checks run single-threaded (tiny tensors) and give the caller its thread count back."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run_checks(load(spec_text(ENERGIES["l2"], "gd(eta = 1)")).energy().program)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_ir_caches_keep_structural_equality():
    """Cached shape/free/hash: separately built equal trees are equal, and unhoist's memo changes nothing."""
    import sympy as sp

    from energydsl import ir
    from energydsl.optimizers import unhoist

    d, n = sp.Symbol("d"), sp.Symbol("n")

    def build():
        z, w, h = ir.Var("z", "state", (d,)), ir.Var("W", "param", (d, d)), ir.Var("h", "param", (n, d))
        key = ir.Let("c0", ir.matmul(w, z))
        return ir.add(ir.mul(ir.scalar(2), key), ir.reduce("sum", "j", ir.mul(ir.Index(h, "j"), ir.dot(z, key))))

    a, b = build(), build()
    assert a is not b and a == b and hash(a) == hash(b)
    assert a.shape == b.shape == (d,) and a.free == frozenset() and a.children == b.children
    assert a != ir.add(a, a)
    plain = ir.substitute(a, {x: x.body for x in ir.walk(a) if isinstance(x, ir.Let)})
    assert unhoist(a) == plain and unhoist(b) is unhoist(a)
    import pickle

    back = pickle.loads(pickle.dumps(a))
    assert "_hash" not in back.__dict__ and back == a and hash(back) == hash(a)


def test_closed_form_integrals_are_kept_on_disk(tmp_path, monkeypatch) -> None:
    """∫f is computed by SymPy once per machine: a second process reads the same expression back, and a
    damaged file is recomputed, not trusted."""
    import sympy as sp

    from energydsl.functions import REGISTRY, X, _closed_form_integral

    monkeypatch.setenv("ENERGYDSL_CACHE", str(tmp_path))
    formula = REGISTRY["gelu"].formula
    fresh = _closed_form_integral(formula)
    files = list((tmp_path / "integrals").glob("*.txt"))
    assert len(files) == 1
    assert _closed_form_integral(formula) == fresh  # read back from the file, structurally equal
    assert sp.simplify(sp.diff(fresh, X) - formula) == 0
    files[0].write_text(sp.srepr(X**3))  # what is on disk is what is used (no SymPy integration)
    assert _closed_form_integral(formula) == X**3
    files[0].write_text("Mul(Symbol('x'), ")  # a torn write
    assert _closed_form_integral(formula) == fresh
    # ∫SiLU is left partly unevaluated by SymPy (a NonElementaryIntegral): kept as a plain Integral
    silu = REGISTRY["silu"].formula
    cold = _closed_form_integral(silu)
    assert len(list((tmp_path / "integrals").glob("*.txt"))) == 2
    warm = _closed_form_integral(silu)
    assert warm == cold and warm.has(sp.Integral)
    assert sp.simplify(sp.diff(warm, X) - silu) == 0


# Terms of a reduction's body that do not use its index (a regulariser written inside the sum): each counts
# once per term of the reduction, |j| or |k| times in all.
INDEX_FREE_TERMS = {
    "sum-context": ("state z[d]\n context h[j, d] where j <= i\n param W[d, d]\n"
                    " global F = sum[j](-(z . (W @ h[j])) + 0.1 * z . z)"),
    "mean-heads": ("state z[d]\n context h[j, d] where j <= i\n param W1[m, d, d]\n"
                   " global F = mean[k](-logsumexp[j](z . (W1[k] @ h[j])) + 0.5 * z . z)"),
    "sum-heads-linear": ("state z[d]\n input h[d]\n param a[m]\n global F = sum[k](a[k] * (z . z) + h . z)"),
}


@pytest.mark.parametrize("name", sorted(INDEX_FREE_TERMS))
def test_index_free_terms_of_a_reduction_count_once_per_term(name):
    derived = load(spec_text(INDEX_FREE_TERMS[name], "gd(eta = 0.5)")).energy()
    results = {r.name: r for r in run_checks(derived.program)}
    for check in ("gradient", "sympy", "update"):
        assert results[check].status == "ok", results[check].detail


@pytest.mark.parametrize("backend", ["interpreter", "module"])
def test_mean_over_an_empty_strict_context_is_zero_not_nan(backend):
    """At the first token a strict context is empty: mean[j] of it is 0 (docs: the count is clamped to 1), and
    so is its gradient, in the interpreter and in the generated module."""
    from energydsl.codegen import module_class
    from energydsl.instance import instance_from_params

    derived = load(spec_text("state z[d]\n context h[j, d] where j < i\n"
                             " global F = -mean[j](z . h[j] - 0.1 * z . z)", "gd(eta = 0.5) steps 2")).energy()
    module = module_class(derived)().double()
    x = module.example_input(2, 5).double()
    ref = run_program(derived.program, instance_from_params(derived.program, dict(module.named_parameters()), x))
    out = ref if backend == "interpreter" else module(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, 0], x[:, 0])  # nothing to attend to: the first token does not move
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


def test_an_entry_of_the_differentiated_variable_has_no_silent_zero_derivative() -> None:
    """The language refuses `z[k]` (a located error); the calculus, reached some other way, raises rather
    than taking the entry as a constant, in both modes."""
    from energydsl import ir
    from energydsl.calculus import NotDifferentiable, directional, gradient

    z = ir.Var("z", "state", (4,))
    f = ir.reduce("sum", "k", ir.mul(ir.Index(z, "k"), ir.Index(z, "k")))
    with pytest.raises(NotDifferentiable, match="an entry of a value of `z`"):
        gradient(f, z)
    with pytest.raises(NotDifferentiable, match="an entry of a value of `z`"):
        directional(f, z, z)


@pytest.mark.parametrize("body, want", [
    # a learned temperature per head: d/dz of t_k lse(s / t_k) is t_k softmax(s / t_k) ds/dz / t_k
    ("state z[d]\n context h[j, d] where j <= i\n param W[d, d]\n param t[m] positive\n"
     " global F = -sum[k](t[k] * logsumexp[j]((z . (W @ h[j])) / t[k]))",
     "∇_z F = -(Σ_{k} (Σ_{j<=i} (softmax_j(⟨z, W h_j⟩ (t_k^-1)) (W h_j))))"),
    # a gain per channel, element-wise; a / a alone is a vector of ones, not the scalar 1
    ("state z[d]\n input h[d]\n param W[d, d]\n param a[d] positive\n"
     " global F = -sum(a * softplus((W @ z) / a)) - sum(a * (z / a)) - h . z",
     "∇_z F = -(Wᵀ sigmoid((W z) ⊙ ((a)^∘-1))) − 𝟙 − h"),  # each entry's reciprocal, not an inverse
])
def test_a_factor_times_its_reciprocal_cancels_and_stays_verified(body: str, want: str) -> None:
    """`x x^-1` dropped from a product (SymPy does it for scalar coefficients, the tensor IR did not): the
    gradient printed `t_k (t_k^-1)` and the module computed both; still equal to autograd's, in every check."""
    from energydsl.codegen import module_class
    from energydsl.instance import instance_from_params
    from energydsl.ir import Ones, Var, mul, power

    derived = load(spec_text(body, "momentum(beta = 0.5, eta = 0.5) steps 2")).energy()
    gradient = next(line for line in derived.equations("text").splitlines() if "gradient" in line)
    assert gradient.strip().removeprefix("gradient").strip() == want
    assert all(r.ok for r in run_checks(derived.program)), run_checks(derived.program)
    module = module_class(derived)().double()
    x = module.example_input(2, 5).double()
    raw = dict(module.named_parameters())
    torch.testing.assert_close(module(x), run_program(derived.program, instance_from_params(derived.program, raw, x)))

    a = Var("a", "param", (4,))
    assert mul(a, power(a, -1)) == Ones((4,)) and mul(power(a, 2), power(a, -2), a) == a
    assert mul(power(a, 2), power(a, -1)) != a  # other powers of one base stay apart (lowering matches them)


def test_relu_times_its_step_is_the_relu_and_stays_verified() -> None:
    """The chain rule writes `relu(z) ∘ step(z)` for the gradient of `½ relu(z)·relu(z)` (the Energy
    Transformer's Hopfield term): it is `relu(z)` everywhere, so the gradient prints and computes that; every
    check still holds. A step of another argument stays."""
    from energydsl.codegen import energy_source, module_class
    from energydsl.instance import instance_from_params
    from energydsl.ir import Func, Var, mul

    body = "state z[d]\n input h[d]\n param W[m, d]\n global F = 0.5 * relu(W @ z) . relu(W @ z) - h . z"
    derived = load(spec_text(body, "gd(eta = 0.5)")).energy()
    gradient = next(line for line in derived.equations("text").splitlines() if "gradient" in line)
    assert gradient.strip().removeprefix("gradient").strip() == "∇_z F = Wᵀ relu(W z) − h"
    assert all(r.ok for r in run_checks(derived.program)), run_checks(derived.program)
    assert "> 0" not in energy_source(derived, "torch").split("def forward", 1)[1]
    module = module_class(derived)().double()
    x = module.example_input(2, 5).double()
    torch.testing.assert_close(module(x), run_program(
        derived.program, instance_from_params(derived.program, dict(module.named_parameters()), x)))

    z, w = Var("z", "state", (4,)), Var("w", "state", (4,))
    assert mul(Func("relu", z), Func("step", z)) == Func("relu", z)
    assert mul(Func("step", z), z, Func("relu", z)) == mul(z, Func("relu", z))
    assert len(mul(Func("relu", z), Func("step", w)).factors) == 2


@pytest.mark.parametrize("body,reference", [
    ("norm(z)", lambda z: torch.linalg.vector_norm(z, dim=-1)),
    ("norm(z, 3)", lambda z: torch.linalg.vector_norm(z, 3, dim=-1)),
    ("norm(z, 1.5)", lambda z: torch.linalg.vector_norm(z, 1.5, dim=-1)),
    ("mean(z * z)", lambda z: (z * z).mean(-1)),
])
def test_norms_and_means_step_as_torchs(body: str, reference) -> None:
    """The built-ins' formulas against torch's own (the checks compare the derivation with autograd of the same
    formula, so a wrong p-norm or mean would pass them): one gd step is -eta times the reference's gradient."""
    from energydsl import load

    spec = load(f"energy E(d = 5, eta = 0.5) {{\n  state z[d]\n  global F = {body}\n  optimizer gd(eta = eta)\n}}\n")
    assert all(r.ok for r in spec.energy().check())
    x = torch.randn(2, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    step = spec.module(d=5).double()(x, delta=True)
    x.requires_grad_(True)
    (grad,) = torch.autograd.grad(reference(x).sum(), x)
    torch.testing.assert_close(step, -0.5 * grad, rtol=1e-12, atol=1e-12)


def test_an_entrywise_reciprocal_and_a_folded_gradient_print_as_computed() -> None:
    """`1 / (W * W + 1)` of a matrix printed `(…)⁻¹`, a matrix inverse, where the program takes each entry's
    reciprocal; `A (∇_Z F)ᵀ` printed `A ∇_Z Fᵀ` (LaTeX `\\nabla_{Z} F^{\\top}`, and MathML an `msup` of 3 children)."""
    import xml.etree.ElementTree as ET

    reciprocal = load("energy Q(d = 3) {\n  state x[d]\n  param W[d, d]\n"
                      "  global F = 0.5 * x . ((1 / (W * W + 1)) @ x)\n}\n").energy()
    assert "(W ⊙ W + 𝟙)^∘-1" in reciprocal.equations("text") and "⁻¹" not in reciprocal.equations("text")
    assert "\\right)^{\\circ -1}" in reciprocal.equations("latex")
    folded = load("energy R(d = 3) {\n  state Z[d, d]\n  param A[d, d]\n"
                  "  global F = sum((A @ Z^T) * Z) + sum(Z * Z * Z) / 3\n  optimizer newton(eta = 0.5)\n}\n").energy()
    assert "A (∇_Z F)ᵀ" in folded.equations("text") and "λ ∇_Z F" in folded.equations("text")
    assert "A \\left(\\nabla_{Z} F\\right)^{\\top}" in folded.equations("latex")
    for energy in (reciprocal, folded):
        for block in re.findall(r"<math.*?</math>", energy.equations("mathml"), flags=re.S):
            for node in ET.fromstring(block).iter():
                if node.tag.endswith(("msup", "msub")):
                    assert len(node) == 2, ET.tostring(node, encoding="unicode")


def test_latex_keeps_textstyle_to_its_sign_and_names_tanh() -> None:
    """`\\textstyle\\int tanh` set t·a·n·h in italics and left the rest of its group in text style."""
    latex = load("energy A(d = 3) {\n  state z[d]\n  param W[d, d]\n"
                 "  global F = sum(integral(tanh)(W @ z)) + sum(integral(relu)(z))\n}\n").energy().equations("latex")
    assert "{\\textstyle\\int}\\tanh\\left(" in latex and "{\\textstyle\\int}\\operatorname{relu}" in latex, latex
    assert "\\textstyle\\int " not in latex

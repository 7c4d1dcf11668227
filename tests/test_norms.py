"""rmsnorm and layernorm in generated code (`energydsl/codegen/norms.py`): found in the expanded IR, printed as
torch's fused ops, equal to the interpreter in float64 forward and differentiable as the chain was."""

import re

import pytest
import sympy as sp
import torch

import energydsl
from energydsl import ir
from energydsl.codegen import energy_source, module_class
from energydsl.codegen.norms import Norm, affine_norm, norm_factors, norm_form
from energydsl.derived import Derived
from energydsl.instance import instance_from_params, run_program

d = sp.Symbol("d")
X = ir.Var("x", "state", (d,))
Y = ir.Var("y", "state", (d,))
EPS = ir.Scalar(sp.Rational(1, 10**6))


def _rms(y: ir.Expr, coefficient=1 / d, eps: ir.Expr = EPS, exponent=sp.Rational(-1, 2), times: ir.Expr | None = None):
    """(c y·y + eps)^exponent * times, built as semantics_expr builds rmsnorm (times = y there)."""
    scale = ir.power(ir.add(ir.mul(ir.Scalar(coefficient), ir.dot(y, y)), eps), exponent)
    return ir.mul(scale, y if times is None else times)


def _centred(x: ir.Expr, coefficient=1 / d) -> ir.Expr:
    return ir.add_broadcast(x, ir.neg(ir.mul(ir.Scalar(coefficient), ir.sum_all(x))))


def test_the_expanded_norms_are_found() -> None:
    assert norm_form(_rms(X)) == Norm("rms_norm", X, 1e-6)
    assert norm_form(_rms(_centred(X))) == Norm("layer_norm", X, 1e-6)
    assert norm_form(_rms(X, eps=ir.Scalar(sp.Rational(1, 10**5)))).eps == 1e-5


def test_a_matrix_states_norm_is_found_over_both_axes() -> None:
    """RMT's `Z / sqrt(Z·Z / (dk dv) + ε)` is F.rms_norm over the matrix's two axes; the mean over one axis
    only (1/dk) is no norm torch has."""
    dk, dv = sp.symbols("dk dv")
    z = ir.Var("Z", "state", (dk, dv))
    assert norm_form(_rms(z, coefficient=1 / (dk * dv))) == Norm("rms_norm", z, 1e-6)
    assert norm_form(_rms(_centred(z, coefficient=1 / (dk * dv)), coefficient=1 / (dk * dv))) == \
        Norm("layer_norm", z, 1e-6)
    assert norm_form(_rms(z, coefficient=1 / dk)) is None


def test_a_norm_among_other_factors_is_one_value() -> None:
    """`g * rmsnorm(x)` reaches the IR as one flat product; the norm's pair comes out as the norm alone is built,
    so both print as one shared F.rms_norm."""
    g = ir.Var("g", "param", (d,))
    product = ir.mul(g, _rms(X))
    assert isinstance(product, ir.Mul) and len(product.factors) == 3
    assert norm_factors(product) == (_rms(X), (g,))
    assert norm_factors(ir.mul(g, _rms(X, times=Y))) is None
    assert norm_factors(_rms(X)) is None  # the norm alone is norm_form's


DELTA = ir.Var("delta", "param", (d,))
GAMMA = ir.Scalar(sp.Symbol("gamma"))  # a learned scalar reaches the IR as a symbol


def test_a_norms_gain_and_bias_go_into_the_fused_op() -> None:
    """`layernorm(x) + delta` and `gamma * layernorm(x) + delta` (NRGPT's and the Energy Transformer's state
    maps) are one F.layer_norm with a bias and a weight; other terms of the sum stay apart."""
    ln = _rms(_centred(X))
    plain = Norm("layer_norm", X, 1e-6)
    assert affine_norm(ir.add(ln, DELTA)) == (plain._replace(bias=DELTA), (ln, DELTA), ())
    gained = ir.mul(GAMMA, ln)
    found, taken, rest = affine_norm(ir.add(gained, DELTA, Y))
    assert found == plain._replace(weight=GAMMA, bias=DELTA) and set(taken) == {gained, DELTA} and rest == (Y,)
    assert affine_norm(ir.add(_rms(X), DELTA)) is None  # rms_norm takes no bias
    assert affine_norm(ir.add(gained, Y)) is None  # a gain alone stays a product (the norm may be shared)
    assert affine_norm(ir.add(_rms(X), Y)) is None
    assert affine_norm(ir.add(ln, Y)) is None  # a token's own vector is no bias
    assert affine_norm(ir.add(ln, ir.mul(ir.Scalar(2), ir.Ones((d,))))) is None  # constants stay apart
    assert affine_norm(ir.add(ir.mul(ir.func("exp", Y), ln), DELTA)) is None  # a per-token gain: not affine


HALF_CENTRED = _centred(X, coefficient=1 / (2 * d))


@pytest.mark.parametrize("expr,want", [
    (_rms(X, times=Y), None),  # normalises x but multiplies y
    (_rms(X, coefficient=1 / (2 * d)), None),  # not the mean square
    (_rms(X, exponent=sp.Rational(-1, 3)), None),
    (_rms(X, eps=ir.Var("eps", "param", ())), None),  # a learned epsilon: not a constant torch takes
    (_rms(HALF_CENTRED), Norm("rms_norm", HALF_CENTRED, 1e-6)),  # an RMS norm of y, not x layer-normed
], ids=["other-vector", "coefficient", "exponent", "learned-eps", "half-centred"])
def test_look_alikes_are_not_taken_for_norms(expr: ir.Expr, want: Norm | None) -> None:
    assert isinstance(expr, ir.Mul) and norm_form(expr) == want


NORMED = [
    ("examples/cem/steps2.energy", "CEMAttentionSteps2", "rms_norm", 1),  # the `via` norm, in the steps loop
    ("examples/models/cem.energy", "CEMAttention", "rms_norm", 2),  # and the context's `let hn[j] = rmsnorm(h[j])`
    ("examples/nrgpt/ff1.energy", "NRGPTFF1", "layer_norm", 1),
    ("examples/rmt/attention.energy", "RMTAttention", "rms_norm", 2),  # matrix states: the state's and the context's
    ("examples/rmt/feed-forward.energy", "RMTFeedForward", "rms_norm", 1),
]
IDS = [name for _, name, _, _ in NORMED]


@pytest.mark.parametrize("path,name,function,count", NORMED, ids=IDS)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_generated_norms_are_torchs_fused_ops(path: str, name: str, function: str, count: int,
                                               backend: str) -> None:
    """The forward calls F.rms_norm / F.layer_norm where the chain (a dot, a scale, + eps, ** -0.5, a product)
    was printed."""
    forward = energy_source(energydsl.load(path).energy(name), backend).split("def forward", 1)[1]
    assert len(re.findall(rf"F\.{function}\(", forward)) == count, forward
    assert "** -0.5" not in forward, forward


NUMBER_GAIN = """
energy NumberGain(d = 8) {
  param   delta[d] ~ normal(0, 0.02)
  state   x[d] via g = sqrt(d) * layernorm(x) + delta
  param   W[d, d] ~ normal(0, 0.02)
  global  F = -sum(softplus(W @ g))
  optimizer gd(eta = 1) wrt g
}
"""


@pytest.mark.parametrize("path,name,weight", [
    ("examples/nrgpt/attention.energy", "NRGPTAttention", None),
    # a learned scalar gain is a 0-d tensor already: spread over the features as it is
    ("examples/hopfield/energy-transformer.energy", "EnergyTransformer", r"gamma\.expand\(8\)"),
    # a number is made a tensor of the input's dtype and device first
    (NUMBER_GAIN, "NumberGain", r"torch\.as_tensor\(2\.828\d*, dtype=(\w+)\.dtype, device=\1\.device\)\.expand\(8\)"),
], ids=["bias", "learned-gain", "number-gain"])
def test_generated_norms_take_their_gain_and_bias(path: str, name: str, weight: str | None, tmp_path) -> None:
    """The state's (and the context's) `[gain *] layernorm(.) + delta` are each one F.layer_norm: no separate
    scale or addition of delta; values equal the interpreter's."""
    if path.lstrip().startswith("energy"):
        (tmp_path / "spec.energy").write_text(path)
        path = tmp_path / "spec.energy"
    derived = energydsl.load(path).energy(name)
    forward = energy_source(derived, "torch").split("def forward", 1)[1]
    calls = re.findall(r"F\.layer_norm\((\w+), \(\d+,\), (.*), eps=1e-06\)", forward)
    assert {x for x, _ in calls} == ({"x_"} if name == "NumberGain" else {"h", "x_"}), forward
    for _, args in calls:
        assert args.endswith("bias=delta_"), forward
        assert re.fullmatch(rf"weight={weight}, bias=delta_", args) if weight else args == "bias=delta_", forward
    assert "delta_[None, None]" not in forward, forward
    _matches_interpreter(derived)


@pytest.mark.parametrize("path,name,function,count", NORMED, ids=IDS)
def test_generated_norms_compute_the_derived_values(path: str, name: str, function: str, count: int) -> None:
    """Forward values equal the interpreter's in float64; gradients pass gradcheck."""
    derived = energydsl.load(path).energy(name)
    _matches_interpreter(derived)


NORM_GATE = """
energy NormGate(d = 8) {
  state   x[d] via u = rmsnorm(x)
  param   W[d, d] ~ normal(0, 0.02)
  global  F = -sum(u * softplus(W @ u))
  optimizer gd(eta = 1) wrt u
}
"""


def test_a_norm_inside_a_gated_product_is_the_gates_value(tmp_path) -> None:
    """`u ∘ sigmoid(W u)` with u = rmsnorm(x) reaches the IR as one product of three factors; on the triton
    backend the norm is the fused gate's value, computed once with the norm the projection reads. Values
    equal the interpreter's."""
    spec = tmp_path / "norm-gate.energy"
    spec.write_text(NORM_GATE)
    derived = energydsl.load(spec).energy()
    forward = energy_source(derived, "triton").split("def forward", 1)[1]
    normed = re.findall(r"(u) = F\.rms_norm\(x_", forward)  # the value by its `via` name
    assert len(normed) == 1, forward
    assert re.search(rf"gated_activation\(t\d+, {normed[0]}, 'sigmoid'\)", forward), forward
    _matches_interpreter(derived)


def _matches_interpreter(derived: Derived) -> None:
    """The torch backend's module, weights moved off their init, against the interpreter in float64 (1e-10);
    its gradients against finite differences (gradcheck)."""
    module = module_class(derived, "torch")().double()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = module.example_input(2, 5).double()
    raw = dict(list(module.named_parameters()) + list(module.named_buffers()))
    want = run_program(derived.program, instance_from_params(derived.program, raw, x))
    torch.testing.assert_close(module(x), want, rtol=1e-10, atol=1e-10)
    assert torch.autograd.gradcheck(lambda x: module(x), (x.requires_grad_(),))

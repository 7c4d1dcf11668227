"""`decay(r[j])`, the data-dependent cumulative gate ∏ r_s over the context tokens after j (and a step size per
token, a factor of the energy): checked against autograd and SymPy, the generated modules against the reference
interpreter (float64, gradients included), the triton backend against the torch backend, and the spellings the
language refuses."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import largest_tensor_made
from test_codegen import _matches_interpreter
from test_triton_backend import _compare_backends

from energydsl import load
from energydsl.codegen import energy_source, module_class
from energydsl.errors import SpecError

FILE = "tests/data/data-dependent-decay.energy"
# A gate on sigmoid weights: a weighted sum of the context that no kernel takes with a gate, so its (T, T) weights
# are formed; kept out of tests/data, whose every energy runs linear in T on the triton backend.
GATED_SIGMOID = """energy GatedSigmoidWeights(d = 6) {
  state   z[d]
  context h[j, d] where j < i
  param   wg[d] ~ normal(0, 0.5)
  local   E[j] = decay(sigmoid(wg . h[j])) * integral(sigmoid)(z . h[j])
  global  F = -sum[j](E[j])
  optimizer gd(eta = 0.5)
}
"""
ENERGIES = ["DataGate", "HeadGatesStrict", "SharedQKHeadGates", "MambaRate", "SquaredGate", "ForgettingAttention",
            "NewtonGate", "MomentumForget", "TokenStep", "ForgetWithDecay", "SigmoidForget", "GatedSigmoidWeights"]
SOFTMAX_GATES = ["ForgettingAttention", "MomentumForget", "ForgetWithDecay"]
LINEAR = ENERGIES[:5]  # the gate times (q . k_j) v_j: chunked linear attention with per-token log decays


def _derived(name: str):
    return load(GATED_SIGMOID if name == "GatedSigmoidWeights" else FILE).energy(name)


@pytest.mark.parametrize("name", ENERGIES)
def test_every_check_passes(name: str) -> None:
    """Gradient, SymPy, update, causality (a strict context's gate reads no rate of token i), descent, params."""
    results = _derived(name).check()
    assert [(r.name, r.detail) for r in results if r.status == "fail"] == []


@pytest.mark.parametrize("T", [7, 1, 70])  # 70: past one chunk (64) of the linear-attention ops
@pytest.mark.parametrize("name", ENERGIES)
def test_modules_match_the_interpreter(name: str, T: int) -> None:
    """The interpreter multiplies the rates over an (i, j, s) table; the module sums their logs (cumulative
    sums, or the linear-attention ops' chunked decays): values and every training gradient agree."""
    _matches_interpreter(_derived(name), T)


@pytest.mark.parametrize("name", LINEAR)
def test_gated_sums_take_linear_attention_and_no_t_by_t_tensor(name: str) -> None:
    derived = load(FILE).energy(name)
    forward = energy_source(derived).split("def forward")[1]
    assert re.search(r"linear_attention\([^\n]*log_decay=t\d+", forward), forward
    assert "mask" not in forward
    module = module_class(derived)()
    x = module.example_input(2, 256).requires_grad_()
    largest = largest_tensor_made(lambda: module(x).square().sum().backward())
    assert largest < 2 * 256 * 256, largest  # the chunks' (B, H, T / 64, 64, 64) scores at most


def test_rates_are_laid_out_once_before_the_steps() -> None:
    """MambaRate runs 2 steps: its log rates read only the context, so they are computed in the prologue."""
    forward = energy_source(load(FILE).energy("MambaRate")).split("def forward")[1]
    loop = forward.index("for ")
    assert forward.count("F.logsigmoid(") == 1 and forward.index("F.logsigmoid(") < loop
    assert forward.count("log_decay=") == 1 and forward.index("log_decay=") > loop


def test_a_strict_context_shifts_the_queries_instead_of_reading_token_i() -> None:
    forward = energy_source(load(FILE).energy("HeadGatesStrict")).split("def forward")[1]
    assert "F.pad(" in forward and "strict=False" in forward


@pytest.mark.parametrize("name", ENERGIES)
def test_triton_backend_matches_torch_backend(name: str) -> None:
    derived = _derived(name)
    source = energy_source(derived, "triton")
    if name in LINEAR:
        assert ".linear_attention(" in source
    if name == "SigmoidForget":  # no softmax drops the query part: G_i a row bias, -G_j a key bias
        assert re.search(r"\.pointwise_attention\([^\n]*key_bias=[^\n]*row_bias=", source)
    if name in SOFTMAX_GATES:  # the gate's key part -G_j: the kernels' key bias
        assert re.search(r"\.energy_attention\([^\n]*key_bias=", source) and "masked_" not in source
    _compare_backends(derived, name)
    _compare_backends(derived, name, T=70)


def test_a_step_size_per_token_scales_the_fused_attention() -> None:
    """σ(w·x) of the token's own input in front of the energy: the attention stays fused, one factor after it."""
    forward = energy_source(load(FILE).energy("TokenStep")).split("def forward")[1]
    assert "softmax_attention(" in forward and "masked_" not in forward and "torch.sigmoid(" in forward


@pytest.mark.parametrize("name", SOFTMAX_GATES)
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])  # triton: ~100 s
def test_a_gate_in_a_softmax_score_keeps_gradients_finite_at_long_sequences(name: str, backend: str) -> None:
    """log(decay(…)) in a score is G_i - G_j itself: the log of exp(G_i - G_j), which underflows to 0 once the log
    decay passes -103 (float32), was -inf and made the gradients NaN at T = 512. Masked pairs are finite too."""
    module = module_class(load(FILE).energy(name), backend)()
    x = module.example_input(1, 512).requires_grad_()
    module(x).square().sum().backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in module.parameters())


def test_the_log_of_a_product_with_gates_is_split_term_by_term() -> None:
    """log(a^(i-j) γ^2) = (i - j) log a + 2 log γ: an ALiBi slope and a key bias for the kernels."""
    forward = energy_source(load(FILE).energy("ForgetWithDecay"), "triton").split("def forward")[1]
    assert re.search(r"\.energy_attention\([^\n]*alibi_slopes=[^\n]*key_bias=", forward)
    assert "torch.exp(" not in forward  # no gate weights formed, only their logs


def _energy(gate: str, relation: str = "j <= i") -> str:
    return f"""energy G(d = 4) {{
  state   z[d] via u = rmsnorm(z)
  input   x[d]
  context h[j, d] where {relation}
  param   w[d] ~ normal(0, 0.5)
  global  F = -0.5 * sum[j]({gate} * (z . h[j])^2)
  optimizer gd(eta = 0.5)
}}
"""


@pytest.mark.parametrize("gate, message", [
    ("decay(sigmoid(z . h[j]))", "r reads the state `z`"),
    ("decay(sigmoid(w . x))", "r reads the input `x`"),
    ("decay(0.9)", "reads no context token"),
    ("decay(sigmoid(w . h[j]) * sigmoid(i - j))", "r reads a position"),
    ("decay(w . h[j])", "positive by its form"),
    ("decay(sigmoid(h[j]))", "takes one scalar"),
    ("decay(sigmoid(sum[j](w . h[j])))", "not a sum or product over the context"),
    ("decay(decay(sigmoid(w . h[j])))", "not a sum or product over the context"),
])
def test_refused_rates_are_located(gate: str, message: str) -> None:
    with pytest.raises(SpecError) as info:
        load(_energy(gate)).derive()
    err = info.value
    assert message in err.message
    assert (err.span.line, err.span.column) == (6, 29)  # the call
    assert "^" in err.render()


def test_a_rate_of_the_via_variable_is_named_so() -> None:
    with pytest.raises(SpecError, match="r reads the `via` variable `u`"):
        load(_energy("decay(sigmoid(u . h[j]))")).derive()


def test_the_hint_for_a_constant_rate_is_a_power() -> None:
    with pytest.raises(SpecError) as info:
        load(_energy("decay(0.9)")).derive()
    assert "a^(i - j)" in info.value.render()

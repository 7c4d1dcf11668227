"""A decayed running sum of the context's values, Σ_j γ_ij v_j (an energy linear in the state with a decay or a
gate): hoisted whole and run as chunked linear attention with q = k = 1, linear in T on both backends. It had been
hoisted as its body, a (B, T, T, d) product, and summed with a mask."""

from __future__ import annotations

import pytest
from conftest import largest_tensor_made
from test_codegen import _matches_interpreter
from test_triton_backend import _compare_backends

from energydsl import load
from energydsl.codegen import energy_source, module_class

FILE = "tests/data/decayed-sums.energy"
NAMES = ["MovingAverage", "HeadMovingAverages", "GatedMovingAverage", "GatedMovingAverageStrict"]


@pytest.mark.parametrize("name", NAMES)
def test_every_check_passes(name: str) -> None:
    results = load(FILE).energy(name).check()
    assert [(r.name, r.detail) for r in results if r.status == "fail"] == []


@pytest.mark.parametrize("T", [1, 7, 70])  # 70: past one chunk (64) of the linear-attention ops
@pytest.mark.parametrize("name", NAMES)
def test_modules_match_the_interpreter(name: str, T: int) -> None:
    _matches_interpreter(load(FILE).energy(name), T)


@pytest.mark.parametrize("name", NAMES)
def test_the_sum_is_hoisted_whole_and_takes_linear_attention(name: str) -> None:
    derived = load(FILE).energy(name)
    assert [h.body.op for h in derived.program.hoisted] == ["sum"]  # the sum, not its T x T body
    forward = energy_source(derived).split("def forward")[1]
    assert "linear_attention(" in forward and "masked_" not in forward, forward
    module = module_class(derived)()
    x = module.example_input(2, 256).requires_grad_()
    largest = largest_tensor_made(lambda: module(x).square().sum().backward())
    assert largest < 2 * 256 * 256, largest  # the chunks' (B, H, T / 64, 64, 64) scores at most


@pytest.mark.parametrize("name", NAMES)
def test_triton_backend_matches_torch_backend(name: str) -> None:
    derived = load(FILE).energy(name)
    source = energy_source(derived, "triton")
    assert ".linear_attention(" in source and "masked_" not in source
    _compare_backends(derived, name)
    _compare_backends(derived, name, T=70)

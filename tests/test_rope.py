"""`rope(v, p)`, rotary position embeddings: the op against the rotate-half formula written out, the checks,
the generated modules against the reference interpreter (which rotates by explicit (D, D) matrices), the triton
backend against the torch backend, the lowering (no (T, T, d) value), and the spellings the language refuses."""

from __future__ import annotations

import re

import pytest
import torch
from test_codegen import _matches_interpreter
from test_triton_backend import _compare_backends

from energydsl import load
from energydsl.codegen import energy_source
from energydsl.errors import SpecError
from energydsl.runtime.ops import rope

FILE = "tests/data/rope.energy"
ENERGIES = ["RopeMHA", "RopeUntiedStrict", "RopeMomentum", "RopeLinear", "RopeNewton"]


def test_rope_is_the_rotate_half_formula() -> None:
    """Hugging Face Llama's `q * cos + rotate_half(q) * sin`, with its cos/sin tables, written out here."""
    x = torch.randn(2, 9, 3, 8, dtype=torch.float64)
    inv_freq = 1.0 / (500 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    freqs = torch.arange(9, dtype=torch.float64)[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[None, :, None]  # (1, T, 1, D)
    rotate_half = torch.cat([-x[..., 4:], x[..., :4]], dim=-1)
    torch.testing.assert_close(rope(x, 1, base=500.0), x * emb.cos() + rotate_half * emb.sin())


def test_rope_is_a_rotation_whose_scores_depend_on_the_distance() -> None:
    q, k = torch.randn(1, 12, 6, dtype=torch.float64), torch.randn(1, 12, 6, dtype=torch.float64)
    torch.testing.assert_close(rope(rope(q, 1), 1, sign=-1), q)  # sign -1 is the inverse
    torch.testing.assert_close(rope(q, 1).norm(dim=-1), q.norm(dim=-1))
    same = q[:, :1].expand(1, 12, 6), k[:, :1].expand(1, 12, 6)  # one q and one k at every position
    scores = rope(same[0], 1)[0] @ rope(same[1], 1)[0].T  # (i, j): a function of i - j alone
    torch.testing.assert_close(torch.diagonal(scores, 3), torch.full((9,), scores[0, 3].item(), dtype=torch.float64))


def test_positions_are_exact_in_bfloat16() -> None:
    """bf16 counts exactly only to 256: the op makes its own positions in float32."""
    x = torch.randn(1, 600, 4)
    torch.testing.assert_close(rope(x.bfloat16(), 1).float(), rope(x, 1), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("name", ENERGIES)
def test_every_check_passes(name: str) -> None:
    results = load(FILE).energy(name).check()
    assert [(r.name, r.detail) for r in results if r.status == "fail"] == []


@pytest.mark.parametrize("T", [7, 1, 70])
@pytest.mark.parametrize("name", ENERGIES)
def test_modules_match_the_interpreter(name: str, T: int) -> None:
    _matches_interpreter(load(FILE).energy(name), T)


@pytest.mark.parametrize("file, name, strict, scaled",
                         [(FILE, "RopeUntiedStrict", True, False),
                          ("examples/models/rope-llama.energy", "RopeMHA", False, True)])
def test_the_untied_update_is_the_papers_form(file: str, name: str, strict: bool, scaled: bool) -> None:
    """z + Σ_k Wo_k R_iᵀ Σ_j softmax_j(⟨R_i q_k, R_j k_kj⟩ / T) R_j Wv_k h_j, written out here: the gradient's
    constant (−1/heads, −1) is Wo's to absorb, as in llama's MHA, even where it stands inside the rotation."""
    energy = load(file).energy(name)
    module = energy.module(dtype=torch.float64)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.5 * torch.randn_like(p))
    params = dict(module.named_parameters())
    heads, dh, d = params["W1"].shape
    base = 100.0 if file == FILE else 10000.0
    x = torch.randn(2, 6, d, dtype=torch.float64)
    scale = dh ** -0.5 if scaled else 1.0
    q = rope(torch.einsum("kad,btd->btka", params["W1"], x), 1, base=base)
    k = rope(torch.einsum("kad,btd->btka", params["W2"], x), 1, base=base)
    v = rope(torch.einsum("kad,btd->btka", params["Wv"], x), 1, base=base)
    scores = torch.einsum("bika,bjka->bkij", q, k) * scale
    T = x.shape[1]
    allowed = torch.ones(T, T).tril(-1 if strict else 0).bool()
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num()
    read = rope(torch.einsum("bkij,bjka->bika", weights, v), 1, base=base, sign=-1)
    want = torch.einsum("kda,bika->bid", params["Wo"], read)
    torch.testing.assert_close(module(x, delta=True), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name, op", [("RopeMHA", "softmax_attention("), ("RopeUntiedStrict", "softmax_attention("),
                                      ("RopeMomentum", "softmax_attention("), ("RopeLinear", "linear_attention(")])
def test_rotated_scores_lower_with_the_rotation_back_after_the_sum(name: str, op: str) -> None:
    """Σ_j p_ij R_{-i} v_j = R_{-i} Σ_j p_ij v_j: the values stay per key (research/cem.md §2.4 feared them
    query-dependent), the sum runs as attention, and one rotation by -i follows it."""
    forward = energy_source(load(FILE).energy(name)).split("def forward")[1]
    assert op in forward and "masked_" not in forward
    assert re.search(r"rope\([^\n]*sign=-1\)", forward)


def test_the_keys_rotation_is_computed_once_before_the_steps() -> None:
    forward = energy_source(load(FILE).energy("RopeMomentum")).split("def forward")[1]
    loop = forward.index("for ")
    key = re.search(r"rope\([^\n]*# rotary position embedding by j", forward)
    assert key is not None and key.start() < loop
    assert re.search(r"rope\([^\n]*# rotary position embedding by i", forward[loop:])


@pytest.mark.parametrize("name", ENERGIES)
def test_triton_backend_matches_torch_backend(name: str) -> None:
    derived = load(FILE).energy(name)
    assert re.search(r"\.(energy_attention\w*|linear_attention)\(", energy_source(derived, "triton"))
    _compare_backends(derived, name)


def _energy(score: str, width: str = "d") -> str:
    return f"""energy R(d = 6) {{
  state   z[d]
  context h[j, d] where j <= i
  param   W[{width}, d] ~ normal(0, 0.5)
  global  F = -logsumexp[j]({score})
  optimizer gd(eta = 0.5)
}}
"""


@pytest.mark.parametrize("score, width, message", [
    ("rope(z . z, i) * (z . h[j])", "d", "rotates the feature pairs of a vector"),
    ("rope(W @ z, i) . rope(W @ h[j], j)", "5", "width must be even; it is 5"),
    ("rope(z, 3) . h[j]", "d", "position must be `i` or the context index"),
    ("rope(z, i, -2) . h[j]", "d", "base must be a positive constant"),
    ("rope(z) . h[j]", "d", "rope(v, i) or rope(v, j, base)"),
])
def test_refused_rotations_are_located(score: str, width: str, message: str) -> None:
    with pytest.raises(SpecError) as info:
        load(_energy(score, width)).derive()
    assert message in info.value.message and "5.0" not in info.value.message
    assert info.value.span.line == 5 and "^" in info.value.render()


HEADS = """energy R(d = 8, heads = 2, base = 500) {{
  dim     dh = d / heads
  state   z[d]
  context h[j, d] where j <= i
  param   Q[heads, dh, d] ~ normal(0, 0.3)
  global  F = -sum[k](logsumexp[j]({score}))
  {expect}
}}
"""


@pytest.mark.parametrize("score", ["rope(Q[k] @ z, k) . (Q[k] @ h[j])",  # k bound by the vector
                                   "rope(z, k) . rope(Q[k] @ h[j], j)"])  # k not bound yet
def test_a_head_index_is_no_position(score: str) -> None:
    with pytest.raises(SpecError, match="not the index `k`"):
        load(HEADS.format(score=score, expect="")).derive()


def test_the_base_may_be_a_dim_and_is_printed() -> None:
    """A header dim (or an expression of dims) is a constant base; `energy derive` shows a base other than 10000."""
    derived = load(HEADS.format(score="rope(Q[k] @ z, i, base) . rope(Q[k] @ h[j], j, dh * 100)", expect="")).energy()
    assert all(r.status != "fail" for r in derived.check())
    text = derived.equations("text")
    assert "rope_{i, 500}(Q_k z)" in text and "rope_{j, 400}(Q_k h_j)" in text


def test_an_expect_clause_can_rotate_back() -> None:
    """`rope(v, -i)` is the rotation back that `energy derive` prints as rope_{-i}: an update can be claimed."""
    claim = ("expect update = z + sum[k](Q[k]^T @ rope(sum[j](softmax[j](rope(Q[k] @ z, i) . rope(Q[k] @ h[j], j))"
             " * rope(Q[k] @ h[j], j)), -i))")
    derived = load(HEADS.format(score="rope(Q[k] @ z, i) . rope(Q[k] @ h[j], j)", expect=claim)).energy()
    assert [r.status for r in derived.check() if r.name == "expect"] == ["ok"]

"""The triton backend (`load(path).module(backend="triton")`) against the torch backend, example by example.

Every example energy whose derived update has a recognised context sum runs its sums in the fused kernels
of `energydsl.kernels` (softmax family, linear and gated linear attention); products value * G(pre)
(CEM's and NRGPT's MLPs) run in the fused gated epilogue, G printed from the energy; momentum steps in the
fused momentum update, nag's look-ahead point in the fused Nesterov op; all of them are copies written into
the generated file. Without CUDA the kernels run under the Triton interpreter (enabled below, before triton is
imported), in float32 with exact fp32 dots.
Each module is compared with the torch backend run in float64: the displacement (update minus x) and the
gradients of a loss on it with respect to x and every parameter, relative error max|x - ref| / max|ref|
below 1e-4, or at most four times the error of the float32 torch backend where that is larger (a peaked
softmax amplifies float32 rounding on both paths alike). Sequence lengths are odd (13), so the last
kernel tile is partial.
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import WEIGHTED_SUMS, largest_tensor_made, multi_head_linear_attention

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

pytest.importorskip("triton")

from energydsl import load  # noqa: E402
from energydsl.codegen import energy_source, module_class  # noqa: E402
from energydsl.codegen.triton_source import KernelRequest  # noqa: E402
from energydsl.instance import instance_from_params, run_program  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "cuda" if CUDA else "cpu"
TOL = 1e-4

# (file, energy, dims): energies whose context sums (or gated activations) the triton backend lowers
LOWERED = [
    ("intrinsic-optimizers/mha.energy", "MHA", {}),
    ("intrinsic-optimizers/mha.energy", "MHA", {"heads": 1}),
    ("intrinsic-optimizers/softmax-attention.energy", "SoftmaxAttention", {}),
    ("intrinsic-optimizers/momen-mha.energy", "MomenMHA", {}),
    ("intrinsic-optimizers/nag-mha.energy", "NagMHA", {}),
    ("intrinsic-optimizers/light-mha2nd1st.energy", "LightMHA2nd1st", {}),
    ("intrinsic-optimizers/linear-attention.energy", "LinearAttention", {}),
    ("intrinsic-optimizers/gated-linear-attention.energy", "GatedLinearAttention", {}),
    ("intrinsic-optimizers/multi-head-linear-attention.energy", "MultiHeadLinearAttention", {}),
    ("intrinsic-optimizers/data-gated-linear-attention.energy", "DataGatedLinearAttention", {}),  # decay(r)
    ("models/gla.energy", "GatedRetention", {}),  # decay(r) per head, untied values
    ("models/rope-llama.energy", "RopeMHA", {}),  # rotated queries and keys, the rotation back after the sum
    ("cem/alibi.energy", "CEMAlibiAttention", {}),
    ("cem/alibi.energy", "CEMAlibiAttention", {"heads": 1}),
    ("cem/tied-attention.energy", "CEMTiedAttention", {}),
    ("cem/dplr.energy", "CEMAttentionDPLR", {}),
    ("cem/steps2.energy", "CEMAttentionSteps2", {}),
    ("cem/kq-diagonal-score-only.energy", "CEMKQDiagonalScoreOnly", {}),
    ("cem/kq-diagonal-exact.energy", "CEMKQDiagonalExact", {}),
    ("nrgpt/attention.energy", "NRGPTAttention", {}),  # strict context: j < i
    ("rmt/attention.energy", "RMTAttention", {}),  # matrix state, dk x 1 reads (flattened for the kernel)
    ("models/rmt.energy", "RMTAttention", {}),
    ("hopfield/modern.energy", "ModernHopfield", {}),
    ("hopfield/classical.energy", "ClassicalHopfield", {}),
    ("hopfield/energy-transformer.energy", "EnergyTransformer", {}),
    # element-wise energies: value * act(pre) as the fused epilogue
    ("cem/mlp.energy", "CEMMLP", {}),
    ("cem/mlp-dplr.energy", "CEMMLPDPLR", {}),
    ("nrgpt/ff1.energy", "NRGPTFF1", {}),  # GELU(a) GELU'(a): a function of one tensor, no value
    ("nrgpt/ff2w.energy", "NRGPTFF2W", {}),  # value * GELU'(a): its backward kernel computes GELU''(a)
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _run(module: torch.nn.Module, x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    """The displacement and the gradients of <w, displacement> w.r.t. x and every parameter."""
    x = x.clone().requires_grad_()
    out = module(x, delta=True)
    params = [p for p in module.parameters()]
    grads = torch.autograd.grad((out * w.to(out.dtype)).sum(), [x, *params], allow_unused=True)
    return [out.detach()] + [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, [x, *params])]


@pytest.mark.parametrize("T", [13, 1])
@pytest.mark.parametrize("path,name,dims", LOWERED, ids=[f"{n}{d or ''}" for _, n, d in LOWERED])
def test_kernels_match_torch_backend(path: str, name: str, dims: dict, T: int) -> None:
    """T = 1: one key, so the softmax weight is 1 and the key-side gradients vanish in the reference."""
    derived = load(ROOT / "examples" / path).energy(name, **dims)
    assert "@triton.jit" in energy_source(derived, "triton"), "the triton backend did not lower this energy"
    _compare_backends(derived, name, T=T)


@pytest.mark.skipif(CUDA, reason="on a GPU the backward mode is timed per shape (test_kernels_attention)")
@pytest.mark.parametrize("path,name", [("intrinsic-optimizers/mha.energy", "MHA"),
                                       ("intrinsic-optimizers/light-mha2nd1st.energy", "LightMHA2nd1st"),
                                       ("cem/alibi.energy", "CEMAlibiAttention"),
                                       ("nrgpt/attention.energy", "NRGPTAttention")])
def test_generated_copies_run_the_fused_backward(path: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention kernels written into a generated module keep the fused backward (the dK/dV kernel adding
    dQ by atomics): first and second order, ALiBi and self bias, a strict context."""
    from energydsl.kernels import attention

    monkeypatch.setattr(attention, "INTERPRET_DQ_ATOMIC", True)
    _compare_backends(load(ROOT / "examples" / path).energy(name), name)


@pytest.mark.parametrize("path,name", [("intrinsic-optimizers/mha.energy", "MHA"),
                                       ("intrinsic-optimizers/momen-mha.energy", "MomenMHA"),
                                       ("intrinsic-optimizers/light-mha2nd1st.energy", "LightMHA2nd1st"),
                                       ("cem/alibi.energy", "CEMAlibiAttention"),
                                       ("intrinsic-optimizers/multi-head-linear-attention.energy",
                                        "MultiHeadLinearAttention")])
def test_heads_reach_the_kernels_without_copies(path: str, name: str) -> None:
    """The generated glue splits heads off its projections and merges the kernels' outputs back by views:
    the kernels read token-major heads (and log decays) through their strides and write token-major outputs,
    so a forward and backward copies no sequence-long tensor (only weights are reshaped by copy, once). The
    profiler records the aten ops inside the custom ops' bodies too."""
    from torch.profiler import profile

    T = 13
    module = load(ROOT / "examples" / path).module(name, backend="triton").to(DEVICE)
    x = torch.randn(2, T, *module.state_shape, device=DEVICE, requires_grad=True)
    w = torch.randn_like(x)  # a loss whose own backward copies nothing (square's does, on the CPU)
    with profile(record_shapes=True) as prof:
        (module(x) * w).sum().backward()
    copies = [(e.name, e.input_shapes[0]) for e in prof.events()
              if e.name in ("aten::clone", "aten::copy_") and e.input_shapes and T in e.input_shapes[0]]
    assert not copies, copies


# CEM's exact diagonal term at widths above 256: the score's concatenated features are d wide
# (kq-diagonal-exact: keys and values d wide) or d/heads + d (the model's attention, with ALiBi and self bias)
WIDE = [
    ("cem/kq-diagonal-exact.energy", "CEMKQDiagonalExact", {"d": 264}),
    ("models/cem.energy", "CEMAttention", {"d": 256, "heads": 4}),
    ("intrinsic-optimizers/light-mha2nd1st.energy", "LightMHA2nd1st", {"d": 264, "heads": 1}),  # second moment
]


@pytest.mark.parametrize("path,name,dims", WIDE, ids=[n for _, n, _ in WIDE])
def test_wide_features_take_the_wide_kernels(path: str, name: str, dims: dict,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from energydsl.kernels import attention

    if not CUDA:  # a few wide feature tiles: the interpreter runs every program in Python
        monkeypatch.setattr(attention, "INTERPRET_FEATURE_TILE", 128)
    derived = load(ROOT / "examples" / path).energy(name, **dims)
    source = energy_source(derived, "triton")
    assert "@triton.jit\ndef _fwd_wide_kernel_" in source and "= attention_wide_ops(" in source
    _compare_backends(derived, name)


@pytest.mark.parametrize("path,name", [("intrinsic-optimizers/linear-attention.energy", "LinearAttention"),
                                       ("intrinsic-optimizers/gated-linear-attention.energy", "GatedLinearAttention")])
def test_strict_linear_kernels_match_torch_backend(path: str, name: str) -> None:
    """`j < i` baked into the linear kernels' copies (no example has a strict linear energy)."""
    derived = load((ROOT / "examples" / path).read_text(encoding="utf-8").replace("j <= i", "j < i")).energy(name)
    assert derived.relations() == {"j": "<i"} and "@triton.jit" in energy_source(derived, "triton")
    _compare_backends(derived, name)


def test_decay_shared_by_heads_matches_torch_backend() -> None:
    """One decay for every head (expanded over heads, batch and time with stride 0), beside the example's
    decay per head (in LOWERED)."""
    derived = load(multi_head_linear_attention(per_head=False)).energy()
    assert ".reshape(1).expand(2)" in energy_source(derived, "triton")
    _compare_backends(derived, "MultiHeadLinearAttention")


@pytest.mark.parametrize("name", ["PerHeadTemperature", "KeySideGain"])
def test_a_learned_factor_in_the_scores_takes_the_attention_kernels(name: str) -> None:
    """A temperature or gain per head (no token in it) rides in the query: the softmax kernels run it."""
    derived = load(ROOT / "tests/data/learned-temperature.energy").energy(name)
    assert ".energy_attention(" in energy_source(derived, "triton")
    _compare_backends(derived, name)


@pytest.mark.parametrize("name", WEIGHTED_SUMS)
def test_an_elementwise_weight_of_the_score_takes_the_pointwise_kernels(name: str) -> None:
    """Sigmoid, squared-ReLU and RBF weights (no normalisation over j) run on the pointwise kernels, with
    their weight and its derivative printed from the energy, and no T x T tensor in the forward: a learned
    bias inside the sigmoid and the RBF's |z|² become a row bias, its |k_j|² a key bias."""
    derived = load(ROOT / "tests/data/weighted-context-sums.energy").energy(name)
    source = energy_source(derived, "triton")
    forward = source.split("def forward")[1]
    assert ".pointwise_attention(" in forward
    assert "masked_reduce(" not in forward and "torch.einsum('btj" not in forward and "mask" not in forward
    if name == "GaussianKernel":  # z Σ_j w_ij − Σ_j w_ij k_j: one call over the values [1, k_j] per step
        assert forward.count(".pointwise_attention(") == 1 and "F.pad(" in forward
    _compare_backends(derived, name)


def _sigmoid_with(position_term: str, context: str = "j <= i") -> str:
    """Sigmoid attention over two heads with a learned term of positions in the score (ALiBi's slope per head,
    Ramapuram et al.'s recommended form)."""
    return f"""
energy SigmoidPositions(d = 8, heads = 2) {{
  dim     dh = d / heads
  state   z[d]
  context h[j, d] where {context}
  param   W1[heads, dh, d] ~ normal(0, 0.3)
  param   W2[heads, dh, d] ~ normal(0, 0.3)
  param   m[heads] = alibi_slopes(heads) learn
  param   c[heads] = 0.5 learn
  global  F = -sum[k](sum[j](softplus((W1[k] @ z) . (W2[k] @ h[j]) + {position_term})))
  optimizer gd(eta = 1)
}}
"""


@pytest.mark.parametrize("term,context,flags", [
    ("-m[k] * abs(i - j)", "j <= i", ["alibi_slopes="]),
    ("-m[k] * abs(i - j) + c[k] * relu(1 - abs(i - j))", "j <= i", ["alibi_slopes=", "self_bias="]),
    ("c[k] * relu(1 - abs(i - j))", "j < i", []),  # vanishes on every pair of a strict context: dropped
])
def test_position_terms_in_a_pointwise_weight_become_kernel_flags(term: str, context: str, flags: list[str]) -> None:
    """ALiBi's distance and a self bias inside the sigmoid are kernel arguments (learned here: their gradients
    are the kernels' column sums, reduced per head)."""
    derived = load(_sigmoid_with(term, context)).energy("SigmoidPositions")
    forward = energy_source(derived, "triton").split("def forward")[1]
    call = next(line for line in forward.splitlines() if ".pointwise_attention(" in line)
    assert all(f in call for f in flags) and sum(f in call for f in ("alibi_slopes=", "self_bias=")) == len(flags)
    _compare_backends(derived, "SigmoidPositions")


@pytest.mark.parametrize("term,context", [("- 1", "j <= i"), ("-m[k] * abs(i - j) - 1", "j < i")])
def test_a_number_in_a_pointwise_score_is_the_kernels_row_bias(term: str, context: str) -> None:
    """`sigmoid(q . k_j - 1)`: the number reached the kernel's row bias as `-1.0[..., None]` (a TypeError)."""
    derived = load(_sigmoid_with(term, context)).energy("SigmoidPositions")
    call = next(line for line in energy_source(derived, "triton").split("def forward")[1].splitlines()
                if ".pointwise_attention(" in line)
    assert "row_bias=" in call
    _compare_backends(derived, "SigmoidPositions")


@pytest.mark.parametrize("loop", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name,dims", [("SigmoidAttention", dict(d=264, heads=1)),  # row bias, 264-wide heads
                                       ("GaussianKernel", dict(d=264))])  # row and key biases, values [1, k_j]
def test_heads_wider_than_the_pointwise_tiles_take_the_wide_kernels(name: str, dims: dict, loop: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The pointwise kernels hold a head's features in one tile (at most 256): wider heads (or values with the
    RBF's column of ones) take the feature-tiled kernels, not the einsum, and agree with the torch backend, the
    generated copies' backward run in both modes (a program per feature tile, one looping over them). One batch:
    tests/test_kernels_pointwise.py checks the wide kernels' batch strides."""
    from energydsl.kernels import pointwise

    monkeypatch.setattr(pointwise, "INTERPRET_FEATURE_LOOP", loop)
    derived = load(ROOT / "tests/data/weighted-context-sums.energy").energy(name, **dims)
    source = energy_source(derived, "triton")
    forward = source.split("def forward")[1]
    assert "= pointwise_wide_ops(" in source and ".pointwise_attention(" in forward
    assert "torch.einsum('btj" not in forward
    _compare_backends(derived, name, batch=1)  # 17 feature tiles under the interpreter: batch strides are the ops'


def test_a_weight_with_a_capped_distance_keeps_the_einsum() -> None:
    """min(|i - j|, 4) = 4 - relu(4 - |i - j|) is ALiBi's distance on short distances only (SymPy proves
    nothing): no kernel flag, so the triton module runs the torch backend's weighted sum, still agreeing."""
    derived = load(_sigmoid_with("-m[k] * (4 - relu(4 - abs(i - j)))")).energy("SigmoidPositions")
    forward = energy_source(derived, "triton").split("def forward")[1]
    assert ".pointwise_attention(" not in forward and "torch.einsum('btj" in forward
    _compare_backends(derived, "SigmoidPositions")


@pytest.mark.parametrize("name", WEIGHTED_SUMS)
def test_pointwise_sums_in_float64_run_the_printed_reference(name: str) -> None:
    """A float64 module runs each pointwise op set's reference, the weight printed in torch: it equals the torch
    backend to float64 rounding."""
    _float64_matches_torch_backend(load(ROOT / "tests/data/weighted-context-sums.energy").energy(name), name)


@pytest.mark.parametrize("name", ["SigmoidAttention", "GaussianKernel"])
def test_pointwise_kernels_make_no_t_by_t_tensor(name: str) -> None:
    """Forward and backward at T = 64: no tensor the torch ops make (outputs of every op, the kernels' included)
    has B x T x T elements; the einsum path's weights have B x heads x T x T."""
    derived = load(ROOT / "tests/data/weighted-context-sums.energy").energy(name)
    sizes = {}
    for backend in ("triton", "torch"):
        module = module_class(derived, backend)().to(DEVICE)
        x = module.example_input(2, 64).to(DEVICE).requires_grad_()
        sizes[backend] = largest_tensor_made(lambda: module(x).square().sum().backward())  # noqa: B023
    assert sizes["triton"] < 2 * 64 * 64 <= sizes["torch"], sizes


@pytest.mark.parametrize("name", ["ExpDecay", "ExpDecayStrict", "ExpDecayAbs", "TwoDecays"])
def test_a_decay_written_as_exp_of_the_distance_takes_the_linear_kernels(name: str) -> None:
    """exp(-lam[k] (i - j)), exp(lam[k] (j - i)) and exp(-lam[k] |j - i|): the decay lam[k]'s log per head, as
    a[k]^(i - j) is; a product of two decays, the sum of their logs."""
    derived = load(ROOT / "tests/data/exp-decay-linear-attention.energy").energy(name)
    assert ".linear_attention(" in energy_source(derived, "triton")
    _compare_backends(derived, name)


@pytest.mark.parametrize("name", ["NewtonAlibi", "CovPerHeadAlibi"])
def test_second_order_updates_with_alibi_take_the_kernels(name: str) -> None:
    """An ALiBi bias behind a minus sign, hoisted, or beside an L2 score: a kernel flag, not the T x T form."""
    derived = load(ROOT / "tests/data/alibi-second-order.energy").energy(name)
    source = energy_source(derived, "triton")
    forward = source[source.index("def forward"):]
    assert ".weighted_second_moment(" in forward and "masked_" not in forward
    _compare_backends(derived, name)


def _compare_backends(derived: object, name: str, weights_std: float | None = None, T: int = 13, batch: int = 2
                      ) -> None:
    """The triton module against the torch backend in float64: displacement and every gradient; with
    `weights_std`, the weights (not the optimizer's scalars) redrawn from normal(0, weights_std).

    A quantity that is exactly zero in float64 (a key-side gradient at T = 1) has no relative error; it
    must be within float32 rounding of the largest quantity, input included, instead."""
    torch.manual_seed(0)
    ref = module_class(derived, "torch")().to(DEVICE)
    if weights_std is not None:
        with torch.no_grad():
            for p in ref.parameters():
                if p.dim() > 0:
                    p.normal_(0.0, weights_std)
    tri = module_class(derived, "triton")().to(DEVICE)
    base = module_class(derived, "torch")().to(DEVICE)
    # exactly the same parameters and buffers, so checkpoints move between backends
    assert {k: v.shape for k, v in tri.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    tri.load_state_dict(ref.state_dict())
    base.load_state_dict(ref.state_dict())
    x = ref.example_input(batch, T).to(DEVICE)
    w = torch.randn(x.shape, device=DEVICE)
    want = _run(ref.double(), x.double(), w)
    got = _run(tri.float(), x.float(), w)
    fp32 = _run(base.float(), x.float(), w)
    labels = ["delta", "x"] + [n for n, _ in ref.named_parameters()]
    scale = max(r.abs().max().item() for r in [x, *want])
    for label, g, r, b in zip(labels, got, want, fp32):
        if r.abs().max() == 0:
            assert g.abs().max() <= TOL * scale, f"{name} {label}: {g.abs().max():.2e}, want 0"
            continue
        err, floor = _rel(g, r), _rel(b, r)
        assert err <= max(TOL, 4 * floor), f"{name} {label}: {err:.2e} (float32 torch: {floor:.2e})"


def test_model_runs_on_kernels_with_same_state_dict() -> None:
    """A whole model: the triton-backend CEM equals the torch-backend one with the same weights."""
    spec = load(ROOT / "examples/models/cem.energy")
    dims = dict(vocab=17, context=32, d=16, layers=2, heads=2)
    torch.manual_seed(0)
    a = spec.model(backend="torch", **dims).to(DEVICE)
    b = spec.model(backend="triton", **dims).to(DEVICE)
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 17, (2, 11), device=DEVICE)
    la, lb = a(idx), b(idx)
    assert _rel(lb, la) < 1e-4
    ga = torch.autograd.grad(la.square().mean(), list(a.parameters()))
    gb = torch.autograd.grad(lb.square().mean(), list(b.parameters()))
    for (n, _), x, y in zip(a.named_parameters(), gb, ga):
        assert _rel(x, y) < 1e-3, n


AUTOCAST = [  # energies whose q, k and v reach the kernels in different dtypes under bfloat16 autocast
    ("models/cem.energy", "CEMAttention"),  # keys: cat(projection (bf16), rms_norm(h) (fp32)) -> fp32
    ("intrinsic-optimizers/softmax-attention.energy", "SoftmaxAttention"),  # q = W z (bf16), k = v = h (fp32)
    ("intrinsic-optimizers/softmax-attention-l2.energy", "SoftmaxAttentionL2"),
    ("intrinsic-optimizers/linear-attention.energy", "LinearAttention"),
    ("intrinsic-optimizers/gated-linear-attention.energy", "GatedLinearAttention"),
    ("intrinsic-optimizers/light-mha2nd1st.energy", "LightMHA2nd1st"),  # the second moment
    ("cem/kq-diagonal-score-only.energy", "CEMKQDiagonalScoreOnly"),
    ("../tests/data/weighted-context-sums.energy", "SigmoidAttention"),  # the pointwise kernels
]


@pytest.mark.parametrize("path,name", AUTOCAST, ids=[n for _, n in AUTOCAST])
def test_layers_run_under_bfloat16_autocast_as_the_torch_backend(path: str, name: str) -> None:
    """Under autocast, the kernels take q, k and v in autocast's dtype, as torch's attention does: a projection
    (bf16) beside a raw context or a norm (fp32) was refused ("q, k, v must share a dtype"), so `energy train
    --backend triton --dtype bfloat16` stopped with an internal error."""
    derived = load(ROOT / "examples" / path).energy(name)
    torch.manual_seed(0)
    ref = module_class(derived, "torch")().to(DEVICE)
    tri = module_class(derived, "triton")().to(DEVICE)
    tri.load_state_dict(ref.state_dict())
    x = ref.example_input(2, 13).to(DEVICE)
    w = torch.randn(x.shape, device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        want, got = _run(ref, x, w), _run(tri, x, w)
    assert got[0].dtype == want[0].dtype
    for label, g, r in zip(["delta", "x"] + [n for n, _ in ref.named_parameters()], got, want):
        assert _rel(g, r) < 0.05, f"{name} {label}: {_rel(g, r):.2e}"  # bfloat16 has 8 bits of mantissa


def test_bias_forms_reach_the_kernel_flags() -> None:
    """ALiBi, the self-token bias and per-key biases become kernel arguments, not a T x T mask."""
    src = energy_source(load(ROOT / "examples/cem/alibi.energy").energy("CEMAlibiAttention"), "triton")
    call = next(line for line in src.splitlines() if ".energy_attention(" in line)
    assert "alibi_slopes=" in call and "self_bias=" in call
    assert "softmax_attention" not in src and "causal_masks" not in src
    strict = energy_source(load(ROOT / "examples/nrgpt/attention.energy").energy("NRGPTAttention"), "triton")
    assert "strict=True" in next(line for line in strict.splitlines() if ".energy_attention(" in line)


def _position_bias_energy(bias: str, relation: str = "j <= i") -> str:
    return textwrap.dedent(f"""
        energy Biased(d = 8, heads = 2) {{
          dim     dh = d / heads
          state   x[d]
          context h[j, d] where {relation}
          param   WQ[heads, dh, d] ~ normal(0, 0.3)
          param   WK[heads, dh, d] ~ normal(0, 0.3)
          param   m[heads] ~ normal(1, 0.1)
          let     tau = sqrt(dh)
          let     bias[k, j] = {bias}
          local   s[k, j] = (WQ[k] @ x) . (WK[k] @ h[j]) / tau + bias[k, j]
          global  E = -tau * sum[k](logsumexp[j](s[k, j]))
          optimizer gd(eta = 1)
        }}
    """)


@pytest.mark.parametrize("bias, kernel_flag", [
    ("-m[k] * abs(i - j)", "alibi_slopes="),
    ("-m[k] * sqrt((i - j)^2)", "alibi_slopes="),  # |i - j| written otherwise: proven, not sampled
    ("m[k] * (j - i)", "alibi_slopes="),  # -|i - j| on every pair j <= i: the sign goes to the slope
    ("m[k] * relu(1 - abs(i - j))", "self_bias="),
    # equal to |i - j| or [i = j] up to distance 7 only: a kernel flag would be silently wrong beyond it
    ("-m[k] * (abs(i - j) - relu(abs(i - j) - 7))", None),
    ("-m[k] * abs(i - j) * relu(sign(8.5 - abs(i - j)))", None),
    ("m[k] * (relu(1 - abs(i - j)) + relu(abs(i - j) - 8))", None),
])
def test_a_position_bias_becomes_a_kernel_flag_only_when_proven(bias: str, kernel_flag: str | None) -> None:
    derived = load(_position_bias_energy(bias)).energy()
    call = next((ln for ln in energy_source(derived, "triton").splitlines() if ".energy_attention(" in ln), "")
    if kernel_flag is None:
        assert "alibi_slopes=" not in call and "self_bias=" not in call, call
    else:
        assert kernel_flag in call, call
    _compare_backends(derived, "Biased")  # T = 13: past the distance 7 where the look-alikes part


def test_a_score_term_no_kernel_takes_is_named_in_the_note() -> None:
    """`energy compile` said "no kernel family matches" of a softmax attention whose one bias term was refused."""
    derived = load(_position_bias_energy("-m[k] * (abs(i - j) - relu(abs(i - j) - 7))")).energy()
    unfused: list[str] = []
    energy_source(derived, "triton", unfused)
    assert unfused == ["no kernel family matches Biased's update: the score term `-m_k (abs(i − j) − relu(abs(i − j) "
                       "− 7))` is not one the kernels take: c |i - j|, c [i = j], a term of the key without i or j "
                       "as a number, or c log(decay(r)); its forward is the torch backend's"], unfused


def test_a_module_partly_on_t_by_t_torch_ops_says_so() -> None:
    """A context sum of a vector per pair (Σ_j relu(W h_j + cos(0.1 (i - j))), beside a softmax attention) is a
    masked reduction over (B, T, T, d): the kernels ran the rest, and nothing said the memory was quadratic."""
    derived = load("energy L(d = 8) {\n  state z[d]\n  context h[j, d] where j <= i\n  param W[d, d]\n"
                   "  param Q[d, d]\n  param K[d, d]\n  global F = -logsumexp[j]((Q @ z) . (K @ h[j]))"
                   " - sum[j](z . relu(W @ h[j] + cos(0.1 * (i - j))))\n}\n").energy()
    unfused: list[str] = []
    assert "@triton.jit" in energy_source(derived, "triton", unfused)
    assert unfused == ["L runs on the kernels, but not all of it: a context sum no kernel takes is computed with "
                       "T x T tensors (masked_reduce)"], unfused


@pytest.mark.parametrize("bias, flags", [
    ("m[k] * relu(1 - abs(i - j))", []),  # the self bias: zero on every pair j < i, dropped
    ("-m[k] * (i - j) + 0.3 * relu(1 - abs(i - j))", ["alibi_slopes="]),  # (i - j) = |i - j| there
    ("m[k] * relu(abs(i - j) - 8)", None),  # zero up to distance 8 only: the torch op stays
])
def test_under_a_strict_context_a_bias_that_vanishes_is_dropped(bias: str, flags: list[str] | None) -> None:
    derived = load(_position_bias_energy(bias, "j < i")).energy()
    call = next((ln for ln in energy_source(derived, "triton").splitlines() if ".energy_attention(" in ln), None)
    if flags is None:
        assert call is None
    else:
        assert call is not None and "strict=True" in call
        assert [f for f in ("alibi_slopes=", "self_bias=", "key_bias=") if f in call] == flags, call
    _compare_backends(derived, "Biased")


@pytest.mark.parametrize("path,name", [("intrinsic-optimizers/momen-mha.energy", "MomenMHA"),
                                       ("intrinsic-optimizers/nag-mha.energy", "NagMHA")])
def test_momentum_step_is_one_fused_update(path: str, name: str) -> None:
    """m = beta m + f, x = x + eta m: one call per step of the momentum kernels written into the file, no
    separate axpys."""
    src = energy_source(load(ROOT / "examples" / path).energy(name), "triton")
    assert src.count(".momentum_update(") == 1 and not re.search(r"m_z = t\d", src)
    assert src.count(f"{KernelRequest.momentum().name}.momentum_update(") == 1
    # nag: the look-ahead z - beta m, where the force is evaluated, is one call of the nesterov kernels written
    # into the file (once per step however often the force reads it), not a scale and an add
    nesterov = KernelRequest.nesterov().name
    assert (f"{nesterov} = nesterov_ops(" in src) == (name == "NagMHA")
    assert src.count(".nesterov_lookahead(") == (name == "NagMHA")
    if name == "NagMHA":
        call = re.search(rf"{nesterov}\.nesterov_lookahead\(z, m_z, (t\d+)\)", src)  # -beta, computed once
        assert call and f"{call.group(1)} = (-1.0 * opt_beta)\n" in src, src
        assert "@triton.jit\ndef _nesterov_fwd_kernel_" in src and "@triton.jit\ndef _nesterov_bwd_kernel_" in src
        assert not re.search(r"= z \+ t\d", src) and not re.search(r"^ *t\d+ = [^#\n]*\* m_z", src, re.M)


@pytest.mark.parametrize("path,name", [("intrinsic-optimizers/momen-mha.energy", "MomenMHA"),
                                       ("intrinsic-optimizers/nag-mha.energy", "NagMHA")])
def test_momentum_steps_match_torch_backend_with_query_dependent_attention(path: str, name: str) -> None:
    """At the default init (std 0.02) the attention hardly depends on its query: the gradient through nag's
    look-ahead point is below float32 noise there, and a wrong dm or dc of the fused look-ahead passes the
    comparison above. With weights of std 0.3 every gradient (opt_beta and opt_eta included) depends on it."""
    _compare_backends(load(ROOT / "examples" / path).energy(name), name, weights_std=0.3)


@pytest.mark.parametrize("path,name", [
    ("intrinsic-optimizers/mha.energy", "MHA"), ("intrinsic-optimizers/gated-linear-attention.energy",
                                                 "GatedLinearAttention"),
    ("intrinsic-optimizers/light-mha2nd1st.energy", "LightMHA2nd1st"), ("cem/mlp.energy", "CEMMLP"),
    ("intrinsic-optimizers/nag-mha.energy", "NagMHA"),
])
def test_float64_runs_the_exact_references(path: str, name: str) -> None:
    """No kernel takes float64 (they accumulate in float32; the attention kernels do not compile for it): a
    float64 triton-backend module runs the references and equals the torch backend to float64 rounding."""
    _float64_matches_torch_backend(load(ROOT / "examples" / path).energy(name), name)


@pytest.mark.parametrize("optimizer", ["momentum(eta = 0.1, beta = 0.3)", "nag(eta = 0.1, beta = 0.3)"])
def test_float64_keeps_a_fixed_step_size_in_float64(optimizer: str) -> None:
    """A fixed eta or beta reached the fused momentum and look-ahead ops as a float32 tensor: in float64 the
    update was off by float32's rounding of 0.1 (1.5e-8 relative; found by generating energies). The examples
    above use 1, 0.5 and 0.9, which the test of the references could not tell apart."""
    spec = (f"energy Mom(d = 4) {{\n  state z[d]\n  param W[d, d] ~ normal(0, 0.5)\n"
            f"  global F = sum(softplus(W @ z))\n  optimizer {optimizer} steps 2\n}}\n")
    _float64_matches_torch_backend(load(spec).energy("Mom"), optimizer)


def _float64_matches_torch_backend(derived: object, name: str) -> None:
    """The triton module in float64 against the torch backend's: displacement and every gradient to 1e-10."""
    torch.manual_seed(0)
    ref = module_class(derived, "torch")().to(DEVICE).double()
    tri = module_class(derived, "triton")().to(DEVICE).double()
    tri.load_state_dict(ref.state_dict())
    x = ref.example_input(2, 13).to(DEVICE).double()
    w = torch.randn(x.shape, device=DEVICE, dtype=torch.float64)
    for label, g, r in zip(["delta", "x"] + [n for n, _ in ref.named_parameters()], _run(tri, x, w), _run(ref, x, w)):
        assert _rel(g, r) < 1e-10, f"{name} {label}: {_rel(g, r):.1e}"


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("ON", True), ("yes", True), ("0", False),
                                       ("false", False), ("", False)])
def test_triton_interpret_is_read_as_triton_reads_it(value: str, on: bool, monkeypatch) -> None:
    from triton import knobs

    from energydsl.kernels import interpret_requested

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpret_requested() is on is knobs.runtime.interpret


def test_without_gpu_or_interpreter_falls_back_to_torch(tmp_path: Path) -> None:
    """No CUDA and no TRITON_INTERPRET: a one-line notice and the torch backend's module."""
    if CUDA:
        pytest.skip("a CUDA device is present: the kernels run")
    script = textwrap.dedent(f"""
        from energydsl import load
        m = load({str(ROOT / "examples/cem/alibi.energy")!r}).module(backend="triton")
        import inspect
        print("kernels" in inspect.getsource(type(m)), sorted(m.state_dict()))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["ENERGYDSL_CACHE"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("False"), proc.stdout
    notice = [ln for ln in proc.stderr.splitlines() if "falls back to torch" in ln]
    assert len(notice) == 1, proc.stderr


def test_interpret_set_after_triton_was_imported_falls_back_and_says_why(tmp_path: Path) -> None:
    """TRITON_INTERPRET=1 set in Python after `import triton`: Triton's own jit functions were built for the
    compiler at import, so the triton backend's kernels failed inside ("Cannot call @triton.jit'd outside of the
    scope of a kernel"). It falls back to torch, saying why, and the model (fused momentum too) runs."""
    if CUDA:
        pytest.skip("a CUDA device is present: the kernels run")
    script = textwrap.dedent(f"""
        import os, torch, triton
        from energydsl import load
        os.environ["TRITON_INTERPRET"] = "1"
        m = load({str(ROOT / "examples/cem/alibi.energy")!r}).module(backend="triton")
        print(m, m(torch.randn(1, 5, 8)).shape)
        model = load({str(ROOT / "examples/models/momentum-gpt.energy")!r}).model(
            backend="triton", vocab=11, context=8, d=8, layers=2, heads=2)
        print(model(torch.zeros(1, 4, dtype=torch.long)).shape)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["ENERGYDSL_CACHE"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "backend=torch) torch.Size([1, 5, 8])" in proc.stdout, proc.stdout
    notice = [ln for ln in proc.stderr.splitlines() if "falls back to torch" in ln]
    assert len(notice) == 1 and "TRITON_INTERPRET was set after triton was imported" in notice[0], proc.stderr


@pytest.mark.parametrize("path", ["models/momentum-gpt.energy", "models/nag-gpt.energy"])
def test_momentum_across_layers_is_one_fused_step(path: str) -> None:
    """`across layers momentum|nag`: each stage's step m = beta m + f, x = x + eta m is one kernel call (and
    nag's look-ahead x + beta m another), and the model equals the torch backend's, learned beta and eta
    included."""
    from energydsl import kernels

    spec = load(ROOT / "examples" / path)
    dims = dict(vocab=17, context=32, d=16, layers=2, heads=2)
    torch.manual_seed(0)
    a = spec.model(backend="torch", **dims).to(DEVICE)
    b = spec.model(backend="triton", **dims).to(DEVICE)
    b.load_state_dict(a.state_dict())
    assert b.fused_momentum and not a.fused_momentum
    calls: dict[str, int] = {"momentum_update": 0, "nesterov_lookahead": 0}
    real = {name: getattr(kernels, name) for name in calls}

    def spy(name: str) -> object:
        def call(*args: torch.Tensor) -> object:
            calls[name] += 1
            return real[name](*args)
        return call

    idx = torch.randint(0, 17, (2, 11), device=DEVICE)
    for name in calls:  # the model calls them through the package, so this sees every call
        setattr(kernels, name, spy(name))
    try:
        lb = b(idx)
    finally:
        for name, fn in real.items():
            setattr(kernels, name, fn)
    nag = "nag" in path
    assert calls == {"momentum_update": 2 * 2, "nesterov_lookahead": 2 * 2 if nag else 0}  # layers x stages
    la = a(idx)
    assert _rel(lb, la) < 1e-4
    ga = torch.autograd.grad(la.square().mean(), list(a.parameters()))
    gb = torch.autograd.grad(lb.square().mean(), list(b.parameters()))
    for (n, _), x, y in zip(a.named_parameters(), gb, ga):
        assert _rel(x, y) < 1e-3, n


@pytest.mark.parametrize("name", ["SoftplusGate", "GaussianBumps", "NewtonSilu", "WeightedSigmoid"])
def test_element_wise_gates_match_torch_backend(name: str) -> None:
    """Products value * G(pre) with G printed from the energy (a softplus gate, a whole exp(-a²) a, a Newton step's
    SiLU and SiLU' gates) against the torch backend in float32, and their float64 references to rounding."""
    derived = load(ROOT / "tests/data/element-wise-gates.energy").energy(name)
    _compare_backends(derived, name)
    _float64_matches_torch_backend(derived, name)


# every example model, at dims small enough that no weight outweighs the activations of T = 24 tokens
SMALL_MODEL_DIMS = dict(vocab=17, context=64, d=16, layers=1, heads=2, mlp=32, dk=8, dv=8, dff=32)
MODELS = [(p.name, n) for p in sorted((ROOT / "examples/models").glob("*.energy")) for n in load(p).model_names]


def _doubling(run: object) -> float:
    """How much the largest tensor any op makes (forward and backward) grows from T = 24 to T = 48."""
    small, large = (largest_tensor_made(lambda T=T: run(T)) for T in (24, 48))  # type: ignore[operator]
    return large / small


# every energy of the examples and of the test specs
ENERGIES = [(str(p.relative_to(ROOT)), n) for p in [*sorted((ROOT / "examples").rglob("*.energy")),
                                                    *sorted((ROOT / "tests/data").glob("*.energy"))]
            for n in load(p).energy_names]


@pytest.mark.parametrize("path,name", [  # the test specs' energies: slow (CI checks the examples')
    pytest.param(path, name, marks=pytest.mark.slow if path.startswith("tests") else ()) for path, name in ENERGIES])
def test_layer_memory_grows_linearly_in_T(path: str, name: str) -> None:
    """Issue 4's memory target, as far as a CPU sees it: doubling T doubles the largest tensor a triton-backend
    layer makes, forward and backward (a T x T one would quadruple it; the kernels keep theirs in registers)."""
    module = module_class(load(ROOT / path).energy(name), "triton")().to(DEVICE)

    def run(T: int) -> None:
        x = module.example_input(1, T).to(DEVICE).requires_grad_()
        module(x).square().sum().backward()

    assert _doubling(run) <= 2.0


# The torch.compile sweeps below trace forward and backward with fake tensors (where layout disagreements show)
# but run the traced graphs eagerly, on a GPU too: Inductor would compile 124 graphs there, minutes of a short
# device run; test_triton_source.py compiles generated layers with Inductor on CUDA.
SWEEP_COMPILER = "aot_eager"


# CI's share of the sweep below: one example energy per distinct set of kernel specialisations and calls in its
# generated source (op, keyword arguments, baked flags: `_kernel_calls`, which the next test checks the list
# against), and for the plain-attention calls, which most examples share, the energies whose torch code around
# the kernel differs most (Taylor steps, the exact diagonal, DPLR's preconditioner, RoPE).
# `-m slow` runs every energy, of the test specs too, on both backends.
COMPILE_SWEEP_IN_CI = {
    ("examples/cem/alibi.energy", "CEMAlibiAttention"),  # ALiBi slopes and the self bias
    ("examples/cem/steps2.energy", "CEMAttentionSteps2"),
    ("examples/cem/kq-diagonal-exact.energy", "CEMKQDiagonalExact"),
    ("examples/cem/dplr.energy", "CEMAttentionDPLR"),
    ("examples/models/rope-llama.energy", "RopeMHA"),
    ("examples/cem/mlp.energy", "CEMMLP"),  # the gated-activation epilogue
    ("examples/nrgpt/ff2w.energy", "NRGPTFF2W"),  # value * GELU'(a)
    ("examples/nrgpt/ff1.energy", "NRGPTFF1"),  # GELU(a) GELU'(a), no value
    ("examples/nrgpt/attention.energy", "NRGPTAttention"),  # the strict mask
    ("examples/intrinsic-optimizers/softmax-attention.energy", "SoftmaxAttention"),  # one head, no head split
    ("examples/intrinsic-optimizers/softmax-attention-l2.energy", "SoftmaxAttentionL2"),  # a key bias
    ("examples/intrinsic-optimizers/light-mha2nd1st.energy", "LightMHA2nd1st"),  # lse and the second moment
    ("examples/intrinsic-optimizers/mha2nd1st.energy", "MHA2nd1st"),  # the same with a key bias
    ("examples/intrinsic-optimizers/momen-mha.energy", "MomenMHA"),  # the momentum epilogue
    ("examples/intrinsic-optimizers/nag-mha.energy", "NagMHA"),  # Nesterov's look-ahead too
    ("examples/intrinsic-optimizers/data-gated-linear-attention.energy", "DataGatedLinearAttention"),
    ("examples/intrinsic-optimizers/gated-linear-attention.energy", "GatedLinearAttention"),  # a broadcast decay
    ("examples/intrinsic-optimizers/multi-head-linear-attention.energy", "MultiHeadLinearAttention"),
    ("examples/hopfield/classical.energy", "ClassicalHopfield"),  # linear attention without a decay
    ("examples/models/gpt.energy", "MLP"),  # no kernel: the torch code alone
}


def _kernel_calls(path: str, name: str) -> frozenset[str]:
    """What the generated triton-backend source of an energy asks of the kernels: each specialisation's header
    (family and baked flags: `# --- attention kernels for STRICT=False, ...`) and each call of an op set (its
    function and keyword arguments, the equation hash left out)."""
    source = energy_source(load(ROOT / path).energy(name), "triton")
    headers = re.findall(r"^# --- (.*?):?$", source, re.M)
    calls = []
    for fn, args in re.findall(r"\b[a-z]+_[0-9a-f]{8}\.(\w+)\((.*)$", source, re.M):
        keywords = sorted(set(re.findall(r"(\w+)=", args)))
        calls.append(f"{fn}({', '.join(keywords)})")
    return frozenset([*headers, *calls])


def test_the_compile_sweeps_ci_share_covers_every_kernel_call_of_the_examples() -> None:
    """CI's share names example energies (a renamed one would silently leave it), and among them one of each
    set of kernel specialisations and calls the examples make: an example added with a new one is named here."""
    assert COMPILE_SWEEP_IN_CI <= set(ENERGIES), COMPILE_SWEEP_IN_CI - set(ENERGIES)
    calls_of = {(path, name): _kernel_calls(path, name) for path, name in ENERGIES if path.startswith("examples")}
    covered = {calls_of[energy] for energy in COMPILE_SWEEP_IN_CI}
    missing: dict[frozenset[str], tuple[str, str]] = {}
    for energy, calls in calls_of.items():
        if calls not in covered:
            missing.setdefault(calls, energy)
    assert not missing, "add to COMPILE_SWEEP_IN_CI: " + "; ".join(
        f"{energy} ({', '.join(sorted(calls)) or 'no kernel'})" for calls, energy in missing.items())


@pytest.mark.parametrize("path,name,backend", [
    pytest.param(path, name, backend,
                 marks=() if (path, name) in COMPILE_SWEEP_IN_CI and backend == "triton" else pytest.mark.slow)
    for path, name in ENERGIES for backend in ("triton", "torch")])
def test_layer_runs_under_torch_compile(path: str, name: str, backend: str) -> None:
    """Every energy's generated layer under torch.compile, in one graph (the kernels are registered ops with fake
    functions), gives eager's displacement and the same gradients for the input and every parameter."""
    torch._dynamo.reset()  # one `forward` per generated class, but many classes: no recompile limit across tests
    torch.manual_seed(0)
    layer = module_class(load(ROOT / path).energy(name), backend)().to(DEVICE)
    x = layer.example_input(2, 7).to(DEVICE).requires_grad_()
    compiled = torch.compile(layer, backend=SWEEP_COMPILER, fullgraph=True)
    eager, got = layer(x, delta=True), compiled(x, delta=True)
    assert _rel(got, eager) < 1e-5
    wrt = [x, *(p for p in layer.parameters() if p.requires_grad)]
    for g, e in zip(torch.autograd.grad(got.square().sum(), wrt, allow_unused=True),
                    torch.autograd.grad(eager.square().sum(), wrt, allow_unused=True), strict=True):
        assert (g is None) == (e is None) and (e is None or _rel(g, e) < 1e-4)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("path,name", MODELS)
def test_model_memory_grows_linearly_in_T(path: str, name: str, backend: str) -> None:
    """A whole example model likewise, embedding to logits; on the torch backend CEM's ALiBi attention builds a
    T x T mask and weights (so the check can fail), which the triton backend's kernels do not. RMT's reads did
    too until their strided heads were made unit-stride for SDPA's fused kernels."""
    spec = load(ROOT / "examples/models" / path)
    declared = {k for k, _ in spec.syntax.models[name].header}
    model = spec.model(name, backend=backend, **{k: v for k, v in SMALL_MODEL_DIMS.items() if k in declared}).to(DEVICE)

    def run(T: int) -> None:
        model(torch.randint(0, 17, (1, T), device=DEVICE)).square().mean().backward()

    quadratic = backend == "torch" and name == "CEM"
    assert (_doubling(run) > 2.5) == quadratic


@pytest.mark.parametrize("backend", ["triton", pytest.param("torch", marks=pytest.mark.slow)])
@pytest.mark.parametrize("path,name", [  # CI: GPT's and Llama's layers are their momentum and RoPE variants' too
    pytest.param(path, name, marks=pytest.mark.slow if name in ("GPT", "Llama") else ()) for path, name in MODELS])
def test_model_trains_under_torch_compile(path: str, name: str, backend: str) -> None:
    """A whole example model under torch.compile (one graph: the kernels are registered ops with fake functions)
    gives eager's logits and parameter gradients. aot_eager traces the backward with fake tensors as
    Inductor does, so a layout that fake and real tensors disagree on fails here (it did: RMT's final LayerNorm)."""
    spec = load(ROOT / "examples/models" / path)
    declared = {k for k, _ in spec.syntax.models[name].header}
    torch.manual_seed(0)
    model = spec.model(name, backend=backend, **{k: v for k, v in SMALL_MODEL_DIMS.items() if k in declared}).to(DEVICE)
    idx = torch.randint(0, 17, (2, 11), device=DEVICE)
    torch._dynamo.reset()  # every model runs the one `forward` of model.py: no recompile limit across tests
    compiled = torch.compile(model, backend=SWEEP_COMPILER, fullgraph=True)
    params = [p for p in model.parameters() if p.requires_grad]
    eager, got = model(idx), compiled(idx)
    assert _rel(got, eager) < 1e-5
    for (n, _), g, e in zip(model.named_parameters(), torch.autograd.grad(got.square().mean(), params),
                            torch.autograd.grad(eager.square().mean(), params)):
        assert _rel(g, e) < 1e-4, n


DIAGONAL_TIMES_3 = """
energy DiagonalTimes3(d = 8, heads = 2) {
  dim dh = d / heads
  state   x[d]
  context h[j, d] where j <= i
  param   WQ[heads, dh, d] ~ normal(0, 0.3)
  param   WK[heads, dh, d] ~ normal(0, 0.3)
  param   dg[d] ~ normal(0, 0.3)
  let     tau = sqrt(dh)
  local   s[k, j] = ((WQ[k] @ x) . (WK[k] @ h[j]) + 3 * stopgrad(h[j] . (dg * x))) / tau
  global  E = -tau * sum[k](logsumexp[j](s[k, j]))
  optimizer gd(eta = 1)
}
"""


@pytest.mark.parametrize("spec,scalings", [
    (ROOT / "examples/cem/kq-diagonal-score-only.energy", []),  # both dots 1/tau: the kernel's scale alone
    (DIAGONAL_TIMES_3, ["3.0"]),  # the diagonal's query part scaled by 3 relative to the first dot's 1/tau
])
def test_several_score_dots_pass_their_first_coefficient_as_the_kernels_scale(spec, scalings: list[str],
                                                                             tmp_path) -> None:
    """CEM's score `(q·k + h·(dg∘x)) / tau` is one attention over the concatenated features: the first dot's
    coefficient is the kernel's `scale` (free there) and only a coefficient that differs from it scales its
    query part, where both parts were multiplied by 1/tau and the kernel ran at scale 1."""
    if isinstance(spec, str):
        (tmp_path / "spec.energy").write_text(spec)
        spec = tmp_path / "spec.energy"
    derived = load(spec).energy()
    for backend in ("torch", "triton"):
        forward = energy_source(derived, backend).split("def forward", 1)[1]
        assert "scale=0.5," in forward, forward  # 1 / sqrt(dh), dh = 4: rounded once
        assert re.findall(r"= t\d+ \* ([\d.]+)\n", forward) == scalings, forward
    _compare_backends(derived, derived.name)
    _float64_matches_torch_backend(derived, derived.name)
    module = module_class(derived, "torch")().double()  # and the torch backend against the interpreter
    x = module.example_input(2, 7).double()
    raw = dict(module.named_parameters())
    torch.testing.assert_close(module(x), run_program(derived.program, instance_from_params(derived.program, raw, x)),
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("path, name", [
    ("intrinsic-optimizers/momen-mha.energy", "MomenMHA"),  # the attention op and the fused momentum update
    ("cem/mlp.energy", "CEMMLP"),  # the gated epilogue, whose backward op returns a list
    ("intrinsic-optimizers/gated-linear-attention.energy", "GatedLinearAttention"),  # chunked linear attention
])
def test_torch_func_per_sample_gradients_match_the_torch_backend(path, name):
    """torch.func's transforms take the kernels' autograd (a Function with its own setup_context and a vmap
    rule: it refused them, "must override the setup_context staticmethod"): per-sample gradients, vmap over
    grad, agree with the torch backend's. A second derivative is refused by name, not computed wrong."""
    torch.manual_seed(0)
    spec = load(ROOT / "examples" / path)
    reference, fused = spec.module(name, backend="torch").double(), spec.module(name, backend="triton")
    fused.load_state_dict(reference.state_dict())
    xs = torch.randn(3, 2, 7, *fused.state_shape, dtype=torch.float64)
    per_sample = {}
    for module, x in ((reference, xs), (fused, xs.float())):  # the kernels run in float32
        params = {k: v.detach() for k, v in module.named_parameters()}

        def loss(p, x, module=module):
            return torch.func.functional_call(module, p, (x,)).square().sum()

        per_sample[module] = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    assert set(per_sample[fused]) == set(per_sample[reference])
    for key, want in per_sample[reference].items():
        got = per_sample[fused][key].double()
        assert got.shape == (3, *dict(reference.named_parameters())[key].shape)
        assert (got - want).abs().max() <= TOL * want.abs().max().clamp_min(1e-30), key
    x = xs[0].float().requires_grad_()
    (gx,) = torch.autograd.grad(fused(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):  # the backward op's own refusal
        gx.sum().backward()
    with pytest.raises(RuntimeError, match="a second derivative through energydsl's fused Triton kernels"):
        torch.func.grad(lambda y: torch.func.grad(lambda z: fused(z).square().sum())(y).sum())(x.detach())  # was 0


@pytest.mark.filterwarnings("ignore")  # TorchScript tracing is deprecated, and says so
@pytest.mark.parametrize("path", ["cem/mlp.energy", "intrinsic-optimizers/mha.energy",
                                  "intrinsic-optimizers/gated-linear-attention.energy"])
def test_torchscript_traces_the_kernel_ops_with_its_own_checks(path):
    """torch.jit.trace with its trace check: the gated epilogue's shape guard failed on traced sizes, and the
    check (a second trace, under no_grad) saw the op where the first saw the autograd Function. The trace
    runs at another length, and its gradients are the module's."""
    module = load(ROOT / "examples" / path).module(backend="triton")
    traced = torch.jit.trace(module, (torch.randn(2, 8, *module.state_shape),))
    x = torch.randn(2, 11, *module.state_shape)
    assert torch.equal(traced(x), module(x))
    grads = [torch.autograd.grad(m(x).square().sum(), list(module.parameters())) for m in (traced, module)]
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("path,name", [("intrinsic-optimizers/mha.energy", "MHA"),
                                       ("intrinsic-optimizers/gated-linear-attention.energy", "GatedLinearAttention"),
                                       ("cem/mlp.energy", "CEMMLP")])
def test_meta_modules_answer_meta_inputs_and_refuse_inputs_elsewhere(path: str, name: str, backend: str) -> None:
    """The triton backend asked autocast about `meta` (which raised deep in the launcher), and an x on the CPU
    with meta parameters came back as garbage from both backends (torch multiplies them without a word)."""
    module = load(ROOT / "examples" / path).energy(name).module(backend=backend).to("meta")
    x = torch.randn(2, 9, *module.state_shape, device="meta", requires_grad=True)
    y = module(x)
    y.sum().backward()
    assert y.is_meta and y.shape == x.shape and x.grad.is_meta
    with pytest.raises(ValueError, match=r"x is on cpu but the parameters are on meta; move one"):
        module(torch.randn(2, 9, *module.state_shape))


# score terms an audit found that crashed the code generator (exit 70): a key position alone in a score (`j`,
# which the generated code computes per pair), and a slope, key bias or gate per head over a q and k the heads
# share (the attention's heads were read off q, k and v only)
SCORE_EDGES = """
energy KeyPosition(d = 6) {
  state z[d]  context h[j, d] where j <= i  param Wk[d, d] ~ normal(0, 0.3)
  global F = -logsumexp[j](z . (Wk @ h[j]) + 0.3 * j)
}
energy SigmoidSlope(d = 6) {
  state z[d]  context h[j, d] where j <= i  param Wk[d, d] ~ normal(0, 0.3)  param m = 0.4 learn
  global F = -sum[j](integral(sigmoid)(z . (Wk @ h[j]) + m * (j - i)))
}
energy SharedAlibi(d = 6, heads = 3) {
  state z[d]  context h[j, d] where j <= i  param W[d, d] ~ normal(0, 0.3)
  param m[heads] = alibi_slopes(heads) fixed
  global F = -sum[k](logsumexp[j](z . (W @ h[j]) - m[k] * abs(i - j)))
}
energy SharedKeyBias(d = 6, heads = 3) {
  state z[d]  context h[j, d] where j <= i  param W[d, d] ~ normal(0, 0.3)  param u[heads, d] ~ normal(0, 0.5)
  global F = -sum[k](logsumexp[j](z . (W @ h[j]) + u[k] . h[j]))
}
energy SharedForgetGate(d = 6, heads = 3) {
  state z[d]  context h[j, d] where j <= i  param W[d, d] ~ normal(0, 0.3)  param wf[heads, d] ~ normal(0, 0.5)
  global F = -sum[k](logsumexp[j](z . (W @ h[j]) + log(decay(sigmoid(wf[k] . h[j] + 1)))))
}
energy SharedSigmoidAlibi(d = 6, heads = 3) {
  state z[d]  context h[j, d] where j <= i  param W[d, d] ~ normal(0, 0.3)
  param m[heads] = alibi_slopes(heads) fixed
  global F = -sum[k](sum[j](integral(sigmoid)(z . (W @ h[j]) - m[k] * abs(i - j))))
}
energy SharedAlibiCovariance(d = 6, heads = 3) {
  state z[d]  context h[j, d] where j <= i  param W[d, d] ~ normal(0, 0.3)
  param m[heads] = alibi_slopes(heads) fixed
  global F = -sum[k](logsumexp[j](z . (W @ h[j]) - m[k] * abs(i - j)))
  optimizer gd(eta = 0.5) precondition covariance(tau = 0.1)
}
"""


# the kernel each takes (KeyPosition stays on the torch op: its `j` is computed per pair)
SCORE_EDGE_KERNELS = {"KeyPosition": None, "SigmoidSlope": "pointwise_attention(", "SharedAlibi": "energy_attention(",
                      "SharedKeyBias": "energy_attention(", "SharedForgetGate": "energy_attention(",
                      "SharedSigmoidAlibi": "pointwise_attention(", "SharedAlibiCovariance": "energy_attention"}


@pytest.mark.parametrize("name", re.findall(r"energy (\w+)\(", SCORE_EDGES))
def test_score_terms_beyond_the_dot_products_compile_on_both_backends(name: str) -> None:
    derived = load(SCORE_EDGES).energy(name)
    forward = energy_source(derived, "triton").split("def forward", 1)[1]
    kernel = SCORE_EDGE_KERNELS[name]  # `m (j - i)` in a sigmoid was split into `m j - m i`, which no kernel took
    assert (kernel in forward) if kernel else ("_attention(" not in forward or "softmax_attention(" in forward)
    _compare_backends(derived, name, T=9)
    module = module_class(derived, "torch")().double()  # and the torch backend against the interpreter
    x = module.example_input(2, 7).double()
    raw = {**dict(module.named_buffers()), **dict(module.named_parameters())}  # a fixed `m` is a buffer
    torch.testing.assert_close(module(x), run_program(derived.program, instance_from_params(derived.program, raw, x)),
                               rtol=1e-10, atol=1e-10)

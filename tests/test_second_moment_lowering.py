"""Second-order context sums (seed 004's covariance and Newton preconditioners) lowered without T x T x d.

LightMHA2nd1st's b_i = Σ_j p_ij (v_j·v̄_i) v_j and MHA2nd1st's centred Σ_j p_ij d_ij (d_ij·g_i), d_ij = k_j - k̄_i
(with l2-distance scores), are lowered by `energydsl.codegen.second_order`: in the torch backend to
(p ∘ (U Xᵀ)) Y from the T x T weights per head, in the triton backend to the second-moment kernels written into the file
reusing the row log-sum-exp of the first-order attention over the same scores. Each lowered module is
compared with the generic masked T x T (x d) form in float64 (the displacement and the gradients with respect
to x and every parameter), and the triton backend (under the Triton interpreter without CUDA) with the torch
backend, as in `tests/test_triton_backend.py`. Sequence length 13 (odd: partial kernel tiles); 1 and 2 heads;
a strict context (j < i), an untied value (x_j != y_j: the kernels over (x_j, y_j) side by side), and Newton with two
Taylor terms and a learned damping as spec variants.
SoftmaxAttentionL2 (first order only, Σ_j p_ij (z_i - k_j) with l2 scores) is lowered by the same expansion.
"""

import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch
from conftest import largest_tensor_made, script_in_process

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import energydsl  # noqa: E402
from energydsl.codegen import energy_source, module_class  # noqa: E402
from energydsl.codegen.torch_module import module_source  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "cuda" if CUDA else "cpu"
LIGHT = (ROOT / "examples/intrinsic-optimizers/light-mha2nd1st.energy").read_text()
NEWTON = (ROOT / "examples/intrinsic-optimizers/mha2nd1st.energy").read_text()
L2 = (ROOT / "examples/intrinsic-optimizers/softmax-attention-l2.energy").read_text()

# (id, spec text, dims, the triton backend's second moment: the fused "kernel", the "torch" form, or None)
CASES = [
    ("light-h1", LIGHT, {"heads": 1}, "kernel"),
    ("light-h2", LIGHT, {"heads": 2}, "kernel"),
    ("light-strict", LIGHT.replace("where j <= i", "where j < i"), {}, "kernel"),
    ("light-untied", LIGHT.replace("  optimizer gd", "  untie value W2[k] -> Wv[k]\n  optimizer gd"), {}, "untied"),
    # the T x T form's own mask: `mask` for `mask_strict` there survived every other case
    ("light-untied-strict", LIGHT.replace("where j <= i", "where j < i").replace(
        "  optimizer gd", "  untie value W2[k] -> Wv[k]\n  optimizer gd"), {}, "untied"),
    ("newton-h1", NEWTON, {"heads": 1}, "kernel"),
    ("newton-h2", NEWTON, {"heads": 2}, "kernel"),
    ("newton-strict", NEWTON.replace("where j <= i", "where j < i"), {}, "kernel"),
    ("newton-taylor2-damped", NEWTON.replace("taylor = 1, damping = 0", "taylor = 2, damping = 0.2 learn"), {},
     "kernel"),
    ("newton-taylor2-strict", NEWTON.replace("where j <= i", "where j < i").replace("taylor = 1", "taylor = 2"), {},
     "kernel"),
    ("l2-first-order", L2, {}, None),
]
IDS = [c[0] for c in CASES]


def _class(src: str, path: Path) -> type[torch.nn.Module]:
    """The module class of generated source, imported from a file (triton.jit reads its kernels' source)."""
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return next(v for v in vars(module).values() if isinstance(v, type) and issubclass(v, torch.nn.Module)
                and v is not torch.nn.Module)


def _perturb(module: torch.nn.Module, scale: float) -> torch.nn.Module:
    """Weights large enough for peaked softmaxes and a visible second-order term (the 0.02 init is nearly flat)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


def _run(module: torch.nn.Module, x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    """The displacement and the gradients of <w, displacement> w.r.t. x and every parameter."""
    x = x.clone().requires_grad_()
    out = module(x, delta=True)
    params = list(module.parameters())
    grads = torch.autograd.grad((out * w.to(out.dtype)).sum(), [x, *params], allow_unused=True)
    return [out.detach()] + [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, [x, *params])]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("case,text,dims,second", CASES, ids=IDS)
def test_lowered_equals_generic(case: str, text: str, dims: dict, second: str | None, tmp_path: Path) -> None:
    derived = energydsl.load(text).energy(**dims)
    lowered = module_source(derived.program, derived.equation_hash(), lowering=True)
    generic = module_source(derived.program, derived.equation_hash(), lowering=False)
    assert ("second moment from the weights" in lowered) == (second is not None)
    if second is not None:  # the T x T weights are computed once, for the attentions and the second moment
        forward = lowered[lowered.index("def forward"):]
        assert forward.count("masked_softmax(") == 1 and "softmax_attention(" not in forward
    assert "masked_reduce" not in lowered  # no masked T x T (x d) reduction is left
    assert "masked_reduce" in generic
    torch.manual_seed(0)
    a = _perturb(_class(lowered, tmp_path / "gen_lowered.py")().double(), 0.5)
    b = _class(generic, tmp_path / "gen_generic.py")().double()
    b.load_state_dict(a.state_dict())
    x = a.example_input(2, 13).double()
    w = torch.randn(x.shape, dtype=torch.float64)
    labels = ["delta", "x"] + [n for n, _ in a.named_parameters()]
    for label, got, want in zip(labels, _run(a, x, w), _run(b, x, w), strict=True):
        assert want.abs().max() > 0, label
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11, msg=lambda m, label=label: f"{label}: {m}")


@pytest.mark.parametrize("case,text,dims,second", CASES, ids=IDS)
def test_triton_backend_matches_torch_backend(case: str, text: str, dims: dict, second: str | None,
                                              tmp_path: Path) -> None:
    pytest.importorskip("triton")
    derived = energydsl.load(text).energy(**dims)
    src = energy_source(derived, "triton")
    assert ".energy_attention" in src and "masked_reduce" not in src
    if second in ("kernel", "untied"):  # the fused kernel, on the log-sum-exp of the attention over the same scores
        lse = re.search(r"(\w+), (\w+) = \w+\.energy_attention_with_lse\(", src)
        call = re.search(r"attention_\w+\.weighted_second_moment\((\w+), (\w+), (\w+), (\w+), ", src)
        assert lse and call and call.group(4) == lse.group(2), "the second moment does not reuse the attention's lse"
        # x_j != y_j: the kernels' r_i = Σ_j p_ij (u_i·v_j) v_j over v_j = (x_j, y_j), its second half
        side_by_side = re.search(rf"{call.group(3)} = torch\.cat\(", src)
        assert bool(side_by_side) == (second == "untied")
        assert "masked_softmax" not in src  # no T x T weights
    else:  # no second moment at all
        assert "weighted_second_moment" not in src and "energy_attention_with_lse" not in src
        assert "second moment from the weights" not in src
    _compare(case, src, energy_source(derived, "torch"), tmp_path)


def _compare(case: str, triton_src: str, torch_src: str, tmp_path: Path) -> None:
    """The triton module in float32 against the torch one in float64, as `tests/test_triton_backend.py`."""
    tri_cls, torch_cls = _class(triton_src, tmp_path / "gen_triton.py"), _class(torch_src, tmp_path / "gen_torch.py")
    torch.manual_seed(0)
    ref = _perturb(torch_cls(), 0.5).to(DEVICE)
    tri, base = tri_cls().to(DEVICE), torch_cls().to(DEVICE)
    tri.load_state_dict(ref.state_dict())
    base.load_state_dict(ref.state_dict())
    x = ref.example_input(2, 13).to(DEVICE)
    w = torch.randn(x.shape, device=DEVICE)
    want = _run(ref.double(), x.double(), w)
    got = _run(tri.float(), x.float(), w)
    fp32 = _run(base.float(), x.float(), w)
    labels = ["delta", "x"] + [n for n, _ in ref.named_parameters()]
    for label, g, r, b in zip(labels, got, want, fp32, strict=True):
        assert r.abs().max() > 0, label
        err, floor = _rel(g, r), _rel(b, r)
        assert err <= max(1e-4, 4 * floor), f"{case} {label}: {err:.2e} (float32 torch: {floor:.2e})"


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", ["newton-h2", "newton-strict", "newton-taylor2-strict"])
def test_the_newton_direction_cancels_to_m_the_second_moment_and_one_dot(case: str, backend: str) -> None:
    """MHA2nd1st's Newton direction multiplies out to twelve terms of which all but (1 - λ) m, c S and
    -c (m·a) a cancel (m = q - a; a, S the attention and the second moment; q - a written out again is m):
    each Taylor term reads one second moment, one dot product and one dot-times-vector product, where the
    derivation as written took two dot products and six such products per term. Values:
    `test_lowered_equals_generic` (the generic form is the derivation as written) and
    `test_triton_backend_matches_torch_backend`."""
    _, text, dims, _ = next(c for c in CASES if c[0] == case)
    derived = energydsl.load(text).energy(**dims)
    forward = energy_source(derived, backend).split("def forward", 1)[1]
    terms = int(derived.spec.optimizer.hyper["taylor"].value)
    seconds = forward.count("weighted_second_moment(") + forward.count("second moment from the weights")
    assert seconds == terms, forward
    assert len(re.findall(r"torch\.einsum\('btkM,btkM->btk'", forward)) == terms, forward
    assert len(re.findall(r"^ *t\d+ = [-\d.e]+ \* t\d+\[:, :, :, None\] \* t\d+$", forward, re.M)) == terms, forward
    # the direction sums three terms, m (computed anyway, as the second moment's query) not written q - a again
    assert not re.search(r"= \w+( [+-] \w+){3,}$", forward, re.M), forward


@pytest.mark.parametrize("case", ["light-strict", "newton-h2"])
def test_kernel_second_moment_without_a_shared_lse(case: str, tmp_path: Path, monkeypatch) -> None:
    """No first-order call over the same scores to share: the second moment gets its own score arguments and
    a first pass of the specialised attention for the lse."""
    pytest.importorskip("triton")
    from energydsl.codegen import second_order

    _, text, dims, _ = next(c for c in CASES if c[0] == case)
    derived = energydsl.load(text).energy(**dims)
    monkeypatch.setattr(second_order, "_shared_lse", lambda *args: None)
    src = energy_source(derived, "triton")
    lse = re.search(r"(\w+) = \w+\.energy_attention_with_lse\((\w+), (\w+), (\w+), .*\)\[1\]", src)
    call = re.search(r"attention_\w+\.weighted_second_moment\((\w+), (\w+), (\w+), (\w+), ", src)
    assert lse and call and call.group(4) == lse.group(1)
    assert lse.group(2, 3, 4) == call.group(1, 2, 3)  # the same scores and values
    _compare(case, src, energy_source(derived, "torch"), tmp_path)


def test_lowering_benchmark_times_a_single_energy_and_rejects_bad_dims() -> None:
    """`benchmarks/lowering.py` on a file without a model times its layer (lowered vs generic, same weights:
    the outputs agree); a malformed or unknown `--set` is a message and exit 2."""
    script = ("benchmarks/lowering.py", "--spec", "examples/intrinsic-optimizers/light-mha2nd1st.energy",
              "--context", "12", "--batch", "1", "--repeats", "1")
    ok = script_in_process(*script)
    assert ok.returncode == 0, ok.stderr
    diff = float(re.search(r"max relative difference (\S+)", ok.stdout).group(1))
    assert diff < 1e-4
    for bad, said in ((["--set", "d"], "NAME=NUMBER"), (["--set", "nope=3"], "`nope` is not a dim")):
        proc = script_in_process(*script, *bad)
        assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("case", ["light-untied", "light-untied-strict"])
def test_an_untied_second_moment_stays_linear_in_T(case: str) -> None:
    """The untied covariance built its T x T weights in the triton backend too (the torch form); over (x_j, y_j)
    side by side the kernels keep them in registers: doubling T doubles the largest tensor, forward and backward."""
    pytest.importorskip("triton")
    text = next(c[1] for c in CASES if c[0] == case)
    module = module_class(energydsl.load(text).energy(), "triton")().to(DEVICE)

    def run(T: int) -> None:
        x = module.example_input(1, T).to(DEVICE).requires_grad_()
        module(x).square().sum().backward()

    small, large = (largest_tensor_made(lambda T=T: run(T)) for T in (24, 48))
    assert large / small <= 2.0

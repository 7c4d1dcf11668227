"""Generated PyTorch modules against the reference interpreter, and the ops they lower to against plain forms."""

from __future__ import annotations

import glob
import os
import re

import pytest
import sympy as sp
import torch
import torch.nn.functional as F
from conftest import WEIGHTED_SUMS, largest_tensor_made

if not torch.cuda.is_available():  # the triton rows run the generated kernels, as in test_triton_backend.py
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported; else the backend falls back to torch

import energydsl  # noqa: E402
from energydsl import ir  # noqa: E402
from energydsl.codegen import energy_source, module_class  # noqa: E402
from energydsl.codegen.hoist import hoist_invariants  # noqa: E402
from energydsl.codegen.projections import COMMENT as PROJECTIONS_COMMENT  # noqa: E402
from energydsl.codegen.projections import fuse_projections  # noqa: E402
from energydsl.codegen.torch_module import module_source  # noqa: E402
from energydsl.codegen.weight_products import weights_first  # noqa: E402
from energydsl.instance import instance_from_params, run_program  # noqa: E402
from energydsl.kernels.linear_ref import linear_attention_recurrent_ref  # noqa: E402
from energydsl.runtime.ops import (  # noqa: E402
    causal_masks,
    linear_attention,
    masked_reduce,
    prefix_reduce,
    projections,
    softmax_attention,
)

EXAMPLES = sorted(glob.glob("examples/**/*.energy", recursive=True))
ENERGIES = [(f, n) for f in EXAMPLES for n in energydsl.load(f).energy_names]


def _perturbed(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    module = module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


def _raw(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(list(module.named_parameters()) + list(module.named_buffers()))


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ENERGYDSL_CACHE", str(tmp_path_factory.getbasetemp() / "codegen"))


@pytest.mark.parametrize("path,name", ENERGIES, ids=[f"{f.split('/')[-2]}/{n}" for f, n in ENERGIES])
def test_generated_module_matches_interpreter(path: str, name: str) -> None:
    _matches_interpreter(energydsl.load(path).energy(name))


@pytest.mark.parametrize("name", ["PerHeadTemperature", "KeySideGain"])
def test_a_learned_factor_in_the_scores_still_lowers_to_attention(name: str) -> None:
    """`(q_k . k_j) / t_k` with a learned t per head: the factor goes into the query and the sum runs as
    attention; it was the T x T masked softmax (and a (B, T, T, H, dh) product) before."""
    derived = energydsl.load("tests/data/learned-temperature.energy").energy(name)
    source = energy_source(derived)
    assert "softmax_attention(" in source and "masked_softmax" not in source
    _matches_interpreter(derived)


@pytest.mark.parametrize("name", WEIGHTED_SUMS)
def test_a_weighted_context_sum_contracts_the_weights_with_the_values(name: str) -> None:
    """Σ_j w_ij v_j that no attention form fits (sigmoid, squared-ReLU weights): the masked T x T weights times
    the values in one einsum; the masked form built the (B, T, T, heads, d) product first. T = 1 under a strict
    context sums over no token."""
    derived = energydsl.load("tests/data/weighted-context-sums.energy").energy(name)
    assert re.search(r"torch\.einsum\('btjk?,bjk?A->btk?A'", energy_source(derived))
    for T in (7, 1):
        _matches_interpreter(derived, T)
    module = module_class(derived)()
    x = module.example_input(2, 32).requires_grad_()
    largest = largest_tensor_made(lambda: module(x).square().sum().backward())
    pairs, d = 2 * 32 * 32, x.shape[-1]
    assert largest < pairs * d // 2, (largest, pairs)  # T x T (x heads), not x features as well


def _matches_interpreter(derived, T: int = 7, backend: str = "torch", atol: float = 1e-12,
                         context: tuple[int, ...] | None = None):
    """The module's update, displacement and training gradients against the reference interpreter, float64;
    returns (module, x, the interpreter's update). `context`: a context of this shape per token, where it is
    not the state's (by default the context is the state, as in a model)."""
    module = _perturbed(module_class(derived, backend)())
    x = module.example_input(2, T).double()
    x.requires_grad_()
    h = None if context is None else torch.randn(2, T, *context, dtype=torch.float64,
                                                 generator=torch.Generator().manual_seed(2)).requires_grad_()
    out = module(x, context=h)
    ref = run_program(derived.program, instance_from_params(derived.program, _raw(module), x, context=h))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=atol)
    torch.testing.assert_close(module(x, context=h, delta=True), ref - x, rtol=1e-9, atol=max(atol, 1e-11))
    # training gradients: the input's (and context's) and every parameter's, under a random cotangent
    leaves = [x, *([] if h is None else [h]), *module.parameters()]
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    got = torch.autograd.grad(out, leaves, cotangent, allow_unused=True)
    want = torch.autograd.grad(ref, leaves, cotangent, allow_unused=True)
    labelled = [("x", x), *([] if h is None else [("context", h)]), *module.named_parameters()]
    for (label, _), g, w in zip(labelled, got, want, strict=True):
        assert (g is None) == (w is None), label
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11, msg=lambda m, label=label: f"{label}: {m}")
    return module, x.detach(), ref.detach()


@pytest.mark.parametrize("path", ["examples/intrinsic-optimizers/mha.energy",
                                  "examples/intrinsic-optimizers/gated-linear-attention.energy",
                                  "examples/intrinsic-optimizers/multi-head-linear-attention.energy",  # decay per head
                                  "examples/intrinsic-optimizers/data-gated-linear-attention.energy",  # decay(r)
                                  "examples/models/gla.energy:GatedRetention",  # decay(r) per head
                                  "examples/nrgpt/attention.energy", "examples/cem/alibi.energy",
                                  "tests/data/exp-decay-linear-attention.energy:ExpDecay",  # exp(-lam[k] (i - j))
                                  "tests/data/exp-decay-linear-attention.energy:ExpDecayStrict",  # (j - i)
                                  "tests/data/exp-decay-linear-attention.energy:ExpDecayAbs",  # abs(j - i)
                                  "tests/data/exp-decay-linear-attention.energy:TwoDecays",  # 0.9^(i-j) e^(-lam (i-j))
                                  "tests/data/decayed-sums.energy:HeadMovingAverages",  # Σ_j γ_ij v_j: q = k = 1
                                  "tests/data/data-dependent-decay.energy:SquaredGate",  # decay(r)^2
                                  "tests/data/alibi-second-order.energy:CovPerHeadAlibi",  # -(… + m |i - j|)
                                  "tests/data/weighted-context-sums.energy:SigmoidAttention",  # weights @ values
                                  "tests/data/weighted-context-sums.energy:ReluSquaredStrict",
                                  "tests/data/weighted-context-sums.energy:GaussianKernel"])  # z - k_j split
def test_lowered_forms_equal_generic_form(path: str, tmp_path) -> None:
    """SDPA / chunked linear attention give what the plain masked T x T reduction gives, gradients included."""
    path, _, name = path.partition(":")
    derived = energydsl.load(path).energy(name or None)
    mods = []
    for lowering in (True, False):
        src = module_source(derived.program, derived.equation_hash(), lowering=lowering)
        scope: dict = {}
        exec(compile(src, f"<{lowering}>", "exec"), scope)
        cls = next(v for k, v in scope.items() if isinstance(v, type) and issubclass(v, torch.nn.Module)
                   and v is not torch.nn.Module)
        torch.manual_seed(0)
        mods.append(_perturbed(cls()))
        forward = src[src.index("def forward"):]
        if lowering:  # attention, linear attention, or a second moment from the softmax weights
            assert "masked_reduce(" not in forward or name == "GaussianKernel"  # there: Σ_j w_ij, T x T
        else:
            assert "attention(" not in forward and "masked_reduce(" in forward
    mods[1].load_state_dict(mods[0].state_dict())
    x = mods[0].example_input(2, 70).double().requires_grad_()
    a, b = mods[0](x), mods[1](x)
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    ga = torch.autograd.grad(a.square().sum(), x)[0]
    gb = torch.autograd.grad(b.square().sum(), x)[0]
    torch.testing.assert_close(ga, gb, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("call, message", [
    (lambda m: m(torch.randn(5, 16)), "MHA: x must be (batch, seq, 16), got shape (5, 16)"),
    (lambda m: m(torch.randn(2, 5, 15)), "MHA: x must be (batch, seq, 16), got shape (2, 5, 15)"),
    (lambda m: m(torch.randn(2, 0, 16)), "MHA: x has no tokens"),
    (lambda m: m(torch.randn(0, 3, 16)), "MHA: x has no sequences"),  # a RuntimeError from a reshape before
    (lambda m: m(torch.randn(2, 5, 16), context=torch.randn(2, 7, 16)),  # would reshape into the batch
     "MHA: context must have x's batch and length (2, 5)"),
    (lambda m: m(torch.randn(2, 5, 16), context=torch.randn(1, 10, 16)),  # 10 = 2 x 5: silently wrong before
     "MHA: context must have x's batch and length (2, 5)"),
    (lambda m: m(torch.randn(2, 5, 16), context=torch.randn(2, 5, 8)), "MHA: context must be (batch, seq, 16)"),
    (lambda m: m(torch.randn(2, 5, 16), input=torch.randn(2, 5, 16)), "MHA takes no input"),
    (lambda m: m(torch.randn(2, 5, 16, dtype=torch.float64)), "MHA: x is torch.float64 but the parameters are"),
    (lambda m: m(torch.randn(2, 5, 16), context=torch.randn(2, 5, 16).double()), "MHA: context is torch.float64"),
    (lambda m: m(torch.zeros(2, 5, 16, dtype=torch.long)), "MHA: x must be floating point"),
    (lambda m: m([[0.0] * 16]), "MHA: x must be a torch.Tensor, got list"),
    (lambda m: m(torch.randn(2, 5, 16), context=[0.0]), "MHA: context must be a torch.Tensor, got list"),
])
def test_a_generated_forward_names_what_is_wrong_with_its_inputs(call, message: str) -> None:
    module = energydsl.load("examples/intrinsic-optimizers/mha.energy").module(d=16, heads=2)
    with pytest.raises(ValueError) as err:
        call(module)
    assert str(err.value).startswith(message), str(err.value)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: float32 inputs into bfloat16 matmuls are fine
        assert module(torch.randn(2, 5, 16)).shape == (2, 5, 16)


def test_an_input_of_another_length_is_named_as_a_per_token_input() -> None:
    """`input` is each token's own: the message explained it as the context is ("tokens up to i")."""
    module = energydsl.load("examples/cem/mlp.energy").module()
    with pytest.raises(ValueError) as err:
        module(torch.randn(2, 4, 8), input=torch.randn(2, 3, 8))
    assert str(err.value) == "CEMMLP: input must have x's batch and length (2, 4) (token i reads its own token's " \
                             "input), got (2, 3)"


def test_a_module_of_a_file_with_several_names_hints_the_module_call() -> None:
    with pytest.raises(energydsl.SpecError) as err:
        energydsl.load("examples/models/gpt.energy").module()
    assert err.value.hint == '`--name MHA` on the command line; in Python, .module("MHA")'  # was .energy or model(


def test_cache_reuses_generated_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ENERGYDSL_CACHE", str(tmp_path))
    derived = energydsl.load("examples/cem/mlp.energy").energy(d=6, dv=10)  # dims no other test uses
    a = module_class(derived)
    files = list(tmp_path.glob("*.py"))
    assert len(files) == 1
    mtime = files[0].stat().st_mtime_ns
    assert module_class(energydsl.load("examples/cem/mlp.energy").energy(d=6, dv=10)) is a
    assert files[0].stat().st_mtime_ns == mtime
    assert energy_source(derived) + "# energydsl cache checksum: " in files[0].read_text()


@pytest.mark.parametrize("damage", ["cut short", "emptied", "edited"])
def test_a_damaged_cache_entry_is_generated_again(tmp_path, monkeypatch, damage: str) -> None:
    """A cache file cut short (a full disk, a killed copy) or emptied was imported as it was: a SyntaxError (or
    "module has no attribute") in every later process, until someone found and deleted the file."""
    import sys

    monkeypatch.setenv("ENERGYDSL_CACHE", str(tmp_path))
    spec = energydsl.load("examples/cem/mlp.energy")
    dv = {"cut short": 13, "emptied": 14, "edited": 15}[damage]  # dims no other test uses: generated here
    cls = module_class(spec.energy(d=5, dv=dv))
    (path,) = tmp_path.glob("*.py")
    whole = path.read_text()
    path.write_text({"cut short": whole[: len(whole) // 2], "emptied": "",
                     "edited": whole.replace("def forward", "def forward_", 1)}[damage])
    monkeypatch.delitem(sys.modules, cls.__module__)  # as a fresh process finds it
    layer = module_class(spec.energy(d=5, dv=dv))()
    assert layer(torch.randn(1, 2, 5)).shape == (1, 2, 5) and path.read_text() == whole


def test_a_generated_file_that_fails_to_import_is_not_left_half_imported(tmp_path, monkeypatch) -> None:
    """The module was put in sys.modules before it ran: after a failure, the next call in the process returned
    that empty module ("has no attribute"), whatever the cache held by then."""
    import sys

    from energydsl import codegen

    monkeypatch.setenv("ENERGYDSL_CACHE", str(tmp_path))
    with pytest.raises(ZeroDivisionError):
        codegen._generated_module("broken_0123abcd.py", lambda: "x = 1 / 0\n")
    assert "energydsl_generated_0123abcd" not in sys.modules


def test_a_cache_that_cannot_be_written_builds_in_a_private_folder_and_says_so(tmp_path, monkeypatch, capsys):
    """A read-only home or an ENERGYDSL_CACHE naming a file: no layer could be built at all (pathlib's
    FileExistsError, naming neither the cache nor the setting)."""
    from energydsl import codegen

    blocker = tmp_path / "cache"
    blocker.write_text("a file")
    monkeypatch.setenv("ENERGYDSL_CACHE", str(blocker))
    monkeypatch.setattr(codegen, "_PRIVATE_DIR", None)
    for d in (7, 9):  # dims no other test uses: generated here, not found in sys.modules
        layer = module_class(energydsl.load("examples/cem/mlp.energy").energy(d=d, dv=11))()
        assert layer(torch.randn(1, 2, d)).shape == (1, 2, d)
    notice = capsys.readouterr().err
    assert notice.count("energydsl: cannot write the code cache") == 1, notice  # said once
    assert f"code cache {blocker} ({blocker} is a file, not a directory)" in notice
    assert "set ENERGYDSL_CACHE to a folder you can write" in notice
    assert len(list(codegen._PRIVATE_DIR.glob("*.py"))) == 2 and blocker.read_text() == "a file"


def test_a_changed_generator_regenerates(tmp_path, monkeypatch) -> None:
    """The cache key hashes the generator's own source: an edited generator never reuses an old file."""
    from energydsl import codegen

    monkeypatch.setenv("ENERGYDSL_CACHE", str(tmp_path))
    derived = energydsl.load("examples/cem/mlp.energy").energy(d=6, dv=12)
    module_class(derived)
    monkeypatch.setattr(codegen, "generator_version", lambda: "edited")
    module_class(derived)
    assert len(list(tmp_path.glob("*.py"))) == 2


def test_generated_module_is_torch_compilable() -> None:
    module = energydsl.load("examples/intrinsic-optimizers/mha.energy").module()
    x = module.example_input(2, 8)
    compiled = torch.compile(module, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), module(x))


# ----------------------------------------------------------------------------- the ops, against plain forms


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("decay", [None, -0.2])
@pytest.mark.parametrize("T", [1, 5, 64, 70])
def test_chunked_linear_attention_equals_recurrence(strict: bool, decay: float | None, T: int) -> None:
    g = torch.Generator().manual_seed(T)
    q, k = (torch.randn(2, 3, T, 4, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 3, T, 5, generator=g, dtype=torch.float64)
    ld = None if decay is None else torch.tensor(decay, dtype=torch.float64)
    out = linear_attention(q, k, v, log_decay=ld, strict=strict, chunk=16)
    ref = linear_attention_recurrent_ref(q, k, v, log_decay=None if ld is None else ld.expand(3), strict=strict)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("strict", [False, True])
def test_softmax_attention_equals_masked_softmax(strict: bool) -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 9, 4, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(2, 3, 9, 9, generator=g, dtype=torch.float64)
    out = softmax_attention(q, k, v, scale=0.7, bias=bias, strict=strict)
    mask = causal_masks(9, q.device)[1 if strict else 0]
    s = (0.7 * q @ k.transpose(-1, -2) + bias).masked_fill(~mask, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, -1))
    torch.testing.assert_close(out, p @ v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("op", ["sum", "mean", "logsumexp"])
@pytest.mark.parametrize("strict", [False, True])
def test_prefix_reduce_equals_masked_reduce(op: str, strict: bool) -> None:
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    mask = causal_masks(6, x.device)[1 if strict else 0]
    full = x[:, None].expand(2, 6, 6, 3)  # (b, i, j, d)
    ref = masked_reduce(full, mask[None, :, :, None], dim=2, op=op)
    torch.testing.assert_close(prefix_reduce(x, dim=1, op=op, strict=strict), ref)


_HASH_BASE = """
energy E(d = 4) {
  state   z[d]
  context h[j, d] where j <= i
  param   W[d, d] ~ normal(0, 0.02)
  global  F = -logsumexp[j](z . (W @ h[j]))
  optimizer gd(eta = 1)
}
"""


@pytest.mark.parametrize("change", [
    ("j <= i", "j < i"),                       # the mask: the equations print alike
    ("gd(eta = 1)", "gd(eta = 1) steps 2"),    # the number of steps
    ("normal(0, 0.02)", "normal(0, 0.5)"),     # the initialiser
])
def test_equation_hash_tells_apart_what_the_equations_do_not_show(tmp_path, change) -> None:
    """The codegen cache and the search's deduplication key on the equation hash: layers that differ in
    mask, steps or initialisation must not share it (nor, therefore, a cached module)."""
    a, b = tmp_path / "a.energy", tmp_path / "b.energy"
    a.write_text(_HASH_BASE)
    b.write_text(_HASH_BASE.replace(*change))
    da, db = energydsl.load(a).energy("E"), energydsl.load(b).energy("E")
    assert da.equation_hash() != db.equation_hash()
    assert module_class(da) is not module_class(db)
    same = tmp_path / "same.energy"
    same.write_text("# the same layer, laid out otherwise\n" + _HASH_BASE.replace("  global", "  global "))
    assert energydsl.load(same).energy("E").equation_hash() == da.equation_hash()


@pytest.mark.parametrize("optimizer", ["momentum", "nag"])
def test_a_default_hyperparameter_prints_as_a_written_one(optimizer: str) -> None:
    """`momentum()` printed `β = 0.900000000000000`. The default stays the float it was (the equation hash that
    checkpoints hold is unchanged); it prints as `beta = 0.9` does."""
    text = _HASH_BASE.replace("gd(eta = 1)", f"{optimizer}() steps 2")
    assert "β = 9/10; η = 1" in energydsl.load(text).energy("E").equations("text")
    written = energydsl.load(text.replace(f"{optimizer}()", f"{optimizer}(beta = 0.9)")).energy("E")
    assert "β = 9/10; η = 1" in written.equations("text")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_steps_loop_lays_out_its_context_once(backend: str) -> None:
    """Keys and values that the steps do not change (CEM's W_K h, tied: keys are the values) are laid out for
    the attention op once, before the loop, and passed as one tensor; only the queries are laid out per step."""
    derived = energydsl.load("examples/cem/steps2.energy").energy("CEMAttentionSteps2")
    forward = energy_source(derived, backend).split("def forward", 1)[1]
    before, loop = forward.split("for _step in range(2):")
    to_bhtd = re.compile(r"(t\d+) = \w+\.permute\(0, 2, 1, 3\)$", re.M)  # (B, T, H, D) -> (B, H, T, D) layouts
    assert len(to_bhtd.findall(before)) == 1 and len(to_bhtd.findall(loop)) == 1
    layout = to_bhtd.findall(before)[0]
    assert f", {layout}, {layout}," in loop  # k and v: the same tensor


def test_invariant_lines_leave_the_steps_loop() -> None:
    """`hoist_invariants` moves a line before the loop when it reads nothing the steps change, and keeps in
    the loop a line that reads the state, a kept line's result, a name the body reads before assigning it,
    or that assigns a carried name or mutates."""
    body = [
        "t0 = F.softplus(P)  # a constrained weight",
        "t1 = t0.transpose(-1, -2)",
        "t2 = x_ @ t1",
        "t3 = t2 * 2",
        "t4 = torch.cat([c1, t0], dim=-1)",
        "t5 = t9 + 1",  # t9: assigned below, so carried from the previous step
        "t9 = t4 * 3",
        "t6[0] = 1.0",  # mutates: never moved
        "x_, m_ = step(x_, m_, t3, t5)",
        "t7 = m_ * t4",
    ]
    hoisted, kept = hoist_invariants(body, {"x_", "m_"})
    assert hoisted == [body[0], body[1], body[4]]
    assert kept == [b for b in body if b not in hoisted]


def test_a_steps_loop_computes_what_the_steps_share_once() -> None:
    """In CEM's two-step layers the parameters' transposes and softplus, the position biases and the
    concatenated key features with their (B, H, T, D) copy are computed once, before the loop."""
    source = energy_source(energydsl.load("examples/models/cem.energy").energy("CEMAttention"), "triton")
    before, loop = source.split("def forward", 1)[1].split("for _step in range(2):")
    for shared in ("torch.cat([c1,", ".transpose(-1, -2)", "torch.as_tensor(b_self"):
        assert shared in before and shared not in loop, shared
    features = re.search(r"(t\d+) = torch\.cat\(\[c1,", before).group(1)
    keys = re.search(rf"(t\d+) = {features}\.permute\(", before).group(1)
    assert "energy_attention(" in loop and f", {keys}, " in loop  # the keys' layout, read at every step


_SHARED_LETS = """
energy E(d = 4) {
  state   z[d]
  context h[j, d] where j <= i
  param   W[d, d] ~ normal(0, 0.5)
  let     a[j] = tanh(h[j])
  let     b[j] = W @ tanh(h[j])
  global  F = -logsumexp[j](z . a[j]) + 0.5 * z . z - sum[j](z . b[j]) / 4
  optimizer gd(eta = 0.5) steps 2
}
"""


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("relation", ["j <= i", "j < i"])
def test_lets_share_what_they_have_in_common(backend: str, relation: str) -> None:
    """The prologue computes a value once for every let that needs it: tanh(h) for `a` and again inside `b`,
    whose code refers to it by the name `a` got (not by the temporary it had before it was named). Under
    `j < i` the prefix sum of `b` must leave out the token itself (a mutation passing `strict=False` survived)."""
    derived = energydsl.load(_SHARED_LETS.replace("j <= i", relation)).energy()
    assert energy_source(derived, backend).count("torch.tanh(") == 1
    _matches_interpreter(derived, 5, backend)


_HEAD_REDUCTIONS = """
energy MaxK(d = 4, heads = 3) {
  state   z[d]
  input   h[d]
  param   a[heads] ~ normal(0, 1)
  global  F = 0.5 * z . z - max[k](a[k]) * (h . z)
}
energy MeanK(d = 4, heads = 3) {
  state   z[d]
  input   h[d]
  param   a[heads] ~ normal(0, 1)
  global  F = 0.5 * z . z - mean[k](a[k]) * (h . z)
}
"""


@pytest.mark.parametrize("name", ["MaxK", "MeanK"])
def test_reductions_over_a_head_index_match_the_interpreter(name: str) -> None:
    """`max[k]` and `mean[k]` of a per-head value over a non-context index (`.amax`, `.mean`): no test reached
    them, and `.amin` or `.sum` there survived."""
    _matches_interpreter(energydsl.load(_HEAD_REDUCTIONS).energy(name))


@pytest.mark.parametrize("term", ["tanh(z)", "gelu(z)", "abs(z) * z", "softplus(z)"])
def test_second_derivatives_of_functions_print_as_torch(term: str) -> None:
    """Newton's Hessian terms hold the functions' second derivatives, which SymPy writes with tanh, cosh, erf,
    sign, ...: each prints as torch code (tanh's once crashed `energy compile`), and the module agrees."""
    text = (f"energy E(d = 4) {{\n state z[d]\n input h[d]\n global F = sum({term}) + 0.5 * z . z - h . z\n"
            " optimizer newton(taylor = 2, damping = 0.5)\n}")
    derived = energydsl.load(text).energy()
    _matches_interpreter(derived)


def test_a_matrix_inverse_runs_in_half_precision() -> None:
    """MHA2nd1st's (W1_k W1_kᵀ)⁻¹ after `.to(torch.bfloat16)`: torch.linalg.inv has no half-precision kernel,
    so the generated module inverts in float32 and casts back, as autocast does."""
    spec = energydsl.load("examples/intrinsic-optimizers/mha2nd1st.energy")
    torch.manual_seed(0)
    layer = spec.module("MHA2nd1st", d=16, heads=2)
    x = layer.example_input(2, 5)
    want = layer.double()(x.double())
    for dtype in (torch.bfloat16, torch.float16):
        got = layer.to(dtype)(x.to(dtype))
        assert got.dtype == dtype
        assert (got.double() - want).abs().max() / want.abs().max() < 2e-2


def test_a_parameter_named_like_a_runtime_op_does_not_shadow_it() -> None:
    text = open("examples/intrinsic-optimizers/mha2nd1st.energy").read().replace("W2", "inverse")
    layer = energydsl.load(text).module("MHA2nd1st")
    assert layer(layer.example_input(1, 3)).shape == (1, 3, 8)


@pytest.mark.parametrize("use", ["C * (x . x)", "huber(x . x, C)"])
def test_constants_that_agree_to_fifteen_digits_are_told_apart(use: str) -> None:
    """`repr` of a SymPy Float keeps 15 digits: `0.1234567890123456` and `…457` had one equation hash and one
    cache key, and the second energy ran the first's generated code."""
    from energydsl.codegen import cache_key

    text = "energy A(d = 3) {\n  state x[d]\n  param S[d, d]\n  global F = 0.5 * (S @ x) . (S @ x) + USE\n}\n"
    a, b = (energydsl.load(text.replace("USE", use.replace("C", c))).energy()
            for c in ("0.1234567890123456", "0.1234567890123457"))
    assert a.equation_hash() != b.equation_hash() and cache_key(a, "torch") != cache_key(b, "torch")
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    layer_a, layer_b = a.module(dtype=torch.float64), b.module(dtype=torch.float64)
    layer_b.load_state_dict(layer_a.state_dict())
    assert not torch.equal(layer_a(x), layer_b(x))
    assert ir.key_text(sp.Float(0.5) * sp.Symbol("d")) == repr(sp.Float(0.5) * sp.Symbol("d"))  # hashes held before


def test_the_cache_tells_apart_energies_whose_updates_agree() -> None:
    """A constant in the energy changes no update (nor the equation hash) but the file's docstring shows it."""
    from energydsl.codegen import cache_key

    text = open("examples/intrinsic-optimizers/mha.energy").read()
    a = energydsl.load(text).energy("MHA")
    b = energydsl.load(text.replace("global  F = ", "global  F = 100 + ")).energy("MHA")
    assert a.equation_hash() == b.equation_hash() and "100" in b.equations()
    assert cache_key(a, "torch") != cache_key(b, "torch")
    assert "100" in energydsl.codegen.energy_source(b)
    # a let's name changes no update either, but the generated code calls the value by it
    text = open("examples/cem/mlp.energy").read()
    a = energydsl.load(text).energy("CEMMLP")
    b = energydsl.load(text.replace("gamma", "gain")).energy("CEMMLP")
    assert a.equation_hash() == b.equation_hash() and cache_key(a, "torch") != cache_key(b, "torch")
    assert "gain = F.linear(h, W)" in energydsl.codegen.energy_source(b)


def test_projections_of_one_input_merge_into_one_call() -> None:
    """`fuse_projections` merges the `F.linear`s whose inputs may be one tensor into one `projections` call,
    keeps each product's method chain on its own line, and orders lines by their dependencies: a member's
    readers after the call, a projection that reads another member's result (or a value that replaced its
    input) out of the group."""
    block = [
        "c1 = F.linear(h, Wv.reshape(-1, Wv.shape[-1])).unflatten(-1, (2, -1))",
        "t4 = c1.permute(0, 2, 1, 3)",
        "z = x",
        "t1 = F.linear(z, Wq)",
        "t2 = F.linear(t1, Wo)",  # reads a member: another input
        "t3 = F.linear(t4, Wk)",  # t4 may be x, but it reads c1, a member: not in the group
        "t5 = F.linear(u, Wk)  # u is its own root",
        "t6 = t2 + t3 + t5",
    ]
    taken = {"p0", "h", "x"}
    out = fuse_projections(block, {"h": "x", "z": "x", "t4": "x"}, taken)
    assert out == [
        "z = x",
        "p1, t1 = projections(h, Wv.reshape(-1, Wv.shape[-1]), z, Wq)" + PROJECTIONS_COMMENT,
        "c1 = p1.unflatten(-1, (2, -1))",
        *block[1:2], *block[4:],
    ]
    assert "p1" in taken
    assert fuse_projections(block[:2], {}, set()) == block[:2]  # nothing to merge: the block as it was
    swapped = ["t1 = F.linear(x, A)", "t2 = t1 * 2", "x = t2", "t3 = F.linear(x, C)"]
    assert fuse_projections(swapped, {}, set()) == swapped  # the second x is another value: x = t2 depends on t1


class _Products:
    """Counts the matrix products (mm, addmm) run inside the block: forward, or forward and backward."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
                return func(*args, **(kwargs or {}))

        self.count, self.mode = 0, Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)


@pytest.mark.parametrize("same", [True, False])
def test_projections_run_one_gemm_per_distinct_input(same: bool) -> None:
    """`projections` equals its separate products, values and gradients in float64, and runs one matrix product
    forward (two backward) for the weights of one input: the context is the state when none is given."""
    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    h = x if same else torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(n, 4, dtype=torch.float64, requires_grad=True) for n in (3, 6, 2)]
    leaves = [x, *ws] if same else [x, h, *ws]
    pairs = ((x, ws[0]), (h, ws[1]), (x, ws[2]))
    upstream = [torch.randn(2, 5, w.shape[0], dtype=torch.float64) for w in ws]
    with _Products() as products:
        fused = projections(*(t for pair in pairs for t in pair))
        torch.autograd.backward(fused, upstream)
    assert products.count == (3 if same else 6)
    fused_grads = [t.grad for t in leaves]
    separate = [F.linear(a, w) for a, w in pairs]
    separate_grads = torch.autograd.grad(separate, leaves, upstream)
    for a, b in zip([*fused, *fused_grads], [*separate, *separate_grads], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_generated_attention_layer_projects_queries_keys_and_values_in_one_gemm() -> None:
    """GPT's attention layer: its q, k, v projections are one matrix product when it attends to itself, two
    (the context's keys and values, the state's queries) when it is given a context; the values are the same.
    Both backends group them (the triton kernels read the product's column views in place)."""
    derived = energydsl.load("examples/models/gpt.energy").energy("MHA")
    assert all(energy_source(derived, backend).count("projections(") == 1 for backend in ("torch", "triton"))
    module = _perturbed(module_class(derived, "torch")()).double()
    x = module.example_input(2, 6).double()

    for context, products_of_x in ((None, 2), (x.clone(), 3)):  # + the output projection
        with _Products() as products:
            out = module(x, context)
        assert products.count == products_of_x
        ref = run_program(derived.program, instance_from_params(derived.program, _raw(module), x, context))
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


_LOW_RANK = """
energy LowRank(d = 8, r = {r}) {{
  state   z[d]
  param   U[d, r] ~ normal(0, 0.5)
  param   V[d, r] ~ normal(0, 0.5)
  global  F = 0.5 * z . z - z . (U @ (V^T @ tanh(z)))
  optimizer gd(eta = 0.5)
}}
"""


@pytest.mark.parametrize("rank,joined", [(1, False), (4, True)])
def test_weights_are_multiplied_first_where_that_saves_token_side_work(rank: int, joined: bool) -> None:
    """The gradient's `U (Vᵀ tanh z)` and `V (Uᵀ z)` run as `(U Vᵀ) tanh z` and `(V Uᵀ) z` only where one d x d
    product per token costs no more than the thin chain (rank 4 of 8; rank 1 keeps both chains). Same values
    either way."""
    derived = energydsl.load(_LOW_RANK.format(r=rank)).energy()
    forward = energy_source(derived, "torch").split("def forward", 1)[1]
    assert forward.count("F.linear(") == (2 if joined else 4), forward
    assert ("torch.einsum('MN,NP->MP'" in forward) == joined  # the weights' own product
    _matches_interpreter(derived, 5, atol=1e-10)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_per_head_maps_after_the_attention_fold_into_one_gemm(backend: str) -> None:
    """CEM's per-head DPLR preconditioner times W_Qᵀ is one (d x d/heads) matrix per head, made from the
    weights: the attention's output goes through one GEMM over the heads, and no (batch, seq, heads, d)
    tensor is made (the chain made five). CEM's tied attention likewise: its value map W_Qᵀ leaves the sum
    over the context (the attention runs at the head width, keys and values one tensor) and joins the sum
    over the heads as one GEMM, where it was applied head by head and summed."""
    for path in ("examples/cem/dplr.energy", "examples/cem/tied-attention.energy"):
        forward = energy_source(energydsl.load(path).energy(), backend).split("def forward", 1)[1]
        assert "btkM" not in forward and forward.count("sum over k in one matmul") == 1, forward
    attention = re.search(r"attention\((t\d+), (t\d+), (t\d+),", forward)
    assert attention and attention.group(2) == attention.group(3), forward  # tied: k is v, laid out once


class _TokenScalings(_Products):
    """Also counts the multiplications of a token-sized tensor (`numel` elements) by a scalar."""

    def __init__(self, numel: int) -> None:
        self.numel = numel

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                counter.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
                scalar = any(not isinstance(a, torch.Tensor) or a.numel() == 1 for a in args)
                counter.scalings += (func in (torch.ops.aten.mul.Tensor, torch.ops.aten.mul.Scalar) and scalar
                                     and out.numel() == counter.numel)
                return out

        self.count, self.scalings, self.mode = 0, 0, Mode()
        self.mode.__enter__()
        return self


@pytest.mark.parametrize("path,name,products,scalings", [
    ("examples/intrinsic-optimizers/mha.energy", "MHA", 2, 0),  # η / heads = 0.5 scales Wo
    ("examples/cem/dplr.energy", None, 3, 0),  # the -1 of x - η D scales the head-merged map
    ("tests/data/element-wise-gates.energy", "NewtonSilu", 4, 2),  # -1.5 (W a) stays: W a is used again
    ("examples/hopfield/energy-transformer.energy", None, 4, 0),  # -α (Σ_k W_k a_k + Ξᵀ b): α scales both
])
def test_scalars_multiply_weights_not_tokens(path: str, name: str | None, products: int, scalings: int) -> None:
    """A scalar times a product of weights and a token vector, `s (M v)` or `s Σ_k M_k v_k`, scales M: no
    token-sized tensor is multiplied by it. Not where `M v` is used elsewhere (it would be computed twice: the
    matrix products stay as many). Values equal the interpreter's."""
    file = energydsl.load(path)
    derived = file.energy(name) if name else file.energy()
    module = _perturbed(module_class(derived, "torch")()).double()
    x = module.example_input(2, 6).double()
    with _TokenScalings(x.numel()) as counted:
        out = module(x)
    assert (counted.count, counted.scalings) == (products, scalings)
    ref = run_program(derived.program, instance_from_params(derived.program, _raw(module), x))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("path", ["examples/intrinsic-optimizers/momen-mha.energy",
                                  "examples/intrinsic-optimizers/nag-mha.energy"])
def test_the_fused_momentum_force_is_ordered_as_every_update_is(path: str) -> None:
    """The triton backend's fused momentum step emits its force apart from the update program; it gets the same
    weights-first form: the force it passes is the output projection's product itself, the -1 in its weights."""
    source = energy_source(energydsl.load(path).energy(), "triton")
    force = re.search(r"momentum_update\(\w+, \w+, (t\d+),", source)
    assert force, source
    assert re.search(rf"\b{force.group(1)} = F\.linear\(", source), source


def test_a_product_used_elsewhere_is_not_counted_as_saved() -> None:
    """Newton's step with a SiLU gate needs `Wᵀ a` on its own and inside `W (Wᵀ a)` (the Hessian-vector
    product): joining `W Wᵀ` would add a d x d product per token and save none, so the chain stays."""
    derived = energydsl.load("tests/data/element-wise-gates.energy").energy("NewtonSilu")
    forward = energy_source(derived, "torch").split("def forward", 1)[1]
    assert "torch.einsum('MN,NP->MP'" not in forward, forward


def test_a_scalar_scales_each_weight_of_a_sum_unless_a_term_is_used_elsewhere() -> None:
    """`s (M a + N b)` becomes `(s M) a + (s N) b`; with `M a` also used elsewhere (here inside an exp) it stays,
    as `M a` would otherwise be computed twice, scaled and not."""
    d = sp.Symbol("d")
    M, N = ir.Var("M", "param", (d, d)), ir.Var("N", "param", (d, d))
    a, b = ir.Var("a", "state", (d,)), ir.Var("b", "state", (d,))
    s = ir.Scalar(sp.Rational(-1, 8))
    scaled = ir.mul(s, ir.add(ir.matmul(M, a), ir.matmul(N, b)))
    want = ir.Add((ir.MatMul(ir.Mul((s, M)), a), ir.MatMul(ir.Mul((s, N)), b)))
    assert weights_first(scaled, lambda _: 8, frozenset()) == want
    shared = ir.add(scaled, ir.func("exp", ir.matmul(M, a)))
    assert weights_first(shared, lambda _: 8, frozenset()) == shared


def test_scalars_reaching_one_weight_twice_are_multiplied_out() -> None:
    """`s (t (M a) + N b)`: t goes into M first, then s into both weights; `t M` scaled again is one product
    `(s t) M`, not `s (t M)`: the Energy Transformer's weights were scaled by -1 and then by -α, two passes
    over each weight where one does."""
    d = sp.Symbol("d")
    M, N = ir.Var("M", "param", (d, d)), ir.Var("N", "param", (d, d))
    a, b = ir.Var("a", "state", (d,)), ir.Var("b", "state", (d,))
    s, t = ir.Scalar(sp.Rational(-1, 8)), ir.Scalar(sp.Integer(-1))
    e = ir.mul(s, ir.add(ir.mul(t, ir.matmul(M, a)), ir.matmul(N, b)))
    want = ir.Add((ir.MatMul(ir.Mul((ir.Scalar(sp.Rational(1, 8)), M)), a), ir.MatMul(ir.Mul((s, N)), b)))
    assert weights_first(e, lambda _: 8, frozenset()) == want
    forward = energy_source(energydsl.load("examples/hopfield/energy-transformer.energy").energy(), "torch")
    assert re.findall(r"= (-?[\d.]+) \* t\d+\n", forward.split("def forward", 1)[1]) == ["0.125", "0.125"]


def test_a_scalar_goes_into_a_sum_of_weights_whose_terms_carry_constants() -> None:
    """`s ((t M + t N) a)` is `((s t) M + (s t) N) a`, no scaling of the sum (`-1 (-A - B - C)` in CEM DPLR's
    preconditioner, four weight scalings before); with two terms bare, `s ((M + N) a)` keeps the one scaling."""
    d = sp.Symbol("d")
    M, N = ir.Var("M", "param", (d, d)), ir.Var("N", "param", (d, d))
    a = ir.Var("a", "state", (d,))
    s, t = ir.Scalar(sp.Symbol("eta")), ir.Scalar(sp.Integer(-1))
    e = ir.mul(s, ir.matmul(ir.add(ir.mul(t, M), ir.mul(t, N)), a))
    minus_eta = ir.Scalar(-sp.Symbol("eta"))
    want = ir.MatMul(ir.Add((ir.Mul((minus_eta, M)), ir.Mul((minus_eta, N)))), a)
    assert weights_first(e, lambda _: 8, frozenset()) == want
    bare = ir.mul(s, ir.matmul(ir.add(M, N), a))
    assert weights_first(bare, lambda _: 8, frozenset()) == ir.MatMul(ir.Mul((s, ir.add(M, N))), a)
    forward = energy_source(energydsl.load("examples/cem/dplr.energy").energy(), "torch").split("def forward", 1)[1]
    assert not re.search(r"= -?[\d.]+ \* t\d+", forward), forward


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("path,computed", [
    ("examples/intrinsic-optimizers/nag-mha.energy", ["-1.0 * opt_beta", "-1.0 * opt_eta"]),  # two steps
    ("examples/nrgpt/ff2w.energy", ["-1.0 * s_ff"]),  # one step, two uses
])
def test_a_scalar_computed_from_learned_ones_is_computed_once_before_the_steps(path: str, computed: list[str],
                                                                                backend: str) -> None:
    """`-1.0 * opt_eta` (the update's `x - η m` with a learned η) is one tensor op forward and one backward: it
    is a local computed once, before the optimizer's loop, not at every step and use."""
    forward = energy_source(energydsl.load(path).energy(), backend).split("def forward", 1)[1]
    loop = forward.split("for _step in range", 1)[1] if "for _step in range" in forward else ""
    for expr in computed:
        assert len(re.findall(re.escape(expr), forward)) == 1, forward
        name = re.search(rf"^ *(t\d+) = \({re.escape(expr)}\)$", forward, re.M).group(1)
        uses = len(re.findall(rf"\b{name}\b", forward)) - 1
        assert expr not in loop and uses >= (1 if loop else 2), forward  # in the loop, or twice in one step


@pytest.mark.parametrize("path,backend,difference", [
    # i - j (j's positions, masked ones at the last kept, are a value of their own), and 1 - |i - j|
    ("examples/cem/alibi.energy", "torch", r"= pos\[:, None\] - t\d+\n"),
    # the kernels take ALiBi's slopes m of -m |i - j|: the coefficient negated in the IR, not -(-1.0 * m)
    ("examples/cem/alibi.energy", "triton", r"(t\d+) = m\.reshape\(2\)\.contiguous\(\)\n.*alibi_slopes=\1,"),
    ("examples/intrinsic-optimizers/light-mha2nd1st.energy", "torch", r"= t\d+ - t\d+\n"),  # the covariance's mean
    ("examples/intrinsic-optimizers/light-mha2nd1st.energy", "triton", r"= t\d+ - t\d+\n"),
])
def test_a_negated_term_of_a_sum_is_subtracted(path: str, backend: str, difference: str) -> None:
    """`a + (-1) b` prints as `a - b` (SymPy's printers' way), not as a negation `-1.0 * b`, an element-wise op
    of its own forward and backward, then an addition. Values equal the interpreter's."""
    derived = energydsl.load(path).energy()
    forward = energy_source(derived, backend).split("def forward", 1)[1]
    assert re.search(difference, forward, re.S), forward
    negations = re.findall(r"^ *(t\d+) = -1\.0 \* \w+$", forward, re.M)
    only_added = [t for t in negations if len(re.findall(rf"\b{t}\b", forward)) == 2  # made, then used once:
                  and re.search(rf"= (\w+ \+ )+{t}\b|= {t} \+", forward)]  # in a sum
    assert not only_added, forward
    _matches_interpreter(derived, 6, atol=1e-10)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("path", ["examples/cem/dplr.energy", "examples/cem/mlp-dplr.energy"])
def test_a_vector_times_ones_in_a_product_is_a_broadcast(path: str, backend: str) -> None:
    """CEM DPLR's `diag(softplus(P_d)) W_Qᵀ` reaches the IR as `(c ⊗ 1) ∘ W_Qᵀ`: it is `c[..., None] * W`, where
    a tensor of ones and an outer product were made first (two launches of their own, forward and backward).
    Values and gradients equal the interpreter's."""
    derived = energydsl.load(path).energy()
    forward = energy_source(derived, backend).split("def forward", 1)[1]
    assert "torch.ones(" not in forward and "->kMN'" not in forward, forward
    assert re.search(r"= \w+\[(:, )+None\] \* t\d+\n", forward), forward  # per head, or not
    _matches_interpreter(derived, 6, backend)


WHOLE_VECTOR = """
energy Root(d = 4) {
  state z[d]
  global F = sqrt(z . z + 1)
}

energy Norm(d = 4) {
  state z[d]
  global F = 0.1 * norm(z)
}

energy NormedSoftplus(d = 4) {
  state x[d] via u = rmsnorm(x)
  global F = sum(softplus(u))
}

energy NormedHuber(d = 4) {
  state x[d] via u = rmsnorm(x)
  global F = huber(u, 1) . huber(u, 1)
}
"""


@pytest.mark.parametrize("name", ["Root", "Norm", "NormedSoftplus", "NormedHuber"])
def test_a_function_of_the_whole_vector_is_not_fused_as_one_of_each_entry(name: str) -> None:
    """The gated epilogue's G is a function of one entry: `sqrt(z·z + 1)` was fused as `sqrt(z_m² + 1)` and
    rmsnorm's Jacobian lost its cross term (wrong values on the triton backend, float64 too; found by
    differential fuzzing). Only factors element-wise in the pre-activation go into G now. Values and
    gradients equal the interpreter's."""
    _matches_interpreter(energydsl.load(WHOLE_VECTOR).energy(name), 9, "triton", atol=1e-10)


FOUND_BY_FUZZING = """
energy TiedUntie(d = 4, heads = 2) {
  dim dh = d / heads
  state   x[d]
  context h[j, d] where j <= i
  param   WQ[heads, dh, d] ~ normal(0, 0.02)
  param   WK[heads, dh, d] ~ normal(0, 0.02)
  global  E = -sum[k](logsumexp[j](WQ[k]^T @ (WK[k] @ h[j]) . x))
  untie   value WQ[k]^T -> Uo[k]
}

energy NewtonVia(d = 4) {
  state   x[d] via g = layernorm(x) + delta
  param   delta[d] ~ zeros()
  param   W[d, d] ~ normal(0, 0.02)
  global  E = -(g . (W @ sigmoid(W @ g)))
  optimizer newton(eta = 0.5, taylor = 1, damping = 1) wrt g
}

energy NegativeScale(d = 4) {
  state z[d]
  context h[j, d] where j <= i
  param W[d, d] ~ normal(0, 0.3)
  global F = -logsumexp[j](-0.5 * z . (W @ h[j]))
}

energy HoistedAttention(d = 4) {
  state   z[d]
  context h[j, d] where j <= i
  param   W[d, d] ~ normal(0, 0.5)
  param   wb[d] ~ normal(0, 0.5)
  global  F = -((W @ z) . sum[j](softmax[j](wb . h[j]) * h[j]))
  optimizer gd(eta = 1)
}
"""


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ["TiedUntie", "NewtonVia", "NegativeScale", "HoistedAttention"])
def test_specs_found_by_differential_fuzzing_compute_the_derived_update(name: str, backend: str) -> None:
    """TiedUntie: the value's narrowed key and the score's key, one tensor, were two lets, and naming the second
    renamed the first's line (NameError in forward). NewtonVia: the rewrite merged two terms of a scaled sum
    (ValueError in codegen). NegativeScale: torch's CPU SDPA gave NaN for a negative scale (torch backend).
    HoistedAttention: an attention with state-free scores, computed once before the steps, left the lowering's
    step cache (a dict) in the memo that naming the hoisted value rewrites (AttributeError in codegen; its
    checks passed, `energy compile` exited 70). Values and gradients equal the interpreter's."""
    _matches_interpreter(energydsl.load(FOUND_BY_FUZZING).energy(name), 7, backend, atol=1e-10)


def test_a_vector_times_ones_stays_an_outer_product_where_nothing_else_has_the_shape() -> None:
    """`c (v ⊗ 1)`: no other factor spans the last axis, so `v[..., None]` would be a column, not the matrix."""
    from energydsl.codegen.torch_expr import _broadcast_factors

    d = sp.Symbol("d")
    v, w = ir.Var("v", "param", (d,)), ir.Var("W", "param", (d, d))
    outer = ir.outer(v, ir.Ones((d,)))
    assert _broadcast_factors(ir.mul(outer, w)) == [v, w]
    assert _broadcast_factors(ir.mul(ir.Scalar(2), outer)) == [ir.Scalar(2), outer]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_step_that_cancels_the_state_computes_no_difference(backend: str) -> None:
    """The modern Hopfield step `x - η (x - attn)` at η = 1 is `attn` itself: the constant goes into the sum where
    a term then cancels (codegen only), so the forward is the attention and no subtraction, negation or
    addition; the displacement is `x_ - x`. Values and gradients equal the interpreter's; at η = 1/2 the
    form stays (distributing would trade one scaling for two)."""
    derived = energydsl.load("examples/hopfield/modern.energy").energy()
    forward = energy_source(derived, backend).split("def forward", 1)[1]
    assert re.search(r"\n +x_ = t\d+\n +return x_ - x if delta else x_", forward), forward
    assert not re.search(r"-1\.0 \*|x_ [+-] t\d+", forward), forward
    module, x, _ = _matches_interpreter(derived, 6, atol=1e-10)  # the displacement too
    assert torch.autograd.gradcheck(lambda x: module(x), (x.requires_grad_(),))
    half = energydsl.load("examples/hopfield/modern.energy").energy(eta=0.5)
    assert re.search(r"x_ [+-] t\d+", energy_source(half, backend).split("def forward", 1)[1])


@pytest.mark.parametrize("lines,want", [
    (["t1 = F.linear(h, W)", "t2 = t1 + b[None, None]", "t3 = F.gelu(t2)"],
     ["t2 = F.linear(h, W, b)", "t3 = F.gelu(t2)"]),
    (["t1 = F.linear(h, W)", "t2 = b[None, None] + t1  # either order"], ["t2 = F.linear(h, W, b)"]),
    # the product read again: it must exist on its own
    (["t1 = F.linear(h, W)", "t2 = t1 + b[None, None]", "t3 = t1 * t2"], None),
    (["t1 = F.linear(h, W)", "t2 = t1 + c[None, None]"], None),  # c is not a 1-d parameter
    (["t1 = F.linear(h, W).unflatten(-1, (2, -1))", "t2 = t1 + b[None, None]"], None),  # not the plain product
    (["t1 = F.linear(h, W)", "t2 = t1 + b"], None),  # not the vector broadcast over batch and sequence
])
def test_a_bias_added_to_a_product_goes_into_the_gemm(lines: list[str], want: list[str] | None) -> None:
    """`F.linear(v, W) + b` is `F.linear(v, W, b)`: one addmm, where the addition was an element-wise pass over
    the product forward. Only where the product is read nowhere else and b is a 1-d parameter."""
    from energydsl.codegen.projections import fuse_biases

    assert fuse_biases(lines, {"b"}) == (lines if want is None else want)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("path,fused,added", [
    ("examples/nrgpt/ff1.energy", r"F\.linear\(g, W, b\)", None),  # z = W g + b (g: the `via` name)
    # z = W1 g + b1 shares one GEMM with the gradient's W2ᵀ g, so b1 stays an addition; W2 gelu(z) + b2 fuses
    ("examples/nrgpt/ff2w.energy", r"F\.linear\(t\d+, W2, b2\)", r"= t\d+ \+ b1\[None, None\]"),
])
def test_nrgpt_feed_forward_adds_a_bias_in_the_gemm(path: str, fused: str, added: str | None, backend: str) -> None:
    """NRGPT's feed-forward layers: a bias added to a product alone is F.linear's own; one added to a merged
    projection stays an addition. Values and gradients equal the interpreter's."""
    derived = energydsl.load(path).energy()
    forward = energy_source(derived, backend).split("def forward", 1)[1]
    assert re.search(fused, forward), forward
    assert len(re.findall(r"\+ b\w*\[None, None\]", forward)) == (added is not None), forward
    assert added is None or re.search(added, forward), forward
    _matches_interpreter(derived, 5, backend="torch")


SINGULAR_PAST_THE_MASK = {  # a position weight finite on every kept pair, infinite or NaN on some masked one
    "Harmonic": ("j < i", "-z . sum[j]((i - j)^(-1) * c[j])"),
    "HarmonicCausal": ("j <= i", "-z . sum[j]((1 + i - j)^(-1) * c[j])"),
    "LogDistance": ("j < i", "-sum[j](log(i - j) * (z . c[j]))"),
    "SqrtDistance": ("j <= i", "-sum[j](sqrt(i - j) * (z . c[j]))"),
    "SoftmaxOfLogDistance": ("j < i", "-logsumexp[j]((z . c[j]) - log(i - j))"),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", sorted(SINGULAR_PAST_THE_MASK))
def test_a_position_weight_singular_only_past_the_mask_gives_finite_updates_and_gradients(name, backend) -> None:
    """Masked pairs are dropped, but their values were computed: 1/(i - j) at j = i made the interpreter's
    masked sum inf * 0 = NaN and the module's gradient 0 * inf = NaN, so `check` failed a sound spec (found by
    generating energies). A context position past the mask now reads as the last kept one."""
    mask, energy = SINGULAR_PAST_THE_MASK[name]
    spec = energydsl.load(f"energy {name}(d = 2) {{\n  state z[d]\n  context c[j, d] where {mask}\n"
                          f"  global F = {energy} + 0.5 * (z . z)\n}}\n")
    derived = spec.energy(name)
    if backend == "torch":
        failed = [r for r in derived.check() if not r.ok]
        assert not failed, failed
    _, x, ref = _matches_interpreter(derived, backend=backend)
    assert torch.isfinite(ref).all()


def test_second_derivatives_through_attention_run_on_sdpas_math_form() -> None:
    """What docs/models.md says to do for a Hessian-vector product or a jvp through a softmax layer (SDPA's fused
    kernels have neither): under the math backend both run, and the double backward is right (gradgradcheck)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    layer = energydsl.load("examples/intrinsic-optimizers/mha.energy").module(d=8, heads=2).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with sdpa_kernel(SDPBackend.MATH):
        assert torch.autograd.gradgradcheck(lambda t: layer(t), (x,))
        _, tangent = torch.func.jvp(layer, (x.detach(),), (torch.ones_like(x),))
    with torch.no_grad():  # the tangent against central differences along the same direction
        eps, v = 1e-6, torch.ones_like(x)
        differences = (layer(x + eps * v) - layer(x - eps * v)) / (2 * eps)
    torch.testing.assert_close(tangent, differences, rtol=1e-6, atol=1e-8)



@pytest.mark.parametrize(("path", "call"), [
    ("examples/intrinsic-optimizers/softmax-attention-l2.energy", "key_bias="),
    ("examples/nrgpt/attention.energy", "strict=True"),
])
def test_torch_attention_builds_no_t_by_t_tensor_for_a_key_bias_or_a_strict_context(path: str, call: str) -> None:
    """The l2 energy's per-key bias and NRGPT's strict context keep SDPA's fused causal path: no (B, H, T, T)
    bias or mask is built (the bias was, with a gradient of that size); values: the example's row above."""
    spec = energydsl.load(path)
    derived = spec.energy(spec.energy_names[0])
    forward = energy_source(derived).split("def forward", 1)[1]
    (attention,) = re.findall(r"softmax_attention\(.*", forward)
    assert call in attention and " bias=" not in attention and "T, T)" not in forward, forward
    module = module_class(derived)()
    x = module.example_input(2, 64).requires_grad_()
    largest = largest_tensor_made(lambda: module(x).square().sum().backward())
    assert largest < 2 * 64 * 64, largest  # B x T x T would be the mask's or the bias's size



def test_a_bias_without_the_batch_is_built_once_not_per_sequence() -> None:
    """CEM's ALiBi and self-token bias depend on the head and the positions only: the torch op's additive mask
    is (1, H, T, T), broadcast by SDPA, not a (B, H, T, T) copy (values: the example's row above)."""
    source = energy_source(energydsl.load("examples/cem/alibi.energy").energy("CEMAlibiAttention"))
    assert ".reshape(1, 2, T, T)  # additive score bias" in source
    model = energy_source(energydsl.load("examples/models/cem.energy").energy("CEMAttention"))
    assert ".reshape(1, 2, T, T)  # additive score bias" in model


@pytest.mark.parametrize(("bias", "lead"), [
    ("-m[k] * abs(i - j)", "1"),  # heads and positions only: one (1, H, T, T) mask
    ("-m[k] * abs(i - j) + 0.5 * (h[j] . h[j])", "B"),  # a per-key term of each sequence: (B, H, T, T)
])
def test_the_torch_bias_mask_has_the_batch_only_when_a_term_does(bias: str, lead: str) -> None:
    derived = energydsl.load(f"""
        energy Biased(d = 8, heads = 2) {{
          dim     dh = d / heads
          state   x[d]
          context h[j, d] where j <= i
          param   WQ[heads, dh, d] ~ normal(0, 0.3)
          param   WK[heads, dh, d] ~ normal(0, 0.3)
          param   m[heads] ~ normal(1, 0.1)
          local   s[k, j] = (WQ[k] @ x) . (WK[k] @ h[j]) + {bias}
          global  E = -sum[k](logsumexp[j](s[k, j]))
          optimizer gd(eta = 1)
        }}""").energy()
    assert f".reshape({lead}, 2, T, T)  # additive score bias" in energy_source(derived)
    _matches_interpreter(derived)


_SCORE_BIASES = {"none": "", "key": " - 0.5 * (WK[k] @ h[j]) . (WK[k] @ h[j])", "alibi": " - m[k] * abs(i - j)",
                 "alibi and key": " - m[k] * abs(i - j) + 0.3 * (h[j] . h[j])",
                 "self": " + m[k] * relu(1 - abs(i - j))"}


@pytest.mark.parametrize(("relation", "bias"), [(r, b) for r in ("<=", "<") for b in _SCORE_BIASES
                                                if (r, b) != ("<", "self")])  # 0 on j < i: dropped, m unused
def test_every_score_bias_form_of_the_torch_attention_matches_the_interpreter(relation: str, bias: str) -> None:
    """The torch op's paths (SDPA's causal flag; a per-key bias as a feature; a strict context shifted by a
    token; a (1, H, T, T) or (B, H, T, T) mask), under a negative score and a learned temperature per head too:
    the layer against the interpreter, T = 7 and T = 1 (a strict context's only row is empty)."""
    for sign, temperature in (("", "sqrt(dh)"), ("-", "tq[k]")):
        derived = energydsl.load(f"""
            energy S(d = 4, heads = 2) {{
              dim     dh = d / heads
              state   x[d]
              context h[j, d] where j {relation} i
              param   WQ[heads, dh, d] ~ normal(0, 0.5)
              param   WK[heads, dh, d] ~ normal(0, 0.5)
              param   m[heads] ~ normal(1, 0.1)
              param   tq[heads] ~ normal(2, 0.1)
              local   s[k, j] = {sign}(WQ[k] @ x) . (WK[k] @ h[j]) / {temperature}{_SCORE_BIASES[bias]}
              global  E = -sum[k](logsumexp[j](s[k, j]))
              optimizer gd(eta = 1)
            }}""").energy()
        assert "softmax_attention(" in energy_source(derived)
        for T in (7, 1):
            _matches_interpreter(derived, T)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_generated_files_are_lint_clean(tmp_path, backend: str) -> None:
    """Every example compiled as `energy compile` writes it passes the project's own ruff rules but line length
    (the equations in the docstring are as long as they are): imports sorted, each once (two energies in a file
    imported `projections` twice), no unused `F`, no unused loop variable."""
    import subprocess
    import sys

    for path in sorted(glob.glob("examples/*/*.energy")):
        spec = energydsl.load(path)
        derived = [spec.energy(name) for name in spec.energy_names]
        (tmp_path / f"{path.replace('/', '_')[:-7]}.py").write_text(energy_source(derived, backend))
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config", "pyproject.toml",
                           "--ignore", "E501", "--output-format", "concise", str(tmp_path)],
                          capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout[-3000:]


def test_a_scalar_preconditioner_is_softplus_in_the_generated_code() -> None:
    """softplus(P_s) folds into SymPy as log(1 + exp(P_s)), which the generated code computed as written: inf in
    float32 from P_s = 89 on. It is `F.softplus` now, finite and equal to P_s there."""
    spec = """energy MatScalar(d = 4) {
  state z[d]
  param W[d, d] ~ normal(0, 0.3)
  global F = 0.5 * (z . z) - sum(exp(W @ z))
  optimizer gd(eta = 0.5) precondition scalar
}"""
    derived = energydsl.load(spec).energy()
    assert "F.softplus(torch.as_tensor(P_s))" in energy_source(derived)
    layer = derived.module()
    with torch.no_grad():
        layer.P_s.fill_(100.0)
    x = torch.randn(1, 3, 4, generator=torch.Generator().manual_seed(0))
    W = layer.W.detach()
    gradient = x - torch.exp(x @ W.T) @ W
    torch.testing.assert_close(layer(x), x - 0.5 * 100.0 * gradient, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dot, summed", [
    ("z . (W @ h[j])", "sum(z * (W @ h[j]))"),
    ("2 * (z . (W @ h[j]))", "sum(2 * z * (W @ h[j]))"),
])
def test_sum_of_a_product_is_a_dot_product(dot: str, summed: str) -> None:
    """`sum(a * b)` (language.md's own spelling of Σ_k a_k b_k) derived as SumAll(a ⊙ b), which no lowering
    recognised: a context sum over it became (B, T, T) weights, where `a . b` is attention."""
    spec = """energy S(d = 8) {{
  state z[d]
  context h[j, d] where j <= i
  param W[d, d] ~ normal(0, 0.1)
  global F = -logsumexp[j]({score})
  optimizer gd(eta = 1)
}}"""
    by_dot, by_sum = (energydsl.load(spec.format(score=s)).energy() for s in (dot, summed))
    assert by_sum.equation_hash() == by_dot.equation_hash()
    assert "softmax_attention(" in energy_source(by_sum) and "masked_softmax" not in energy_source(by_sum)


def test_sum_of_a_product_of_matrices_lowers_as_their_dot_product() -> None:
    spec = """energy M(dk = 4, dv = 3) {{
  state Z[dk, dv]
  context H[j, dk, dv] where j <= i
  param A[dk, dk] ~ normal(0, 0.1)
  global F = -logsumexp[j]({score})
  optimizer gd(eta = 1)
}}"""
    by_dot, by_sum = (energydsl.load(spec.format(score=s)).energy() for s in ("Z . (A @ H[j])", "sum(Z * (A @ H[j]))"))
    assert by_sum.equation_hash() == by_dot.equation_hash()
    assert "masked_softmax" not in energy_source(by_sum)


@pytest.mark.parametrize("name, spec", [
    ("heads", """energy PoE(d = 4, experts = 3) {
  state z[d]
  param W[experts, d] ~ normal(0, 1)
  global F = 0.5 * (z . z) - prod[k](relu(W[k] . z))
  optimizer gd(eta = 0.5)
}"""),
    ("context", """energy CtxProd(d = 4) {
  state z[d]
  context h[j, d] where j < i
  param W[d, d] ~ normal(0, 1)
  global F = 0.5 * (z . z) - prod[j](sigmoid(z . (W @ h[j])))
  optimizer gd(eta = 0.5)
}"""),
])
def test_the_gradient_of_a_product_is_finite_where_a_factor_is_zero(name: str, spec: str) -> None:
    """∇ prod[k](b_k) was ∏ b · Σ_k b_k' / b_k: NaN where a relu is 0 or a sigmoid underflows, where autograd's is
    finite. It is Σ_k (∏_{m≠k} b_m) b_k' now, in the reference interpreter and in the generated module."""
    derived = energydsl.load(spec).energy()
    layer = derived.module().double()
    x = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        if name == "heads":  # expert 0 along one token, experts 1 and 2 along another: some factors are 0
            layer.W[0], layer.W[1:] = x[0, 1], x[0, 0]
        else:  # the first token, large: its sigmoid factor is 0 or 1 for every later token, the others are not
            layer.W.copy_(torch.eye(4, dtype=torch.float64))
            x[:, 0] *= 1000.0
    W = layer.W.detach()

    def factors(z: torch.Tensor) -> torch.Tensor:
        if name == "heads":
            return torch.relu(z @ W.T)
        s = torch.sigmoid(torch.einsum("btd,bjd->btj", z, x @ W.T))
        return torch.where(torch.ones(6, 6, dtype=torch.bool).tril(-1), s, torch.ones_like(s))

    z = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad((0.5 * (z * z).sum(-1) - factors(z).prod(-1)).sum(), z)
    assert bool((factors(x) == 0).any()) and float((grad - x).abs().max()) > 0.01  # zeros met; a live product too
    expected = x - 0.5 * grad
    torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)
    inst = instance_from_params(derived.program, dict(layer.named_parameters()), x)
    torch.testing.assert_close(run_program(derived.program, inst), expected, rtol=1e-12, atol=1e-12)


def test_an_l2_score_on_a_normed_state_runs_as_attention() -> None:
    """Under `u = rmsnorm(x)` the derivation writes the l2 score's coupling r(x_i) (x_i . k_j), a factor of the
    query token times a dot. It stayed (B, T, T) weights; the factor now moves into the query, which is u."""
    spec = """energy L2Norm(d = 8) {
  state x[d] via u = rmsnorm(x)
  context h[j, d] where j <= i
  param Wk[d, d] ~ normal(0, 0.1)
  global F = -logsumexp[j](-0.5 * ((u - Wk @ h[j]) . (u - Wk @ h[j])))
  optimizer gd(eta = 1) wrt u
}"""
    derived = energydsl.load(spec).energy()
    source = energy_source(derived)
    assert "softmax_attention(" in source and "masked_softmax" not in source
    layer = derived.module().double()
    x = torch.randn(2, 7, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64, requires_grad=True)
    got = layer(x)
    inst = instance_from_params(derived.program, dict(layer.named_parameters()), x)
    want = run_program(derived.program, inst)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g_got = torch.autograd.grad(got.square().sum(), [x, layer.Wk])
    g_want = torch.autograd.grad(want.square().sum(), [x, layer.Wk])
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_sin_and_cos_derive_check_and_compile() -> None:
    """A rotary-style relative score `cos(theta * (i - j))` with a learned frequency, and sin of a score, under
    Newton (second derivatives of sin and cos): every check passes and the module matches the interpreter."""
    spec = """energy Rot(d = 4) {
  state z[d]
  context h[j, d] where j <= i
  param W[d, d] ~ normal(0, 0.3)
  param theta = 0.3 learn
  global F = 0.5 * (z . z) - logsumexp[j](cos(theta * (i - j)) * (z . (W @ h[j])) + sin(z . h[j]))
  optimizer newton(taylor = 2, damping = 0.5)
}"""
    derived = energydsl.load(spec).energy()
    results = derived.check()
    assert all(r.ok for r in results) and {r.name for r in results} >= {"gradient", "sympy", "hessian", "update"}
    _matches_interpreter(derived)


_DELTA_RULE = """energy Delta(d = 8, dk = 4, dv = 3) {
  state Z[dk, dv]
  context h[j, d] where j <= i
  param Wk[dk, d] ~ normal(0, 0.3)
  param Wv[dv, d] ~ normal(0, 0.3)
  let r[j] = Z^T @ (Wk @ h[j]) - Wv @ h[j]
  global F = 0.5 * sum[j](r[j] . r[j])
  optimizer gd(eta = 0.1)
}"""


_DELTANET = {  # DeltaNet's write strength β_j, a weight of the key alone; a mean over j
    "plain": {},
    "beta": {"  global F = 0.5 * sum[j](r[j] . r[j])": "  param wb[d] ~ normal(0, 0.3)\n"
             "  global F = 0.5 * sum[j](sigmoid(wb . h[j]) * r[j] . r[j])"},
    "mean": {"sum[j]": "mean[j]"},
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("relation", ["j <= i", "j < i"])
@pytest.mark.parametrize("variant", sorted(_DELTANET))
def test_the_delta_rule_runs_on_prefix_sums(backend: str, relation: str, variant: str) -> None:
    """Σ_j (Zᵀ k_j − v_j) k_jᵀ, the delta rule's gradient, was a (B, T, T, dv, dk) tensor of pair products. It is
    Zᵀ (Σ_j k_j k_jᵀ) − Σ_j v_j k_jᵀ now: two prefix sums along j and a matrix product per token. With a weight
    β_j on each key, or a mean, it was the pair products again (found by a user trying DeltaNet)."""
    spec = _DELTA_RULE.replace("j <= i", relation)
    for old, new in _DELTANET[variant].items():
        spec = spec.replace(old, new)
    derived = energydsl.load(spec).energy()
    source = energy_source(derived, backend)
    assert source.count("prefix_reduce(") == 2 and "masked_reduce" not in source
    assert source.count(f"over {relation} as a prefix") == 2  # the comment said `j <= i` of a strict sum too
    for T in (7, 1):
        _matches_interpreter(derived, T, backend, context=(8,))
    module = module_class(derived, backend)()
    x, h = module.example_input(2, 64).requires_grad_(), torch.randn(2, 64, 8)
    largest = largest_tensor_made(lambda: module(x, context=h).square().sum().backward())
    assert largest <= 2 * 64 * 8 * 8, largest  # (B, T, dk, dk) and the context's own: no T x T


def test_compile_says_which_torch_modules_hold_t_by_t_tensors() -> None:
    """Only `--backend triton` said so: a user found a DeltaNet layer's (B, T, T, dk, dv) tensors by measuring."""
    notes: list[str] = []
    mha = energydsl.load("examples/intrinsic-optimizers/mha.energy").energy()
    second = energydsl.load("examples/intrinsic-optimizers/mha2nd1st.energy").energy()
    energy_source([mha, second], "torch", notes)
    assert notes == ["MHA2nd1st computes a context sum with T x T tensors (masked_softmax): its memory grows as T² "
                     "(docs/models.md, the lowering table)"], notes


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_generated_numbers_are_rounded_once(backend):
    """sqrt(heads)/sqrt(d) at d=8, heads=2 is 0.5: the dims go in exactly and the result is rounded once
    (float arithmetic gave `scale=0.5000000000000001`)."""
    text = energy_source(energydsl.load("examples/intrinsic-optimizers/mha.energy").derive(), backend, [])
    scales = set(re.findall(r"scale=([-0-9.e]+)", text))
    assert scales == {"0.5"}, scales


def test_the_generic_form_is_a_public_module_class_with_the_same_parameters():
    """`module_class(derived, lowering=False)`: the unlowered form docs/models.md points users to (it named a
    function that did not exist), cached apart from the lowered class, taking its state dict."""
    derived = energydsl.load("examples/intrinsic-optimizers/mha.energy").energy()
    lowered, generic = module_class(derived)(), module_class(derived, lowering=False)()
    assert type(lowered) is not type(generic)
    assert "softmax_attention(" in energy_source(derived) and "softmax_attention(" not in energy_source(
        derived, lowering=False)
    generic.load_state_dict(lowered.state_dict())
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    torch.testing.assert_close(generic.double()(x), lowered.double()(x))
    with pytest.raises(energydsl.UserError, match="the generic form"):
        energy_source(derived, "triton", lowering=False)


def test_a_pickled_module_loads_in_a_fresh_process_with_an_empty_cache(tmp_path):
    """torch.save of a whole generated module (or a language model of them) failed to load in a new process:
    "No module named 'energydsl_generated_...'". It now travels with its generated file's text."""
    import subprocess
    import sys

    torch.manual_seed(0)
    layer = energydsl.load("examples/intrinsic-optimizers/mha.energy").module()
    model = energydsl.load("examples/models/gpt.energy").model(d=16, heads=2, layers=1)
    x, idx = torch.randn(2, 5, 8), torch.randint(0, 65, (1, 6))
    torch.save({"layer": layer, "model": model, "x": x, "y": layer(x), "idx": idx, "logits": model(idx)},
               tmp_path / "whole.pt")
    check = ("import torch; d = torch.load('whole.pt', weights_only=False); "
             "assert torch.equal(d['layer'](d['x']), d['y']) and torch.equal(d['model'](d['idx']), d['logits']); "
             "print(type(d['layer']).__name__)")
    env = {**os.environ, "ENERGYDSL_CACHE": str(tmp_path / "empty-cache")}
    r = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "MHA", r.stderr
    written = sorted(p.name.split("_")[0] for p in (tmp_path / "empty-cache").glob("*.py"))
    assert written == ["mha", "mha", "mlp"]  # the layer's, and the model's two stages at its dims


def test_a_generated_module_prints_its_dims_and_backend():
    """print(module) said `MHA()`: two layers of other sizes looked the same."""
    spec = energydsl.load("examples/models/gpt.energy")
    assert repr(spec.module("MHA", d=16, heads=2)) == "MHA(d=16, heads=2, backend=torch)"
    assert "(1): MLP(d=16, hidden=64, backend=torch)" in repr(spec.model(d=16, heads=2, layers=1))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_term_whose_coefficient_is_zero_at_the_fixed_values_is_not_computed(backend):
    """Newton's two-term series carries (1 - 2 eta)-like coefficients that SymPy keeps; at the fixed value they
    are 0, and the code multiplied by 0.0 at every step (`t17 = 0.0 * t16`). The module still equals the
    reference interpreter (the repository-wide sweep runs this energy too)."""
    derived = energydsl.load("tests/data/data-dependent-decay.energy").energy("NewtonGate")
    text = energy_source(derived, backend)
    assert not re.search(r"\b-?0\.0 \*|\* -?0\.0\b", text), text


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_generated_code_calls_values_by_the_specs_names(backend: str) -> None:
    """`let gamma = W @ h` and `via u = rmsnorm(x)` were printed as `c0` and `t2`: the forward now uses the
    spec's names, where a value is printed once and its name is free."""
    derived = energydsl.load("examples/cem/mlp.energy").energy()
    forward = energy_source(derived, backend).split("def forward", 1)[1]
    assert re.search(r"^\s+gamma = F\.linear\(h, W\)$", forward, re.M), forward
    assert re.search(r"^\s+u = F\.rms_norm\(x_, ", forward, re.M), forward
    assert not re.search(r"\bc0\b", forward), forward
    _matches_interpreter(derived, 5, backend=backend)
    # a parameter called like a temporary: its attribute `self.t1` is not the temporary t1
    clash = energydsl.load("""
energy E(d = 4) {
  state   x[d] via u = rmsnorm(x)
  param   t1[d, d] ~ normal(0, 0.5)
  global  G = -sum(tanh(t1 @ u))
  optimizer gd(eta = 1)
}
""").energy("E")
    assert "t1_ = self.t1" in energy_source(clash, backend)
    _matches_interpreter(clash, 5, backend=backend)


@pytest.mark.parametrize("name", ["T", "F", "torch", "x_", "delta", "context", "check_inputs"])
def test_a_specs_name_the_forward_gives_a_meaning_stays_a_temporary(name: str) -> None:
    """A `let` called as the forward's own locals or the file's imports would shadow or rebind them: its value
    keeps its temporary's name, and the module still computes the update."""
    param = "W"
    text = f"""
energy E(d = 4) {{
  state   x[d]
  param   {param}[d, d] ~ normal(0, 0.5)
  let     {name} = tanh({param} @ x)
  global  G = ({name} . {name}) / 2
  optimizer gd(eta = 1)
}}
"""
    derived = energydsl.load(text).energy("E")
    forward = energy_source(derived, "torch").split("def forward", 1)[1]
    assert not re.search(rf"^\s+{re.escape(name)} = tanh|^\s+{re.escape(name)} = torch\.tanh", forward, re.M), forward
    _matches_interpreter(derived, 5)


def test_delta_is_the_displacement_itself_when_the_step_has_several_terms() -> None:
    """The Energy Transformer's update x + (attention term) + (Hopfield term): `delta=True` returned (x + Δ) − x,
    which rounds Δ away in float32 as |x| grows (a relative error of 8e-3 at inputs of 100, 0.57 at 1e4); it now
    returns Δ as summed, as a one-term step always did."""
    spec = energydsl.load("examples/hopfield/energy-transformer.energy")
    torch.manual_seed(0)
    exact = spec.module("EnergyTransformer").double()
    single = spec.module("EnergyTransformer").float()
    single.load_state_dict(exact.state_dict())
    x = torch.randn(2, 17, 8, dtype=torch.float64) * 1e3
    want = exact(x, delta=True)
    got = single(x.float(), delta=True).double()
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    torch.testing.assert_close(single(x.float()), exact(x).float())  # and the update itself, as before


@pytest.mark.parametrize("name,cls", [("F", "F_"), ("f", "F_"), ("none", "None_"), ("true", "True_"), ("B", "B")])
def test_a_class_name_never_shadows_the_files_functional_nor_is_a_keyword(name: str, cls: str) -> None:
    """An energy `F` (or `f`) was `class F`, which replaced `torch.nn.functional as F` in the generated file
    (AttributeError: type object 'F' has no attribute 'linear'); `none` was `class None`, a SyntaxError."""
    text = (f"energy {name}(d = 4) {{\n  state z[d]\n  context h[j, d] where j <= i\n"
            "  param W[d, d] ~ normal(0, 0.3)\n  global F = -logsumexp[j](z . (W @ h[j])) + 0.5 * z . z\n}\n")
    layer = energydsl.load(text).module(name)
    assert type(layer).__name__ == cls and "F.linear" in energy_source(energydsl.load(text).energy(name))
    assert layer(layer.example_input(1, 5)).shape == (1, 5, 4)


_FUZZED = {  # specs a fuzzer found, each one `energy check` accepts
    # a scalar context sum lowered with value 1 came back one per token *and* entry: (B, T, T, d) out, or a crash
    "scalar sum in a function": "global F = -exp(0.3 * sum[j](z . h[j]))",
    "scalar decayed sum": "global F = -exp(0.3 * sum[j](0.9^(i - j) * (z . h[j])))",
    "scalar sum times a state term": "global F = -(z . z) * exp(0.1 * sum[j](z . h[j]))",
    # a factor of the key's position j: the value was per pair (i, j), and lowering raised an AssertionError
    "key position factor": "global F = -0.5 * sum[j](j * (z . h[j])^2)",
    "key position decay": "global F = -sum[j](0.9^(i - j) * (j + 1) * (z . h[j]))",
    # a scalar function of a number was computed in float32 (torch.as_tensor(0.3)) in a float64 module
    "function of a number": "global F = exp(stopgrad(0.3)) * 0.5 * (z . z)",
}


@pytest.mark.parametrize("body", list(_FUZZED.values()), ids=list(_FUZZED))
def test_fuzzed_specs_match_the_interpreter(body: str) -> None:
    text = (f"energy E(d = 4) {{\n  state z[d]\n  context h[j, d] where j <= i\n  {body}\n"
            "  optimizer gd(eta = 0.5)\n}\n")
    derived = energydsl.load(text).energy("E")
    assert all(r.ok for r in derived.check())
    for T in (1, 2, 5):
        _matches_interpreter(derived, T=T)


def test_a_step_that_simplifies_to_zero_returns_its_displacement() -> None:
    """(1 - λ) u with λ = 1 is 0: the generated forward returned `t1` with delta=True before assigning it."""
    text = ("energy E(d = 4) {\n  state z[d] via u = rmsnorm(z)\n  global F = 0.5 * (u . u)\n"
            "  optimizer newton(eta = 0.5, taylor = 1, damping = 1) wrt u\n}\n")
    module, x, ref = _matches_interpreter(energydsl.load(text).energy("E"), T=3)
    assert torch.equal(module(x, delta=True), torch.zeros_like(x))

"""Models: sizes against the papers' tables, equivalences with hand-written layers, and the model CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import energydsl
from benchmarks.reference_gpt import GPT
from energydsl.kernels.linear_ref import linear_attention_recurrent_ref

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = json.loads((ROOT / "tests/data/paper_configs.json").read_text())
ENERGY = [sys.executable, "-m", "energydsl.cli"]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ENERGYDSL_CACHE", str(tmp_path_factory.getbasetemp() / "codegen"))


def _info(path: str, dims: dict) -> dict:
    with torch.device("meta"):  # sizes without allocating 160M parameters
        return energydsl.load(path).model(**dims).info()


# ----------------------------------------------------------------------------- sizes (paper tables)

LLAMA = [c for c in CONFIGS if c["model"] == "llama"]


@pytest.mark.parametrize("cfg", LLAMA, ids=[c["label"] for c in LLAMA])
def test_llama_sizes_match_cem_table_1(cfg: dict) -> None:
    dims = {k: cfg["dims"][k] for k in ("vocab", "context", "d", "layers", "heads", "mlp")}
    info = _info("examples/models/llama.energy", dims)
    assert info["params"] == cfg["exact"]["params"]
    assert info["params_non_embedding"] == cfg["exact"]["params_non_embedding"]
    assert info["flops_per_token"] == cfg["exact"]["flops_per_token"]
    assert math.floor(info["params"] / 1e6) == int(cfg["label"].rstrip("M"))  # the paper truncates


def test_gpt_size_matches_nanogpt_shakespeare_char() -> None:
    cfg = next(c for c in CONFIGS if c["source"].startswith("nanoGPT"))
    dims = {k: cfg["dims"][k] for k in ("vocab", "context", "d", "layers", "heads")}
    info = _info("examples/models/gpt.energy", dims)
    wpe = dims["context"] * dims["d"]
    assert info["params"] - wpe == cfg["exact"]["params"] == 10_646_784  # nanoGPT prints "10.65M"
    assert info["params_non_embedding"] == cfg["exact"]["params_non_embedding"]
    assert info["flops_per_token"] == cfg["exact"]["flops_per_token"]


def test_info_cli_reports_the_86m_llama() -> None:
    r = subprocess.run(ENERGY + ["info", "examples/models/llama.energy", "--set", "vocab=32000", "--set", "d=672",
                                 "--set", "layers=8", "--set", "heads=8", "--set", "mlp=1792", "--set",
                                 "context=2048", "--json"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["params"] == 86_371_488


# ----------------------------------------------------------------------------- equivalences


def _perturbed(m: torch.nn.Module) -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    m = m.double()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m


def test_generated_gpt_equals_hand_written_nanogpt() -> None:
    dims = dict(vocab=11, context=16, d=12, layers=2, heads=3)
    gen = _perturbed(energydsl.load("examples/models/gpt.energy").model(**dims))
    ref = GPT(11, 16, 12, 2, 3).double()
    d = 12
    with torch.no_grad():
        ref.wte.weight.copy_(gen.wte.weight)
        ref.wpe.weight.copy_(gen.wpe.weight)
        ref.ln_f.weight.copy_(gen.final_norm.weight)
        for block, stages, norms in zip(ref.blocks, gen.layers, gen.norms):
            mha, mlp = stages
            block.ln_1.weight.copy_(norms[0].weight)
            block.ln_2.weight.copy_(norms[1].weight)
            block.attn.c_attn.weight.copy_(torch.cat([mha.W1.reshape(d, d), mha.W2.reshape(d, d),
                                                      mha.Wv.reshape(d, d)]))
            block.attn.c_proj.weight.copy_(mha.Wo.movedim(0, 1).reshape(d, d))
            block.mlp.c_fc.weight.copy_(mlp.W1)
            block.mlp.c_proj.weight.copy_(mlp.W2)
    idx = torch.randint(0, 11, (3, 16))
    torch.testing.assert_close(gen(idx), ref(idx), rtol=1e-10, atol=1e-10)


def test_untied_mha_equals_standard_causal_multi_head_attention() -> None:
    m = _perturbed(energydsl.load("examples/intrinsic-optimizers/mha.energy").module())  # eta = 0.5
    x = m.example_input(2, 9).double()
    q = torch.einsum("kmd,btd->bktm", m.W1, x)
    k = torch.einsum("kmd,btd->bktm", m.W2, x)
    v = torch.einsum("kmd,btd->bktm", m.Wv, x)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = x + 0.5 * torch.einsum("kdm,bktm->btd", m.Wo, o)  # untie strips eta/H; eta stays a factor
    torch.testing.assert_close(m(x), ref)


@pytest.mark.parametrize("path", ["examples/intrinsic-optimizers/linear-attention.energy",
                                  "examples/intrinsic-optimizers/gated-linear-attention.energy"])
def test_linear_attention_equals_its_recurrence(path: str) -> None:
    m = _perturbed(energydsl.load(path).module())
    x = m.example_input(2, 11).double()
    key = x @ m.W.T
    temp = m.T
    decay = None
    if hasattr(m, "a"):
        decay = torch.log(torch.sigmoid(m.a)).expand(1)
    o = linear_attention_recurrent_ref(x[:, None], key[:, None], key[:, None], log_decay=decay)[:, 0]
    torch.testing.assert_close(m(x), x + 0.5 * temp * o)  # z + eta T sum_j gamma (z.k_j) k_j


def test_nrgpt_attention_is_causal_softmax_attention_with_values_equal_to_keys_and_no_self_term() -> None:
    m = _perturbed(energydsl.load("examples/nrgpt/attention.energy").module())
    x = m.example_input(2, 6).double()
    g = F.layer_norm(x, (x.shape[-1],), eps=1e-6) + m.delta
    beta = 1 / math.sqrt(x.shape[-1] / m.J.shape[0])
    s = beta * torch.einsum("bjd,kde,bie->bkij", g, m.J, g)
    T = x.shape[1]
    strict = torch.ones(T, T).tril(-1).bool()
    p = torch.nan_to_num(torch.softmax(s.masked_fill(~strict, float("-inf")), -1))
    read = torch.einsum("bkij,bjd->bkid", p, g)  # values = the keys' tokens g_j, j < i
    grad = -torch.einsum("k,kde,bkid->bie", m.alpha, m.J, read)
    torch.testing.assert_close(m(x), x - grad @ m.P_M.T)


def test_cem_attention_with_one_step_is_a_weight_tied_llama_attention() -> None:
    """W_V = W_K and W_O = W_Qᵀ: CEM attention (T = 1, no preconditioner, no diagonal) is tied MHA."""
    m = _perturbed(energydsl.load("examples/cem/tied-attention.energy").module())
    x = m.example_input(2, 7).double()
    q = torch.einsum("kmd,btd->bktm", m.WQ, x)
    k = torch.einsum("kmd,btd->bktm", m.WK, x)
    o = F.scaled_dot_product_attention(q, k, k, is_causal=True)  # values are the keys
    torch.testing.assert_close(m(x), x + torch.einsum("kmd,bktm->btd", m.WQ, o))  # output map W_Qᵀ


def test_cem_mlp_is_a_tied_swiglu() -> None:
    """x + Vᵀ((W h) ∘ SiLU(V u)): SwiGLU with the down-projection the activated up-projection transposed."""
    m = _perturbed(energydsl.load("examples/cem/mlp.energy").module())
    x = m.example_input(2, 5).double()
    u = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(m(x), x + ((x @ m.W.T) * F.silu(u @ m.V.T)) @ m.V)


@pytest.mark.parametrize("variant", ["momentum-gpt", "nag-gpt"])
def test_across_layer_optimizers_reduce_to_gpt_when_beta_is_zero(variant: str) -> None:
    dims = dict(vocab=11, context=8, d=8, layers=3, heads=2)
    plain = _perturbed(energydsl.load("examples/models/gpt.energy").model(**dims))
    model = energydsl.load(f"examples/models/{variant}.energy").model(**dims).double()
    state = {k: v for k, v in plain.state_dict().items()}
    state.update(across_beta=torch.tensor(0.0, dtype=torch.float64), across_eta=torch.tensor(1.0, dtype=torch.float64))
    model.load_state_dict(state)
    idx = torch.randint(0, 11, (2, 8))
    torch.testing.assert_close(model(idx), plain(idx))
    with torch.no_grad():
        model.across_beta.fill_(0.9)
    assert not torch.allclose(model(idx), plain(idx))


# ----------------------------------------------------------------------------- CLI


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(ENERGY + list(args), capture_output=True, text=True, cwd=cwd)


def test_compile_writes_an_importable_module(tmp_path: Path) -> None:
    out = tmp_path / "layer.py"
    r = _run("compile", "examples/models/gpt.energy", "-o", str(out), "--backend", "torch")
    assert r.returncode == 0, r.stderr
    scope: dict = {}
    exec(compile(out.read_text(), str(out), "exec"), scope)
    layer = scope["MHA"]()
    x = layer.example_input(2, 5)
    assert layer(x).shape == x.shape and "autograd" not in out.read_text()


def test_graph_prints_and_writes_dot(tmp_path: Path) -> None:
    r = _run("graph", "examples/models/gpt.energy", "--dot", str(tmp_path / "g.dot"))
    assert r.returncode == 0, r.stderr
    assert "MHA -> MLP" in r.stdout and "digraph" in (tmp_path / "g.dot").read_text()


def test_train_cli_runs_and_resumes(tmp_path: Path) -> None:
    text = tmp_path / "tiny.txt"
    text.write_text("to be or not to be, that is the question. " * 200)
    args = ["train", "examples/models/gpt.energy", "--data", f"bytes:{text}", "--steps", "6", "--json",
            "--set", "vocab=256", "--set", "d=16", "--set", "layers=1", "--set", "heads=2", "--set", "context=16",
            "--batch-size", "4", "--eval-interval", "3", "--eval-iters", "2", "--out", str(tmp_path / "run")]
    r = _run(*args)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("train_loss", "val_loss", "best_val_loss", "steps", "tokens_per_s", "params"):
        assert key in result
    assert result["steps"] == 6 and (tmp_path / "run" / "best.safetensors").exists()
    r = _run("sample", str(tmp_path / "run"), "--prompt", "to be", "--tokens", "5")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("data,message", [("bytes:/no/such/file.txt", "no/such/file"),
                                          ("imagenet", "imagenet")])
def test_train_bad_data_is_a_clear_error(data: str, message: str) -> None:
    r = _run("train", "examples/models/gpt.energy", "--data", data, "--steps", "1")
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_model_hole_outside_search_is_located(tmp_path: Path) -> None:
    spec = tmp_path / "m.energy"
    spec.write_text((ROOT / "examples/models/gpt.energy").read_text().replace("layers = 4", "layers = int 1..3"))
    r = _run("info", str(spec))
    assert r.returncode == 2 and "m.energy:" in r.stderr and "search" in r.stderr


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples/models").glob("*.energy")))
def test_every_model_example_trains_one_step(path: str) -> None:
    model = energydsl.load(ROOT / path).model(context=8)
    idx = model.example_input(2, 8)
    logits = model(idx)
    assert logits.shape == (2, 8, model.vocab_size)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx.reshape(-1))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("args,message", [
    (["info", "examples/models/gpt.energy", "--set", "width=3"], "gpt.energy:47:7: error: `width` is not a dim"),
    (["compile", "examples/cem/mlp.energy", "--backend", "cuda"], "unknown backend `cuda`"),
    (["graph", "examples/cem/mlp.energy"], "declares no model"),
    (["sample", "/no/such/run"], "checkpoint not found"),
    (["train", "examples/models/gpt.energy", "--data", "shakespeare_char", "--block-size", "999"],
     "longer than the model's context 64"),
])
def test_model_cli_bad_input_is_a_clear_error(args: list[str], message: str) -> None:
    r = _run(*args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_unknown_stage_is_located(tmp_path: Path) -> None:
    spec = tmp_path / "m.energy"
    spec.write_text((ROOT / "examples/models/gpt.energy").read_text().replace("-> MLP(", "-> MLPX("))
    r = _run("info", str(spec))
    assert r.returncode == 2 and "m.energy:49:28: error: no energy or block named `MLPX`" in r.stderr

"""The training loop, checkpoints, resuming, divergence and sampling, on a tiny reference GPT (CPU)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from energydsl.errors import TrainingDiverged, UserError
from energydsl.training import TrainConfig, load_checkpoint, load_dataset, sample, train
from energydsl.training.sampling import codec_from_json
from energydsl.training.trainer import configure_optimizer, lr_at

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = 32


def _reference_module():
    spec = importlib.util.spec_from_file_location("reference_gpt", ROOT / "benchmarks" / "reference_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GPT = _reference_module().GPT


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run faster on one thread, and much faster on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def text_dataset(tmp_path_factory):
    """A small, learnable character corpus that needs no download."""
    lines = [
        "the quick brown fox jumps over the lazy dog.\n",
        "now is the time for all good men to come to the aid of the party.\n",
        "to be, or not to be, that is the question.\n",
    ]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("".join(lines[i % 3] for i in range(200)))
    return load_dataset(f"chars:{path}")


def tiny_gpt(vocab: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return GPT(vocab, CONTEXT, 32, 2, 2)


def config(**kw) -> TrainConfig:
    base = dict(steps=30, batch_size=8, block_size=CONTEXT, lr=3e-3, min_lr=3e-4, warmup_steps=5,
                eval_interval=10, eval_iters=4, log_interval=5, seed=7)
    return TrainConfig(**{**base, **kw})


META = {"source": "spec text here", "dims": {"d": 32, "layers": 2}, "context": CONTEXT}


# ------------------------------------------------------------------------------------ schedule


def test_lr_schedule_warmup_then_cosine():
    cfg = config(steps=100, warmup_steps=10, lr=1.0, min_lr=0.1)
    lrs = [lr_at(s, cfg) for s in range(101)]
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11]))  # noqa: B905
    assert lrs[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # noqa: B905
    assert lrs[100] == pytest.approx(0.1)


def test_weight_decay_only_on_matrices():
    model = tiny_gpt(20)
    opt = configure_optimizer(model, config(), torch.device("cpu"))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] > 0 and no_decay["weight_decay"] == 0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == sum(
        p.numel() for p in model.parameters()
    )


# -------------------------------------------------------------------------------------- training


def test_training_lowers_loss_and_writes_outputs(text_dataset, tmp_path):
    model = tiny_gpt(text_dataset.vocab_size)
    result = train(model, text_dataset, config(), tmp_path, metadata=META, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 10, 20, 30]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5
    assert result["steps"] == 30 and result["val_loss"] == pytest.approx(evals[-1]["val_loss"])
    assert result["best_val_loss"] <= result["val_loss"] and result["tokens_per_s"] > 0
    assert result["params"] == sum(p.numel() for p in model.parameters())
    for name in ("best.safetensors", "best.json", "best.optim.pt", "last.safetensors", "loss.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_best_checkpoint_loads_into_a_fresh_model(text_dataset, tmp_path):
    model = tiny_gpt(text_dataset.vocab_size)
    train(model, text_dataset, config(), tmp_path, metadata=META, progress=False)
    state, meta = load_checkpoint(tmp_path)
    assert meta["source"] == META["source"] and meta["dims"] == META["dims"]
    best = meta["training"]
    assert best["step"] == best["best_step"] and best["val_loss"] == best["best_val_loss"]
    assert "lm_head.weight" in state and torch.equal(state["lm_head.weight"], state["wte.weight"])
    fresh = tiny_gpt(text_dataset.vocab_size, seed=123)
    fresh.load_state_dict(state)
    if best["step"] == 30:  # the final model is the best one: identical outputs
        x = torch.randint(0, text_dataset.vocab_size, (2, CONTEXT))
        model.eval()
        torch.testing.assert_close(fresh(x), model(x))
    with pytest.raises(Exception, match="checkpoint"):
        load_checkpoint(tmp_path / "nothing-here.safetensors")


def test_resume_continues_from_saved_step_and_matches_uninterrupted_run(text_dataset, tmp_path):
    cfg = config(steps=20)
    straight = tiny_gpt(text_dataset.vocab_size)
    train(straight, text_dataset, cfg, tmp_path / "a", metadata=META, progress=False)

    first = tiny_gpt(text_dataset.vocab_size)
    stopped = train(first, text_dataset, cfg, tmp_path / "b", metadata=META, progress=False,
                    on_eval=lambda step, loss: step == 10)
    assert stopped["steps"] == 10 and stopped["stopped_early"]
    assert json.loads((tmp_path / "b" / "last.json").read_text())["training"]["step"] == 10

    second = tiny_gpt(text_dataset.vocab_size, seed=99)  # weights come from the checkpoint
    resumed = train(second, text_dataset, cfg, tmp_path / "b", metadata=META, progress=False)
    assert resumed["resumed_from"] == 10 and resumed["steps"] == 20
    for (name, a), b in zip(straight.state_dict().items(), second.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    evals = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if r["kind"] == "eval"] == [0, 10, 20]


def test_no_resume_when_metadata_differs_or_disabled(text_dataset, tmp_path):
    cfg = config(steps=10)
    train(tiny_gpt(text_dataset.vocab_size), text_dataset, cfg, tmp_path, metadata=META, progress=False)
    again = train(tiny_gpt(text_dataset.vocab_size), text_dataset, config(steps=20), tmp_path, metadata=META,
                  progress=False, resume=False)
    assert again["resumed_from"] is None
    with pytest.warns(UserWarning, match="different model"):
        other = train(tiny_gpt(text_dataset.vocab_size), text_dataset, cfg, tmp_path,
                      metadata={**META, "source": "another spec"}, progress=False)
    assert other["resumed_from"] is None
    assert load_checkpoint(tmp_path)[1]["source"] == "another spec"


class NaNAfter(nn.Module):
    """Wraps a model; after `k` training forwards its logits turn NaN (or are scaled by `scale`)."""

    def __init__(self, inner: nn.Module, k: int, scale: float | None = None):
        super().__init__()
        self.inner, self.k, self.scale = inner, k, scale
        self.calls = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.inner(idx)
        if not self.training:
            return logits
        self.calls += 1
        if self.calls > self.k:
            return logits * self.scale if self.scale is not None else logits * float("nan")
        return logits


def test_nan_loss_raises_and_keeps_last_good_checkpoint(text_dataset, tmp_path):
    model = NaNAfter(tiny_gpt(text_dataset.vocab_size), k=17)
    with pytest.raises(TrainingDiverged) as err:
        train(model, text_dataset, config(), tmp_path, metadata=META, progress=False)
    assert err.value.step == 17 and math.isnan(err.value.loss)
    assert err.value.checkpoint == str(tmp_path / "last.safetensors")
    state, meta = load_checkpoint(tmp_path / "last.safetensors")
    assert meta["training"]["step"] == 10
    assert all(torch.isfinite(t).all() for t in state.values())
    fresh = NaNAfter(tiny_gpt(text_dataset.vocab_size, seed=5), k=10**9)
    fresh.load_state_dict(state)
    assert torch.isfinite(fresh(torch.zeros(1, 4, dtype=torch.long))).all()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["kind"] == "diverged" and rows[-1]["step"] == 17


def test_exploding_loss_raises(text_dataset, tmp_path):
    model = NaNAfter(tiny_gpt(text_dataset.vocab_size), k=12, scale=1e4)
    with pytest.raises(TrainingDiverged) as err:
        train(model, text_dataset, config(log_interval=1), tmp_path, metadata=META, progress=False)
    assert err.value.step == 12 and math.isfinite(err.value.loss) and err.value.loss > 100


def test_on_eval_can_stop_early_without_out_dir(text_dataset):
    seen = []

    def prune(step: int, val_loss: float) -> bool:
        seen.append((step, val_loss))
        return step >= 20

    result = train(tiny_gpt(text_dataset.vocab_size), text_dataset, config(steps=50), None, metadata=META,
                   progress=False, on_eval=prune)
    assert [s for s, _ in seen] == [0, 10, 20]
    assert result["steps"] == 20 and result["stopped_early"] and result["out_dir"] is None


def test_masked_task_trains(tmp_path):
    ds = load_dataset("listops", seed=0, max_length=20, num_train=256, num_val=64)
    model = GPT(ds.vocab_size, 24, 32, 2, 2)
    result = train(model, ds, config(steps=10, block_size=24, eval_interval=5), tmp_path, metadata={},
                   progress=False)
    assert math.isfinite(result["val_loss"]) and result["val_loss"] < math.log(ds.vocab_size)


def test_bad_config_and_model_are_user_errors(text_dataset):
    with pytest.raises(UserError, match="batch_size"):
        train(tiny_gpt(text_dataset.vocab_size), text_dataset, config(batch_size=0), None, metadata={})
    with pytest.raises(UserError, match="dtype"):
        train(tiny_gpt(text_dataset.vocab_size), text_dataset, config(dtype="float8"), None, metadata={})

    class Wrong(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(3))

        def forward(self, idx):
            return self.w.expand(idx.shape[0], 3)

    with pytest.raises(ValueError, match="logits"):
        train(Wrong(), text_dataset, config(), None, metadata={}, progress=False)


# -------------------------------------------------------------------------------------- sampling


def test_sample_length_determinism_and_cropping(text_dataset, tmp_path):
    model = tiny_gpt(text_dataset.vocab_size)
    train(model, text_dataset, config(steps=10), tmp_path, metadata=META, progress=False)
    state, meta = load_checkpoint(tmp_path)
    codec = codec_from_json(meta["training"]["dataset"]["codec"])
    fresh = tiny_gpt(codec.vocab_size, seed=1)
    fresh.load_state_dict(state)
    long_prompt = "the quick brown fox " * 5  # longer than the context: must be cropped
    out = sample(fresh, codec, long_prompt, 50, temperature=0.8, top_k=5,
                 generator=torch.Generator().manual_seed(0), metadata=meta)
    assert isinstance(out, str) and len(out) == 50
    again = sample(fresh, text_dataset, long_prompt, 50, temperature=0.8, top_k=5,
                   generator=torch.Generator().manual_seed(0), metadata=meta)
    assert again == out
    greedy = sample(fresh, codec, "", 20, temperature=0)
    assert len(greedy) == 20 and greedy == sample(fresh, codec, "", 20, temperature=0)
    full = sample(fresh, codec, "to be", 7, temperature=0, include_prompt=True)
    assert full.startswith("to be") and len(full) == 12
    assert fresh.training, "sampling restores the training mode"


def test_bfloat16_autocast_on_cpu(text_dataset):
    result = train(tiny_gpt(text_dataset.vocab_size), text_dataset, config(steps=5, eval_interval=5,
                   dtype="bfloat16"), None, metadata={}, progress=False)
    assert math.isfinite(result["val_loss"])
    with pytest.raises(UserError, match="float16"):
        train(tiny_gpt(text_dataset.vocab_size), text_dataset, config(dtype="float16"), None, metadata={})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cuda_training_and_resume(text_dataset, tmp_path, dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cfg = config(steps=20, device="cuda", dtype=dtype)
    first = train(tiny_gpt(text_dataset.vocab_size), text_dataset, cfg, tmp_path, metadata=META,
                  progress=False, on_eval=lambda step, loss: step == 10)
    assert first["steps"] == 10
    result = train(tiny_gpt(text_dataset.vocab_size), text_dataset, cfg, tmp_path, metadata=META,
                   progress=False)
    assert result["resumed_from"] == 10 and result["val_loss"] < math.log(text_dataset.vocab_size)
    state, meta = load_checkpoint(tmp_path)
    assert all(t.device.type == "cpu" for t in state.values())

"""The training loop, checkpoints, resuming, divergence and sampling, on a tiny reference GPT (CPU)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import signal
import types
from pathlib import Path

import pytest
import torch
from conftest import strict_json
from torch import nn

import energydsl
from energydsl.errors import TrainingDiverged, TrainingInterrupted, UserError
from energydsl.training import TrainConfig, load_checkpoint, load_dataset, sample, train
from energydsl.training.checkpoint import checkpoint_file, read_checkpoint
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


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def text_dataset(corpus):
    return load_dataset(f"chars:{corpus}")


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


def test_a_warmup_longer_than_the_run_ends_with_it():
    """The same schedule as a warmup of exactly the run's steps, while the config keeps what was asked for."""
    long, exact = config(steps=20, warmup_steps=30, lr=1.0, min_lr=0.1), config(steps=20, warmup_steps=20, lr=1.0,
                                                                                   min_lr=0.1)
    assert [lr_at(s, long) for s in range(21)] == [lr_at(s, exact) for s in range(21)]
    assert long.warmup_steps == 30


def test_weight_decay_only_on_matrices():
    model = tiny_gpt(20)
    opt = configure_optimizer(model, config(), torch.device("cpu"))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] > 0 and no_decay["weight_decay"] == 0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == sum(
        p.numel() for p in model.parameters()
    )


def test_a_matrix_streams_norm_gains_are_not_decayed():
    """RMT's gains are [dk, dv] matrices: gains all the same, kept out of weight decay as a vector's are."""
    model = energydsl.load(ROOT / "examples/models/rmt.energy").model(layers=1)
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = configure_optimizer(model, config(), torch.device("cpu")).param_groups
    gains = sorted(names[id(p)] for p in no_decay["params"] if p.dim() >= 2)
    assert gains == ["final_norm.weight", "norms.0.0.weight", "norms.0.1.weight"]
    assert not any("norm" in names[id(p)] for p in decay["params"])


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
    notices: list[str] = []  # the same command again said nothing of resuming (only of changed settings)
    resumed = train(second, text_dataset, cfg, tmp_path / "b", metadata=META, progress=False, notify=notices.append)
    assert resumed["resumed_from"] == 10 and resumed["steps"] == 20
    assert notices == [f"resuming {tmp_path / 'b'} at step 10"], notices
    for (name, a), b in zip(straight.state_dict().items(), second.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    evals = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if r["kind"] == "eval"] == [0, 10, 20]


class Killed(BaseException):
    """A SIGKILL, simulated: raised instead of a checkpoint write or rename, and caught by nothing."""


def count_checkpoint_writes(monkeypatch, kill_at: int | None = None) -> list[str]:
    """Record each file written, renamed or removed by a checkpoint save; raise `Killed` instead of the
    `kill_at`-th (1-based)."""
    from energydsl.training import checkpoint

    ops: list[str] = []

    def counted(name, fn):
        def op(*args, **kw):
            ops.append(f"{name} {' '.join(a.name for a in args if isinstance(a, Path))}")
            if len(ops) == kill_at:
                raise Killed(ops[-1])
            return fn(*args, **kw)
        return op

    for name in ("_write_weights", "_write_resume_state", "_write_text"):
        monkeypatch.setattr(checkpoint, name, counted(name, getattr(checkpoint, name)))
    fake_os = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
    fake_os.replace, fake_os.unlink = counted("replace", os.replace), counted("unlink", os.unlink)
    monkeypatch.setattr(checkpoint, "os", fake_os)
    monkeypatch.setattr(checkpoint, "shutil", types.SimpleNamespace(copyfile=counted("copy", shutil.copyfile)))
    return ops


def test_a_kill_at_any_point_of_a_save_leaves_a_checkpoint_that_resumes_exactly(text_dataset, tmp_path,
                                                                               monkeypatch):
    """Killed before any write, rename or removal of the saves at steps 0 and 5 (`last` and `best` each),
    the rerun resumes from the old or the new checkpoint, never a mix, and ends as the uninterrupted run. (No
    loss plot: its draws took two thirds of the 60-odd runs' time, and it writes nothing a checkpoint reads.)"""
    from energydsl.training import run_dir

    with pytest.MonkeyPatch.context() as no_plot:  # apart from `monkeypatch`, which the loop undoes
        no_plot.setattr(run_dir, "_plot", lambda metrics, png: None)
        _kill_at_every_save_op(text_dataset, tmp_path, monkeypatch)


def _kill_at_every_save_op(text_dataset, tmp_path, monkeypatch) -> None:
    cfg = config(steps=10, eval_interval=5, eval_iters=2)
    straight = tiny_gpt(text_dataset.vocab_size)
    ops = count_checkpoint_writes(monkeypatch)
    done = train(straight, text_dataset, cfg, tmp_path / "a", metadata=META, progress=False)
    monkeypatch.undo()
    first_two = [i for i, op in enumerate(ops, 1) if op == "unlink .checkpoint.commit"][1]
    assert done["best_step"] == 10 and ops.count("unlink .checkpoint.commit") == 3
    best = load_checkpoint(tmp_path / "a")[0]
    resumed_from = set()
    for k in range(1, first_two + 2):  # the last one: killed before the first write of the save at step 10
        out = tmp_path / f"k{k}"
        count_checkpoint_writes(monkeypatch, kill_at=k)
        with pytest.raises(Killed):
            train(tiny_gpt(text_dataset.vocab_size), text_dataset, cfg, out, metadata=META, progress=False)
        monkeypatch.undo()
        for stem in ("last", "best"):  # what `energy sample` reads now: each stem's files are from one save
            if checkpoint_file(out / f"{stem}.json") is not None:
                _, meta, header = read_checkpoint(out / f"{stem}.safetensors")
                assert header["step"] == str(meta["training"]["step"]), (k, ops[k - 1], stem)
        model = tiny_gpt(text_dataset.vocab_size)  # as the CLI does: a rerun that finds no checkpoint starts afresh
        result = train(model, text_dataset, cfg, out, metadata=META, progress=False)
        resumed_from.add(result["resumed_from"])
        assert (result["steps"], result["best_step"]) == (10, 10), (k, ops[k - 1])
        for (name, a), b in zip(straight.state_dict().items(), model.state_dict().values(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{name} after a kill at {ops[k - 1]}")
        state, meta = load_checkpoint(out)  # best.* is the step-10 model, too
        assert meta["training"]["step"] == 10 and all(torch.equal(best[n], t) for n, t in state.items())
        staged = sorted(p.name for p in out.glob(".*") if p.name != ".train.lock")  # the lock stays, empty of use
        assert not staged, (k, staged)  # no staged files left
    assert resumed_from == {None, 0, 5}


def test_a_run_directory_in_use_is_refused_and_released_after(text_dataset, tmp_path):
    """Two trainings in one directory interleaved their metrics and deleted each other's staged files: the
    second is refused at once, naming the process; once the first ends (or fails), the directory is free."""
    from energydsl.training.run_dir import _claim

    held = _claim(tmp_path)  # what a running training holds
    try:
        with pytest.raises(UserError, match=rf"{tmp_path} is in use by another training \(pid {os.getpid()}\)"):
            train(tiny_gpt(text_dataset.vocab_size), text_dataset, config(steps=2), tmp_path, metadata=META,
                  progress=False)
        assert not (tmp_path / "metrics.jsonl").exists()
    finally:
        held.close()
    model = CtrlCAt(tiny_gpt(text_dataset.vocab_size), k=2)
    with pytest.raises(KeyboardInterrupt):
        train(model, text_dataset, config(steps=4), tmp_path, metadata=META, progress=False)
    result = train(CtrlCAt(tiny_gpt(text_dataset.vocab_size), k=10**9), text_dataset, config(steps=4), tmp_path,
                   metadata=META, progress=False)  # the interrupted run let go of it
    assert result["resumed_from"] == 2


def test_a_file_system_without_locks_trains_unguarded(text_dataset, tmp_path, monkeypatch):
    """flock fails with ENOLCK on some network mounts: the run goes on, as it did before runs were locked."""
    import errno

    from energydsl.training import run_dir

    def no_locks(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_dir.fcntl, "flock", no_locks)
    result = train(tiny_gpt(text_dataset.vocab_size), text_dataset, config(steps=2, eval_interval=2), tmp_path,
                   metadata=META, progress=False)
    assert result["steps"] == 2


def test_a_last_checkpoint_mixed_from_two_saves_is_refused(text_dataset, tmp_path):
    """An old run directory killed between two writes: weights from step 20, optimizer and sidecar from step
    10. The steps in all three files must agree, or the run would train on from the wrong weights."""
    cfg = config(steps=20)
    train(tiny_gpt(text_dataset.vocab_size), text_dataset, cfg, tmp_path, metadata=META, progress=False,
          on_eval=lambda step, loss: step == 10)
    old = {name: (tmp_path / name).read_bytes() for name in ("last.json", "last.optim.pt")}
    train(tiny_gpt(text_dataset.vocab_size), text_dataset, cfg, tmp_path, metadata=META, progress=False)
    for name, data in old.items():
        (tmp_path / name).write_bytes(data)
    with pytest.raises(UserError, match=r"different steps \(last.safetensors 20, last.optim.pt 10, last.json 10\)"):
        train(tiny_gpt(text_dataset.vocab_size), text_dataset, config(steps=30), tmp_path, metadata=META,
              progress=False)


def test_a_stale_best_is_repaired_when_resuming(text_dataset, tmp_path):
    """An old run directory killed after `last` was saved at the final step but before `best`: resuming (with
    nothing left to train) rewrites `best` from `last`, which the run state names the best."""
    cfg = config(steps=20)
    train(tiny_gpt(text_dataset.vocab_size), text_dataset, cfg, tmp_path, metadata=META, progress=False,
          on_eval=lambda step, loss: step == 10)
    old = {name: (tmp_path / name).read_bytes() for name in ("best.json", "best.optim.pt", "best.safetensors")}
    assert train(tiny_gpt(text_dataset.vocab_size), text_dataset, cfg, tmp_path, metadata=META,
                 progress=False)["best_step"] == 20
    for name, data in old.items():
        (tmp_path / name).write_bytes(data)
    result = train(tiny_gpt(text_dataset.vocab_size), text_dataset, cfg, tmp_path, metadata=META, progress=False)
    assert (result["resumed_from"], result["best_step"]) == (20, 20)
    (best, meta), (last, _) = load_checkpoint(tmp_path), load_checkpoint(tmp_path, which="last")
    assert meta["training"]["step"] == 20 and all(torch.equal(last[n], t) for n, t in best.items())


def test_a_resumed_run_keeps_its_best(text_dataset, tmp_path):
    """The best loss so far is part of the resumed state: resumed with a step size that makes things worse,
    `best.*` stays at the step before (not overwritten by the first evaluation after the resume)."""
    train(tiny_gpt(text_dataset.vocab_size), text_dataset, config(steps=10), tmp_path, metadata=META, progress=False)
    train(tiny_gpt(text_dataset.vocab_size), text_dataset, config(steps=20, lr=0.3, min_lr=0.3, warmup_steps=0,
                                                                 diverge_factor=math.inf),
          tmp_path, metadata=META, progress=False, notify=lambda message: None)
    evals = {r["step"]: r["val_loss"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "eval"}
    assert evals[20] > evals[10]  # the resumed steps made it worse, as intended
    best = json.loads((tmp_path / "best.json").read_text())["training"]
    assert best["step"] == min(evals, key=evals.__getitem__) == 10


def test_resuming_with_changed_settings_says_so_or_refuses(text_dataset, tmp_path):
    train(tiny_gpt(text_dataset.vocab_size), text_dataset, config(steps=10), tmp_path, metadata=META,
          progress=False)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for changed, shown in [(dict(seed=8), "seed 8"), (dict(batch_size=4, eval_iters=8), "batch_size 4, eval_iters 8"),
                           (dict(block_size=16), "block_size 16")]:
        with pytest.raises(UserError, match=f"cannot resume the run in .* \\(step 10\\) with {shown}: it was "
                                            "trained with") as err:
            train(tiny_gpt(text_dataset.vocab_size), text_dataset, config(steps=20, **changed), tmp_path,
                  metadata=META, progress=False)
        assert "--fresh" in err.value.hint
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing touched
    notices: list[str] = []
    result = train(tiny_gpt(text_dataset.vocab_size), text_dataset, config(steps=20, lr=1e-3), tmp_path,
                   metadata=META, progress=False, notify=notices.append, names={"lr": "--lr"})
    assert result["resumed_from"] == 10
    assert notices == [f"resuming {tmp_path} at step 10 with changed settings: steps 10 → 20, --lr 0.003 → 0.001"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"kind": "resumed", "step": 10, "changed": {"steps": [10, 20], "lr": [0.003, 0.001]}} in rows


def test_a_resumed_run_trains_with_its_own_weight_decay_and_betas(text_dataset, tmp_path):
    """The moments come back from the checkpoint, the settings do not: a changed --weight-decay that a
    resume announces is the one it applies (load_state_dict brought back the saved one)."""
    train(tiny_gpt(text_dataset.vocab_size), text_dataset, config(steps=4, weight_decay=0.1), tmp_path,
          metadata=META, progress=False)
    saved = torch.load(tmp_path / "last.optim.pt", weights_only=True)["optimizer"]
    assert [g["weight_decay"] for g in saved["param_groups"]] == [0.1, 0.0]
    result = train(tiny_gpt(text_dataset.vocab_size), text_dataset,
                   config(steps=6, weight_decay=0.0, betas=(0.8, 0.95)), tmp_path, metadata=META, progress=False)
    assert result["resumed_from"] == 4
    groups = torch.load(tmp_path / "last.optim.pt", weights_only=True)["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.0, 0.0]
    assert [tuple(g["betas"]) for g in groups] == [(0.8, 0.95)] * 2
    assert saved["state"][0]["step"] < torch.load(tmp_path / "last.optim.pt", weights_only=True)[
        "optimizer"]["state"][0]["step"]  # the moments went on from the checkpoint's


def test_no_resume_when_disabled_and_other_model_refused(text_dataset, tmp_path):
    cfg = config(steps=10)
    train(tiny_gpt(text_dataset.vocab_size), text_dataset, cfg, tmp_path, metadata=META, progress=False)
    again = train(tiny_gpt(text_dataset.vocab_size), text_dataset, config(steps=20), tmp_path, metadata=META,
                  progress=False, resume=False)
    assert again["resumed_from"] is None
    before = (tmp_path / "last.json").read_text(), (tmp_path / "metrics.jsonl").read_text()
    other_meta = {**META, "dims": {"d": 16, "layers": 2}}
    with pytest.raises(UserError) as err:  # a typo must not wipe a run
        train(tiny_gpt(text_dataset.vocab_size), text_dataset, cfg, tmp_path, metadata=other_meta, progress=False)
    assert str(tmp_path) in err.value.message and "dims.d is 32 there, 16 now" in err.value.message
    assert "--fresh" in err.value.hint and "--out" in err.value.hint
    assert ((tmp_path / "last.json").read_text(), (tmp_path / "metrics.jsonl").read_text()) == before
    other = train(tiny_gpt(text_dataset.vocab_size), text_dataset, cfg, tmp_path, metadata=other_meta,
                  progress=False, resume=False)
    assert other["resumed_from"] is None
    assert load_checkpoint(tmp_path)[1]["dims"] == {"d": 16, "layers": 2}


def test_resuming_needs_the_same_data_not_only_its_name_and_vocabulary(corpus, text_dataset, tmp_path):
    """A corpus of the same name and characters, in another order, was taken: its validation split overlapped the
    old training data, and `best` compared losses on two validation sets."""
    train(tiny_gpt(text_dataset.vocab_size), text_dataset, config(steps=10), tmp_path, metadata=META,
          progress=False)
    before = (tmp_path / "last.json").read_text()
    reordered = tmp_path / "reordered.txt"
    reordered.write_text("\n".join(reversed(Path(corpus).read_text().splitlines())))
    other = load_dataset(f"chars:{reordered}")
    other.name = text_dataset.name  # the same name and vocabulary: only the tokens differ
    assert other.vocab_size == text_dataset.vocab_size and other.digest() != text_dataset.digest()
    with pytest.raises(UserError, match="has other contents there"):
        train(tiny_gpt(text_dataset.vocab_size), other, config(steps=20), tmp_path, metadata=META, progress=False)
    assert (tmp_path / "last.json").read_text() == before
    again = train(tiny_gpt(text_dataset.vocab_size), load_dataset(f"chars:{corpus}"), config(steps=20), tmp_path,
                  metadata=META, progress=False)  # the same file read again: the same digest, it resumes
    assert again["resumed_from"] == 10


def test_resuming_needs_the_same_shapes_and_the_same_derived_model(corpus, text_dataset, tmp_path):
    train(tiny_gpt(text_dataset.vocab_size), text_dataset, config(steps=10), tmp_path, metadata=META,
          progress=False)
    narrower = GPT(text_dataset.vocab_size, CONTEXT, 16, 2, 2)  # the same metadata, other shapes
    with pytest.raises(UserError, match=r"of a different model or dataset: wte.weight is \[\d+, 32\] there, "
                                        r"\[\d+, 16\] now"):
        train(narrower, text_dataset, config(steps=20), tmp_path, metadata=META, progress=False)

    from energydsl import load  # the same shapes, other equations: momentum and Nesterov across layers
    dims = dict(d=16, layers=1, heads=2, context=CONTEXT, vocab=text_dataset.vocab_size)
    momentum = load(ROOT / "examples/models/momentum-gpt.energy").model(**dims)
    nesterov = load(ROOT / "examples/models/nag-gpt.energy").model(**dims)
    train(momentum, text_dataset, config(steps=10), tmp_path / "m", metadata={}, progress=False)
    with pytest.raises(UserError, match="equation_hash is .* there, .* now"):
        train(nesterov, text_dataset, config(steps=20), tmp_path / "m", metadata={}, progress=False)
    with pytest.warns(UserWarning, match="at step 10 with changed settings: steps 10 → 20"):
        assert train(momentum, text_dataset, config(steps=20), tmp_path / "m", metadata={},
                     progress=False)["resumed_from"] == 10


def test_a_model_too_small_for_the_data_is_refused_before_training(text_dataset):
    from energydsl import load

    spec = load(ROOT / "examples/models/gpt.energy")
    small_vocab = spec.model(d=16, layers=1, heads=2, context=CONTEXT, vocab=4)
    with pytest.raises(UserError, match=f"has {text_dataset.vocab_size} tokens but the model's vocab is 4"):
        train(small_vocab, text_dataset, config(), None, metadata={}, progress=False)
    short = spec.model(d=16, layers=1, heads=2, context=8, vocab=text_dataset.vocab_size)
    with pytest.raises(UserError, match=f"block_size {CONTEXT} is longer than the model's context 8"):
        train(short, text_dataset, config(), None, metadata={}, progress=False)


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


class CtrlCAt(nn.Module):
    """Wraps a model; its `k`-th training forward sends this process a SIGINT, as Ctrl-C does (or `signum`)."""

    def __init__(self, inner: nn.Module, k: int, signum: int = signal.SIGINT):
        super().__init__()
        self.inner, self.k, self.calls, self.signum = inner, k, 0, signum

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.k:
                signal.raise_signal(self.signum)
        return self.inner(idx)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_finishes_the_step_saves_and_resumes_where_it_stopped(text_dataset, tmp_path, signum):
    """Ctrl-C, or SIGTERM (a scheduler's pre-emption, `timeout`): saved at the step, resumed as if never stopped,
    the best checkpoint included (the interrupt's evaluation is saved as `last` but cannot become `best`)."""
    cfg = config(steps=20)
    straight = tiny_gpt(text_dataset.vocab_size)
    train(straight, text_dataset, cfg, tmp_path / "a", metadata=META, progress=False)

    model = CtrlCAt(tiny_gpt(text_dataset.vocab_size), k=13, signum=signum)
    with pytest.raises(KeyboardInterrupt) as err:  # a notebook stops as usual
        train(model, text_dataset, cfg, tmp_path / "b", metadata=META, progress=False)
    assert isinstance(err.value, TrainingInterrupted) and err.value.signum == signum
    assert err.value.step == 13 and err.value.checkpoint == str(tmp_path / "b" / "last.safetensors")
    assert json.loads((tmp_path / "b" / "last.json").read_text())["training"]["step"] == 13
    assert json.loads((tmp_path / "b" / "best.json").read_text())["training"]["step"] == 10
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers are put back
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    again = CtrlCAt(tiny_gpt(text_dataset.vocab_size, seed=99), k=10**9)
    resumed = train(again, text_dataset, cfg, tmp_path / "b", metadata=META, progress=False)
    assert resumed["resumed_from"] == 13 and resumed["steps"] == 20
    for (name, a), b in zip(straight.state_dict().items(), again.inner.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)  # as if never interrupted
    best = [json.loads((tmp_path / run / "best.json").read_text())["training"] for run in ("a", "b")]
    assert best[0]["best_step"] == best[1]["best_step"] and best[0]["step"] == best[1]["step"]


def test_an_interrupted_run_draws_its_plot_to_the_step_it_stopped_at(text_dataset, tmp_path, monkeypatch):
    """The plot is redrawn at most every 30 s: a Ctrl-C left it showing step 0 while the metrics went on."""
    from energydsl.training import run_dir

    plotted: list[int] = []
    draw = run_dir._plot

    def recording(metrics_path, png_path) -> None:
        rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
        plotted.append(max(r["step"] for r in rows))
        draw(metrics_path, png_path)

    monkeypatch.setattr(run_dir, "_plot", recording)
    with pytest.raises(TrainingInterrupted):
        train(CtrlCAt(tiny_gpt(text_dataset.vocab_size), k=13), text_dataset, config(steps=20), tmp_path,
              metadata=META, progress=False)
    assert plotted[-1] == 13 and (tmp_path / "loss.png").exists()


def test_sigterm_is_left_to_a_handler_already_installed(text_dataset, tmp_path):
    """A search worker handles SIGTERM itself (its trial is requeued): training does not take it over."""
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        model = CtrlCAt(tiny_gpt(text_dataset.vocab_size), k=3, signum=signal.SIGTERM)
        train(model, text_dataset, config(steps=5, eval_interval=5), tmp_path, metadata=META, progress=False)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_ctrl_c_without_a_run_directory_stops_at_once(text_dataset):
    model = CtrlCAt(tiny_gpt(text_dataset.vocab_size), k=3)
    with pytest.raises(KeyboardInterrupt) as err:
        train(model, text_dataset, config(steps=20), None, metadata=META, progress=False)
    assert not isinstance(err.value, TrainingInterrupted) and model.calls == 3


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
    rows = [strict_json(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["kind"] == "diverged" and rows[-1]["step"] == 17 and rows[-1]["loss"] is None
    assert rows[-1]["checkpoint_step"] == 10 and "nan" in rows[-1]["reason"]
    assert strict_json((tmp_path / "diverged.json").read_text())["checkpoint_step"] == 10


def test_exploding_loss_raises(text_dataset, tmp_path):
    model = NaNAfter(tiny_gpt(text_dataset.vocab_size), k=12, scale=1e4)
    with pytest.raises(TrainingDiverged) as err:
        train(model, text_dataset, config(log_interval=1), tmp_path, metadata=META, progress=False)
    assert err.value.step == 12 and math.isfinite(err.value.loss) and err.value.loss > 100


def test_exploding_loss_during_warmup_raises_and_keeps_last_good_checkpoint(text_dataset, tmp_path):
    model = NaNAfter(tiny_gpt(text_dataset.vocab_size), k=12, scale=1e4)
    with pytest.raises(TrainingDiverged) as err:
        train(model, text_dataset, config(warmup_steps=25, log_interval=1), tmp_path, metadata=META,
              progress=False)
    assert err.value.step == 12 and err.value.checkpoint_step == 10
    assert json.loads((tmp_path / "last.json").read_text())["training"]["step"] == 10


def last_good_checkpoint_is_good(path: Path, err: TrainingDiverged) -> None:
    assert err.checkpoint == str(path / "last.safetensors")
    state, meta = load_checkpoint(path / "last.safetensors")
    record = meta["training"]
    assert record["step"] == err.checkpoint_step < err.step
    assert record["val_loss"] == pytest.approx(err.checkpoint_val_loss)
    assert record["val_loss"] < 2 * record["initial_loss"] and record["train_loss"] < 2 * record["initial_loss"]
    assert all(torch.isfinite(t).all() for t in state.values())


def test_high_lr_diverging_in_warmup_keeps_a_good_last_checkpoint(text_dataset, tmp_path):
    """The audit's case: lr 30 with a long warmup; every evaluation used to overwrite `last`."""
    cfg = config(steps=40, warmup_steps=40, lr=30.0, min_lr=3.0, eval_interval=5)
    with pytest.raises(TrainingDiverged) as err:
        train(tiny_gpt(text_dataset.vocab_size), text_dataset, cfg, tmp_path, metadata=META, progress=False)
    last_good_checkpoint_is_good(tmp_path, err.value)


class EvalBlowsUp(nn.Module):
    """Trains normally; from evaluation forward `k` on, its logits are scaled by 1e4 (finite, huge loss)."""

    def __init__(self, inner: nn.Module, k: int):
        super().__init__()
        self.inner, self.k, self.evals = inner, k, 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.inner(idx)
        if self.training:
            return logits
        self.evals += 1
        return logits * 1e4 if self.evals > self.k else logits


def test_diverged_evaluation_is_not_saved(text_dataset, tmp_path):
    cfg = config()
    model = EvalBlowsUp(tiny_gpt(text_dataset.vocab_size), k=2 * 2 * cfg.eval_iters)  # evals at 0 and 10 fine
    with pytest.raises(TrainingDiverged) as err:
        train(model, text_dataset, cfg, tmp_path, metadata=META, progress=False)
    assert err.value.step == 20 and "val loss" in err.value.reason
    last_good_checkpoint_is_good(tmp_path, err.value)
    assert err.value.checkpoint_step == 10


def test_rerun_after_divergence_is_refused_unless_settings_change(text_dataset, tmp_path):
    model = NaNAfter(tiny_gpt(text_dataset.vocab_size), k=17)
    with pytest.raises(TrainingDiverged):
        train(model, text_dataset, config(), tmp_path, metadata=META, progress=False)
    again = NaNAfter(tiny_gpt(text_dataset.vocab_size), k=0)  # replaying would diverge at once
    with pytest.raises(UserError, match="diverged at step 17 with these same settings") as err:
        train(again, text_dataset, config(), tmp_path, metadata=META, progress=False)
    assert "rerun with a lower lr, or other" in err.value.hint and "--fresh" in err.value.hint
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert sum('"diverged"' in r for r in rows) == 1
    healthy = NaNAfter(tiny_gpt(text_dataset.vocab_size), k=10**9)
    with pytest.warns(UserWarning, match="with changed settings: lr 0.003 → 0.001"):
        result = train(healthy, text_dataset, config(lr=1e-3), tmp_path, metadata=META,
                       progress=False)  # a lower lr resumes from the last good checkpoint
    assert result["resumed_from"] == 10 and result["steps"] == 30
    rows = [strict_json(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 10, 20, 30]
    assert not any(r["kind"] == "diverged" for r in rows) and not (tmp_path / "diverged.json").exists()


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


@pytest.mark.parametrize(("setting", "message"), [
    (dict(lr=math.inf), "lr must be a finite number, got inf"),
    (dict(lr=math.nan), "lr must be above 0, got nan"),
    (dict(seed=2**64), f"seed must be a whole number in \\[0, 2\\*\\*64\\), got {2**64}"),
    (dict(seed=-1), "seed must be a whole number"),
    (dict(seed=1.5), "seed must be a whole number"),
    (dict(weight_decay=math.nan), "weight_decay must be a number, got nan"),
    (dict(weight_decay=math.inf), "weight_decay must be a finite number, got inf"),
    (dict(grad_clip=math.nan), "grad_clip must be a number, got nan"),
])
def test_out_of_range_settings_are_user_errors(setting, message, text_dataset):
    with pytest.raises(UserError, match=message):
        config(**setting).validate()
    with pytest.raises(UserError, match=message):
        train(tiny_gpt(text_dataset.vocab_size), text_dataset, config(**setting), None, metadata={}, progress=False)


def test_the_largest_seed_trains(text_dataset):
    result = train(tiny_gpt(text_dataset.vocab_size), text_dataset, config(steps=2, eval_interval=2, seed=2**64 - 1),
                   None, metadata={}, progress=False)
    assert math.isfinite(result["val_loss"])


def test_divergence_with_the_check_off_is_recorded_as_strict_json(text_dataset, tmp_path):
    """diverge_factor=inf (only NaN counts) puts an infinity into the config that diverged.json records."""
    cfg = config(lr=1e4, diverge_factor=math.inf)
    with pytest.raises(TrainingDiverged):
        train(tiny_gpt(text_dataset.vocab_size), text_dataset, cfg, tmp_path, metadata=META, progress=False)
    record = strict_json((tmp_path / "diverged.json").read_text())
    assert record["config"]["diverge_factor"] is None and record["config"]["lr"] == 1e4
    with pytest.raises(UserError, match="with these same settings"):  # still recognised as the same settings
        train(tiny_gpt(text_dataset.vocab_size), text_dataset, cfg, tmp_path, metadata=META, progress=False)


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


class FixedLogits(torch.nn.Module):
    """Logits 1 for the `favoured` token ids and 0 for the rest of a `vocab`, at every position: what a sampler
    draws from it is known."""

    def __init__(self, vocab: int, favoured: list[int]) -> None:
        super().__init__()
        self.logits = torch.zeros(vocab)
        self.logits[favoured] = 1.0
        self.w = torch.nn.Parameter(torch.zeros(1))  # the sampler reads the device off a parameter

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(*idx.shape, -1) + 0 * self.w


def test_top_k_keeps_exactly_k_tokens_when_logits_tie():
    """Two tokens tie for the largest logit: `top_k=1` drew from both (nanoGPT's `logits < kth` keeps ties),
    where the docs say it keeps the K likeliest."""
    from energydsl.training.sampling import CharCodec

    tied = FixedLogits(5, [0, 1, 2])  # a, b and c tie
    drawn = {k: set(sample(tied, CharCodec("abcde"), "a", 200, temperature=1.0, top_k=k,
                           generator=torch.Generator().manual_seed(0))) for k in (1, 2, 3, 4)}
    assert [len(d) for d in drawn.values()] == [1, 2, 3, 4] and drawn[3] == set("abc"), drawn


def test_a_prompt_that_encodes_to_no_tokens_is_not_returned_as_the_start_token():
    """`sample(..., include_prompt=True)` of " " on a words codec returned '<pad> b b b': the start token drawn from
    as if it were the prompt ("" gave 'b b b'); `stream` gives such a prompt no ids."""
    from energydsl.training.sampling import WordCodec, stream

    codec, model = WordCodec(["<pad>", "a", "b", "c"]), FixedLogits(4, [2])  # always b
    for prompt in ("", " ", "   "):
        assert sample(model, codec, prompt, 3, temperature=0, include_prompt=True) == "b b b", prompt
        assert stream(model, codec, prompt, 3, temperature=0)[1] == []
    assert sample(model, codec, "a", 2, temperature=0, include_prompt=True) == "a b b"


def test_sampling_reads_no_further_back_than_the_trained_block(text_dataset, tmp_path):
    """Trained on blocks of 8 in a context of 32: positions 8..31 never had a gradient, so the sampler feeds the
    model the last 8 tokens, not 32 (a run's metadata without a training block keeps the context)."""
    model = tiny_gpt(text_dataset.vocab_size)
    train(model, text_dataset, config(steps=5, eval_interval=5, block_size=8), tmp_path, metadata=META, progress=False)
    state, meta = load_checkpoint(tmp_path)
    lengths: list[int] = []
    model.register_forward_pre_hook(lambda module, args: lengths.append(args[0].shape[1]))
    sample(model, text_dataset, "the quick brown fox " * 3, 5, temperature=0, metadata=meta)
    assert lengths == [8] * 5
    lengths.clear()
    sample(model, text_dataset, "the quick brown fox " * 3, 5, temperature=0, metadata=META)
    assert lengths == [CONTEXT] * 5


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


def test_min_lr_defaults_to_a_tenth_of_lr_as_on_the_command_line():
    """TrainConfig's min_lr was a fixed 1e-4: `TrainConfig(lr=5e-5)` was refused (min_lr above lr) and any other
    lr ran another schedule from Python than `energy train --lr` does."""
    small = TrainConfig(lr=5e-5)
    small.validate()
    assert small.min_lr == 5e-6
    explicit = TrainConfig(lr=1e-3, min_lr=0)
    explicit.validate()
    assert explicit.min_lr == 0.0

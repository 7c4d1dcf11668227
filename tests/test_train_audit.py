"""`energy train` and `energy sample` against damaged checkpoints, memory exhaustion, Ctrl-C, `--fresh` and file
modes: exit 2 with a message (never 70), and a failing run never destroys what an earlier one left (CPU)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import struct
import sys
from pathlib import Path

import pytest
import torch
from conftest import energy_in_process, without_progress

from energydsl.errors import DataError

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


def energy(*args: str) -> tuple[int, str, str]:
    """Run the `energy` CLI in this process: exit status, stdout, stderr."""
    result = energy_in_process(*args)
    return result.returncode, result.stdout, without_progress(result.stderr)  # the lines of each evaluation left out


def tiny(corpus: Path, out: Path, *more: str) -> list[str]:
    """A tiny GPT on the test corpus: 4 steps, checkpoints at steps 0, 2 and 4 (seconds on a CPU)."""
    return ["train", str(ROOT / "examples/models/gpt.energy"), "--data", f"chars:{corpus}", "--set", "d=16",
            "--set", "layers=1", "--set", "heads=2", "--set", "context=16", "--steps", "4", "--eval-interval",
            "2", "--eval-iters", "2", "--batch-size", "4", "--out", str(out), *more]


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    """A finished tiny run (step 4); tests work on copies (`run`)."""
    path = tmp_path_factory.mktemp("trained") / "run"
    code, _, err = energy(*tiny(corpus, path))
    assert code == 0, err
    return path


@pytest.fixture
def run(trained, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def garble_weights(path: Path) -> None:
    """Same size, garbage content: every byte of the tensor data 0xFF, which reads back as NaN."""
    raw = bytearray(path.read_bytes())
    start = 8 + struct.unpack("<Q", raw[:8])[0]  # the u64 header length, the JSON header, then the data
    raw[start:] = b"\xff" * (len(raw) - start)
    path.write_bytes(bytes(raw))


class CtrlC(BaseException):
    """For `forward_fails`: a real Ctrl-C (SIGINT to this process) rather than an exception raised."""


@contextlib.contextmanager
def forward_fails(at_call: int, error: BaseException, *, training: bool = True):
    """The model's forward raises `error` at its `at_call`-th call in training mode (or in eval mode); `CtrlC()`
    sends this process a SIGINT there instead, which the training loop defers to the end of the step."""
    from energydsl.runtime.model import LanguageModel

    original = LanguageModel.forward
    calls = {"n": 0}

    def forward(self, idx):
        if self.training == training:
            calls["n"] += 1
            if calls["n"] == at_call:
                if isinstance(error, CtrlC):  # a real Ctrl-C: the training loop's handler takes it
                    signal.raise_signal(signal.SIGINT)
                else:
                    raise error
        return original(self, idx)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LanguageModel, "forward", forward)
        yield calls


# ---------------------------------------------------------------------------------- 1. damaged weights


def test_sample_refuses_weights_with_nan_naming_the_file(run):
    """Garbage bytes of the right size used to load, and sampling failed on NaN probabilities (exit 70)."""
    weights = run / "last.safetensors"
    garble_weights(weights)
    code, out, err = energy("sample", str(weights), "--tokens", "5")
    assert code == 2, err
    assert err.startswith(f"error: checkpoint {weights} is damaged: its weights hold NaN or infinite values"), err
    assert f"hint: use the run's other checkpoint, {run / 'best.safetensors'}" in err
    assert "internal error" not in err and out == ""
    code, out, err = energy("sample", str(run / "best.safetensors"), "--tokens", "5", "--prompt", "the")
    assert code == 0 and out.startswith("the"), err  # the intact checkpoint still samples
    (run / "best.safetensors").unlink()  # the other checkpoint is not offered where it is not
    code, out, err = energy("sample", str(weights), "--tokens", "5")
    assert code == 2 and "hint: use another checkpoint, or train again" in err, err


def test_sample_of_a_file_that_is_no_checkpoint_says_so(run, tmp_path):
    """A spec, an optimizer state or a text gave safetensors' own "header too large"."""
    spec = tmp_path / "best.energy"
    spec.write_text("energy E(d = 4) {\n}\n")
    for path, hint in ((spec, f"hint: train it first: `energy train {spec}`"),
                       (run / "last.optim.pt", "hint: give a run directory of `energy train`")):
        code, out, err = energy("sample", str(path), "--tokens", "5")
        assert code == 2 and err.startswith(f"error: {path} is not a safetensors checkpoint") and hint in err, err
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(3)}, str(tmp_path / "other.safetensors"))  # another model's weights, this sidecar
    shutil.copy(run / "best.json", tmp_path / "other.json")
    code, out, err = energy("sample", str(tmp_path / "other.safetensors"), "--tokens", "5")
    assert code == 2 and "hint: its weights and its metadata are from different saves" in err, err
    code, out, err = energy("sample", str(tmp_path), "--tokens", "5")  # a search's folder: its best.energy
    assert code == 2 and f"hint: a search keeps no weights: `energy train {spec}`" in err, err
    cut = tmp_path / "cut.safetensors"  # a checkpoint cut short is a damaged checkpoint, not another kind of file
    cut.write_bytes((run / "best.safetensors").read_bytes()[:200])
    code, out, err = energy("sample", str(cut), "--tokens", "5")
    assert code == 2 and err.startswith(f"error: cannot read checkpoint {cut}: "), err


def test_resume_refuses_weights_with_nan_as_a_damaged_checkpoint(run, corpus):
    """A resumed run used to load NaN weights and report a divergence ("lower --lr"): misleading."""
    garble_weights(run / "last.safetensors")
    before = files(run)
    code, _, err = energy(*tiny(corpus, run, "--steps", "8"))
    assert code == 2, err
    assert err.startswith(f"error: the checkpoint last.* in {run} cannot be read, so the run cannot resume: "
                          f"checkpoint {run / 'last.safetensors'} is damaged: its weights hold NaN or infinite "
                          "values"), err
    assert "hint: pass --fresh" in err and "diverged" not in err and "--lr" not in err
    assert files(run) == before


@pytest.mark.parametrize("damage, message", [
    # torch's own text explained weights_only loading ("you have two options..."), beside the point here
    (lambda run: (run / "last.optim.pt").write_bytes(b"PK\x03\x04 not a zip"),
     "checkpoint {run}/last.optim.pt is damaged: it is not an optimizer state PyTorch can read (RuntimeError)"),
    # an emptied sidecar read as "a checkpoint (step None) of a different model or dataset: the dataset is null"
    (lambda run: (run / "last.json").write_text("{}"),
     "the checkpoint's last.json in {run} is damaged: it lacks the training record that `energy train` writes"),
    # each was exit 70 (TypeError, KeyError, AttributeError where the value is used), or accepted (`lr: "x"`)
    (lambda run: (run / "last.json").write_text("[]"),
     "checkpoint metadata {run}/last.json is damaged: it is not the JSON object a save writes (it holds a list)"),
    (lambda run: edit_json(run / "last.json", lambda d: d["training"].pop("best_val_loss")),
     "the checkpoint last.* in {run} is damaged: last.json's training record lacks best_val_loss"),
    (lambda run: edit_json(run / "last.json", lambda d: d["training"]["config"].update(lr="x")),
     "the checkpoint last.* in {run} is damaged: last.json's training config has lr = \"x\""),
    (lambda run: torch.save({k: v for k, v in torch.load(run / "last.optim.pt").items() if k != "rng"},
                            run / "last.optim.pt"),
     "the checkpoint last.* in {run} is damaged: last.optim.pt's rng state is missing"),
    (lambda run: torch.save([1, 2], run / "last.optim.pt"),
     "last.optim.pt holds a list, not the optimizer, scaler and RNG states"),
    # each of these was exit 70, a KeyError, ValueError, TypeError or RuntimeError while loading the states or
    # (a moment of another shape) at the first step; the first two named no file ("...cannot resume: 101")
    (lambda run: (run / "last.optim.pt").write_bytes(b"hello\n"),
     "checkpoint {run}/last.optim.pt is damaged: it is not an optimizer state PyTorch can read (KeyError)"),
    (lambda run: (run / "last.optim.pt").unlink(), "checkpoint {run}/last.optim.pt is missing"),
    (lambda run: edit_optim(run, lambda d: d.update(optimizer={})),
     "the checkpoint last.* in {run} is damaged: the optimizer, scaler and batch-order states in last.optim.pt do "
     "not fit this run (KeyError: 'param_groups')"),
    (lambda run: edit_optim(run, lambda d: d["optimizer"]["state"][0].pop("step")), "(KeyError: 'step')"),
    (lambda run: edit_optim(run, lambda d: d["rng"].update(batches=torch.zeros(3))),
     "(TypeError: RNG state must be a torch.ByteTensor)"),
    (lambda run: edit_optim(run, lambda d: d["optimizer"]["state"][0].update(exp_avg=torch.zeros(3))),
     "(ValueError: exp_avg of shape [3] for a parameter of shape"),
    (lambda run: alias_nothing(run / "last.safetensors"),
     "checkpoint {run}/last.safetensors is damaged: its header's aliases name tensors it does not hold"),
], ids=["optim-not-torch", "sidecar-emptied", "sidecar-a-list", "record-lacks-a-field", "config-value-a-string",
        "optim-without-rng", "optim-a-list", "optim-text", "optim-missing", "optim-emptied", "moment-without-step",
        "rng-of-floats", "moment-of-another-shape", "alias-of-nothing"])
def test_resume_names_a_damaged_file_as_damaged(run, corpus, damage, message):
    damage(run)
    before = files(run)
    code, _, err = energy(*tiny(corpus, run, "--steps", "8"))
    assert code == 2 and message.format(run=run) in err, err
    assert "different model" not in err and "weights_only" not in err and "hint: pass --fresh" in err
    assert files(run) == before


def alias_nothing(path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        tensors, header = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    save_file(tensors, str(path), metadata={**header, "aliases": json.dumps({"x.weight": "nope"})})


def edit_optim(run: Path, edit) -> None:
    state = torch.load(run / "last.optim.pt", weights_only=True)
    edit(state)
    torch.save(state, run / "last.optim.pt")


def edit_json(path: Path, edit) -> None:
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))


@pytest.mark.parametrize("damage, message", [
    (lambda run: edit_json(run / "best.json", lambda d: d.pop("dims")),
     "the metadata of {run} is damaged: it lacks the model's name or dims"),
    (lambda run: edit_json(run / "best.json", lambda d: d.update(training=5)),
     "checkpoint metadata {run}/best.json is damaged: it is not the JSON object a save writes (its training record "
     "is a int)"),
    (lambda run: (run / ".checkpoint.commit").write_text('{"files": 5}'),
     "the checkpoint commit record {run}/.checkpoint.commit is damaged"),
    (lambda run: edit_json(run / "best.json", lambda d: d["training"]["dataset"].update(codec="x")),
     "the metadata of {run} is damaged: its training.dataset.codec is not what `energy train` writes"),
    (lambda run: edit_json(run / "best.json", lambda d: d["training"].update(dataset=[1])),
     "the metadata of {run} is damaged: its training.dataset is not what `energy train` writes"),
    (lambda run: edit_json(run / "best.json", lambda d: d["training"]["dataset"]["codec"].pop("chars")),
     "the metadata of {run} is damaged: its codec {{'kind': 'chars', 'vocab_size': 30}} is not what "
     "Codec.to_json() writes (KeyError: 'chars')"),
    (lambda run: edit_json(run / "best.json", lambda d: d.update(spec_source=5)),
     "the metadata of {run} is damaged: its spec_source is not what `energy train` writes"),
    (lambda run: edit_json(run / "best.json", lambda d: d.update(spec_path=5)),
     "the metadata of {run} is damaged: its spec_path is not what `energy train` writes"),
    # reported as `<string>:1:1: error: unexpected 'garbage'`, as if the user's own spec were wrong
    (lambda run: edit_json(run / "best.json", lambda d: d.update(spec_source="garbage {{")),
     "the metadata of {run} is damaged: the spec it holds (spec_source) does not load: unexpected `garbage`"),
    # the tokens a model reads when sampling: int("x"), int([1]) and a context of -5 were exit 70
    *[(lambda run, bad=bad: edit_json(run / "best.json", lambda d: d.update(context=bad)),
       "the metadata of {run} is damaged: its context is not what `energy train` writes")
      for bad in ("x", [1], -5, 2.5)],
    (lambda run: edit_json(run / "best.json", lambda d: d["training"].update(config=[])),
     "the metadata of {run} is damaged: its training.config is not what `energy train` writes"),
    # a table edited by hand sampled from the first 2 of 30 logits without a word
    (lambda run: edit_json(run / "best.json", lambda d: d["training"]["dataset"]["codec"].update(chars="ab")),
     "(its table has 2 tokens, its vocab_size says 30)"),
], ids=["no-dims", "training-a-number", "commit-record-not-names", "codec-a-string", "dataset-a-list",
        "codec-without-chars", "spec-source-a-number", "spec-path-a-number", "spec-source-garbage", "context-text",
        "context-a-list", "context-negative", "context-fractional", "config-a-list", "codec-table-edited"])
def test_sample_names_damaged_metadata(run, damage, message):
    """Each was exit 70 (KeyError, AttributeError, TypeError), but the last, which blamed the spec."""
    damage(run)
    code, out, err = energy("sample", str(run), "--tokens", "5")
    assert code == 2 and out == "" and message.format(run=run) in err, err


def test_resume_refuses_a_damaged_commit_record_and_run_files_that_are_folders(run, corpus):
    (run / ".checkpoint.commit").write_text('{"files": 5}')
    code, _, err = energy(*tiny(corpus, run, "--steps", "8"))
    assert code == 2 and f"the checkpoint commit record {run / '.checkpoint.commit'} is damaged" in err, err
    (run / ".checkpoint.commit").unlink()
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()
    code, _, err = energy(*tiny(corpus, run, "--steps", "8", "--lr", "2e-3"))
    assert code == 2 and f"{run / 'metrics.jsonl'} is not a file: the run writes its metrics there" in err, err
    assert "resuming" not in err, err  # refused first: it announced the resume with changed settings, then refused
    (run / "metrics.jsonl").rmdir()
    (run / "diverged.json").mkdir()  # was IsADirectoryError (exit 70) where the resume removes the record
    code, _, err = energy(*tiny(corpus, run, "--steps", "8", "--lr", "2e-3"))
    assert code == 2 and f"{run / 'diverged.json'} is not a file: the run writes a divergence's record there" in err


def test_a_metrics_row_the_disk_damaged_is_dropped_on_resume(run, corpus):
    """Bytes that are not UTF-8 in metrics.jsonl were a UnicodeDecodeError (exit 70), a step that is no number
    (null, text) a TypeError (exit 70)."""
    with (run / "metrics.jsonl").open("ab") as f:
        f.write(b'{"kind": "train", "step": 1, "loss": \xff}\n')
        f.write(b'{"kind": "eval", "step": null}\n{"kind": "train", "step": "3"}\n')
    code, _, err = energy(*tiny(corpus, run, "--steps", "6"))
    assert code == 0, err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 2, 4, 6]


def test_sample_names_lost_metadata_and_the_other_checkpoint(run):
    """Weights whose .json was lost were "not written by `energy train` (no model in its metadata)"."""
    (run / "best.json").unlink()
    code, out, err = energy("sample", str(run), "--tokens", "5")
    assert code == 2 and out == "", err
    assert err.startswith(f"error: {run / 'best.safetensors'} has no metadata beside it (best.json is missing)"), err
    assert f"`energy sample {run / 'last.safetensors'}` if that checkpoint is whole" in err
    code, out, err = energy("sample", str(run / "last.safetensors"), "--tokens", "5", "--prompt", "the")
    assert code == 0 and out.startswith("the"), err
    for name in ("best.safetensors", "last.json"):  # the other checkpoint is not suggested where it is not
        (run / name).unlink()
    code, out, err = energy("sample", str(run / "last.safetensors"), "--tokens", "5")
    assert code == 2 and "has no metadata beside it (last.json is missing)" in err and "best" not in err, err


def test_resume_refuses_an_optimizer_state_with_nan(run, corpus):
    """The same damage in last.optim.pt (torch.load does not notice it): NaN moments would make the loss NaN."""
    path = run / "last.optim.pt"
    state = torch.load(path, weights_only=True)
    state["optimizer"]["state"][0]["exp_avg"].fill_(float("nan"))
    torch.save(state, path)
    code, _, err = energy(*tiny(corpus, run, "--steps", "8"))
    assert code == 2 and f"checkpoint {path} is damaged: its optimizer state holds NaN" in err, err
    assert "diverged" not in err


# ---------------------------------------------------------------------------------- 2. out of memory


def test_out_of_memory_on_a_batch_is_exit_2_with_a_hint(corpus, tmp_path):
    """A batch far beyond this machine's memory is refused before training: Linux granted a batch larger than what
    was free (--batch-size 100000000) and killed the process when it touched the pages (exit 137, no message).
    2**55 sequences of 16 tokens need 2**62 bytes of ids alone, more than any machine has."""
    code, _, err = energy(*tiny(corpus, tmp_path / "run", "--batch-size", str(2**55)))
    assert code == 2, err
    assert err.startswith(f"error: out of memory while training on cpu: a batch of {2**55:,} sequences of 16 tokens "
                          "keeps at least "), err
    assert f"hint: train with a smaller --batch-size (now {2**55}) or --block-size (now 16), or a smaller model; " \
           "nothing was trained or written" in err
    assert "internal error" not in err and not any((tmp_path / "run").glob("*"))


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                 "tried to allocate 4294967296 bytes. Error code 12 (Cannot allocate memory)"),
    MemoryError(),
], ids=["cuda", "cpu-allocator", "MemoryError"])
def test_out_of_memory_mid_run_keeps_the_last_good_checkpoint(error, run, corpus):
    """Injected at the model's forward, through the real training loop: a resumed run cannot take a larger batch
    than it was trained with (--batch-size must stay as it was), and a GPU is not at hand, so no real allocation
    can fail after a checkpoint in a fast CPU test. The resumed run fails at its first step (5)."""
    before = files(run)
    with forward_fails(1, error):
        code, _, err = energy(*tiny(corpus, run, "--steps", "8"))
    assert code == 2, err
    first, hint = err.splitlines()[-2:]
    assert first.startswith("error: out of memory while training on cpu: ") and "err == 0" not in first, err
    assert hint == ("hint: train with a smaller --batch-size (now 4) or --block-size (now 16), or a smaller model; "
                    f"the last good checkpoint, step 4, is kept: {run / 'last.safetensors'} (another --batch-size "
                    "or --block-size starts a new run: --fresh (resume=False) or another --out directory)")
    assert files(run) == before  # nothing written: not even metrics.jsonl


def test_other_runtime_errors_stay_internal_errors(run, corpus):
    with forward_fails(1, RuntimeError("a bug")):
        code, _, err = energy(*tiny(corpus, run, "--steps", "8"))
    assert code == 70 and "internal error" in err and "a bug" in err


# ---------------------------------------------------------------------------------- 3. one `error:` prefix


def test_resume_refusal_says_error_once(run, corpus):
    weights = run / "last.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    code, _, err = energy(*tiny(corpus, run, "--steps", "8"))
    assert code == 2 and err.startswith(f"error: the checkpoint last.* in {run} cannot be read"), err
    assert err.count("error:") == 1, err


# ---------------------------------------------------------------------------------- 4. ENERGYDSL_SHAKESPEARE


def test_shakespeare_variable_naming_a_directory(tmp_path, monkeypatch):
    from energydsl.training import load_dataset

    monkeypatch.setenv("ENERGYDSL_SHAKESPEARE", str(tmp_path))
    with pytest.raises(DataError) as err:
        load_dataset("shakespeare_char")
    assert err.value.message == ("ENERGYDSL_SHAKESPEARE points to a directory, not to the tiny Shakespeare text "
                                 f"file (input.txt): {tmp_path}")
    assert "missing" not in err.value.message and "input.txt" in err.value.hint
    (tmp_path / "tinyshakespeare").mkdir()
    (tmp_path / "tinyshakespeare" / "input.txt").write_text("to be or not to be\n" * 50)
    with pytest.raises(DataError) as err:
        load_dataset("shakespeare_char")
    assert err.value.hint == f"set ENERGYDSL_SHAKESPEARE={tmp_path / 'tinyshakespeare' / 'input.txt'}"


def test_shakespeare_variable_naming_a_device_or_nothing(tmp_path, monkeypatch):
    """`ENERGYDSL_SHAKESPEARE=/dev/null` was called "a missing file"."""
    from energydsl.training import load_dataset

    for path, says in (("/dev/null", "something that is no regular file"), (tmp_path / "no.txt", "a missing file")):
        monkeypatch.setenv("ENERGYDSL_SHAKESPEARE", str(path))
        with pytest.raises(DataError, match=f"ENERGYDSL_SHAKESPEARE points to {says}"):
            load_dataset("shakespeare_char")


# ---------------------------------------------------------------------------------- 5. file modes


def test_run_files_get_the_mode_the_umask_gives(corpus, tmp_path):
    """last.safetensors used to be 0600 (safetensors writes a private temporary file and renames it)."""
    previous = os.umask(0o027)
    try:
        code, _, err = energy(*tiny(corpus, tmp_path / "run"))
    finally:
        os.umask(previous)
    assert code == 0, err
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "run").iterdir()}
    assert "last.safetensors" in modes and "best.safetensors" in modes
    assert modes == dict.fromkeys(modes, oct(0o640))


# ---------------------------------------------------------------------------------- 6. Ctrl-C at once


def test_a_ctrl_c_that_stops_at_once_says_what_was_kept(corpus, tmp_path):
    """A second Ctrl-C (the first restores Python's handler) raises KeyboardInterrupt wherever the run is; Typer
    turned it into exit 130 without a word. Injected at the third training forward (step 2, after the step-2
    checkpoint): sending two real SIGINTs into that window is a race."""
    run = tmp_path / "run"
    with forward_fails(3, KeyboardInterrupt()):
        code, _, err = energy(*tiny(corpus, run))
    assert code == 130
    assert err == (f"interrupted at once, without saving: kept the last checkpoint, step 2: "
                   f"{run / 'last.safetensors'}; rerun the same command to resume from it\n")
    assert json.loads((run / "last.json").read_text())["training"]["step"] == 2
    code, _, err = energy(*tiny(corpus, run))
    assert code == 0, err  # and it does resume
    with forward_fails(1, KeyboardInterrupt(), training=False):  # at the first evaluation: nothing saved yet
        code, _, err = energy(*tiny(corpus, tmp_path / "other"))
    assert code == 130
    assert err == f"interrupted at once, before a checkpoint was written: nothing was saved in {tmp_path / 'other'}\n"


def test_a_ctrl_c_before_training_says_nothing_was_written(corpus, tmp_path, monkeypatch):
    from energydsl import api

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "load", interrupted)  # while the spec is read and the model built
    code, _, err = energy(*tiny(corpus, tmp_path / "run"))
    assert code == 130 and err == "interrupted before training started: nothing was written\n"


def test_a_sigterm_before_training_says_so_too(corpus, tmp_path, monkeypatch):
    """SIGTERM (a scheduler's stop, `timeout`) while the model was built killed the command with exit 143 and
    no word, where a Ctrl-C said what the run directory keeps. A real signal, sent from inside the build."""
    import os
    import signal

    from energydsl import api

    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:  # a runner's own handler: the command keeps it
        pytest.skip("this process handles SIGTERM itself")

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(api, "load", terminated)
    code, _, err = energy(*tiny(corpus, tmp_path / "run"))
    assert code == 143 and err == "interrupted before training started: nothing was written\n", (code, err)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # given back


def test_a_ctrl_c_before_a_fresh_start_names_the_run_it_kept(run, corpus, monkeypatch):
    """--fresh over a run, stopped while the model was built: the run is untouched and resumable, which the note
    said nothing of ("nothing was written")."""
    from energydsl import api

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "load", interrupted)
    code, _, err = energy(*tiny(corpus, run, "--fresh"))
    assert code == 130
    assert err == (f"interrupted before training started: nothing was written; {run} keeps its last checkpoint, "
                   "step 4: rerun without --fresh to resume from it\n"), err


def test_the_interruption_notes_after_fresh_say_to_drop_it(run, corpus):
    """Rerunning the same command, --fresh included, would start over instead of resuming."""
    with forward_fails(3, KeyboardInterrupt()):
        code, _, err = energy(*tiny(corpus, run, "--fresh"))
    assert code == 130 and err.endswith("; rerun without --fresh to resume from it\n"), err
    with forward_fails(3, CtrlC()):  # the first Ctrl-C: the run is saved (at step 3), then it stops
        code, _, err = energy(*tiny(corpus, run, "--fresh"))
    assert code == 130
    assert err == f"interrupted at step 3: saved {run / 'last.safetensors'}; rerun without --fresh to resume\n"


# ---------------------------------------------------------------------------------- 7. exit statuses in --help


def test_train_help_lists_every_exit_status_as_the_docs_do():
    code, out, err = energy("train", "--help")
    assert code == 0, err
    shown = " ".join(out.replace("│", " ").split())
    docs = " ".join((ROOT / "docs/models.md").read_text().split())
    for status in ("0 done", "1 diverged", "2 bad input", "70 an internal error", "130 interrupted"):
        assert status in shown, status
        assert f"{status}" in docs.split("- Exit status:")[1], status


# ---------------------------------------------------------------------------------- 8. --fresh that fails early


@pytest.mark.parametrize("failure", ["out of memory", "ctrl-c at once", "nan at step 0"])
def test_a_fresh_run_that_fails_before_its_first_checkpoint_keeps_the_previous_run(failure, run, corpus):
    """--fresh used to empty metrics.jsonl (and drop diverged.json) before the new run had done anything, so a run
    that then failed (here: out of memory, a Ctrl-C that stops at once, a model that is NaN from the start) lost
    the previous run's metrics. The previous run's files are replaced once the new run saves its first checkpoint."""
    (run / "diverged.json").write_text('{"step": 3}')  # its divergence record is the previous run's, too
    before = files(run)
    if failure == "out of memory":
        code, _, err = energy(*tiny(corpus, run, "--fresh", "--batch-size", str(2**55)))
        assert code == 2 and "out of memory" in err, err
    elif failure == "ctrl-c at once":
        with forward_fails(1, KeyboardInterrupt(), training=False):
            code, _, err = energy(*tiny(corpus, run, "--fresh"))
        assert code == 130 and "kept the last checkpoint, step 4" in err and "without --fresh" in err, err
    else:
        from energydsl.runtime.model import LanguageModel

        original = LanguageModel.forward
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(LanguageModel, "forward", lambda self, idx: original(self, idx) * float("nan"))
            code, _, err = energy(*tiny(corpus, run, "--fresh"))
        assert code == 1 and "training diverged at step 0" in err and "no good checkpoint was written" in err, err
        assert "no optimizer setting changes them" in err and "--lr" not in err, err  # no step ran: not the lr
    assert files(run) == before


def test_a_fresh_run_replaces_the_previous_files_once_it_has_begun(run, corpus):
    old = (run / "metrics.jsonl").read_text()
    (run / "diverged.json").write_text('{"step": 3}')
    with forward_fails(3, KeyboardInterrupt()):  # stopped after its step-2 checkpoint
        code, _, err = energy(*tiny(corpus, run, "--fresh", "--lr", "0.002"))
    assert code == 130, err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 2] and (run / "metrics.jsonl").read_text() != old
    assert not (run / "diverged.json").exists()
    assert json.loads((run / "last.json").read_text())["training"]["config"]["lr"] == 0.002


def test_a_resumed_run_that_fails_at_once_keeps_the_metrics_after_its_checkpoint(run, corpus):
    """Resuming drops the metrics rows after the checkpoint (those steps are trained again) and the divergence
    record: only once the resumed run has taken a step."""
    metrics = run / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + json.dumps({"kind": "train", "step": 5, "loss": 1.0}) + "\n")
    before = files(run)
    with forward_fails(1, KeyboardInterrupt()):
        code, _, err = energy(*tiny(corpus, run, "--steps", "8"))
    assert code == 130, err
    assert files(run) == before
    code, _, err = energy(*tiny(corpus, run, "--steps", "8"))
    assert code == 0, err
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 2, 4, 6, 8]


def _data_error_as_nobody(imports: str, call: str) -> str:
    """What `call` raises as a DataError (message | hint), run by a user who is not root: root reads any file, so
    the process gives up root first (after its imports: the venv may not be readable to others)."""
    import subprocess

    code = (f"import os\nfrom pathlib import Path\n{imports}\nfrom energydsl.errors import DataError\n"
            "if os.geteuid() == 0:\n    os.setuid(65534)\n"
            f"try:\n    {call}\nexcept DataError as e:\n    print(e, '|', e.hint)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


def _folder_others_may_enter() -> Path:
    """A fresh folder of mode 755 (pytest's tmp_path is private to its user)."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="energydsl-unreadable-"))
    folder.chmod(0o755)
    return folder


def test_an_unreadable_checkpoint_says_permission_denied() -> None:
    """safetensors reports a file it may not read as "No such file"; the message now says why it cannot be read."""
    from safetensors.torch import save_file

    folder = _folder_others_may_enter()
    weights = folder / "best.safetensors"
    save_file({"w": torch.zeros(2)}, str(weights))
    weights.chmod(0)
    try:
        imports = "from energydsl.training.checkpoint import read_checkpoint\nimport safetensors.torch"
        out = _data_error_as_nobody(imports, f"read_checkpoint({str(weights)!r})")
    finally:
        shutil.rmtree(folder)
    assert f"cannot read checkpoint {weights}: Permission denied" in out and "No such file" not in out


@pytest.mark.parametrize("locked", ["folder", "record"])
def test_an_unreadable_run_directory_says_so(locked: str) -> None:
    """A run directory its user may not enter was blamed on a commit record that was not there ("cannot read the
    checkpoint commit record ...: Permission denied", hint: remove it)."""
    parent = _folder_others_may_enter()
    run = parent / "run"
    run.mkdir()
    (run / ".checkpoint.commit").write_text('{"files": []}')
    (run if locked == "folder" else run / ".checkpoint.commit").chmod(0)
    try:
        out = _data_error_as_nobody("from energydsl.training.checkpoint import checkpoint_file",
                                    f"checkpoint_file(Path({str(run / 'best.safetensors')!r}))")
    finally:
        run.chmod(0o755)
        shutil.rmtree(parent)
    if locked == "folder":
        assert f"cannot read the run directory {run}: permission denied" in out, out
    else:
        assert f"cannot read the checkpoint commit record {run / '.checkpoint.commit'}" in out, out
    assert "remove it" not in out, out


def test_a_gradient_that_is_not_finite_at_step_0_names_the_parameters_not_the_lr(run, corpus):
    """A finite loss whose first gradient is NaN (here: sqrt at 0 on the embedding) used to be reported at step 1,
    as a NaN loss, with "try a lower --lr"; no optimizer step had run yet, so no lr could help."""
    from energydsl.runtime.model import LanguageModel

    original = LanguageModel.forward
    with pytest.MonkeyPatch.context() as mp:  # the value is unchanged; the gradient of sqrt(0 * w) is NaN
        mp.setattr(LanguageModel, "forward",
                   lambda self, idx: original(self, idx) + 0 * torch.sqrt(self.wte.weight * 0).sum())
        code, _, err = energy(*tiny(corpus, run, "--fresh"))
    assert code == 1 and "training diverged at step 0: the gradient at step 0 is not finite in wte.weight" in err, err
    assert "no optimizer setting changes them" in err and "--lr" not in err, err


def test_a_plot_that_cannot_be_drawn_is_one_warning_line(corpus, tmp_path):
    """`loss.png` taken by a folder: training goes on, and the CLI says so in one `warning:` line (Python's
    format printed the library's own source line under it, and twice)."""
    run = tmp_path / "run"
    (run / "loss.png").mkdir(parents=True)
    code, _, err = energy(*tiny(corpus, run))
    assert code == 0, err
    warned = [line for line in err.splitlines() if "could not draw" in line]
    assert len(warned) == 1 and warned[0].startswith(f"warning: could not draw {run / 'loss.png'}: "), err
    assert "UserWarning" not in err and "run.plot(" not in err, err
    assert (run / "last.safetensors").is_file()
    assert not (run / ".loss.png.tmp.png").exists()  # the drawing that could not take its place is not left


def test_a_folder_where_a_checkpoint_is_staged_is_named(corpus, tmp_path):
    """`.next.last.json` taken by a folder: an internal error (IsADirectoryError, exit 70); now exit 2 naming it.
    The folder is someone's: left where it is."""
    run = tmp_path / "run"
    (run / ".next.last.json").mkdir(parents=True)
    code, _, err = energy(*tiny(corpus, run))
    assert code == 2, err
    assert f"error: {run / '.next.last.json'} is a folder, where a checkpoint is staged before it is committed" in err
    assert (run / ".next.last.json").is_dir()

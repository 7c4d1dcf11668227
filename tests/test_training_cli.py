"""The `energy train` and `energy sample` commands: flags, exit statuses, resuming, damaged runs (CPU)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import energy_in_process, strict_json, without_progress

from energydsl.training import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------ command line


def energy(*args: str, progress: bool = False) -> tuple[int, str, str]:
    """Run the `energy` CLI in this process: exit status, stdout, stderr (without the progress lines of each
    evaluation unless `progress`)."""
    result = energy_in_process(*args)
    return result.returncode, result.stdout, result.stderr if progress else without_progress(result.stderr)


def tiny_cli_run(corpus: Path, out: Path, *more: str) -> list[str]:
    return ["train", str(ROOT / "examples/models/gpt.energy"), "--data", f"chars:{corpus}", "--set", "d=16",
            "--set", "layers=1", "--set", "heads=2", "--set", "context=16", "--steps", "4", "--eval-interval",
            "2", "--eval-iters", "2", "--batch-size", "4", "--out", str(out), *more]


def trained_copy_of_gpt(corpus: Path, tmp_path: Path, monkeypatch, capsys) -> tuple[Path, list[str]]:
    """A copy of examples/models/gpt.energy in tmp_path, trained by the tiny CLI run into tmp_path/run."""
    spec = tmp_path / "gpt.energy"
    spec.write_text((ROOT / "examples/models/gpt.energy").read_text())
    args = tiny_cli_run(corpus, tmp_path / "run")
    args[1] = str(spec)
    code, _, err = energy(*args)
    assert code == 0, err
    return spec, args


def test_a_comment_edited_in_the_spec_still_resumes_and_a_real_edit_is_refused(corpus, tmp_path, monkeypatch,
                                                                                capsys):
    """The run's spec gains a comment and some spacing: the same spec, so the run resumes (it was refused as
    "a different model", with --fresh, which overwrites best.*, as the hint). A changed init is a change."""
    spec, args = trained_copy_of_gpt(corpus, tmp_path, monkeypatch, capsys)
    edited = spec.read_text().replace("\n  state", "\n\n  # a note, and some spacing\n  state    ", 1)
    edited = edited.replace("W1[k] @ z", "W1[k]@z", 1)
    spec.write_text(edited + "\n# the end\n")
    code, _, err = energy(*args, "--steps", "6")  # the later --steps wins
    assert code == 0 and "resuming" in err and "different model" not in err, err
    spec.write_text(spec.read_text().replace("normal(0, 0.02)", "normal(0, 0.05)", 1))
    code, _, err = energy(*args, "--steps", "8")
    assert code == 2 and "spec_source differs from line " in err, err  # the edit, where it is
    assert "~ normal(0, 0.02)     # W_Q\" there" in err and "~ normal(0, 0.05)     # W_Q\" now" in err, err


def test_the_first_edited_line_skips_comments_and_spacing() -> None:
    """A comment added above the real edit was named as the edit (`from line 1: "# a comment" there …`)."""
    from energydsl.training.run_dir import _first_edit

    saved = "model M(d = 8) {\n  layer = A\n  repeat 4\n}\n"
    now = "# a comment\n\nmodel M(d = 8) {  # and here\n  layer =   A\n  repeat 2\n}\n"
    assert _first_edit(saved, now) == 'from line 5: "repeat 4" there, "repeat 2" now'
    assert _first_edit(saved, now.replace("  repeat 2\n", "")) == 'from line 5: "repeat 4" there, "}" now'
    # spacing inside a line, lone \r line ends (as the parser reads them) and a comment holding a line separator
    assert _first_edit("param W[d,d]\nlet a = 1\n", "param W[d, d]\nlet a = 2\n") == \
        'from line 2: "let a = 1" there, "let a = 2" now'
    assert _first_edit("state z[d]  # c\rlet a = 1\r", "state z[d]  # c\rlet a = 2\r") == \
        'from line 2: "let a = 1" there, "let a = 2" now'
    assert _first_edit("# x\u2028y\nlet a = 1\n", "# x\u2028y\nlet a = 2\n") == \
        'from line 2: "let a = 1" there, "let a = 2" now'


def test_a_moved_spec_resumes_its_run_and_says_so(corpus, tmp_path, monkeypatch, capsys):
    """The same spec at another path (a copied or re-cloned checkout) was "a different model" (spec_path)."""
    spec, args = trained_copy_of_gpt(corpus, tmp_path, monkeypatch, capsys)
    moved = tmp_path / "elsewhere" / "gpt.energy"
    moved.parent.mkdir()
    moved.write_text(spec.read_text())
    args[1] = str(moved)
    code, _, err = energy(*args, "--steps", "6")
    assert code == 0 and "resuming" in err and f'spec_path "{spec}" → "{moved}"' in err, err
    assert json.loads((tmp_path / "run" / "last.json").read_text())["spec_path"] == str(moved)


def test_cli_divergence_is_an_outcome_not_an_internal_error(corpus, tmp_path, monkeypatch, capsys):
    args = tiny_cli_run(corpus, tmp_path, "--steps", "40", "--warmup", "40", "--lr", "30", "--eval-interval", "5")
    code, out, err = energy(*args)
    assert code == 1, err
    assert err.startswith("training diverged at step ") and err.count("\n") == 1
    assert "internal error" not in err and "report" not in err and "Traceback" not in err
    assert f"{tmp_path / 'last.safetensors'}" in err and "--lr" in err
    code, out, err = energy(*args, "--json", "--fresh")
    assert code == 1
    summary = strict_json(out)
    assert summary["diverged"] is True and summary["checkpoint"] == str(tmp_path / "last.safetensors")
    assert summary["checkpoint_step"] < summary["step"] and summary["out"] == str(tmp_path)
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        strict_json(line)
    code, out, err = energy(*args)  # the same settings again: refused, not replayed
    assert code == 2 and "same settings" in err and "Traceback" not in err
    code, out, err = energy("sample", str(tmp_path), "--tokens", "3")
    step = strict_json((tmp_path / "diverged.json").read_text())["step"]
    assert code == 0 and err.startswith(f"note: this run diverged at step {step} (") and " holds the weights from " \
        "step " in err, err  # its weights are from before the divergence: said, not silently sampled


def test_a_divergence_names_a_best_checkpoint_better_than_the_last_good_one(tmp_path):
    """A training that climbs before it diverges keeps a "good" last checkpoint (under 4x the initial loss) far
    worse than its best (an audit: last good at val loss 6.94, best 3.38): the message now names the best."""
    from energydsl.cli import _better_best

    assert _better_best(tmp_path, 6.9426) == ""  # no best.json
    (tmp_path / "best.json").write_text(json.dumps({"training": {"step": 40, "val_loss": 3.3781}}))
    note = _better_best(tmp_path, 6.9426)
    assert f"the best so far, step 40 with val loss 3.3781, is {tmp_path / 'best.safetensors'}" in note, note
    assert _better_best(tmp_path, 3.0) == "" and _better_best(tmp_path, None) == ""  # the last is the best
    (tmp_path / "best.json").write_text("{")  # damaged: the divergence line is still said, without the note
    assert _better_best(tmp_path, 6.9426) == ""


def test_a_divergence_from_weight_decay_names_weight_decay_not_lr(corpus, tmp_path, monkeypatch, capsys):
    """lr x weight decay > 1: AdamW's decay alone flips and grows the weights; the advice was always a lower --lr."""
    args = tiny_cli_run(corpus, tmp_path, "--steps", "40", "--warmup", "0", "--weight-decay", "5000",
                        "--eval-interval", "5")
    code, _, err = energy(*args)
    remedy = ("a lower --weight-decay (--lr x --weight-decay = 5, so each step's decay alone scales the weights "
              "by -4)")
    assert code == 1 and err.startswith("training diverged at step ") and f"rerun with {remedy} to resume" in err, err
    code, _, err = energy(*args)  # the same settings again: refused with the same advice
    assert code == 2 and f"hint: rerun with {remedy}, or other changed settings, to resume" in err, err
    code, _, err = energy(*args[:-4], "--weight-decay", "0.1", "--eval-interval", "5")
    assert code == 0 and "--weight-decay 5000 → 0.1" in err, err  # the advice taken: the run resumes and trains


@pytest.mark.parametrize(("lr", "weight_decay", "remedy"), [
    (1e-3, 5000, "a lower wd (lr x wd = 5, so each step's decay alone scales the weights by -4)"),
    # lowering the decay alone, as the advice said, diverged again: an lr this large is the cause
    (1e6, 0.1, "a lower lr (below 1, and below 1 / wd: lr x wd = 1e+05, so each step's decay alone scales the "
               "weights by -1e+05)"),
    (5, 0.1, "a lower lr"), (1e-3, 0.1, "a lower lr")])
def test_the_divergence_advice_names_the_setting_at_fault(lr: float, weight_decay: float, remedy: str) -> None:
    from energydsl.training.config import TrainConfig
    from energydsl.training.trainer import divergence_remedy

    config = TrainConfig(lr=lr, weight_decay=weight_decay)
    assert divergence_remedy(config, {"lr": "lr", "weight_decay": "wd"}) == remedy


@pytest.mark.parametrize("betas,says", [("0.9", "--betas takes two numbers B1,B2, got '0.9'"),
                                         ("0.9,x", "--betas takes two numbers B1,B2, got '0.9,x'"),
                                         ("1.5,0.9", "--betas must be two numbers in [0, 1), got (1.5, 0.9)")])
def test_bad_betas_are_refused_before_any_work(corpus, tmp_path, monkeypatch, capsys, betas: str, says: str):
    code, _, err = energy(*tiny_cli_run(corpus, tmp_path / "run"), "--betas", betas)
    assert code == 2 and err.startswith(f"error: {says}"), err
    assert not (tmp_path / "run").exists()


def test_betas_train_and_a_change_on_resume_is_announced_and_applied(corpus, tmp_path, monkeypatch, capsys):
    """docs/models.md named --betas among the settings a resumed run applies; the flag did not exist."""
    args = tiny_cli_run(corpus, tmp_path, "--betas", "0.8,0.95")
    code, _, err = energy(*args)
    assert code == 0, err
    assert json.loads((tmp_path / "last.json").read_text())["training"]["config"]["betas"] == [0.8, 0.95]
    code, _, err = energy(*args[:-2], "--betas", "0.7,0.9", "--steps", "6")
    assert code == 0 and "with changed settings: --steps 4 → 6, --betas 0.8,0.95 → 0.7,0.9" in err, err
    assert json.loads((tmp_path / "last.json").read_text())["training"]["config"]["betas"] == [0.7, 0.9]
    _, meta = load_checkpoint(str(tmp_path / "last.safetensors"))
    assert meta["training"]["step"] == 6


def test_the_backend_is_recorded_and_a_switch_on_resume_is_announced(corpus, tmp_path, monkeypatch, capsys):
    """Both backends hold the same parameters, so a run may resume on the other; it said nothing of the switch."""
    from energydsl import codegen

    args = tiny_cli_run(corpus, tmp_path)
    code, _, err = energy(*args)
    assert code == 0 and json.loads((tmp_path / "last.json").read_text())["backend"] == "torch", err
    # the triton backend's module, as where its kernels run (on CPU tensors they take the torch references)
    monkeypatch.setattr(codegen, "_triton_runs", lambda: True)
    code, _, err = energy(*args, "--steps", "6", "--backend", "triton")
    monkeypatch.undo()
    assert code == 0 and 'with changed settings: --steps 4 → 6, --backend "torch" → "triton"' in err, err
    assert json.loads((tmp_path / "last.json").read_text())["backend"] == "triton"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["changed"] for r in rows if r["kind"] == "resumed"] == [{"steps": [4, 6], "backend": ["torch", "triton"]}]
    sidecar = json.loads((tmp_path / "last.json").read_text())
    del sidecar["backend"]  # a checkpoint from before the backend was recorded: resumed, nothing announced
    (tmp_path / "last.json").write_text(json.dumps(sidecar))
    code, _, err = energy(*args, "--steps", "8")
    assert code == 0 and "--steps 6 → 8" in err and "--backend" not in err, err


@pytest.mark.parametrize(("signum", "status", "as_json"), [(signal.SIGINT, 130, False), (signal.SIGTERM, 143, True)])
def test_cli_ctrl_c_saves_the_run_and_exits_130(corpus, tmp_path, signum, status, as_json):
    """Ctrl-C, and SIGTERM (a scheduler's pre-emption): the run is saved first (SIGTERM killed it unsaved)."""
    import subprocess
    import time

    args = tiny_cli_run(corpus, tmp_path, "--steps", "1000000", "--eval-interval", "1000000",
                        *(("--json",) if as_json else ()))
    proc = subprocess.Popen([sys.executable, "-m", "energydsl.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while '"train"' not in (metrics.read_text() if metrics.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.1)  # wait until it is training (step 0 evaluated, a few steps logged)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == status, err
    err = without_progress(err)
    step = json.loads((tmp_path / "last.json").read_text())["training"]["step"]
    assert step > 0 and err.strip() == (f"interrupted at step {step}: saved {tmp_path / 'last.safetensors'}; "
                                        "rerun the same command to resume")
    if as_json:  # an outcome on stdout, as a divergence's
        assert strict_json(out) == {"interrupted": True, "step": step, "checkpoint": str(tmp_path / "last.safetensors"),
                                    "out": str(tmp_path)}


@pytest.mark.parametrize(("flags", "message"), [
    (("--steps", "0"), "--steps must be at least 1, got 0"),
    (("--batch-size", "0"), "--batch-size must be at least 1, got 0"),
    (("--warmup", "-3"), "--warmup must not be negative, got -3"),
    (("--eval-iters", "0"), "--eval-iters must be at least 1, got 0"),
    (("--lr", "0"), "--lr must be above 0, got 0.0"),
    (("--lr", "inf"), "--lr must be a finite number, got inf"),
    (("--seed", "99999999999999999999"), "--seed must be a whole number in [0, 2**64), got 99999999999999999999"),
    (("--seed", "-1"), "--seed must be a whole number in [0, 2**64), got -1"),
    (("--min-lr", "1"), "--min-lr must be in [0, --lr], got 1.0 with --lr 0.001"),
    (("--weight-decay", "-1"), "--weight-decay must not be negative, got -1.0"),
    (("--grad-clip", "nan"), "--grad-clip must be a number, got nan"),
    (("--dtype", "fp8"), "unknown --dtype 'fp8'"),
    (("--dtype", "float16"), "--dtype float16 needs CUDA"),
    (("--out", ""), "--out is empty"),  # it fell back to runs/<model> silently
])
def test_cli_training_flags_are_named_in_errors(flags, message, corpus, tmp_path, monkeypatch, capsys):
    code, _, err = energy(*tiny_cli_run(corpus, tmp_path / "run", *flags))
    assert code == 2 and err.strip().splitlines()[0] == f"error: {message}"  # a hint may follow
    assert not (tmp_path / "run").exists()  # refused before anything was built or written


@pytest.mark.parametrize("flags, says", [
    (("--data", "no-such-dataset"), "no-such-dataset"),
    (("--block-size", "99"), "--block-size 99 is longer than the model's context 16"),
    (("--set", "vocab=10"), "tokens but the model's vocab is 10"),
])
def test_a_run_refused_for_its_data_leaves_no_empty_out_folders(flags, says, corpus, tmp_path):
    """The --out tree was made before the data, block and vocab were checked: a refused run left it behind."""
    args = tiny_cli_run(corpus, tmp_path / "new" / "deep" / "run", *flags)
    if flags[0] == "--data":
        args[args.index("--data") + 1] = flags[1]
        args = args[:-2]
    code, _, err = energy(*args)
    assert code == 2 and says in err, err
    assert not (tmp_path / "new").exists()


def test_cli_resuming_with_changed_settings(corpus, tmp_path, monkeypatch, capsys):
    code, _, err = energy(*tiny_cli_run(corpus, tmp_path))
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    code, _, err = energy(*tiny_cli_run(corpus, tmp_path, "--steps", "6", "--seed", "5",
                                                               "--batch-size", "8", "--lr", "0.01"))
    assert code == 2 and "Traceback" not in err
    assert err.startswith(f"error: cannot resume the run in {tmp_path} (step 4) with --batch-size 8, --seed 5: it "
                          "was trained with --batch-size 4, --seed 1337 (--batch-size: the evaluation batches would "
                          "change, and best.* would be chosen by losses that do not compare; --seed: a resumed run "
                          "continues its saved random state, so a new seed would be ignored)\n")
    assert "hint: pass --batch-size 4, --seed 1337 to resume it, or --fresh" in err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    code, _, err = energy(*tiny_cli_run(corpus, tmp_path, "--steps", "6", "--lr", "0.01"))
    # --warmup stays 30 (the default): the schedule clamps it to the steps, the report names only what was passed
    assert code == 0 and err == (f"resuming {tmp_path} at step 4 with changed settings: --steps 4 → 6, "
                                 "--lr 0.001 → 0.01, --min-lr 0.0001 → 0.001\n")


def test_a_triton_run_that_fell_back_records_the_torch_backend_it_ran(corpus, tmp_path, monkeypatch, capsys):
    """Without CUDA or the interpreter, --backend triton trains on torch (with a notice); the checkpoint recorded
    "triton", so a plain resume announced `--backend "triton" → "torch"`, a switch that never happened."""
    from energydsl import codegen, kernels

    monkeypatch.setattr(kernels, "use_triton", lambda device=None: False)  # as on a machine without CUDA
    monkeypatch.setattr(codegen, "_NOTICE_SHOWN", False)
    code, _, err = energy(*tiny_cli_run(corpus, tmp_path, "--backend", "triton"))
    assert code == 0 and err.count("the triton backend falls back to torch") == 1, err  # said once
    assert json.loads((tmp_path / "last.json").read_text())["backend"] == "torch"
    code, _, err = energy(*tiny_cli_run(corpus, tmp_path, "--steps", "6"))
    assert code == 0 and err == f"resuming {tmp_path} at step 4 with changed settings: --steps 4 → 6\n", err


def test_steps_the_run_has_already_reached_train_nothing_and_say_so(corpus, tmp_path, monkeypatch, capsys):
    """--steps at or below the checkpoint's step trains nothing: it was announced as changed settings (`--steps
    6 → 4`), as if the run went on with them. Exit 0 and the run's summary, as rerunning a finished run gives."""
    code, _, err = energy(*tiny_cli_run(corpus, tmp_path, "--steps", "6"))
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    code, out, err = energy(*tiny_cli_run(corpus, tmp_path, "--json"))  # --steps 4
    assert code == 0 and err == (f"the run in {tmp_path} is already at step 6, past --steps 4: nothing to train; "
                                 "pass a --steps above 6 to train it further\n"), err
    summary = strict_json(out)
    assert summary["steps"] == 6 and summary["resumed_from"] == 6
    code, _, err = energy(*tiny_cli_run(corpus, tmp_path, "--steps", "6", "--lr", "0.01"))
    assert code == 0 and err == (f"the run in {tmp_path} is already at step 6, the --steps 6 asked for: nothing to "
                                 "train (not applied: --lr 0.001 → 0.01, --min-lr 0.0001 → 0.001); pass a --steps "
                                 "above 6 to train it further\n"), err
    code, _, err = energy(*tiny_cli_run(corpus, tmp_path, "--steps", "6"))
    assert code == 0 and err == "", err  # the same command again: nothing changed, nothing to say
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_cli_refuses_to_overwrite_another_models_run(corpus, tmp_path, monkeypatch, capsys):
    code, _, err = energy(*tiny_cli_run(corpus, tmp_path))
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    code, out, err = energy(*tiny_cli_run(corpus, tmp_path, "--set", "d=8"))
    assert code == 2 and "Traceback" not in err
    assert str(tmp_path) in err and "dims.d is 16 there, 8 now" in err and "--fresh" in err and "--out" in err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    code, _, err = energy(*tiny_cli_run(corpus, tmp_path, "--set", "d=8", "--fresh"))
    assert code == 0, err
    dims = load_checkpoint(tmp_path)[1]["dims"]
    assert dims["d"] == 8 and all(type(v) is int for v in dims.values()), dims  # as written: 8, not 8.0


def test_cli_seed_fixes_the_initial_weights(corpus, tmp_path, monkeypatch, capsys):
    def metrics(name: str, seed: str) -> str:
        code, _, err = energy(*tiny_cli_run(corpus, tmp_path / name, "--seed", seed))
        assert code == 0, err
        return (tmp_path / name / "metrics.jsonl").read_text()

    first = metrics("a", "1")
    torch.rand(10)  # whatever the process's RNG did in between
    assert metrics("b", "1") == first
    assert metrics("c", "2") != first


def test_sample_uses_the_spec_the_run_was_trained_with(corpus, tmp_path, monkeypatch, capsys):
    """Editing the spec file after training (here the MLP width) must not break sampling: the checkpoint
    carries the spec's text, and `sample` builds the model from that."""
    spec, args = trained_copy_of_gpt(corpus, tmp_path, monkeypatch, capsys)
    text = spec.read_text()
    assert "4 * d" in text
    spec.write_text(text.replace("4 * d", "2 * d"))
    code, out, err = energy("sample", str(tmp_path / "run"), "--tokens", "5", "--prompt", "the")
    assert code == 0, err
    assert out.startswith("the") and len(out.rstrip("\n")) == 8
    # a tiny temperature is greedy in the limit, not NaN probabilities (exit 70); a seed torch cannot take is exit 2
    run = str(tmp_path / "run")
    code, out, err = energy("sample", run, "--tokens", "5", "--prompt", "the", "--temperature",
                            "1e-300")
    greedy = energy("sample", run, "--tokens", "5", "--prompt", "the", "--temperature", "1e-6")
    assert code == 0 and out == greedy[1], err
    zero = energy("sample", run, "--tokens", "5", "--prompt", "the", "--temperature", "0")
    assert zero[0] == 0 and zero[1] == out, zero[2]  # 0 is greedy, as sample(temperature=0) in Python
    code, _, err = energy("sample", run, "--seed", str(2**64))
    assert code == 2 and "--seed must be in [0, 2**64)" in err


def test_sample_reads_imports_next_to_the_spec_and_refuses_a_changed_model(corpus, tmp_path, monkeypatch, capsys):
    """The trained spec's text travels in the checkpoint; the files it imports are read as they are now, next to
    the spec (not the working directory), and a model whose equations changed since is refused, not sampled."""
    text = (ROOT / "examples/models/gpt.energy").read_text()
    split = text.index("model GPT")
    (tmp_path / "parts.energy").write_text(text[:split])
    main = tmp_path / "main.energy"
    main.write_text('import "parts.energy"\n' + text[split:])
    args = tiny_cli_run(corpus, tmp_path / "run")
    args[1] = str(main)
    code, _, err = energy(*args)
    assert code == 0, err
    main.write_text(main.read_text() + "# edited after training\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, out, err = energy("sample", str(tmp_path / "run"), "--tokens", "3", "--prompt", "a")
    assert code == 0 and out.startswith("a"), err
    parts = tmp_path / "parts.energy"
    parts.write_text(parts.read_text().replace("integral(gelu)", "integral(silu)"))  # same shapes, another model
    code, out, err = energy("sample", str(tmp_path / "run"), "--tokens", "3")
    assert code == 2 and "is not the one trained, its equations changed" in err, err
    code, _, err = energy(*args)  # resuming it: the spec's text is the same, an import not
    assert code == 2 and "(the spec's text is the same: a file it imports was edited" in err, err
    # an import broken or gone was called damaged metadata, without its location, and sent the user to the other
    # checkpoint (which fails alike) or to train again
    good = parts.read_text()
    parts.write_text(good + "oops\n")
    code, _, err = energy("sample", str(tmp_path / "run"), "--tokens", "3")
    line = good.count("\n") + 1
    assert code == 2 and f"{parts}:{line}:1: error: unexpected `oops`\n  oops\n  ^^^^\n" in err, err
    assert "damaged" not in err and f"the spec kept in {tmp_path / 'run'} imports this file" in err, err
    parts.rename(tmp_path / "moved.energy")
    code, _, err = energy("sample", str(tmp_path / "run"), "--tokens", "3")
    assert code == 2 and f"{tmp_path / 'run'}'s spec_source:1:1: error: no such file: {parts}" in err, err
    assert "damaged" not in err and "restore the spec files as they were" in err, err
    parts.write_text(good)
    # a checkpoint without an equation hash (written by hand, or by an older version): weights that no longer
    # fit the model its spec builds are exit 2, not an internal error
    parts.write_text(parts.read_text().replace("integral(silu)", "integral(gelu)")
                     .replace("dh = d / heads", "dh = 2 * d / heads"))
    for sidecar in (tmp_path / "run").glob("*.json"):
        record = json.loads(sidecar.read_text())
        record.pop("equation_hash", None)
        sidecar.write_text(json.dumps(record))
    code, out, err = energy("sample", str(tmp_path / "run"), "--tokens", "3")
    assert code == 2 and "its weights do not fit the model its spec builds now" in err, err


def test_a_full_disk_is_exit_2_and_keeps_what_was_saved(corpus, tmp_path, monkeypatch, capsys):
    """No space left while a checkpoint is written: the machine's state, not an internal error (exit 70)."""
    import errno

    from energydsl.training import checkpoint

    code, _, err = energy(*tiny_cli_run(corpus, tmp_path))
    assert code == 0, err

    from safetensors import SafetensorError

    def full(*args, **kwargs):  # what safetensors raises on a full disk: its own type, the errno in the text
        raise SafetensorError(f"Error while serializing: I/O error: No space left on device (os error {errno.ENOSPC})")

    monkeypatch.setattr(checkpoint, "save_file", full)
    code, _, err = energy(*tiny_cli_run(corpus, tmp_path, "--steps", "8"))
    assert code == 2 and f"\nerror: cannot write {tmp_path}/" in err and ".safetensors: No space left on device" in err
    assert "hint: files saved before are as they were" in err and "internal error" not in err, err
    assert json.loads((tmp_path / "last.json").read_text())["training"]["step"] == 4  # the last save is intact


def test_a_fresh_run_killed_after_its_first_commit_keeps_none_of_the_old_runs_metrics(corpus, tmp_path):
    """`--fresh` wrote its metrics only after its first checkpoint's commit: a kill between them left the old
    run's metrics (and divergence record) beside the new checkpoint, and the resume kept the old step-0 row.
    The metrics and the record's removal are now in the commit itself."""
    import subprocess
    import sys

    code, _, err = energy(*tiny_cli_run(corpus, tmp_path, "--set", "d=8"))
    assert code == 0, err
    (tmp_path / "diverged.json").write_text('{"step": 3}')  # as a diverged attempt of the old run leaves it
    killer = ("import os, sys\nimport energydsl.training.checkpoint as c\nfinish, calls = c.finish_commit, []\n"
              "def killed(d):\n    calls.append(d)\n    if len(calls) == 2:\n        os._exit(9)  # after the commit\n"
              "    finish(d)\nc.finish_commit = killed\nfrom energydsl.__main__ import main\n"
              "sys.argv = ['energy'] + sys.argv[1:]\nmain()\n")
    args = tiny_cli_run(corpus, tmp_path, "--fresh", "--steps", "6")
    proc = subprocess.run([sys.executable, "-c", killer, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 9, proc.stderr
    code, _, err = energy(*tiny_cli_run(corpus, tmp_path, "--steps", "6"))
    assert code == 0 and "resuming" in err, err
    resumed = (tmp_path / "metrics.jsonl").read_text()
    assert not (tmp_path / "diverged.json").exists()
    fresh = tmp_path / "fresh"
    code, _, err = energy(*tiny_cli_run(corpus, fresh, "--steps", "6"))
    assert code == 0, err
    assert [json.loads(r)["val_loss"] for r in resumed.splitlines() if json.loads(r).get("kind") == "eval"] == \
        [json.loads(r)["val_loss"] for r in (fresh / "metrics.jsonl").read_text().splitlines()
         if json.loads(r).get("kind") == "eval"]


def test_a_checkpoint_that_is_a_directory_is_named_so(corpus, tmp_path):
    """A `last.safetensors` that is a folder was taken for a run directory: "no checkpoint in
    run/last.safetensors (expected best.safetensors)"."""
    code, _, err = energy(*tiny_cli_run(corpus, tmp_path))
    assert code == 0, err
    (tmp_path / "last.safetensors").unlink()
    (tmp_path / "last.safetensors").mkdir()
    code, _, err = energy(*tiny_cli_run(corpus, tmp_path, "--steps", "8"))
    assert code == 2 and f"{tmp_path}/last.safetensors is a directory, not a checkpoint file" in err, err


def test_a_full_disk_while_writing_a_record_names_the_file(tmp_path, monkeypatch):
    """A write (not the open) that fails carries no file name: a full disk in the commit record or a sidecar
    read `error: cannot write: No space left on device`, naming nothing."""
    import errno
    import os
    from pathlib import Path

    from energydsl.training import checkpoint

    def full(self, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError) as e:
        checkpoint._write_text(tmp_path / ".next.last.json", "{}")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / ".next.last.json")


@pytest.mark.parametrize("failure", ["full disk in the optimizer state", "read-only run folder"])
def test_a_failed_save_is_exit_2_and_leaves_no_staged_files(failure, corpus, tmp_path, monkeypatch, capsys):
    """torch.save on a full disk raises RuntimeError ("unexpected pos"), with the OSError only as its context, and
    a folder made read-only mid-run a PermissionError: both were internal errors (exit 70), and the half-written
    `.next.*` files of the save stayed behind, taking the room a rerun needs."""
    import errno
    import os

    from energydsl.training import checkpoint

    code, _, err = energy(*tiny_cli_run(corpus, tmp_path))
    assert code == 0, err
    if failure == "read-only run folder":
        def denied(*args, **kwargs):
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), str(tmp_path / ".next.last.safetensors"))

        monkeypatch.setattr(checkpoint, "save_file", denied)
        expected = f"error: cannot access {tmp_path}/.next.last.safetensors: Operation not permitted"
    else:
        def full(obj, f):  # as torch.save fails on a full disk: part written, the OSError as the context
            f.write(b"partial")
            try:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None

        monkeypatch.setattr(checkpoint.torch, "save", full)
        expected = f"error: cannot write {tmp_path}/.next.last.optim.pt: No space left on device"
    code, _, err = energy(*tiny_cli_run(corpus, tmp_path, "--steps", "8"))
    assert code == 2 and expected in err and "hint: files saved before are as they were" in err, err
    assert not list(tmp_path.glob(".next.*")), list(tmp_path.glob(".next.*"))
    assert json.loads((tmp_path / "last.json").read_text())["training"]["step"] == 4  # the last save is intact


@pytest.mark.parametrize("flag,message", [
    (["--tokens", "-5"], "--tokens must be at least 0, got -5"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0, got -1"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0, got inf"),
    (["--top-k", "0"], "--top-k must be at least 1, got 0"),
])
def test_sample_flags_are_checked(flag, message, monkeypatch, capsys, tmp_path):
    """One message named every sampling flag, whichever was wrong."""
    code, _, err = energy("sample", str(tmp_path), *flag)
    assert code == 2 and f"error: {message}\nhint: " in err, err


def test_sample_streams_and_a_bytes_model_takes_a_prompt_that_is_not_utf8(corpus, tmp_path, monkeypatch, capsys):
    """A prompt that is not UTF-8 (argv gives Python lone surrogates) was an internal error on a bytes model; every
    token was printed only at the end. The output stays UTF-8 text (a byte that is not prints as U+FFFD)."""
    import itertools

    from energydsl.training.sampling import stream
    from energydsl.training.trained import load_trained

    data = tmp_path / "bytes.txt"
    data.write_bytes(Path(corpus).read_bytes() + b"\xff\xfe" * 50)
    args = tiny_cli_run(corpus, tmp_path / "run")
    args[args.index("--data") + 1] = f"bytes:{data}"
    code, _, err = energy(*args, "--set", "vocab=256")
    assert code == 0, err
    proc = subprocess.run([sys.executable, "-m", "energydsl.cli", "sample", str(tmp_path / "run"), "--prompt",
                           b"ab\xff", "--tokens", "7"], capture_output=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and b"internal error" not in proc.stderr, proc.stderr
    text = proc.stdout.decode("utf-8")  # strict: the output is text
    assert text.startswith("ab\ufffd") and text.endswith("\n")
    ascii_out = subprocess.run([sys.executable, "-m", "energydsl.cli", "sample", str(tmp_path / "run"), "--prompt",
                                b"ab\xff", "--tokens", "7"], capture_output=True, timeout=300, cwd=ROOT,
                               env={**os.environ, "PYTHONIOENCODING": "ascii"})
    message = ascii_out.stderr.decode()  # was "internal error ... UnicodeEncodeError", exit 70
    assert ascii_out.returncode == 2 and "error: the output encoding (ascii) cannot write '\\ufffd'" in message
    assert "hint: set PYTHONIOENCODING=utf-8" in message and ascii_out.stdout == b"", message
    prompt = b"ab\xff".decode("utf-8", errors="surrogateescape")  # as Python read it from argv
    model, codec, meta = load_trained(tmp_path / "run")
    _, ids, new = stream(model, codec, prompt, 10**12, 0.8, None, torch.Generator().manual_seed(0), metadata=meta)
    assert ids == [97, 98, 255]
    assert len(list(itertools.islice(new, 7))) == 7  # drawn one at a time: 10**12 asked, 7 taken


def test_sample_shows_no_start_token_for_a_prompt_of_spaces(tmp_path, monkeypatch, capsys):
    """A words codec encodes " " to no tokens, so sampling starts from its start token: that was printed as the
    prompt (`<pad> 8 8 8`), where "" prints only what was drawn."""
    code, _, err = energy("train", str(ROOT / "examples/models/gpt.energy"), "--data", "listops", "--set", "d=16",
                          "--set", "layers=1", "--set", "heads=2", "--set", "context=65", "--steps", "2",
                          "--eval-interval", "2", "--eval-iters", "1", "--batch-size", "2", "--out",
                          str(tmp_path / "run"))
    assert code == 0, err
    outputs = []
    for prompt in ("", " ", "   "):
        code, out, err = energy("sample", str(tmp_path / "run"), "--prompt", prompt, "--tokens", "3",
                                "--temperature", "0")
        assert code == 0, err
        outputs.append(out)
    assert len(outputs[0].split()) == 3 and outputs == [outputs[0]] * 3, outputs


@pytest.mark.parametrize("damage", ["truncated weights", "steps disagree", "sidecar missing", "last missing"])
def test_a_damaged_last_checkpoint_is_refused_and_best_kept(damage, corpus, tmp_path, monkeypatch, capsys):
    """Starting afresh over a run whose `last` cannot be resumed would overwrite its `best`: refuse instead."""
    code, _, err = energy(*tiny_cli_run(corpus, tmp_path))
    assert code == 0, err
    best = (tmp_path / "best.safetensors").read_bytes()
    if damage == "truncated weights":
        weights = tmp_path / "last.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "sidecar missing":  # a fresh start would overwrite best.*, and take another model's
        (tmp_path / "last.json").unlink()
    elif damage == "last missing":
        for name in ("last.json", "last.safetensors", "last.optim.pt"):
            (tmp_path / name).unlink()
    else:  # a kill between the weights and the sidecar: the sidecar still names the previous evaluation
        sidecar = json.loads((tmp_path / "last.json").read_text())
        sidecar["training"]["step"] -= 2
        (tmp_path / "last.json").write_text(json.dumps(sidecar))
    code, _, err = energy(*tiny_cli_run(corpus, tmp_path, "--steps", "8"))
    assert code == 2 and "cannot resume" in err and "--fresh" in err, err
    assert (tmp_path / "best.safetensors").read_bytes() == best


def _has_cxx() -> bool:
    import shutil

    return any(shutil.which(c) for c in ("g++", "clang++", "c++"))


@pytest.mark.slow
@pytest.mark.skipif(not _has_cxx(), reason="Inductor compiles C++ on the CPU")
def test_cli_compile_trains_as_eager_and_resumes_without_it(corpus, tmp_path, monkeypatch, capsys):
    """`--compile` runs the step and the evaluations through torch.compile (Inductor, real C++ on the CPU): the
    losses are eager's, the checkpoint is the model's own state dict (no `_orig_mod.` prefixes), and the run
    resumes without the flag, saying what changed."""
    torch._dynamo.reset()
    runs = {}
    for name, more in (("eager", ()), ("compiled", ("--compile",))):
        code, out, err = energy(*tiny_cli_run(corpus, tmp_path / name, "--json", *more))
        assert code == 0, err
        runs[name] = json.loads(out)
    assert runs["compiled"]["best_val_loss"] == pytest.approx(runs["eager"]["best_val_loss"], rel=1e-4)
    eager, compiled = (load_checkpoint(tmp_path / name)[0] for name in ("eager", "compiled"))
    assert compiled.keys() == eager.keys()
    assert all(torch.allclose(compiled[k], eager[k], rtol=1e-3, atol=1e-5) for k in eager)
    code, _, err = energy(*tiny_cli_run(corpus, tmp_path / "compiled", "--steps", "6"))
    assert code == 0 and err == (f"resuming {tmp_path / 'compiled'} at step 4 with changed settings: --steps 4 → 6, "
                                 "--compile true → false\n")


def test_cli_compile_failure_is_exit_2_and_names_the_flag(corpus, tmp_path):
    """Without a working C++ compiler (CXX points nowhere; a fresh Inductor cache, so nothing compiled is reused)
    `--compile` fails as bad input, before the run directory holds anything but its lock."""
    import os
    import subprocess

    env = dict(os.environ, CXX=str(tmp_path / "no-such-g++"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    proc = subprocess.run([sys.executable, "-m", "energydsl", *tiny_cli_run(corpus, tmp_path / "run", "--compile")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: --compile: torch.compile failed: ") and "no-such-g++" in proc.stderr
    assert "hint: train without --compile" in proc.stderr and "Traceback" not in proc.stderr
    assert not list((tmp_path / "run").glob("*.safetensors"))


def test_without_a_terminal_each_evaluation_prints_one_line(corpus, tmp_path, monkeypatch, capsys):
    """The progress bar shows only on a terminal; a log file got nothing until the summary. Now one line per
    evaluation; `--json` still prints only the summary."""
    code, out, err = energy(*tiny_cli_run(corpus, tmp_path, "--steps", "4"), progress=True)
    assert code == 0, err
    lines = err.splitlines()
    assert [line.split(":")[0] for line in lines] == ["step 0/4", "step 2/4", "step 4/4"], err
    assert re.fullmatch(r"step 0/4: train loss \d+\.\d{4}, val loss \d+\.\d{4} \(best\)", lines[0]), lines[0]
    code, out, err = energy(*tiny_cli_run(corpus, tmp_path / "json", "--steps", "4", "--json"))
    assert code == 0 and err == "", err


def test_the_same_data_spelled_otherwise_resumes_and_other_dims_are_not_blamed_on_imports(corpus, tmp_path,
                                                                                          monkeypatch, capsys):
    """`chars:./a.txt` after `chars:a.txt` (or from another folder) was "a different dataset", so a run could not be
    resumed from elsewhere; other dims were explained as "a file it imports was edited"."""
    (tmp_path / "a.txt").write_bytes(corpus.read_bytes())
    monkeypatch.chdir(tmp_path)
    args = tiny_cli_run(Path("a.txt"), Path("run"))
    code, _, err = energy(*args)
    assert code == 0, err
    sub = tmp_path / "sub"
    sub.mkdir()
    monkeypatch.chdir(sub)
    again = tiny_cli_run(Path("../a.txt"), Path("../run"), "--steps", "6")
    code, _, err = energy(*again)
    assert code == 0 and "resuming" in err and "different" not in err, err
    (tmp_path / "b.txt").write_text(corpus.read_text()[::-1])  # the same characters, other text: other data
    code, _, err = energy(*tiny_cli_run(Path("../b.txt"), Path("../run"), "--steps", "8"))
    assert code == 2 and 'the dataset is "chars:../a.txt" there, "chars:../b.txt" now' in err, err
    wider = [a if a != "d=16" else "d=32" for a in again]
    code, _, err = energy(*wider[:-2], "--steps", "8")
    assert code == 2 and "equation_hash" in err and "a file it imports was edited" not in err, err


def test_brackets_in_a_run_folder_are_printed_as_written(corpus, tmp_path, monkeypatch, capsys):
    """rich read `runs/a[/]b` as markup: the run trained and saved, then its summary line exited 70."""
    out = tmp_path / "a[/]b[red]"
    code, stdout, err = energy(*tiny_cli_run(corpus, out))
    assert code == 0, err
    assert f"checkpoints in {out}" in stdout, stdout

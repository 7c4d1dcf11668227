"""Bad input found by an audit: huge sizes, deep models, misplaced error locations, a broken stdout pipe.

Each is a user error (exit 2, a located message, no traceback), a quick answer, or a quiet exit: never exit 70
with pages of C++ frames, a hang, or a status that reads as an outcome."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_main

from energydsl import cli, load, sizing
from energydsl.errors import SpecError

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "examples/models"
GPT = str(MODELS / "gpt.energy")
MHA = str(ROOT / "examples/intrinsic-optimizers/mha.energy")


def energy(*args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "energydsl.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, **kwargs)


# ----------------------------------------------------------------------------- huge sizes


@pytest.mark.parametrize("args,says", [
    (["info", GPT, "--set", "d=1e30"],
     "`d` (as set for model `GPT`) must be a whole number from 1 to 2**60 - 1, got 1e+30"),
    (["info", GPT, "--set", "vocab=1e30"],
     "`vocab` (as set for model `GPT`) must be a whole number from 1 to 2**60 - 1"),
    (["info", GPT, "--set", "context=1e17"], "the position embedding [100000000000000000, 128] has 1.28e+19 entries"),
    (["info", GPT, "--set", "d=4e9"], "a param of shape [heads, d/heads, d] has 1.6e+19 entries (with d=4000000000"),
    (["check", MHA, "--set", "d=1e30"], "dim `dh` = d/heads = 5e+29 is too large (with d=1e+30"),
    (["check", str(ROOT / "examples/cem/mlp.energy"), "--set", "dv=1e30"],
     "this size dv = 1e+30 is too large (with "),  # it read `this size = dv = 1e+30`
    (["derive", MHA, "--set", "d=4e9"], "has 1.6e+19 entries"),
    (["train", GPT, "--data", "shakespeare_char", "--set", "context=1e30"],
     "`context` (as set for model `GPT`) must be a whole number"),
])
def test_a_size_too_large_for_a_tensor_is_exit_2_naming_it(monkeypatch, capsys, tmp_path, args, says) -> None:
    if args[0] == "train":
        args = [*args, "--out", str(tmp_path / "run")]
    code, _, err = run_main(*args)
    assert code == 2, err
    assert says in err and "2**60 - 1" in err and "internal error" not in err and "frame #" not in err, err
    assert err.splitlines()[0].count(":") >= 3  # file:line:col: error: ...


def test_a_size_that_is_not_whole_is_quoted_as_given(capsys) -> None:
    """`--set d=128.000001` was refused with "must be a whole number ≥ 1, got 128": rounded, a contradiction."""
    code, _, err = run_main("info", GPT, "--set", "d=128.000001")
    assert code == 2 and "`d` (as set for model `GPT`) must be a whole number ≥ 1, got 128.000001\n" in err, err


@pytest.mark.parametrize("command,value,says", [
    ("derive", "1e400", "--set 'd=1e400': `1e400` is too large for a float (at most about 1.8e308)"),
    ("check", "nan", "--set 'd=nan': `nan` is not a finite number"),
    ("info", "-inf", "--set 'd=-inf': `-inf` is not a finite number"),
])
def test_a_set_value_that_is_no_finite_number_blames_the_flag(capsys, command: str, value: str, says: str) -> None:
    """It was blamed on the spec, as `dim d ... must be a finite number, got inf` under its header."""
    code, _, err = run_main(command, MHA if command != "info" else GPT, "--set", f"d={value}")
    assert code == 2 and err.startswith(f"error: {says}"), err


@pytest.mark.parametrize("flags,says", [
    (["--batch-size", "99999999999999999999"], "--batch-size must be at most 2**60 - 1, got 99999999999999999999"),
    (["--batch-size", "2000000000000", "--block-size", "2000000000"], "--batch-size x --block-size = 4000000"),
])
def test_a_batch_too_large_for_a_tensor_is_exit_2_naming_the_flags(monkeypatch, capsys, tmp_path, flags, says):
    """A batch is a (batch size, block size) tensor of token ids: past torch's 64-bit index it was exit 70."""
    code, _, err = run_main("train", GPT, "--data", "shakespeare_char", *flags,
                            "--out", str(tmp_path / "run"))
    assert code == 2, err
    assert says in err and "internal error" not in err, err


def test_check_refuses_an_instance_too_large_to_draw(monkeypatch, capsys) -> None:
    code, _, err = run_main("check", MHA, "--set", "d=1e9")
    assert code == 2, err
    assert "mha.energy:9:8: error: a random instance of `MHA` at d=1e+09, heads=2, eta=0.5 is too large" in err, err
    assert "`W1` [2, 500000000, 1000000000] alone has 1,000,000,000,000,000,000 entries" in err


def test_check_json_reports_an_instance_too_large_to_draw_as_its_files_row(monkeypatch, capsys) -> None:
    """--json: one object per file, also when the refusal comes from drawing the check instance."""
    code, out, err = run_main("check", "--json", MHA, "--set", "d=1e9")
    assert code == 2, err
    row = json.loads(out.strip().splitlines()[-1])
    assert row["ok"] is False and "is too large" in row["error"], row


def test_an_internal_error_is_one_line(monkeypatch, capsys) -> None:
    def crash(*args, **kwargs):
        raise RuntimeError("something broke\nException raised from f at x.cpp:1\nframe #0: 0x1234")

    monkeypatch.setattr(cli, "sized_model", crash)  # what `energy info` calls first
    code, _, err = run_main("info", GPT)
    assert code == 70
    assert err.strip() == (f"internal error while processing {GPT}: RuntimeError: something broke (please report "
                           "this with the spec)")


# ----------------------------------------------------------------------------- deep models


@pytest.mark.parametrize("model,dims", [
    ("gpt.energy", {"layers": 3}),
    ("momentum-gpt.energy", {"layers": 3}),  # learned hyper-parameters across layers: counted once
    ("rmt.energy", {"layers": 3}),  # matrix stream, factorised tables
    ("nrgpt.energy", {"layers": 3}),  # one shared block
])
def test_info_counts_every_layer_from_the_first(model: str, dims: dict) -> None:
    import torch

    spec = load(MODELS / model)
    with torch.device("meta"):
        full = spec.model(**dims).info()
    shallow, layers = sizing.sized_model(spec, None, "torch", dims)
    assert len(shallow.layers) == 1 and layers == 3
    assert shallow.info(layers=layers) == full


def test_info_and_train_of_a_billion_layers_answer_at_once(tmp_path: Path) -> None:
    """`energy info` used to build every layer (hours); `energy train` built them before refusing the size."""
    t0 = time.perf_counter()
    proc = energy("info", GPT, "--json", "--set", "layers=1e9", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert '"params": 196864000016640,' in proc.stdout and '"layers": 1000000000,' in proc.stdout
    proc = energy("train", GPT, "--data", "shakespeare_char", "--set", "layers=1e9", "--out", str(tmp_path / "r"),
                  timeout=60)
    assert proc.returncode == 2 and "does not fit in host memory here: 196,864,000,016,640 parameters" in proc.stderr
    assert time.perf_counter() - t0 < 60


# ----------------------------------------------------------------------------- error locations

UNDEFINED = "energy A(d = 4) {\n  state z[d]\n  # a comment\n  global F = z . q\n  optimizer gd(eta = 1)\n}\n"


def spec_error(path: Path) -> SpecError:
    with pytest.raises(SpecError) as e:
        load(path).derive()
    return e.value


@pytest.mark.parametrize("newline", ["\r", "\r\n", "\n"])
def test_an_error_in_a_file_with_any_line_ends_is_at_its_line(tmp_path: Path, newline: str) -> None:
    path = tmp_path / "a.energy"
    path.write_bytes(UNDEFINED.replace("\n", newline).encode())
    e = spec_error(path)
    assert str(e.span) == f"{path}:4:18" and "undefined name `q`" in e.message
    assert e.render().splitlines()[1:3] == ["    global F = z . q", "                   ^"]


@pytest.mark.parametrize(("tail", "named", "shown"), [("\x00", "NUL", "\u2400"),
                                                    ("\x1b[31m\x07", "U+001B", "\u241b[31m\u2407")])
def test_control_characters_are_reported_where_they_are_and_quoted_as_their_pictures(
        tmp_path: Path, tail: str, named: str, shown: str) -> None:
    """A binary file read as a spec echoed ESC and the like to the terminal, which acts on them."""
    path = tmp_path / "binary.energy"
    path.write_bytes(UNDEFINED.replace("q\n", f"z{tail}\n").encode())
    e = spec_error(path)
    assert str(e.span) == f"{path}:4:19" and named in e.message
    assert e.render().splitlines()[1:3] == [f"    global F = z . z{shown}", "                    ^"]
    assert not any(c in e.render() for c in tail if ord(c) < 0x20)


def test_a_byte_that_is_not_utf8_is_reported_at_its_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "latin1.energy"
    path.write_bytes(UNDEFINED.replace("a comment", "café").encode("latin-1"))
    e = spec_error(path)
    assert str(e.span) == f"{path}:3:8" and "not UTF-8 text: byte 0xE9" in e.message
    assert e.render().splitlines()[1:3] == ["    # caf\ufffd", "         ^"]
    (tmp_path / "main.energy").write_text('\n  import "latin1.energy"\n')  # located in the imported file itself
    e = spec_error(tmp_path / "main.energy")
    assert str(e.span) == f"{tmp_path / 'latin1.energy'}:3:8"
    assert e.hint.endswith(f"imported at {tmp_path / 'main.energy'}:2:3")


def test_a_file_cut_inside_a_character_says_so(tmp_path: Path) -> None:
    """A file that stops in the middle of a UTF-8 character was reported as a misencoded byte, with a Latin-1
    hint, where it is a file cut short."""
    path = tmp_path / "cut.energy"
    path.write_bytes(UNDEFINED.replace("a comment", "τ").encode()[: UNDEFINED.index("a comment") + 1])
    e = spec_error(path)
    assert str(e.span) == f"{path}:3:5" and e.message.startswith("the file ends inside a character"), e.render()
    assert "Latin-1" not in (e.hint or "")


# ----------------------------------------------------------------------------- a broken pipe


def test_a_broken_stdout_pipe_exits_141_quietly() -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written: every write fails, deterministically
    try:
        proc = subprocess.run([sys.executable, "-m", "energydsl.cli", "derive", MHA], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120, cwd=ROOT)
    finally:
        os.close(write)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr


@pytest.mark.parametrize("argv, status", [(["derive", "missing.energy"], 2), (["derive", "--format", "x"], 2)])
def test_a_broken_stderr_pipe_keeps_the_commands_status(tmp_path, argv, status) -> None:
    """The message cannot be delivered, but the outcome stands: 2, not a traceback's 1."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "energydsl.cli", *argv], stdout=subprocess.PIPE,
                              stderr=write, text=True, timeout=120, cwd=tmp_path)
    finally:
        os.close(write)
    assert proc.returncode == status


@pytest.mark.parametrize(("command", "status"), [
    ("check missing.energy", 2), ("check --bogus", 2), ("derive {mha} --set zz=1", 2),
    ("train {gpt} --data chars:{corpus} --steps 2 --batch-size 2 --block-size 8 --eval-iters 1 --out run", 0)])
def test_a_closed_stderr_keeps_the_commands_status_and_stdout_clean(tmp_path, command, status) -> None:
    """`2>&-`: Python's sys.stderr is None, and print(file=None) wrote the error to stdout; then flushing None
    raised, exit 1 (training crashed on None.isatty())."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question\n" * 40)
    line = command.format(mha=MHA, gpt=ROOT / "examples/models/gpt.energy", corpus=corpus)
    proc = subprocess.run(f"{sys.executable} -m energydsl.cli {line} 2>&-", shell=True, stdout=subprocess.PIPE,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == status and "error" not in proc.stdout, proc.stdout


class _Gone:
    """A stdout whose reader went away: at the first write, or only when the buffer is flushed."""

    def __init__(self, at_flush: bool):
        self.at_flush = at_flush

    def write(self, text: str) -> int:
        if not self.at_flush:
            raise BrokenPipeError(32, "Broken pipe")
        return len(text)

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self) -> int:
        raise OSError("no file")


@pytest.mark.parametrize("at_flush", [False, True])
def test_a_broken_pipe_is_141_wherever_it_shows(monkeypatch, capsys, at_flush: bool) -> None:
    monkeypatch.setattr(sys, "argv", ["energy", "derive", MHA])
    monkeypatch.setattr(sys, "stdout", _Gone(at_flush))
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 141
    assert capsys.readouterr().err == ""


def test_a_ctrl_c_in_any_command_says_interrupted(monkeypatch, capsys) -> None:
    """Typer turns a KeyboardInterrupt in a command into status 130 without a word; `main` says it (train and
    search, which say what they kept, exit on their own and are not doubled: test_train_audit)."""
    from energydsl import api

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "load", interrupted)
    code, _, err = run_main("derive", MHA)
    assert code == 130
    assert err.strip().splitlines()[-1] == "interrupted", err



# ----------------------------------------------------------------------------- --backend in the command line's terms


@pytest.mark.parametrize("command", [["compile", GPT], ["train", GPT, "--data", "shakespeare_char", "--out"]])
def test_an_unknown_backend_flag_names_the_flag_and_its_values(monkeypatch, capsys, tmp_path, command) -> None:
    """The message was the Python API's (`sizes are keywords, for example .module("MHA", d=16)`)."""
    if command[-1] == "--out":
        command = [*command, str(tmp_path / "r")]
    code, out, err = run_main(*command, "--backend", "bogus")
    assert code == 2, err
    assert err.splitlines() == [
        "error: unknown backend `bogus` given to --backend",
        "hint: --backend takes torch or triton (default: torch)",
    ], err
    assert not (tmp_path / "r").exists() and out == ""


def test_the_python_api_keeps_its_own_backend_message() -> None:
    from energydsl.errors import UserError

    with pytest.raises(UserError, match=r"sizes are keywords, for example \.module") as e:
        load(GPT).module("MHA", 16)
    assert "unknown backend `16`" in e.value.message


def test_compile_help_lists_the_backends(monkeypatch, capsys) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    code, out, _ = run_main("compile", "--help")
    assert code == 0 and "<torch|triton>" in out


# ----------------------------------------------------------------------------- the graph of a deep stack


def dot_of(monkeypatch, capsys, tmp_path: Path, *sets: str) -> tuple[str, str]:
    path = tmp_path / "g.dot"
    code, _, err = run_main("graph", GPT, "--dot", str(path), *sets)
    assert code == 0, err
    return path.read_text(encoding="utf-8"), err


def test_a_graph_of_up_to_32_layers_draws_each_layer(monkeypatch, capsys, tmp_path) -> None:
    dot, err = dot_of(monkeypatch, capsys, tmp_path, "--set", "layers=32")
    assert '"L31.MLP" [label="MLP", shape=box, kind="stage", weights="layer 31", energies="MLP"];' in dot
    assert "cluster" not in dot and "L*" not in dot
    assert err.strip().endswith("(133 nodes)")  # tokens, embed, 32 x (2 norms + 2 stages), final norm, head, logits
    plan = load(GPT).plan(layers=32)
    assert list(plan.graph().nodes(data=True)) == list(plan.graph(unroll=None).nodes(data=True))


def test_a_deeper_graph_draws_its_identical_layers_once(monkeypatch, capsys, tmp_path) -> None:
    dot, err = dot_of(monkeypatch, capsys, tmp_path, "--set", "layers=33")
    assert 'label="layer × 33 (weights per layer)";' in dot and '"L*.MHA" [label="MHA", shape=box, kind="stage"' in dot
    assert '"embed" -> "L*.0:layernorm";' in dot and '"L*.MLP" -> "final_norm";' in dot and "L0." not in dot
    assert "(9 nodes: 33 identical layers drawn once, as `layer × 33`)" in err
    g = load(MODELS / "nrgpt.energy").plan(layers=33).graph()
    assert g.graph["repeat"] == 33 and g.nodes["L*.NRGPTAttention+NRGPTFF2W"]["weights"] == "shared"


def test_the_dot_file_says_what_the_graph_holds_and_keeps_norms_apart_from_stages(tmp_path: Path, monkeypatch) -> None:
    """DOT wrote label and shape only: NRGPT's shared weights and MomentumGPT's momentum across layers were
    lost. A stage whose energy is named `layernorm`, run twice in a layer, took the norm's node name: the
    norms vanished and the stages looped onto themselves."""
    _, _, err = run_main("graph", str(MODELS / "nrgpt.energy"), "--dot", str(tmp_path / "n.dot"))
    dot = (tmp_path / "n.dot").read_text()
    assert '"L0.NRGPTAttention+NRGPTFF2W" [label="NRGPTAttention+NRGPTFF2W\\n(shared weights)", shape=box, ' \
           'kind="stage", weights="shared", energies="NRGPTAttention, NRGPTFF2W"];' in dot, dot
    run_main("graph", str(MODELS / "momentum-gpt.energy"), "--dot", str(tmp_path / "m.dot"))
    assert '"L0.0:layernorm" -> "L0.MHA" [across="momentum", label="momentum"];' in (tmp_path / "m.dot").read_text()
    spec = tmp_path / "clash.energy"
    spec.write_text("energy layernorm(d = 4) {\n  state z[d]\n  param W[d, d]\n  global F = 0.5 * z . (W @ z)\n}\n"
                    "model M(vocab = 8, context = 4, d = 4) {\n  layer = layernorm(d) -> layernorm(d)\n"
                    "  norm layernorm before each stage\n}\n")
    g = load(spec).plan().graph()
    assert [n for n, kind in g.nodes(data="kind") if kind in ("norm", "stage")] == [
        "L0.0:layernorm", "L0.0.layernorm", "L0.1:layernorm", "L0.1.layernorm"]
    assert nx_self_loops(g) == []
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main("graph", str(spec), "--dot", "-")  # wrote a file named `-`
    assert code == 0 and out.startswith('digraph "M" {') and "1× [ layernorm -> layernorm ]" in err, (out, err)
    assert not (tmp_path / "-").exists()


def nx_self_loops(g) -> list:
    import networkx as nx

    return list(nx.selfloop_edges(g))

def test_the_graph_of_a_million_layers_answers_at_once(tmp_path: Path) -> None:
    """Drawn one by one, a million layers took 75 s and 5 GiB for a 370 MB DOT file."""
    proc = energy("graph", GPT, "--dot", str(tmp_path / "g.dot"), "--set", "layers=1e6", timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "1000000× [ MHA -> MLP ]" in proc.stdout and "(9 nodes: 1,000,000 identical layers" in proc.stderr
    assert 'label="layer × 1,000,000 (weights per layer)";' in (tmp_path / "g.dot").read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- activations grow with depth

NRGPT = str(MODELS / "nrgpt.energy")  # `repeat layers shared`: 189,570 parameters at any depth


def test_train_refuses_a_billion_shared_layers_for_their_activations(monkeypatch, capsys, tmp_path) -> None:
    """The shared weights passed the memory check, then every forward pass ran a billion layers."""
    import energydsl.training

    def started(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(energydsl.training, "train", started)
    args = ["train", NRGPT, "--data", "shakespeare_char", "--set", "layers=1e9", "--out", str(tmp_path / "r")]
    code, _, err = run_main(*args)
    assert code == 2, err
    assert (
        "error: the model does not fit in host memory here: training even one sequence of 64 tokens (--batch-size 1) "
        "keeps at least 61,035.2 GiB of activations for the backward pass through its 1,000,000,000 layers, besides "
        "2.9 MiB for 189,570 parameters;"
    ) in err, err
    assert "hint: lower --set layers (every layer keeps its own activations, shared weights or not)" in err
    assert not (tmp_path / "r").exists()
    code, out, err = run_main("info", NRGPT, "--json", "--set", "layers=1e9")
    assert code == 0, err
    info = json.loads(out)
    assert info["layers"] == 10**9 and info["params"] == 189570 and info["shared"] is True
    assert info["activation_bytes_per_token"] == 4 * ((2 * 10**9 + 2) * 128 + 65)


def test_the_activation_check_counts_the_block_and_the_dtype(monkeypatch) -> None:
    from energydsl.errors import UserError

    monkeypatch.setattr(sizing, "available_memory", lambda: 100 * 2**20)  # 100 MiB
    # 2,000 shared layers: 2.9 MiB of weights; one sequence of 64 tokens keeps at least 125.1 MiB in float32
    for block in (None, 64, 10**6):  # a block longer than the context is counted as the context (refused later)
        with pytest.raises(UserError, match=r"one sequence of 64 tokens \(--batch-size 1\) keeps at least 125\.1 MiB"):
            sizing.load_model(NRGPT, None, {"layers": 2000}, block_size=block, dtype="float32")
    for block, dtype in ((None, "bfloat16"), (16, "float32"), (None, None)):  # 62.5 MiB, 31.3 MiB, unchecked
        _, model = sizing.load_model(NRGPT, None, {"layers": 2000}, block_size=block, dtype=dtype)
        assert model.plan.layers == 2000 and len(model.layers) == 1


PRECONDITIONED = """energy Pull(d = 8) {
  state x[d]
  param w[d] ~ normal(0, 1)
  global E = 0.5 * ((x - w) . (x - w))
  optimizer gd(eta = 0.5), precondition PRE
}
"""


@pytest.mark.parametrize("command", ["compile", "derive", "check"])
@pytest.mark.parametrize("pre,dims,says", [
    ("dplr(rank = 2e17)", [], "`P_U` [d, 200000000000000000] would have 1.6e+18 entries"),
    ("psd(rank = 3e17)", [], "`P_L` [d, 300000000000000000] would have 2.4e+18 entries"),
    ("full", ["--set", "d=2e9"], "`P_M` [d, d] would have 4e+18 entries (with d=2e+09)"),
])
def test_a_preconditioner_too_large_for_a_tensor_is_exit_2_at_the_optimizer(monkeypatch, capsys, tmp_path, command,
                                                                          pre, dims, says) -> None:
    """Each size fits but the factor's entries do not: `compile` wrote a module that failed allocating it."""
    spec = tmp_path / "pull.energy"
    spec.write_text(PRECONDITIONED.replace("PRE", pre))
    out = ["-o", str(tmp_path / "pull.py")] if command == "compile" else []
    code, _, err = run_main(command, str(spec), *dims, *out)
    assert code == 2, err
    assert says in err and "2**60 - 1" in err and f"{spec}:5:3: error:" in err, err
    assert not (tmp_path / "pull.py").exists()


LONG = "a" * 300  # over a file name's 255 bytes: pathlib's exists() and is_dir() raise ENAMETOOLONG


@pytest.mark.parametrize("args", [
    ["train", GPT, "--data", "shakespeare_char", "--out", "{long}"],
    ["train", GPT, "--data", "chars:{long}.txt", "--out", "{tmp}/run"],
    ["sample", "{long}"],
    ["search", str(ROOT / "search/quickstart.energy"), "--trials", "1", "--storage", "{long}/optuna.journal"],
    ["search", str(ROOT / "search/quickstart.energy"), "--trials", "1", "--storage", "{tmp}/s.journal",
     "--report", "{long}.html"],
    ["report", "{long}"],
    ["compile", MHA, "-o", "{long}.py"],
    ["derive", "{long}.energy"],
    ["check", "{long}.energy"],
    ["train", "{long}.energy", "--data", "shakespeare_char"],
], ids=["train --out", "train --data", "sample", "search --storage", "search --report", "report", "compile -o",
        "derive FILE", "check FILE", "train FILE"])
def test_a_path_too_long_is_exit_2_naming_it(monkeypatch, capsys, tmp_path, args) -> None:
    """Every command said `internal error ... OSError: [Errno 36] File name too long` (exit 70)."""
    long = str(tmp_path / LONG)
    code, _, err = run_main(*(a.format(long=long, tmp=tmp_path) for a in args))
    assert code == 2, err
    assert err.startswith(f"error: a path is too long: {long}") and "internal error" not in err, err
    assert "hint: a file or folder name holds at most 255 bytes" in err


def test_a_set_given_twice_takes_the_last_value(monkeypatch, capsys) -> None:
    """Flags are overrides (a script adds its own `--set` after a shared base command): documented, tested."""
    code, out, err = run_main("derive", MHA, "--set", "d=8", "--set", "d=16")
    assert code == 0 and "d=16," in out, err


# ----------------------------------------------------------------------------- empty paths, long literals


@pytest.mark.parametrize("argv, says", [
    (["graph", GPT, "--dot", ""], "error: --dot is empty"),  # exit 0, nothing written
    (["sample", ""], "error: the checkpoint path is empty"),  # "no checkpoint in ." (the working directory)
])
def test_an_empty_path_is_refused_as_empty(monkeypatch, capsys, argv, says) -> None:
    code, out, err = run_main(*argv)
    assert code == 2 and err.startswith(says) and out == "", (code, err)


def test_a_literal_too_large_is_named_without_all_its_digits(tmp_path: Path) -> None:
    path = tmp_path / "long.energy"
    path.write_text(UNDEFINED.replace("z . q", "z . z * " + "9" * 5000))
    e = spec_error(path)
    assert e.message == "number too large: 999999999999…999999999999 (5000 characters)", e.message[:300]


def test_a_model_too_large_to_check_is_refused_at_once(monkeypatch, capsys, tmp_path) -> None:
    """`layer = MLP(d, hidden = 1e8)`: the model checks built 6 GiB of float64 weights and ran for minutes (the
    energy's own checks refuse an instance over 4 GiB). Sized on the meta device first, it is refused at the
    model, naming its largest weight; at smaller dims it checks."""
    spec = tmp_path / "big.energy"
    spec.write_text("energy MLP(d = 8, hidden = 16) {\n  state z[d]\n  param W1[hidden, d] ~ normal(0, 0.02)\n"
                    "  global F = -sum(integral(gelu)(W1 @ z))\n}\n"
                    "model M(vocab = 65, context = 8, d = 8, hidden = 100000000) {\n  embed tokens, positions\n"
                    "  layer = MLP(d, hidden = hidden)\n  head tied\n}\n")
    started = time.monotonic()
    code, _, err = run_main("check", str(spec))
    assert code == 2 and "big.energy:6:7: error: model `M` is too large to check at its dims" in err, err
    assert "[100000000, 8] alone has 800,000,000 entries" in err and "^" in err, err
    assert time.monotonic() - started < 30
    code, _, err = run_main("check", str(spec), "--set", "hidden=32")
    assert code == 0, err
    # small weights, a billion shared layers: the checks ran the forward for days
    spec.write_text(spec.read_text().replace("hidden = 100000000) {", "hidden = 32, layers = 1e9) {")
                    .replace("  head tied", "  repeat layers shared\n  head tied"))
    started = time.monotonic()
    code, _, err = run_main("check", str(spec))
    assert code == 2 and "model `M` is too deep to check at its dims: 1,000,000,000 layers, more than 10,000" in err
    assert "--set layers=2" in err and time.monotonic() - started < 30

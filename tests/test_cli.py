"""Command-line usage errors: a clear message and exit status 2, never an internal error."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import energy_in_process

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples/models/gpt.energy")


@pytest.mark.parametrize("args,message,hint", [
    (["train", GPT, "--steps", "1"], "error: missing option '--data'\n", "train --help` lists its options"),
    (["train", GPT, "--data", "shakespeare_char", "--steps", "x"], "error: invalid value for '--steps'",
     "train --help` lists its options"),
    (["compile", GPT, "--no-such-flag"], "error: no such option: --no-such-flag", "compile --help` lists its"),
    (["derive"], "error: missing argument 'FILE'\n", "derive --help` lists its options"),
    (["no-such-command"], "error: no such command 'no-such-command'\n", "--help` lists the commands"),
    (["train", GPT, "--data", "shakespeare_char", "--backend", "bogus", "--steps", "1"], "unknown backend `bogus`",
     ""),
])
def test_usage_errors_exit_2(args: list[str], message: str, hint: str) -> None:
    """Flags click refuses read as every other flag error does: `error: ...` and a hint (not click's usage block)."""
    proc = subprocess.run([sys.executable, "-m", "energydsl.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr and "internal error" not in proc.stderr
    assert "\nhint: " in proc.stderr and hint in proc.stderr and "Usage:" not in proc.stderr, proc.stderr


def test_report_on_a_missing_sqlite_file_creates_nothing(tmp_path: Path) -> None:
    db = tmp_path / "none.db"
    proc = subprocess.run([sys.executable, "-m", "energydsl.cli", "report", f"sqlite:///{db}"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and "no study storage at" in proc.stderr, proc.stderr
    assert not db.exists()


def test_train_out_naming_a_file_is_refused_before_any_work(tmp_path: Path) -> None:
    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    proc = energy_in_process("train", GPT, "--data", "shakespeare_char", "--steps", "1", "--out", target, cwd=ROOT)
    assert proc.returncode == 2 and "is a file, not a directory" in proc.stderr, proc.stderr
    assert target.read_text() == "keep me"


def test_check_json_reports_every_file_and_exits_2_on_a_bad_one(tmp_path: Path) -> None:
    empty = tmp_path / "empty.energy"
    empty.write_text("")
    good = ROOT / "examples/intrinsic-optimizers/softmax-attention.energy"
    proc = energy_in_process("check", "--json", tmp_path / "missing.energy", empty, good, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["ok"] for r in rows] == [False, False, True]
    assert "no such file" in rows[0]["error"] and "declares no energy" in rows[1]["error"]
    # as text too: each bad file is said, and the good one after them is checked (the first stopped the run)
    proc = energy_in_process("check", tmp_path / "missing.energy", empty, good, cwd=ROOT)
    assert proc.returncode == 2 and "no such file" in proc.stderr and "declares no energy" in proc.stderr, proc.stderr
    assert f"{empty}: FAILED (not checked)" in proc.stdout and f"{good}: ok" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr


def test_check_loads_a_files_search_as_energy_search_does(tmp_path: Path) -> None:
    """A search naming a model the file lacks was passed by `energy check` (which said nothing of searches);
    only `energy search` refused it. It is now the file's error, at the name, and a good search gets a row."""
    space = tmp_path / "space.energy"
    text = f'import "{GPT}"\nsearch S {{\n  model Nope(d = choice{{32, 64}})\n  data mqar, steps 4\n}}\n'
    space.write_text(text)
    proc = energy_cli("check", str(space))
    assert proc.returncode == 2 and f"{space}:3:9: error: no model named `Nope`" in proc.stderr, proc.stderr
    assert "hint: models: GPT" in proc.stderr and "Traceback" not in proc.stderr
    space.write_text(text.replace("Nope", "GPT"))  # the data against the model, as energy search checks it
    proc = energy_cli("check", str(space))
    assert proc.returncode == 2 and "dataset mqar has 8192 tokens, more than model `GPT`'s vocab 65" in proc.stderr
    space.write_text(text.replace("Nope", "GPT").replace("64})", "64}, vocab = 8192)"))
    proc = energy_cli("check", "--json", str(space))
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout)
    assert row["energies"] == [] and row["models"] == []  # imported: checked where they are declared
    (search,) = row["searches"]
    assert search["name"] == "S" and search["ok"], search
    assert [c["name"] for c in search["checks"]] == ["space"] and "model GPT, 1 hole (GPT.d)" in \
        search["checks"][0]["detail"]


def test_check_passes_a_search_whose_templates_hold_holes(tmp_path: Path) -> None:
    """The shipped attention zoo (holes in its energies' scores, steps and optimizers) was refused by `energy check`
    at its first hole, as was a model header with one: a file's search fills them, and checks each candidate
    before it trains. Without a search in the file a hole stays an error."""
    proc = energy_cli("check", "--json", "search/attention-zoo.energy")
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout)
    templates = [*row["energies"], *row["models"]]
    assert {t["name"] for t in templates} == {"Attention", "MLP", "ZooGPT"}, templates
    assert all([c["name"] for c in t["checks"]] == ["holes"] and c["status"] == "skip"
               for t in templates for c in t["checks"]), templates
    assert row["searches"][0]["ok"]
    # a block whose stage holds a hole: one `holes` row under the block's name
    quick = (ROOT / "search/quickstart.energy").read_text()
    space = tmp_path / "block.energy"
    block = "block Pair = MHA(d, heads) -> MLP(d, hidden = hidden)\n\n"
    space.write_text(quick.replace("global  F = -sum(", "global  F = -choice{1, 2} * sum(")
                     .replace("  layer = MHA(d, heads) -> MLP(d, hidden = 4 * d)", "  layer = Pair(hidden = 4 * d)")
                     .replace("model TinyGPT", block + "model TinyGPT", 1))
    proc = energy_cli("check", "--json", str(space))
    assert proc.returncode == 0, proc.stderr
    checks = {t["name"]: [c["name"] for c in t["checks"]] for t in json.loads(proc.stdout)["energies"]}
    assert checks["Pair"] == ["holes"] and checks["MLP"] == ["holes"] and "gradient" in checks["MHA"], checks
    alone = tmp_path / "alone.energy"
    alone.write_text("energy A(d = 2) {\n  state z[d]\n  global F = choice{1, 2} * (z . z)\n}\n")
    proc = energy_cli("check", str(alone))
    assert proc.returncode == 2 and f"{alone}:3:14: error: a search hole" in proc.stderr, proc.stderr


def energy_cli(*args: str) -> subprocess.CompletedProcess:
    return energy_in_process(*args, cwd=ROOT)


def test_info_sizes_a_model_without_building_its_weights_and_train_refuses_one_too_large(tmp_path: Path) -> None:
    proc = energy_cli("info", GPT, "--json", "--set", "vocab=1e15")  # 1.28e17 parameters: 512 PB in float32
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["params"] - info["params_non_embedding"] == (10**15 + 64) * 128  # tied wte and wpe, d 128
    proc = energy_cli("train", GPT, "--set", "vocab=1e15", "--data", "shakespeare_char", "--out", str(tmp_path))
    assert proc.returncode == 2 and "does not fit in host memory here: 128,000,000,000," in proc.stderr, proc.stderr


def test_train_refuses_a_model_larger_than_free_memory_before_building_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """With overcommit, building a too-large model can succeed and the kernel kills the process once the
    initialisation touches the pages: the size is checked against the available memory first."""
    from energydsl import sizing
    from energydsl.errors import UserError

    monkeypatch.setattr(sizing, "available_memory", lambda: 2**20)  # 1 MiB free
    built = []
    monkeypatch.setattr(sizing, "free_gpu_memory", lambda device: built.append("asked") or None)
    with pytest.raises(UserError, match=r"does not fit in host memory here: [\d,]+ parameters need about"):
        sizing.load_model(GPT, None, {})
    assert not built  # a CPU run does not ask the GPU
    monkeypatch.setattr(sizing, "available_memory", lambda: 2**40)
    assert sizing.load_model(GPT, None, {})[1].num_params() > 0


def test_an_empty_energy_name_is_not_all_energies() -> None:
    proc = energy_cli("derive", str(ROOT / "examples/intrinsic-optimizers/mha.energy"), "--name", "")
    assert proc.returncode == 2 and "no energy, block or model named ``" in proc.stderr, proc.stderr
    assert "(it has: MHA)" in proc.stderr


@pytest.mark.parametrize("command", ["derive", "compile"])
def test_an_unknown_name_lists_the_energies_blocks_and_models_the_command_takes(command: str) -> None:
    """`--name NRGPTblock` said "no energy named … (it has: NRGPTAttention, NRGPTFF2W)", hiding the block and the
    model both commands take."""
    proc = energy_cli(command, str(ROOT / "examples/models/nrgpt.energy"), "--name", "NRGPTblock")
    assert proc.returncode == 2, proc.stderr
    assert ("no energy, block or model named `NRGPTblock` in " in proc.stderr
            and "(it has: NRGPTAttention, NRGPTFF2W, NRGPTBlock, NRGPT)\nhint: did you mean `NRGPTBlock`?"
            in proc.stderr), proc.stderr


def test_a_spec_path_with_backslashes_or_quotes_compiles_to_a_file_that_imports(tmp_path: Path) -> None:
    """The path went into the generated file's docstring as written: `a\\Nb.energy` (a \\N escape) or
    `q\"\"\"x.energy` wrote a file that did not import, and `energy compile` said it wrote it (exit 0)."""
    import shutil

    for name in ("a\\Nb.energy", 'q"""x.energy'):
        spec = tmp_path / name
        shutil.copy(ROOT / "examples/intrinsic-optimizers/mha.energy", spec)
        out = tmp_path / "out.py"
        proc = energy_cli("compile", str(spec), "-o", str(out))
        assert proc.returncode == 0, proc.stderr
        script = f"import runpy; print(runpy.run_path({str(out)!r})['__doc__'])"
        imported = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert imported.returncode == 0 and f"from {spec}, backend torch" in imported.stdout, imported.stderr


def test_an_output_path_ending_in_a_slash_names_a_folder(tmp_path: Path) -> None:
    """`-o new.py/` wrote a file `new.py` and said so; an existing folder was refused."""
    proc = energy_cli("compile", str(ROOT / "examples/intrinsic-optimizers/mha.energy"), "-o", f"{tmp_path}/new.py/")
    assert proc.returncode == 2 and "is a directory, not a file" in proc.stderr, proc.stderr
    assert not (tmp_path / "new.py").exists()


def test_ctrl_c_while_the_cli_is_imported_exits_130_without_a_traceback() -> None:
    """The `energy` script's entry point imports the CLI (typer, rich: a fraction of a second) inside its guard."""
    from importlib.metadata import entry_points

    assert entry_points(group="console_scripts")["energy"].value == "energydsl.__main__:main"
    interrupt_the_import = (
        "import sys\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'energydsl.cli':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Interrupt())\n"
        "from energydsl.__main__ import main\n"
        "main()\n")
    proc = subprocess.run([sys.executable, "-c", interrupt_the_import, "derive", GPT], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 130 and proc.stderr == "interrupted\n", proc.stderr


def test_python_m_energydsl_runs_the_cli() -> None:
    proc = subprocess.run([sys.executable, "-m", "energydsl", "derive", GPT, "--name", "MHA"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and "∇" in proc.stdout, proc.stderr


def test_a_file_without_an_energy_of_its_own_names_what_it_has(tmp_path: Path) -> None:
    blocks = tmp_path / "blocks.energy"
    blocks.write_text(f'import "{ROOT / "examples/models/gpt.energy"}"\nblock Both = MHA -> MLP\n')
    for command in ("derive", "compile"):
        proc = energy_cli(command, str(blocks))
        assert proc.returncode == 2 and "declares no energy" in proc.stderr, proc.stderr
        assert "it has blocks (Both)" in proc.stderr and "--name Both" in proc.stderr
    proc = energy_cli("check", str(blocks))  # checks the block's stages
    assert proc.returncode == 0 and "Both stage 1 (MHA)" in proc.stdout and "Both stage 2 (MLP)" in proc.stdout
    imports = tmp_path / "imports.energy"
    imports.write_text(f'import "{ROOT / "examples/intrinsic-optimizers/mha.energy"}"\n')
    proc = energy_cli("derive", str(imports))
    assert proc.returncode == 2 and "it imports energies (MHA)" in proc.stderr, proc.stderr
    model = tmp_path / "model.energy"  # its own model first (not the imported GPT), in the command's own words
    model.write_text(f'import "{ROOT / "examples/models/gpt.energy"}"\nmodel M(vocab = 11, context = 8, d = 16) '
                     '{\n  layer = MLP\n}\n')
    proc = energy_cli("compile", str(model))
    assert proc.returncode == 2 and f"`energy compile {model} --name M` compiles a model's layers" in proc.stderr
    assert f"{model} declares no energy of its own" in proc.stderr, proc.stderr
    # a block that reads its model's dims cannot be derived alone: the model comes first (the block was suggested,
    # and the suggested command failed on the unknown `h`)
    model.write_text(f'import "{ROOT / "examples/models/gpt.energy"}"\nblock Pair = MHA(heads = h) -> MLP\n'
                     'model M(vocab = 11, context = 8, d = 16, h = 2) {\n  layer = Pair(h = h)\n}\n')
    proc = energy_cli("derive", str(model))
    assert proc.returncode == 2 and f"`energy derive {model} --name M` derives a model's layers, and its blocks " \
        "(Pair) take --name too" in proc.stderr, proc.stderr
    assert energy_cli("derive", str(model), "--name", "M").returncode == 0
    two = tmp_path / "two.energy"
    two.write_text((ROOT / "examples/models/gpt.energy").read_text(encoding="utf-8").replace("model GPT(", "model A(")
                   + "\nmodel B(vocab = 65, context = 8, d = 8, layers = 1) {\n embed tokens\n layer = MLP\n"
                   " repeat layers\n head tied\n}\n")
    proc = energy_cli("graph", str(two))
    assert proc.returncode == 2 and "name one" in proc.stderr and "`--name A`" in proc.stderr, proc.stderr


def test_compile_to_dash_writes_stdout_not_a_file_named_dash(tmp_path: Path) -> None:
    proc = energy_in_process("compile", ROOT / "examples/cem/mlp.energy", "-o", "-", cwd=tmp_path)
    assert proc.returncode == 0 and "class CEMMLP(" in proc.stdout and not (tmp_path / "-").exists(), proc.stderr


@pytest.mark.parametrize("args", [["derive", GPT, "--format"], ["train", GPT, "--steps"],
                                  ["search", "space.energy", "--trials"]])
def test_an_option_missing_its_value_hints_at_its_commands_help(args: list[str]) -> None:
    """click raises it without a context, and the hint named `energy --help` (the list of commands)."""
    proc = energy_cli(*args)
    assert proc.returncode == 2 and f"error: option '{args[-1]}' requires an argument" in proc.stderr, proc.stderr
    assert f"hint: `energy {args[0]} --help` lists its options and arguments" in proc.stderr, proc.stderr


def test_a_file_that_only_imports_its_model_names_it_for_graph_and_info(tmp_path: Path) -> None:
    """`energy graph` of such a file said "declares no model" with no hint, where `--name GPT` works."""
    imports = tmp_path / "imports.energy"
    imports.write_text(f'import "{GPT}"\n')
    for command in ("graph", "info"):
        proc = energy_cli(command, str(imports))
        assert proc.returncode == 2 and f"error: {imports} declares no model" in proc.stderr, proc.stderr
        assert "hint: it imports GPT: `--name GPT`" in proc.stderr, proc.stderr


def test_an_output_encoding_that_cannot_write_the_math_is_a_clear_error() -> None:
    """`PYTHONIOENCODING=ascii energy derive` (or check, sample): an internal error, exit 70, "please report"."""
    import os

    proc = subprocess.run([sys.executable, "-m", "energydsl.cli", "derive", "examples/cem/alibi.energy"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("error: the output encoding (ascii) cannot write '\\xb7'\nhint: set PYTHONIOENCODING=utf-8 "
                           "(or a UTF-8 locale, LANG=C.UTF-8) and rerun the same command\n"), proc.stderr

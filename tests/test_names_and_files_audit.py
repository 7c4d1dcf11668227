"""Bad input found by fuzzing the CLI (session 33): names Python cannot take, an energy without the state,
special files, a search factory that fails, a model `graph` passed that training refuses.

Each is exit 2 with a message that names the problem (file:line:col and a caret where there is a source),
never exit 70, a module that does not import, a silently wrong module, or a hang."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_main

import energydsl
from energydsl.python_names import MODULE_ATTRIBUTES

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples/models/gpt.energy")

SPEC = """energy A(d = 4) {{
  state z[d]
  param {name}[d, d] ~ normal(0, 0.1)
  global F = -sum(integral(gelu)({name} @ z))
  optimizer gd(eta = 1)
}}
"""


def energy(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`energy ARGS` in a process of its own, for what could hang (a pipe) or read forever (/dev/zero)."""
    return subprocess.run([sys.executable, "-m", "energydsl.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("global_", ["3", "0 * (z . z)", "stopgrad(z . z)"])
@pytest.mark.parametrize("command", ["derive", "check", "compile"])
def test_an_energy_that_does_not_depend_on_the_state_is_refused_where_it_is_written(
        monkeypatch, capsys, tmp_path, global_: str, command: str) -> None:
    """`check` crashed (exit 70, autograd of a constant) where `derive` printed `z⁺ = z`."""
    spec = tmp_path / "flat.energy"
    spec.write_text(f"energy A(d = 4) {{\n  state z[d]\n  global F = {global_}\n  optimizer gd(eta = 1)\n}}\n")
    code, _, err = run_main(command, str(spec))
    assert code == 2 and f"{spec}:3:3: error: the energy does not depend on the state `z`" in err, err
    assert "^^^" in err and "Traceback" not in err


@pytest.mark.parametrize("name,says", [
    ("lambda", "`lambda` is a Python keyword"),
    ("None", "`None` is a Python keyword"),
    ("forward", "`forward` is an attribute every generated nn.Module already has"),
    ("training", "`training` is an attribute every generated nn.Module already has"),
    ("reset_parameters", "`reset_parameters` is an attribute every generated nn.Module already has"),
    ("_parameters", "`_parameters` starts with `_`"),
    ("𝑥", "`𝑥` is read by Python as `x`"),
])
@pytest.mark.parametrize("command", ["derive", "compile"])
def test_a_param_name_the_generated_module_cannot_take_is_refused_at_its_clause(
        monkeypatch, capsys, tmp_path, name: str, says: str, command: str) -> None:
    """Before: a keyword wrote a file that did not parse (exit 70 in compile's own pass over it), `None` and
    `forward` a file that did not import or build, and `𝑥` beside a state `x` a module that read the weight
    where the input was (Python reads identifiers in NFKC)."""
    spec = tmp_path / "name.energy"
    spec.write_text(SPEC.format(name=name))
    code, _, err = run_main(command, str(spec), "-o", str(tmp_path / "out.py")) \
        if command == "compile" else run_main(command, str(spec))
    assert code == 2 and f"{spec}:3:3: error: {says}" in err, err
    assert "hint: " in err and not (tmp_path / "out.py").exists()


@pytest.mark.parametrize("text,at,says", [
    ("energy None(d = 4) {\n  state z[d]\n  global F = z . z\n  optimizer gd(eta = 1)\n}\n", ":1:8:",
     "`None` is a Python keyword"),
    ("energy A(d = 4) {\n  state if[d]\n  global F = if . if\n  optimizer gd(eta = 1)\n}\n", ":2:3:",
     "`if` is a Python keyword"),
    ("energy A(d = 4, heads = 2) {\n  dim dh = d / heads\n  state z[d]\n  context h[j, d] where j <= i\n"
     "  param W[heads, dh, d] ~ normal(0, 0.02)\n"
     "  global F = -sum[k](logsumexp[j]((W[k] @ z) . (W[k] @ h[j])))\n  optimizer gd(eta = 1)\n"
     "  untie value W[k]^T -> forward[k]\n}\n", ":8:",
     "`forward` is an attribute every generated nn.Module already has"),
], ids=["energy-name", "state", "untie-target"])
def test_other_names_python_cannot_take_are_refused(monkeypatch, capsys, tmp_path, text: str, at: str,
                                                     says: str) -> None:
    spec = tmp_path / "name.energy"
    spec.write_text(text)
    code, _, err = run_main("derive", str(spec))
    assert code == 2 and f"{spec}{at}" in err and says in err, err


def test_the_refused_attributes_cover_torchs_and_the_generated_class() -> None:
    """A torch that adds a public nn.Module attribute fails here, not in a user's spec."""
    module = torch.nn.Module()
    public = {n for n in [*dir(module), *vars(module)] if not n.startswith("_")}  # `_...` are refused as a group
    generated = type(energydsl.load(GPT).module("MHA"))
    own = {n for n in dir(generated) if not n.startswith("_")} - set(dir(torch.nn.Module))
    assert public <= MODULE_ATTRIBUTES, public - MODULE_ATTRIBUTES
    assert own <= MODULE_ATTRIBUTES, own - MODULE_ATTRIBUTES


@pytest.mark.parametrize("name", ["check_inputs", "alibi_slopes", "causal_masks", "triton", "attention_ops",
                                  "attention_1970317a"])
def test_a_param_named_like_what_the_generated_file_imports_still_computes_the_update(name: str) -> None:
    """Its local is renamed (`check_inputs_`), in both backends' files: before, `check_inputs = self.check_inputs`
    made the forward's first call an UnboundLocalError (and `triton = self.triton` hid the kernels' module)."""
    from energydsl.codegen import energy_source

    for backend in ("torch", "triton"):
        source = energy_source(energydsl.load(SPEC.format(name=name)).energy(), backend)
        assert f"{name}_ = self.{name}" in source, source
    named, plain = (energydsl.load(SPEC.format(name=n)).module() for n in (name, "W"))
    plain.load_state_dict({"W": getattr(named, name).detach()})
    x = torch.randn(2, 5, 4)
    torch.testing.assert_close(named(x), plain(x))


def test_two_energies_that_would_be_one_class_are_refused(monkeypatch, capsys, tmp_path) -> None:
    """`mlp` and `Mlp` are both the class `Mlp`: the second silently replaced the first in the file."""
    one = "energy {}(d = 4) {{\n  state z[d]\n  global F = z . z\n  optimizer gd(eta = 0.5)\n}}\n"
    spec = tmp_path / "two.energy"
    spec.write_text(one.format("mlp") + one.format("Mlp"))
    code, _, err = run_main("compile", str(spec), "-o", str(tmp_path / "out.py"))
    assert code == 2 and f"{spec}:6:8: error: energies `mlp` (at {spec}:1:8) and `Mlp` would both be the class " \
        "`Mlp`" in err, err


def test_a_class_named_from_dims_gives_way_to_an_energy_of_that_name(monkeypatch, capsys, tmp_path) -> None:
    """`MLP` at hidden 8 is the class `MLP_hidden8`, which an energy of that name is too: `energy compile --name M`
    refused the model (its hint, `--name`, was given), which info, check and train took."""
    spec = tmp_path / "m.energy"
    spec.write_text(f'import "{Path("examples/models/gpt.energy").resolve()}"\n'
                    "energy MLP_hidden8(d = 8) {\n  state z[d]\n  global F = 0.5 * z . z\n}\n"
                    "model M(vocab = 11, context = 8, d = 16) {\n"
                    "  layer = MLP(d, hidden = 8) -> MLP(d, hidden = 16) -> MLP_hidden8(d)\n}\n")
    code, _, err = run_main("compile", str(spec), "--name", "M", "-o", str(tmp_path / "out.py"))
    assert code == 0 and "(MLP_hidden8_2, MLP_hidden16, MLP_hidden8, backend torch)" in err, err


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
def test_special_files_are_refused_not_read_forever(tmp_path: Path) -> None:
    """/dev/zero was read until memory ran out and a named pipe blocked, as a spec, an import, -o or data."""
    fifo = tmp_path / "pipe.energy"
    os.mkfifo(fifo)
    importer = tmp_path / "imports.energy"
    importer.write_text('import "/dev/zero"\n')
    cases = [
        (["derive", "/dev/zero"], "/dev/zero is not a regular file"),
        (["derive", str(fifo)], f"{fifo} is not a regular file"),
        (["derive", str(importer)], f"{importer}:1:1: error: /dev/zero is not a regular file"),
        (["compile", GPT, "-o", str(fifo)], f"-o/--output {fifo} is not a regular file"),
        (["train", GPT, "--data", f"chars:{fifo}", "--steps", "1", "--out", str(tmp_path / "run")],
         f"text file is not a regular file (a device, pipe or socket): {fifo}"),
    ]
    for args, says in cases:
        proc = energy(*args)
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)


@pytest.mark.parametrize("target,says", [
    ("json:loads", "building the search space 'json:loads' failed: TypeError:"),
    ("builtins:exit", "building the search space 'builtins:exit' failed: SystemExit"),
])
def test_a_search_factory_that_fails_is_named(monkeypatch, capsys, target: str, says: str) -> None:
    """`package.module:attr` is called to build the space: its failure was exit 70 (or, for exit(), 0)."""
    code, _, err = run_main("search", target, "--holes")
    assert code == 2 and says in err and "Traceback" not in err, err


SPACE_CLASS = """class Space:
    name = "half"
    objectives = [("loss", "minimize")]
    budget = {"trials": 1}
    def suggest(self, trial): ...
    def evaluate(self, candidate, report): ...
"""


@pytest.mark.parametrize("module,says", [
    ("def f(:\n", "importing the search space 'MOD:space' failed: SyntaxError: invalid syntax (MOD.py, line 1)"),
    ("raise RuntimeError('import boom')\n", "importing the search space 'MOD:space' failed: RuntimeError: import boom"),
    ("import sys\nsys.exit(3)\n", "importing the search space 'MOD:space' failed: SystemExit: 3"),
    (SPACE_CLASS + "class Half(Space):\n    budget = 1\nspace = Half()\n",
     "search space 'half': budget must be a dict, not int"),
    (SPACE_CLASS + "class Bad(Space):\n    objectives = [1, 2]\nspace = Bad()\n",
     "search space 'half': objectives must be (name, direction) pairs, not [1, 2]"),
    (SPACE_CLASS + "class Bad(Space):\n    name = 3\nspace = Bad()\n", "its name must be a non-empty string, not 3"),
    (SPACE_CLASS + "class Bad(Space):\n    evaluate = 3\nspace = Bad()\n",
     "search space 'half': evaluate must be a method, not int"),
])
def test_a_python_search_space_that_fails_to_import_or_is_malformed_is_named(monkeypatch, tmp_path: Path,
                                                                             module: str, says: str) -> None:
    """A module that failed as it was imported (a SyntaxError, a raise) and a space whose budget was no dict were
    internal errors (exit 70); only a missing module or attribute was the user's."""
    name = f"space_{abs(hash(module))}"
    (tmp_path / f"{name}.py").write_text(module)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    code, _, err = run_main("search", f"{name}:space", "--holes")
    assert code == 2 and says.replace("MOD", name) in err and "Traceback" not in err, err


def test_graph_refuses_a_stage_whose_state_does_not_fit_the_stream(monkeypatch, capsys, tmp_path) -> None:
    """`graph` drew a model that `info` and `train` refuse."""
    spec = tmp_path / "model.energy"
    spec.write_text("energy A(d = 4) {\n  state z[d]\n  global F = z . z\n  optimizer gd(eta = 0.5)\n}\n"
                    "model M(vocab = 16, context = 8, d = 8, layers = 1) {\n  layer = A(d = 4)\n}\n")
    for command in ("graph", "info"):
        code, _, err = run_main(command, str(spec))
        assert code == 2 and f"{spec}:7:11: error: stage `A` has the state [4]" in err, (command, err)


OTHER_SHAPES = """energy InOther(d = 4, e = 3, f = 5) {
  state   z[d]
  input   x[e]
  context h[j, f] where j <= i
  param   U[d, e] ~ normal(0, 0.5)
  param   W[d, f] ~ normal(0, 0.5)
  global  F = 0.5 * (z - U @ x) . (z - U @ x) - logsumexp[j](z . (W @ h[j]))
  optimizer gd(eta = 0.5)
}
"""


def test_a_layers_example_inputs_are_ones_it_takes(tmp_path) -> None:
    """`example_input()` was float32 on the CPU whatever the module's dtype (a float64 layer refused it), left out a
    context or input of its own shape (the forward then refused x alone), and `example_input(-1)` failed in torch."""
    spec = tmp_path / "other.energy"
    spec.write_text(OTHER_SHAPES)
    layer = energydsl.load(spec).module("InOther").double()
    inputs = layer.example_inputs(3, 5)
    assert {k: (tuple(v.shape), v.dtype) for k, v in inputs.items()} == {
        "x": ((3, 5, 4), torch.float64), "context": ((3, 5, 5), torch.float64), "input": ((3, 5, 3), torch.float64)}
    assert layer(**inputs).shape == (3, 5, 4)
    x = layer.example_input(2, 7)
    assert x.shape == (2, 7, 4) and x.dtype == torch.float64
    same = energydsl.load(ROOT / "examples/cem/tied-attention.energy").module(d=8).double()
    assert list(same.example_inputs(1, 3)) == ["x"] and same(same.example_input(1, 3)).dtype == torch.float64
    for batch, seq in ((-1, 3), (2, 0), (2.5, 3), (2, "3")):
        with pytest.raises(ValueError, match=r"example_input: (batch|seq) must be a whole number of at least 1"):
            layer.example_input(batch, seq)


def test_an_input_and_context_of_their_own_shapes(monkeypatch, capsys, tmp_path) -> None:
    """`energy check` reshaped the input to the state's shape (its sympy row failed on a valid spec); the module
    failed deep in a matmul when context or input were left to default to x; a model stage with such a context
    crashed `energy check` (exit 70) while `info`, `graph` and `compile` accepted it."""

    spec = tmp_path / "other.energy"
    spec.write_text(OTHER_SHAPES)
    code, out, err = run_main("check", str(spec))
    assert code == 0 and "sympy.diff of an explicit instance agrees" in out, out + err
    layer = energydsl.load(spec).module("InOther")
    assert layer(torch.randn(2, 3, 4), context=torch.randn(2, 3, 5), input=torch.randn(2, 3, 3)).shape == (2, 3, 4)
    with pytest.raises(ValueError, match=r"context defaults to x, but its tokens have shape \(5,\) and x's \(4,\)"):
        layer(torch.randn(2, 3, 4), input=torch.randn(2, 3, 3))
    with pytest.raises(ValueError, match=r"input defaults to x, .* pass input= explicitly, \(batch, seq, 3\)"):
        layer(torch.randn(2, 3, 4), context=torch.randn(2, 3, 5))
    for clause, what in (("context h[j, f]", "input `x` [3]"), ("input   x[e]", "context `h` [5]")):
        text = OTHER_SHAPES.replace(clause, clause.replace("[e]", "[d]").replace("[j, f]", "[j, d]"))
        text = text.replace("W[d, f]" if "context" in clause else "U[d, e]",
                            "W[d, d]" if "context" in clause else "U[d, d]")
        spec.write_text(text + "model M(vocab = 11, context = 8, d = 4, layers = 1) {\n  layer = InOther(d)\n}\n")
        for command in ("check", "info", "graph", "derive", "compile"):
            code, _, err = run_main(command, str(spec), *(
                ["--name", "M"] if command in ("derive", "compile") else []), *(
                ["-o", str(tmp_path / "x.py")] if command == "compile" else []))
            assert code == 2 and f"{spec}:11:11: error: stage `InOther` has the {what} per token but the state [4]" \
                in err, (command, err)


def test_misleading_messages_now_say_what_is_wrong(monkeypatch, capsys, tmp_path) -> None:
    spec = tmp_path / "blocks.energy"
    spec.write_text("energy A(d = 8) {\n  state z[d]\n  global F = z . z\n  optimizer gd(eta = 0.5)\n}\n"
                    "block B = C\nblock C = B\nmodel M(vocab = 16, context = 8, d = 8, layers = 1) {\n"
                    "  layer = B\n}\n")
    code, _, err = run_main("info", str(spec))
    assert code == 2 and "block `B` is part of a cycle of blocks: `B` -> `C` -> `B`" in err, err
    code, _, err = run_main("compile", GPT, "-o", "")
    assert code == 2 and "-o/--output is empty" in err, err
    code, _, err = run_main("train", GPT, "--data", "shakespeare_char", "--weight-decay", "nan",
                            "--out", str(tmp_path / "run"))
    assert code == 2 and "--weight-decay must be a number, got nan" in err, err


def test_per_head_over_the_context_is_a_spec_error(monkeypatch, capsys, tmp_path) -> None:
    """`per head` on `sum[j]` over the context took j for the heads: exit 70 in codegen (found by fuzzing)."""
    spec = tmp_path / "heads.energy"
    spec.write_text("energy A(d = 4) {\n  state z[d]\n  context h[j, d] where j <= i\n"
                    "  param W[d, d] ~ normal(0, 0.02)\n  global F = -sum[j]((z . (W @ h[j]))^2)\n"
                    "  optimizer gd(eta = 1) per head, precondition diag\n}\n")
    code, _, err = run_main("compile", str(spec), "-o", str(tmp_path / "out.py"))
    assert code == 2 and f"{spec}:6:3: error: `per head` needs a sum over heads" in err, err



def test_an_output_that_is_the_spec_or_an_import_is_refused(monkeypatch, capsys, tmp_path) -> None:
    """`energy compile x.energy -o x.energy` replaced the spec with Python, exit 0; so did `--dot` of `graph`."""
    root = Path(__file__).resolve().parent.parent
    spec = tmp_path / "m.energy"
    spec.write_text(f'import "{root}/examples/models/gpt.energy"\n'
                    "model M(vocab = 11, context = 8, d = 16, heads = 2) {\n  embed tokens\n"
                    "  layer = MHA(d, heads) -> MLP(d)\n  head tied\n}\n")
    text = spec.read_text()
    for args, flag in ((["compile", str(spec), "-o"], "-o/--output"), (["graph", str(spec), "--dot"], "--dot")):
        code, _, err = run_main(*args, str(spec))
        assert code == 2 and f"error: {flag} {spec} is the spec: writing there would replace it" in err, err
    imported = tmp_path / "gpt.energy"  # the import, reached by another path
    imported.symlink_to(root / "examples/models/gpt.energy")
    code, _, err = run_main("compile", str(spec), "--name", "M", "-o", str(imported))
    assert code == 2 and f"{imported} is a file the spec imports: writing there would replace it" in err, err
    assert spec.read_text() == text
    # a file that only imports (no declaration of its own), reached through a linked folder and `..`
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "real" / "lib.energy").write_text(f'import "{spec}"\n')
    (tmp_path / "link").symlink_to(tmp_path / "real" / "sub")
    top = tmp_path / "top.energy"
    top.write_text('import "link/../lib.energy"\n')
    code, _, err = run_main("compile", str(top), "--name", "M", "-o",
                            str(tmp_path / "real" / "lib.energy"))
    assert code == 2 and "is a file the spec imports" in err, err
    code, _, err = run_main("compile", str(top), "--name", "M", "-o", str(tmp_path / "lib.energy"))
    assert code == 0, err  # not read: `link/..` is real/, not this folder
    # a hard link: another path, the same file (the spec was replaced by the generated Python, exit 0)
    for link, of in ((tmp_path / "hard.py", spec), (tmp_path / "hard-import.py", tmp_path / "real" / "lib.energy")):
        link.hardlink_to(of)
        code, _, err = run_main("compile", str(top), "--name", "M", "-o", str(link))
        assert code == 2 and f"{link} is " in err and "writing there would replace it" in err, err
    assert spec.read_text() == text


def test_a_failed_command_leaves_no_folders_and_a_good_one_makes_them(monkeypatch, capsys, tmp_path) -> None:
    """`-o new/deep/out.py` of a spec that does not derive left `new/deep/` behind, empty; a good one writes there
    (the folders made then), and `graph --dot` as well."""
    bad = tmp_path / "bad.energy"
    bad.write_text("energy Bad(d = 4) {\n  state z[d]\n  global F = z . q\n}\n"
                   "model M(vocab = 11, context = 8, d = 4) {\n  embed tokens\n  layer = Nope(d)\n  head tied\n}\n")
    for args, says in ((["compile", str(bad), "--name", "Bad", "-o", str(tmp_path / "new/deep/out.py")],
                        "undefined name `q`"),
                       (["graph", str(bad), "--dot", str(tmp_path / "new/deep/m.dot")], "Nope")):
        code, _, err = run_main(*args)
        assert code == 2 and says in err, err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.energy"]
    code, _, err = run_main("compile", GPT, "--name", "MLP", "-o", str(tmp_path / "a/b/out.py"))
    assert code == 0 and "class MLP(" in (tmp_path / "a/b/out.py").read_text(), err
    code, _, err = run_main("graph", GPT, "--dot", str(tmp_path / "c/m.dot"))
    assert code == 0 and (tmp_path / "c/m.dot").read_text().startswith("digraph"), err

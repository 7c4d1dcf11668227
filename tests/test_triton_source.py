"""Kernels written into generated files: the templates of energydsl/kernels specialised per energy
(the softmax family, the linear-attention family, the gated-activation, momentum and Nesterov epilogues).

`energy compile --backend triton -o out.py` must give a file whose @triton.jit kernels (forward and both
backward passes) compute this energy's scores only, and which runs on its own: imported from disk, its
module equals the torch backend in float64 (values and gradients). Without CUDA the kernels run under the
Triton interpreter, enabled before triton is first imported.
"""

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import compile_for_gpu, energy_in_process

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

pytest.importorskip("triton")

from energydsl import ir, load  # noqa: E402
from energydsl.codegen import energy_source, module_class, scalar_functions  # noqa: E402
from energydsl.codegen.triton_source import (  # noqa: E402
    FAMILIES,
    WIDTH,
    KernelRequest,
    kernel_imports,
    kernel_source,
    specialise,
    wrap_long_lines,
)

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "cuda" if CUDA else "cpu"


def _import(path: Path, name: str) -> object:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _kernels(src: str) -> dict[str, str]:
    """name -> source of each @triton.jit function in a generated file."""
    parts = src.split("@triton.jit\ndef ")[1:]
    return {p.split("(", 1)[0]: p.split("\n\n\n", 1)[0] for p in parts}


@pytest.mark.parametrize("path,name,has,lacks", [
    # ALiBi and the self-token bias on a causal mask; no per-key bias
    ("cem/alibi.energy", "CEMAlibiAttention", ["tl.abs(i - j)", "i == j", "valid = j <= i"],
     ["kb[None, :]", "valid = j < i"]),
    # a strict mask and no bias at all
    ("nrgpt/attention.energy", "NRGPTAttention", ["valid = j < i"], ["tl.abs(i - j)", "i == j", "j <= i"]),
    # linear attention: the decay-free chunk update only; gated: the decay mask and state decay only
    ("intrinsic-optimizers/linear-attention.energy", "LinearAttention", ["state += tl.dot(tl.trans(x), y"],
     ["tl.cumsum(g", "tl.exp(b_last)"]),
    ("intrinsic-optimizers/gated-linear-attention.energy", "GatedLinearAttention", ["tl.cumsum(g"],
     ["state += tl.dot(tl.trans(x), y"]),
])
def test_compile_writes_the_energys_own_kernels(tmp_path: Path, path: str, name: str, has: list[str],
                                                 lacks: list[str]) -> None:
    """The written file holds forward and backward kernels with this energy's score terms and no others."""
    out = tmp_path / "out.py"
    proc = energy_in_process("compile", ROOT / "examples" / path, "--backend", "triton", "-o", out)
    assert proc.returncode == 0, proc.stderr
    src = out.read_text()
    kernels = _kernels(src)
    if name.startswith("NRGPT") or name.startswith("CEM"):
        assert {k.rsplit("_", 1)[0] for k in kernels} == {"_scores", "_key_blocks", "_query_blocks", "_fwd_kernel",
                                                         "_bwd_dkdv_kernel", "_bwd_dq_kernel"}
        scores = next(v for k, v in kernels.items() if k.startswith("_scores"))
    else:  # linear attention: chunk states, forward, dq/dk, dv
        assert {k.rsplit("_", 1)[0] for k in kernels} == {"_state_kernel", "_fwd_kernel", "_bwd_dqk_kernel",
                                                         "_bwd_dv_kernel"}
        scores = "\n".join(kernels.values())
    for text in has:
        assert text in scores, text
    for text in lacks:
        assert text not in scores, text
    # every switch the energy fixes is gone from the kernels' code; runtime ones (dot precision, tiles) remain
    names = {n.id for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Name)}
    names |= {a.arg for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) for a in n.args.args}
    assert not names & {"STRICT", "HAS_ALIBI", "HAS_SELF", "HAS_KB", "SECOND", "DELTA_PASS", "NEED_KB", "HAS_DECAY"}
    assert "DOT_PREC" in names


@pytest.mark.parametrize("path,name", [("cem/alibi.energy", "CEMAlibiAttention"),
                                       ("nrgpt/attention.energy", "NRGPTAttention"),
                                       ("intrinsic-optimizers/gated-linear-attention.energy",
                                        "GatedLinearAttention"),
                                       ("cem/mlp.energy", "CEMMLP"),  # gated SiLU
                                       ("nrgpt/ff1.energy", "NRGPTFF1"),  # gated GELU
                                       ("intrinsic-optimizers/momen-mha.energy", "MomenMHA"),  # + momentum
                                       ("intrinsic-optimizers/nag-mha.energy", "NagMHA")])  # + look-ahead
def test_written_file_runs_and_matches_torch_backend(tmp_path: Path, path: str, name: str) -> None:
    """Imported from disk, the written module's displacement and gradients equal the float64 torch backend."""
    derived = load(ROOT / "examples" / path).energy(name)
    out = tmp_path / f"{name.lower()}_written.py"
    out.write_text(energy_source(derived, "triton"))
    written = getattr(_import(out, f"written_{name}"), type(module_class(derived, "torch")()).__name__)
    torch.manual_seed(0)
    ref = module_class(derived, "torch")().double().to(DEVICE)
    tri = written().to(DEVICE)
    tri.load_state_dict(ref.state_dict())
    x = ref.example_input(2, 13).to(DEVICE)
    w = torch.randn(x.shape, device=DEVICE, dtype=torch.float64)
    got_x, want_x = x.float().requires_grad_(), x.double().requires_grad_()
    got, want = tri(got_x, delta=True), ref(want_x, delta=True)
    assert _rel(got, want) < 1e-4
    g = torch.autograd.grad((got * w.float()).sum(), [got_x, *tri.parameters()])
    r = torch.autograd.grad((want * w).sum(), [want_x, *ref.parameters()])
    for label, a, b in zip(["x"] + [n for n, _ in ref.named_parameters()], g, r):
        assert _rel(a, b) < 1e-3, label


def test_one_specialisation_per_file() -> None:
    """Two energies with the same score terms share one kernel section; the op sets are named by content."""
    spec = load(ROOT / "examples/intrinsic-optimizers/mha.energy")
    src = energy_source([spec.energy("MHA"), spec.energy("MHA", heads=1)], "triton")
    assert src.count("@triton.jit") == 6  # _scores, the block ranges, forward, dK/dV, dQ
    req = KernelRequest.attention(strict=False, alibi=False, self_bias=False, key_bias=False)
    assert f"{req.name} = attention_ops(" in src
    assert req.tag != KernelRequest.attention(strict=True, alibi=False, self_bias=False, key_bias=False).tag


def test_a_specialised_set_refuses_calls_it_was_not_made_for() -> None:
    """A copy baked without a strict mask must not silently run a strict call."""
    derived = load(ROOT / "examples/intrinsic-optimizers/mha.energy").energy("MHA")
    module = sys.modules[module_class(derived, "triton").__module__]
    req = KernelRequest.attention(strict=False, alibi=False, self_bias=False, key_bias=False)
    ops = getattr(module, req.name)
    q = torch.randn(1, 1, 5, 4, device=DEVICE)
    assert ops.energy_attention(q, q, q, scale=0.5).shape == q.shape
    with pytest.raises(ValueError, match="STRICT=True"):
        ops.energy_attention(q, q, q, scale=0.5, strict=True)


# what each energy's activation leaves in its gated copy: G and G' printed from the energy (`_act_and_grad`)
FORMULAS = {"silu": ["x * tl.sigmoid(x)", "tl.sigmoid(x) * (1.0 + x * (1.0 - tl.sigmoid(x)))"],
            "gelu(x) dgelu(x)": ["x * 0.5 * (1.0 + tl.math.erf(", "0.3989422804014327 * "]}


@pytest.mark.parametrize("path,name,act", [("cem/mlp.energy", "CEMMLP", "silu"),
                                           ("nrgpt/ff1.energy", "NRGPTFF1", "gelu(x) dgelu(x)")])
def test_gated_activation_kernels_are_written_for_the_energys_activation(path: str, name: str, act: str) -> None:
    """value * G(pre) runs on gated kernels written into the file, with the energy's G and G' printed in place of
    the templates' activation table (NRGPT FF1's GELU(a) GELU'(a) with no value: one fused function)."""
    src = energy_source(load(ROOT / "examples" / path).energy(name), "triton")
    kernels = _kernels(src)
    assert {k.rsplit("_", 1)[0] for k in kernels} == {"_act_and_grad", "_gated_fwd_kernel", "_gated_bwd_kernel"}
    helper = next(v for k, v in kernels.items() if k.startswith("_act_and_grad"))
    for formula in FORMULAS[act]:
        assert formula in helper, formula
    if act == "silu":
        assert "gelu" not in src and "erf" not in src
    assert "if " not in helper  # no table left: the energy's function only
    names = {n.id for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Name)}
    names |= {a.arg for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) for a in n.args.args}
    assert not names & {"ACT", "HAS_VALUE"}
    ops = next(line.split(" = ")[0] for line in src.splitlines() if "= gated_activation_ops(" in line)
    value = "gamma" if act == "silu" else "None"  # W @ h, its `let` name; FF1's product has no value
    assert f"{ops}.gated_activation(" in src and f", {value}, {act!r})" in src
    assert "from energydsl import kernels" not in src  # no call left to the package's generic ops


# G as the IR gives it (s the variable), what the call names it, and whether the product has a value
_S = scalar_functions.VAR
GATES = {
    "silu": ir.func("silu", _S),
    "dgelu": ir.func("dgelu", _S),  # its G' is GELU''
    "gelu(x) dgelu(x)": ir.mul(ir.func("gelu", _S), ir.func("dgelu", _S)),
    "exp(-x x) x": ir.mul(_S, ir.func("exp", ir.mul(ir.scalar(-1), _S, _S))),
    "relu(x) step(x)": ir.mul(ir.func("relu", _S), ir.func("step", _S)),  # G' has step' = 0 dropped
}


@pytest.mark.parametrize("has_value", [True, False])
@pytest.mark.parametrize("label", GATES)
def test_each_gated_copy_computes_its_function_and_only_it(tmp_path: Path, label: str, has_value: bool) -> None:
    """A gated copy with G printed from the IR equals value * G (or G) in float64, values and both gradients, and
    refuses a call it was not made for (another function, or a value where it has none: both would silently
    compute the baked product)."""
    class _Emitter:
        scalars: dict = {}

    printed = scalar_functions.scalar_function(_Emitter(), GATES[label])  # type: ignore[arg-type]
    req = KernelRequest.gated(label, printed.pair, printed.torch, value=has_value)
    path = tmp_path / "gated.py"
    header = ["import torch", "import torch.nn.functional as F", *kernel_imports([req])]  # a module's own imports
    path.write_text("\n".join([*header, "", "", *kernel_source([req])]))
    ops = getattr(_import(path, f"gated_{req.tag}"), req.name)
    reference = eval(f"lambda x: {printed.torch}", {"torch": torch, "F": torch.nn.functional})
    gen = torch.Generator().manual_seed(0)
    gate, value, up = (s * torch.randn(3, 333, generator=gen) for s in (2.0, 1.0, 1.0))  # several programs
    gate, value, up = gate.to(DEVICE).requires_grad_(), value.to(DEVICE).requires_grad_(), up.to(DEVICE)
    inputs = [gate, value] if has_value else [gate]
    got = ops.gated_activation(gate, value if has_value else None, label)
    gate64, value64 = gate.detach().double().requires_grad_(), value.detach().double().requires_grad_()
    want = reference(gate64) * (value64 if has_value else 1.0)
    assert got.dtype == torch.float32 and _rel(got, want) < 1e-5
    g = torch.autograd.grad((got * up).sum(), inputs)
    r = torch.autograd.grad((want * up.double()).sum(), [gate64, value64][:len(inputs)])
    for a, b in zip(g, r, strict=True):
        assert _rel(a, b) < 1e-5
    with pytest.raises(ValueError, match="specialised for .*ACT='other'"):
        ops.gated_activation(gate, value if has_value else None, "other")
    with pytest.raises(ValueError, match=f"HAS_VALUE={not has_value}"):
        ops.gated_activation(gate, None if has_value else value, label)
    # float64 takes the reference path: the same product
    assert _rel(ops.gated_activation(gate64, value64 if has_value else None, label), want) < 1e-12


# (energy of tests/data/element-wise-gates.energy, [(G's label, its value)]): the gated calls its update makes
ELEMENT_WISE_GATES = [("SoftplusGate", [("softplus", "c0")]),  # no named activation of the generic kernels
                      ("GaussianBumps", [("exp(-x x) x", "None")]),  # all of W^T(a exp(-a²)): the innermost a
                      ("NewtonSilu", [("silu", "c0"), ("dsilu", "t8")]),  # gradient and Hessian-vector product
                      ("WeightedSigmoid", [])]  # a parameter vector times a sigmoid: not an epilogue


@pytest.mark.parametrize("name,calls", ELEMENT_WISE_GATES)
def test_products_of_functions_of_one_tensor_become_gated_calls(name: str, calls: list[tuple[str, str]]) -> None:
    """Which products fuse, with which G and value (tests/test_triton_backend.py runs them against torch)."""
    src = energy_source(load(ROOT / "tests/data/element-wise-gates.energy").energy(name), "triton")
    found = [(m.group(2), m.group(1)) for m in re.finditer(r"\.gated_activation\(\w+, (\w+), '([^']*)'\)", src)]
    assert found == calls


@pytest.mark.parametrize("path,name", [("intrinsic-optimizers/momen-mha.energy", "MomenMHA"),
                                       ("intrinsic-optimizers/nag-mha.energy", "NagMHA")])
def test_momentum_kernels_are_written_into_the_file(path: str, name: str) -> None:
    """The fused step m = beta m + f, x = x + eta m runs on momentum kernels written into the file."""
    src = energy_source(load(ROOT / "examples" / path).energy(name), "triton")
    kernels = _kernels(src)
    momentum = {k.rsplit("_", 1)[0]: v for k, v in kernels.items() if k.startswith("_momentum")}
    assert set(momentum) == {"_momentum_fwd_kernel", "_momentum_bwd_kernel"}
    assert "m_new = beta * m + f" in momentum["_momentum_fwd_kernel"]
    ops = KernelRequest.momentum().name
    assert f"{ops} = momentum_ops(" in src and f"{ops}.momentum_update(" in src
    # nag's look-ahead x + c m (c = -beta) on its own pair, written into the file too
    nesterov = {k.rsplit("_", 1)[0]: v for k, v in kernels.items() if k.startswith("_nesterov")}
    assert set(nesterov) == ({"_nesterov_fwd_kernel", "_nesterov_bwd_kernel"} if name == "NagMHA" else set())
    assert name != "NagMHA" or "x + c * m" in nesterov["_nesterov_fwd_kernel"]


def _chain(x, MODE):  # an if/elif chain on a string, as `_act_and_grad`'s on ACT
    if MODE == "add":
        y = x + 1
    elif MODE == "mul":
        y = x * 3
    elif MODE != "neg":
        y = x - 5
    else:
        y = -x
    return y


@pytest.mark.parametrize("mode", ["add", "mul", "neg", "other"])
def test_specialise_folds_elif_chains_on_strings(mode: str) -> None:
    """`==` / `!=` on a baked string keep one branch of an elif chain and remove the others."""
    src = specialise(_chain, {"MODE": mode}, {"_chain": "baked"})
    fn = ast.parse(src).body[0]
    assert not any(isinstance(n, ast.If) for n in ast.walk(fn)) and "MODE" not in src
    assert len(fn.body) == 2  # the kept assignment and the return
    scope: dict = {}
    exec(src, scope)  # noqa: S102 - the test's own template
    for x in (0, 2):
        assert scope["baked"](x) == _chain(x, mode)


def _template(x, FLAG, MODE, OTHER):  # a plain function stands in for a kernel template
    y = x
    if FLAG:
        y = y + 1
    else:
        y = y - 1
    if not FLAG and MODE == "double":
        y = y * 2
    if FLAG and OTHER > 0:
        y = y + OTHER
    z = 10 if MODE != "double" else 20
    return y + z


@pytest.mark.parametrize("flag", [True, False])
@pytest.mark.parametrize("mode", ["double", "single"])
def test_specialise_folds_branches_and_keeps_the_rest(flag: bool, mode: str) -> None:
    """Baking some parameters gives a function equal to the template on every remaining input."""
    src = specialise(_template, {"FLAG": flag, "MODE": mode}, {"_template": "baked"})
    assert "FLAG" not in src and "MODE" not in src and "def baked(x, OTHER)" in src
    scope: dict = {}
    exec(src, scope)  # noqa: S102 - the test's own template
    for x in (0, 3):
        for other in (-1, 2):
            assert scope["baked"](x, other) == _template(x, flag, mode, other)


def _orphans(x, FLAG):  # a template whose removed branch was the only reader of two chained values
    a = x * 2
    b = a + 1
    acc = 0
    for i in range(3):
        acc += i
    if FLAG:
        return x + b + acc
    return x


def test_specialise_drops_stores_only_the_removed_branches_read() -> None:
    src = specialise(_orphans, {"FLAG": False}, {"_orphans": "baked"})
    assert "a = " not in src and "b = " not in src and "acc" not in src, src
    assert "for i in range(3):\n        pass" in src  # the emptied loop stays a valid block
    kept = specialise(_orphans, {"FLAG": True}, {"_orphans": "baked"})
    scope: dict = {}
    exec(kept, scope)  # noqa: S102 - the test's own template
    assert scope["baked"](5) == _orphans(5, True)


def test_generated_files_have_no_unused_names(tmp_path: Path) -> None:
    """Every example, both backends: no variable assigned and never read (F841), no undefined name (F821)
    in the generated modules and the kernels written into them, which people read."""
    files = sorted((ROOT / "examples").rglob("*.energy"))
    for path in files:
        derived = load(path).derive()
        for backend in ("torch", "triton") if derived else ():
            (tmp_path / f"{path.parent.name}_{path.stem}_{backend}.py".replace("-", "_")).write_text(
                energy_source(derived, backend))
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F841,F821",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_copies_define_every_function_they_call(family: str) -> None:
    """A template's call to a @triton.jit helper the family does not list would reach the generated file
    under its template name, undefined there, and fail only when a GPU compiles that branch (e.g. a
    constexpr mode the interpreter tests leave off): every called `_name` must be a written copy."""
    request = {"attention": KernelRequest.attention(True, True, True, True, second=False),
               "attention_wide": KernelRequest.attention(False, True, True, True, second=True, wide=True),
               "linear": KernelRequest.linear(strict=False, decay=True),
               "gated": KernelRequest.gated("silu", "return x * tl.sigmoid(x), tl.sigmoid(x)", "F.silu(x)", True),
               "momentum": KernelRequest.momentum(), "nesterov": KernelRequest.nesterov(),
               "pointwise": KernelRequest.pointwise(True, True, True, True, True, "return tl.sigmoid(x)",
                                                    "return tl.sigmoid(x) * (1.0 - tl.sigmoid(x))",
                                                    "torch.sigmoid(x)"),
               "pointwise_wide": KernelRequest.pointwise(True, True, True, True, True, "return tl.sigmoid(x)",
                                                         "return tl.sigmoid(x) * (1.0 - tl.sigmoid(x))",
                                                         "torch.sigmoid(x)", wide=True)}[family]
    tree = ast.parse("\n".join(kernel_source([request])))
    defined = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    called = {node.func.id for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id.startswith("_")}
    assert called <= defined, called - defined


def test_generating_needs_no_triton() -> None:
    """`energy compile --backend triton` writes the file on a machine where triton cannot be imported."""
    script = (
        "import sys; sys.modules['triton'] = None\n"  # any `import triton` now raises ImportError
        "from energydsl import load\n"
        "from energydsl.codegen import energy_source\n"
        f"d = load({str(ROOT / 'examples/cem/alibi.energy')!r}).energy('CEMAlibiAttention')\n"
        "print(energy_source(d, 'triton').count('@triton.jit'))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "6"


@pytest.mark.parametrize("path,name,dims", [("examples/cem/alibi.energy", "CEMAlibiAttention", {}),
                                            ("examples/cem/mlp.energy", "CEMMLP", {}),
                                            ("examples/nrgpt/ff1.energy", "NRGPTFF1", {}),  # a gate, no value
                                            ("examples/intrinsic-optimizers/momen-mha.energy", "MomenMHA", {}),
                                            ("examples/intrinsic-optimizers/nag-mha.energy", "NagMHA", {}),
                                            ("tests/data/weighted-context-sums.energy", "SigmoidAttention", {}),
                                            ("tests/data/weighted-context-sums.energy", "SigmoidAttention",
                                             dict(d=264, heads=1))])  # the wide pointwise kernels
def test_generated_module_runs_under_torch_compile(path: str, name: str, dims: dict) -> None:
    """The specialised op sets are registered torch.library ops (with fake kernels under the interpreter),
    so torch.compile traces a generated layer instead of breaking on the Triton launch."""
    derived = load(ROOT / path).energy(name, **dims)
    torch.manual_seed(0)
    layer = module_class(derived, "triton")().to(DEVICE)
    x = layer.example_input(2, 13).to(DEVICE)
    compiled = torch.compile(layer, backend="inductor" if CUDA else "aot_eager", fullgraph=True)
    eager = layer(x, delta=True)
    got = compiled(x, delta=True)
    assert _rel(got, eager) < 1e-6
    grad = torch.autograd.grad(got.square().sum(), list(layer.parameters()), allow_unused=True)
    assert any(g is not None and g.abs().max() > 0 for g in grad)


# ---------------------------------------------------------------------------------------------------------
# Compiled mode (no interpreter): generated files say `from __future__ import annotations`, so a copied
# kernel's `X: tl.constexpr` is the string "tl.constexpr"; triton must still see a constexpr there.
# ---------------------------------------------------------------------------------------------------------

_COMPILED_COPIES = """
import importlib, sys, tempfile
from pathlib import Path
from energydsl.codegen.triton_source import FAMILIES, KernelRequest, kernel_imports, kernel_source

requests = [
    KernelRequest.attention(strict=True, alibi=True, self_bias=True, key_bias=False),
    KernelRequest.attention(strict=False, alibi=False, self_bias=False, key_bias=True, second=True, wide=True),
    KernelRequest.linear(strict=False, decay=True),
    KernelRequest.gated("gelu", "t0 = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))\\n"
                        "return x * t0, t0 + x * tl.exp(-0.5 * x * x) * 0.3989422804014327", "F.gelu(x)", True),
    KernelRequest.gated("sigmoid", "t0 = tl.sigmoid(x)\\nreturn t0, t0 * (1.0 - t0)", "torch.sigmoid(x)", False),
    KernelRequest.momentum(),
    KernelRequest.nesterov(),
    KernelRequest.pointwise(True, True, False, True, False, "return tl.sigmoid(x)",
                            "return tl.sigmoid(x) * (1.0 - tl.sigmoid(x))", "torch.sigmoid(x)"),
    KernelRequest.pointwise(False, False, True, True, True, "return tl.sigmoid(x)",
                            "return tl.sigmoid(x) * (1.0 - tl.sigmoid(x))", "torch.sigmoid(x)", wide=True),
]
from energydsl import ir
from energydsl.codegen.scalar_functions import VAR, scalar_function
from energydsl.functions import antiderivative


class _Emitter:
    scalars = {}


printed = scalar_function(_Emitter(), ir.func(antiderivative("gelu"), VAR))  # G and G' printed from SymPy's formulas
requests.append(KernelRequest.gated("int_gelu", printed.pair, printed.torch, True))
text = "\\n".join(["from __future__ import annotations", *kernel_imports(requests), *kernel_source(requests)])
path = Path(tempfile.mkdtemp()) / "copies.py"
path.write_text(text)
sys.path.insert(0, str(path.parent))
copies = importlib.import_module("copies")
COMPILE = {COMPILE}
checked = 0
for req in requests:
    fam = FAMILIES[req.family]
    for name in (*fam.helpers, *fam.kernels):
        template = next(getattr(m, name) for m in (importlib.import_module(f"energydsl.kernels.{t}")
                                                   for t in fam.templates) if hasattr(m, name))
        copy = getattr(copies, f"{name}_{req.tag}")
        gone = dict(req.baked) | dict(req.functions)  # baked in, and the generated functions called by name
        want = {p.name: p.is_constexpr for p in template.params if p.name not in gone}
        got = {p.name: p.is_constexpr for p in copy.params}
        assert got == want, (req.family, name, got, want)
        checked += 1
        if COMPILE and name in fam.kernels:
            import triton
            from triton.backends.compiler import GPUTarget
            from triton.compiler import ASTSource

            values = dict(DOT_PREC="ieee", BLOCK_M=64, BLOCK_N=64, BLOCK_DK=64, BLOCK_DV=64, BLOCK_D=64,
                          NEED_KB=True, NEED_SELF=False, NEED_ALIBI=False, C=64, BK=64, BV=64, BLOCK=1024,
                          REVERSE=True, FEATURE_LOOP=True, DQ_ATOMIC=True, DELTA_PASS=True)
            consts = {p.name: values[p.name] for p in copy.params if p.is_constexpr}
            ints = {"T", "H", "D_QK", "D_V", "N", "T_TUNE"} | ({"K", "V"} if req.family == "linear" else set())
            sig = {p.name: "constexpr" if p.is_constexpr else "i32" if p.name in ints or p.name.startswith("stride_")
                   else "fp32" if p.name == "scale" else "*fp32" for p in copy.params}
            triton.compile(ASTSource(copy, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "num_stages": 2})
print("compiled", checked)
"""


def test_copies_keep_their_constexprs_in_compiled_mode() -> None:
    """Each specialised copy, imported from a file with string annotations outside the interpreter, has
    exactly the template's constexpr parameters (less the baked ones)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILED_COPIES.replace("{COMPILE}", "False")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "compiled 52" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.slow
def test_copies_compile_for_gpu() -> None:
    """The specialised copies themselves compile for sm_90 on a CPU-only machine."""
    compile_for_gpu(_COMPILED_COPIES.replace("{COMPILE}", "True"))


@pytest.mark.parametrize("request_", [
    KernelRequest.attention(strict=True, alibi=True, self_bias=True, key_bias=True),
    KernelRequest.attention(strict=False, alibi=True, self_bias=False, key_bias=False, second=True, wide=True),
    KernelRequest.linear(strict=False, decay=True),
    KernelRequest.momentum(),
    KernelRequest.nesterov(),
], ids=["attention", "wide-second", "linear", "momentum", "nesterov"])
def test_written_kernels_wrap_long_lines_and_keep_the_code(request_: KernelRequest) -> None:
    """Headers and calls are split one argument per line; the code parses to the same tree as unwrapped."""
    text = "\n".join(kernel_source([request_]))
    docstrings = {n for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Constant)
                  and isinstance(node.value, str) and node.end_lineno > node.lineno
                  for n in range(node.lineno, node.end_lineno + 1)}
    long = [ln for n, ln in enumerate(text.splitlines(), 1) if len(ln) > WIDTH and n not in docstrings]
    assert not long, long
    unwrapped = [ast.unparse(ast.parse(block)) for block in text.split("\n\n\n") if block.strip()]
    assert [ast.dump(ast.parse(u)) for u in unwrapped] == [
        ast.dump(ast.parse(block)) for block in text.split("\n\n\n") if block.strip()]


def test_wrapping_leaves_a_docstring_that_reads_like_a_call() -> None:
    long_call = "f(" + ", ".join(f"argument_{i}" for i in range(20)) + ")"
    source = f'def g(x):\n    """\n    {long_call}\n    """\n    y = {long_call}\n    return y'
    wrapped = wrap_long_lines(source)
    assert f"    {long_call}\n" in wrapped  # the docstring line is kept as it was
    assert "    y = f(\n        argument_0,\n" in wrapped  # the statement is split
    assert ast.dump(ast.parse(wrapped)) == ast.dump(ast.parse(source))

"""The Python API as a notebook uses it (found by a review, 2026-12-03): a working directory changed after `load`, a
cache cleared under a live module, dims named as the API's own arguments, `block()` without a name, a model's
example inputs, and dtypes no layer computes in."""

import copy
import io
import shutil
from pathlib import Path

import pytest
import torch

import energydsl
from energydsl.errors import SpecError, UserError

ROOT = Path(__file__).resolve().parent.parent
DIMS = dict(vocab=11, context=8, d=8, layers=1, heads=2)


def test_a_run_records_where_the_spec_is_though_the_working_directory_changed(tmp_path, monkeypatch) -> None:
    """`load("sub/x.energy")`, then `os.chdir`: the run recorded `<new cwd>/sub/<string>`, and `load_trained`
    then failed on the imports it resolved there."""
    (tmp_path / "sub").mkdir()
    for name in ("llama.energy", "rope-llama.energy"):
        shutil.copy(ROOT / "examples/models" / name, tmp_path / "sub" / name)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    spec = energydsl.load("sub/rope-llama.energy")
    monkeypatch.chdir(tmp_path / "elsewhere")
    model = spec.model("RopeLlama", **DIMS, mlp=8)
    assert model.run_metadata["spec_path"] == str(tmp_path / "sub" / "rope-llama.energy")
    text = energydsl.load("energy A(d = 4) { state z[d]  global F = 0.5 * (z . z) }", base=tmp_path)
    assert text._source == tmp_path / "<string>"


def test_a_module_copies_and_saves_after_the_code_cache_is_cleared(tmp_path, monkeypatch) -> None:
    """deepcopy and torch.save read the generated file again: FileNotFoundError once the cache was cleared."""
    monkeypatch.setenv("ENERGYDSL_CACHE", str(tmp_path / "cache"))
    module = energydsl.load(ROOT / "examples/intrinsic-optimizers/mha.energy").module(d=4, heads=2, eta=0.3125)
    shutil.rmtree(tmp_path / "cache")
    twin = copy.deepcopy(module)
    buffer = io.BytesIO()
    torch.save(module, buffer)
    x = module.example_input(1, 3)
    torch.testing.assert_close(twin(x), module(x))


@pytest.mark.parametrize("dim", ["name", "self", "backend", "device", "dtype"])
def test_a_dim_named_as_an_api_argument_is_refused_where_it_is_declared(dim: str) -> None:
    """`energy E(device = 4)` loaded, but `.module(device=2)` took the device, `.energy(name=2)` the name and
    `.energy(self=2)` failed with "multiple values for argument 'self'"."""
    text = f"energy E({dim} = 4) {{ state z[{dim}]  global F = 0.5 * (z . z) }}"
    with pytest.raises(SpecError) as info:
        energydsl.load(text)
    assert info.value.span.line == 1 and info.value.span.column == 10, info.value.span
    assert f"`{dim}` is an argument of the Python API's calls" in info.value.message
    assert energydsl.load(text.replace(dim, f"n_{dim}")).energy(**{f"n_{dim}": 2}).spec.dim_values[f"n_{dim}"] == 2


def test_block_without_a_name_takes_the_files_one() -> None:
    """`.block(None)` said "declares no block" of a file that declares one."""
    stages = energydsl.load(ROOT / "examples/models/nrgpt.energy").block()
    assert [d.spec.name for d in stages] == ["NRGPTBlock"]
    with pytest.raises(SpecError, match="declares no block"):
        energydsl.load(ROOT / "examples/models/gpt.energy").block()


def test_a_models_example_inputs_are_on_its_device_and_by_name() -> None:
    """A model's example_input was on the CPU wherever its weights were, and it had no example_inputs."""
    model = energydsl.load(ROOT / "examples/models/gpt.energy").model(**DIMS)
    inputs = model.example_inputs(2, 5)
    assert set(inputs) == {"idx"} and inputs["idx"].shape == (2, 5)
    assert model(**inputs).shape == (2, 5, 11)
    assert copy.deepcopy(model).to("meta").example_input(1, 2).device.type == "meta"


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", torch.float8_e5m2])
def test_a_dtype_no_layer_computes_in_is_refused(dtype) -> None:
    """float8 passed `is_floating_point`, built, and failed at the first call ("normal_kernel_cpu" not
    implemented)."""
    with pytest.raises(UserError, match="dtype must be a floating torch dtype a layer computes in") as info:
        energydsl.load(ROOT / "examples/cem/mlp.energy").module(d=4, dv=8, dtype=dtype)
    assert "float8 types hold weights for scaled matmuls" in info.value.hint


def test_the_subpackages_the_docs_name_in_full_work_after_import_energydsl() -> None:
    """`energydsl.search.register_space` (docs/search.md), `energydsl.training.data.download_shakespeare`
    (README) and `energydsl.codegen.module_class` (docs/models.md) were AttributeErrors after `import energydsl`."""
    import subprocess
    import sys

    names = ["search.register_space", "training.data.download_shakespeare", "codegen.module_class",
             "codegen.energy_source", "kernels.sigmoid_attention", "runtime"]
    code = "import energydsl\n" + "".join(f"energydsl.{n}\n" for n in names) + "print(sorted(dir(energydsl)))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)  # a fresh import
    assert r.returncode == 0, r.stderr
    assert {"search", "training", "codegen", "kernels", "runtime", "load"} <= set(eval(r.stdout))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        energydsl.nope  # noqa: B018

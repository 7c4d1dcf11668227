"""`train`, `sample`, `TrainConfig` and `load_checkpoint` called from Python with the wrong kinds of arguments:
a UserError (or ValueError) naming the argument, never an error from deep inside torch (found by an audit of the
Python API as a notebook uses it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import STRICT_SELF_BIAS, energy_in_process

import energydsl
from energydsl.errors import SpecError, TrainingDiverged, UserError
from energydsl.training import TrainConfig, load_checkpoint, load_dataset, sample, train

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gpt():
    return energydsl.load(ROOT / "examples/models/gpt.energy").model(vocab=40, context=8, d=8, layers=1, heads=2)


@pytest.fixture()
def data(corpus: Path):
    return load_dataset(f"chars:{corpus}")


def tiny(**settings) -> TrainConfig:
    return TrainConfig(**{"steps": 2, "batch_size": 2, "block_size": 8, "eval_interval": 2, "eval_iters": 1,
                          **settings})


@pytest.mark.parametrize("settings,message", [
    ({"batch_size": 2.5}, "batch_size must be a whole number, got 2.5 (float)"),  # torch.randint's overloads
    ({"steps": 2.5}, "steps must be a whole number, got 2.5 (float)"),  # trained 3 steps
    ({"steps": "3"}, "steps must be a whole number, got '3' (str)"),
    ({"lr": "1e-3"}, "lr must be a number, got '1e-3' (str)"),  # '>' not supported between 'str' and 'int'
    ({"grad_clip": None}, "grad_clip must be a number, got None (NoneType)"),
    ({"betas": 0.9}, "betas must be two numbers in [0, 1), got 0.9"),  # object of type 'float' has no len()
    ({"steps": True}, "steps must be a whole number, got True (bool)"),
    ({"compile": 1}, "compile must be True or False, got 1"),
    # AdamW's first step, lr / (1 - beta1), passed to torch as a float: an internal error (exit 70) at step 1
    ({"lr": 1e38}, "lr 1e+38 is too large: AdamW's first step size, lr / (1 - beta1) = 1e+39, overflows a float32 "
                   "(at most 3.4e+38)"),
])
def test_a_setting_of_the_wrong_type_is_named(settings: dict, message: str) -> None:
    with pytest.raises(UserError) as err:
        tiny(**settings).validate()
    assert err.value.message == message


def test_a_torch_dtype_is_taken_as_its_name() -> None:
    """`.model(dtype=torch.bfloat16)` takes a torch dtype; `TrainConfig(dtype=torch.bfloat16)` was "unknown"."""
    config = tiny(dtype=torch.bfloat16)
    config.validate()
    assert config.dtype == "bfloat16"
    with pytest.raises(UserError, match="unknown dtype 'torch.float64'"):
        tiny(dtype=torch.float64).validate()


def test_whole_numbers_of_other_types_are_taken_as_ints(gpt, data) -> None:
    """8 / 2 is 4.0 and numpy's ints are not ints: both were refused or failed inside torch; the seed's message
    said `must be a whole number in [0, 2**64), got 1`."""
    config = tiny(block_size=16 / 2, seed=np.int64(1), steps=np.int32(2), lr=np.float32(1e-3), betas=[0.8, 0.9])
    assert train(gpt, data, config, None, metadata={}, progress=False)["steps"] == 2
    config.validate()  # train() validates a copy: the caller's config is theirs
    assert (config.block_size, config.seed, config.steps, config.betas) == (8, 1, 2, (0.8, 0.9))
    assert all(type(v) is int for v in (config.block_size, config.seed, config.steps)) and type(config.lr) is float


def test_train_names_an_argument_of_the_wrong_kind(gpt, data) -> None:
    layer = energydsl.load(ROOT / "examples/intrinsic-optimizers/mha.energy").module(d=8, heads=2)
    cases = [
        (lambda: train(gpt, "shakespeare_char", tiny(), None, metadata={}), "dataset must be an LMDataset, got str"),
        (lambda: train(gpt, data, {"steps": 2}, None, metadata={}), "config must be a TrainConfig, got dict"),
        (lambda: train(gpt, data, tiny(), None, metadata=["gpt"]), "metadata must be a dict"),
        (lambda: train(layer, data, tiny(), None, metadata={}), "MHA is one energy layer (states to states); "
                                                                "train() takes a language model"),
        # saved as its repr (never equal on resume) / "x is NaN there, NaN now": a run that could not resume
        (lambda: train(gpt, data, tiny(), None, metadata={"x": object()}), "metadata must be plain JSON (strings, "
                                                                         "finite numbers, lists, dicts; paths are "
                                                                         "taken), but it holds a object"),
        (lambda: train(gpt, data, tiny(), None, metadata={"x": float("nan")}), "metadata must be plain JSON"),
        (lambda: train(gpt, data, tiny(), None, metadata={}, resume="no"), "resume must be True or False, got 'no'"),
        (lambda: train(gpt, data, tiny(), None, metadata={}, on_eval=5), "on_eval must be a function (or None)"),
        (lambda: train(gpt, data, tiny(), None, metadata={}, notify=5), "notify must be a function (or None)"),
        (lambda: train(gpt, data, tiny(), None, metadata={}, names=["lr"]), "names must be a dict"),
        (lambda: train(gpt, data, tiny(), 5, metadata={}), "out_dir must be a path (or None: no files), got int"),
    ]
    for call, message in cases:
        with pytest.raises(UserError) as err:
            call()
        assert err.value.message.startswith(message), err.value.message


@pytest.mark.parametrize("kwargs,message", [
    ({"dataset_or_codec": None}, "dataset_or_codec must be a dataset or its codec"),
    ({"max_new_tokens": -3}, "max_new_tokens must be a whole number >= 0, got -3"),  # returned '' silently
    ({"max_new_tokens": 2.5}, "max_new_tokens must be a whole number >= 0, got 2.5"),
    ({"temperature": float("nan")}, "temperature must be a number (<= 0: greedy), got nan"),  # torch.multinomial's
    ({"temperature": "1"}, "temperature must be a number (<= 0: greedy), got '1'"),  # '<=' not supported
    ({"top_k": 2.5}, "top_k must be a whole number >= 1 (or None: every token), got 2.5"),  # topk(): 'k' int
    ({"top_k": -1}, "top_k must be a whole number >= 1 (or None: every token), got -1"),  # kept every token
    ({"prompt": 5}, "prompt must be a string, got 5"),  # 'int' object is not iterable
    ({"prompt": None}, "prompt must be a string, got None"),  # sampled as if empty
    ({"generator": 1}, "generator must be a torch.Generator (or None), got int"),
    ({"model": None}, "model must be a torch.nn.Module, got NoneType"),
])
def test_sample_names_an_argument_of_the_wrong_kind(gpt, data, kwargs: dict, message: str) -> None:
    with pytest.raises(UserError) as err:
        sample(**{"model": gpt, "dataset_or_codec": data, "prompt": "to", "max_new_tokens": 3, **kwargs})
    assert err.value.message.startswith(message), err.value.message
    assert len(sample(gpt, data, "to", np.int64(3))) == 3


def test_a_prompt_of_spaces_alone_samples_as_an_empty_one(gpt) -> None:
    """A words or ints vocabulary (ListOps, MQAR) encodes `"   "` as no tokens: the model got a (1, 0) input and
    `energy sample --prompt "   "` exited 70."""
    from energydsl.training.sampling import IntCodec, WordCodec

    for codec in (WordCodec(["(", ")", "x"]), IntCodec(3)):
        assert sample(gpt, codec, "   ", 4, temperature=0) == sample(gpt, codec, "", 4, temperature=0)

def test_load_checkpoint_names_a_wrong_which(gpt, data, tmp_path: Path) -> None:
    train(gpt, data, tiny(), tmp_path, metadata={}, progress=False)
    with pytest.raises(ValueError, match='which must be "best" or "last" .*got \'latest\''):  # "no checkpoint in"
        load_checkpoint(tmp_path, which="latest")
    assert load_checkpoint(tmp_path, which="last")[1]["training"]["step"] == 2


def test_a_divergence_says_why_and_what_to_change(gpt, data) -> None:
    """str(e) was `training diverged at step 1 (loss = ...)`: the reason and the remedy were attributes only."""
    with pytest.raises(TrainingDiverged) as err:
        config = tiny(steps=30, lr=1e4, weight_decay=0, warmup_steps=0, log_interval=1)
        train(gpt, data, config, None, metadata={}, progress=False)
    assert str(err.value).startswith(f"training diverged at step {err.value.step}: {err.value.reason}")
    assert str(err.value).endswith("; try a lower lr"), str(err.value)


def test_an_out_dir_that_is_a_file_is_named(gpt, data, tmp_path: Path) -> None:
    """From Python it was pathlib's FileExistsError (the CLI checks --out itself)."""
    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    with pytest.raises(UserError) as err:
        train(gpt, data, tiny(), target, metadata={}, progress=False)
    assert err.value.message == f"out_dir {target} is a file, not a directory" and target.read_text() == "keep me"


# ----------------------------------------------------------------------------- arguments of the wrong kind


@pytest.mark.parametrize("layers", [0, -3, 2.5, "2", True])
def test_model_sizes_refuse_a_layer_count_that_is_not_one(layers) -> None:
    """`info(layers=0)` gave the model's own layers but counted parameters for none; -3 counted them negative."""
    model = energydsl.load(ROOT / "examples/models/gpt.energy").model("GPT", vocab=11, context=8, d=16, layers=1,
                                                                      heads=2)
    for count in (model.info, model.num_params, model.flops_per_token, model.activation_floats_per_token):
        with pytest.raises(ValueError, match="layers must be a whole number of at least 1"):
            count(layers=layers)
    assert model.num_params(layers=3) > model.num_params() == model.info()["params"]


def test_a_model_built_with_a_bad_layer_count_names_the_repeat_clause_and_its_dim() -> None:
    spec = energydsl.load(ROOT / "examples/models/gpt.energy")
    for layers in (0, 2.5):
        with pytest.raises(SpecError, match=f"`repeat layers` must be a whole number ≥ 1, got {layers}") as e:
            spec.model(layers=layers)
        assert e.value.span.line == next(i for i, line in enumerate(spec.syntax.text.splitlines(), 1)
                                         if line.strip() == "repeat layers")


def test_modules_and_models_take_a_device_and_dtype_as_torch_layers_do() -> None:
    import torch

    mha = energydsl.load(ROOT / "examples/intrinsic-optimizers/mha.energy")
    for dtype in (torch.float64, "float64"):
        layer = mha.module("MHA", d=16, heads=2, device="cpu", dtype=dtype)
        assert {p.dtype for p in layer.parameters()} == {torch.float64}
        assert layer(torch.randn(2, 5, 16, dtype=torch.float64)).dtype == torch.float64
    assert mha.energy("MHA", d=16, heads=2).module(dtype=torch.float64).Wo.dtype == torch.float64
    gpt = energydsl.load(ROOT / "examples/models/gpt.energy")
    model = gpt.model(vocab=11, context=8, d=16, layers=1, heads=2, dtype="float64")
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    logits = model(torch.randint(0, 11, (2, 8)))
    assert logits.dtype == torch.float64 and logits.shape == (2, 8, 11) and torch.isfinite(logits).all()
    for bad, message in ((dict(dtype="int64"), "dtype must be a floating torch dtype"),
                         (dict(dtype="floaty"), "got 'floaty'"), (dict(device="tpu"), "unknown device 'tpu'")):
        with pytest.raises(UserError, match=message):
            mha.module("MHA", d=16, heads=2, **bad)


@pytest.mark.parametrize("context", [0, -1, 7.5, float("nan"), "16", None])
def test_an_energys_flops_refuse_a_context_that_is_not_a_token_count(context) -> None:
    derived = energydsl.load(ROOT / "examples/intrinsic-optimizers/mha.energy").energy("MHA", d=16, heads=2)
    with pytest.raises(ValueError, match="context must be a whole number of tokens"):
        derived.flops_per_token(context)
    assert derived.flops_per_token(16) > 0


@pytest.mark.parametrize("delta", ["False", None, 0, 1])
def test_a_generated_forward_takes_delta_as_a_bool_only(delta) -> None:
    """`delta="False"` is truthy: it returned the displacement."""
    import torch

    module = energydsl.load(ROOT / "examples/intrinsic-optimizers/mha.energy").module("MHA", d=16, heads=2)
    x = torch.randn(1, 3, 16)
    with pytest.raises(TypeError, match="delta must be True or False"):
        module(x, delta=delta)
    assert torch.allclose(module(x, delta=True), module(x) - x, atol=1e-6)


def test_load_dataset_refuses_a_path_naming_what_it_takes(tmp_path: Path) -> None:
    """A Path was `'PosixPath' object has no attribute 'strip'`: a file's kind (chars: or bytes:) is in the name."""
    (tmp_path / "t.txt").write_text("hello world\n" * 50)
    with pytest.raises(UserError, match="load_dataset takes a dataset name, not a PosixPath") as e:
        load_dataset(tmp_path / "t.txt")
    assert "chars:PATH" in e.value.hint
    assert load_dataset(f"chars:{tmp_path / 't.txt'}").vocab_size > 0


@pytest.mark.parametrize("kwargs", [{"batch": 0}, {"seq": 100}, {"seq": -1}, {"batch": 2.5}])
def test_a_models_example_input_is_one_the_model_takes(gpt, kwargs) -> None:
    """(0, 8) and (2, 100) were returned, and refused by the model's own forward; -1 and 2.5 failed in torch."""
    with pytest.raises(ValueError, match="example_input: (batch|seq) must be a whole number of at least 1"):
        gpt.example_input(**kwargs)
    assert gpt.example_input().shape == (2, 8) and gpt(gpt.example_input(1, 8)).shape == (1, 8, 40)


@pytest.mark.parametrize("name", ["chars", "listops"])
@pytest.mark.parametrize("batch, block", [(-1, 8), (2.5, 8), (0, 8), (2, 2.5), (2, "8"), (2, float("nan"))])
def test_a_datasets_batch_and_block_are_whole_numbers(corpus, name, batch, block) -> None:
    """torch's `negative dimension` or randint's overload error, an empty batch for 0, or (NaN) nothing at all."""
    data = load_dataset(f"chars:{corpus}" if name == "chars" else "listops")
    with pytest.raises(UserError, match=r"(batch_size|block_size) must be a whole number, at least 1"):
        data.get_batch("train", batch, block if name == "chars" else 100)
        if not isinstance(block, int):
            data.check_block_size(block)
    assert data.get_batch("train", 2, 8 if name == "chars" else 100)[0].shape[0] == 2


@pytest.mark.parametrize("unroll", [0, -1, 2.5, "x"])
def test_a_plans_graph_takes_a_layer_count(unroll) -> None:
    plan = energydsl.load(ROOT / "examples/models/gpt.energy").plan("GPT")
    with pytest.raises(ValueError, match="unroll must be a whole number of layers"):
        plan.graph(unroll=unroll)
    assert plan.graph(unroll=None).graph["repeat"] == 1


@pytest.mark.parametrize("codec, says", [
    (None, "a codec is the dict Codec.to_json() writes, not NoneType"),  # AttributeError: 'NoneType' ... 'get'
    ({"kind": "chars"}, "is not what Codec.to_json() writes (KeyError: 'chars')"),  # a bare KeyError
    ({"kind": "ints", "vocab_size": "x"}, "its vocab_size is not a whole number >= 1"),
    ({"kind": "chars", "chars": 5}, "its table is not a string or list"),  # a codec that failed when used
    # exit 70 when sampled (an empty table; a word table of numbers), or sampling silently from a cut vocabulary
    ({"kind": "chars", "chars": ""}, "its table is empty, repeats a token or holds one that is no text"),
    ({"kind": "chars", "chars": "abca"}, "its table is empty, repeats a token"),
    ({"kind": "words", "tokens": [0, 1]}, "holds one that is no text"),
    ({"kind": "ints", "vocab_size": 0}, "its vocab_size is not a whole number >= 1"),
    ({"kind": "ints", "vocab_size": -5}, "its vocab_size is not a whole number >= 1"),
    ({"kind": "ints", "vocab_size": 3.7}, "its vocab_size is not a whole number >= 1"),
])
def test_codec_from_json_names_a_damaged_codec(codec, says) -> None:
    from energydsl.training.sampling import codec_from_json

    with pytest.raises(UserError) as e:
        codec_from_json(codec)
    assert says in e.value.message, e.value.message
    assert codec_from_json({"kind": "chars", "chars": "ab"}).decode([1, 0]) == "ba"


def test_a_name_or_a_checkpoint_of_the_wrong_kind_is_named() -> None:
    """`spec.energy(["MHA"])` was `unhashable type: 'list'`; `load_checkpoint(None)` a pathlib TypeError."""
    spec = energydsl.load(ROOT / "examples/intrinsic-optimizers/mha.energy")
    for call in (spec.energy, spec.block, spec.module, spec.plan, spec.model, spec.derivations):
        with pytest.raises(TypeError, match="a declaration's name is a string"):
            call(["MHA"])
    for bad in (None, 3):
        with pytest.raises(UserError, match="a checkpoint is a path"):
            load_checkpoint(bad)


def test_a_device_and_a_base_of_the_wrong_kind_are_named(gpt, data) -> None:
    """`device=None` failed in torch.device's overloads; `load(text, base=3)` in pathlib."""
    with pytest.raises(UserError, match="device must be a string, not None"):
        train(gpt, data, tiny(device=None), None, metadata={}, progress=False)
    with pytest.raises(TypeError, match="base is the folder a spec text's imports resolve against"):
        energydsl.load((ROOT / "examples/intrinsic-optimizers/mha.energy").read_text(), base=3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_missing_gpu_is_named_in_the_callers_terms() -> None:
    """From Python the hint said `use --device cpu`, a flag Python has not got."""
    with pytest.raises(UserError) as err:
        TrainConfig(device="cuda").resolve_device()
    assert err.value.hint == 'use device="cpu"'
    with pytest.raises(UserError) as err:
        TrainConfig(device="cuda").resolve_device({"device": "--device"})
    assert err.value.hint == "use --device cpu"


STRICT_SELF_BIAS_AND_LORA = STRICT_SELF_BIAS + """energy Lora(d = 8, r = 2) {
  state   z[d]
  param   A[r, d] ~ normal(0, 0.02)
  param   B[d, r] ~ zeros()
  global  F = -(z . (B @ (A @ z)))
  optimizer gd(eta = 1)
}
model M(vocab = 40, context = 8, d = 8, layers = 2) {
  embed tokens
  layer = StrictSelf(d) -> Lora(d)
  repeat layers
  norm rmsnorm before each stage
  final norm rmsnorm
  head tied
}"""


def test_parameters_that_never_get_a_gradient_are_named(gpt, data) -> None:
    """The self-token bias under `j < i` gets a zero gradient at every step (the masked diagonal): the run says
    so once. LoRA's A has a zero gradient at step 1 only (B starts at 0, and gets one), and is not named; nor is
    any of GPT's. (With `-sum(integral(gelu)((B @ A) @ z))`, B = 0 is a saddle: gelu(0) = 0 gives B no gradient
    either, and A, B and the norm before them are all named, rightly.)"""
    notices: list[str] = []
    model = energydsl.load(STRICT_SELF_BIAS_AND_LORA).model("M")
    train(model, data, tiny(steps=8, eval_interval=8), None, metadata={}, progress=False, notify=notices.append)
    assert notices == ["2 parameters got no gradient in the first 5 steps and will not train: layers.0.0.b_self, "
                       "layers.1.0.b_self. `energy check` on the energy that declares them says why, in its `params` "
                       "row; declare them `fixed`, or remove them"], notices
    train(gpt, data, tiny(steps=3, eval_interval=3), None, metadata={}, progress=False, notify=notices.append)
    assert len(notices) == 1, notices  # a run shorter than the watch reports at its last step: nothing here


@pytest.mark.parametrize("source", ["file", "text"])
def test_a_run_trained_from_python_samples_and_resumes_like_a_cli_run(data, tmp_path: Path, source: str) -> None:
    """train() without metadata records what `energy train` does for a model from load(...).model(...): `energy
    sample` refused such a run ("not written by `energy train`"), and nothing said which metadata it needs. A
    spec given as text travels as text."""
    from energydsl.training.trained import load_trained

    path = ROOT / "examples/models/gpt.energy"
    spec = energydsl.load(path if source == "file" else path.read_text())
    model = spec.model(vocab=data.vocab_size, context=8, d=8, layers=1, heads=2)
    train(model, data, tiny(), tmp_path / "run", progress=False)
    rebuilt, _, meta = load_trained(tmp_path / "run")
    assert meta["model"] == "GPT" and meta["dims"]["d"] == 8 and meta["spec_source"] == path.read_text()
    for got, want in zip(rebuilt.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(got, want.cpu())
    r = energy_in_process("sample", tmp_path / "run", "--prompt", "a", "--tokens", "5")
    assert r.returncode == 0 and r.stdout.startswith("a"), r.stderr
    with pytest.warns(UserWarning, match="steps 2 → 4"):  # the same metadata: it resumes
        train(model, data, tiny(steps=4), tmp_path / "run", progress=False)
    assert load_checkpoint(tmp_path / "run")[1]["training"]["step"] == 4


def _overcommit_mode() -> str:
    try:
        return Path("/proc/sys/vm/overcommit_memory").read_text().strip()
    except OSError:
        return "unknown"


# with overcommit mode 1 (always) a 640 TB allocation succeeds and the kernel kills the process at first touch
@pytest.mark.skipif(_overcommit_mode() not in ("0", "2"), reason="the kernel may grant any allocation here")
@pytest.mark.parametrize(("build", "what"), [
    (lambda: energydsl.load(ROOT / "examples/models/gpt.energy").model("GPT", context=1e13, d=16), "model `GPT`"),
    (lambda: energydsl.load(ROOT / "examples/intrinsic-optimizers/mha.energy").module("MHA", d=4e6),
     "the layer of `MHA`")])
def test_dims_too_large_to_allocate_are_named_from_python(build, what: str) -> None:
    """The CLI sizes a model first; from Python torch's allocator message came from deep inside a layer."""
    with pytest.raises(UserError) as err:
        build()
    assert err.value.message.startswith(f"{what} does not fit in memory here (") and "bytes in one tensor" in \
        err.value.message and "torch.device" in err.value.hint


def test_the_default_block_size_is_the_models_context(gpt, data, tmp_path) -> None:
    """`TrainConfig()` took nanoGPT's 256 tokens, longer than every example model's context (64), so the documented
    `train(model, dataset, TrainConfig(...), out_dir)` failed unless block_size was given; it is now the model's
    context, as `energy train --block-size` defaults it. Given, it is checked as before."""
    config = TrainConfig(steps=2, batch_size=2, eval_interval=2, eval_iters=1)
    assert config.block_size is None
    config.validate()  # None is the model's, known to `train`
    summary = train(gpt, data, config, tmp_path / "run", progress=False)
    assert summary["steps"] == 2
    recorded = load_checkpoint(tmp_path / "run")[1]["training"]["config"]
    assert recorded["block_size"] == 8 == gpt.block_size
    with pytest.raises(UserError, match="block_size 16 is longer than the model's context 8"):
        train(gpt, data, tiny(block_size=16), tmp_path / "other", progress=False)
    with pytest.raises(UserError, match="block_size must be at least 1, got 0"):
        tiny(block_size=0).validate()


def test_train_leaves_the_callers_config_as_it_was(gpt, data) -> None:
    """With block_size given, `train` validated the caller's own config, which wrote `min_lr = lr / 10` into it: the
    config reused with a lower lr kept the first run's min_lr, and was refused as above the new lr."""
    config = tiny()
    before = repr(config)
    train(gpt, data, config, None, metadata={}, progress=False)
    assert repr(config) == before and config.min_lr is None
    config.lr = 1e-5
    assert train(gpt, data, config, None, metadata={}, progress=False)["steps"] == 2


def test_a_batch_that_fits_this_machine_is_not_refused(gpt) -> None:
    """The estimate is a lower one: the batch the examples train with is well within it."""
    from energydsl.sizing import available_memory
    from energydsl.training.arguments import check_batch_fits

    if available_memory() is None:
        pytest.skip("this system does not say how much memory is available")
    check_batch_fits(gpt, TrainConfig(batch_size=64, block_size=8), torch.device("cpu"))
    tokens = available_memory() // (4 * gpt.activation_floats_per_token()) + 1
    with pytest.raises(UserError, match="out of memory while training on cpu"):
        check_batch_fits(gpt, TrainConfig(batch_size=tokens, block_size=1), torch.device("cpu"))

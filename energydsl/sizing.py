"""Sizing a model against this machine before `energy info` or `energy train` builds it.

The model is built on the meta device with one layer (every layer has the first one's shapes), so a billion
layers are counted at once; `energy train` then refuses what cannot fit: the weights with their gradients and
AdamW's moments, and the activations one sequence keeps for the backward pass (which grow with depth even when
the weights are shared). Shared by the CLI, the Python API and training; kept apart from `cli.py`, which parses
flags and prints.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .errors import UserError

if TYPE_CHECKING:
    import torch


def sized_model(spec, name: str | None, backend: str, dims: dict[str, float]):
    """The model built on the meta device (no memory, however large the dims) with one layer, and the number of
    layers it has: every layer's weights have the first one's shapes, so `.info(layers=...)` and
    `.num_params(layers=...)` count them all without building them (a million layers would take hours)."""
    import dataclasses

    import torch

    from .api import model_of_plan
    from .codegen import check_backend

    check_backend(backend)
    plan = spec.plan(name, **dims)
    with torch.device("meta"):
        return model_of_plan(dataclasses.replace(plan, layers=1), backend), plan.layers


def load_model(
    file: str,
    name: str | None,
    dims: dict[str, float],
    backend: str = "torch",
    *,
    train_on: torch.device | None = None,
    block_size: int | None = None,
    dtype: str | None = None,
):
    """The spec and its model. A model too large to train on `train_on` (default: the CPU) is a user error that
    says how large it is, before any layer is built. With `dtype` (--dtype), so is one whose activations for a
    single sequence of `block_size` tokens (default: the model's context) do not fit (`activation_bytes`)."""
    from .api import load

    spec = load(file)
    sized, layers = sized_model(spec, name, backend, dims)
    hint = "check the dims (--set); `energy info` shows sizes without building the weights"
    params = sized.num_params(layers=layers)
    on_gpu = train_on is not None and train_on.type == "cuda"
    host, gpu = available_memory(), free_gpu_memory(train_on) if on_gpu else None
    # the weights are built in host memory; training keeps weights, gradients and AdamW's two moments
    # (16 bytes a parameter in float32) on its device. Refused before any allocation: an overcommitted
    # allocation succeeds, and the kernel kills the process when the initialisation touches the pages.
    for where, needed, available in (
        ("host memory", params * (4 if on_gpu else 16), host),
        ("GPU memory", params * 16, gpu),
    ):
        if available is not None and needed > available:
            raise UserError(f"the model does not fit in {where} here: {params:,} parameters need about "
                            f"{needed / 2**30:,.1f} GiB to train; {available / 2**30:,.1f} GiB are available",
                            hint=hint)
    if dtype is not None:
        # shared weights (`repeat layers shared`) stay small however deep the stack, but every layer's activations
        # are kept for the backward pass: a billion shared layers passed the check above, then ran for ever. A model
        # that cannot train one sequence is refused here; a batch too large is the training loop's out-of-memory error
        block = min(block_size or sized.block_size, sized.block_size)  # a longer one is refused after this
        activations = activation_bytes(sized, layers, block, dtype)
        where, available = ("GPU memory", gpu) if on_gpu else ("host memory", host)
        if available is not None and params * 16 + activations > available:
            raise UserError(
                f"the model does not fit in {where} here: training even one sequence of {block:,} tokens "
                f"(--batch-size 1) keeps at least {size_text(activations)} of activations for the backward pass "
                f"through its {layers:,} layers, besides {size_text(params * 16)} for {params:,} parameters; "
                f"{available / 2**30:,.1f} GiB are available",
                hint=f"lower {depth_setting(spec, sized.plan)} (every layer keeps its own activations, shared "
                "weights or not) or --block-size; `energy info` shows activation_bytes_per_token",
            )
    try:
        return spec, spec.model(name, backend, **dims)
    except (MemoryError, RuntimeError) as e:
        if not isinstance(e, MemoryError) and "allocate" not in str(e):
            raise
        raise UserError(f"the model does not fit in memory here: {params:,} parameters", hint=hint) from None


def activation_bytes(model, layers: int, tokens: int, dtype: str) -> int:
    """A lower estimate of what training on `tokens` tokens keeps for the backward pass: `energy info`'s
    activation_bytes_per_token (the stream and one displacement per stage and layer, the embedding and the logits)
    in `dtype`'s bytes (2 under bfloat16 or float16 autocast, 4 in float32). Autograd keeps more for the models of
    examples/ (the norms' outputs, the stages' keys, values and hidden units: NRGPT's about 27 times as much per
    layer on a CPU), so what is refused here would not have fitted; what passes may still run out of memory."""
    return model.activation_floats_per_token(layers) * (4 if dtype == "float32" else 2) * tokens


def size_text(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def depth_setting(spec, plan) -> str:
    """What sets the number of layers: `--set layers` when `repeat` names a header dim, else the clause itself."""
    from . import syntax as ast

    decl = spec.syntax.models[plan.name]
    value = next((c.value for c in decl.clauses if c.kind == "repeat"), None)
    if isinstance(value, ast.Name) and value.name in plan.dims:
        return f"--set {value.name}"
    return f"the `repeat` of model `{plan.name}`"


def free_gpu_memory(device: torch.device) -> int:
    import torch

    return torch.cuda.mem_get_info(device)[0]


def available_memory() -> int | None:
    """Bytes of host memory available now (Linux's MemAvailable; None where the system does not say)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


@contextlib.contextmanager
def allocation_named(what: str) -> Iterator[None]:
    """Building `what` from Python (`load(path).model(context=1e13)`): an allocation this machine refuses is a
    UserError naming the size asked for, not torch's allocator message from deep inside a layer. (The CLI
    sizes a model before building it: an overcommitted allocation can succeed and be killed later.)"""
    import torch

    try:
        yield
    except (MemoryError, RuntimeError) as e:
        text = str(e)
        if not isinstance(e, MemoryError | torch.OutOfMemoryError) and "can't allocate memory" not in text:
            raise
        asked = re.search(r"allocate (\d+) bytes|Tried to allocate ([\d.]+ \w+)", text)
        size = "" if asked is None else (f" ({int(asked[1]):,} bytes in one tensor)" if asked[1] else
                                         f" ({asked[2]} in one tensor)")
        raise UserError(f"{what} does not fit in memory here{size}",
                        hint="check the dims; building under `with torch.device(\"meta\"):` (or `energy info`) "
                             "sizes a model without allocating its weights") from None

"""What a generated module's forward accepts, said in one clear ValueError before any work.

Without it a wrong input fails deep inside a matmul or a reshape ("mat1 and mat2 shapes cannot be
multiplied"), or worse, a context of another length is reshaped into the batch and gives a wrong answer.
Every generated `forward` starts with `check_inputs(self, x, context, input)`; the class says what it
takes through `state_shape`, `context_shape` and `input_shape` (None: the energy has no such clause).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def check_inputs(module: nn.Module, x: Tensor, context: Tensor | None, input: Tensor | None) -> None:
    """Raise ValueError unless x is (batch, seq, *state_shape) with batch, seq >= 1, and context and input (when
    given) are tensors of the same batch, length, dtype and device with their own per-token shapes."""
    name = type(module).__name__
    _check_tensor(name, "x", x, None, tuple(module.state_shape))
    if not x.is_floating_point():
        raise ValueError(f"{name}: x must be floating point, got {x.dtype}")
    if x.shape[1] < 1:
        raise ValueError(f"{name}: x has no tokens (shape {tuple(x.shape)}); a sequence needs at least one")
    if x.shape[0] < 1:
        raise ValueError(f"{name}: x has no sequences (shape {tuple(x.shape)}); a batch needs at least one")
    for what, value, shape in (("context", context, module.context_shape), ("input", input, module.input_shape)):
        if value is None:
            continue
        if shape is None:
            raise ValueError(f"{name} takes no {what} (its energy has no `{what}` clause)")
        _check_tensor(name, what, value, x, tuple(shape))
    params = next((p for p in module.parameters() if p.is_floating_point()), None)
    autocast = torch.is_autocast_enabled(x.device.type)
    if params is not None and not autocast and x.dtype != params.dtype:
        raise ValueError(f"{name}: x is {x.dtype} but the parameters are {params.dtype}; convert one "
                         "(module.to(x.dtype)) or run under torch.autocast")


def _check_tensor(name: str, what: str, value: object, x: Tensor | None, shape: tuple[int, ...]) -> None:
    if not isinstance(value, Tensor):
        raise ValueError(f"{name}: {what} must be a torch.Tensor, got {type(value).__name__}")
    want = "(batch, seq" + "".join(f", {s}" for s in shape) + ")"
    if value.dim() != 2 + len(shape) or tuple(value.shape[2:]) != shape:
        raise ValueError(f"{name}: {what} must be {want}, got shape {tuple(value.shape)}")
    if x is None:
        return
    if tuple(value.shape[:2]) != tuple(x.shape[:2]):
        raise ValueError(f"{name}: {what} must have x's batch and length {tuple(x.shape[:2])} (token i reads "
                         f"the {what} of tokens up to i), got {tuple(value.shape[:2])}")
    if value.dtype != x.dtype or value.device != x.device:
        raise ValueError(f"{name}: {what} is {value.dtype} on {value.device} but x is {x.dtype} on {x.device}")

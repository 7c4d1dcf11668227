"""What a generated module's forward accepts, said in one clear ValueError before any work.

Without it a wrong input fails deep inside a matmul or a reshape ("mat1 and mat2 shapes cannot be
multiplied"), or worse, a context of another length is reshaped into the batch and gives a wrong answer.
Every generated `forward` starts with `check_inputs(self, x, context, input, delta)`; the class says what it
takes through `state_shape`, `context_shape` and `input_shape` (None: the energy has no such clause).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..number_text import is_count


def check_inputs(module: nn.Module, x: Tensor, context: Tensor | None, input: Tensor | None,
                 delta: bool = False) -> None:
    """Raise ValueError unless x is (batch, seq, *state_shape) with batch, seq >= 1, and context and input (when
    given) are tensors of the same batch, length, dtype and device with their own per-token shapes; TypeError
    unless `delta` is a bool (`delta="False"` returned the displacement).

    Called at every forward, so the passing path does only comparisons (about 1.3 us on a 2-core CPU box): the
    messages are built when they are raised."""
    if delta is not True and delta is not False:
        raise TypeError(f"{type(module).__name__}: delta must be True or False, not {delta!r}")
    _check_tensor(module, "x", x, None, module.state_shape)
    if not x.is_floating_point():
        raise ValueError(f"{type(module).__name__}: x must be floating point, got {x.dtype}")
    batch, seq = x.shape[:2]
    if seq < 1:
        raise ValueError(f"{type(module).__name__}: x has no tokens (shape {tuple(x.shape)}); a sequence needs "
                         "at least one")
    if batch < 1:
        raise ValueError(f"{type(module).__name__}: x has no sequences (shape {tuple(x.shape)}); a batch needs "
                         "at least one")
    if context is not None:
        _check_given(module, "context", context, x, module.context_shape)
    elif module.context_shape is not None and module.context_shape != module.state_shape:
        _no_default(module, "context")
    if input is not None:
        _check_given(module, "input", input, x, module.input_shape)
    elif module.input_shape is not None and module.input_shape != module.state_shape:
        _no_default(module, "input")
    weight = _first_parameter(module)
    if weight is not None and weight.device != x.device:  # torch multiplies a CPU x by meta weights into garbage
        raise ValueError(f"{type(module).__name__}: x is on {x.device} but the parameters are on {weight.device}; "
                         "move one (module.to(x.device))")
    if x.dtype != _parameter_dtype(module, x.dtype) and not (torch.amp.is_autocast_available(x.device.type)
                                                             and torch.is_autocast_enabled(x.device.type)):
        raise ValueError(f"{type(module).__name__}: x is {x.dtype} but the parameters are "
                         f"{_parameter_dtype(module, x.dtype)}; convert one (module.to(x.dtype)) or run under "
                         "torch.autocast")


def random_inputs(module: nn.Module, batch: int = 2, seq: int = 16) -> dict[str, Tensor]:
    """Standard-normal inputs a generated layer takes, as keyword arguments: `x` (batch, seq, *state_shape), and a
    `context` or `input` where the layer has one whose tokens are not x's shape (it cannot default to x); on the
    parameters' device and in their dtype (float32 CPU for a layer without parameters), so `module(**inputs)` runs."""
    for name, value in (("batch", batch), ("seq", seq)):
        if not is_count(value):
            raise ValueError(f"{type(module).__name__}.example_input: {name} must be a whole number of at least 1, "
                             f"not {value!r}")
    weight = _first_parameter(module)
    dtype = _parameter_dtype(module, torch.get_default_dtype())
    device = weight.device if weight is not None else torch.device("cpu")
    inputs = {"x": torch.randn(batch, seq, *module.state_shape, dtype=dtype, device=device)}
    for what in ("context", "input"):
        shape = getattr(module, f"{what}_shape")
        if shape is not None and tuple(shape) != tuple(module.state_shape):
            inputs[what] = torch.randn(batch, seq, *shape, dtype=dtype, device=device)
    return inputs


def _first_parameter(module: nn.Module) -> Tensor | None:
    """A generated layer's first own parameter (its first anywhere when it has none of its own), or None."""
    for p in module._parameters.values():  # no recursion on the hot path
        if p is not None:
            return p
    return next(module.parameters(), None)


def _parameter_dtype(module: nn.Module, default: torch.dtype) -> torch.dtype:
    """The dtype of the module's first floating-point parameter (`default` when it has none)."""
    for p in module._parameters.values():  # a generated layer's own parameters; no recursion on the hot path
        if p is not None and p.is_floating_point():
            return p.dtype
    p = next((p for p in module.parameters() if p.is_floating_point()), None)
    return default if p is None else p.dtype


def _no_default(module: nn.Module, what: str) -> None:
    shape = getattr(module, f"{what}_shape")
    want = "(batch, seq" + "".join(f", {s}" for s in shape) + ")"
    raise ValueError(f"{type(module).__name__}: {what} defaults to x, but its tokens have shape {tuple(shape)} and "
                     f"x's {tuple(module.state_shape)}: pass {what}= explicitly, {want}")


def _check_given(module: nn.Module, what: str, value: object, x: Tensor, shape: tuple[int, ...] | None) -> None:
    if shape is None:
        raise ValueError(f"{type(module).__name__} takes no {what} (its energy has no `{what}` clause)")
    _check_tensor(module, what, value, x, shape)


def _check_tensor(module: nn.Module, what: str, value: object, x: Tensor | None, shape: tuple[int, ...]) -> None:
    name = type(module).__name__
    if not isinstance(value, Tensor):
        raise ValueError(f"{name}: {what} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != 2 + len(shape) or value.shape[2:] != tuple(shape):
        want = "(batch, seq" + "".join(f", {s}" for s in shape) + ")"
        raise ValueError(f"{name}: {what} must be {want}, got shape {tuple(value.shape)}")
    if x is None:
        return
    if value.shape[:2] != x.shape[:2]:
        reads = ("the context of tokens up to i" if what == "context" else f"its own token's {what}")
        raise ValueError(f"{name}: {what} must have x's batch and length {tuple(x.shape[:2])} (token i reads "
                         f"{reads}), got {tuple(value.shape[:2])}")
    if value.dtype != x.dtype or value.device != x.device:
        raise ValueError(f"{name}: {what} is {value.dtype} on {value.device} but x is {x.dtype} on {x.device}")

"""Fused kernels for derived updates, each beside a plain PyTorch reference.

Importing this package never imports triton: the Triton module (`energydsl.kernels.attention`) is loaded on
first use, so the compiler and the references work on machines without triton or a GPU. The functions here
dispatch: the Triton op when `kernels_take(tensor)` holds (a kernel device, a dtype the kernels compute in), the
reference otherwise (same signature, same results up to float rounding).

TRITON_INTERPRET=1 (or true, on, yes) must be set before triton is first imported for the CPU interpreter.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .attention_ref import (
    energy_attention_lse_ref,
    energy_attention_ref,
    weighted_second_moment_ref,
)
from .epilogue_ref import gated_activation_ref, momentum_update_ref, nesterov_lookahead_ref
from .pointwise_ref import pointwise_attention_ref

if TYPE_CHECKING:
    import torch
    from torch import Tensor

__all__ = [
    "energy_attention",
    "energy_attention_lse_ref",
    "energy_attention_ref",
    "energy_attention_with_lse",
    "gated_activation",
    "interpret_requested",
    "interpreter_missed",
    "kernels_take",
    "linear_attention",
    "momentum_update",
    "nesterov_lookahead",
    "pointwise_attention_ref",
    "sigmoid_attention",
    "triton_available",
    "use_triton",
    "weighted_second_moment",
    "weighted_second_moment_ref",
]


# The widest feature axis (head dim) the attention kernels hold as one tile; wider ones take the feature-tiled
# ("wide") kernels. Here, without triton, so that the code generator can choose without importing it.
MAX_HEAD_DIM = 256

OpSet = TypeVar("OpSet")
_OP_SETS: dict[str, Any] = {}


def op_set(name: str, build: Callable[[], OpSet]) -> OpSet:
    """The op set registered under `energydsl::{name}_*`, built on first use and kept for the process.

    A generated module imported twice (or two modules with the same kernels) asks for the same set again; the
    first one is kept, as torch.library names cannot be registered twice.
    """
    if name not in _OP_SETS:
        _OP_SETS[name] = build()
    return _OP_SETS[name]


_TRITON_FOUND: bool | None = None  # found once: dispatch asks on every call (a plain global: Dynamo traces it)


def triton_available() -> bool:
    """Whether triton can be imported (checked without importing it, once per process)."""
    global _TRITON_FOUND
    if _TRITON_FOUND is None:
        try:
            _TRITON_FOUND = importlib.util.find_spec("triton") is not None
        except (ImportError, ValueError):  # a broken or blocked installation counts as absent
            _TRITON_FOUND = False
    return _TRITON_FOUND


#: what Triton reads as "on" in TRITON_INTERPRET (triton.knobs), without importing triton
_ON = ("1", "true", "on", "yes", "y")


def interpret_requested() -> bool:
    """Whether TRITON_INTERPRET asks for the interpreter, read as Triton reads it."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _ON


def interpreter_missed() -> bool:
    """TRITON_INTERPRET asks for the interpreter, but triton was imported before it was set: Triton builds its own
    jit functions (`tl.cdiv`, `tl.sigmoid`) for the compiler or the interpreter once, at import, so kernels built
    now would fail inside ("Cannot call @triton.jit'd outside of the scope of a kernel")."""
    language = sys.modules.get("triton.language")
    if language is None or not interpret_requested():
        return False
    return type(getattr(language, "cdiv", None)).__name__ == "JITFunction"


def kernels_take(t: Tensor) -> bool:
    """Whether the fused kernels can take tensor `t`: on a device `use_triton` allows, and in a dtype they
    compute in (float32, bfloat16, float16). float64 keeps the torch references, which are exact: the kernels
    accumulate in float32, and the attention kernels do not compile for float64. The same test as
    `use_triton(t.device)`, ordered so that a CUDA tensor, every call on a GPU, reads no environment."""
    import torch

    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if triton_available() and (t.is_cuda or interpret_requested()):
        return True
    _reference_notice(t)
    return False


_REFERENCE_NOTED = False  # a plain global, as _TRITON_FOUND


def _reference_notice(t: Tensor) -> None:
    """Say once per process that the kernels' calls run their PyTorch references: a generated triton file used
    on the CPU (or without triton) computed with T x T tensors and said nothing (`.module()` falls back to the
    torch backend with a notice of its own, before any call reaches here)."""
    global _REFERENCE_NOTED
    if not _REFERENCE_NOTED:
        _REFERENCE_NOTED = True
        why = "triton is not installed" if not triton_available() else \
            f"the inputs are on {t.device.type}, not CUDA, and TRITON_INTERPRET is off"
        print(f"energydsl: {why}: the fused kernels run as their plain PyTorch references (T x T memory)",
              file=sys.stderr)


def use_triton(device: torch.device | str | None = None) -> bool:
    """True when the Triton kernels can run on `device`: CUDA with triton, or any device when interpreting.

    Without a device: whether they can run at all (CUDA available, or the interpreter is on).
    """
    if not triton_available():
        return False
    if interpret_requested():
        return True
    import torch

    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def _triton_ops() -> Any:
    from . import attention

    return attention


def energy_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    strict: bool = False,
    alibi_slopes: Tensor | None = None,
    self_bias: Tensor | None = None,
    key_bias: Tensor | None = None,
) -> Tensor:
    """Softmax attention over derived scores: the fused kernel when possible, else the T x T reference."""
    kw = dict(scale=scale, strict=strict, alibi_slopes=alibi_slopes, self_bias=self_bias, key_bias=key_bias)
    if kernels_take(q):
        return _triton_ops().energy_attention(q, k, v, **kw)
    return energy_attention_ref(q, k, v, **kw)


def energy_attention_with_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    strict: bool = False,
    alibi_slopes: Tensor | None = None,
    self_bias: Tensor | None = None,
    key_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(o, lse) as `energy_attention`, plus the row log-sum-exp reused by `weighted_second_moment`."""
    kw = dict(scale=scale, strict=strict, alibi_slopes=alibi_slopes, self_bias=self_bias, key_bias=key_bias)
    if kernels_take(q):
        return _triton_ops().energy_attention_with_lse(q, k, v, **kw)
    return energy_attention_lse_ref(q, k, v, **kw)


def weighted_second_moment(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor | None,
    u: Tensor,
    *,
    scale: float,
    strict: bool = False,
    alibi_slopes: Tensor | None = None,
    self_bias: Tensor | None = None,
    key_bias: Tensor | None = None,
) -> Tensor:
    """r_i = sum_j p_ij (v_j . u_i) v_j (second-order variants): fused kernel if possible, else reference."""
    kw = dict(scale=scale, strict=strict, alibi_slopes=alibi_slopes, self_bias=self_bias, key_bias=key_bias)
    if kernels_take(q):
        return _triton_ops().weighted_second_moment(q, k, v, lse, u, **kw)
    return weighted_second_moment_ref(q, k, v, lse, u, **kw)


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float = 1.0,
    log_decay: Tensor | None = None,
    strict: bool = False,
) -> Tensor:
    """(Gated) linear attention: the chunked Triton kernel when possible, else the torch backend's chunked form."""
    kw = dict(scale=scale, log_decay=log_decay, strict=strict)
    if kernels_take(q):
        from .linear import linear_attention as kernel

        return kernel(q, k, v, **kw)
    from ..runtime.ops import linear_attention as chunked  # same contract, O(T d^2): no T x T matrix

    return chunked(q, k, v, **kw)


def sigmoid_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float = 1.0,
    strict: bool = False,
    row_bias: Tensor | None = None,
    key_bias: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    self_bias: Tensor | None = None,
) -> Tensor:
    """o_i = sum_j sigmoid(scale q_i . k_j + row_bias_i + key_bias_j - slope_h |i - j| + [i = j] self_h) v_j over
    the causal context, no normalisation: the pointwise kernels when possible, else the T x T reference."""
    kw = dict(scale=scale, strict=strict, row_bias=row_bias, key_bias=key_bias, alibi_slopes=alibi_slopes,
              self_bias=self_bias)
    if kernels_take(q):
        from .pointwise import sigmoid_attention as kernel

        return kernel(q, k, v, **kw)
    import torch

    return pointwise_attention_ref(q, k, v, torch.sigmoid, **kw)


def gated_activation(gate_pre: Tensor, value: Tensor | None, activation: str = "silu") -> Tensor:
    """value * act(gate_pre) (act(gate_pre) with value None) in one fused pass (forward and backward), else the
    reference."""
    if kernels_take(gate_pre):
        from .epilogue import gated_activation as kernel

        return kernel(gate_pre, value, activation)
    return gated_activation_ref(gate_pre, value, activation)


def momentum_update(
    x: Tensor, m: Tensor, f: Tensor, beta: Tensor | float, eta: Tensor | float
) -> tuple[Tensor, Tensor]:
    """(x + eta m', m') with m' = beta m + f, one fused pass (forward and backward), else the reference."""
    if kernels_take(x):
        from .epilogue import momentum_update as kernel

        return kernel(x, m, f, beta, eta)
    return momentum_update_ref(x, m, f, beta, eta)


def nesterov_lookahead(x: Tensor, m: Tensor, c: Tensor | float) -> Tensor:
    """The look-ahead point x + c m in one fused pass (forward and backward), else the reference."""
    if kernels_take(x):
        from .epilogue import nesterov_lookahead as kernel

        return kernel(x, m, c)
    return nesterov_lookahead_ref(x, m, c)

"""How every fused kernel is registered and launched, decided once at import (shared by all op families).

* CUDA: each op is a `torch.library.triton_op`, so `torch.compile` sees the Triton kernels and can schedule
  around them; launch configurations are autotuned (`maybe_autotune`).
* TRITON_INTERPRET=1 (CPU tests): triton_op would launch the interpreted kernel on fake tensors while
  `torch.compile` traces, which fails, so the same functions are registered as opaque
  `torch.library.custom_op`s with explicit fake (shape) functions; eager and compiled calls both work. Tiles
  are fixed and passed at launch (`launch_options`).

Both APIs are in every torch the project supports (>= 2.6). Gradients are wired with `register_autograd`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
from torch.library import wrap_triton  # the launch wrapper triton_op discovers kernels by (name kept)

from .tuning import autotune_options

__all__ = ["INTERPRET", "dot_precision", "launch_options", "maybe_autotune", "register_op", "wrap_triton"]


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    from . import interpret_requested

    return interpret_requested()


# `triton.jit` picks interpreter or compiler when a kernel is decorated, i.e. when a kernel module is imported
INTERPRET: bool = _interpreting()


def register_op(
    name: str,
    impl: Callable[..., Any],
    fake: Callable[..., Any],
    *,
    backward: Callable[..., Any] | None = None,
    setup_context: Callable[..., Any] | None = None,
) -> Any:
    """`impl` as torch.ops.energydsl.<name>: a triton_op on CUDA, a custom_op with `fake` under the interpreter."""
    qualname = f"energydsl::{name}"
    if INTERPRET:
        op = torch.library.custom_op(qualname, impl, mutates_args=())
        op.register_fake(fake)
    else:
        op = torch.library.triton_op(qualname, impl, mutates_args=())
    if backward is not None:
        op.register_autograd(backward, setup_context=setup_context)
    return op


def maybe_autotune(configs: list[triton.Config], key: list[str]) -> Callable[[Any], Any]:
    """`triton.autotune` on CUDA, its choices kept on disk (`tuning.py`); identity under the interpreter (the
    caller then passes fixed tiles)."""

    def wrap(kernel: Any) -> Any:
        return kernel if INTERPRET else triton.autotune(configs=configs, key=key, **autotune_options())(kernel)

    return wrap


def launch_options(**fixed: Any) -> dict[str, Any]:
    """Meta-parameters to pass at launch: none when autotuned (the tuner owns them), `fixed` otherwise."""
    return fixed if INTERPRET else {}


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's `input_precision`: exact fp32 products ("ieee") under the interpreter and where PyTorch's own
    float32 matmuls are exact (`torch.get_float32_matmul_precision() == "highest"`, the default); "tf32"
    otherwise. 16-bit inputs ignore it."""
    if INTERPRET or (dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"):
        return "ieee"
    return "tf32"

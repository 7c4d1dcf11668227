"""Plain PyTorch references for the fused elementwise epilogues in `energydsl.kernels.epilogue`.

* `gated_activation_ref`: value * sigma(gate_pre), the update of element-wise energies such as CEM's gated MLP
  energy E = -(W h) . phi(V u), phi = integral of sigma, whose gradient in u is V^T((W h) o sigma(V u)).
* `momentum_update_ref`, `nesterov_lookahead_ref`: heavy-ball / Nesterov state on the residual stream.

Gradients come from autograd through these formulas.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "ACTIVATIONS",
    "activation_ref",
    "gated_activation_ref",
    "momentum_update_ref",
    "nesterov_lookahead_ref",
]

_ACTIVATION_FNS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x, approximate="none"),  # erf form: x * Phi(x)
    "sigmoid": torch.sigmoid,
    "relu": torch.relu,
    "tanh": torch.tanh,
    "identity": lambda x: x,
}

ACTIVATIONS: tuple[str, ...] = tuple(_ACTIVATION_FNS)


def activation_ref(x: Tensor, activation: str) -> Tensor:
    """sigma(x) for one of `ACTIVATIONS`."""
    try:
        return _ACTIVATION_FNS[activation](x)
    except KeyError:
        raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}") from None


def gated_activation_ref(gate_pre: Tensor, value: Tensor | None, activation: str) -> Tensor:
    """value * sigma(gate_pre); sigma(gate_pre) with no value."""
    y = activation_ref(gate_pre, activation)
    return y if value is None else value * y


def momentum_update_ref(x: Tensor, m: Tensor, f: Tensor, beta: Tensor, eta: Tensor) -> tuple[Tensor, Tensor]:
    """Heavy-ball step: m_new = beta m + f, x_new = x + eta m_new."""
    m_new = beta * m + f
    return x + eta * m_new, m_new


def nesterov_lookahead_ref(x: Tensor, m: Tensor, c: Tensor) -> Tensor:
    """The Nesterov look-ahead point x + c m (c = -beta for nag), where the next force is evaluated."""
    return x + c * m

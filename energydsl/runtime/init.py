"""Helpers generated modules import for parameter initialisers and special functions."""

from __future__ import annotations

import torch

from ..functions import _QuadratureIntegral
from ..instance import alibi_slopes as _alibi_slopes

__all__ = ["alibi_slopes", "integral_quadrature"]


def alibi_slopes(n: int) -> torch.Tensor:
    """ALiBi's geometric slopes 2^(-8k/n), k = 1..n (Press et al.), in the default dtype."""
    return _alibi_slopes(n).to(torch.get_default_dtype())


def integral_quadrature(x: torch.Tensor, name: str) -> torch.Tensor:
    """φ(x) = ∫_0^x f for an f whose antiderivative has no torch closed form; dφ/dx = f exactly."""
    return _QuadratureIntegral.apply(x, name)

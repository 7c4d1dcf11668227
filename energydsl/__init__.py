"""energydsl: sequence layers as optimizers running on energies.

    import energydsl
    spec = energydsl.load("examples/intrinsic-optimizers/mha.energy")
    layer = spec.energy(d=16, heads=2)
    print(layer.equations())

Imports are lazy: `import energydsl.search` or `energydsl.training` does not pull in the compiler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import SpecError, UserError

if TYPE_CHECKING:
    from .api import Derived, Spec, load

__all__ = ["load", "Spec", "Derived", "SpecError", "UserError"]


def __getattr__(name: str) -> Any:
    if name in ("load", "Spec", "Derived"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'energydsl' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The lazy names too, so that tab completion and `dir(energydsl)` show `load`."""
    return sorted(set(globals()) | set(__all__))

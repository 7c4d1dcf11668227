"""energydsl: sequence layers as optimizers running on energies.

    import energydsl
    spec = energydsl.load("examples/intrinsic-optimizers/mha.energy")
    layer = spec.energy(d=16, heads=2)
    print(layer.equations())

Imports are lazy: `import energydsl.search` or `energydsl.training` does not pull in the compiler, and a
subpackage named in full after `import energydsl` (`energydsl.training.data.download_shakespeare()`) is imported
when first read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import SpecError, UserError

if TYPE_CHECKING:
    from .api import Derived, Spec, load

__all__ = ["load", "Spec", "Derived", "SpecError", "UserError"]


# the subpackages the docs call by their full names (`energydsl.search.register_space`), imported when first read
SUBPACKAGES = ("codegen", "kernels", "runtime", "search", "training")


def __getattr__(name: str) -> Any:
    if name in ("load", "Spec", "Derived"):
        from . import api

        return getattr(api, name)
    if name in SUBPACKAGES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'energydsl' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The lazy names too, so that tab completion and `dir(energydsl)` show `load`."""
    return sorted(set(globals()) | set(__all__) | set(SUBPACKAGES))

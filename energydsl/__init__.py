"""energydsl: sequence layers as optimizers running on energies.

    import energydsl
    spec = energydsl.load("examples/intrinsic-optimizers/mha.energy")
    layer = spec.energy(d=16, heads=2)
    print(layer.equations())
"""

from .api import Derived, Spec, load
from .errors import SpecError, UserError

__all__ = ["load", "Spec", "Derived", "SpecError", "UserError"]

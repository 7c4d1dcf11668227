"""Triton launches replaced by a counter that runs nothing, for the CPU scripts that measure the host's share of
a call (`host_overhead.py`) or count a layer's device work (`op_counts.py`).

Imports nothing of the project at module level, so a script given another checkout on PYTHONPATH stubs that
checkout's ops. Call `stub_launches()` after setting TRITON_INTERPRET=1 (the ops' CPU registration).
"""

from __future__ import annotations

from typing import Any

# the modules whose `wrap_triton` launches every kernel of an op family
LAUNCHING_MODULES = ("energydsl.kernels.attention", "energydsl.kernels.linear", "energydsl.kernels.pointwise",
                     "energydsl.kernels.epilogue")

LAUNCHES = [0]  # launches made since the counter was last set to 0


class _CountedLaunch:
    """Stands in for `wrap_triton(kernel)[grid]`: counts the launch and launches nothing."""

    def __getitem__(self, grid: Any) -> _CountedLaunch:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        LAUNCHES[0] += 1


def stub_launches() -> None:
    import importlib

    for name in LAUNCHING_MODULES:
        importlib.import_module(name).wrap_triton = lambda kernel: _CountedLaunch()

"""Host time per call of the fused ops and the generated layers, with the Triton launches left out (any CPU).

At short sequences a GPU waits for the host: the Python around each kernel (argument checks, the custom op's
dispatch, autograd, building the launch) sets a floor under every forward and backward. This script
measures that floor on the CPU. It registers the ops as the interpreter does (TRITON_INTERPRET=1, set here
before triton is imported) and replaces every Triton launch by a no-op, so what is timed is everything but
the kernels and Triton's own launcher (which needs a GPU: `profile_kernels.py` splits a GPU step into host
and device time). Shapes are tiny, so the peers' compute is negligible too.

Peers, in the same run: for each op, the plain PyTorch implementation of the same case (`kernel_cases.py`:
SDPA, the chunked form, the reference); for each generated layer, the torch backend's module of the same
spec (`modules.py`'s cases). The ratio is host time over the peer's; it is a CPU measurement, not a speed
claim for a GPU.

    python benchmarks/host_overhead.py
    python benchmarks/host_overhead.py --families attention --no-modules --min-run-time 0.5
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"  # the ops' CPU registration; must precede the first import of triton

from kernel_cases import FAMILIES, SMOKE, build_cases, torch_dtype  # noqa: E402
from kernels import as_tuple, detach_leaves, fwd_bwd_step, grad_leaves  # noqa: E402
from launch_stub import stub_launches  # noqa: E402
from modules import CASES as MODULE_CASES  # noqa: E402
from modules import build  # noqa: E402


def per_call_us(fn: Callable[[], Any], min_run_time: float) -> float:
    """Microseconds per call: the fastest block of `torch.utils.benchmark` (the least disturbed by other
    processes, which only ever add time)."""
    from torch.utils.benchmark import Timer

    measurement = Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time)
    return min(measurement.times) * 1e6


def time_pair(forward: Callable[[], Any], leaves: list[Any], min_run_time: float) -> tuple[float, float]:
    """(forward without grad, forward + backward) in microseconds per call."""
    import torch

    outs = as_tuple(forward())
    grads = [torch.ones_like(o) for o in outs]

    with torch.no_grad():
        fwd = per_call_us(forward, min_run_time)
    return fwd, per_call_us(fwd_bwd_step(forward, grads, leaves), min_run_time)


# (case, (fwd, fwd+bwd) us, peer name, the peer's (fwd, fwd+bwd) us)
Row = tuple[str, tuple[float, float], str, tuple[float, float]]


def op_rows(families: list[str], min_run_time: float) -> list[Row]:
    """Each case's kernel against its first plain-PyTorch peer that runs on the CPU."""
    rows = []
    for family in families:
        cases, _note = build_cases(family, SMOKE[family], cuda=False)
        for case in cases:
            base = case.make_inputs(torch_dtype(case.dtype), "cpu")
            kernel = next(i for i in case.impls if i.role == "kernel")
            peer = next((i for i in case.impls if i.role != "kernel" and not i.gpu_only and i.cpu_backward), None)
            if peer is None:
                continue
            times = []
            for impl in (kernel, peer):
                x = detach_leaves(impl.prepare(base) if impl.prepare else base)
                times.append(time_pair(partial(impl.fn, x), list(grad_leaves(x).values()), min_run_time))
            rows.append((case.label, times[0], peer.name, times[1]))
    return rows


def module_rows(min_run_time: float, d: int = 64, heads: int = 4, T: int = 16) -> list[Row]:
    """Each generated layer (`--backend triton`) against the torch backend's module of the same spec."""
    import torch

    rows = []
    for label, path, energy in MODULE_CASES:
        layers = build(path, energy, d=d, heads=heads)
        x = torch.randn(1, T, d)
        times = [time_pair(partial(m, x, delta=True), list(m.parameters()), min_run_time) for m in layers]
        rows.append((label, times[0], "torch backend", times[1]))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated subset of {FAMILIES}")
    ap.add_argument("--no-modules", action="store_true", help="leave out the generated layers")
    ap.add_argument("--min-run-time", type=float, default=0.3, help="seconds timed per measurement")
    args = ap.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        ap.error(f"--families: unknown {unknown}; choose from {','.join(FAMILIES)}")
    if args.min_run_time <= 0:
        ap.error("--min-run-time must be positive")

    from rich.console import Console
    from rich.table import Table

    stub_launches()
    rows = op_rows(families, args.min_run_time)
    if not args.no_modules:
        rows += module_rows(args.min_run_time)
    table = Table(title="host time per call, us (Triton launches stubbed; CPU)")
    for column in ("case", "fwd", "fwd+bwd", "peer", "peer fwd", "peer fwd+bwd", "fwd+bwd / peer"):
        table.add_column(column, justify="left" if column in ("case", "peer") else "right")
    for label, (fwd, step), peer, (peer_fwd, peer_step) in rows:
        table.add_row(label, f"{fwd:.1f}", f"{step:.1f}", peer, f"{peer_fwd:.1f}", f"{peer_step:.1f}",
                      f"{step / peer_step:.2f}")
    Console(width=200).print(table)
    print(f"measured {len(rows)} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())

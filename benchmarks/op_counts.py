"""Device work per call of each generated layer, counted: the eager ops and kernel launches a forward and a
forward + backward make. What the generated code's leanness buys, on any machine.

On a GPU each eager op that computes (an element-wise op, a matmul, a copy) is a kernel launch and a pass over
memory, forward and backward; at short sequences the launches set the time. This script builds each energy of
the given specs at its own dims, runs one forward (no grad) and one forward + backward of a (2, 16) batch
under a `TorchDispatchMode`, and counts the aten ops that reach a kernel (views and allocations left out:
they launch nothing). With `--backend triton` the generated layer's Triton kernels are counted too:
the ops are registered as the interpreter does and every launch is replaced by a counter, so the kernels'
own work is neither run nor timed. Run it against another checkout to compare commits:

    python benchmarks/op_counts.py [--backend triton]
    PYTHONPATH=/tmp/other-checkout python benchmarks/op_counts.py --json before.json
    python benchmarks/op_counts.py --compare before.json

A count, not a time: the CPU box cannot say how much each op costs on a GPU (`benchmarks/RESULTS.md` says which
rows were timed where).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from pathlib import Path
from typing import Any

from launch_stub import LAUNCHES, stub_launches

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SPECS = sorted(glob.glob(str(ROOT / "examples" / "*" / "*.energy")))

# ops that move no data: allocations (views are told apart by their schema)
NO_WORK = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "detach",
           "_unsafe_view", "set_", "is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"}

def count_launches_instead() -> None:
    """Every Triton launch counted, not run (`launch_stub.py`); and each op's body run as plain eager calls run
    it (`launch.runs_body_directly`), which the counting mode would otherwise route through the custom op,
    hiding the torch ops inside from the count."""
    import importlib

    stub_launches()
    importlib.import_module("energydsl.kernels.launch").runs_body_directly = lambda args, differentiable: True


def device_ops(run) -> int:
    """The ops one call of `run` dispatches to a device kernel (aten ops past autograd, views and allocations
    left out: `linear` is `mm` or `addmm`, `0.5 * W` one `mul`), plus its Triton launches. A custom op
    (`energydsl::*`) is not counted: its launches are."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.ops += func.namespace == "aten" and not func.is_view and name not in NO_WORK
            return func(*args, **(kwargs or {}))

    LAUNCHES[0] = 0
    with Counter() as counter:
        counter.ops = 0
        run()
    return counter.ops + LAUNCHES[0]


def count(spec: str, backend: str) -> dict[str, tuple[int, int]]:
    """{energy name: (forward, forward + backward)} for every energy of `spec` (models left out)."""
    import energydsl

    file = energydsl.load(spec)
    return {name: count_layer(file.module(name, backend=backend)) for name in file.energy_names}


def count_layer(module: Any) -> tuple[int, int]:
    import torch

    torch.manual_seed(0)
    x = module.example_input(2, 16)

    def step() -> None:
        module(x.clone().requires_grad_()).square().sum().backward()

    step()  # warm: caches, lazy kernels
    with torch.no_grad():
        fwd = device_ops(lambda: module(x))
    return fwd, device_ops(step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("specs", nargs="*", default=DEFAULT_SPECS, help="spec files (default: every example)")
    ap.add_argument("--backend", choices=("torch", "triton"), default="torch")
    ap.add_argument("--json", help="write the counts here")
    ap.add_argument("--compare", help="a --json file of another run: print the layers whose counts differ")
    args = ap.parse_args()
    before = {}
    if args.compare:  # read first: a wrong path fails before minutes of counting
        try:
            before = {k: tuple(v) for k, v in json.loads(Path(args.compare).read_text()).items()}
        except (OSError, ValueError, AttributeError, TypeError) as e:
            ap.exit(2, f"error: --compare {args.compare}: not a --json file of this script ({e})\n")
    if args.backend == "triton":
        os.environ["TRITON_INTERPRET"] = "1"  # the ops' CPU registration; before triton is first imported
        count_launches_instead()
    import torch

    from energydsl.errors import UserError

    torch.set_num_threads(1)
    try:
        counts = {f"{Path(spec).parent.name}/{Path(spec).name}:{name}": ops
                  for spec in args.specs for name, ops in count(spec, args.backend).items()}
    except UserError as e:  # a spec that does not load or build: its file:line:col, as `energy` says it
        ap.exit(2, e.render() + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(counts, indent=1))
    if before:
        print("| layer | fwd before | fwd | fwd+bwd before | fwd+bwd |\n|---|---|---|---|---|")
        for key, (fwd, both) in counts.items():
            if before.get(key) != (fwd, both):
                old = before.get(key, ("-", "-"))
                print(f"| {key} | {old[0]} | {fwd} | {old[1]} | {both} |")
        print(f"({sum(before.get(k) == v for k, v in counts.items())} layers unchanged)")
    else:
        print("| layer | fwd | fwd+bwd |\n|---|---|---|")
        for key, (fwd, both) in counts.items():
            print(f"| {key} | {fwd} | {both} |")


if __name__ == "__main__":
    main()

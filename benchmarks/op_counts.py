"""aten ops per call of each generated layer (torch backend): what the generated code's leanness buys, counted.

On a GPU every element-wise op is a kernel launch and a pass over a (batch, seq, d) tensor, forward and
backward; at short sequences the launches set the time. This script counts them on any machine: it builds
each energy of the given specs at its own dims, runs one forward and one forward + backward of a (2, 16)
batch under `torch.profiler`, and prints the number of `aten::` ops recorded (nested ops included, as the
profiler records them). Run it against another checkout to compare commits:

    python benchmarks/op_counts.py
    PYTHONPATH=/tmp/other-checkout python benchmarks/op_counts.py --json before.json
    python benchmarks/op_counts.py --compare before.json

A count, not a time: the same op count can cost more or less, and the CPU box cannot say how much a GPU
gains (`benchmarks/RESULTS.md` says which rows were timed where).
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_SPECS = sorted(glob.glob(str(ROOT / "examples" / "*" / "*.energy")))


def aten_ops(run) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def count(spec: str) -> dict[str, tuple[int, int]]:
    """{energy name: (forward ops, forward + backward ops)} for every energy of `spec` (models left out)."""
    import energydsl

    file = energydsl.load(spec)
    return {name: count_layer(file.module(name)) for name in file.energy_names}


def count_layer(module: torch.nn.Module) -> tuple[int, int]:
    torch.manual_seed(0)
    x = module.example_input(2, 16)

    def step() -> None:
        module(x.clone().requires_grad_()).square().sum().backward()

    step()  # warm: caches, lazy kernels
    with torch.no_grad():
        fwd = aten_ops(lambda: module(x))
    return fwd, aten_ops(step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("specs", nargs="*", default=DEFAULT_SPECS, help="spec files (default: every example)")
    ap.add_argument("--json", help="write the counts here")
    ap.add_argument("--compare", help="a --json file of another run: print its counts beside these")
    args = ap.parse_args()
    torch.set_num_threads(1)
    counts = {}
    for spec in args.specs:
        for name, ops in count(spec).items():
            counts[f"{Path(spec).parent.name}/{Path(spec).name}:{name}"] = ops
    if args.json:
        Path(args.json).write_text(json.dumps(counts, indent=1))
    before = json.loads(Path(args.compare).read_text()) if args.compare else {}
    print("| layer | fwd | fwd+bwd |" if not before else "| layer | fwd before | fwd | fwd+bwd before | fwd+bwd |")
    print("|---|---|---|" if not before else "|---|---|---|---|---|")
    for key, (fwd, both) in counts.items():
        if before:
            b = before.get(key, ("-", "-"))
            if tuple(b) != (fwd, both):
                print(f"| {key} | {b[0]} | {fwd} | {b[1]} | {both} |")
        else:
            print(f"| {key} | {fwd} | {both} |")
    if before:
        print(f"({sum(1 for k in counts if tuple(before.get(k, ())) == counts[k])} layers unchanged)")


if __name__ == "__main__":
    main()

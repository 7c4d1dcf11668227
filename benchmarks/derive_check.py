"""Time `energy derive` + `energy check` of every example (in-process, after imports), median of runs.

Target (issue 2): under 2 s per example on this CPU. Run: `python benchmarks/derive_check.py [--runs 3]`.

Columns: `median s` is the median over `--runs` in one process (the target); `first s` is the first of
those runs, which also pays the example's one-off SymPy work (SymPy caches it for the later runs, so the
median hides it). `--fresh` adds `fresh s`: one run in a new interpreter per example, after its imports,
which is what a separate `energy check FILE` process pays besides the imports. The last line prints the
import cost of the compiler (torch + sympy + lark), which every `energy` process pays once.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_FRESH = """
import json, sys, time
import energydsl.api
t = time.perf_counter()
spec = energydsl.api.load(sys.argv[1])
ok = True
for d in spec.derive():
    d.equations("text")
    ok &= all(r.ok for r in d.check())
print(json.dumps({"seconds": time.perf_counter() - t, "ok": ok}))
"""


def run_once(path: str) -> tuple[float, bool, int]:
    """derive + equations + check of every energy in `path`: (seconds, all ok, number of energies)."""
    import energydsl

    t = time.perf_counter()
    spec = energydsl.load(path)
    derived = spec.derive()
    ok = True
    for d in derived:
        d.equations("text")
        ok &= all(r.ok for r in d.check())
    return time.perf_counter() - t, ok, len(derived)


def fresh(path: str) -> tuple[float, bool]:
    """One run in a new interpreter, timed after its imports."""
    out = subprocess.run([sys.executable, "-c", _FRESH, path], check=True, capture_output=True, text=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return res["seconds"], res["ok"]


def _label(path: str) -> str:
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--fresh", action="store_true", help="also time one run per example in a new interpreter")
    ap.add_argument("files", nargs="*")
    args = ap.parse_args()
    files = [str(Path(f).resolve()) for f in args.files] or \
        sorted(glob.glob(str(ROOT / "examples/**/*.energy"), recursive=True))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import energydsl.cli, energydsl.api"], check=True)
    startup = time.perf_counter() - t0
    from rich.console import Console
    from rich.table import Table

    import energydsl.api  # noqa: F401 -- imported here, not inside the first timed run

    table = Table(title=f"derive + check, median of {args.runs} runs (target < 2 s)")
    cols = ["example", "energies", "median s", "first s"] + (["fresh s"] if args.fresh else []) + ["ok"]
    for col in cols:
        table.add_column(col, no_wrap=col == "example")
    worst = worst_first = worst_fresh = 0.0
    for path in files:
        times, ok, n = [], True, 0
        for _ in range(args.runs):
            t, run_ok, n = run_once(path)
            times.append(t)
            ok &= run_ok
        med = statistics.median(times)
        worst, worst_first = max(worst, med), max(worst_first, times[0])
        row = [_label(path), str(n), f"{med:.2f}", f"{times[0]:.2f}"]
        if args.fresh:
            tf, fresh_ok = fresh(path)
            ok &= fresh_ok
            worst_fresh = max(worst_fresh, tf)
            row.append(f"{tf:.2f}")
        table.add_row(*row, "✓" if ok else "✗")
    Console(width=120).print(table)  # wide enough for every example path, also when piped
    print(f"slowest example: {worst:.2f} s in-process (median), first run {worst_first:.2f} s"
          + (f", fresh interpreter {worst_fresh:.2f} s" if args.fresh else "")
          + f"; process start-up (imports): {startup:.2f} s")


if __name__ == "__main__":
    main()

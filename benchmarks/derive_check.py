"""Time `energy derive` + `energy check` of every example (in-process, after imports), median of runs.

Target (issue 2): under 2 s per example on this CPU. Run: `python benchmarks/derive_check.py [--runs 3]`.
Also prints the one-off import cost of the CLI (torch + sympy), which a fresh `energy` process pays.
"""

from __future__ import annotations

import argparse
import glob
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("files", nargs="*")
    args = ap.parse_args()
    files = args.files or sorted(glob.glob(str(ROOT / "examples/**/*.energy"), recursive=True))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import energydsl.cli"], check=True)
    startup = time.perf_counter() - t0
    from rich.console import Console
    from rich.table import Table

    import energydsl

    table = Table(title=f"derive + check, median of {args.runs} runs (target < 2 s)")
    for col in ("example", "energies", "median s", "ok"):
        table.add_column(col)
    worst = 0.0
    for path in files:
        times, ok, n = [], True, 0
        for _ in range(args.runs):
            t = time.perf_counter()
            spec = energydsl.load(path)
            derived = spec.derive()
            for d in derived:
                d.equations("text")
                ok &= all(r.ok for r in d.check())
            n = len(derived)
            times.append(time.perf_counter() - t)
        med = statistics.median(times)
        worst = max(worst, med)
        table.add_row(str(Path(path).relative_to(ROOT)), str(n), f"{med:.2f}", "✓" if ok else "✗")
    Console().print(table)
    print(f"slowest example: {worst:.2f} s in-process; process start-up (imports): {startup:.2f} s")


if __name__ == "__main__":
    main()

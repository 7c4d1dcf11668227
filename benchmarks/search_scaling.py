"""How the search engine scales: trials per hour with 1 and N local worker processes and on Ray, the
scaling efficiency, and the engine's own overhead (time not spent inside `evaluate`).

    python benchmarks/search_scaling.py                       # toy space, 1 s per trial
    python benchmarks/search_scaling.py --set sleep=0.5 --trials 24 --no-ray
    python benchmarks/search_scaling.py --space path/to/model.energy --set steps=200
    python benchmarks/search_scaling.py --space search/quickstart.energy --cold-checks

Check verdicts are kept on disk between processes and runs (`energydsl.search.stagecheck`), so by default
a case may find the energies checked by an earlier case or run; `--cold-checks` gives every case an empty
check cache, as when a space is searched for the first time.

Two rates are printed: "wall" counts everything from the call to the summary (process start-up,
imports, Ray start-up), "steady" only the span from the first trial's start to the last one's end.
Overhead per trial is (trial time - evaluate time) / trial time, measured inside the worker; overhead
of the run is 1 - sum(evaluate) / (wall x workers), i.e. the share of worker time not spent training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from optuna.trial import TrialState

from energydsl.search import SpaceRef, load_study, run_search, stagecheck
from energydsl.search.report import TIMING, trial_kind

TOY = "energydsl.search.toy:make_space"


def run_case(label: str, ref: SpaceRef, backend: str, workers: int, trials: int,
             root: Path) -> dict[str, Any]:
    storage = str(root / f"{label}.journal")
    t0 = time.perf_counter()
    run_search(ref, backend=backend, workers=workers, trials=trials, storage=storage, study_name=label,
               pruner="none", sampler="random", seed=0, progress=False, json=True,
               cpus_per_trial=1 if backend == "ray" else None)  # the local backend reserves nothing
    wall = time.perf_counter() - t0
    done = [t for t in load_study(storage, label).get_trials(deepcopy=False)
            if t.state.is_finished() and trial_kind(t) not in ("lost", "interrupted")]
    timing = [t.user_attrs.get(TIMING) or {} for t in done]
    eval_s = sum(float(x.get("evaluate_s") or 0.0) for x in timing)
    total = [float(x["total_s"]) for x in timing if x.get("total_s")]
    starts = [t.datetime_start.timestamp() for t in done if t.datetime_start]
    ends = [t.datetime_complete.timestamp() for t in done if t.datetime_complete]
    span = (max(ends) - min(starts)) if starts and ends else wall
    trained = [t for t in done if trial_kind(t) in ("complete", "error", "pruned")]
    return {
        "case": label, "backend": backend, "workers": workers, "trials": len(done), "trained": len(trained),
        "wall_s": round(wall, 2), "steady_s": round(span, 2),
        "tph_wall": round(len(done) / wall * 3600, 1), "tph_steady": round(len(done) / span * 3600, 1),
        "evaluate_s": round(eval_s, 2),
        "overhead_trial": round(1 - eval_s / sum(total), 4) if total else None,
        "overhead_run": round(1 - eval_s / (wall * workers), 4),
        "complete": sum(t.state == TrialState.COMPLETE for t in done),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--space", default=TOY, help="package.module:attr or a .energy path (default: the toy)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="space options")
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2, help="the parallel case (compared with 1 worker)")
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--dir", default=None, help="where the studies go (default: a temporary directory)")
    ap.add_argument("--cold-checks", action="store_true",
                    help="every case starts with no check verdicts, on disk or in this process")
    args = ap.parse_args(argv)
    sets = dict(s.split("=", 1) for s in args.set)
    if args.space == TOY:  # 1 s of "training" per trial, no invalid or duplicate candidates
        sets = {"mixers": "ssm,attn", "sleep": "0.25", "steps": "4", **sets}
    ref = SpaceRef(args.space, sets)
    root = Path(args.dir or tempfile.mkdtemp(prefix="search-scaling-"))
    root.mkdir(parents=True, exist_ok=True)
    cases = [("local-1", "local", 1), (f"local-{args.workers}", "local", args.workers)]
    if not args.no_ray:
        cases.append((f"ray-{args.workers}", "ray", args.workers))
    rows = []
    for label, backend, w in cases:
        if args.cold_checks:  # workers inherit the variable; this process (1 worker, Ray's driver) forgets
            os.environ["ENERGYDSL_CHECK_CACHE"] = str(root / f"{label}-checks")
            stagecheck.forget()
        rows.append(run_case(label, ref, backend, w, args.trials, root))
    base = rows[0]
    for r in rows:
        r["efficiency_wall"] = round(r["tph_wall"] / (base["tph_wall"] * r["workers"]), 3)
        r["efficiency_steady"] = round(r["tph_steady"] / (base["tph_steady"] * r["workers"]), 3)
    if args.json:
        json.dump({"space": str(ref), "cold_checks": args.cold_checks, "results": rows}, sys.stdout, indent=1)
        print()
        return 0
    cold = "   (cold checks)" if args.cold_checks else ""
    print(f"space: {ref}   trials per case: {args.trials}   studies in {root}{cold}")
    head = ["case", "trials", "wall_s", "tph_wall", "tph_steady", "efficiency_wall", "efficiency_steady",
            "overhead_trial", "overhead_run"]
    print("  ".join(f"{h:>17}" for h in head))
    for r in rows:
        print("  ".join(f"{'-' if r[h] is None else r[h]!s:>17}" for h in head))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`energy search SPACE` and `energy report STUDY`: the search engine on the command line.

`register(app)` adds both commands to the `energy` Typer app. The engine and the DSL are imported when a
command runs, not when the CLI starts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from energydsl.errors import UserError

SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", help="Override a search setting: KEY=VALUE (repeatable): search, data, steps, trials, timeout, lr, "
                  "batch, block, warmup, min_lr, weight_decay, grad_clip, eval_interval, eval_iters, seed, dtype.")]


def parse_sets(items: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key.isidentifier():
            raise UserError(f"--set {item!r}: expected KEY=VALUE, e.g. --set steps=100")
        out[key] = value.strip()
    return out


def space_spec(space: str) -> str:
    """A `.energy` path made absolute (workers, Ray actors included, may run elsewhere), else as given
    (a registered name or package.module:attr)."""
    from energydsl.search.space import is_import_path, registered_spaces

    if space in registered_spaces() or is_import_path(space):
        return space
    if not space.strip():
        raise UserError("SPACE is empty", hint="give a .energy file with a `search` declaration (e.g. search/"
                        f"quickstart.energy), or the name of a registered space ({', '.join(registered_spaces())})")
    p = Path(space)
    if not p.exists():
        import difflib

        close = difflib.get_close_matches(space, list(registered_spaces()), n=1)
        raise UserError(f"no such search space file: {space}",
                        hint=f"did you mean the registered space `{close[0]}`?" if close else
                        "give a .energy file with a `search` declaration (e.g. search/quickstart.energy), or the "
                        f"name of a registered space ({', '.join(registered_spaces())})")
    if p.is_dir():
        raise UserError(f"{space} is a directory, not a .energy file")
    return str(p.resolve())


def search(
    space: Annotated[str, typer.Argument(metavar="SPACE", help="A .energy file with a `search` declaration (or a "
                                                               "registered space, or package.module:attr).")],
    trials: Annotated[int | None, typer.Option(help="Finished trials the study should hold (default: the "
                                                    "space's `trials`). A rerun continues the study.")] = None,
    timeout: Annotated[float | None, typer.Option(help="Seconds after which no new trial starts.")] = None,
    workers: Annotated[int, typer.Option(help="Trials run at once (worker processes, or Ray trials); on this "
                                              "machine (not a Ray --address), at most 4 per CPU.")] = 1,
    storage: Annotated[str | None, typer.Option(help="Optuna storage: a journal file or a URL such as "
                                                     "sqlite:///runs/s.db (default runs/STUDY/optuna.journal).")
                       ] = None,
    study: Annotated[str | None, typer.Option(help="Study name (default: the search's name).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON summary on stdout (no live display).")
                       ] = False,
    backend: Annotated[str, typer.Option(help="local | ray")] = "local",
    address: Annotated[str | None, typer.Option(help="Ray cluster address (ray backend), e.g. auto or "
                                                     "HEAD_IP:6379; default a local Ray runtime.")] = None,
    gpus_per_trial: Annotated[float | None, typer.Option(help="GPUs reserved per Ray trial (--backend ray; "
                                                              "fractions allowed; default 0).", show_default=False)
                              ] = None,
    cpus_per_trial: Annotated[float | None, typer.Option(help="CPUs reserved per Ray trial (--backend ray; "
                                                              "fractions allowed; default 1).", show_default=False)
                              ] = None,
    device: Annotated[str, typer.Option(help="cpu | cuda | cuda:N | auto (local workers spread over the GPUs).")
                      ] = "cpu",
    sampler: Annotated[str, typer.Option(help="auto (TPE for one objective, NSGA-II for several) | tpe | nsga2 "
                                              "| random | cmaes | qmc")] = "auto",
    pruner: Annotated[str, typer.Option(help="asha | hyperband | none")] = "asha",
    seed: Annotated[int | None, typer.Option(help="Sampler seed.")] = None,
    report: Annotated[str | None, typer.Option(help="Where to write the HTML report (default: next to the "
                                                    "storage, report.html; report-STUDY.html in a storage of "
                                                    "several studies).")] = None,
    export: Annotated[str | None, typer.Option(help="Where to write the best candidate as a plain .energy file "
                                                    "(default: next to the storage, best.energy; best-STUDY.energy in "
                                                    "a storage of several studies).")] = None,
    holes: Annotated[bool, typer.Option("--holes", help="List the space's holes and exit.")] = False,
    sets: SetOpt = None,
) -> None:
    """Search a space of compositions: sample, check, deduplicate, train; report the best."""
    from energydsl.files import apart, check_output
    from energydsl.search import export_best, hole_rows, run_search, write_report
    from energydsl.search.report import not_an_input
    from energydsl.search.space import SpaceRef, resolve_space
    from energydsl.search.storage import study_outputs

    ref = SpaceRef(space_spec(space), parse_sets(sets))
    for flag, path, example in (("--report", report, "report.html"), ("--export", export, "best.energy")):
        if path is not None and not holes:  # before any trial runs, not after: writable, and neither the storage
            check_output(path, flag, example)  # given nor the space searched (a default storage: below, once known)
            not_an_input(path, flag, storage, ref.spec)
    if report is not None and export is not None and not holes:
        apart(report, "--report", export, "--export")
    if holes:
        resolved = resolve_space(ref)
        rows = hole_rows(resolved)
        if rows is None:  # a Python space may sample its holes in code no listing can read
            print(f"space {resolved.name!r} does not list its holes: a Python space lists them with a "
                  "`distributions()` method (docs/search.md)", file=sys.stderr)
            rows = []
        if as_json:
            print(json.dumps([{"name": n, "values": v, "at": w} for n, v, w in rows]))
        else:
            for n, v, w in rows:
                print(f"{n:<40} {v:<40} {w}")
        return
    summary = run_search(ref, backend=backend, trials=trials, timeout=timeout, workers=workers, storage=storage,
                         study_name=study, sampler=sampler, pruner=pruner, device=device, json=as_json,
                         address=address, gpus_per_trial=gpus_per_trial, cpus_per_trial=cpus_per_trial,
                         seed=seed)
    default_report, default_best = study_outputs(summary["storage"], summary["study"])
    for flag, path in (("--report", report), ("--export", export)):
        if path is not None:  # the default storage and the dataset, known now (the space, its imports: above)
            not_an_input(path, flag, summary["storage"], None, summary.get("dataset"))
    report_path = Path(report) if report else default_report
    apart(report_path, "--report" if report else "the report", Path(export) if export else default_best,
          "--export" if export else "the best candidate")  # one of them a default: known once the storage is
    older = default_report.with_name("report.html")
    if not report and default_report != older and older.exists():  # left from when the storage held one study
        print(f"note: this storage now holds several studies, each with its own report-STUDY.html and "
              f"best-STUDY.energy; {older} and best.energy beside it are older, written before", file=sys.stderr)
    write_report(summary["storage"], summary["study"], report_path)
    summary["report"] = str(report_path)
    summary["best_source"] = None
    if summary.get("completed"):
        best_path = Path(export) if export else default_best
        export_best(summary["storage"], summary["study"], best_path)
        summary["best_source"] = str(best_path)
    err = sys.stderr
    if as_json:
        print(json.dumps(summary, default=_plain))
    else:
        print(f"report: {report_path}", file=err)
        if summary["best_source"]:
            print(f"best candidate: {summary['best_source']}", file=err)
    if summary.get("interrupted"):
        print("interrupted: run the same command again to continue the study", file=err)
        # the shell's status of a command stopped by the signal: 130 for Ctrl-C, 143 for SIGTERM
        # (SystemExit: said why, so `main` adds no note of its own)
        sys.exit(143 if summary.get("interrupted_by") == "SIGTERM" else 130)


def report(
    study: Annotated[str, typer.Argument(metavar="STUDY", help="A study name (its storage: --storage, else "
                                              "runs/STUDY/optuna.journal), a run directory, or a storage path "
                                              "or URL.")],
    out: Annotated[str | None, typer.Option("-o", "--output", help="The HTML file (default: report.html next "
                                                                    "to the storage).")] = None,
    storage: Annotated[str | None, typer.Option(help="Optuna storage (journal file or URL).")] = None,
    name: Annotated[str | None, typer.Option("--study", help="Which study, when the storage holds several.")
                    ] = None,
    export: Annotated[str | None, typer.Option(help="Also write the best candidate as a .energy file here.")
                      ] = None,
    leaderboard: Annotated[bool, typer.Option(help="Print the leaderboard too.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print every trial as JSON (number, state, kind, "
                                                         "params, values, metrics, reason) instead of the "
                                                         "leaderboard.")] = False,
) -> None:
    """Write a self-contained HTML report of a study (plots, leaderboard, every trial's spec and equations)."""
    from energydsl.files import apart, check_output
    from energydsl.search import export_best, load_study, write_report
    from energydsl.search.display import print_leaderboard
    from energydsl.search.report import not_an_input, study_dataset
    from energydsl.search.storage import default_storage_path, study_outputs

    store, study_name = _locate(study, storage, name, default_storage_path)
    loaded = load_study(store, study_name)  # a missing study is refused (naming those there) before any folder is made
    given = out is not None  # `-o ""` is refused as empty, not taken for the default
    path = Path(out) if given else study_outputs(store, study_name)[0]
    check_output(out if given else path, "-o/--output" if given else "report")
    space = str(loaded.user_attrs.get("space") or "")
    data = study_dataset(loaded)
    not_an_input(path, "-o/--output" if given else "report", store, space, data)
    if export is not None:
        check_output(export, "--export", "best.energy")
        not_an_input(export, "--export", store, space, data)
        apart(path, "-o/--output" if given else "the report", export, "--export")
    write_report(store, study_name, path, study=loaded)
    if as_json:
        from energydsl.search.report import trial_rows

        print(json.dumps({"study": study_name, "storage": store, "report": str(path), "trials": trial_rows(loaded)},
                         default=_plain))
    elif leaderboard:  # the command's answer: on stdout, so that `energy report S > board.txt` keeps it
        from rich.console import Console

        print_leaderboard(loaded, console=Console())
    print(f"report: {path}", file=sys.stderr)
    if export is not None:
        number = export_best(store, study_name, export, study=loaded)
        print(f"best candidate (trial #{number}): {export}", file=sys.stderr)


def _locate(study: str, storage: str | None, name: str | None, default: Any) -> tuple[str, str]:
    """(storage, study name) from what the user gave: a study name, a journal path or a URL."""
    import optuna

    from energydsl.search.storage import NO_STUDIES_HINT, check_storage_given, local_file, open_storage, slashless_url

    if storage is not None and not storage.strip():
        raise UserError("--storage is empty", hint="give the journal file or the storage URL of the study")
    if name is not None and not name.strip():
        raise UserError("--study is empty", hint="give the study's name, or leave --study out when the storage "
                                                 "holds one study")
    if not study.strip():
        raise UserError("STUDY is empty", hint="give a study name (its storage: runs/STUDY/optuna.journal), a "
                                               "journal file or a storage URL")
    if storage is None and (Path(study) / "optuna.journal").is_file():  # a run directory: its journal
        storage, study = str((Path(study) / "optuna.journal").resolve()), ""
    if storage is None and ("://" in study or slashless_url(study) or Path(study).is_file()):
        storage, study = (study if "://" in study or slashless_url(study) else str(Path(study).resolve())), ""
    if storage is not None:
        check_storage_given(storage)  # a URL without its `//`, an in-memory SQLite one
    if study and name and study != name:  # `energy report toy --study Q`: the positional was dropped silently
        raise UserError(f"STUDY {study!r} and --study {name!r} name two studies",
                        hint="give the study once: as STUDY, or --study with STUDY the storage or run directory")
    if storage is None:
        storage = default(study)
        if not Path(storage).exists():
            if Path(study).is_dir():
                raise UserError(f"{study} is a directory without a study journal (optuna.journal) in it",
                                hint="give a study name, a run directory, a journal file or a storage URL")
            if "/" in study or study.endswith(".journal"):  # a path (`runs/x`, `/tmp/s.journal`), not a name
                raise UserError(f"no study journal at {study}: no such file or run directory",
                                hint="give an existing journal file, run directory or storage URL, or a study name")
            raise UserError(f"no study {study!r} under runs/ (looked for {storage})",
                            hint="give the storage with --storage, or the journal file itself")
        return str(Path(storage).resolve()), name or study
    local = local_file(storage)
    if local is not None and not local.exists():
        raise UserError(f"no study storage at {storage}")  # opening a missing file would create an empty one
    wanted = name or study
    if wanted:
        return storage, wanted
    names = optuna.get_all_study_names(open_storage(storage))
    if not names:
        where = storage
        if local is not None:  # where it looked: the file, absolute
            where = str(local.resolve()) if "://" not in storage else f"{storage} (the file {local.resolve()})"
        raise UserError(f"the storage {where} holds no studies", hint=NO_STUDIES_HINT)
    if len(names) != 1:
        raise UserError(f"{storage} holds {len(names)} studies ({', '.join(names)})",
                        hint="pick one with --study NAME")
    return storage, names[0]


def _plain(v: Any) -> Any:
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


def register(app: typer.Typer) -> None:
    """Add `search` and `report` to the `energy` command line."""
    app.command("search")(search)
    app.command("report")(report)

"""The `energy` command line: derive, check (and, as they land, compile, train, search).

Every user error prints `file:line:col: error: ...` with the source line and a caret, exit 2.
Anything unexpected prints one line naming the spec and exits 70: never a traceback.
"""

from __future__ import annotations

import glob
import json
import sys
import time
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from .errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="energydsl: sequence layers as optimizers running on energies.")
err = Console(stderr=True, highlight=False)
out = Console(highlight=False)

SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override a dim: NAME=VALUE (repeatable).")]


def parse_sets(items: list[str] | None) -> dict[str, float]:
    dims: dict[str, float] = {}
    for item in items or []:
        name, eq, value = item.partition("=")
        if not eq or not name.strip().isidentifier():
            raise UserError(f"--set {item!r}: expected NAME=VALUE, e.g. --set d=64")
        try:
            dims[name.strip()] = float(value)
        except ValueError:
            raise UserError(f"--set {item!r}: `{value}` is not a number") from None
    return dims


def expand_files(files: list[str]) -> list[str]:
    paths: list[str] = []
    for f in files:
        hits = sorted(glob.glob(f, recursive=True)) if any(c in f for c in "*?[") else [f]
        if not hits:
            raise UserError(f"no file matches {f}")
        paths.extend(hits)
    return paths


@app.command()
def derive(
    file: Annotated[str, typer.Argument(help="A .energy file.")],
    name: Annotated[str | None, typer.Option("--name", help="Which energy (default: all in the file).")] = None,
    fmt: Annotated[str, typer.Option("--format", help="text | latex | markdown | mathml")] = "text",
    sets: SetOpt = None,
) -> None:
    """Print the derived equations: energy, gradient, update per step, tying, untied form."""
    from .api import load

    if fmt not in ("text", "latex", "markdown", "mathml"):
        raise UserError(f"--format {fmt}: expected text, latex, markdown or mathml")
    spec = load(file)
    dims = parse_sets(sets)
    derived = [spec.energy(name, **dims)] if name else spec.derive(**dims)
    if not derived:
        raise UserError(f"{file} declares no energy")
    print("\n\n".join(d.equations(fmt) for d in derived))


@app.command()
def check(
    files: Annotated[list[str], typer.Argument(help=".energy files (globs allowed).")],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per file.")] = False,
    sets: SetOpt = None,
) -> None:
    """Prove every derived update against autograd and SymPy (float64)."""
    from .api import load
    from .checks import as_json as results_json

    dims = parse_sets(sets)
    all_ok = True
    for path in expand_files(files):
        t0 = time.perf_counter()
        try:
            spec = load(path)
            derived = spec.derive(**dims)
        except UserError as e:
            if not as_json:
                raise
            print(json.dumps({"file": path, "ok": False, "error": e.render(), "energies": []}))
            all_ok = False
            continue
        report = []
        file_ok = True
        for d in derived:
            results = d.check()
            ok = all(r.ok for r in results)
            file_ok &= ok
            report.append((d, results, ok))
        all_ok &= file_ok
        seconds = time.perf_counter() - t0
        if as_json:
            print(json.dumps({"file": path, "ok": file_ok, "seconds": round(seconds, 3), "energies": [
                {"name": d.name, "ok": ok, "checks": results_json(rs)} for d, rs, ok in report]}))
            continue
        for d, results, _ok in report:
            table = Table(title=f"{path} · {d.name}", title_justify="left", show_edge=False)
            table.add_column("check")
            table.add_column("")
            table.add_column("detail", overflow="fold")
            marks = {"ok": "[green]✓[/]", "fail": "[red]✗[/]", "warn": "[yellow]![/]", "skip": "[dim]–[/]"}
            for r in results:
                table.add_row(r.name, marks[r.status], r.detail)
            out.print(table)
        out.print(f"[{'green' if file_ok else 'red'}]{path}: {'ok' if file_ok else 'FAILED'}[/] ({seconds:.2f} s)\n")
    if not all_ok:
        raise typer.Exit(1)


def main() -> None:
    """Entry point: user errors exit 2 with a located message; internal errors exit 70 in one line."""
    argv = sys.argv[1:]
    spec_name = next((a for a in argv if a.endswith(".energy")), "the command")
    try:
        code = app(standalone_mode=False)
        if isinstance(code, int) and code:
            sys.exit(code)
    except UserError as e:
        print(e.render(), file=sys.stderr)  # plain print: never wrap a file:line:col location
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        err.print("interrupted")
        sys.exit(130)
    except Exception as e:  # click usage errors are UsageError, handled below
        import click

        if isinstance(e, click.exceptions.UsageError):
            e.show()
            sys.exit(2)
        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(e.exit_code)
        print(f"internal error while processing {spec_name}: {type(e).__name__}: {e} "
              "(please report this with the spec)", file=sys.stderr)
        sys.exit(70)


if __name__ == "__main__":
    main()

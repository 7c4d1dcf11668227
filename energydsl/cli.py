"""The `energy` command line: derive, check, compile, info, graph, train, sample, search, report.

Every user error prints `file:line:col: error: ...` with the source line and a caret, exit 2.
Anything unexpected prints one line naming the spec and exits 70: never a traceback.
"""

from __future__ import annotations

import codecs
import errno
import glob
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .cli_output import broken_pipe, closed_streams_to_devnull, to_stderr, usage_error, warning_line
from .errors import TrainingDiverged, TrainingInterrupted, UserError
from .files import PATH_LIMITS, check_output, not_an_input, writable_dir, write_atomic
from .signal_handlers import CTRL_C, Terminated, sigterm_interrupts
from .sizing import load_model, sized_model

if TYPE_CHECKING:
    from .api import Spec

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="energydsl: sequence layers as optimizers running on energies.")
err = Console(stderr=True, highlight=False, soft_wrap=True)  # paths are never broken across lines
out = Console(highlight=False, soft_wrap=True)  # tables still fit the terminal

SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override a dim: NAME=VALUE (repeatable).")]


def backend_flag(value: str) -> str:
    """`--backend`, checked as the flag is read, in the command line's terms (`codegen.check_backend`'s message
    speaks to Python callers of `.module(...)`)."""
    from .codegen import BACKENDS

    if value not in BACKENDS:
        raise UserError(
            f"unknown backend `{value}` given to --backend",
            hint=f"--backend takes {' or '.join(BACKENDS)} (default: torch)",
        )
    return value


BACKEND_METAVAR = "<torch|triton>"
NAME_HELP = ("Which energy, block or model (a model: each stage of its layer, at its dims); default: every energy "
             "in the file.")


def parse_sets(items: list[str] | None) -> dict[str, float]:
    dims: dict[str, float] = {}
    for item in items or []:
        name, eq, value = item.partition("=")
        if not eq or not name.strip().isidentifier():
            raise UserError(f"--set {item!r}: expected NAME=VALUE, e.g. --set d=64")
        try:
            number = float(value)
        except ValueError:
            raise UserError(f"--set {item!r}: `{value}` is not a number") from None
        if not math.isfinite(number):  # as the spec would be blamed for it: `dim d must be finite, got inf`
            literal = value.strip().lstrip("+-").lower() in ("inf", "infinity", "nan")
            raise UserError(f"--set {item!r}: `{value.strip()}` is "
                            + ("not a finite number" if literal else "too large for a float (at most about 1.8e308)"))
        dims[name.strip()] = number
    return dims


def parse_betas(text: str) -> tuple[float, float]:
    """`--betas 0.9,0.95` as AdamW's pair (its range is checked with the other settings)."""
    parts = text.split(",")
    try:
        if len(parts) == 2:
            return float(parts[0]), float(parts[1])
    except ValueError:
        pass
    raise UserError(f"--betas takes two numbers B1,B2, got {text!r}", hint="e.g. --betas 0.9,0.95")


def expand_files(files: list[str]) -> list[str]:
    paths: list[str] = []
    for f in files:
        pattern = any(c in f for c in "*?[") and not os.path.exists(f)  # a file named `m[1].energy` is itself
        hits = sorted(glob.glob(f, recursive=True)) if pattern else [f]
        if not hits:
            raise UserError(f"no file matches {f}")
        paths.extend(hits)
    return paths


def no_energy(path: str, spec, command: str = "derive") -> UserError:
    """A file with no energy of its own; the hint names what it has (blocks, imported energies, models), and how
    `command` (derive, compile) takes one."""
    syntax = spec.syntax
    imported = [n for n in syntax.energies if n not in spec.energy_names]
    does = {"derive": "derives", "compile": "compiles"}.get(command, "takes")
    if syntax.blocks and not spec.model_names:
        hint = f"it has blocks ({', '.join(syntax.blocks)}): `energy {command} {path} --name " \
               f"{next(iter(syntax.blocks))}` {does} one"
    elif syntax.models:  # its own first: a model gives its blocks the dims they read (`heads = h`)
        model = (spec.model_names or list(syntax.models))[0]
        blocks = f", and its blocks ({', '.join(syntax.blocks)}) take --name too" if syntax.blocks else ""
        hint = f"it declares models: `energy {command} {path} --name {model}` {does} a model's layers{blocks}; " \
               "`energy graph`, `info` and `train` take models"
    elif imported:
        hint = f"it imports energies ({', '.join(imported)}): `energy {command} {path} --name {imported[0]}` " \
               f"{does} one"
    else:
        hint = "an energy is `energy Name(d = 8) { state z[d] ... }` (docs/language.md)"
    own = " of its own" if imported else ""  # `--name` takes an imported one
    return UserError(f"{path} declares no energy{own}", hint=hint)


@app.command()
def derive(
    file: Annotated[str, typer.Argument(metavar="FILE", help="A .energy file.")],
    name: Annotated[str | None, typer.Option("--name", help=NAME_HELP)] = None,
    fmt: Annotated[str, typer.Option("--format", help="text | latex | markdown | mathml")] = "text",
    sets: SetOpt = None,
) -> None:
    """Print the derived equations: energy, gradient, update per step, tying, untied form."""
    from .api import load

    if fmt not in ("text", "latex", "markdown", "mathml"):
        raise UserError(f"--format {fmt}: expected text, latex, markdown or mathml")
    spec = load(file)
    dims = parse_sets(sets)
    derived = spec.derivations(name, **dims)
    if not derived:
        raise no_energy(file, spec)
    print("\n\n".join(d.equations(fmt) for d in derived))


@app.command()
def check(
    files: Annotated[list[str], typer.Argument(metavar="FILES", help=".energy files (globs allowed).")],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per file.")] = False,
    sets: SetOpt = None,
) -> None:
    """Prove every derived update against autograd and SymPy, and every model's causality (float64)."""
    from .api import load
    from .checks import as_json as results_json

    dims = parse_sets(sets)
    all_ok = True
    status = 1  # of a failed run: 1 a failing check, 2 a bad file, 70 an internal error (the worst one wins)
    paths = expand_files(files)
    for path in paths:
        t0 = time.perf_counter()
        try:
            spec = load(path)
            if not spec.energy_names and not spec.model_names and not spec.block_names and not spec.search_names:
                raise no_energy(path, spec)
            kinds = dict.fromkeys(spec.model_names, "model") | dict.fromkeys(spec.search_names, "search")
            report = [(kinds.get(name, "energy"), name, results, all(r.ok for r in results))
                      for name, results in spec.check(**dims).items()]
        except Exception as e:  # one bad file of several: said, and the files after it still run
            if not as_json and len(paths) == 1:
                raise
            internal = not isinstance(e, UserError)
            first = (str(e).strip().splitlines() or [""])[0]
            error = f"internal error: {type(e).__name__}: {first} (please report this with the spec)" if internal \
                else e.render()
            if as_json:
                print(json.dumps({"file": path, "ok": False, "error": error, "energies": [], "models": [],
                                  "searches": []}))
            else:
                to_stderr(error)
                out.print(f"[red]{escape(path)}: FAILED[/] (not checked)\n")
            all_ok, status = False, max(status, 70 if internal else 2)
            continue
        file_ok = all(ok for *_, ok in report)
        all_ok &= file_ok
        seconds = time.perf_counter() - t0
        if as_json:
            rows: dict[str, list[dict]] = {"energies": [], "models": [], "searches": []}
            for kind, name, results, ok in report:
                rows[{"model": "models", "search": "searches"}.get(kind, "energies")].append(
                    {"name": name, "ok": ok, "checks": results_json(results)})
            print(json.dumps({"file": path, "ok": file_ok, "seconds": round(seconds, 3), **rows}))
            continue
        for kind, name, results, _ok in report:
            title = escape(f"{path} · {'' if kind == 'energy' else kind + ' '}{name}")  # a path's `[x]` as written
            table = Table(title=title, title_justify="left", show_edge=False)
            table.add_column("check")
            table.add_column("")
            table.add_column("detail", overflow="fold")
            marks = {"ok": "[green]✓[/]", "fail": "[red]✗[/]", "warn": "[yellow]![/]", "skip": "[dim]–[/]"}
            for r in results:
                table.add_row(r.name, marks[r.status], Text(r.detail))  # as written: `[m]` is not markup
            out.print(table)
        color, verdict = ("green", "ok") if file_ok else ("red", "FAILED")
        out.print(f"[{color}]{escape(path)}: {verdict}[/] ({seconds:.2f} s)\n")
    if not all_ok:
        raise typer.Exit(status)


def not_a_source(output: str, spec: Spec, flag: str, example: str) -> None:
    """Refuse an output path that is one of the spec's own files (the one given or one it imports): writing
    there replaced the spec with the output, without a word."""
    first, *imported = spec.syntax.files  # every file read: the spec and each import, resolved
    not_an_input(output, flag, [("the spec", Path(first)), *(("a file the spec imports", Path(f)) for f in imported)],
                 example)


@app.command("compile")
def compile_(
    file: Annotated[str, typer.Argument(metavar="FILE", help="A .energy file.")],
    output: Annotated[str | None, typer.Option("-o", "--output", help="Write here (default, or -: stdout).")] = None,
    name: Annotated[str | None, typer.Option("--name", help=NAME_HELP)] = None,
    backend: Annotated[
        str,
        typer.Option(
            "--backend", metavar=BACKEND_METAVAR, callback=backend_flag, help="torch, or triton (Triton kernels)"
        ),
    ] = "torch",
    sets: SetOpt = None,
) -> None:
    """Generate readable PyTorch modules: one nn.Module per energy, its forward the derived update."""
    from .api import load
    from .codegen import class_names, energy_source

    output = None if output == "-" else output  # as most tools read `-o -`: it wrote a file named `-`
    if output is not None:
        check_output(output, "-o/--output", "layers.py")  # before the derivation, which may take a while
    spec = load(file)
    if output is not None:
        not_a_source(output, spec, "-o/--output", "layers.py")
    dims = parse_sets(sets)
    derived = spec.derivations(name, **dims)
    if not derived:
        raise no_energy(file, spec, "compile")
    unfused: list[str] = []
    text = energy_source(derived, backend, unfused)
    for note in unfused:
        err.print(f"note: {note}", markup=False)
    if output is None:
        print(text)
        return
    write_atomic(Path(output), text)
    err.print(f"wrote {output} ({', '.join(class_names(derived))}, backend {backend})", markup=False)


@app.command()
def info(
    file: Annotated[str, typer.Argument(metavar="FILE", help="A .energy file with a model.")],
    name: Annotated[str | None, typer.Option("--name", help="Which model.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    sets: SetOpt = None,
) -> None:
    """Sizes and costs: parameters (total, non-embedding), forward FLOPs and activation memory per token."""
    from .api import load

    model, layers = sized_model(load(file), name, "torch", parse_sets(sets))
    data = model.info(layers=layers)
    if as_json:
        print(json.dumps(data))
        return
    table = Table(title=escape(f"{file} · {data['model']}"), title_justify="left", show_edge=False, show_header=False)
    for key in ("params", "params_non_embedding", "flops_per_token", "activation_bytes_per_token", "layers"):
        table.add_row(key.replace("_", " "), f"{data[key]:,}")
    table.add_row("stages", " -> ".join(data["stages"]) + (" (shared)" if data["shared"] else ""))
    table.add_row("dims", ", ".join(f"{k}={v}" for k, v in data["dims"].items()))
    out.print(table)


@app.command()
def graph(
    file: Annotated[str, typer.Argument(metavar="FILE", help="A .energy file with a model.")],
    name: Annotated[str | None, typer.Option("--name", help="Which model.")] = None,
    dot: Annotated[str | None, typer.Option("--dot", help="Also write the graph as Graphviz DOT here (`-`: to "
                                                           "stdout, the composition then to stderr).")] = None,
    sets: SetOpt = None,
) -> None:
    """Print a model's composition (embeddings, stages per layer, norms, head) and write it as DOT.

    Up to 32 layers are drawn one by one; a deeper stack (its layers are identical) is drawn once, in a box
    labelled `layer × N`."""
    from .api import load
    from .composition import check_stage_state, describe, stage_named
    from .dot import dot_text
    from .semantics import lower_energy

    to_stdout = dot == "-"  # as `compile -o -`: it wrote a file named `-`
    if dot is not None and not to_stdout:
        check_output(dot, "--dot", "model.dot")  # before the composition is printed, not after
    spec = load(file)
    if dot is not None and not to_stdout:
        not_a_source(dot, spec, "--dot", "model.dot")
    plan = spec.plan(name, **parse_sets(sets))
    for stage in plan.stages:  # each stage's declaration resolves (names, shapes, untie targets), as derive needs,
        with stage_named(stage, plan.name):  # and its state fits the stream, as training needs
            spec = lower_energy(stage.decl, stage.dims)
        check_stage_state(plan, stage, spec)
    print(describe(plan), file=sys.stderr if to_stdout else sys.stdout)
    if dot is not None:
        g = plan.graph()
        text = dot_text(plan, g)
        if to_stdout:
            print(text, end="")
            return
        write_atomic(Path(dot), text)
        repeat = g.graph["repeat"]
        drawn = f": {repeat:,} identical layers drawn once, as `layer × {repeat:,}`" if repeat > 1 else ""
        err.print(f"wrote {dot} ({g.number_of_nodes()} nodes{drawn})", markup=False)


@app.command("train")
def train_(
    file: Annotated[str, typer.Argument(metavar="FILE", help="A .energy file with a model.")],
    data: Annotated[str, typer.Option("--data", help="shakespeare_char | bytes:PATH | chars:PATH | listops | mqar")],
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps.")] = 300,
    name: Annotated[str | None, typer.Option("--name", help="Which model.")] = None,
    out_dir: Annotated[
        str | None, typer.Option("--out", help="Run directory (default runs/<model>, lower case).")
    ] = None,
    batch_size: Annotated[int, typer.Option("--batch-size")] = 16,
    block_size: Annotated[int | None, typer.Option("--block-size", help="Default: the model's context.")] = None,
    lr: Annotated[float, typer.Option("--lr")] = 1e-3,
    min_lr: Annotated[float | None, typer.Option("--min-lr", help="The cosine schedule's end. Default: --lr / 10.")
                      ] = None,
    weight_decay: Annotated[float, typer.Option("--weight-decay", help="AdamW's, on matrices only (not norm gains).")
                            ] = 0.1,
    betas: Annotated[str, typer.Option("--betas", metavar="B1,B2", help="AdamW's moment decays.")] = "0.9,0.99",
    grad_clip: Annotated[float, typer.Option("--grad-clip", help="Gradient norm clipping; 0: off.")] = 1.0,
    dtype: Annotated[str, typer.Option("--dtype", help="float32 | bfloat16 | float16 (autocast; float16: CUDA)")
                     ] = "float32",
    eval_interval: Annotated[int, typer.Option(
        "--eval-interval", help="Evaluate and checkpoint every N steps (a killed run resumes from the last one).",
    )] = 100,
    eval_iters: Annotated[int, typer.Option("--eval-iters")] = 20,
    warmup: Annotated[int, typer.Option("--warmup")] = 30,
    device: Annotated[str, typer.Option("--device", help="cpu | cuda | cuda:N | auto")] = "cpu",
    backend: Annotated[
        str,
        typer.Option(
            "--backend", metavar=BACKEND_METAVAR, callback=backend_flag, help="torch, or triton (fused kernels; a GPU)"
        ),
    ] = "torch",
    seed: Annotated[int, typer.Option("--seed")] = 1337,
    compile_: Annotated[bool, typer.Option(
        "--compile", help="torch.compile the model (Inductor; the first steps compile, minutes on a CPU).",
    )] = False,
    fresh: Annotated[bool, typer.Option("--fresh", help="Ignore an existing checkpoint in --out.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print a final JSON summary.")] = False,
    sets: SetOpt = None,
) -> None:
    """Train a model: AdamW, warmup + cosine, clipping, best-validation checkpoint (safetensors), resumable.

    Exit status:
    0 done;
    1 diverged (the last good checkpoint is kept);
    2 bad input (spec, flags, data, a run directory of another model or a damaged one, out of memory, a --compile
    that fails);
    70 an internal error;
    130 interrupted (Ctrl-C: the run is saved first; a second Ctrl-C stops at once);
    141 stdout's reader went away (`| head`: the last evaluation's checkpoint is kept);
    143 stopped by SIGTERM (saved first, as for Ctrl-C).

    With --fresh, the previous run's files in --out are replaced only once the new run writes its first checkpoint.
    """
    import torch

    from .training import TrainConfig, load_dataset, train
    from .training.config import TRAIN_FLAGS
    from .training.run_dir import interrupted_at_once_note, resume_hint

    if steps < 1:
        raise UserError(f"--steps must be at least 1, got {steps}")
    if block_size is not None and block_size < 1:
        raise UserError(f"--block-size must be at least 1, got {block_size}")
    if out_dir is not None and not out_dir.strip():
        raise UserError("--out is empty", hint="give a run directory, or leave --out out for runs/<model>")
    # checked before the model and the data are built; the block size defaults to the model's context, below
    config = TrainConfig(steps=steps, batch_size=batch_size, block_size=block_size or 1, lr=lr,
                         min_lr=min_lr, warmup_steps=warmup,
                         weight_decay=weight_decay, betas=parse_betas(betas), grad_clip=grad_clip,
                         eval_interval=eval_interval, eval_iters=eval_iters, device=device, seed=seed, dtype=dtype,
                         compile=compile_)
    config.validate(TRAIN_FLAGS)
    train_on = config.resolve_device(TRAIN_FLAGS)
    run_dir: Path | None = None
    try:
        with sigterm_interrupts():  # SIGTERM before the loop (which handles its own) says what it kept
            # --seed fixes the initial weights too: a fresh run is reproducible
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                spec, model = load_model(file, name, parse_sets(sets), backend, train_on=train_on,
                                         block_size=block_size, dtype=dtype)
            run_dir = Path(out_dir or Path("runs") / model.plan.name.lower())
            writable_dir(run_dir, "--out", keep=False)  # made when the run claims it, after the data's checks
            config.block_size = block_size or model.block_size
            if config.block_size > model.block_size:
                raise UserError(f"--block-size {config.block_size} is longer than the model's context "
                                f"{model.block_size}", hint=f"add --set context={config.block_size}, or give a "
                                f"--block-size of at most {model.block_size}")
            dataset = load_dataset(data)
            example = getattr(dataset, "seq_len", None)  # a task's examples are whole rows of this many tokens
            problems, fixes = [], []  # both the block and the vocab, in one message: not one rerun for each
            if example is not None and config.block_size < example:
                fixes += ([f"--set context={example}"] if example > model.block_size else []) + \
                    ([f"--block-size {example}"] if block_size else [])
                problems.append(f"{dataset.name} examples are {example} tokens long but the block size is "
                                f"{config.block_size}" + ("" if block_size else " (the model's context)"))
            if dataset.vocab_size > model.vocab_size:
                problems.append(f"dataset {data} has {dataset.vocab_size} tokens but the model's vocab is "
                                f"{model.vocab_size}")
                fixes.append(f"--set vocab={dataset.vocab_size}")
            if problems:
                raise UserError("; and ".join(problems), hint=f"add {' '.join(fixes)}")
            dataset.check_block_size(config.block_size)
        try:
            result = train(model, dataset, config, run_dir, metadata=model.run_metadata, resume=not fresh,
                           progress=not as_json, names={**TRAIN_FLAGS, "backend": "--backend"},
                           notify=lambda notice: print(notice, file=sys.stderr))
        except TrainingDiverged as e:
            _report_divergence(e, run_dir, as_json)
            raise typer.Exit(1) from None
        except TrainingInterrupted as e:
            print(f"interrupted at step {e.step}: saved {e.checkpoint}; {resume_hint(fresh)}", file=sys.stderr)
            if as_json:  # an outcome, as a divergence is
                print(json.dumps({"interrupted": True, "step": e.step, "checkpoint": e.checkpoint,
                                  "out": str(run_dir)}))
            sys.exit(128 + e.signum)  # 130 (Ctrl-C), 143 (SIGTERM); SystemExit passes Typer and `main` as is
    except KeyboardInterrupt as e:  # a Ctrl-C (or SIGTERM) before the training loop, or a second one: at once
        given = Path(out_dir) if out_dir else None  # a run there (--fresh or not) is as it was
        print(interrupted_at_once_note(run_dir or given, fresh, started=run_dir is not None), file=sys.stderr)
        sys.exit(143 if isinstance(e, Terminated) else 130)
    result.setdefault("params", model.num_params())
    result["out"] = str(run_dir)
    if as_json:
        print(json.dumps(result, default=str))
    else:
        out.print(f"best val loss {result.get('best_val_loss', float('nan')):.4f} · checkpoints in {run_dir}",
                  markup=False)


def _better_best(run_dir: Path, val: float | None) -> str:
    """A note on the best checkpoint where it is better than the last good one: a training that climbs for a
    while before it diverges leaves a "good" last checkpoint (under 4x the initial loss) far worse."""
    from .training.run_dir import committed_training

    best = committed_training(run_dir, "best") or {}
    try:
        step, loss = int(best["step"]), float(best["val_loss"])
    except (ValueError, KeyError, TypeError):
        return ""
    if val is None or not loss < val:
        return ""
    return (f" (the best so far, step {step} with val loss {loss:.4f}, is {run_dir / 'best.safetensors'}, which "
            "`energy sample` reads; training resumes from the last)")


def _report_divergence(e: TrainingDiverged, run_dir: Path, as_json: bool) -> None:
    """A diverged training is an outcome, not a bug: one line on stderr (and a JSON object with --json)."""
    import math

    loss = e.loss if math.isfinite(e.loss) else None
    reason, step, val = e.reason, e.checkpoint_step, e.checkpoint_val_loss
    if e.checkpoint:
        loss_text = f" (val loss {val:.4f})" if val is not None else ""
        kept = (f"kept the last good checkpoint, step {step}{loss_text}: {e.checkpoint}; "
                f"rerun with {e.remedy} to resume from it, or with --fresh to start over{_better_best(run_dir, val)}")
    else:
        kept = f"no good checkpoint was written; rerun with {e.remedy}"
    print(f"training diverged at step {e.step}: {reason}; {kept}", file=sys.stderr)
    if as_json:
        print(json.dumps({"diverged": True, "step": e.step, "loss": loss, "reason": reason,
                          "checkpoint": e.checkpoint, "checkpoint_step": step, "checkpoint_val_loss": val,
                          "out": str(run_dir)}, allow_nan=False))


@app.command()
def sample(
    checkpoint: Annotated[str, typer.Argument(metavar="RUN", help="A run directory (its best checkpoint, else its "
                                              "last) or a .safetensors checkpoint.")],
    prompt: Annotated[str, typer.Option(
        "--prompt", help="Text to continue. Default: a newline (chars: and bytes: data), else token 0.")] = "",
    tokens: Annotated[int, typer.Option("--tokens", help="How many tokens to generate.")] = 200,
    temperature: Annotated[float, typer.Option("--temperature", help="0: greedy (the likeliest token).")] = 0.8,
    top_k: Annotated[int | None, typer.Option(
        "--top-k", help="Sample among the K likeliest tokens only. Default: all of them.")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
) -> None:
    """Generate text from a trained checkpoint (its spec and dims travel with it)."""
    import torch

    from .training.sampling import stream
    from .training.trained import divergence_note, load_trained

    if tokens < 0:
        raise UserError(f"--tokens must be at least 0, got {tokens}", hint="how many tokens to generate")
    if not temperature >= 0 or math.isinf(temperature):
        raise UserError(f"--temperature must be a finite number >= 0, got {temperature:g}",
                        hint="0 is greedy (the likeliest token), 1 samples the model's own distribution")
    if top_k is not None and top_k < 1:
        raise UserError(f"--top-k must be at least 1, got {top_k}", hint="leave it out to sample from every token")
    if not 0 <= seed < 2**64:  # torch's generator takes 64 bits
        raise UserError(f"--seed must be in [0, 2**64), got {seed}")
    model, codec, meta = load_trained(checkpoint)
    if (note := divergence_note(checkpoint, meta)) is not None:
        err.print(f"note: {note}", markup=False, highlight=False)
    codec, ids, new = stream(model, codec, prompt, tokens, temperature, top_k, torch.Generator().manual_seed(seed),
                             metadata=meta)
    # printed as drawn, so that a long run shows its text and Ctrl-C keeps what came: a bytes model's bytes through
    # an incremental UTF-8 decoder (a character split over tokens prints whole; a byte that is not UTF-8 as U+FFFD,
    # so the output stays text), every other codec's tokens decoded one by one
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace") if codec.kind == "bytes" else None
    separator = " " if codec.kind in ("words", "ints") else ""

    def emit(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    prompted = bool(ids)  # no tokens (`""`, spaces alone for words): drawn after the start token, not shown
    if prompted:
        emit(utf8.decode(bytes(ids)) if utf8 else codec.decode(ids))
    for n, token in enumerate(new):
        emit(utf8.decode(bytes([token])) if utf8 else (separator if prompted or n else "") + codec.decode([token]))
    emit((utf8.decode(b"", final=True) if utf8 else "") + "\n")


from .cli_search import register as register_search  # noqa: E402  (search and report; optuna loads lazily)

register_search(app)


# a full disk, an exhausted quota, a file system turned read-only while a command writes
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}
_KEPT = "files saved before are as they were"  # true of a first save too: "what was saved is kept" was not


def main() -> None:
    """Entry point: user errors exit 2 with a located message; internal errors exit 70 in one line; energydsl's
    warnings one line each."""
    closed_streams_to_devnull()
    previous, warnings.showwarning = warnings.showwarning, warning_line
    try:
        _main()
    finally:
        warnings.showwarning = previous


def _main() -> None:
    argv = sys.argv[1:]
    spec_name = next((a for a in argv if a.endswith(".energy")), "the command")
    try:
        code = app(standalone_mode=False)
        sys.stdout.flush()  # a reader gone away (`| head`) shows here, not in Python's flush at exit
        if CTRL_C.received and code in (None, 0, 1):  # a Ctrl-C came and something swallowed it: not a result
            code = 130
        if isinstance(code, int) and code:
            if code == 130:  # Typer turns a Ctrl-C in a command into this status, silently
                err.print("interrupted")
            sys.exit(code)
    except SystemExit as e:  # click answers a broken pipe with exit status 1, which is an outcome's here
        context = e.__context__
        if isinstance(context, OSError) and context.errno == errno.EPIPE:
            broken_pipe()
        raise
    except BrokenPipeError:
        broken_pipe()
    except UserError as e:
        to_stderr(e.render())  # plain print: never wrap a file:line:col location
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        err.print("interrupted")
        sys.exit(130)
    except Exception as e:
        if isinstance(e, OSError) and e.errno in _FULL:  # the machine's state, not a bug: saved files are intact
            where = f" {e.filename}" if e.filename else ""
            to_stderr(f"error: cannot write{where}: {e.strerror}\n"
                       f"hint: {_KEPT}: make room (or a writable place) and rerun the same command")
            sys.exit(2)
        if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM):  # a folder made read-only mid-run
            where = f" {e.filename}" if e.filename else ""
            to_stderr(f"error: cannot access{where}: {e.strerror}\n"
                       f"hint: {_KEPT}: restore the permissions (or choose another place) and rerun "
                       "the same command")
            sys.exit(2)
        if isinstance(e, UnicodeEncodeError) and _an_output_encoding(e.encoding):  # PYTHONIOENCODING=ascii
            to_stderr(f"error: the output encoding ({e.encoding}) cannot write {e.object[e.start:e.end]!r}\n"
                      "hint: set PYTHONIOENCODING=utf-8 (or a UTF-8 locale, LANG=C.UTF-8) and rerun the same command")
            sys.exit(2)
        if isinstance(e, OSError) and e.errno == errno.ENAMETOOLONG:  # pathlib's exists() and is_dir() raise it
            to_stderr(f"error: a path is too long: {e.filename or '?'} ({e.strerror})\nhint: {PATH_LIMITS}")
            sys.exit(2)
        # click's usage errors (a missing or bad option); typer >= 0.20 vendors its own click, so match by name
        kinds = {c.__name__ for c in type(e).__mro__}
        if "UsageError" in kinds:  # as every other flag error reads: `error: ...` and a hint, not click's block
            to_stderr(usage_error(e, argv))
            sys.exit(2)
        if "ClickException" in kinds:
            try:
                e.show()  # type: ignore[attr-defined]
            except BrokenPipeError:
                to_stderr("")
            sys.exit(e.exit_code)  # type: ignore[attr-defined]
        if CTRL_C.received:  # an error that a Ctrl-C let loose (a module left half-imported), not a bug
            err.print("interrupted")
            sys.exit(130)
        first = (str(e).strip().splitlines() or [""])[0]  # one line: torch appends pages of C++ frames
        to_stderr(f"internal error while processing {spec_name}: {type(e).__name__}: {first} "
                   "(please report this with the spec)")
        sys.exit(70)


def _an_output_encoding(encoding: str) -> bool:
    """Whether `encoding` is standard output's or error's, and not UTF-8: the math, `·` and `→` cannot be written."""
    def name(e: str | None) -> str | None:
        try:
            return codecs.lookup(e).name if e else None
        except LookupError:
            return None

    ours = {name(getattr(stream, "encoding", None)) for stream in (sys.stdout, sys.stderr)}
    return name(encoding) in ours - {None, "utf-8"}


if __name__ == "__main__":
    main()

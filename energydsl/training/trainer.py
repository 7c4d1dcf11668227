"""The training loop: nanoGPT's train.py as a function, with checkpoints, resuming and divergence checks.

`train(model, dataset, config, out_dir, metadata=...)` trains any `model(idx[B, T]) -> logits[B, T, V]`
with AdamW (weight decay on matrices only, not norm gains), linear warmup then cosine decay, gradient clipping
and evaluation every `eval_interval` steps. In `out_dir` it keeps `last.*` (for resuming), `best.*` (the
lowest validation loss), `metrics.jsonl` and `loss.png`. Step `s` always means "after `s` updates".
Checkpoints are written at evaluations, and when Ctrl-C (or SIGTERM) stops a run that has an `out_dir`: the
step under way finishes, the run is evaluated and saved as `last` (not `best`: an unscheduled evaluation would
make the best depend on when the run was stopped), and `TrainingInterrupted` (a KeyboardInterrupt) is raised;
a second signal stops at once. A killed run resumes from its last checkpoint.

Divergence: a loss (any training step's, or an evaluation's train or validation loss) has diverged
when it is NaN or infinite, or above `diverge_factor` (4) times the run's initial loss (the training
loss of the untrained model, measured at step 0) and above 2 ln V (twice a uniform guess's loss).
Ordinary training, even noisy or during warmup, stays at or below the initial loss. A diverged run
raises `TrainingDiverged` without writing `last` or `best` from the diverged state, so `last` is the
last good checkpoint; it records the divergence in `metrics.jsonl` and in `diverged.json`. Resuming
such a run with identical settings would replay the divergence, so it is refused (`UserError`);
with any setting changed (typically a lower lr) it resumes from the last good checkpoint.

An attempt changes nothing in `out_dir` until it has begun (`RunDir.begin`: its first checkpoint, or a resumed
run's first step): a fresh run (`resume=False`) that fails before its step-0 checkpoint leaves the previous run's
files whole. Running out of memory on a batch is a `UserError` naming the sizes to lower; `last` is kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import signal
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from energydsl.errors import TrainingDiverged, TrainingInterrupted, UserError, first_few
from energydsl.signal_handlers import handlers_restored

from .arguments import check_arguments, check_batch_fits, check_fits
from .config import DTYPES, TRAIN_FLAGS, TrainConfig
from .data import IGNORE_INDEX, LMDataset
from .run_dir import START_OVER_HINT, RunDir, RunState, changed_settings, describe_changes, finite_or_none

__all__ = ["TRAIN_FLAGS", "TrainConfig", "configure_optimizer", "estimate_loss", "lr_at", "train"]


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr` at `steps` (nanoGPT's get_lr).

    A warmup longer than the run ends with it. The clamp is applied here, not to the config, so that the
    config records the warmup asked for, and a resume with more steps does not report a warmup change that
    nobody made."""
    warmup = min(config.warmup_steps, config.steps)
    if step < warmup:
        return config.lr * (step + 1) / (warmup + 1)
    if step >= config.steps:
        return config.min_lr
    ratio = (step - warmup) / max(1, config.steps - warmup)
    return config.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (config.lr - config.min_lr)


def configure_optimizer(model: nn.Module, config: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings only; biases, vectors and norm gains are not decayed
    (a matrix stream's gains are matrices, [dk, dv], and still gains: decay would pull them towards 0)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise UserError("the model has no trainable parameters")
    gains = {id(p) for m in model.modules() if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) for p in m.parameters()}
    decayed = {id(p) for p in params if p.dim() >= 2 and id(p) not in gains}
    groups = [
        {"params": [p for p in params if id(p) in decayed], "weight_decay": config.weight_decay},
        {"params": [p for p in params if id(p) not in decayed], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    fused = device.type == "cuda" and all(p.is_floating_point() for p in params)
    return torch.optim.AdamW(groups, lr=config.lr, betas=tuple(config.betas), fused=fused or None)


def _loss(model: nn.Module, x: Tensor, y: Tensor, vocab: int) -> Tensor:
    logits = model(x)
    ok = isinstance(logits, Tensor) and logits.dim() == 3 and logits.shape[:2] == x.shape
    if not ok or logits.size(-1) < vocab:  # a model bug, not a user error
        got = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(f"the model must map idx[B, T] to logits[B, T, V >= {vocab}]; for {tuple(x.shape)} "
                         f"it returned {got}")
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)


@torch.no_grad()
def estimate_loss(model: nn.Module, dataset: LMDataset, config: TrainConfig, device: torch.device,
                  autocast: Any = contextlib.nullcontext) -> dict[str, float]:
    """Mean loss over `eval_iters` batches per split; fixed generators make evaluations comparable."""
    was_training = model.training
    model.eval()
    out = {}
    for offset, split in enumerate(("train", "val"), start=1):
        generator = torch.Generator().manual_seed((config.seed + 1_000_003 * offset) % 2**64)
        total = torch.zeros((), device=device)  # summed on the device: one sync per split, not per batch
        for _ in range(config.eval_iters):
            x, y = dataset.get_batch(split, config.batch_size, config.block_size, generator)
            with autocast():
                total += _loss(model, x.to(device), y.to(device), dataset.vocab_size)
        out[split] = total.item() / config.eval_iters
    model.train(was_training)
    return out


def _jsonable(value: Any) -> Any:
    """The value as it reads back from JSON, so metadata compares equal after a round trip."""
    return json.loads(json.dumps(value, default=str))


def _rng_states(generator: torch.Generator, device: torch.device) -> dict[str, Tensor]:
    states = {"batches": generator.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def train(
    model: nn.Module,
    dataset: LMDataset,
    config: TrainConfig,
    out_dir: Path | str | None,
    *,
    metadata: dict[str, Any] | None = None,
    resume: bool = True,
    progress: bool = True,
    on_eval: Callable[[int, float], bool] | None = None,
    names: dict[str, str] | None = None,
    notify: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train `model` on `dataset`; returns losses, steps, throughput (tokens/s, training steps only).

    Resumes from `out_dir/last.*` when `resume` and the checkpoint's metadata equals `metadata`
    (the caller's description of the model, e.g. spec source and dims; left out, a model built by
    `load(path).model(...)` describes itself as `energy train` records it, so `energy sample` and
    `load_trained` rebuild it, and any other model records nothing). `progress`: a progress bar on a terminal,
    and elsewhere (a log file, a batch job) one line per evaluation on stderr. `on_eval(step, val_loss)`
    returning True stops after that evaluation. Raises `TrainingDiverged` on a NaN/inf or exploding
    loss (see the module docstring), leaving the last checkpoint (saved at the previous evaluation)
    untouched; the exception's `checkpoint` names it (None if there is none), `checkpoint_step` its
    step and `reason` says what diverged. Raises `UserError` if `out_dir` holds a checkpoint of a
    different model or dataset (`resume=False` overwrites it), or if it holds a run that diverged
    with exactly this config (resuming would diverge again; change a setting, e.g. a lower lr).

    Resuming with other settings (a lower lr after a divergence, more steps) passes one line saying what
    changed to `notify` (default: `warnings.warn`), or, when the run is already at `steps`, that there is nothing
    to train; other seed, batch_size, block_size or eval_iters are refused (`UserError`, see
    `run_dir.KEPT_ON_RESUME`). Errors name settings as `names` spells them (a CLI passes its flags, e.g.
    {"lr": "--lr"}).
    """
    if metadata is None:
        metadata = dict(getattr(model, "run_metadata", None) or {})
    check_arguments(model, dataset, config, metadata, out_dir=out_dir, resume=resume, progress=progress,
                    on_eval=on_eval, notify=notify, names=names)
    config = dataclasses.replace(config)  # validate() normalizes in place (min_lr, dtype): not the caller's config
    if config.block_size is None:  # the model's context, as `energy train` defaults it
        context = getattr(model, "block_size", None)
        config.block_size = context if isinstance(context, int) else 256
    config.validate(names)
    device = config.resolve_device(names)
    dataset.check_block_size(config.block_size)
    check_fits(model, dataset, config)
    check_batch_fits(model, config, device, names)
    metadata = _jsonable(metadata)
    if "training" in metadata:
        raise UserError("metadata must not use the key 'training': the trainer writes it")
    if callable(getattr(model, "equation_hash", None)):  # a resumed run must be the same derived model
        metadata.setdefault("equation_hash", model.equation_hash())
    out_dir = Path(out_dir) if out_dir is not None else None
    model.to(device)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    with RunDir(out_dir, metadata, dataset, config, params) as run:  # holds out_dir while the run lasts
        optimizer = configure_optimizer(model, config, device)
        scaler = torch.amp.GradScaler(device.type, enabled=config.dtype == "float16")
        enabled = config.dtype != "float32"

        def autocast() -> Any:
            return torch.autocast(device.type, dtype=DTYPES[config.dtype], enabled=enabled)

        generator = torch.Generator().manual_seed(config.seed)
        state = RunState()
        changes: dict[str, tuple[Any, Any]] = {}
        found = run.find_resumable(model) if resume else None
        if found is not None:
            state, changes = _resume(found, run, model, optimizer, scaler, generator, config, names, notify)
        run.start(state.step if found else None)
        if changes:  # metrics.jsonl says from which step on the run trained with other settings
            run.log(kind="resumed", step=state.step, changed={k: list(v) for k, v in changes.items()})

        rng_devices = [device.index] if device.type == "cuda" else []
        precision = torch.get_float32_matmul_precision()
        with torch.random.fork_rng(devices=rng_devices):
            if found is not None:
                rng = found[2]["rng"]  # the resume state's
                torch.set_rng_state(rng["torch"])
                if "cuda" in rng and device.type == "cuda":
                    torch.cuda.set_rng_state(rng["cuda"], device)
            else:  # seed only the generators fork_rng restores: the caller's RNG streams stay untouched
                torch.random.default_generator.manual_seed(config.seed)
                if device.type == "cuda":
                    with torch.cuda.device(device):
                        torch.cuda.manual_seed(config.seed)
            if device.type == "cuda":
                torch.set_float32_matmul_precision("high")  # TF32 matmuls, as nanoGPT
            try:
                with _deferred_interrupt(out_dir is not None) as interrupt:
                    result = _loop(model, dataset, config, device, optimizer, scaler, autocast, generator, state,
                                   run, resumed=found is not None, progress=progress, on_eval=on_eval,
                                   interrupt=interrupt, names=names, notify=notify)
            except torch._dynamo.exc.BackendCompilerFailed as e:  # before RuntimeError: it is one
                raise _compile_error(e, names) from None
            except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
                if not _out_of_memory(e):
                    raise
                raise _memory_error(e, config, device, run, names) from e
            finally:
                torch.set_float32_matmul_precision(precision)
        result.update(params=params, out_dir=str(out_dir) if out_dir is not None else None)
        return result


def divergence_remedy(config: TrainConfig, names: dict[str, str] | None = None) -> str:
    """The setting a diverged run should change, spelled as `names` does: a lower lr, unless AdamW's decoupled
    decay alone overshoots zero (lr x weight decay > 1 scales the weights by 1 - lr wd < 0 each step, and by more
    than 1 in size past 2), which no lower lr short of lr wd <= 1 cures. An lr of 1 or more is the cause itself
    (AdamW's steps are about lr in size whatever the decay: lr 1e6 with no decay diverges too)."""
    def name(field: str) -> str:
        return (names or {}).get(field, field)

    shrink = config.lr * config.weight_decay
    decay = (f"{name('lr')} x {name('weight_decay')} = {shrink:.4g}, so each step's decay alone scales the weights "
             f"by {1 - shrink:.4g}")
    if shrink > 1 and config.lr < 1:
        return f"a lower {name('weight_decay')} ({decay})"
    if shrink > 1:
        return f"a lower {name('lr')} (below 1, and below 1 / {name('weight_decay')}: {decay})"
    return f"a lower {name('lr')}"


def _resume(found: tuple[dict[str, Tensor], dict[str, Any], dict[str, Any]], run: RunDir, model: nn.Module,
            optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, generator: torch.Generator,
            config: TrainConfig, names: dict[str, str] | None, notify: Callable[[str], None] | None
            ) -> tuple[RunState, dict[str, tuple[Any, Any]]]:
    """Load the resumable checkpoint `found` into the model, optimizer, scaler and batch generator; returns the
    run's state and the settings changed since (said through `notify`). A run that diverged with exactly these
    settings is refused: it would diverge again."""
    weights, training, extra = found
    out_dir = run.out_dir
    diverged = run.divergence()
    now = _jsonable(asdict(config))
    if diverged is not None and diverged.get("config") == finite_or_none(now):  # as diverged.json holds it
        raise UserError(
            f"the run in {out_dir} diverged at step {diverged.get('step')} with these same settings "
            f"({diverged.get('reason')}); resuming from its last good checkpoint (step {training.get('step')}) "
            "would diverge again",
            hint=f"rerun with {divergence_remedy(config, names)}, or other changed settings, to resume from that "
                 "checkpoint, "
                 "or pass --fresh (resume=False) to start over")
    changes = changed_settings(training.get("config", {}), now, out_dir, training.get("step"), names)
    changes.update(run.switched)
    model.load_state_dict(weights)
    # the moments resume, the settings are this run's: load_state_dict would bring back the saved weight decay,
    # betas and fused flag (a changed --weight-decay was announced and not applied)
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    try:  # states that load as a file but do not fit this run: damaged, or written by hand
        optimizer.load_state_dict(extra["optimizer"])
        if extra["scaler"]:  # empty when saved by a disabled scaler (before a switch to float16)
            scaler.load_state_dict(extra["scaler"])
        generator.set_state(extra["rng"]["batches"])
        for param, moments in optimizer.state.items():  # AdamW would meet a wrong shape at its first step
            for name, value in moments.items():
                if isinstance(value, Tensor) and value.dim() and value.shape != param.shape:
                    raise ValueError(f"{name} of shape {list(value.shape)} for a parameter of shape "
                                     f"{list(param.shape)}")
    except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as e:
        raise UserError(f"the checkpoint last.* in {out_dir} is damaged: the optimizer, scaler and batch-order "
                        f"states in last.optim.pt do not fit this run ({type(e).__name__}: {str(e)[:160]}), so the "
                        "run cannot resume", hint=START_OVER_HINT) from None
    for group, own in zip(optimizer.param_groups, settings, strict=True):
        group.update(own)
    state = RunState(**{f.name: training[f.name] for f in fields(RunState)})
    run.good = (state.step, state.val_loss)
    if run.best_is_stale(state):  # a run directory written before saves were transactions
        run.save(("best",), model, state, extra)
    if changes and state.step >= config.steps:  # nothing to train: the changes apply to no step
        (notify or _warn)(_nothing_to_train(out_dir, state.step, config.steps, changes, names))
    elif changes:
        (notify or _warn)(f"resuming {out_dir} at step {state.step} with changed settings: "
                          f"{describe_changes(changes, names)}")
    elif notify is not None and state.step < config.steps:  # the same command again: say where it starts
        notify(f"resuming {out_dir} at step {state.step}")
    return state, changes


def _nothing_to_train(out_dir: Path | None, step: int, steps: int, changes: dict[str, tuple[Any, Any]],
                      names: dict[str, str] | None) -> str:
    """The line for a resume whose `steps` the run has already reached: it trains nothing, so announcing "changed
    settings" (`--steps 6 → 4`) would say the run changed when it did not; a larger --steps trains further."""
    flag = (names or {}).get("steps", "steps")
    unused = {k: v for k, v in changes.items() if k != "steps"}
    reached = f"past {flag} {steps}" if step > steps else f"the {flag} {steps} asked for"
    ignored = f" (not applied: {describe_changes(unused, names)})" if unused else ""
    return (f"the run in {out_dir} is already at step {step}, {reached}: nothing to train{ignored}; "
            f"pass a {flag} above {step} to train it further")


def _compile_error(e: BaseException, names: dict[str, str] | None) -> UserError:
    """torch.compile could not build the step (no working C++ compiler for Inductor on the CPU, say); the run
    directory is as the last checkpoint left it."""
    flag = (names or {}).get("compile", "compile")
    inner = e.__cause__ or getattr(e, "inner_exception", None) or e
    first = next((line.strip() for line in str(inner).splitlines() if line.strip()), type(inner).__name__)
    return UserError(f"{flag}: torch.compile failed: {first}",
                     hint=f"train without {flag} (eager, same results), or fix what the message names")


def _out_of_memory(e: BaseException) -> bool:
    """An allocation that failed: CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's error."""
    if isinstance(e, MemoryError | torch.OutOfMemoryError):
        return True
    text = str(e)
    return "can't allocate memory" in text or "out of memory" in text.lower()


def _memory_error(e: BaseException, config: TrainConfig, device: torch.device, run: RunDir,
                  names: dict[str, str] | None) -> UserError:
    """Running out of memory on a batch is the settings', not a bug: say which ones to lower and what was kept."""
    def name(field: str) -> str:
        return (names or {}).get(field, field)

    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = text.split("] err == 0. ", 1)[-1]  # the CPU allocator's `[enforce fail at alloc_cpu.cpp:N]` prefix
    sizes = f"{name('batch_size')} (now {config.batch_size}) or {name('block_size')} (now {config.block_size})"
    if run.last_checkpoint is not None and run.good is not None:
        kept = (f"the last good checkpoint, step {run.good[0]}, is kept: {run.last_checkpoint} (another "
                f"{name('batch_size')} or {name('block_size')} starts a new run: --fresh (resume=False) or another "
                "--out directory)")
    else:
        untouched = run.out_dir is not None and run.pending is not None  # this attempt never began
        kept = "no checkpoint was written" + (f", and {run.out_dir} is as it was" if untouched else "")
    return UserError(f"out of memory while training on {device}: {text[:300]}",
                     hint=f"train with a smaller {sizes}, or a smaller model; {kept}")


# Steps over which every trainable parameter must get a nonzero gradient once. More than one: a LoRA-style
# product with a zero factor gives its partner a zero gradient at the first step only.
IDLE_WATCH_STEPS = 5


def _nonfinite_gradients(model: nn.Module) -> list[str]:
    """The parameters whose gradient holds a NaN or an infinity."""
    named = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
    finite = torch.stack([torch.isfinite(grad).all() for _, grad in named]).tolist() if named else []
    return [name for (name, _), ok in zip(named, finite, strict=True) if not ok]


def _idle_notice(idle: list[str], steps: int, layers: int) -> str:
    """What to say of parameters the loss does not reach."""
    from ..model_checks import idle_reason

    shown = first_few(idle)
    them = "them" if len(idle) > 1 else "it"
    why = idle_reason(idle, layers) or (f"`energy check` on the energy that declares {them} says why, in its "
                                        f"`params` row; declare {them} `fixed`, or remove {them}")
    return (f"{len(idle)} parameter{'s' if len(idle) > 1 else ''} got no gradient in the first {steps} "
            f"step{'s' if steps > 1 else ''} and will not train: {shown}. {why[0].upper()}{why[1:]}")


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)


@dataclass
class _Interrupt:
    requested: bool = False
    signum: int = signal.SIGINT  # which signal asked: TrainingInterrupted carries it (exit 130 or 143)


@contextlib.contextmanager
def _deferred_interrupt(enabled: bool):
    """While active, the first Ctrl-C (or SIGTERM, as a batch scheduler or `timeout` sends) only sets
    `requested` (the loop then saves and stops between steps, so no state is torn mid-update); it also
    restores the previous handler, so a second signal stops at once. Only in the main thread (signals go
    there) and when there is somewhere to save; SIGTERM only where nothing else handles it (a search worker
    has its own handler)."""
    interrupt = _Interrupt()
    with handlers_restored(signal.SIGINT, signal.SIGTERM) as previous:
        if enabled and previous is not None:

            def request(signum: int, frame: Any) -> None:
                interrupt.requested, interrupt.signum = True, signum
                signal.signal(signum, previous[signum])

            signal.signal(signal.SIGINT, request)
            if previous[signal.SIGTERM] is signal.SIG_DFL:
                signal.signal(signal.SIGTERM, request)
        yield interrupt


def _loop(model: nn.Module, dataset: LMDataset, config: TrainConfig, device: torch.device,
          optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, autocast: Callable[[], Any],
          generator: torch.Generator, state: RunState, run: RunDir, *, resumed: bool, progress: bool,
          on_eval: Callable[[int, float], bool] | None, interrupt: _Interrupt,
          names: dict[str, str] | None = None, notify: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The step loop; evaluation (and checkpointing) at every multiple of eval_interval, at the end, and
    when `interrupt` was requested (then it raises TrainingInterrupted). Parameters whose gradient is still
    missing or exactly zero after the first `IDLE_WATCH_STEPS` steps are named through `notify`: they never train."""
    vocab = dataset.vocab_size
    explode_floor = 2.0 * math.log(max(vocab, 2))
    pending: list[tuple[int, Tensor]] = []  # losses not yet checked: checking syncs the GPU
    shown = {"loss": math.nan}  # what the progress bar displays
    start_step, step = state.step, state.step
    train_time, started, stopped_early = 0.0, time.perf_counter(), False
    show = progress and sys.stderr.isatty()
    bar = tqdm(total=config.steps, initial=min(step, config.steps), disable=not show, unit="step",
               dynamic_ncols=True, leave=False)

    def why_diverged(value: float, what: str) -> str | None:
        """Why `value` counts as diverged (see the module docstring), or None if it does not."""
        if not math.isfinite(value):
            return f"the {what} was {value}"
        if state.initial_loss is None:
            return None
        relative = config.diverge_factor * state.initial_loss
        if value > max(relative, explode_floor):
            limit = (f"{relative:.4g} = {config.diverge_factor:g} x the initial loss {state.initial_loss:.4g}"
                     if relative >= explode_floor else f"{explode_floor:.4g} = 2 ln V")
            return f"the {what} was {value:.4g}, above {limit}"
        return None

    def diverge(at: int, value: float, reason: str) -> None:
        """Record the divergence and raise; `last` and `best` keep the last good states. At step 0 no optimizer
        step has run: the untrained model's own loss or gradient is not finite, which no lr cures."""
        good = run.good if run.last_checkpoint is not None else None
        checkpoint_step = good[0] if good else None
        run.log(kind="diverged", step=at, loss=value, reason=reason, checkpoint_step=checkpoint_step)
        run.mark_diverged({"step": at, "loss": value, "reason": reason, "checkpoint": run.last_checkpoint,
                           "checkpoint_step": checkpoint_step, "config": _jsonable(asdict(config))})
        run.plot(force=True)
        bar.close()
        remedy = (divergence_remedy(config, names) if at > 0 else "a spec whose untrained model gives a finite "
                  "loss and gradient: no optimizer setting changes them (`energy check` runs each energy and the "
                  "model on random instances)")
        raise TrainingDiverged(at, value, run.last_checkpoint, reason, checkpoint_step, good[1] if good else None,
                               remedy)

    def check_pending() -> None:
        values = torch.stack([loss for _, loss in pending]).tolist() if pending else []
        for (at, _), value in zip(pending, values, strict=True):
            if state.initial_loss is None and math.isfinite(value):  # a checkpoint from before it was kept
                state.initial_loss = value
            reason = why_diverged(value, f"training loss at step {at}")
            if reason is not None:
                diverge(at, value, reason)
        if values:
            run.log(kind="train", step=step, loss=sum(values) / len(values), lr=lr_at(step - 1, config))
            shown["loss"] = values[-1]
            bar.set_postfix(loss=f"{values[-1]:.4f}", val=f"{state.val_loss:.4f}", refresh=False)
        pending.clear()

    # the compiled module shares the model's parameters; checkpoints are the model's own state dict
    forward = torch.compile(model) if config.compile else model
    first = True
    # has each trainable parameter had a nonzero gradient yet? (flags on the device: no sync per step)
    idle_watch: dict[str, Tensor] | None = {name: torch.zeros((), dtype=torch.bool, device=p.device)
                                            for name, p in model.named_parameters() if p.requires_grad}
    while True:
        scheduled = step % config.eval_interval == 0 or step >= config.steps
        due = scheduled or interrupt.requested
        if due and not (first and resumed):  # a resumed run was evaluated just before it was saved
            check_pending()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            train_time += time.perf_counter() - started
            losses = estimate_loss(forward, dataset, config, device, autocast)
            if state.initial_loss is None and math.isfinite(losses["train"]):
                state.initial_loss = losses["train"]  # step 0: the untrained model's loss
            for split in ("val", "train"):  # before anything is saved: `last` never holds a diverged state
                reason = why_diverged(losses[split], f"{split} loss evaluated at step {step}")
                if reason is not None:
                    diverge(step, losses[split], reason)
            state.step, state.train_loss, state.val_loss = step, losses["train"], losses["val"]
            # an evaluation only an interrupt asked for is shown and saved as `last`, but cannot become `best`:
            # the resumed run then keeps the best the uninterrupted one would
            improved = scheduled and losses["val"] < state.best_val_loss
            if improved:
                state.best_val_loss, state.best_step = losses["val"], step
            run.log(kind="eval", step=step, train_loss=losses["train"], val_loss=losses["val"],
                    best_val_loss=state.best_val_loss, lr=lr_at(step, config))
            resume_state = {"step": step, "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                            "rng": _rng_states(generator, device)}
            run.save(("last", "best") if improved else ("last",), model, state, resume_state)
            run.plot(force=interrupt.requested)  # the run stops here: the plot shows it to its last step
            bar.set_postfix(loss=f"{shown['loss']:.4f}", val=f"{losses['val']:.4f}", refresh=False)
            if progress and not show:  # no terminal (a log file, a batch job): one line per evaluation instead
                print(f"step {step}/{config.steps}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
                      + (" (best)" if improved else ""), file=sys.stderr, flush=True)
            if on_eval is not None and on_eval(step, losses["val"]) and step < config.steps:
                stopped_early = True
            started = time.perf_counter()
        if interrupt.requested and step < config.steps and not stopped_early:  # saved just above (or resumed)
            run.log(kind="interrupted", step=step)
            bar.close()
            raise TrainingInterrupted(step, run.last_checkpoint, interrupt.signum)
        first = False
        if step >= config.steps or stopped_early:
            break
        lr = lr_at(step, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = dataset.get_batch("train", config.batch_size, config.block_size, generator)
        if device.type == "cuda":  # pinned host memory lets the copy overlap with compute (nanoGPT)
            x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        with autocast():
            loss = _loss(forward, x, y, vocab)
        pending.append((step, loss.detach()))
        scaler.scale(loss).backward()
        if step == 0 and not scaler.is_enabled():  # (float16's scaler skips a step whose gradient overflowed)
            broken = _nonfinite_gradients(model)  # the first step only: one sync
            if broken:
                value = float(loss.detach())
                diverge(0, value, why_diverged(value, "training loss at step 0")
                        or f"the gradient at step 0 is not finite in {first_few(broken)}")
        if idle_watch is not None:
            for name, p in model.named_parameters():
                if p.grad is not None and name in idle_watch:
                    torch.logical_or(idle_watch[name], p.grad.ne(0).any(), out=idle_watch[name])
            if step + 1 - start_step >= IDLE_WATCH_STEPS or step + 1 >= config.steps:
                moved = torch.stack(list(idle_watch.values())).tolist() if idle_watch else []  # one sync for all
                idle = [name for name, got in zip(idle_watch, moved, strict=True) if not got]
                if idle:
                    with tqdm.external_write_mode():  # the line above the progress bar, not through it
                        layers = getattr(getattr(model, "plan", None), "layers", 0)
                        (notify or _warn)(_idle_notice(idle, step + 1 - start_step, layers))
                idle_watch = None
        if config.grad_clip > 0:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        run.begin()  # this attempt has begun: from here on it writes into the run directory
        bar.update(1)
        if step % config.log_interval == 0:
            check_pending()
    bar.close()
    run.plot(force=True)
    trained = step - start_step
    return {
        "train_loss": state.train_loss,
        "val_loss": state.val_loss,
        "best_val_loss": state.best_val_loss,
        "best_step": state.best_step,
        "steps": step,
        "resumed_from": start_step if resumed else None,
        "stopped_early": stopped_early,
        "tokens_per_s": trained * config.batch_size * config.block_size / train_time if trained else 0.0,
        "train_time_s": train_time,
    }

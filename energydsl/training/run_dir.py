"""A training run's directory: checkpoints (`last`, `best`), metrics.jsonl, loss.png, the divergence record,
and the checks that decide whether an existing `last` may be resumed (same metadata, data and shapes).

Used by `energydsl.training.trainer.train`; every method is a no-op without an out_dir.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch
from torch import Tensor, nn

from energydsl.errors import UserError, first_few
from energydsl.files import writable_dir
from energydsl.syntax import same_source

from .checkpoint import checkpoint_file, finish_commit, read_checkpoint, read_resume_state, save_checkpoints
from .data import LMDataset

if TYPE_CHECKING:
    from .config import TrainConfig

FORMAT = 1  # of the `training` record in a checkpoint's sidecar

# the checkpoint files a run leaves besides last.json (whose absence alone is not a fresh directory)
_RUN_FILES = ("last.safetensors", "last.optim.pt", "best.json", "best.safetensors")
START_OVER_HINT = ("pass --fresh (resume=False) to start over (that overwrites best.* too: copy it first if you "
                   "need it), or choose another --out directory")


def finite_or_none(value: Any) -> Any:
    """NaN and infinities as None (JSON null), in nested dicts and lists too: strict JSON parsers reject
    `NaN` and `Infinity`."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(v) for v in value]
    return value


def _show(value: Any, width: int = 40) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= width else text[: width - 1] + "…"


def _differences(saved: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    """What differs between a checkpoint's metadata and this run's, one short phrase each."""
    missing = object()
    diffs = []
    for key in sorted(set(saved) | set(now), key=str):
        a, b = saved.get(key, missing), now.get(key, missing)
        if a == b:
            continue
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            diffs.extend(_differences(a, b, f"{name}."))
        elif a is missing or b is missing:
            diffs.append(f"{name} is {'not set' if a is missing else _show(a)} there, "
                         f"{'not set' if b is missing else _show(b)} now")
        elif isinstance(a, str) and isinstance(b, str) and "\n" in a + b:  # a spec's text: its first edited line
            diffs.append(f"{name} differs {_first_edit(a, b)}")
        elif isinstance(a, str) and isinstance(b, str) and (len(a) > 40 or len(b) > 40):
            diffs.append(f"{name} differs")
        else:
            diffs.append(f"{name} is {_show(a)} there, {_show(b)} now")
    return diffs


def _first_edit(a: str, b: str) -> str:
    """Where two spec texts first differ: `from line 12: "d = 8" there, "d = 16" now` (line numbers of the text
    now). Comments, blank lines and spacing are no edit (a spec edited only there is the same spec): an added
    comment line was named as the edit, above the one that was."""
    from ..syntax import _lines, tokens, without_comments

    def code_lines(text: str) -> list[tuple[int, str, str]]:  # (line number, as written, its tokens)
        text = _lines(text)  # lines as the parser counts them: at \n (a lone \r is one), not at \f or \u2028
        raw = text.split("\n")
        return [(i + 1, raw[i].strip(), tokens(line))
                for i, line in enumerate(without_comments(text).split("\n")) if line.strip()]

    old, new = code_lines(a), code_lines(b)
    n = next((i for i, (x, y) in enumerate(zip(old, new)) if x[2] != y[2]), min(len(old), len(new)))
    shown = [_show(lines[n][1], 60) if n < len(lines) else "(the end)" for lines in (old, new)]
    line = new[n][0] if n < len(new) else len(b.splitlines()) + 1
    return f"from line {line}: {shown[0]} there, {shown[1]} now"


def _shape_differences(saved: dict[str, Tensor], now: dict[str, Tensor]) -> list[str]:
    """Parameters (and buffers) the checkpoint and the model do not share, or hold at other shapes."""
    diffs = [f"{name} is {list(saved[name].shape)} there, {list(now[name].shape)} now"
             for name in now if name in saved and saved[name].shape != now[name].shape]
    extra, missing = sorted(set(saved) - set(now)), sorted(set(now) - set(saved))
    if extra:
        diffs.append(f"{len(extra)} tensors there are not in the model ({', '.join(extra[:3])}"
                     f"{', ...' if len(extra) > 3 else ''})")
    if missing:
        diffs.append(f"{len(missing)} of the model's tensors are not there ({', '.join(missing[:3])}"
                     f"{', ...' if len(missing) > 3 else ''})")
    return diffs


# Settings a resumed run must keep. The seed: a resumed run continues the saved random state, so another seed
# would be ignored. The batch size, block size and eval iters set the evaluation batches: with other values,
# validation losses before and after the resume would measure different things, yet choose `best` together.
_EVALUATION = "the evaluation batches would change, and best.* would be chosen by losses that do not compare"
KEPT_ON_RESUME = {
    "seed": "a resumed run continues its saved random state, so a new seed would be ignored",
    "batch_size": _EVALUATION, "block_size": _EVALUATION, "eval_iters": _EVALUATION,
}


# Metadata a resumed run may change, announced with its changed settings rather than refused: the code backend
# computes the same update with the same parameters (state dicts move between backends); the spec's path, when
# the spec moved or was copied, since its text (spec_source) and its derived equations (equation_hash, imports
# included) are still compared.
SWITCHABLE_ON_RESUME = ("backend", "spec_path")


def _value(value: Any) -> str:
    """A setting as its flag is written: 0.001, or 0.9,0.95 for a pair (--betas)."""
    if isinstance(value, list | tuple) and value and all(isinstance(v, float) for v in value):
        return ",".join(f"{v:g}" for v in value)
    return f"{value:g}" if isinstance(value, float) else _show(value, 400)  # a moved spec's path, whole


def changed_settings(saved: dict[str, Any], now: dict[str, Any], where: Path, step: Any,
                     names: dict[str, str] | None = None) -> dict[str, tuple[Any, Any]]:
    """The settings a resumed run changes, field -> (old, new), compared as JSON values (`saved` is a checkpoint's
    `training.config`). Raises `UserError` for the settings in `KEPT_ON_RESUME`, naming each as `names` spells it."""
    changes = {k: (saved[k], now[k]) for k in now if k in saved and saved[k] != now[k]}
    kept = [k for k in changes if k in KEPT_ON_RESUME]
    if kept:
        name = (names or {}).get
        asked = ", ".join(f"{name(k, k)} {_value(changes[k][1])}" for k in kept)
        old = ", ".join(f"{name(k, k)} {_value(changes[k][0])}" for k in kept)
        by_reason: dict[str, list[str]] = {}
        for k in kept:
            by_reason.setdefault(KEPT_ON_RESUME[k], []).append(name(k, k))
        reasons = "; ".join(f"{' and '.join(flags)}: {why}" for why, flags in by_reason.items())
        raise UserError(f"cannot resume the run in {where} (step {step}) with {asked}: it was trained with {old} "
                        f"({reasons})",
                        hint=f"pass {old} to resume it, or --fresh (resume=False) to start over (that overwrites "
                             "best.* too), or choose another --out directory")
    return changes


def describe_changes(changes: dict[str, tuple[Any, Any]], names: dict[str, str] | None = None) -> str:
    """`--lr 0.001 → 0.0005, ...`: the one-line summary printed when a run resumes with changed settings."""
    return ", ".join(f"{(names or {}).get(k, k)} {_value(a)} → {_value(b)}" for k, (a, b) in changes.items())


def _plot(metrics_path: Path, png_path: Path) -> None:
    """Draw the loss curves from metrics.jsonl (Agg canvas: no display, no global pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [(r["step"], r["loss"]) for r in rows if r.get("kind") == "train" and r.get("loss") is not None]
    evals = [r for r in rows if r.get("kind") == "eval" and None not in (r.get("train_loss"), r.get("val_loss"))]
    fig = Figure(figsize=(7, 4.2), dpi=110)
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.12, top=0.97)  # tight_layout's margins, without its 30 ms
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train, strict=True), lw=0.8, alpha=0.6, label="train (running)")
    if evals:
        steps = [r["step"] for r in evals]
        ax.plot(steps, [r["train_loss"] for r in evals], "o-", ms=3, label="train (eval)")
        ax.plot(steps, [r["val_loss"] for r in evals], "o-", ms=3, label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    if train or evals:
        ax.legend()
    tmp = png_path.with_name(f".{png_path.name}.tmp.png")
    try:
        fig.savefig(tmp)
        tmp.replace(png_path)
    finally:  # a loss.png that cannot be replaced (a folder there) left the drawing beside it
        tmp.unlink(missing_ok=True)


@dataclass
class RunState:
    """What a checkpoint must carry beyond weights for a resumed run to continue exactly."""

    step: int = 0
    train_loss: float = math.nan  # from the last evaluation, like val_loss (not the running loss)
    val_loss: float = math.nan
    best_val_loss: float = math.inf
    best_step: int | None = None
    initial_loss: float | None = None

    def record(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _claim(out_dir: Path) -> TextIO:
    """Hold `out_dir` for this process (an exclusive lock on `.train.lock`, released when the file is closed or
    the process ends): two runs writing one directory interleave their metrics and delete each other's staged
    checkpoint files. A directory in use is refused at once, naming the process that holds it."""
    lock = out_dir / ".train.lock"
    try:
        f = open(lock, "a+")  # noqa: SIM115 (closed by RunDir.close, or with the process)
    except OSError as e:
        raise UserError(f"cannot write {lock}: {e.strerror or e}", hint="choose another --out directory") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip()
        f.close()
        raise UserError(f"{out_dir} is in use by another training{f' (pid {holder})' if holder else ''}",
                        hint="wait for it to finish, or give this run another --out directory") from None
    except OSError:  # a file system without locks (some network mounts): train unguarded, as before
        return f
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _record_damage(training: dict[str, Any], now: TrainConfig) -> str | None:
    """What is wrong with a checkpoint's training record (`RunState` and the config, as a save writes them),
    or None: damaged bytes are named here, not met as a KeyError where a value is used."""
    for f in fields(RunState):
        if f.name not in training:
            return f"last.json's training record lacks {f.name}"
        value = training[f.name]
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0 if f.name == "step" else (
            value is None or _number(value))
        if not ok:
            return f"last.json's training record has {f.name} = {_show(value)}"
    config = training.get("config", {})
    if not isinstance(config, dict):
        return f"last.json's training config is {_show(config)}, not an object"
    for f in fields(now):  # a value of another kind than this run's would be announced as a change and applied
        if f.name in config and config[f.name] is not None and not _same_kind(config[f.name], getattr(now, f.name)):
            return f"last.json's training config has {f.name} = {_show(config[f.name])}"
    return None


def _same_kind(value: Any, now: Any) -> bool:
    if isinstance(now, bool | str):
        return isinstance(value, type(now))
    if isinstance(now, tuple | list):
        return isinstance(value, list) and all(_number(v) for v in value)
    return _number(value)


def _resume_state_damage(extra: Any) -> str | None:
    """What is wrong with a checkpoint's `last.optim.pt` (optimizer, scaler and RNG states), or None."""
    if not isinstance(extra, dict):
        return f"last.optim.pt holds a {type(extra).__name__}, not the optimizer, scaler and RNG states"
    for key in ("optimizer", "scaler", "rng"):
        if not isinstance(extra.get(key), dict):
            return f"last.optim.pt's {key} state is {'missing' if key not in extra else type(extra[key]).__name__}"
    if not isinstance(extra["rng"].get("batches"), Tensor):
        return "last.optim.pt lacks the batch generator's state"
    return None


class RunDir:
    """One training run's files: checkpoints, metrics and the plot (all no-ops without an out_dir)."""

    def __init__(self, out_dir: Path | None, metadata: dict[str, Any], dataset: LMDataset,
                 config: TrainConfig, params: int):
        self.out_dir = out_dir
        self.metadata = metadata
        self.dataset_info = dataset.describe()
        self.config = config
        self.params = params
        self.last_plot = 0.0
        self.switched: dict[str, tuple[Any, Any]] = {}  # SWITCHABLE_ON_RESUME metadata a resume changed
        self.good: tuple[int, float] | None = None  # (step, val loss) of `last` as this run wrote or resumed it
        self.pending: list[str] | None = None  # metrics rows of an attempt that has not begun yet (`start`)
        self._lock: TextIO | None = None
        if out_dir is not None:
            writable_dir(out_dir, "out_dir")  # from Python: a file there was pathlib's FileExistsError
            self.metrics = out_dir / "metrics.jsonl"
            self.diverged = out_dir / "diverged.json"
            for path, what in ((self.metrics, "its metrics"), (self.diverged, "a divergence's record")):
                if path.exists() and not path.is_file():  # before a resume announces anything
                    raise UserError(f"{path} is not a file: the run writes {what} there",
                                    hint="move it out of the way, or choose another --out directory")
            self._lock = _claim(out_dir)
            finish_commit(out_dir)  # a save killed after its commit: its metrics and records as it left them

    def close(self) -> None:
        """Release the directory for the next run (the lock also goes with the process)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def last_checkpoint(self) -> str | None:
        """`last.safetensors` if this run wrote or resumed it (never a stale one from another run)."""
        if self.out_dir is None or self.good is None or checkpoint_file(self.out_dir / "last.safetensors") is None:
            return None
        return str(self.out_dir / "last.safetensors")

    def divergence(self) -> dict[str, Any] | None:
        """The record of an earlier attempt's divergence in this directory, if any."""
        if self.out_dir is None or not self.diverged.exists():
            return None
        try:
            record = json.loads(self.diverged.read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def mark_diverged(self, record: dict[str, Any]) -> None:
        if self.out_dir is not None and self.pending is None:  # an attempt that never began changed nothing
            text = json.dumps(finite_or_none(record), indent=1, allow_nan=False)
            tmp = self.diverged.with_name(f".{self.diverged.name}.tmp")
            tmp.write_text(text)
            tmp.replace(self.diverged)

    def find_resumable(self, model: nn.Module) -> tuple[dict[str, Tensor], dict[str, Any], dict[str, Any]] | None:
        """The last checkpoint if it is complete and was made for the same metadata, data and `model`
        (parameter names and shapes), else None.

        A checkpoint of another model or dataset, or one that cannot be resumed (damaged, or its three files
        from different steps: saves are transactions, so not after a kill), raises `UserError`: starting afresh
        would overwrite the run's `best.*`, so that takes `resume=False`.
        """
        if self.out_dir is None:
            return None
        if checkpoint_file(self.out_dir / "last.json") is None:
            # no sidecar: nothing to resume, but a fresh start would overwrite what the run left
            left = [name for name in _RUN_FILES if checkpoint_file(self.out_dir / name) is not None]
            if left:
                raise UserError(f"{self.out_dir} holds a run ({', '.join(left)}) without its last.json, so it cannot "
                                "resume", hint=START_OVER_HINT)
            return None
        try:
            state, sidecar, header = read_checkpoint(self.out_dir / "last.safetensors")
            extra = read_resume_state(self.out_dir / "last.optim.pt")
        except Exception as e:  # noqa: BLE001 - whatever is wrong with the files, the answer is the same
            # a UserError's str() is its rendering, `error: ...` and a hint: this message wraps its text alone
            text = e.message if isinstance(e, UserError) else str(e)
            first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
            raise UserError(f"the checkpoint last.* in {self.out_dir} cannot be read, so the run cannot resume: "
                            f"{first[:200]}", hint=START_OVER_HINT) from None
        training = sidecar.pop("training", None)
        if not isinstance(training, dict) or "step" not in training or not isinstance(training.get("dataset"), dict):
            raise UserError(f"the checkpoint's last.json in {self.out_dir} is damaged: it lacks the training record "
                            "that `energy train` writes, so the run cannot resume", hint=START_OVER_HINT)
        damage = _record_damage(training, self.config) or _resume_state_damage(extra)
        if damage:
            raise UserError(f"the checkpoint last.* in {self.out_dir} is damaged: {damage}, so the run cannot resume",
                            hint=START_OVER_HINT)
        data = training["dataset"]
        diffs = []
        # the same file spelled another way (`chars:./a.txt`, an absolute path, from another folder) is the same
        # data: its vocabulary and its splits' tokens tell, where the checkpoint records them
        same_tokens = "digest" in data and all(data.get(k) == self.dataset_info[k] for k in ("vocab_size", "codec",
                                                                                            "digest"))
        if data.get("name") != self.dataset_info["name"] and not same_tokens:
            diffs.append(f"the dataset is {_show(data.get('name'))} there, {_show(self.dataset_info['name'])} now")
        elif any(data.get(k) != self.dataset_info[k] for k in ("vocab_size", "codec")):
            diffs.append(f"the dataset {_show(data.get('name'))} has another vocabulary there")
        elif "digest" in data and data["digest"] != self.dataset_info["digest"]:  # absent from older checkpoints
            diffs.append(f"the dataset {_show(data.get('name'))} has other contents there (its splits' tokens "
                         "hash differently: another file under that name, or the file was edited)")
        saved_source, source = sidecar.get("spec_source"), self.metadata.get("spec_source")
        if isinstance(saved_source, str) and isinstance(source, str) and same_source(saved_source, source):
            sidecar["spec_source"] = source  # a comment or spacing edited: the same spec, the same run
        for key in SWITCHABLE_ON_RESUME:  # absent from older checkpoints: unknown, so nothing to announce
            old, new = sidecar.pop(key, None), self.metadata.get(key)
            if old is not None and new is not None and old != new:
                self.switched[key] = (old, new)
            if key in self.metadata:
                sidecar[key] = self.metadata[key]
        spec_diffs = _differences(sidecar, self.metadata)
        if sidecar.get("spec_source") == self.metadata.get("spec_source") and sidecar.get("dims") == \
                self.metadata.get("dims"):  # the text and the dims alike, the equations not
            spec_diffs = [d + " (the spec's text is the same: a file it imports was edited, or this energydsl "
                          "derives it otherwise)" if d.startswith("equation_hash ") else d for d in spec_diffs]
        diffs += spec_diffs
        diffs += _shape_differences(state, model.state_dict())
        if diffs:  # most likely a typo in a flag: never overwrite a run unasked
            shown = first_few(diffs, sep="; ")
            raise UserError(f"{self.out_dir} holds a checkpoint (step {training.get('step')}) of a different "
                            f"model or dataset: {shown}",
                            hint="pass --fresh (resume=False) to overwrite that run, or choose another --out "
                                 "directory")
        steps = {"last.safetensors": header.get("step"), "last.optim.pt": extra.get("step"),
                 "last.json": training.get("step")}
        if not steps["last.safetensors"]:  # weights saved without a step in their header: nothing to compare
            del steps["last.safetensors"]
        if len({str(v) for v in steps.values()}) > 1:  # not after a kill (saves are atomic): damaged or mixed up
            shown = ", ".join(f"{name} {step}" for name, step in steps.items())
            raise UserError(f"the checkpoint files last.* in {self.out_dir} are from different steps ({shown}), "
                            "so the run cannot resume", hint=START_OVER_HINT)
        return state, training, extra

    def start(self, resumed_step: int | None) -> None:
        """Fresh run: empty the metrics. Resumed: drop metrics written after the checkpoint.

        Nothing is written yet: the new metrics (and the rows logged meanwhile) replace the file, and the previous
        attempt's divergence record goes, only when this attempt `begin`s (its first checkpoint or training step).
        An attempt that fails before (a model that cannot run, out of memory, Ctrl-C, NaN at step 0) leaves the
        previous run's files as they were, `--fresh` or not."""
        if self.out_dir is None:
            return
        keep: list[str] = []
        if resumed_step is not None and self.metrics.exists():
            # a row the disk damaged (bytes that are not UTF-8 or JSON, a step that is no number) is dropped, as a
            # torn last row is
            for line in self.metrics.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError, AttributeError):
                    row = json.loads(line)
                    step = row.get("step", 0)
                    if _number(step) and step <= resumed_step and row.get("kind") != "diverged":
                        keep.append(line + "\n")
        self.pending = keep

    def begin(self) -> None:
        """The attempt has begun (saved a checkpoint, or took a training step): write what `start` prepared."""
        if self.out_dir is None or self.pending is None:
            return
        tmp = self.metrics.with_name(f".{self.metrics.name}.tmp")
        tmp.write_text("".join(self.pending))
        tmp.replace(self.metrics)
        self.pending = None
        self.diverged.unlink(missing_ok=True)  # this attempt starts from a good state

    def log(self, **row: Any) -> None:
        if self.out_dir is not None:
            line = json.dumps(finite_or_none(row), allow_nan=False) + "\n"
            if self.pending is not None:
                self.pending.append(line)
                return
            with self.metrics.open("a") as f:
                f.write(line)

    def save(self, stems: tuple[str, ...], model: nn.Module, state: RunState, resume_state: dict[str, Any]) -> None:
        """Save the model under each of `stems` (`last`, and `best` when it improved) in one transaction: a kill
        at any point leaves all of them old or all new, so `best` never lags behind the `last` it matches."""
        if self.out_dir is None:
            return
        saved_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")

        def sidecar(stem: str) -> dict[str, Any]:
            training = {
                "format": FORMAT, **state.record(), "params": self.params, "config": asdict(self.config),
                "dataset": self.dataset_info, "weights": f"{stem}.safetensors",
                "resume_state": f"{stem}.optim.pt", "torch": torch.__version__, "saved_at": saved_at,
            }
            return {**self.metadata, "training": training}

        begins = "last" in stems and self.pending is not None
        # the attempt's first `last` begins it in the same transaction: its metrics replace the previous run's
        # and the divergence record goes with the commit (after it, a kill mixed the old run's rows into these)
        texts = {self.metrics.name: "".join(self.pending or [])} if begins else None
        save_checkpoints(self.out_dir, model, {stem: sidecar(stem) for stem in stems}, resume_state, texts,
                         [self.diverged.name] if begins else [])
        if "last" in stems:
            self.good = (state.step, state.val_loss)
            if begins:
                self.pending = None

    def best_is_stale(self, state: RunState) -> bool:
        """Whether `best.*` lags behind a resumed `last` that the run state names the best: left so by a kill
        between the two saves, which only the separate saves before checkpoint transactions allowed."""
        if self.out_dir is None or state.best_step != state.step:
            return False
        sidecar = checkpoint_file(self.out_dir / "best.json")
        if sidecar is None or checkpoint_file(self.out_dir / "best.safetensors") is None:
            return True
        try:
            return json.loads(sidecar.read_text())["training"]["step"] != state.step
        except (OSError, ValueError, KeyError, TypeError):  # unreadable: rewrite it
            return True

    def plot(self, force: bool = False) -> None:
        if self.out_dir is None or self.pending is not None or not (force or time.monotonic() - self.last_plot > 30):
            return
        self.last_plot = time.monotonic()
        try:
            _plot(self.metrics, self.out_dir / "loss.png")
        except Exception as e:  # a plotting problem must never cost a training run
            warnings.warn(f"could not draw {self.out_dir / 'loss.png'}: {e}", stacklevel=2)


def resume_hint(fresh: bool) -> str:
    """How to resume from `last`: the same command, less --fresh (which would start over again)."""
    return "rerun without --fresh to resume" if fresh else "rerun the same command to resume"


def committed_training(run_dir: Path, stem: str) -> dict[str, Any] | None:
    """The `training` record of checkpoint `stem`'s committed sidecar, as resuming reads it (a save cut short
    reads as the previous one); None where there is none or it is damaged."""
    try:
        sidecar = checkpoint_file(run_dir / f"{stem}.json")
        record = None if sidecar is None else json.loads(sidecar.read_text())["training"]
    except Exception:  # noqa: BLE001 - a damaged run directory: nothing certain to say
        return None
    return record if isinstance(record, dict) else None


def interrupted_at_once_note(run_dir: Path | None, fresh: bool, started: bool = True) -> str:
    """The note for a Ctrl-C that stopped `energy train` at once (before the training loop, or a second Ctrl-C):
    nothing is saved then, so it says which checkpoint the run directory keeps. `started` False: stopped while
    the model was built, before the run directory was touched (`run_dir` the --out given, or None)."""
    last = None if run_dir is None else committed_training(run_dir, "last")
    step = None if last is None else last.get("step")
    if not started or run_dir is None:
        note = "interrupted before training started: nothing was written"
        kept = f"; {run_dir} keeps its last checkpoint, step {step}: {resume_hint(fresh)} from it"
        return note if step is None else note + kept
    if step is None:
        return f"interrupted at once, before a checkpoint was written: nothing was saved in {run_dir}"
    return (f"interrupted at once, without saving: kept the last checkpoint, step {step}: "
            f"{run_dir / 'last.safetensors'}; {resume_hint(fresh)} from it")

"""A training run's directory: checkpoints (`last`, `best`), metrics.jsonl, loss.png, the divergence record,
and the checks that decide whether an existing `last` may be resumed (same metadata, data and shapes).

Used by `energydsl.training.trainer.train`; every method is a no-op without an out_dir.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from energydsl.errors import UserError

from .data import LMDataset
from .sampling import load_checkpoint, save_checkpoint

if TYPE_CHECKING:
    from .trainer import TrainConfig

FORMAT = 1  # of the `training` record in a checkpoint's sidecar

_START_OVER = ("pass --fresh (resume=False) to start over (that overwrites best.* too: copy it first if you need "
               "it), or choose another --out directory")


def _finite_or_none(value: Any) -> Any:
    """NaN and infinities as None (JSON null): strict JSON parsers reject `NaN` and `Infinity`."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


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
        elif isinstance(a, str) and isinstance(b, str) and (len(a) > 40 or len(b) > 40 or "\n" in a + b):
            diffs.append(f"{name} differs")
        else:
            diffs.append(f"{name} is {_show(a)} there, {_show(b)} now")
    return diffs


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


def _plot(metrics_path: Path, png_path: Path) -> None:
    """Draw the loss curves from metrics.jsonl (Agg canvas: no display, no global pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [(r["step"], r["loss"]) for r in rows if r.get("kind") == "train" and r.get("loss") is not None]
    evals = [r for r in rows if r.get("kind") == "eval" and None not in (r.get("train_loss"), r.get("val_loss"))]
    fig = Figure(figsize=(7, 4.2), dpi=110)
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
    fig.tight_layout()
    tmp = png_path.with_name(f".{png_path.name}.tmp.png")
    fig.savefig(tmp)
    tmp.replace(png_path)


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
        self.good: tuple[int, float] | None = None  # (step, val loss) of `last` as this run wrote or resumed it
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            self.metrics = out_dir / "metrics.jsonl"
            self.diverged = out_dir / "diverged.json"

    @property
    def last_checkpoint(self) -> str | None:
        """`last.safetensors` if this run wrote or resumed it (never a stale one from another run)."""
        if self.out_dir is None or self.good is None or not (self.out_dir / "last.safetensors").exists():
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
        if self.out_dir is not None:
            text = json.dumps({k: _finite_or_none(v) for k, v in record.items()}, indent=1, allow_nan=False)
            tmp = self.diverged.with_name(f".{self.diverged.name}.tmp")
            tmp.write_text(text)
            tmp.replace(self.diverged)

    def find_resumable(self, model: nn.Module) -> tuple[dict[str, Tensor], dict[str, Any], dict[str, Any]] | None:
        """The last checkpoint if it is complete and was made for the same metadata, data and `model`
        (parameter names and shapes), else None.

        A checkpoint of another model or dataset, or one that cannot be resumed (damaged, or its files from
        different steps after a kill between two writes), raises `UserError`: starting afresh would overwrite
        the run's `best.*`, so that takes `resume=False`.
        """
        if self.out_dir is None or not (self.out_dir / "last.json").exists():
            return None
        try:
            state, sidecar = load_checkpoint(self.out_dir / "last.safetensors")
            extra = torch.load(self.out_dir / "last.optim.pt", map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - whatever is wrong with the files, the answer is the same
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"the checkpoint last.* in {self.out_dir} cannot be read, so the run cannot resume: "
                            f"{first[:200]}", hint=_START_OVER) from None
        training = sidecar.pop("training", {})
        data = training.get("dataset", {})
        diffs = []
        if data.get("name") != self.dataset_info["name"]:
            diffs.append(f"the dataset is {_show(data.get('name'))} there, {_show(self.dataset_info['name'])} now")
        elif any(data.get(k) != self.dataset_info[k] for k in ("vocab_size", "codec")):
            diffs.append(f"the dataset {_show(data.get('name'))} has another vocabulary there")
        diffs += _differences(sidecar, self.metadata)
        diffs += _shape_differences(state, model.state_dict())
        if diffs:  # most likely a typo in a flag: never overwrite a run unasked
            shown = "; ".join(diffs[:4]) + (f"; and {len(diffs) - 4} more" if len(diffs) > 4 else "")
            raise UserError(f"{self.out_dir} holds a checkpoint (step {training.get('step')}) of a different "
                            f"model or dataset: {shown}",
                            hint="pass --fresh (resume=False) to overwrite that run, or choose another --out "
                                 "directory")
        if extra.get("step") != training.get("step"):
            raise UserError(f"the checkpoint files last.* in {self.out_dir} are from different steps "
                            f"({extra.get('step')} and {training.get('step')}: killed while saving?), so the run "
                            "cannot resume", hint=_START_OVER)
        return state, training, extra

    def start(self, resumed_step: int | None) -> None:
        """Fresh run: empty the metrics. Resumed: drop metrics written after the checkpoint."""
        if self.out_dir is None:
            return
        keep: list[str] = []
        if resumed_step is not None and self.metrics.exists():
            for line in self.metrics.read_text().splitlines():
                with contextlib.suppress(ValueError, AttributeError):
                    row = json.loads(line)
                    if row.get("step", 0) <= resumed_step and row.get("kind") != "diverged":
                        keep.append(line + "\n")
        self.metrics.write_text("".join(keep))
        self.diverged.unlink(missing_ok=True)  # this attempt starts from a good state

    def log(self, **row: Any) -> None:
        if self.out_dir is not None:
            row = {k: _finite_or_none(v) for k, v in row.items()}
            with self.metrics.open("a") as f:
                f.write(json.dumps(row, allow_nan=False) + "\n")

    def save(self, stem: str, model: nn.Module, state: RunState, resume_state: dict[str, Any]) -> None:
        if self.out_dir is None:
            return
        training = {
            "format": FORMAT, **state.record(), "params": self.params, "config": asdict(self.config),
            "dataset": self.dataset_info, "weights": f"{stem}.safetensors",
            "resume_state": f"{stem}.optim.pt", "torch": torch.__version__,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        save_checkpoint(self.out_dir, stem, model, {**self.metadata, "training": training}, resume_state)
        if stem == "last":
            self.good = (state.step, state.val_loss)

    def plot(self, force: bool = False) -> None:
        if self.out_dir is None or not (force or time.monotonic() - self.last_plot > 30):
            return
        self.last_plot = time.monotonic()
        try:
            _plot(self.metrics, self.out_dir / "loss.png")
        except Exception as e:  # a plotting problem must never cost a training run
            warnings.warn(f"could not draw {self.out_dir / 'loss.png'}: {e}", stacklevel=2)

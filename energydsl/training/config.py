"""A training run's settings (`TrainConfig`), checked before anything is built, and the device they name."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from energydsl.composition import MAX_SIZE, SIZE_LIMIT_HINT
from energydsl.errors import UserError

__all__ = ["DTYPES", "TRAIN_FLAGS", "TrainConfig", "check_dtype", "device_of"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FLOAT32_MAX = torch.finfo(torch.float32).max


#: TrainConfig fields -> the `energy train` flags that set them: for messages, and the command a search
#: writes into a candidate's file to train it again as its trial was trained
TRAIN_FLAGS = {"steps": "--steps", "batch_size": "--batch-size", "block_size": "--block-size", "lr": "--lr",
               "min_lr": "--min-lr", "warmup_steps": "--warmup", "weight_decay": "--weight-decay",
               "betas": "--betas", "grad_clip": "--grad-clip", "eval_interval": "--eval-interval",
               "eval_iters": "--eval-iters", "seed": "--seed", "device": "--device", "dtype": "--dtype",
               "compile": "--compile"}


@dataclass
class TrainConfig:
    """Hyper-parameters of a run; the defaults are nanoGPT's shakespeare_char recipe, except `block_size`, which is
    the model's context unless given (as `energy train --block-size`): nanoGPT's 256 is longer than the context of
    every example model."""

    steps: int = 5000
    batch_size: int = 64
    block_size: int | None = None  # None: the model's context (`train` fills it in), 256 for a model with none
    lr: float = 1e-3
    min_lr: float | None = None  # the cosine schedule's end; None: lr / 10 (as `energy train --min-lr`)
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = 1.0  # 0 disables clipping
    eval_interval: int = 250
    eval_iters: int = 200
    seed: int = 1337
    device: str = "cpu"  # 'cpu', 'cuda', 'cuda:N' or 'auto'
    log_interval: int = 10  # also how often the loss is checked for NaN (each check syncs the GPU)
    dtype: str = "float32"  # 'float32', 'bfloat16' (autocast) or 'float16' (autocast + grad scaling, CUDA)
    diverge_factor: float = 4.0  # a loss above this x the initial loss (and above 2 ln V) diverged; inf: off
    compile: bool = False  # torch.compile the model's forward and backward (Inductor; the weights stay the model's)

    def validate(self, names: dict[str, str] | None = None) -> None:
        """Reject impossible settings with a message naming each one as `names` spells it (a CLI passes its
        flags, e.g. {"warmup_steps": "--warmup"}); the field name otherwise."""
        def name(field: str) -> str:
            return (names or {}).get(field, field)

        if isinstance(self.dtype, torch.dtype):  # as `.model(dtype=torch.bfloat16)` takes it
            self.dtype = next((k for k, v in DTYPES.items() if v == self.dtype), str(self.dtype))
        self._normalize_types(name)
        # `not x >= 0` rather than `x < 0`: NaN fails every comparison and must not slip through
        block = self.block_size if self.block_size is not None else 1  # None: the model's, known to `train`
        for field in ("batch_size", "block_size", "eval_interval", "eval_iters", "log_interval"):
            value = block if field == "block_size" else getattr(self, field)
            if not value >= 1:
                raise UserError(f"{name(field)} must be at least 1, got {value}")
        # a batch is a (batch_size, block_size) tensor of token ids: its entries must fit torch's 64-bit index
        # (refused here rather than as an overflow deep in torch, exit 70)
        for field, value in (("batch_size", self.batch_size), ("block_size", block)):
            if value > MAX_SIZE:
                raise UserError(f"{name(field)} must be at most 2**60 - 1, got {value}", hint=SIZE_LIMIT_HINT)
        if self.batch_size * block > MAX_SIZE:
            raise UserError(f"{name('batch_size')} x {name('block_size')} = {self.batch_size * self.block_size} "
                            "token ids in a batch is more than 2**60 - 1", hint=SIZE_LIMIT_HINT)
        for field in ("steps", "warmup_steps", "weight_decay", "grad_clip"):
            if not getattr(self, field) >= 0:
                value = getattr(self, field)
                said = "must be a number" if value != value else "must not be negative"  # nan compares false too
                raise UserError(f"{name(field)} {said}, got {value}")
        if not math.isfinite(self.weight_decay):
            raise UserError(f"{name('weight_decay')} must be a finite number, got {self.weight_decay}")
        if not self.lr > 0:
            raise UserError(f"{name('lr')} must be above 0, got {self.lr}")
        if not math.isfinite(self.lr):
            raise UserError(f"{name('lr')} must be a finite number, got {self.lr}")
        # torch's generators take seeds in [0, 2**64) (negative ones are aliases of large ones): refused here
        # rather than as an overflow inside torch.manual_seed
        if not 0 <= self.seed < 2**64:
            raise UserError(f"{name('seed')} must be a whole number in [0, 2**64), got {self.seed}")
        if not 0 <= self.min_lr <= self.lr:
            raise UserError(f"{name('min_lr')} must be in [0, {name('lr')}], got {self.min_lr} with "
                            f"{name('lr')} {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise UserError(f"{name('betas')} must be two numbers in [0, 1), got {self.betas}")
        first_step = self.lr / (1 - self.betas[0])  # AdamW's step size at step 1, which it passes to torch as a float
        if first_step > FLOAT32_MAX:
            raise UserError(f"{name('lr')} {self.lr:g} is too large: AdamW's first step size, lr / (1 - beta1) = "
                            f"{first_step:.3g}, overflows a float32 (at most {FLOAT32_MAX:.3g})",
                            hint="a learning rate is usually below 1")
        if self.dtype not in DTYPES:
            raise UserError(f"unknown {name('dtype')} {self.dtype!r}", hint=f"use one of {', '.join(DTYPES)}")
        if not self.diverge_factor > 1:
            raise UserError(f"{name('diverge_factor')} must be above 1, got {self.diverge_factor}")

    def _normalize_types(self, name: Callable[[str], str]) -> None:
        """Each setting as the type it is: a whole number (numpy's too, or 4.0, as 8 / 2 gives) as an int, a
        number as a float, betas as a pair; anything else refused by name. A float batch size failed inside
        torch.randint after the run had started, and steps = 2.5 trained 3 steps."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" or (f.type == "int | None" and value is not None):
                whole = _whole(value)
                if whole is None:
                    raise UserError(f"{name(f.name)} must be a whole number, got {value!r} ({type(value).__name__})")
                setattr(self, f.name, whole)
            elif f.type in ("float", "float | None"):
                if value is None and f.name == "min_lr":  # lr, the field before it, is a float by now
                    value = self.lr / 10
                if isinstance(value, bool) or not isinstance(value, numbers.Real):
                    raise UserError(f"{name(f.name)} must be a number, got {value!r} ({type(value).__name__})")
                setattr(self, f.name, float(value))
            elif f.type == "bool" and not isinstance(value, bool):
                raise UserError(f"{name(f.name)} must be True or False, got {value!r}")
        pair = self.betas
        if isinstance(pair, str) or not isinstance(pair, Sequence) or len(pair) != 2 or not all(
                isinstance(b, numbers.Real) and not isinstance(b, bool) for b in pair):
            raise UserError(f"{name('betas')} must be two numbers in [0, 1), got {pair!r}")
        self.betas = (float(pair[0]), float(pair[1]))

    def resolve_device(self, names: dict[str, str] | None = None) -> torch.device:
        """The device this trains on, checked with the dtype (float16 needs CUDA): a CLI calls it before it
        builds or writes anything, `train` again."""
        device = device_of(self.device, (names or {}).get("device", "device"))
        check_dtype(self.dtype, device, (names or {}).get("dtype", "dtype"))
        return device


def _whole(value: Any) -> int | None:
    """`value` as an int if it is a whole number (an int, a numpy integer, an integral float), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        pass
    if isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
        return int(value)
    return None


def device_of(name: str, setting: str = "device") -> torch.device:
    """The torch device a `device` setting names (`auto`: CUDA where there is one), checked; `setting` is how
    the caller spells it (`--device` on the command line)."""
    if not isinstance(name, str):  # None and 0 reached torch.device's overloads
        raise UserError(f"device must be a string, not {name!r}", hint="use cpu, cuda, cuda:N or auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise UserError(f"unknown device {name!r}", hint="use cpu, cuda, cuda:N or auto") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        cpu = f"{setting} cpu" if setting.startswith("--") else f'{setting}="cpu"'
        raise UserError(f"device {name!r} requested but CUDA is not available", hint=f"use {cpu}")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise UserError(f"device {name!r} requested but this machine has {count} CUDA device{'s' * (count != 1)}",
                        hint=f"use cuda:0 to cuda:{count - 1}, or cuda")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"unsupported device {name!r}", hint="use cpu, cuda, cuda:N or auto")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def check_dtype(dtype: str, device: torch.device, name: str) -> None:
    """Autocast dtypes the device can run: float16 (with grad scaling) needs CUDA, bfloat16 a CPU or a GPU
    with bfloat16 arithmetic (compute capability 8.0+); found here, not as a kernel error mid-run."""
    if dtype == "float16" and device.type != "cuda":
        raise UserError(f"{name} float16 needs CUDA", hint="use bfloat16 or float32 on the CPU")
    if dtype == "bfloat16" and device.type == "cuda":
        with torch.cuda.device(device):
            try:
                supported = torch.cuda.is_bf16_supported(including_emulation=False)
            except TypeError:  # torch < 2.4 has no emulation argument
                supported = torch.cuda.is_bf16_supported()
        if not supported:
            raise UserError(f"{name} bfloat16 is not supported by {torch.cuda.get_device_name(device)}",
                            hint="use float16 or float32 on this GPU")

"""What `train` is given, checked before anything is built: each argument of the wrong kind named (from Python;
the CLI builds them right), and a model that cannot read the dataset's tokens or blocks refused."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from energydsl.errors import UserError

from .config import TrainConfig
from .data import LMDataset


def check_arguments(model: Any, dataset: Any, config: Any, metadata: Any, *, out_dir: Any, resume: Any,
                    progress: Any, on_eval: Any, notify: Any, names: Any) -> None:
    """What `train` is given, named where it is not what it takes (from Python: the CLI builds them right)."""
    if out_dir is not None and not isinstance(out_dir, str | os.PathLike):
        raise UserError(f"out_dir must be a path (or None: no files), got {type(out_dir).__name__}")
    for name, flag in (("resume", resume), ("progress", progress)):
        if not isinstance(flag, bool):  # resume="no" is truthy: it resumed
            raise UserError(f"{name} must be True or False, got {flag!r}")
    for name, function in (("on_eval", on_eval), ("notify", notify)):
        if function is not None and not callable(function):
            raise UserError(f"{name} must be a function (or None), got {type(function).__name__}")
    if names is not None and not isinstance(names, dict):
        raise UserError(f"names must be a dict of setting -> how to name it, got {type(names).__name__}")
    if not isinstance(model, nn.Module):
        raise UserError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if hasattr(model, "example_input") and not hasattr(model, "vocab_size"):  # a generated energy layer
        raise UserError(f"{type(model).__name__} is one energy layer (states to states); train() takes a language "
                        "model (token ids to logits)", hint="build one with load(path).model(name, **dims)")
    if not isinstance(dataset, LMDataset):
        raise UserError(f"dataset must be an LMDataset, got {type(dataset).__name__}",
                        hint="load_dataset('shakespeare_char'), or load_dataset('chars:PATH')")
    if not isinstance(config, TrainConfig):
        raise UserError(f"config must be a TrainConfig, got {type(config).__name__}",
                        hint="TrainConfig(steps=..., lr=...)" + (", or TrainConfig(**settings) from a dict"
                                                                 if isinstance(config, dict) else ""))
    if not isinstance(metadata, dict):
        raise UserError(f"metadata must be a dict (what a resumed run must match), got {type(metadata).__name__}",
                        hint="leave it out: a model from load(path).model(...) records itself, others nothing")
    try:  # saved in the checkpoint and compared on resume: an object's repr, or NaN (never equal), could not be
        json.dumps(metadata, allow_nan=False, default=_path_or_refuse)
    except (TypeError, ValueError) as e:
        held = str(e) if isinstance(e, TypeError) else "NaN or an infinity"
        raise UserError("metadata must be plain JSON (strings, finite numbers, lists, dicts; paths are taken), but "
                        f"it holds {held}", hint="it is saved with the checkpoint and a resumed run must match it") \
            from None


def _path_or_refuse(value: Any) -> str:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"a {type(value).__name__}, {str(value)[:60]}")


def check_fits(model: nn.Module, dataset: LMDataset, config: TrainConfig) -> None:
    """The model reads every token id of the dataset and sequences of block_size (a LanguageModel says how
    many through `vocab_size` and `block_size`); found here, not as an index error inside the embedding."""
    vocab, context = getattr(model, "vocab_size", None), getattr(model, "block_size", None)
    if isinstance(vocab, int) and dataset.vocab_size > vocab:
        raise UserError(f"the dataset {dataset.name} has {dataset.vocab_size} tokens but the model's vocab is {vocab}",
                        hint=f"build the model with vocab={dataset.vocab_size}")
    if isinstance(context, int) and config.block_size > context:
        raise UserError(f"block_size {config.block_size} is longer than the model's context {context}",
                        hint=f"set block_size <= {context}, or build the model with a longer context")


def check_batch_fits(model: nn.Module, config: TrainConfig, device: torch.device,
                     names: dict[str, str] | None = None) -> None:
    """A batch too large for host memory, refused before training: Linux grants an allocation larger than what
    is free and kills the process when the pages are touched (exit 137, no message), so the out-of-memory error
    the training loop turns into advice never comes. The estimate is a lower one (token ids, a language model's
    `activation_floats_per_token` for the backward pass, the gradients and AdamW's two moments): what is refused
    here could not have run. On a GPU the allocator raises, and the loop says so."""
    from ..sizing import available_memory, size_text

    per_token = getattr(model, "activation_floats_per_token", None)
    available = available_memory() if device.type == "cpu" and callable(per_token) else None
    if available is None:
        return
    tokens = config.batch_size * config.block_size
    width = 4 if config.dtype == "float32" else 2  # autocast keeps bfloat16 / float16 activations
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    needed = tokens * (2 * 8 + per_token() * width) + 3 * trained  # x and y ids; a gradient and two moments
    if needed > available:
        def name(field: str) -> str:
            return (names or {}).get(field, field)

        raise UserError(
            f"out of memory while training on cpu: a batch of {config.batch_size:,} sequences of "
            f"{config.block_size:,} tokens keeps at least {size_text(needed)} (the token ids, the activations for "
            f"the backward pass, the gradients and AdamW's moments); {available / 2**30:,.1f} GiB are available",
            hint=f"train with a smaller {name('batch_size')} (now {config.batch_size}) or {name('block_size')} (now "
                 f"{config.block_size}), or a smaller model; nothing was trained or written (Linux would have "
                 "granted the memory and killed the run when it used it)")

"""Codecs, checkpoint files and text sampling: what a trained model needs, without the training loop.

A checkpoint is three files sharing a stem (`best` or `last`): `<stem>.safetensors` (weights; tied
tensors stored once and listed as aliases in the header), `<stem>.json` (the caller's metadata at the
top level plus a `training` record: step, losses, config, dataset codec) and `<stem>.optim.pt`
(optimizer, grad-scaler and RNG states, for resuming). The JSON is written last, so a stem whose
JSON names the same step as its weights is complete.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from energydsl.errors import DataError

__all__ = [
    "ByteCodec", "CharCodec", "Codec", "IntCodec", "TextCodec", "WordCodec", "codec_from_json",
    "load_checkpoint", "sample", "save_checkpoint",
]


class Codec:
    """Text <-> token ids; kept apart from the splits so a checkpoint can rebuild it to sample."""

    kind = "abstract"
    vocab_size: int
    start_id = 0  # what sampling starts from when the prompt is empty

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "vocab_size": self.vocab_size}


class CharCodec(Codec):
    """One token per character of a fixed alphabet (nanoGPT's shakespeare_char)."""

    kind = "chars"

    def __init__(self, chars: str):
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.vocab_size = len(chars)
        self.start_id = self.stoi.get("\n", 0)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise DataError(f"character {e.args[0]!r} is not in the vocabulary",
                            hint=f"the vocabulary is {self.chars!r}") from None

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.chars[i] for i in ids if 0 <= i < self.vocab_size)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "chars": self.chars}


class ByteCodec(Codec):
    """UTF-8 bytes; decoding replaces incomplete characters, so lengths are in bytes, not characters."""

    kind = "bytes"
    vocab_size = 256
    start_id = 10

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class WordCodec(Codec):
    """Whitespace-separated symbols from a fixed list (ListOps)."""

    kind = "words"

    def __init__(self, tokens: Iterable[str]):
        self.tokens = list(tokens)
        self.stoi = {t: i for i, t in enumerate(self.tokens)}
        self.vocab_size = len(self.tokens)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[t] for t in text.split()]
        except KeyError as e:
            raise DataError(f"token {e.args[0]!r} is not in the vocabulary",
                            hint=f"tokens are separated by spaces: {' '.join(self.tokens)}") from None

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(self.tokens[i] for i in ids if 0 <= i < self.vocab_size)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "tokens": self.tokens}


class IntCodec(Codec):
    """Token ids written as decimal numbers separated by spaces (MQAR)."""

    kind = "ints"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(t) for t in text.split()]
        except ValueError as e:
            raise DataError(f"expected token ids separated by spaces: {e}") from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise DataError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def codec_from_json(spec: dict[str, Any]) -> Codec:
    """Rebuild a codec from `Codec.to_json()` (as stored in a checkpoint's `training.dataset.codec`)."""
    kind = spec.get("kind")
    if kind == "chars":
        return CharCodec(spec["chars"])
    if kind == "bytes":
        return ByteCodec()
    if kind == "words":
        return WordCodec(spec["tokens"])
    if kind == "ints":
        return IntCodec(int(spec["vocab_size"]))
    raise DataError(f"unknown codec kind {kind!r} in checkpoint metadata")


# --------------------------------------------------------------------------------------- checkpoints


def _atomic_write(path: Path, write: Any) -> None:
    """Write through a temporary file and rename, so a crash never leaves a half-written checkpoint."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def _weights_for_saving(model: nn.Module) -> tuple[dict[str, Tensor], dict[str, str]]:
    """CPU copies of the state dict; a tensor that is another entry (a tied head) becomes an alias."""
    tensors: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, t in model.state_dict().items():
        storage = t.untyped_storage().data_ptr()
        key = (t.device, storage, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.detach().to("cpu", copy=True).contiguous()
    return tensors, aliases


def save_checkpoint(out_dir: Path, stem: str, model: nn.Module, sidecar: dict[str, Any],
                    resume_state: dict[str, Any] | None = None) -> Path:
    """Write `<stem>.safetensors`, `<stem>.optim.pt` (with `resume_state`), then `<stem>.json`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors, aliases = _weights_for_saving(model)
    step = str(sidecar.get("training", {}).get("step", ""))
    header = {"format": "pt", "aliases": json.dumps(aliases), "step": step}
    weights = out_dir / f"{stem}.safetensors"
    _atomic_write(weights, lambda p: save_file(tensors, str(p), metadata=header))
    if resume_state is not None:
        _atomic_write(out_dir / f"{stem}.optim.pt", lambda p: torch.save(resume_state, p))
    text = json.dumps(sidecar, indent=1, default=str)
    _atomic_write(out_dir / f"{stem}.json", lambda p: p.write_text(text))
    return weights


def _checkpoint_paths(path_or_dir: str | Path, which: str) -> tuple[Path, Path]:
    path = Path(path_or_dir).expanduser()
    if path.is_dir():
        weights = path / f"{which}.safetensors"
        if not weights.exists() and which == "best":
            weights = path / "last.safetensors"
        if not weights.exists():
            raise DataError(f"no checkpoint in {path} (expected {which}.safetensors)",
                            hint="point at a training output directory or a .safetensors file")
    elif path.suffix == ".json":
        weights = path.with_suffix(".safetensors")
    else:
        weights = path
    if not weights.is_file():
        raise DataError(f"checkpoint not found: {weights}")
    return weights, weights.with_suffix(".json")


def load_checkpoint(
    path_or_dir: str | Path, *, which: str = "best"
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Read a checkpoint's weights (a full state dict, aliases restored) and its metadata.

    `path_or_dir` is an output directory (its `best`, else `last`, checkpoint; `which` picks), a
    `.safetensors` file or its `.json` sidecar. The metadata is the sidecar: the dict the trainer's
    caller gave, plus `training` (step, losses, config, dataset). Tensors load on the CPU.
    """
    weights, sidecar = _checkpoint_paths(path_or_dir, which)
    try:
        with safe_open(str(weights), framework="pt", device="cpu") as f:
            header = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise DataError(f"cannot read checkpoint {weights}: {e}") from e
    for alias, target in json.loads(header.get("aliases", "{}")).items():
        state[alias] = state[target]
    metadata: dict[str, Any] = {}
    if sidecar.is_file():
        try:
            metadata = json.loads(sidecar.read_text())
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read checkpoint metadata {sidecar}: {e}") from e
    return state, metadata


# ------------------------------------------------------------------------------------------ sampling


class TextCodec(Protocol):
    """Anything with encode/decode: a dataset or a codec."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def _context_length(model: nn.Module, metadata: Mapping[str, Any] | None) -> int | None:
    """The model's block size: metadata['context'], else a `context`/`block_size` attribute."""
    for meta in (metadata, getattr(model, "metadata", None)):
        if isinstance(meta, Mapping) and meta.get("context"):
            return int(meta["context"])
    for owner in (model, getattr(model, "config", None)):
        for attr in ("context", "block_size"):
            value = getattr(owner, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


@torch.no_grad()
def sample(
    model: nn.Module,
    dataset_or_codec: TextCodec,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    *,
    metadata: Mapping[str, Any] | None = None,
    include_prompt: bool = False,
) -> str:
    """Continue `prompt` by `max_new_tokens` tokens and return the decoded continuation.

    The context is cropped to the model's block size (`metadata['context']` if given) so models
    with learned positions never see more than they were built for. `temperature <= 0` is greedy.
    For character codecs the result has exactly `max_new_tokens` characters.
    """
    codec = getattr(dataset_or_codec, "codec", dataset_or_codec)
    vocab = getattr(codec, "vocab_size", None)
    ids = codec.encode(prompt) if prompt else [getattr(codec, "start_id", 0)]
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    context = _context_length(model, metadata)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            cond = idx if context is None else idx[:, -context:]
            logits = model(cond)[:, -1, :].float()
            if vocab is not None:
                logits = logits[:, :vocab]  # a padded output layer must not emit ids the codec lacks
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None and top_k > 0:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                if generator is not None and generator.device != probs.device:
                    probs = probs.to(generator.device)
                nxt = torch.multinomial(probs, 1, generator=generator).to(device)
            idx = torch.cat([idx, nxt], dim=1)
    finally:
        model.train(was_training)
    out = idx[0].tolist()
    return codec.decode(out if include_prompt and prompt else out[len(ids):])

"""Codecs, checkpoints and text sampling: what a trained model needs, without the training loop.

The checkpoint files (and how a save survives a kill) are `energydsl.training.checkpoint`'s; its
`load_checkpoint` and `save_checkpoint` are exported here too.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from energydsl.errors import DataError
from energydsl.number_text import is_count

from .checkpoint import load_checkpoint, save_checkpoint

__all__ = [
    "ByteCodec", "CharCodec", "Codec", "IntCodec", "TextCodec", "WordCodec", "codec_from_json",
    "load_checkpoint", "sample", "save_checkpoint", "stream",
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
        # surrogateescape: bytes that are not UTF-8 reach Python (a command line's argv) as lone surrogates
        return list(text.encode("utf-8", errors="surrogateescape"))

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
    if not isinstance(spec, dict):
        raise DataError(f"a codec is the dict Codec.to_json() writes, not {type(spec).__name__}")
    kind, damaged = spec.get("kind"), f"codec {spec!r:.80} is not what Codec.to_json() writes"
    try:
        if kind == "bytes":
            return ByteCodec()
        if kind == "ints":
            size = spec["vocab_size"]
            if not is_count(size):  # -5 sampled from all but the last 5 logits; 3.7 became 3
                raise DataError(f"{damaged} (its vocab_size is not a whole number >= 1)")
            return IntCodec(size)
        if kind in ("chars", "words"):
            table = spec["chars" if kind == "chars" else "tokens"]
            if not isinstance(table, str if kind == "chars" else list):
                raise DataError(f"{damaged} (its table is not a string or list)")
            if not table or len(set(table)) != len(table) or not all(isinstance(t, str) and t for t in table):
                raise DataError(f"{damaged} (its table is empty, repeats a token or holds one that is no text)")
            codec = CharCodec(table) if kind == "chars" else WordCodec(table)
            if "vocab_size" in spec and codec.vocab_size != spec["vocab_size"]:  # a table edited by hand
                raise DataError(f"{damaged} (its table has {codec.vocab_size} tokens, its vocab_size says "
                                f"{spec['vocab_size']!r})")
            return codec
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{damaged} ({type(e).__name__}: {e})") from None
    raise DataError(f"unknown codec kind {kind!r} in checkpoint metadata")


# ------------------------------------------------------------------------------------------ sampling


class TextCodec(Protocol):
    """Anything with encode/decode: a dataset or a codec."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def _context_length(model: nn.Module, metadata: Mapping[str, Any] | None) -> int | None:
    """How many tokens the model reads: the block it was trained on (metadata['training']['config']), which
    may be shorter than its context (positions past it never had a gradient), else metadata['context'], else
    a `context`/`block_size` attribute."""
    for meta in (metadata, getattr(model, "metadata", None)):
        if isinstance(meta, Mapping) and meta.get("context"):
            training = meta.get("training")
            trained = training.get("config", {}).get("block_size") if isinstance(training, Mapping) else None
            if isinstance(trained, int) and 0 < trained < int(meta["context"]):
                return trained
            return int(meta["context"])
    for owner in (model, getattr(model, "config", None)):
        for attr in ("context", "block_size"):
            value = getattr(owner, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


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
    codec, ids, new = stream(model, dataset_or_codec, prompt, max_new_tokens, temperature, top_k, generator,
                             metadata=metadata)
    out = list(new)
    return codec.decode(ids + out if include_prompt else out)


def stream(
    model: nn.Module,
    dataset_or_codec: TextCodec,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    *,
    metadata: Mapping[str, Any] | None = None,
) -> tuple[Any, list[int], Iterator[int]]:
    """`sample`'s work one token at a time: the codec, the prompt's ids (none for a prompt that encodes to no
    tokens, which is continued from the codec's start token), and an iterator of the new ids as they are
    drawn (what `energy sample` prints as they come). The arguments are checked here, before any is drawn."""
    codec = getattr(dataset_or_codec, "codec", dataset_or_codec)
    if not callable(getattr(codec, "encode", None)) or not callable(getattr(codec, "decode", None)):
        raise DataError(f"dataset_or_codec must be a dataset or its codec (what encodes the prompt and decodes the "
                        f"tokens), got {type(dataset_or_codec).__name__}",
                        hint="the dataset the model was trained on: load_dataset(...)")
    if not is_count(max_new_tokens, least=0):
        raise DataError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}")
    # NaN: torch.multinomial's "probability tensor contains inf, nan" otherwise
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or temperature != temperature:
        raise DataError(f"temperature must be a number (<= 0: greedy), got {temperature!r}")
    if top_k is not None and not is_count(top_k):  # -1 kept every token, silently, as None does
        raise DataError(f"top_k must be a whole number >= 1 (or None: every token), got {top_k!r}")
    if not isinstance(prompt, str):  # None sampled as if empty
        raise DataError(f"prompt must be a string, got {prompt!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise DataError(f"generator must be a torch.Generator (or None), got {type(generator).__name__}")
    if not isinstance(model, nn.Module):
        raise DataError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    ids = codec.encode(prompt)
    start = ids or [getattr(codec, "start_id", 0)]  # no tokens (`""`, or spaces between words): the start token's
    return codec, ids, _draw(model, getattr(codec, "vocab_size", None), start, max_new_tokens, temperature, top_k,
                             generator, _context_length(model, metadata))


@torch.no_grad()
def _draw(model: nn.Module, vocab: int | None, ids: list[int], max_new_tokens: int, temperature: float,
          top_k: int | None, generator: torch.Generator | None, context: int | None) -> Iterator[int]:
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    idx = torch.tensor([ids], dtype=torch.long, device=device)
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
                # shifted so the largest is 0, in float64 (where 1e-300 is not 0): a tiny temperature then gives
                # 0 and -inf, never inf - inf
                logits = (logits - logits.max(dim=-1, keepdim=True).values).double() / temperature
                if top_k is not None:  # exactly K kept, ties at the K-th value too (nanoGPT's `< kth` kept them all)
                    kept = torch.topk(logits, min(top_k, logits.size(-1))).indices
                    logits = torch.full_like(logits, float("-inf")).scatter(-1, kept, logits.gather(-1, kept))
                probs = torch.softmax(logits, dim=-1)
                if generator is not None and generator.device != probs.device:
                    probs = probs.to(generator.device)
                nxt = torch.multinomial(probs, 1, generator=generator).to(device)
            if context is not None and idx.size(1) >= context:  # only the last `context` ids are read again
                idx = idx[:, -(context - 1):] if context > 1 else idx[:, :0]
            idx = torch.cat([idx, nxt], dim=1)
            yield int(nxt)
    finally:
        model.train(was_training)

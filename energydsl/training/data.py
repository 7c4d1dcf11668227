"""Datasets for causal language modelling, independent of the DSL.

Every dataset gives `train`/`val` splits as 1-D LongTensors of token ids, a `vocab_size`, a codec
(`encode`/`decode`) and `get_batch(split, batch_size, block_size, generator)` returning `(x, y)`
LongTensors of shape `[B, T]`, where a target of `IGNORE_INDEX` (-1) takes no part in the loss.

* `shakespeare_char`: tiny Shakespeare, one token per character (vocab 65, 90/10 split as nanoGPT).
* `bytes:PATH` / `chars:PATH`: any text file, one token per byte (vocab 256) or per character.
* `listops`: generated nested MAX/MIN/MED/SM expressions followed by `=` and the answer digit.
* `mqar`: generated multi-query associative recall (key-value pairs, then the keys queried again).

Text datasets sample random windows of the token stream (nanoGPT). Generated tasks sample whole
examples, right-padded to `block_size`, and by default only count the answer tokens in the loss.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import math
import os
import random
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from energydsl.errors import DataError
from energydsl.files import check_output, write_atomic
from energydsl.number_text import is_count

from .sampling import ByteCodec, CharCodec, Codec, IntCodec, WordCodec, codec_from_json

__all__ = [
    "IGNORE_INDEX", "SHAKESPEARE_SHA256", "SHAKESPEARE_URL", "ByteCodec", "CharCodec", "Codec", "IntCodec",
    "LMDataset", "ListOpsConfig", "MQARConfig", "TaskDataset", "TextDataset", "WordCodec", "codec_from_json",
    "download_shakespeare", "find_shakespeare", "load_dataset",
]

IGNORE_INDEX = -1
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SHAKESPEARE_REL = Path("tinyshakespeare") / "input.txt"
KNOWN = "shakespeare_char, bytes:PATH, chars:PATH, listops, mqar"


class LMDataset:
    """Train/val token splits plus the codec; subclasses decide how a batch is cut."""

    def __init__(self, name: str, codec: Codec, train: Tensor, val: Tensor,
                 options: dict[str, Any] | None = None):
        self.name = name
        self.codec = codec
        self.train = train
        self.val = val
        self.options = dict(options or {})

    @property
    def vocab_size(self) -> int:
        return self.codec.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.codec.decode(ids)

    def split(self, split: str) -> Tensor:
        if split == "train":
            return self.train
        if split == "val":
            return self.val
        raise DataError(f"unknown split {split!r}", hint="use 'train' or 'val'")

    def check_block_size(self, block_size: int) -> None:
        """Raise DataError if `get_batch` could not serve windows of this length."""
        raise NotImplementedError

    def get_batch(
        self, split: str, batch_size: int, block_size: int, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """What a checkpoint records about its data: enough to rebuild the codec and to spot a mismatch."""
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "codec": self.codec.to_json(),
            "train_tokens": int(self.train.numel()),
            "val_tokens": int(self.val.numel()),
            "options": self.options,
            "digest": self.digest(),
        }

    def digest(self) -> str:
        """A hash of the tokens of both splits: a resumed run must train and be evaluated on the same data, not on
        another corpus of the same name and vocabulary (about 10 ms for tinyshakespeare)."""
        if getattr(self, "_digest", None) is None:
            h = hashlib.sha256()
            for t in (self.train, self.val):
                h.update(str(tuple(t.shape)).encode() + t.detach().contiguous().cpu().numpy().tobytes())
            self._digest = h.hexdigest()[:16]
        return self._digest

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab={self.vocab_size}, train={self.train.numel()}, " \
               f"val={self.val.numel()})"


class TextDataset(LMDataset):
    """A token stream; a batch is `batch_size` random windows, targets shifted by one (nanoGPT)."""

    def check_block_size(self, block_size: int) -> None:
        if not is_count(block_size):
            raise DataError(f"block_size must be a whole number, at least 1, got {block_size!r}")
        counts = {split: self.split(split).numel() for split in ("train", "val")}
        split = min(counts, key=counts.__getitem__)  # the shorter split bounds the block
        n = counts[split]
        if n <= block_size:
            raise DataError(
                f"block_size {block_size} needs at least {block_size + 1} tokens in the {split} split of "
                f"{self.name}, which has {n}",
                hint=f"use a block size below {n}, or a larger text file" if n > 1 else
                "the file is too small for any block size: give a larger text file",
            )

    def get_batch(
        self, split: str, batch_size: int, block_size: int, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        data = self.split(split)
        if not is_count(batch_size):
            raise DataError(f"batch_size must be a whole number, at least 1, got {batch_size!r}")
        if not is_count(block_size) or data.numel() <= block_size:
            self.check_block_size(block_size)
        start = torch.randint(data.numel() - block_size, (batch_size,), generator=generator)
        chunk = data[start[:, None] + torch.arange(block_size + 1)]
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


class TaskDataset(LMDataset):
    """Fixed-width examples (rows of `seq_len + 1` tokens) with a mask of the tokens that are targets.

    `train`/`val` are the rows flattened (`split.view(-1, seq_len + 1)` recovers them), so the
    1-D interface holds; batches are whole rows, never windows across examples.
    """

    def __init__(self, name: str, codec: Codec, rows: dict[str, Tensor], masks: dict[str, Tensor],
                 pad_id: int, options: dict[str, Any]):
        super().__init__(name, codec, rows["train"].reshape(-1), rows["val"].reshape(-1), options)
        self.rows = rows
        self.masks = masks
        self.pad_id = pad_id
        self.seq_len = rows["train"].shape[1] - 1

    def check_block_size(self, block_size: int) -> None:
        _check_task_block(self.name, self.seq_len, block_size)

    def get_batch(
        self, split: str, batch_size: int, block_size: int, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        self.check_block_size(block_size)
        if not is_count(batch_size):
            raise DataError(f"batch_size must be a whole number, at least 1, got {batch_size!r}")
        self.split(split)  # validates the name
        rows, masks = self.rows[split], self.masks[split]
        pick = torch.randint(rows.shape[0], (batch_size,), generator=generator)
        seq, mask = rows[pick], masks[pick]
        x = seq[:, :-1]
        y = seq[:, 1:].masked_fill(~mask[:, 1:], IGNORE_INDEX)
        if block_size > self.seq_len:  # right padding never changes what a causal model sees earlier
            extra = block_size - self.seq_len
            x = torch.nn.functional.pad(x, (0, extra), value=self.pad_id)
            y = torch.nn.functional.pad(y, (0, extra), value=IGNORE_INDEX)
        return x.contiguous(), y.contiguous()


def _check_task_block(name: str, seq_len: int, block_size: int) -> None:
    if not is_count(block_size):
        raise DataError(f"block_size must be a whole number, at least 1, got {block_size!r}")
    if block_size < seq_len:
        raise DataError(f"{name} examples are {seq_len} tokens long but block_size is {block_size}",
                        hint=f"use a block size (and a model context) of at least {seq_len}, or, from Python, "
                             "shorter examples (`load_dataset` options)")


# ----------------------------------------------------------------------------------------- text files


def _check_readable(path: Path, what: str) -> None:
    """What can be said of a data file without reading it: it is there, not a directory, readable."""
    if not path.exists():
        if path.is_symlink():  # exists() follows links: a dangling one, or a loop of them
            try:
                path.resolve(strict=True)
            except (RuntimeError, OSError) as e:  # a loop: RuntimeError before Python 3.13, then ELOOP
                if not isinstance(e, OSError) or e.errno == errno.ELOOP:
                    raise DataError(f"{what} is a loop of symbolic links: {path}", hint="check the path") from None
            raise DataError(f"{what} is a symbolic link to nothing: {path} -> {os.readlink(path)}",
                            hint="check the path")
        raise DataError(f"{what} not found: {path}", hint="check the path")
    if path.is_dir():
        raise DataError(f"{what} is a directory, not a file: {path}")
    if not path.is_file():  # /dev/zero never ends, a pipe may block forever
        raise DataError(f"{what} is not a regular file (a device, pipe or socket): {path}", hint="give a text file")
    if not os.access(path, os.R_OK):
        raise DataError(f"cannot read {what} {path}", hint="check the file's permissions")


def _read_bytes(path: Path, what: str) -> bytes:
    _check_readable(path, what)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {what} {path}: {e.strerror or e}",
                        hint="check the file's permissions") from e
    if not data:
        raise DataError(f"{what} is empty: {path}", hint="give a file with some text in it")
    return data


def _split(tokens: Tensor, val_fraction: float = 0.1) -> tuple[Tensor, Tensor]:
    cut = int(tokens.numel() * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]


def _read_text(path: Path, what: str) -> tuple[bytes, str]:
    """The file's bytes and its UTF-8 text; a file that is not UTF-8 is a DataError pointing to bytes:PATH."""
    raw = _read_bytes(path, what)
    try:
        return raw, raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{what} is not UTF-8 text: {path} (byte {e.start})", hint=f"use bytes:{path}") from e


def _char_dataset(name: str, path: Path, what: str) -> TextDataset:
    raw, text = _read_text(path, what)
    codec = CharCodec("".join(sorted(set(text))))
    if text.isascii():  # fast path for the common case: a lookup table over the raw bytes
        lut = np.zeros(128, dtype=np.int64)
        lut[[ord(c) for c in codec.chars]] = np.arange(codec.vocab_size)
        tokens = torch.from_numpy(lut[np.frombuffer(raw, dtype=np.uint8)])
    else:
        tokens = torch.tensor(codec.encode(text), dtype=torch.long)
    train, val = _split(tokens)
    return TextDataset(name, codec, train, val, {"path": str(path)})


def _bytes_dataset(name: str, path: Path) -> TextDataset:
    raw = _read_bytes(path, "text file")
    tokens = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).astype(np.int64))
    train, val = _split(tokens)
    return TextDataset(name, ByteCodec(), train, val, {"path": str(path)})


def default_data_dir() -> Path:
    """Where downloads go: $ENERGYDSL_DATA_DIR, else ~/.cache/energydsl/data."""
    env = os.environ.get("ENERGYDSL_DATA_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "energydsl" / "data"


def _shakespeare_candidates() -> list[Path]:
    found: list[Path] = []
    if os.environ.get("ENERGYDSL_DATA_DIR"):
        found.append(default_data_dir() / SHAKESPEARE_REL)
    for base in (Path.cwd(), Path(__file__).resolve().parent):
        for d in (base, *base.parents):
            for rel in ("shared/data", "../shared/data"):
                found.append(Path(os.path.normpath(d / rel / SHAKESPEARE_REL)))
    found.append(Path.home() / ".cache" / "energydsl" / "data" / SHAKESPEARE_REL)
    return list(dict.fromkeys(found))


def find_shakespeare() -> Path:
    """Tiny Shakespeare on disk: $ENERGYDSL_SHAKESPEARE, the data dir, or a shared/data folder above."""
    explicit = os.environ.get("ENERGYDSL_SHAKESPEARE")
    if explicit:
        path = Path(explicit).expanduser()
        if path.is_dir():
            inside = [p for p in (path / "input.txt", path / SHAKESPEARE_REL) if p.is_file()]
            raise DataError(f"ENERGYDSL_SHAKESPEARE points to a directory, not to the tiny Shakespeare text file "
                            f"(input.txt): {path}",
                            hint=f"set ENERGYDSL_SHAKESPEARE={inside[0]}" if inside else
                            "set it to the path of input.txt, or unset it to search the usual places")
        if not path.is_file():
            what = "a missing file" if not path.exists() else "something that is no regular file (a device or pipe)"
            raise DataError(f"ENERGYDSL_SHAKESPEARE points to {what}: {path}",
                            hint="fix the variable, or unset it to search the usual places")
        return path
    candidates = _shakespeare_candidates()
    for path in candidates:
        if path.is_file():
            return path
    shown = ", ".join(str(p) for p in candidates[:3])
    raise DataError(
        f"tiny Shakespeare corpus not found (looked in {shown} and {len(candidates) - 3} more places)",
        hint="set ENERGYDSL_SHAKESPEARE=/path/to/input.txt, or download it once with energydsl.training."
             "data.download_shakespeare() or load_dataset('shakespeare_char', download=True)",
    )


def download_shakespeare(dest: str | Path | None = None, *, url: str = SHAKESPEARE_URL,
                         sha256: str = SHAKESPEARE_SHA256, timeout: float = 60.0) -> Path:
    """Fetch tiny Shakespeare (karpathy/char-rnn) to `dest`, checksum verified; never called implicitly."""
    dest = Path(dest) if dest is not None else default_data_dir() / SHAKESPEARE_REL
    if dest.is_file() and hashlib.sha256(dest.read_bytes()).hexdigest() == sha256:
        return dest
    check_output(dest, "the download's destination", "input.txt")  # before the download, not after it
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            payload = response.read()
    except (urllib.error.URLError, OSError, ValueError) as e:  # ValueError: no URL (`""`, `http://[::1`)
        raise DataError(f"cannot download {url}: {e}",
                        hint="download it by hand and set ENERGYDSL_SHAKESPEARE") from e
    digest = hashlib.sha256(payload).hexdigest()
    if digest != sha256:
        raise DataError(f"checksum mismatch for {url}: got {digest}, expected {sha256}",
                        hint="the file changed upstream or the download was corrupted")
    write_atomic(dest, payload)
    return dest


# ------------------------------------------------------------------------------------------ ListOps

LISTOPS_OPS = ("[MAX", "[MIN", "[MED", "[SM")
LISTOPS_TOKENS = ("<pad>", *(str(d) for d in range(10)), *LISTOPS_OPS, "]", "=")


@dataclass(frozen=True)
class ListOpsConfig:
    """ListOps as in LRA / NRGPT, sized for small models.

    `max_depth` bounds the nesting of operators (the root is depth 1), `max_length` the expression's
    tokens; rows are `max_length + 2` tokens (expression, `=`, answer), so models need a block size
    of at least `max_length + 1`.
    """

    seed: int = 0
    max_depth: int = 3
    max_args: int = 5
    max_length: int = 64
    num_train: int = 20000
    num_val: int = 1000
    op_prob: float = 0.25  # chance that an argument (below the root) is itself an operator, as in LRA
    answer_only: bool = True  # loss on the answer digit only; False trains on every token (plain LM)

    def validate(self) -> None:
        _require(self.max_depth >= 1, "listops max_depth must be at least 1")
        _require(self.max_args >= 2, "listops max_args must be at least 2")
        _require(self.max_length >= 4, "listops max_length must be at least 4 (the shortest is '[MAX 1 2 ]')")
        _require(self.num_train >= 1 and self.num_val >= 1, "listops num_train and num_val must be positive")
        _require(0.0 <= self.op_prob <= 1.0, "listops op_prob must lie in [0, 1]")


def listops_apply(op: str, args: list[int]) -> int:
    """MAX, MIN, MED (median, the mean of the middle two rounded down) and SM (sum mod 10) on digits."""
    if op == "[MAX":
        return max(args)
    if op == "[MIN":
        return min(args)
    if op == "[MED":
        s = sorted(args)
        return (s[(len(s) - 1) // 2] + s[len(s) // 2]) // 2
    if op == "[SM":
        return sum(args) % 10
    raise ValueError(f"unknown ListOps operator {op!r}")


def _listops_tree(rng: random.Random, cfg: ListOpsConfig, depth: int) -> tuple[list[str], int]:
    """One expression as (tokens, value); the root (depth 1) is always an operator."""
    if depth > 1 and (depth > cfg.max_depth or rng.random() >= cfg.op_prob):
        d = rng.randrange(10)
        return [str(d)], d
    op = rng.choice(LISTOPS_OPS)
    tokens, values = [op], []
    for _ in range(rng.randint(2, cfg.max_args)):
        sub, value = _listops_tree(rng, cfg, depth + 1)
        tokens += sub
        values.append(value)
    tokens.append("]")
    return tokens, listops_apply(op, values)


def _listops_examples(cfg: ListOpsConfig, split: str, count: int,
                      exclude: set[tuple[str, ...]]) -> list[list[str]]:
    rng = random.Random(f"listops-{split}-{cfg.seed}")  # string seeds are stable across runs and platforms
    out: list[list[str]] = []
    seen = set(exclude)
    attempts = 0
    while len(out) < count and attempts < 50 * count + 1000:
        attempts += 1
        tokens, value = _listops_tree(rng, cfg, 1)
        key = tuple(tokens)
        if len(tokens) > cfg.max_length or (split == "val" and key in seen):
            continue  # val never repeats a training expression, so its loss measures generalisation
        seen.add(key)
        out.append([*tokens, "=", str(value)])
    if len(out) < count:
        raise DataError(f"could only generate {len(out)} of {count} distinct listops {split} examples",
                        hint="raise max_depth, max_args or max_length, or ask for fewer examples")
    return out


def _listops(cfg: ListOpsConfig) -> TaskDataset:
    cfg.validate()
    codec = WordCodec(LISTOPS_TOKENS)
    train = _listops_examples(cfg, "train", cfg.num_train, set())
    val = _listops_examples(cfg, "val", cfg.num_val, {tuple(e[:-2]) for e in train})
    width = cfg.max_length + 2  # fixed by the config, so the block size a model needs is known upfront
    rows, masks = {}, {}
    for split, examples in (("train", train), ("val", val)):
        seq = torch.zeros(len(examples), width, dtype=torch.long)
        mask = torch.zeros(len(examples), width, dtype=torch.bool)
        for i, e in enumerate(examples):
            seq[i, : len(e)] = torch.tensor([codec.stoi[t] for t in e])
            if cfg.answer_only:
                mask[i, len(e) - 1] = True
            else:
                mask[i, 1 : len(e)] = True
        rows[split], masks[split] = seq, mask
    return TaskDataset("listops", codec, rows, masks, pad_id=0, options=asdict(cfg))


# --------------------------------------------------------------------------------------------- MQAR


@dataclass(frozen=True)
class MQARConfig:
    """Zoology-style MQAR: `num_kv_pairs` pairs, then each key queried once at power-law-spaced slots.

    Keys come from [1, vocab/2), values from [vocab/2, vocab), 0 fills the gaps. Unlike Zoology the
    value follows its query key in the input too, so a row is an ordinary LM sequence; only the
    queried values are targets.
    """

    seed: int = 0
    vocab_size: int = 8192
    seq_len: int = 64
    num_kv_pairs: int = 8
    num_train: int = 20000
    num_val: int = 1000
    power_a: float = 0.01

    def validate(self) -> None:
        n = self.num_kv_pairs
        _require(n >= 1, "mqar num_kv_pairs must be at least 1")
        _require(self.vocab_size // 2 - 1 >= n,
                 f"mqar vocab_size {self.vocab_size} is too small for {n} distinct keys")
        _require((self.seq_len - 2 * n) // 2 >= n,
                 f"mqar seq_len {self.seq_len} is too short for {n} pairs and {n} queries (needs {4 * n})")
        _require(self.num_train >= 1 and self.num_val >= 1, "mqar num_train and num_val must be positive")
        _require(self.power_a > 0, "mqar power_a must be positive")


def _mqar_rows(cfg: MQARConfig, split_id: int, count: int) -> tuple[Tensor, Tensor]:
    rng = np.random.default_rng([cfg.seed, split_id, 0x4D514152])
    n, half = cfg.num_kv_pairs, cfg.vocab_size // 2
    keys = np.stack([rng.choice(np.arange(1, half), n, replace=False) for _ in range(count)])
    values = np.stack([rng.choice(np.arange(half, cfg.vocab_size), n, replace=False) for _ in range(count)])
    space = (cfg.seq_len - 2 * n) // 2
    p = cfg.power_a * np.arange(1, space + 1, dtype=np.float64) ** (cfg.power_a - 1)
    # sampling slots without replacement with probability p: the Gumbel top-k trick, vectorised
    scores = np.log(p / p.sum())[None, :] + rng.gumbel(size=(count, space))
    gaps = np.argsort(-scores, axis=1)[:, :n]
    seq = np.zeros((count, cfg.seq_len + 1), dtype=np.int64)
    seq[:, 0 : 2 * n : 2], seq[:, 1 : 2 * n : 2] = keys, values
    rows = np.arange(count)[:, None]
    query = 2 * n + 2 * gaps
    seq[rows, query], seq[rows, query + 1] = keys, values
    mask = np.zeros_like(seq, dtype=bool)
    mask[rows, query + 1] = True
    return torch.from_numpy(seq), torch.from_numpy(mask)


def _mqar(cfg: MQARConfig) -> TaskDataset:
    cfg.validate()
    rows, masks = {}, {}
    for split_id, (split, count) in enumerate((("train", cfg.num_train), ("val", cfg.num_val))):
        rows[split], masks[split] = _mqar_rows(cfg, split_id, count)
    return TaskDataset("mqar", IntCodec(cfg.vocab_size), rows, masks, pad_id=0, options=asdict(cfg))


# ------------------------------------------------------------------------------------------ loading


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise DataError(message)


def _make_config(cls: type, name: str, options: dict[str, Any]) -> Any:
    """Build a generator config from keyword options, coercing CLI strings and naming bad keys."""
    known = {f.name: f for f in fields(cls)}
    values = {}
    for key, raw in options.items():
        if key not in known:
            raise DataError(f"unknown option {key!r} for dataset {name}",
                            hint=f"known options: {', '.join(known)}")
        kind = type(getattr(cls(), key))
        try:
            if kind is bool and isinstance(raw, str):
                if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(raw)
                value = raw.lower() in ("true", "1", "yes")
            else:
                value = kind(raw)
                if kind is int and isinstance(raw, float) and not math.isclose(raw, value):
                    raise ValueError(raw)
        except (TypeError, ValueError) as e:
            raise DataError(f"option {key}={raw!r} for dataset {name} is not a valid {kind.__name__}") from e
        values[key] = value
    return cls(**values)


def _no_options(name: str, options: dict[str, Any], allowed: tuple[str, ...] = ()) -> None:
    extra = sorted(set(options) - set(allowed))
    if extra:
        hint = f"known options: {', '.join(allowed)}" if allowed else f"{name} takes no options"
        raise DataError(f"unknown option {extra[0]!r} for dataset {name}", hint=hint)


def file_dataset(name: str) -> tuple[str, str] | None:
    """(kind, path as written) of a dataset read from a file, `bytes:PATH` or `chars:PATH` (the path may be
    empty: callers say what is missing), else None."""
    kind, colon, raw = name.strip().partition(":")
    return (kind, raw) if colon and kind in ("bytes", "chars") else None


def check_dataset(name: str) -> None:
    """Raise a DataError when `load_dataset(name)` would fail to find its data: the name is known and its file
    is there and readable, checked without reading it (a search checks every trial's dataset up front)."""
    name, file = name.strip(), file_dataset(name)
    if name == "shakespeare_char":
        find_shakespeare()
    elif file is not None:
        kind, raw = file
        if not raw:
            raise DataError(f"{kind}: needs a file path", hint=f"write {kind}:path/to/file.txt")
        path = Path(raw).expanduser()
        _check_readable(path, "text file")
        if path.is_file() and path.stat().st_size == 0:
            raise DataError(f"text file is empty: {path}", hint="give a file with some text in it")
    elif name not in ("listops", "mqar"):
        raise DataError(f"unknown dataset {name!r}", hint=f"known datasets: {KNOWN}")


def dataset_vocab(name: str) -> int:
    """The vocabulary size `load_dataset(name)` gives (default options), without building its splits: a search
    compares it with the model's vocab before any trial. Text files are read (their characters count)."""
    name, file = name.strip(), file_dataset(name)
    if name == "listops":
        return len(LISTOPS_TOKENS)
    if name == "mqar":
        return MQARConfig().vocab_size
    if file is not None and file[0] == "bytes":
        return ByteCodec().vocab_size
    if name == "shakespeare_char":
        return len(set(_read_text(find_shakespeare(), "tiny Shakespeare corpus")[1]))
    return len(set(_read_text(Path(file[1] if file else "").expanduser(), "text file")[1]))


def block_check(name: str) -> Callable[[int], None]:
    """`check_block_size` of `load_dataset(name)` (default options), loaded once for several block sizes: a search
    checks each block a trial may take before any trial. A task's examples are not generated (their length is
    the config's); a text file is read and split."""
    name = name.strip()
    if name == "listops":
        return functools.partial(_check_task_block, name, ListOpsConfig().max_length + 1)
    if name == "mqar":
        return functools.partial(_check_task_block, name, MQARConfig().seq_len)
    return load_dataset(name).check_block_size


def load_dataset(name: str, *, block_size: int | None = None, **options: Any) -> LMDataset:
    """Parse a dataset name (`shakespeare_char`, `bytes:PATH`, `chars:PATH`, `listops`, `mqar`) and load it.

    `options` go to the generator config (e.g. `seed=1, max_depth=4`); `shakespeare_char` takes
    `path=` and `download=True`. With `block_size`, a size the splits cannot serve fails here.
    """
    if not isinstance(name, str):  # a Path is a file's, whose kind (chars: or bytes:) the name says
        raise DataError(f"load_dataset takes a dataset name, not a {type(name).__name__} ({name!r})",
                        hint="shakespeare_char, listops, mqar, or chars:PATH / bytes:PATH for a file")
    name = name.strip()
    if name == "shakespeare_char":
        _no_options(name, options, ("path", "download"))
        if options.get("path"):
            path = Path(options["path"]).expanduser()
        elif options.get("download"):
            try:
                path = find_shakespeare()
            except DataError:
                path = download_shakespeare()
        else:
            path = find_shakespeare()
        dataset: LMDataset = _char_dataset(name, path, "tiny Shakespeare corpus")
    elif (file := file_dataset(name)) is not None:
        kind, raw_path = file
        _no_options(name, options)
        if not raw_path:
            raise DataError(f"{kind}: needs a file path", hint=f"write {kind}:path/to/file.txt")
        path = Path(raw_path).expanduser()
        dataset = _bytes_dataset(name, path) if kind == "bytes" else _char_dataset(name, path, "text file")
    elif name == "listops":
        dataset = _listops(_make_config(ListOpsConfig, name, options))
    elif name == "mqar":
        dataset = _mqar(_make_config(MQARConfig, name, options))
    else:
        raise DataError(f"unknown dataset {name!r}", hint=f"known datasets: {KNOWN}")
    if block_size is not None:
        dataset.check_block_size(block_size)
    return dataset

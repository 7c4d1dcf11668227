"""Checkpoint files, saved so that a process killed at any moment leaves a whole checkpoint behind.

A checkpoint is three files sharing a stem (`best` or `last`): `<stem>.safetensors` (weights; tied
tensors stored once and listed as aliases in the header, which also holds the step), `<stem>.json`
(the caller's metadata at the top level plus a `training` record: step, losses, config, dataset codec)
and `<stem>.optim.pt` (optimizer, grad-scaler and RNG states, for resuming).

Three files cannot be replaced at once, so a save is a small transaction over one or more stems (an
evaluation saves `last` and, when it improved, `best`, together):

1. each new file is written under a staging name, `.next.<name>`, and flushed to disk (fsync);
2. commit: the record `.checkpoint.commit` (which files it replaces) appears by one atomic rename;
3. each staged file is renamed over its name, then the record is removed.

A kill before the commit leaves the previous checkpoint untouched (the staged files are debris that the
next save overwrites); after it, a reader takes a file's staged version while it exists, else the file
itself: the new checkpoint either way. The next save first finishes the renames. A directory without
a record (every directory at rest, and those written before this scheme) reads as plain files.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from energydsl.errors import DataError, first_few
from energydsl.files import new_file_mode

__all__ = ["COMMIT", "checkpoint_file", "checkpoint_paths", "load_checkpoint", "read_checkpoint", "read_resume_state",
           "save_checkpoint", "save_checkpoints"]

COMMIT = ".checkpoint.commit"
SUFFIXES = (".safetensors", ".optim.pt", ".json")


def _staged(path: Path) -> Path:
    return path.with_name(f".next.{path.name}")


def _fsync(path: Path) -> None:
    """Flush a file (or, on POSIX, a directory's entries) to disk; a rename is durable only after that."""
    is_dir = path.is_dir()
    if is_dir and os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY if is_dir else os.O_RDWR)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot sync a directory: the rename is still atomic
        if not is_dir:
            raise
    finally:
        os.close(fd)


def _write_weights(path: Path, tensors: dict[str, Tensor], header: dict[str, str]) -> None:
    try:
        save_file(tensors, str(path), metadata=header)
    except Exception as e:  # SafetensorError: "I/O error: No space left on device (os error 28)"
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from None  # a full disk names the file
    # safetensors writes a private temporary file (mode 0600) and renames it: give the weights the mode of
    # any file the user writes (0644 under umask 022), as the other checkpoint files have
    os.chmod(path, new_file_mode())


def _write_resume_state(path: Path, state: Mapping[str, Any]) -> None:
    try:
        with open(path, "wb") as f:  # through a Python file, whose write error torch keeps as the context
            torch.save(dict(state), f)
    except RuntimeError as e:  # "[enforce fail at inline_container.cc] unexpected pos": a full disk, say
        if not isinstance(e.__context__, OSError) or e.__context__.errno is None:
            raise
        raise OSError(e.__context__.errno, os.strerror(e.__context__.errno), str(path)) from None


def _write_text(path: Path, text: str) -> None:
    """`Path.write_text`, naming the file where a write (not the open) fails: a full disk said `cannot write:`."""
    try:
        path.write_text(text)
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror or os.strerror(e.errno), str(path)) from e


def _read_commit(out_dir: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((out_dir / COMMIT).read_text())
    except FileNotFoundError:
        return None
    except PermissionError as e:
        if not os.access(out_dir, os.R_OK | os.X_OK):  # the folder itself, not the record (which may not exist)
            raise DataError(f"cannot read the run directory {out_dir}: permission denied",
                            hint=f"its permissions must let you read it (`ls -ld {out_dir}`)") from e
        raise DataError(f"cannot read the checkpoint commit record {out_dir / COMMIT}: {e}",
                        hint="its permissions must let you read it") from e
    except (OSError, ValueError) as e:  # written by an atomic rename: damaged only by hand
        raise DataError(f"cannot read the checkpoint commit record {out_dir / COMMIT}: {e}",
                        hint="remove it if the checkpoint files beside it are whole") from e
    names = [record.get(k, []) for k in ("files", "drop")] if isinstance(record, dict) else [None]
    if not all(isinstance(n, list) and all(isinstance(x, str) for x in n) for n in names):
        raise DataError(f"the checkpoint commit record {out_dir / COMMIT} is damaged: it is not the lists of file "
                        "names a save writes", hint="remove it if the checkpoint files beside it are whole")
    return record


def checkpoint_file(path: Path) -> Path | None:
    """Where the committed content of checkpoint file `path` lies now: its staged version while a commit
    is being completed, else `path` itself; None if it has none."""
    record = _read_commit(path.parent)
    if record is not None:
        if path.name in record.get("drop", []):
            return None
        if path.name in record.get("files", []) and _staged(path).exists():
            return _staged(path)
    return path if path.exists() else None


def finish_commit(out_dir: Path) -> None:
    """Complete a committed save: move its staged files into place, then drop the record."""
    record = _read_commit(out_dir)
    if record is None:
        return
    for name in record.get("files", []):
        staged = _staged(out_dir / name)
        if staged.exists():
            os.replace(staged, out_dir / name)
    for name in record.get("drop", []):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(out_dir / name)
    _fsync(out_dir)
    os.unlink(out_dir / COMMIT)


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


def save_checkpoints(out_dir: Path, model: nn.Module, sidecars: Mapping[str, dict[str, Any]],
                     resume_state: Mapping[str, Any] | None = None, texts: Mapping[str, str] | None = None,
                     drop: Sequence[str] = ()) -> None:
    """Save `model` (and `resume_state`) under each stem of `sidecars` with that stem's sidecar, as one
    transaction: after a kill at any point, every stem reads either all old or all new (module docstring).
    `texts` (file name: content) are written and `drop` removed in the same transaction."""
    out_dir.mkdir(parents=True, exist_ok=True)
    finish_commit(out_dir)  # an earlier save that was killed after its commit
    for debris in out_dir.glob(".next.*"):
        if debris.is_dir() and not debris.is_symlink():  # not a staged file: someone's folder, left alone
            raise DataError(f"{debris} is a folder, where a checkpoint is staged before it is committed",
                            hint="move it out of the run directory")
        debris.unlink(missing_ok=True)
    tensors, aliases = _weights_for_saving(model)
    files: list[str] = []
    drop = list(drop)
    tmp = out_dir / f"{COMMIT}.tmp"
    try:
        for name, text in (texts or {}).items():
            _write_text(_staged(out_dir / name), text)
            files.append(name)
        _stage(out_dir, tensors, aliases, sidecars, resume_state, files, drop)
        _write_text(tmp, json.dumps({"files": files, "drop": drop}))
        _fsync(tmp)
    except BaseException:  # a full disk, say: nothing is committed yet, and the staged files take its room
        for debris in [*out_dir.glob(".next.*"), tmp]:
            if not debris.is_dir():
                debris.unlink(missing_ok=True)
        raise
    os.replace(tmp, out_dir / COMMIT)  # the commit: from here on, readers see the new files
    _fsync(out_dir)
    finish_commit(out_dir)


def _stage(out_dir: Path, tensors: dict[str, Tensor], aliases: dict[str, str],
           sidecars: Mapping[str, dict[str, Any]], resume_state: Mapping[str, Any] | None,
           files: list[str], drop: list[str]) -> None:
    """Write every file of the save under its staging name, flushed to disk; `files` and `drop` get the names
    the commit record will list."""
    first: str | None = None
    for stem, sidecar in sidecars.items():
        step = str(sidecar.get("training", {}).get("step", ""))
        weights, optim, meta = (out_dir / f"{stem}{suffix}" for suffix in SUFFIXES)
        if first is None:
            _write_weights(_staged(weights), tensors, {"format": "pt", "aliases": json.dumps(aliases), "step": step})
            if resume_state is not None:
                _write_resume_state(_staged(optim), resume_state)
            first = stem
        else:  # the same bytes (the step is in the header): copy rather than serialize again; not a hard
            # link, which `cp other.safetensors best.safetensors` (writing in place) would change under last.*
            shutil.copyfile(_staged(out_dir / f"{first}.safetensors"), _staged(weights))
            if resume_state is not None:
                shutil.copyfile(_staged(out_dir / f"{first}.optim.pt"), _staged(optim))
        _write_text(_staged(meta), json.dumps(sidecar, indent=1, default=str))
        files += [weights.name, meta.name]
        (files if resume_state is not None else drop).append(optim.name)
    for name in files:
        _fsync(_staged(out_dir / name))
    _fsync(out_dir)


def save_checkpoint(out_dir: Path, stem: str, model: nn.Module, sidecar: dict[str, Any],
                    resume_state: dict[str, Any] | None = None) -> Path:
    """Save one stem (see `save_checkpoints`); returns the path of its weights."""
    save_checkpoints(out_dir, model, {stem: sidecar}, resume_state)
    return out_dir / f"{stem}.safetensors"


def checkpoint_paths(path_or_dir: str | Path, which: str) -> tuple[Path, Path]:
    """The weights and sidecar named by a directory (its `which`, else `last`), a .safetensors or a .json."""
    if which not in ("best", "last"):
        raise ValueError(f"which must be \"best\" or \"last\" (a run directory's two checkpoints), got {which!r}")
    if not isinstance(path_or_dir, str | os.PathLike):
        raise DataError(f"a checkpoint is a path (a run directory or a .safetensors file), not "
                        f"{type(path_or_dir).__name__}")
    if str(path_or_dir) == "":  # Path("") is the working directory
        raise DataError("the checkpoint path is empty", hint="give a run directory or a .safetensors file")
    path = Path(path_or_dir).expanduser()
    if path.is_dir() and path.suffix in (".safetensors", ".json"):  # it read "no checkpoint in c/last.safetensors"
        raise DataError(f"{path} is a directory, not a checkpoint file",
                        hint="a run directory keeps last.safetensors and best.safetensors as files")
    if path.is_dir():
        weights = path / f"{which}.safetensors"
        if checkpoint_file(weights) is None and which == "best":
            weights = path / "last.safetensors"
        if checkpoint_file(weights) is None:
            best = path / "best.energy"  # a search's folder: it keeps the best candidate's spec, not weights
            raise DataError(f"no checkpoint in {path} (expected {which}.safetensors)",
                            hint=f"a search keeps no weights: `energy train {best}` trains its best candidate"
                            if best.is_file() else "point at a training output directory or a .safetensors file")
    elif path.suffix == ".json":
        weights = path.with_suffix(".safetensors")
    else:
        weights = path
    if weights.is_dir() or checkpoint_file(weights) is None:
        raise DataError(f"checkpoint not found: {weights}")
    return weights, weights.with_suffix(".json")


def _read(path: Path, read: Callable[[Path], Any]) -> Any:
    """`read` the committed version of `path`, again if a save in another process moved it meanwhile."""
    for attempt in range(3):
        found = checkpoint_file(path)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
        try:
            return read(found)
        except FileNotFoundError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _read_weights(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    with open(path, "rb"):  # safetensors says "No such file" of a file it may not read; open says why
        pass
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}


def _safetensors_header(path: Path) -> bool:
    """Does the file open as safetensors does: an 8-byte little-endian length of a JSON header (safetensors caps it
    at 100 MB), then `{`? A damaged or cut checkpoint does; a spec, an optimizer state or a text does not."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return True  # then its read error is the message
    return len(head) == 9 and int.from_bytes(head[:8], "little") <= 100_000_000 and head[8:9] == b"{"


def read_checkpoint(path_or_dir: str | Path, *, which: str = "best"
                    ) -> tuple[dict[str, Tensor], dict[str, Any], dict[str, str]]:
    """`load_checkpoint`, plus the weights' header (its `step` says which save the weights are from)."""
    weights, sidecar = checkpoint_paths(path_or_dir, which)
    try:
        state, header = _read(weights, _read_weights)
    except OSError as e:
        raise DataError(f"cannot read checkpoint {weights}: {e.strerror}") from None
    except Exception as e:  # safetensors raises its own error types for corrupt files
        if not _safetensors_header(weights):  # a spec, an optimizer state, a text: another kind of file
            hint = f"train it first: `energy train {weights}`" if weights.suffix == ".energy" else \
                "give a run directory of `energy train` or its best.safetensors / last.safetensors"
            raise DataError(f"{weights} is not a safetensors checkpoint", hint=hint) from None
        raise DataError(f"cannot read checkpoint {weights}: {e}") from e
    damaged = _nonfinite(state)
    if damaged:  # saves never hold a diverged state: NaN or inf in the weights means damaged bytes
        shown = first_few(damaged, 3)
        other = weights.with_name(f"{ {'last': 'best', 'best': 'last'}.get(weights.stem)}.safetensors")
        hint = (f"use the run's other checkpoint, {other}, if it is intact, or train again"
                if weights.stem in ("best", "last") and checkpoint_file(other) is not None
                else "use another checkpoint, or train again")
        raise DataError(f"checkpoint {weights} is damaged: its weights hold NaN or infinite values ({shown})",
                        hint=hint)
    try:
        for alias, target in json.loads(header.get("aliases", "{}")).items():
            state[alias] = state[target]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DataError(f"checkpoint {weights} is damaged: its header's aliases name tensors it does not hold "
                        f"({type(e).__name__}: {e})") from None
    metadata: dict[str, Any] = {}
    if checkpoint_file(sidecar) is not None:
        try:
            metadata = _read(sidecar, lambda p: json.loads(p.read_text()))
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read checkpoint metadata {sidecar}: {e}") from e
        if not isinstance(metadata, dict) or not isinstance(metadata.get("training", {}), dict):
            held = metadata.get("training") if isinstance(metadata, dict) else metadata
            raise DataError(f"checkpoint metadata {sidecar} is damaged: it is not the JSON object a save writes "
                            f"({'its training record is' if held is not metadata else 'it holds'} a "
                            f"{type(held).__name__})")
    return state, metadata, header


def _nonfinite(value: Any, where: str = "") -> list[str]:
    """Where nested dicts and lists hold a floating tensor with NaN or infinite values."""
    if isinstance(value, Tensor):
        return [where or "a tensor"] if value.is_floating_point() and not bool(torch.isfinite(value).all()) else []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list | tuple) else ()
    return [hit for key, v in items for hit in _nonfinite(v, f"{where}.{key}" if where else str(key))]


def read_resume_state(path: Path) -> dict[str, Any]:
    """The committed `<stem>.optim.pt` at `path` (optimizer, scaler and RNG states)."""
    try:
        state = _read(path, lambda p: torch.load(p, map_location="cpu", weights_only=True))
    except FileNotFoundError:
        raise DataError(f"checkpoint {path} is missing") from None
    except Exception as e:  # noqa: BLE001 - pickle's and the zip reader's errors on damaged bytes are many
        # torch's own text for a damaged file explains weights_only loading, which is beside the point here
        raise DataError(f"checkpoint {path} is damaged: it is not an optimizer state PyTorch can read "
                        f"({type(e).__name__})") from e
    damaged = _nonfinite(state)
    if damaged:  # as for the weights: a save never holds a diverged state
        raise DataError(f"checkpoint {path} is damaged: its optimizer state holds NaN or infinite values "
                        f"({', '.join(damaged[:3])}{' and more' if len(damaged) > 3 else ''})")
    return state


def load_checkpoint(
    path_or_dir: str | Path, *, which: str = "best"
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Read a checkpoint's weights (a full state dict, aliases restored) and its metadata.

    `path_or_dir` is an output directory (its `best`, else `last`, checkpoint; `which` picks), a
    `.safetensors` file or its `.json` sidecar. The metadata is the sidecar: the dict the trainer's
    caller gave, plus `training` (step, losses, config, dataset). Tensors load on the CPU. Weights with NaN or
    infinite values are a `DataError` naming the file: a save never holds a diverged state, so its bytes were
    damaged (`read_resume_state` checks the optimizer state the same way).
    """
    state, metadata, _ = read_checkpoint(path_or_dir, which=which)
    return state, metadata

"""Tuning that outlives the process: the autotuners' chosen tiles and the attention backward's mode, on disk.

Autotuning times every config of a kernel on the first call of each tuning key, and the softmax family's
backward times its two modes on the first call of each shape (`AttentionOps._fuse_dq`). Kept in memory only,
every new process pays this again: each restarted training run and every search trial. Kept on disk, a
process finds what an earlier one measured on the same kind of device:

* the autotuners' choices go to Triton's own cache (`$TRITON_CACHE_DIR`, else ~/.triton/cache), through
  `triton.autotune(cache_results=True)`: keyed by Triton's version, the device's architecture, the kernel's
  source, the tuning key and the config list;
* the backward's mode goes to `<energydsl cache>/tuning/` (`$ENERGYDSL_CACHE`, else
  ~/.cache/energydsl/codegen), one small JSON file per choice, keyed by the device's name, the torch and
  Triton versions, the kernels' source, their configs and the shape key.

`ENERGYDSL_TUNING_CACHE=off` (or empty) keeps both in memory (the autotuners' setting is read when a kernel
module is imported); a path puts the backward's choices there instead. A file that cannot be read or written is
ignored: the choice is then timed again, never wrong.
"""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path
from typing import Any

from ..files import cache_setting, read_record, write_record

__all__ = ["autotune_options", "cache_dir", "digest", "load", "store"]

FORMAT = 1


def cache_dir() -> Path | None:
    """Where the backward's choices are kept; None when `ENERGYDSL_TUNING_CACHE` is `off` (or empty)."""
    return cache_setting("ENERGYDSL_TUNING_CACHE", "tuning")


def autotune_options() -> dict[str, Any]:
    """Extra `triton.autotune` arguments: its disk cache, where this Triton has one (3.2 on) and it is on."""
    import triton

    if cache_dir() is None or "cache_results" not in inspect.signature(triton.autotune).parameters:
        return {}
    return {"cache_results": True}


def digest(*parts: object) -> str:
    """A file name for a record identified by `parts` (their reprs, which must not change across processes)."""
    return hashlib.sha256(repr((FORMAT, *parts)).encode()).hexdigest()[:32]


def load(name: str) -> dict[str, Any] | None:
    """The record stored under `name`, or None (absent, unreadable, another format, or the cache is off)."""
    where = cache_dir()
    return None if where is None else read_record(where / f"{name}.json", FORMAT)


def store(name: str, record: dict[str, Any]) -> None:
    """Write `record` under `name`, whole or not at all (`files.write_record`)."""
    where = cache_dir()
    if where is not None:
        write_record(where / f"{name}.json", {"format": FORMAT, **record})

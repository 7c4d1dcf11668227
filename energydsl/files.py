"""Small helpers for the files the commands write."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from .errors import UserError

PATH_LIMITS = "a file or folder name holds at most 255 bytes, a whole path 4096"  # hint for ENAMETOOLONG


def new_file_mode() -> int:
    """The mode open() gives a new file: 0o666 less the umask. A file written through a private temporary one
    (mkstemp, safetensors: 0600) and renamed gets this mode, as any file the user writes.

    Linux reports the umask in /proc; elsewhere it can only be read by setting it and back (which another
    thread creating a file in between would see)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def make_dirs(path: Path) -> None:
    """`path.mkdir(parents=True, exist_ok=True)`, except that an ancestor which is a file is named: mkdir says
    "File exists" there (errno EEXIST, strerror only), which reads as if `path` itself existed."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if blocking is None:
            raise
        raise NotADirectoryError(errno.ENOTDIR, f"{blocking} is a file, not a directory", str(blocking)) from None


def read_record(path: Path, format: int) -> dict[str, Any] | None:
    """A cache's JSON record written by `write_record`, or None: missing, unreadable, or of another format."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == format else None


def write_whole(path: Path, text: str, *, quiet: bool = True) -> None:
    """Write a cache file whole or not at all (renamed into place: a reader in another process never sees half
    of it). A cache that cannot be written is only slower, so a failure is ignored, unless not `quiet` (then
    the OSError is raised, no half-written file left)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        make_dirs(path.parent)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if not quiet:
            raise


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Write a cache's JSON record with `write_whole`; `read_record` reads it back."""
    write_whole(path, json.dumps(record))


_OFF = ("", "0", "off", "no", "false", "none")


def cache_setting(env: str, default_subdir: str) -> Path | None:
    """A cache's directory: the path in `$env`, None when that says off (`off`, `0`, `no`, `false`, `none`
    or empty), else `default_subdir` under the code generator's cache (`$ENERGYDSL_CACHE`)."""
    value = os.environ.get(env)
    if value is not None:
        return None if value.strip().lower() in _OFF else Path(value)
    from .codegen import cache_dir

    return cache_dir() / default_subdir


def _same_file(a: Path, b: Path) -> bool:
    """One file under two names: a hard link (`ln spec.energy out.py`) resolves to another path."""
    try:
        return b.is_file() and os.path.samefile(a, b)
    except OSError:
        return False


def _resolved(path: str | os.PathLike[str], what: str) -> Path:
    """`path` with its links followed; a loop of links is refused, naming `what` (it was exit 70)."""
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError) as e:  # a loop: RuntimeError before Python 3.13, then ELOOP
        if isinstance(e, OSError) and e.errno != errno.ELOOP:
            raise
        raise UserError(f"{what} {path} is a loop of symbolic links", hint="check the path") from None


def not_an_input(path: str | os.PathLike[str], what: str, inputs: list[tuple[str, Path | None]],
                 example: str | None = None) -> None:
    """Refuse an output path that is one of the command's inputs, given as (description, path) pairs: writing
    there replaced the input (a spec, its import, a study's storage, a search space) without a word."""
    target = _resolved(path, what)
    for description, source in inputs:
        if source is not None and source.is_file() and (source.resolve() == target or _same_file(source, target)):
            raise UserError(f"{what} {path} is {description}: writing there would replace it",
                            hint=f"give another file, e.g. {example}" if example else "give another file")


def apart(first: str | os.PathLike[str], first_what: str, second: str | os.PathLike[str], second_what: str) -> None:
    """Refuse two outputs of one command at one file (`--export` at the report's path): the later write replaced
    the earlier without a word."""
    a, b = Path(first), Path(second)
    if _resolved(a, first_what) == _resolved(b, second_what) or (a.is_file() and b.is_file() and _same_file(a, b)):
        raise UserError(f"{second_what} {second} is also {first_what}: the one would replace the other",
                        hint="give each its own file")


def check_output(path: str | os.PathLike[str], what: str = "output", example: str = "report.html") -> Path:
    """Fail now, naming `what` (e.g. `--report`), if a file cannot be written at `path`: it is a directory,
    or its folder cannot be created or written. Call it before the work whose result goes there; the folders it
    made to find out are removed again (`write_atomic` makes them)."""
    p = Path(path)
    if str(path) == "":
        raise UserError(f"{what} is empty", hint=f"give a file name, e.g. {example}")
    _resolved(p, what)
    if p.is_dir() or str(path).endswith(os.sep):  # `out.py/` names a folder, which pathlib's Path drops
        raise UserError(f"{what} {str(path)!r} is a directory, not a file",
                        hint=f"give a file name, e.g. {p / example}")
    if p.exists() and not p.is_file():  # writing to a pipe blocks until someone reads it
        raise UserError(f"{what} {path} is not a regular file (a device, pipe or socket)",
                        hint="give the path of a file to write")
    made = [a for a in (p.parent.absolute(), *p.parent.absolute().parents) if not a.exists()]  # deepest first
    try:
        make_dirs(p.parent)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        reason = e.strerror or str(e)
        if e.errno == errno.ENOENT and p.parent.is_dir():  # /proc: the folder is there but takes no new files
            reason = f"the folder {p.parent} takes no new files"
        raise UserError(f"{what} {path}: cannot write a file there ({reason})",
                        hint="give a path in a directory you can write to") from None
    finally:
        for folder in made:  # the work may still fail: leave no empty folders behind (the writer makes them)
            with contextlib.suppress(OSError):
                folder.rmdir()
    return p


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write a user's output file (text, or bytes as they are) whole or not at all (renamed into place over any old
    one), making its folders; a failure is a UserError naming the path."""
    try:
        make_dirs(path.parent)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        os.fchmod(fd, new_file_mode())  # mkstemp makes 0600: give the file the mode open() would
        with os.fdopen(fd, "wb") if isinstance(text, bytes) else os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise UserError(f"cannot write {path}: {e.strerror or e}") from None
        raise


def writable_dir(path: Path, flag: str, *, keep: bool = True) -> None:
    """Create `path` as a directory we can write into, or say why not (before any work is done); `flag` names
    the setting that gave it (`--out`). `keep=False` only finds out: the folders made to do so are removed again
    (a command refused later, for its data say, leaves no empty tree behind; the work makes them)."""
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file, not a directory", hint=f"choose another {flag}")
    made = [] if keep else [a for a in (path.absolute(), *path.absolute().parents) if not a.exists()]
    try:
        make_dirs(path)
        if not os.access(path, os.W_OK | os.X_OK):
            raise UserError(f"cannot write into {flag} {path}: permission denied")
    except OSError as e:
        raise UserError(f"cannot create {flag} {path}: {e.strerror}") from None
    finally:
        for folder in made:  # deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()


def read_text(path: str | os.PathLike[str]) -> str:
    """A file's text, or a UserError that names it and says why it cannot be read."""
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None

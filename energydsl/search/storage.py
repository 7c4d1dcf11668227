"""Where a study is stored: the storage string a user gives (a journal file or a database URL), checked, and
opened as an Optuna storage.

A wrong string is refused before anything is written, with the form that was probably meant: an empty one, a
URL missing the `//` after its scheme, an in-memory SQLite database, a folder, a file that is not a journal.
The file locks that commands on one host share a storage by live here too.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage
from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock, JournalStorage

from energydsl.errors import UserError
from energydsl.files import make_dirs


def safe_name(name: str) -> str:
    """A study's name as a file or folder name: runs of other characters become `_`."""
    return re.sub(r"[^\w.-]+", "_", name).strip("._") or "study"


def file_tag(name: str) -> str:
    """A study's own part of a file name: `safe_name`, with a hash of the name where that changed it, so that
    `x y` and `x_y` (one file name, two studies) do not share a report, a best candidate or a lock."""
    safe = safe_name(name)
    return safe if safe == name else f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def default_storage_path(study_name: str) -> str:
    """Where a study lives when no --storage is given: a journal file any local process can append to."""
    return os.path.join("runs", safe_name(study_name), "optuna.journal")


def local_file(spec: str) -> Path | None:
    """The file on this machine a storage lives in (a journal, or an SQLite database, with or without a driver:
    `sqlite:///s.db`, `sqlite+pysqlite:///s.db`), else None."""
    if "://" not in spec:
        return Path(spec)
    rest = _sqlite_rest(spec)
    if rest is None or not rest.startswith("/"):
        return None
    path = rest[1:].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def study_dir(spec: str, study_name: str) -> Path:
    """Where a study's files go (the report, the best candidate, Ray's trial folders): beside its storage file
    (a journal or an SQLite database), else runs/STUDY for a server."""
    local = local_file(spec)
    return local.parent if local is not None else Path("runs") / safe_name(study_name)


def study_outputs(spec: str, study_name: str) -> tuple[Path, Path]:
    """The default report and best-candidate files of a study, in `study_dir`: `report.html` and `best.energy`,
    or, in a storage that holds other studies as well, `report-STUDY.html` and `best-STUDY.energy`, so that the
    studies of one database do not overwrite each other's."""
    import optuna

    where = study_dir(spec, study_name).absolute()  # as a journal's: a sqlite URL's folder was relative
    shared = len(optuna.get_all_study_names(storage=open_storage(spec))) > 1
    tag = f"-{file_tag(study_name)}" if shared else ""
    return where / f"report{tag}.html", where / f"best{tag}.energy"


def _dialect(scheme: str) -> str:
    """A URL scheme's SQLAlchemy dialect: `sqlite+pysqlite` -> `sqlite`, in lower case."""
    return scheme.split("+")[0].lower()


def _sqlite_rest(spec: str) -> str | None:
    """What follows `://` in an SQLite URL (any driver, any case), else None."""
    scheme, sep, rest = spec.partition("://")
    return rest if sep and _dialect(scheme) == "sqlite" else None


def _check_journal(path: Path) -> None:
    """Refuse, before Optuna opens (or appends to) it, a path that is not a journal file or cannot become one."""
    hint = "give the journal of an earlier search, or a new file name (e.g. runs/NAME/optuna.journal)"
    if path.is_dir():
        raise UserError(f"storage {path} is a directory, not an Optuna journal file",
                        hint=f"give a file in it, e.g. {path / 'optuna.journal'}")
    if not path.exists():
        return
    if not path.is_file():
        raise UserError(f"storage {path} is not a regular file, so not an Optuna journal", hint=hint)
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError as e:
        raise UserError(f"cannot read the storage {path}: {e.strerror or e}") from None
    if not head:
        return  # an empty journal: Optuna creates one so
    first, newline, _ = head.partition(b"\n")
    if newline:
        try:
            record = json.loads(first)
        except ValueError:
            record = None
        ok = isinstance(record, dict) and "op_code" in record
    else:  # a first line still being written
        ok = head.startswith(b'{"op_code"')
    if not ok:
        raise UserError(f"storage {path} is not an Optuna journal file (it does not start with a journal record)",
                        hint=hint)


# what a URL's scheme looks like (RFC 3986); two letters at least, so that a Windows drive (C:) is a path
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):")
# SQLAlchemy's dialects (the part of a scheme before `+driver`): `NAME:anything` without `//` is a mistyped URL
_DIALECTS = frozenset({"sqlite", "postgresql", "postgres", "mysql", "mariadb", "oracle", "mssql", "cockroachdb"})


def slashless_url(spec: str) -> str | None:
    """The scheme of a storage URL written without the `//` after it (`sqlite:/x.db`, `postgresql:host/db`), which
    would otherwise be taken as a journal path (a folder named `sqlite:`), else None. A path that means it
    starts with `./`."""
    m = _SCHEME.match(spec)
    if m is None or "://" in spec:
        return None
    scheme = m.group(1)
    rest = spec[m.end():]
    return scheme if rest.startswith("/") or _dialect(scheme) in _DIALECTS else None


def _in_memory_sqlite(spec: str) -> bool:
    """`sqlite://`, `sqlite:///:memory:`: a database each connection sees empty (the engine opens several)."""
    rest = _sqlite_rest(spec)
    return rest is not None and rest.split("?", 1)[0].removeprefix("/") in ("", ":memory:")


def check_storage_given(spec: str) -> None:
    """Refuse a storage string that cannot be the storage meant (checked before a search starts, and when a
    storage is opened): an empty one; a URL missing the `//` after its scheme (`sqlite:/x.db` would be a journal
    file in a folder named `sqlite:`); an in-memory SQLite database (the search's processes, its report and a
    rerun would each see an empty one)."""
    if not spec.strip():
        raise UserError("the storage is empty",
                        hint="give a journal file (e.g. runs/NAME/optuna.journal) or a URL such as sqlite:///s.db")
    scheme = slashless_url(spec)
    if scheme is not None:
        rest = spec[len(scheme) + 1:]
        if _dialect(scheme) == "sqlite":
            path = rest.lstrip("/") or "NAME.db"
            form = (f"an SQLite URL is {scheme}:/// and the file's path: {scheme}:///{path} for {path} in the "
                    f"working directory, {scheme}:////{path} for /{path}")
        else:
            form = f"a database URL is {scheme}://USER:PASSWORD@HOST/DATABASE"
        folder, slash, _ = spec.partition("/")
        as_path = f"a journal file in a folder named `{folder}`" if slash else "a journal file of that name"
        raise UserError(f"storage {spec!r} looks like a URL without the `//` after `{scheme}:` (as a path, it would be "
                        f"{as_path})", hint=f"{form}; for a journal file whose path starts so, write ./{spec}")
    if _in_memory_sqlite(spec):
        raise UserError(f"storage {spec!r} is an in-memory SQLite database: every connection to it sees an empty "
                        "one, so the search's trials, its report and a rerun could not share the study",
                        hint="give a database file (e.g. sqlite:///runs/NAME.db) or a journal file")


def _clear_dangling_lock(path: Path) -> None:
    """Remove Optuna's journal lock (`JOURNAL.lock`, a symlink to the journal) when it points nowhere: left by a
    process killed while appending, from a folder since moved (or by a version that linked a relative path).
    Optuna's grace period never frees such a lock (it stats the link's target) and spins on it for ever."""
    lock = Path(f"{path}.lock")
    if lock.is_symlink() and not lock.exists():
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
        print(f"note: removed a stale lock of the journal, {lock} (left by a search killed while writing)",
              file=sys.stderr)


def _mend_torn_record(path: Path) -> None:
    """Move a last record that a write left cut short (a full disk, a kill mid-append) or damaged (a line that is
    not JSON) to `JOURNAL.torn`, under the journal's lock. Optuna reads past such a tail, but its next append
    would follow it and leave a record that is not JSON in the middle of the journal, which no later read gets
    past (a search would stop at its next read)."""
    if not path.is_file():
        return
    with open(path, "rb") as f:  # the common case, a whole last record, without the lock
        if _bad_tail(f) is None:
            return
    lock = JournalFileSymlinkLock(os.path.abspath(path))  # as the backend's (see open_storage)
    lock.acquire()
    try:  # under the lock no one is appending, so a tail without its newline is torn, not being written
        with open(path, "r+b") as f:
            bad = _bad_tail(f)
            if bad is None:
                return
            keep, tail = bad
            with open(f"{path}.torn", "ab") as torn:
                torn.write(tail if tail.endswith(b"\n") else tail + b"\n")
            f.truncate(keep)
    finally:
        lock.release()
    what = "a record cut short" if not tail.endswith(b"\n") else "a record that is not JSON"
    print(f"note: {path} ended in {what} ({len(tail)} bytes, a write that did not finish); moved it to "
          f"{path}.torn, the records before it are whole", file=sys.stderr)


def _bad_tail(f: Any) -> tuple[int, bytes] | None:
    """(where it starts, its bytes) of a journal's last record if it has no newline or is not JSON, else None."""
    size = f.seek(0, os.SEEK_END)
    if size == 0:
        return None
    f.seek(size - 1)
    whole = f.read(1) == b"\n"
    end, keep = size - 1 if whole else size, 0
    while end > 0:  # keep: just after the newline before the last record, looked for block by block from the end
        start = max(0, end - (1 << 16))
        f.seek(start)
        cut = f.read(end - start).rfind(b"\n")
        if cut >= 0:
            keep = start + cut + 1
            break
        end = start
    f.seek(keep)
    tail = f.read()
    if whole:
        try:
            json.loads(tail)
            return None
        except ValueError:  # JSONDecodeError, UnicodeDecodeError
            pass
    return keep, tail


class _JournalFile(JournalFileBackend):
    """Optuna's journal file, whose failed appends name it: a full disk fails in write() or fsync(), whose
    OSError carries no file name, so the message would not say which file could not be written."""

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        try:
            super().append_logs(logs)
        except OSError as e:
            if e.filename is None:
                e.filename = self._file_path
            raise


def open_storage(spec: str, append: bool = False) -> BaseStorage:
    """An Optuna storage from a URL (sqlite:///..., postgresql://...) or a journal file path. With `append`
    (a search, which writes), a journal's stale lock is cleared and a record cut short at its end set aside.

    Raises UserError, naming the path, for an empty spec, a URL without its `//` or an in-memory SQLite one
    (`check_storage_given`), a directory, a file that is not an Optuna journal (never appended to), or a
    journal that cannot be read or created."""
    check_storage_given(spec)
    if "://" in spec:
        kwargs: dict[str, Any] = {}
        if _sqlite_rest(spec) is not None:  # several processes write: wait for the lock instead of failing
            kwargs["engine_kwargs"] = {"connect_args": {"timeout": 120}}
        try:
            if not append:
                _check_has_studies(spec, kwargs.get("engine_kwargs", {}))
            return optuna.storages.RDBStorage(spec, **kwargs)
        except UserError:
            raise
        except Exception as e:  # bad URL, missing driver, unreachable server
            raise _storage_error(spec, e) from e
    path = Path(spec)
    _check_journal(path)
    try:
        make_dirs(path.parent)
        if append:
            _clear_dangling_lock(path)
            _mend_torn_record(path)
        # absolute: Optuna's lock is a symlink to this path, and a relative one would point nowhere from the
        # journal's folder, so a stale lock's grace period (which stats the target) would never run out
        backend = _JournalFile(os.path.abspath(path))
    except OSError as e:
        raise UserError(f"cannot create the storage {path}: {e.strerror or e}",
                        hint="give a journal path in a directory you can write to") from None
    try:
        return JournalStorage(backend)
    except (ValueError, KeyError, TypeError, AttributeError, AssertionError) as e:  # damaged: JSON, fields, op code
        line = _first_line_not_json(path)
        where = f"line {line} is not a JSON record" if line else f"{type(e).__name__}: {e}"
        raise UserError(f"storage {path} is not a readable Optuna journal ({where})",
                        hint="a journal is only ever appended to; if a line was damaged, the records after it "
                             "cannot be read in order: restore a copy, or start another study (--storage)") from None


def _check_has_studies(spec: str, engine_kwargs: dict[str, Any]) -> None:
    """Refuse a database without Optuna's tables before `RDBStorage` creates them: a report pointed at another
    program's database (or an empty file) added a dozen tables to it."""
    import sqlalchemy

    local = local_file(spec)
    if local is not None and local.is_dir():
        raise UserError(f"storage {spec} names a directory ({local.resolve()}), not an SQLite database file")
    if local is not None and not local.is_file():  # connecting would create it
        raise UserError(f"no study storage at {spec} (no file {local.resolve()})", hint=NO_STUDIES_HINT)
    engine = sqlalchemy.create_engine(spec, **engine_kwargs)
    try:
        tables = sqlalchemy.inspect(engine).get_table_names()
    finally:
        engine.dispose()
    if "studies" not in tables:
        where = spec if local is None else f"{spec} (the file {local.resolve()})"
        raise UserError(f"the storage {where} holds no studies: it has no Optuna tables", hint=NO_STUDIES_HINT)


# the DB-API modules SQLAlchemy imports for a URL's dialect, and the PyPI package that provides each
_DRIVERS = {"MySQLdb": "mysqlclient", "pymysql": "PyMySQL", "psycopg2": "psycopg2-binary", "psycopg": "psycopg",
            "pg8000": "pg8000", "mysql": "mysql-connector-python"}


def _storage_error(spec: str, e: Exception) -> UserError:
    """What went wrong opening a database storage, in the database's words: the driver module that is missing
    (and its package), or the DB-API error SQLAlchemy wraps (`file is not a database`), without the SQL
    statement and link SQLAlchemy appends."""
    missing = e.__cause__ or e.__context__
    if isinstance(e, ImportError) and isinstance(missing, ModuleNotFoundError) and missing.name:
        module = missing.name.split(".")[0]
        package = _DRIVERS.get(module, module)
        return UserError(f"cannot open storage {spec!r}: its database driver, the Python module `{module}`, is not "
                         "installed", hint=f"pip install {package}; or use a journal file (--storage PATH)")
    said = str(getattr(e, "orig", None) or e).split("\n")[0]
    return UserError(f"cannot open storage {spec!r}: {said}",
                     hint="check the URL, that the database server is up, and that a sqlite file is a database")


def _first_line_not_json(path: Path) -> int | None:
    """The number of a journal's first line (from 1) that is not JSON, to name it in the error; None if all are."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                json.loads(line)
            except ValueError:
                return number
    return None


NO_STUDIES_HINT = ("a search writes its study there first (energy search SPACE --storage ...); without --storage a "
                   "study is runs/STUDY/optuna.journal")


def load_study(storage: str | BaseStorage, study_name: str) -> optuna.Study:
    """Open an existing study, with a readable error listing the names that do exist."""
    if isinstance(storage, str) and "://" not in storage and not Path(storage).exists():
        raise UserError(f"no study storage at {storage}")  # checked first: opening a journal creates it
    st = open_storage(storage) if isinstance(storage, str) else storage
    try:
        return optuna.load_study(study_name=study_name, storage=st)
    except KeyError as e:
        names = optuna.get_all_study_names(st)
        if not names:
            raise UserError(f"no study {study_name!r} in {storage}: it holds no studies",
                            hint=NO_STUDIES_HINT) from None
        raise UserError(f"no study {study_name!r} in {storage}; studies there: {names}",
                        hint="name one of them (energy report: STUDY, or --study NAME)") from e


# ----------------------------------------------------------------------------- locks between commands on this host


def _lock_dir(storage_spec: str) -> Path:
    """Where a storage's locks live: next to its journal or SQLite database, whatever the working directory;
    for a database server, in a per-user folder of the temp directory named by the URL's hash."""
    local = local_file(storage_spec)
    if local is not None:
        return local.resolve().parent
    key = hashlib.sha256(storage_spec.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"energydsl-locks-{os.getuid()}" / key


def lock_path(storage_spec: str, study_name: str) -> Path:
    """The lock file of a study (see `_lock_dir`)."""
    return _lock_dir(storage_spec) / f".{file_tag(study_name)}.lock"


@contextlib.contextmanager
def _flock(path: Path, what: str) -> Iterator[None]:
    try:
        make_dirs(path.parent)
        f = open(path, "a")  # noqa: SIM115 (closed below)
    except OSError as e:
        raise UserError(f"cannot create {what} lock file {path}: {e.strerror or e}") from None
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def study_lock(storage_spec: str, study_name: str) -> Iterator[None]:
    """Serialize budget bookkeeping between commands on this host (a file lock, see `lock_path`)."""
    with _flock(lock_path(storage_spec, study_name), "the study's"):
        yield


@contextlib.contextmanager
def storage_lock(storage_spec: str) -> Iterator[None]:
    """Serialize opening a database storage between commands on this host: Optuna creates a new database's
    tables without a transaction, and two commands creating it at once fail (`table studies already exists`,
    `UNIQUE constraint failed: alembic_version.version_num`). Journal files need no lock (appends)."""
    if "://" not in storage_spec:
        yield
        return
    with _flock(_lock_dir(storage_spec) / ".storage.lock", "the storage's"):
        yield

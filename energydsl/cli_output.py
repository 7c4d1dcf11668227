"""How the `energy` CLI writes to the terminal: one-line warnings, usage errors as every other error reads,
and stderr or stdout whose reader went away (`energy derive x | head`)."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

_PACKAGE = str(Path(__file__).resolve().parent)
_SHOWN: set[str] = set()


def warning_line(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
    """energydsl's own warnings as one `warning: ...` line, each once (Python's format quotes our source line);
    other libraries' as Python shows them."""
    if not str(filename).startswith(_PACKAGE):
        return _SHOW_WARNING(message, category, filename, lineno, file, line)
    text = f"warning: {message}"
    if text not in _SHOWN:
        _SHOWN.add(text)
        to_stderr(text)


_SHOW_WARNING = warnings.showwarning


def usage_error(e: Exception, argv: list[str] | None = None) -> str:
    """A flag or argument click refused (unknown, missing, not a number) as `error: ...` with a hint naming the
    command's --help. An option missing its value comes without a context (click's parser raises it): the
    command is then the first word of `argv`."""
    message = e.format_message()  # type: ignore[attr-defined]
    ctx = getattr(e, "ctx", None)
    if ctx is None and argv and argv[0].isidentifier():
        command, lists = f"energy {argv[0]}", "its options and arguments"
    else:
        command = ctx.command_path if ctx is not None else "energy"
        lists = "the commands" if ctx is None or ctx.parent is None else "its options and arguments"
    message = message[:1].lower() + message[1:].rstrip(".")
    return f"error: {message}\nhint: `{command} --help` lists {lists}"


BROKEN_PIPE = 128 + 13  # 141: as a shell reports a command that SIGPIPE stopped (`energy derive x | head`)


def closed_streams_to_devnull() -> None:
    """With stderr or stdout closed (`energy check x 2>&-`) Python sets it to None, and `print(file=None)` writes
    to stdout instead: messages go where they are dropped, and the command's own exit status stands."""
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 -- open for the life of the process


def to_stderr(text: str) -> None:
    """Print a message to stderr; if its reader went away (`energy check x 2>&1 | true`), drop it and let the
    command's own exit status stand, instead of a traceback that exits 1."""
    try:
        if text:
            print(text, file=sys.stderr)
        sys.stderr.flush()
    except BrokenPipeError:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
        except (OSError, ValueError):
            pass


def broken_pipe() -> None:
    """The reader of stdout went away: exit quietly with BROKEN_PIPE. What is still buffered for stdout goes
    to /dev/null (Python's flush at exit would meet the broken pipe again and print a warning)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is no file (a test's capture, or already closed)
        pass
    sys.exit(BROKEN_PIPE)

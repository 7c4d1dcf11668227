"""Signal handlers swapped for a while and always given back (training's Ctrl-C, a search's SIGTERM, Ray's
handlers), so that what runs next in the process gets its own handlers."""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

Handler = Callable[[int, Any], Any] | int


@contextlib.contextmanager
def handlers_restored(*signums: int) -> Iterator[dict[int, Handler] | None]:
    """Yields the current handlers of `signums`, and sets them back on the way out, whatever was installed
    meanwhile. Yields None outside the main thread: Python delivers signals to it only, and elsewhere no
    handler can be set. A handler installed from C (`getsignal` gives None) comes back as the default."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    previous: dict[int, Handler] = {}
    for s in signums:
        handler = signal.getsignal(s)
        if handler is None:
            handler = signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL
        previous[s] = handler
    try:
        yield previous
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def interruptions_held() -> Iterator[None]:
    """A short bookkeeping step that a quick second Ctrl-C must not cut halfway, such as handing an interrupted
    trial back (a second Ctrl-C there left it RUNNING, to be found lost on the next run). Inside, one Ctrl-C is
    absorbed and the next stops it after all (the step may hang on a storage), and SIGTERM is ignored. Only
    the main thread can hold them; elsewhere this does nothing."""
    absorbed, holding = 0, True

    def absorb_one(signum: int, frame: Any) -> None:
        nonlocal absorbed
        absorbed += 1
        if absorbed > 1 and holding:  # not while the handlers are being given back: both must be
            raise KeyboardInterrupt

    with handlers_restored(signal.SIGINT, signal.SIGTERM) as previous:
        if previous is not None:
            signal.signal(signal.SIGINT, absorb_one)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            yield
        finally:
            holding = False


class Terminated(KeyboardInterrupt):
    """SIGTERM handled as Ctrl-C is: a search's driver hands its running trials back as interrupted (a retry not
    held against them), and `energy train` stopped before its loop says what its run directory keeps."""


def _terminated(signum: int, frame: Any) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Inside, SIGTERM raises `Terminated` (main thread only; Python delivers signals there, and elsewhere the
    handler cannot be set). The previous handler comes back afterwards."""
    with handlers_restored(signal.SIGTERM) as previous:
        if previous is not None:
            signal.signal(signal.SIGTERM, _terminated)
        yield


class CtrlC:
    """The `energy` command's SIGINT handler: KeyboardInterrupt, as Python's own, except while another package
    is being imported.

    A Ctrl-C in `import torch` was lost or fatal: torch clears an exception raised while it loads NumPy (the
    command then ran to its end and exited 0), and one raised in a pybind11 callback aborts the process. While
    another package is imported, it is sent again every 20 ms (a daemon timer and `signal.pthread_kill`) until
    that import is done; `received` says that one came, for an interrupt something swallowed all the same."""

    RETRY_S = 0.02
    HOLD_AT_MOST_S = 5.0  # an import that hangs is interrupted all the same

    def __init__(self) -> None:
        self.received = False
        self.held_since: float | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        self.received = True
        now = time.monotonic()
        self.held_since = self.held_since or now
        if _inside_an_import(frame) and now - self.held_since < self.HOLD_AT_MOST_S:
            timer = threading.Timer(self.RETRY_S, _interrupt_main_thread)
            timer.daemon = True
            timer.start()
            return
        self.held_since = None
        raise KeyboardInterrupt


def _interrupt_main_thread() -> None:
    """SIGINT to the main thread: a real signal, which wakes a sleep or a wait (`interrupt_main` waits for them)."""
    if hasattr(signal, "pthread_kill"):
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]
    else:
        _thread.interrupt_main(signal.SIGINT)


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _inside_an_import(frame: Any) -> bool:
    """Whether a module of another package (torch, NumPy, ...) is being imported here. One of ours lets a
    KeyboardInterrupt through the import as Python's handler does, so a Ctrl-C waits only for the other's."""
    running_other = False  # the innermost module whose top level runs, so far, is another package's
    while frame is not None:
        where = frame.f_code.co_filename
        if where.startswith("<frozen importlib._bootstrap"):
            if running_other:
                return True
        elif frame.f_code.co_name == "<module>":
            running_other = not os.path.abspath(where).startswith(_PACKAGE)
        frame = frame.f_back
    return False


CTRL_C = CtrlC()


def install_ctrl_c() -> None:
    """`CTRL_C` as the process's SIGINT handler, unless SIGINT is ignored (`nohup`, a background job of a
    script): that stays as the parent asked."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, CTRL_C)

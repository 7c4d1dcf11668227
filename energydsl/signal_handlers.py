"""Signal handlers swapped for a while and always given back (training's Ctrl-C, a search's SIGTERM, Ray's
handlers), so that what runs next in the process gets its own handlers."""

from __future__ import annotations

import contextlib
import signal
import threading
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

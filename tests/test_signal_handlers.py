"""`handlers_restored`: whatever a training, a search or Ray installs, the caller's handlers come back. The
`energy` command's Ctrl-C handler, which holds a Ctrl-C back while a module is imported."""

import signal
import sys
import threading
import time

import pytest
from conftest import ROOT, energy_in_process

from energydsl import signal_handlers
from energydsl.signal_handlers import CtrlC, _inside_an_import, handlers_restored, install_ctrl_c


def test_the_previous_handlers_come_back_even_after_an_error() -> None:
    def mine(signum, frame):  # pragma: no cover - never delivered
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        try:
            with handlers_restored(signal.SIGINT, signal.SIGTERM) as previous:
                assert previous == {signal.SIGINT: signal.getsignal(signal.SIGINT), signal.SIGTERM: mine}
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                raise RuntimeError("the search failed")
        except RuntimeError:
            pass
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGINT) is previous[signal.SIGINT] is not signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)


def test_outside_the_main_thread_nothing_is_set_or_restored() -> None:
    seen: list[object] = []

    def run() -> None:
        with handlers_restored(signal.SIGINT) as previous:
            seen.append(previous)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [None]


def test_a_ctrl_c_inside_an_import_is_raised_once_the_import_is_done(tmp_path, monkeypatch) -> None:
    """A Ctrl-C in `import torch` was swallowed (torch clears what is raised while it loads NumPy: `energy
    check` ran to its end and exited 0) or aborted the process (raised in a pybind11 callback)."""
    (tmp_path / "slow_to_import.py").write_text(
        "import signal, time\nsignal.raise_signal(signal.SIGINT)\ntime.sleep(0.1)\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "slow_to_import", raising=False)
    handler = CtrlC()
    with handlers_restored(signal.SIGINT):
        signal.signal(signal.SIGINT, handler)
        with pytest.raises(KeyboardInterrupt):
            import slow_to_import  # noqa: F401

            time.sleep(10)  # sent again 20 ms after the import
    assert "slow_to_import" in sys.modules and sys.modules["slow_to_import"].DONE and handler.received
    with handlers_restored(signal.SIGINT):  # outside an import, at once
        signal.signal(signal.SIGINT, CtrlC())
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def test_sigint_ignored_by_the_parent_stays_ignored() -> None:
    with handlers_restored(signal.SIGINT):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        install_ctrl_c()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signal.signal(signal.SIGINT, signal.default_int_handler)
        install_ctrl_c()
        assert signal.getsignal(signal.SIGINT) is signal_handlers.CTRL_C


def test_a_command_that_got_a_ctrl_c_does_not_exit_0(monkeypatch) -> None:
    """Something swallowed the KeyboardInterrupt and the command ran to its end: its output is not a result."""
    monkeypatch.setattr(signal_handlers.CTRL_C, "received", True)
    proc = energy_in_process("derive", ROOT / "examples/intrinsic-optimizers/mha.energy")
    assert proc.returncode == 130 and proc.stderr.strip() == "interrupted", proc.stderr


def test_an_import_that_hangs_is_interrupted_all_the_same(tmp_path, monkeypatch) -> None:
    (tmp_path / "hangs_on_import.py").write_text(
        "import signal, time\nsignal.raise_signal(signal.SIGINT)\ntime.sleep(30)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "hangs_on_import", raising=False)
    handler = CtrlC()
    handler.HOLD_AT_MOST_S = 0.2
    started = time.monotonic()
    with handlers_restored(signal.SIGINT):
        signal.signal(signal.SIGINT, handler)
        with pytest.raises(KeyboardInterrupt):
            import hangs_on_import  # noqa: F401
    assert time.monotonic() - started < 5 and "hangs_on_import" not in sys.modules


def _frames(*files: tuple[str, str]):
    """A chain of stand-in frames, innermost first: (file, code name) each."""
    from types import SimpleNamespace

    frame = None
    for where, name in reversed(files):
        frame = SimpleNamespace(f_code=SimpleNamespace(co_filename=where, co_name=name), f_back=frame)
    return frame


def test_only_another_packages_import_holds_a_ctrl_c() -> None:
    """A module of ours lets the KeyboardInterrupt through its import, as Python's handler does (torch's does not:
    it swallowed it); the script's own top level, which no import runs, holds nothing."""
    ours = signal_handlers.__file__.replace("signal_handlers.py", "checks.py")
    boot = "<frozen importlib._bootstrap>"
    script = ("/usr/bin/energy", "<module>")
    assert _inside_an_import(_frames(("/site-packages/torch/__init__.py", "<module>"), (boot, "_call"),
                                     (ours, "<module>"), (boot, "_call"), script))
    assert _inside_an_import(_frames(("/site-packages/numpy/lib.py", "add_newdoc"),
                                     ("/site-packages/numpy/_add_newdocs.py", "<module>"), (boot, "_call"), script))
    assert not _inside_an_import(_frames((ours, "<module>"), (boot, "_call"), script))
    assert not _inside_an_import(_frames((ours, "check"), script))

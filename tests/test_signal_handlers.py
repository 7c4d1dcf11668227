"""`handlers_restored`: whatever a training, a search or Ray installs, the caller's handlers come back."""

import signal
import threading

from energydsl.signal_handlers import handlers_restored


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

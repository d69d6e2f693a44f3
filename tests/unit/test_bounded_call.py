"""The watchdog's store calls (coord/watchdog.py BoundedCall): each waited for at most its
bound, nothing piled up behind a call stuck for good, and the thread ended by close() (a
Checkpointer per generation under run_in_process left one idle thread each)."""

from __future__ import annotations

import threading

import pytest

from ftkit.coord.watchdog import BoundedCall


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_calls_are_answered_bounded_and_their_thread_ends_at_close():
    calls = BoundedCall("test-bounded-a")
    assert calls.call(lambda: 41 + 1, 1.0) == 42
    with pytest.raises(ZeroDivisionError):
        calls.call(lambda: 1 / 0, 1.0)
    (served,) = _threads("test-bounded-a")
    calls.close()
    served.join(5)
    assert not served.is_alive()
    assert calls.call(lambda: "again", 1.0) == "again"  # a later call starts another
    calls.close()


def test_a_call_stuck_for_good_times_out_and_the_next_fails_at_once():
    release = threading.Event()
    calls = BoundedCall("test-bounded-b")
    with pytest.raises(TimeoutError, match="no answer within 0.2s"):
        calls.call(release.wait, 0.2)
    with pytest.raises(TimeoutError, match="previous call has not returned"):
        calls.call(lambda: 1, 0.2)
    (stuck,) = _threads("test-bounded-b")
    calls.close()  # (the stuck thread ends once its call is back)
    release.set()
    stuck.join(5)
    assert not stuck.is_alive()

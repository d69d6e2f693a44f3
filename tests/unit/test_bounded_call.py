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


def test_a_watchdog_stopped_by_an_in_process_verdict_still_cleans_up_at_close(tmp_path, monkeypatch):
    """An in-process verdict stops the heartbeat thread; the generation's Checkpointer then closed
    without `failed` (a loop's ``finally: ck.close()``, a trainer's teardown) skipped stop()'s
    cleanup: the store thread stayed, one per generation, and the node's board stayed in RAM."""
    import os
    import time

    import torch.distributed as dist

    from ftkit.coord.dist import DistContext
    from ftkit.coord.events import EventLog
    from ftkit.coord.judge import Verdict, WatchdogConfig
    from ftkit.coord.watchdog import Watchdog
    from ftkit.runtime import generation

    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "shm"))
    store = dist.HashStore()
    cfg = WatchdogConfig(interval_s=0.05)
    wds = [Watchdog(DistContext(rank=r, world_size=2, store=store), EventLog(None, r), cfg) for r in (0, 1)]
    generation.set_active(True)  # under run_in_process
    try:
        for wd in wds:
            wd.start()
        leader = wds[0]
        while not _threads("ftkit-watchdog-store"):  # the leader's first round with the store
            time.sleep(0.01)
        (served,) = _threads("ftkit-watchdog-store")
        leader.board.write("verdict.json", Verdict(1, "failed", 0.0, "its training loop raised", 1).to_json())
        for wd in wds:
            assert wd._thread is not None
            wd._thread.join(5)  # the verdict stopped each heartbeat thread: a recovery takes over
            assert not wd._thread.is_alive()
        for wd in wds:
            wd.stop()  # (Checkpointer.close() without `failed`)
        served.join(5)
        assert not served.is_alive()
        assert not os.path.exists(leader.board.path)  # the last rank of the node out removed its board
    finally:
        generation.set_active(False)  # (the verdict's recovery timer then ends nothing)
        for wd in wds:
            wd.stop()

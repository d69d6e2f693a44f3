"""The node board's doorbells (ftkit/coord/bell.py): a waiting rank sleeps until a peer posts."""

from __future__ import annotations

import os
import select
import threading

from ftkit.coord.bell import Bell, ring
from ftkit.coord.nodelocal import NodeBoard


def readable(bell: Bell) -> bool:
    return bool(select.select([bell._fd], [], [], 0)[0])


def test_a_ring_wakes_the_listener_and_waiting_drains_it(tmp_path):
    path = str(tmp_path / "bell-r0")
    bell = Bell.listen(path)
    assert bell is not None and not readable(bell)
    ring(path)
    ring(path)
    assert readable(bell)
    bell.wait(5.0)
    assert not readable(bell)  # both rings drained: the next wait sleeps
    again = Bell.listen(path)  # the same name again (a later Checkpointer of the same rank): reused
    assert again is not None
    bell.close()
    again.close()
    ring(str(tmp_path / "bell-r9"))  # nobody listens there: nothing happens


def test_something_else_at_the_bell_name_is_no_bell_and_is_left_alone(tmp_path):
    planted = tmp_path / "bell-r0"
    planted.write_bytes(b"not a pipe")
    assert Bell.listen(str(planted)) is None  # a regular file would read as always ringing
    ring(str(planted))
    assert planted.read_bytes() == b"not a pipe"
    target = tmp_path / "elsewhere"
    os.mkfifo(target)
    link = tmp_path / "bell-r1"
    link.symlink_to(target)
    assert Bell.listen(str(link)) is None  # never through a link


def test_a_collecting_leader_gets_every_message_posted_with_a_ring(tmp_path, monkeypatch):
    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "ram"))
    leader = NodeBoard("scope", "node0", leader=True, kind="commit")
    peer = NodeBoard("scope", "node0", leader=False, kind="commit")  # another rank's view of the same board
    got: dict = {}

    def wait():
        got.update(leader.collect({1: "w-r1", 2: "w-r2"}, 60.0, 1024, me=0))

    t = threading.Thread(target=wait)
    t.start()
    peer.write_text("w-r1", "one", wake=[0])
    peer.write("w-r2", {"two": 2}, wake=[0])
    t.join(60)
    assert got == {1: b"one", 2: b'{"two":2}'}
    assert os.path.exists(os.path.join(leader.path, "bell-r0"))  # the leader's bell: a pipe on its board

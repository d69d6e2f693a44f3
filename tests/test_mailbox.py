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


def test_what_a_skipped_step_left_on_the_board_is_removed_within_prune_every_steps(tmp_path, monkeypatch):
    """A collector looks for the messages of steps nobody collected (a skipped step) once every
    PRUNE_EVERY steps of an epoch, not at every collect; what it finds of earlier steps goes,
    the current step's messages and an earlier epoch's look stay put until then."""
    from ftkit.coord.nodelocal import PRUNE_EVERY, step_message

    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "ram"))
    board = NodeBoard("scope", "node0", leader=True, kind="commit")
    board.prune_before((0, 10))  # the first look
    board.write_text(step_message((0, 11), "w-r1"), "left by a skipped step")
    board.write_text(step_message((0, 12), "w-r1"), "this step's")
    board.prune_before((0, 12))
    assert step_message((0, 11), "w-r1") in board.names()  # not looked for yet
    board.prune_before((0, 10 + PRUNE_EVERY))
    assert step_message((0, 11), "w-r1") not in board.names()
    assert step_message((0, 12), "w-r1") not in board.names()  # before the step looked at: gone too
    board.write_text(step_message((0, 30), "w-r1"), "left before a restore")
    board.prune_before((1, 2))  # a new epoch (a restore): looked at at once
    assert step_message((0, 30), "w-r1") not in board.names()

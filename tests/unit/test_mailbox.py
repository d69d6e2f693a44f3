"""The node board's mailboxes (ftkit/coord/mailbox.py): a step's messages between the ranks of
a node, one datagram each, with the board's files behind them for what a mailbox cannot take."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time

import pytest

from ftkit.coord.mailbox import (
    MAX_FRAME,
    Addresses,
    Mailbox,
    message_frame,
    notice_frame,
    parse_frame,
    post,
)
from ftkit.coord.nodelocal import PRUNE_EVERY, NodeBoard, step_message


@pytest.fixture
def boards(tmp_path, monkeypatch):
    """A node's commit board as its collector (rank 0) and another rank (1) see it."""
    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "ram"))
    leader = NodeBoard("scope", "node0", leader=True, kind="commit")
    peer = NodeBoard("scope", "node0", leader=False, kind="commit")
    return leader, peer


def _collect_in_thread(board: NodeBoard, names: dict, **kw) -> tuple[threading.Thread, dict]:
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(board.collect(names, 60.0, 1 << 20, me=0, **kw)))
    t.start()
    return t, got


def test_frames_round_trip_and_anything_else_is_not_a_frame():
    assert parse_frame(message_frame("0-3-w-r1.json", b'{"a":1}')) == ("0-3-w-r1.json", b'{"a":1}')
    assert parse_frame(message_frame("0-3-w-r1.json", b"")) == ("0-3-w-r1.json", b"")
    assert parse_frame(notice_frame("0-3-peers.json")) == ("0-3-peers.json", None)
    for junk in (
        b"",
        b"M",
        b"Mname",
        b"X0-3-w.json\0x",
        b"M../up\0x",
        b"M\0x",
        b"F0-3-w.json\0extra",
        b"M" + b"a" * 200 + b"\0",
    ):
        assert parse_frame(junk) is None, junk


def test_a_collecting_leader_gets_every_message_from_its_mailbox(boards):
    leader, peer = boards
    leader.mailbox(0)
    t, got = _collect_in_thread(leader, {1: "w-r1", 2: "w-r2"}, only_reader=True)
    peer.send("w-r1", b"one", [0])
    peer.send("w-r2", b'{"two":2}', [0])
    t.join(60)
    assert got == {1: b"one", 2: b'{"two":2}'}
    box = os.path.join(leader.path, "box-r0")
    assert stat.S_ISSOCK(os.lstat(box).st_mode)  # the leader's mailbox: a socket on its board
    assert sorted(n for n in leader.names() if not n.startswith("box-")) == []  # no message went as a file


def test_a_message_too_big_for_a_datagram_goes_as_a_file_with_a_notice(boards):
    leader, peer = boards
    leader.mailbox(0)
    big = os.urandom(MAX_FRAME + 10)
    peer.send("0-1-w-r1.json", big, [0])
    assert "0-1-w-r1.json" in leader.names()  # the file, posted before its notice
    box = leader.mailbox(0)
    assert box is not None and box.wait(5.0)  # the notice woke the leader
    box.fresh = False  # not its first look at the board: only the notice can lead it to the file
    got = leader.collect({1: "0-1-w-r1.json"}, 5.0, 1 << 20, me=0, only_reader=True)
    assert got == {1: big}
    assert "0-1-w-r1.json" not in leader.names()  # read by its only reader: removed


def test_a_message_sent_before_the_mailbox_is_bound_is_a_file_found_at_the_first_look(boards):
    leader, peer = boards
    peer.send("0-1-r-r1.json", b'{"errors":[]}', [0])  # nobody bound box-r0 yet
    assert "0-1-r-r1.json" in leader.names()
    assert leader.collect({1: "0-1-r-r1.json"}, 5.0, 1024, me=0) == {1: b'{"errors":[]}'}


def test_a_message_a_full_mailbox_cannot_take_arrives_through_the_board(boards):
    """Past its queue a mailbox refuses datagrams (EAGAIN): the sender posts a file, which the
    receiver reads once nothing came for FALLBACK_S."""
    leader, peer = boards
    box = leader.mailbox(0)
    assert box is not None
    addresses = Addresses(leader.path)  # (its addresses hold while it lives)
    filled, address = 0, addresses.of(0)
    while post(address, message_frame(f"0-0-x{filled}.json", b"filler")):
        filled += 1
        assert filled < 100_000
    peer.send("0-1-w-r1.json", b"late", [0])
    assert "0-1-w-r1.json" in leader.names()
    box.fresh = False
    got = leader.collect({1: "0-1-w-r1.json"}, 10.0, 1024, me=0)
    assert got == {1: b"late"}
    assert filled >= 1


def test_a_mailbox_that_is_not_read_costs_its_senders_one_wait_not_one_per_message(boards, monkeypatch):
    """A rank alive but not reading (hung in a kernel, say) lets its mailbox fill: the first
    sender to find it full waits PATIENCE_S for room, in vain; later messages to it go
    straight to files, until it takes one again and senders wait for it as before."""
    from ftkit.coord import mailbox

    monkeypatch.setattr(mailbox, "PATIENCE_S", 0.5)
    monkeypatch.setattr(mailbox, "_sender", None)  # a sending socket with that patience
    monkeypatch.setattr(mailbox, "_unheeded", set())
    leader, _ = boards
    box = leader.mailbox(0)
    assert box is not None
    addresses = Addresses(leader.path)  # (its addresses hold while it lives)
    filled, address = 0, addresses.of(0)
    while post(address, message_frame(f"0-0-x{filled}.json", b"filler"), patient=False):
        filled += 1
        assert filled < 100_000
    t0 = time.monotonic()
    assert not post(address, message_frame("0-1-a.json", b"a"))  # waits, in vain
    waited = time.monotonic() - t0
    t1 = time.monotonic()
    for i in range(20):
        assert not post(address, message_frame(f"0-1-b{i}.json", b"b"))
    again = time.monotonic() - t1
    assert waited >= 0.4 and again < 0.4  # one wait for the whole run, not twenty-one
    assert len(box.drain()) == filled  # the rank reads again: it gets patience again
    assert post(address, message_frame("0-1-c.json", b"c"))
    assert address not in mailbox._unheeded
    assert mailbox._sender is not None
    mailbox._sender.close()


def test_a_mailbox_past_descriptor_1024_still_wakes_its_rank(tmp_path, monkeypatch):
    """A training process can hold more than 1024 descriptors (data loader workers, NCCL,
    open shards): a mailbox bound past that (where select() cannot look) still wakes its
    rank when a message comes."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"needs 1200 descriptors, the hard limit is {hard}")
    if soft != resource.RLIM_INFINITY and soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1200, hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "ram"))
        leader = NodeBoard("scope", "node0", leader=True, kind="commit")
        peer = NodeBoard("scope", "node0", leader=False, kind="commit")
        box = leader.mailbox(0)
        assert box is not None and box.fileno() > 1024
        names = {1: step_message((0, 1), "w-r1")}
        t, got = _collect_in_thread(leader, names)
        time.sleep(0.1)  # the collector is waiting in its mailbox
        peer.send(names[1], b"report", [0])
        t.join(30)
        assert got == {1: b"report"}
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_closed_mailbox_waits_instead_of_spinning(boards):
    """A mailbox closed under its rank reports nothing waiting and still sleeps its pause,
    so a collect goes on looking at the board's files instead of spinning."""
    from ftkit.coord.mailbox import FALLBACK_S

    leader, _ = boards
    box = leader.mailbox(0)
    assert box is not None
    box.close()
    t0 = time.monotonic()
    assert [box.wait(1.0) for _ in range(3)] == [False, False, False]
    assert time.monotonic() - t0 >= 3 * FALLBACK_S * 0.9
    assert box.drain() == []


def test_datagrams_that_are_not_frames_are_dropped_and_the_messages_still_arrive(boards):
    leader, peer = boards
    addresses = Addresses(leader.path)
    address = addresses.of(0)
    leader.mailbox(0)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    for junk in (b"garbage", b"M../../etc/passwd\0x", b"\xff" * 100, b"F0-1-w-r1.json\0x"):
        s.sendto(junk, address)
    s.close()
    peer.send("0-1-w-r1.json", b"real", [0])
    assert leader.collect({1: "0-1-w-r1.json"}, 5.0, 1024, me=0) == {1: b"real"}


def test_over_max_bytes_is_refused_like_a_missing_message(boards):
    leader, peer = boards
    leader.mailbox(0)
    peer.send("0-1-w-r1.json", b"x" * 100, [0])
    assert leader.collect({1: "0-1-w-r1.json"}, 0.1, 50, me=0) == {1: None}


def test_something_else_at_the_mailbox_name_is_no_mailbox_and_is_left_alone(boards, tmp_path):
    leader, peer = boards
    planted = os.path.join(leader.path, "box-r0")
    with open(planted, "wb") as f:
        f.write(b"not a socket")
    assert leader.mailbox(0) is None
    target = tmp_path / "elsewhere.sock"
    elsewhere = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    elsewhere.bind(str(target))
    os.symlink(target, os.path.join(leader.path, "box-r1"))
    assert peer.mailbox(1) is None  # never bound through a link
    elsewhere.close()
    with open(planted, "rb") as f:
        assert f.read() == b"not a socket"
    # Without a mailbox the board's files carry the messages, polled.
    t, got = _collect_in_thread(leader, {1: "0-1-w-r1.json"}, only_reader=True)
    peer.send("0-1-w-r1.json", b"by file", [0])
    t.join(60)
    assert got == {1: b"by file"}


def test_a_mailbox_left_by_an_earlier_one_of_the_rank_is_replaced_and_one_per_process(tmp_path):
    path = str(tmp_path / "box-r0")
    first = Mailbox.open(path, path)
    assert first is not None and Mailbox.open(path, path) is first  # one per name in a process
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(str(tmp_path / "box-r1"))
    stale.close()  # its socket file stays
    again = Mailbox.open(str(tmp_path / "box-r1"), str(tmp_path / "box-r1"))
    assert again is not None
    assert post(str(tmp_path / "box-r1"), message_frame("a.json", b"1"))
    assert again.wait(5.0) and again.drain() == [("a.json", b"1")]
    again.close()
    assert not os.path.exists(tmp_path / "box-r1")  # closed: its socket removed
    first.close()


def test_a_board_deeper_than_a_socket_address_allows_is_reached_through_its_descriptor(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    addresses = Addresses(str(deep))
    address = addresses.of(3)
    assert address is not None and address.startswith("/proc/self/fd/") and len(address) < 100
    box = Mailbox.open(address, str(deep / "box-r3"))
    assert box is not None and stat.S_ISSOCK(os.lstat(deep / "box-r3").st_mode)
    assert post(address, message_frame("a.json", b"deep"))
    assert box.wait(5.0) and box.drain() == [("a.json", b"deep")]
    box.close()
    addresses.close()


def test_a_skip_ends_the_wait_and_stays_for_has(boards):
    leader, peer = boards
    peer.mailbox(1)
    leader.send("0-4-skip.json", b'{"reason":"x"}', [1])
    got = peer.collect({0: "0-4-peers.json"}, 60.0, 1024, give_up="0-4-skip.json", me=1)
    assert got == {0: None}
    assert peer.has("0-4-skip.json", 1)
    assert not peer.has("0-5-skip.json", 1)


def test_what_a_skipped_step_left_on_the_board_is_removed_within_prune_every_steps(boards):
    """A collector looks for the messages of steps nobody collected (a skipped step) once every
    PRUNE_EVERY steps of an epoch, not at every collect; what it finds of earlier steps goes,
    in its inbox and on the board; the current step's messages and an earlier epoch's look
    stay put until then."""
    board, peer = boards
    board.mailbox(0)
    board.prune_before((0, 10))  # the first look
    board.write_text(step_message((0, 11), "w-r1"), "left by a skipped step")
    board.write_text(step_message((0, 12), "w-r1"), "this step's")
    peer.send(step_message((0, 11), "r-r1"), b"a mailed one, never collected", [0])
    assert board.has(step_message((0, 11), "r-r1"), 0)
    board.prune_before((0, 12))
    assert step_message((0, 11), "w-r1") in board.names()  # not looked for yet
    board.prune_before((0, 10 + PRUNE_EVERY))
    assert step_message((0, 11), "w-r1") not in board.names()
    assert step_message((0, 12), "w-r1") not in board.names()  # before the step looked at: gone too
    assert not board.has(step_message((0, 11), "r-r1"), 0)  # and from the inbox
    board.write_text(step_message((0, 30), "w-r1"), "left before a restore")
    board.prune_before((1, 2))  # a new epoch (a restore): looked at at once
    assert step_message((0, 30), "w-r1") not in board.names()


def test_a_burst_bigger_than_a_mailbox_queues_waits_for_room_and_goes_through_the_mailbox(boards, monkeypatch):
    """Seven ranks send a report and an outcome each at once (a node of eight without replicas)
    to a collector busy with something else for a moment: more than a mailbox queues
    (net.unix.max_dgram_qlen, 10 by default). The senders wait for room; everything arrives,
    and nothing had to go as a file."""
    leader, peer = boards
    leader.mailbox(0)
    as_files: list[str] = []
    monkeypatch.setattr(peer, "write_bytes", lambda name, data: as_files.append(name))
    names = {r: step_message((0, 1), f"w-r{r}") for r in range(1, 8)}
    names.update({10 + r: step_message((0, 1), f"r-r{r}") for r in range(1, 8)})

    def rank(r: int) -> None:
        peer.send(names[r], f"report {r}".encode(), [0])
        peer.send(names[10 + r], f"outcome {r}".encode(), [0])

    senders = [threading.Thread(target=rank, args=(r,)) for r in range(1, 8)]
    for t in senders:
        t.start()
    time.sleep(0.2)  # the collector is busy: the burst fills its mailbox
    got = leader.collect(names, 10.0, 1024, me=0, only_reader=True)
    for t in senders:
        t.join(60)
    assert got == {k: (f"report {k}" if k < 10 else f"outcome {k - 10}").encode() for k in names}
    assert as_files == []

"""The node board's mailboxes (ftkit/coord/mailbox.py): a step's messages between the ranks of
a node, as frames down one kept connection per sender and mailbox; no other path."""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading
import time

import pytest

from ftkit.coord import mailbox
from ftkit.coord.mailbox import MAX_MESSAGE, Addresses, Link, Mailbox, frame, split_frames
from ftkit.coord.nodelocal import NodeBoard, step_message


@pytest.fixture
def boards(tmp_path, monkeypatch):
    """A node's commit board as its collector (rank 0) and another rank (1) see it."""
    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "ram"))
    leader = NodeBoard("scope", "node0", leader=True, kind="commit")
    peer = NodeBoard("scope", "node0", leader=False, kind="commit")
    return leader, peer


def _collect_in_thread(board: NodeBoard, names: dict, **kw) -> tuple[threading.Thread, dict]:
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(board.collect(names, 60.0, 1 << 30, 0, **kw)))
    t.start()
    return t, got


def _raw_connection(board: NodeBoard, rank: int) -> socket.socket:
    """A connection to `rank`'s mailbox with no ftkit code on the sending side."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = os.open(board.path, os.O_RDONLY | os.O_DIRECTORY)  # (tmp_path is too long for a socket address)
    try:
        s.connect(f"/proc/self/fd/{fd}/box-r{rank}")
    finally:
        os.close(fd)
    return s


def test_frames_split_whole_and_in_order_and_a_piece_waits_for_the_rest():
    stream = frame("0-3-w-r1.json", b'{"a":1}') + frame("0-3-r-r1.json", b"") + frame("0-4-w-r1.json", b"xyz")
    buf = bytearray(stream[:-2])
    got, sound = split_frames(buf)
    assert sound and got == [("0-3-w-r1.json", b'{"a":1}'), ("0-3-r-r1.json", b"")]
    buf += stream[-2:]
    assert split_frames(buf) == ([("0-4-w-r1.json", b"xyz")], True) and buf == bytearray()
    for junk in (b"", b"../up", b"a" * 200, b"sp ace"):  # names that do not parse: the frame is dropped, not the stream
        body = junk + b"\0payload"
        buf = bytearray(struct.pack("!I", len(body)) + body + frame("ok.json", b"1"))
        assert split_frames(buf) == ([("ok.json", b"1")], True), junk
    too_long = bytearray(struct.pack("!I", MAX_MESSAGE + 1) + b"x" * 10)
    assert split_frames(too_long) == ([], False)


def test_a_collecting_leader_gets_every_message_from_its_mailbox_and_nothing_is_a_file(boards):
    leader, peer = boards
    leader.mailbox(0)
    t, got = _collect_in_thread(leader, {1: "w-r1", 2: "w-r2"})
    peer.send("w-r1", b"one", [0])
    peer.send("w-r2", b'{"two":2}', [0])
    t.join(60)
    assert got == {1: b"one", 2: b'{"two":2}'}
    box = os.path.join(leader.path, "box-r0")
    assert stat.S_ISSOCK(os.lstat(box).st_mode)  # the leader's mailbox: a socket on its board
    assert os.listdir(leader.path) == ["box-r0"]


def test_a_message_far_bigger_than_the_socket_buffer_goes_down_the_same_connection(boards):
    leader, peer = boards
    leader.mailbox(0)
    big = os.urandom(3 * 2**20 + 7)
    t, got = _collect_in_thread(leader, {1: "0-1-w-r1.json"})
    peer.send("0-1-w-r1.json", big, [0])  # waits for the collector to read, piece by piece
    t.join(60)
    assert got == {1: big}
    assert os.listdir(leader.path) == ["box-r0"]


def test_a_message_sent_before_the_mailbox_listens_waits_for_it(boards):
    """A rank may send before its collector has opened its tiers: the sender waits for the
    mailbox to listen, up to its patience, and the message arrives."""
    leader, peer = boards

    def late_collector() -> None:
        time.sleep(0.3)
        leader.mailbox(0)

    t = threading.Thread(target=late_collector)
    t.start()
    peer.send("0-1-r-r1.json", b'{"errors":[]}', [0])  # nobody listens at box-r0 yet
    t.join(60)
    assert leader.collect({1: "0-1-r-r1.json"}, 5.0, 1024, 0) == {1: b'{"errors":[]}'}


def test_a_mailbox_that_is_not_read_makes_a_sender_wait_its_patience_then_loses_only_that_message(boards, monkeypatch):
    """Backpressure: a rank alive but not reading (hung in a kernel, say) lets its connection's
    buffer fill. A sender waits for room up to PATIENCE_S, then closes the connection: the
    receiver gets every message written whole before it, never a piece of the last. The
    training thread's sends (patient False) never wait."""
    monkeypatch.setattr(mailbox, "PATIENCE_S", 0.3)
    leader, peer = boards
    box = leader.mailbox(0)
    assert box is not None
    addresses = Addresses(leader.path)  # (its addresses hold while it lives)
    link = Link(addresses.of(0))
    chunk = b"x" * 4096
    sent = 0
    t0 = time.monotonic()
    while link.send(frame(f"0-0-x{sent}.json", chunk), 0.3):
        sent += 1
        assert sent < 100_000
    waited = time.monotonic() - t0
    assert sent >= 10 and waited >= 0.25  # a buffer's worth went at once, then it waited
    t1 = time.monotonic()
    assert link.send(frame("0-1-a.json", chunk), 0.0)  # a new connection has room
    while link.send(frame("0-1-b.json", chunk), 0.0):
        pass
    assert time.monotonic() - t1 < 0.25  # the training thread's sends: never a wait
    got = []
    while box.wait(0.2):
        got += box.drain()
    names = [n for n, _ in got]
    assert names[:sent] == [f"0-0-x{i}.json" for i in range(sent)]  # whole and in order, the piece dropped
    assert all(p == chunk for _, p in got)
    peer.send("0-2-w-r1.json", b"after", [0])  # the rank reads again: messages flow as before
    assert leader.collect({1: "0-2-w-r1.json"}, 5.0, 1024, 0) == {1: b"after"}
    link.close()


def test_a_send_that_never_waits_is_not_held_up_by_a_commits_send_waiting_for_room(boards):
    """A commit's sends wait for room as long as its timeout (its collector may be busy for
    seconds); the training thread's (a skipped step's word, patience 0) to the same rank go
    at once, whole, and arrive: they never queue behind the commit's."""
    leader, peer = boards
    leader.mailbox(0)
    big = b"x" * (4 << 20)  # more than a connection's buffer: waits until rank 0 reads
    t = threading.Thread(target=peer.send, args=("0-1-w-r1.json", big, [0], 30.0))
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    peer.send("0-2-w-r1.json", b"skipped", [0], 0.0)
    assert time.monotonic() - t0 < 0.5
    got = leader.collect({1: "0-1-w-r1.json", 2: "0-2-w-r1.json"}, 10.0, 8 << 20, 0)
    t.join(10)
    assert got == {1: big, 2: b"skipped"}


def test_a_sender_gone_mid_frame_leaves_no_piece_and_others_go_on(boards):
    leader, peer = boards
    box = leader.mailbox(0)
    assert box is not None
    raw = _raw_connection(leader, 0)
    whole = frame("0-1-w-r2.json", b"whole")
    raw.sendall(whole + frame("0-1-r-r2.json", b"cut short")[:12])
    raw.close()
    peer.send("0-1-w-r1.json", b"real", [0])
    got = leader.collect({1: "0-1-w-r1.json", 2: "0-1-w-r2.json"}, 5.0, 1024, 0)
    assert got == {1: b"real", 2: b"whole"}
    assert not leader.has("0-1-r-r2.json", 0)


def test_a_stream_that_is_not_frames_is_dropped_and_the_messages_still_arrive(boards):
    leader, peer = boards
    leader.mailbox(0)
    for junk in (b"\xff" * 100, struct.pack("!I", 5) + b"../x\0" + frame("0-1-w-r1.json", b"forged")[:3]):
        raw = _raw_connection(leader, 0)
        raw.sendall(junk)
        raw.close()
    peer.send("0-1-w-r1.json", b"real", [0])
    assert leader.collect({1: "0-1-w-r1.json"}, 5.0, 1024, 0) == {1: b"real"}


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
    leader, _ = boards
    box = leader.mailbox(0)
    assert box is not None
    box.close()
    t0 = time.monotonic()
    assert [box.wait(0.05) for _ in range(3)] == [False, False, False]
    assert time.monotonic() - t0 >= 0.14
    assert box.drain() == []


def test_over_max_bytes_is_refused_like_a_missing_message(boards):
    leader, peer = boards
    leader.mailbox(0)
    peer.send("0-1-w-r1.json", b"x" * 100, [0])
    assert leader.collect({1: "0-1-w-r1.json"}, 0.5, 50, 0) == {1: None}


def test_something_else_at_the_mailbox_name_is_no_mailbox_and_is_left_alone(boards, tmp_path):
    leader, peer = boards
    planted = os.path.join(leader.path, "box-r0")
    with open(planted, "wb") as f:
        f.write(b"not a socket")
    assert leader.mailbox(0) is None
    target = tmp_path / "elsewhere.sock"
    elsewhere = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    elsewhere.bind(str(target))
    os.symlink(target, os.path.join(leader.path, "box-r1"))
    assert peer.mailbox(1) is None  # never bound through a link
    elsewhere.close()
    t0 = time.monotonic()
    peer.send("0-1-w-r1.json", b"lost", [0])  # refused at once: no wait on what is not a mailbox
    assert time.monotonic() - t0 < mailbox.PATIENCE_S
    with open(planted, "rb") as f:
        assert f.read() == b"not a socket"
    assert leader.collect({1: "0-1-w-r1.json"}, 0.2, 1024, 0) == {1: None}


def test_a_mailbox_left_by_an_earlier_one_of_the_rank_is_replaced_and_one_per_process(tmp_path):
    path = str(tmp_path / "box-r0")
    first = Mailbox.open(path, path)
    assert first is not None and Mailbox.open(path, path) is first  # one per name in a process
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "box-r1"))
    stale.close()  # its socket file stays
    again = Mailbox.open(str(tmp_path / "box-r1"), str(tmp_path / "box-r1"))
    assert again is not None
    link = Link(str(tmp_path / "box-r1"))
    assert link.send(frame("a.json", b"1"), 5.0)
    assert again.wait(5.0) and again.drain() == [("a.json", b"1")]
    link.close()
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
    link = Link(address)
    assert link.send(frame("a.json", b"deep"), 5.0)
    got = []
    while not got and box.wait(5.0):
        got += box.drain()
    assert got == [("a.json", b"deep")]
    link.close()
    box.close()
    addresses.close()


def test_a_skip_ends_the_wait_and_stays_for_has(boards):
    leader, peer = boards
    peer.mailbox(1)
    leader.send("0-4-skip.json", b'{"reason":"x"}', [1])
    got = peer.collect({0: "0-4-peers.json"}, 60.0, 1024, 1, give_up="0-4-skip.json")
    assert got == {0: None}
    assert peer.has("0-4-skip.json", 1)
    assert not peer.has("0-5-skip.json", 1)


def test_what_a_skipped_step_left_is_dropped_at_a_later_steps_collect(boards):
    board, peer = boards
    board.mailbox(0)
    peer.send(step_message((0, 11), "r-r1"), b"never collected", [0])
    peer.send(step_message((0, 12), "w-r1"), b"this step's", [0])
    assert board.has(step_message((0, 11), "r-r1"), 0)
    board.prune_before((0, 12))
    assert not board.has(step_message((0, 11), "r-r1"), 0)
    assert board.has(step_message((0, 12), "w-r1"), 0)
    board.prune_before((1, 2))  # a new epoch (a restore): everything of the earlier one goes
    assert not board.has(step_message((0, 12), "w-r1"), 0)


def test_what_never_changes_goes_once_per_connection(boards):
    """A rank's layout goes once down a connection, ahead of its reports; a new connection
    (its collector's mailbox made anew: a new process may hold it) carries it again."""
    leader, peer = boards
    leader.mailbox(0)
    for _ in range(3):
        peer.send_once("layout-ab.json", b"[layout]", [0])
    assert leader.take("layout-ab.json", 0, 1024) == b"[layout]"
    time.sleep(0.1)
    assert leader.take("layout-ab.json", 0, 1024) is None  # sent once
    leader.mailbox(0).close()
    leader._boxes.clear()
    peer.send("0-1-w-r1.json", b"into the void", [0])  # the old connection: broken now, or soon
    time.sleep(0.1)
    leader.mailbox(0)  # a new mailbox at the name
    for i in range(3):
        peer.send(f"0-{2 + i}-w-r1.json", b"x", [0])
    peer.send_once("layout-ab.json", b"[layout]", [0])
    assert leader.collect({1: "0-4-w-r1.json"}, 5.0, 1024, 0) == {1: b"x"}
    assert leader.take("layout-ab.json", 0, 1024) == b"[layout]"


def test_a_burst_of_every_ranks_messages_at_once_arrives_whole(boards):
    """Seven ranks send a report and an outcome each at once (a node of eight without replicas)
    to a collector busy with something else for a moment: everything arrives."""
    leader, peer = boards
    leader.mailbox(0)
    names = {r: step_message((0, 1), f"w-r{r}") for r in range(1, 8)}
    names.update({10 + r: step_message((0, 1), f"r-r{r}") for r in range(1, 8)})
    ranks = {r: NodeBoard("scope", "node0", leader=False, kind="commit") for r in range(1, 8)}

    def rank(r: int) -> None:
        ranks[r].send(names[r], f"report {r}".encode(), [0])
        ranks[r].send(names[10 + r], f"outcome {r}".encode(), [0])

    senders = [threading.Thread(target=rank, args=(r,)) for r in range(1, 8)]
    for t in senders:
        t.start()
    time.sleep(0.2)  # the collector is busy
    got = leader.collect(names, 10.0, 1024, 0)
    for t in senders:
        t.join(60)
    assert got == {k: (f"report {k}" if k < 10 else f"outcome {k - 10}").encode() for k in names}


def test_a_layout_goes_again_after_a_connection_broke_even_before_the_next_one_opens(boards):
    """A connection that broke forgets what it carried `once`: the next `send_once` opens the
    new connection with it, ahead of the reports that name it."""
    leader, peer = boards
    leader.mailbox(0)
    peer.send_once("layout-ab.json", b"[layout]", [0])
    assert leader.take("layout-ab.json", 0, 1024) == b"[layout]"
    leader.mailbox(0).close()
    leader._boxes.clear()
    peer.send("0-1-w-r1.json", b"into the void", [0])  # fails: the connection closes
    leader.mailbox(0)
    peer.send_once("layout-ab.json", b"[layout]", [0])  # the first message of the new connection
    peer.send("0-2-w-r1.json", b"report", [0])
    assert leader.collect({1: "0-2-w-r1.json"}, 5.0, 1024, 0) == {1: b"report"}
    assert leader.take("layout-ab.json", 0, 1024) == b"[layout]"


def test_a_wait_of_a_generation_that_is_over_ends_within_a_second(boards, monkeypatch):
    """Under run_in_process, a board wait for generation g (a commit's persist thread) raises
    RecoveryRequested soon after g is over, as the store's waits do, not at the commit's timeout
    (a failed generation's thread lingering until the process exits); outside run_in_process,
    and for a generation still current, it waits as asked."""
    from ftkit.errors import RecoveryRequested
    from ftkit.runtime import generation

    leader, _ = boards
    monkeypatch.setattr(generation, "_active", True)
    monkeypatch.setattr(generation, "_requested", None)
    g = generation.current()
    t0 = time.monotonic()
    assert leader.collect({1: "0-1-w-r1.json"}, 1.5, 1024, 0, serves=g) == {1: None}  # still current
    assert time.monotonic() - t0 >= 1.4
    monkeypatch.setattr(generation, "_generation", g + 1)
    t0 = time.monotonic()
    with pytest.raises(RecoveryRequested, match="a newer generation"):
        leader.collect({1: "0-1-w-r1.json"}, 60.0, 1024, 0, serves=g)
    assert time.monotonic() - t0 < 5
    monkeypatch.setattr(generation, "_active", False)  # outside run_in_process: generations do not end waits
    assert leader.collect({1: "0-1-w-r1.json"}, 0.3, 1024, 0, serves=g) == {1: None}

"""What one message between two ranks of a node costs: ftkit's board (coord/nodelocal.py
NodeBoard.send / collect, down a kept connection to the receiver's mailbox, coord/mailbox.py)
beside its floor (the same frame down a bare Unix stream connection: `sendall`, `poll` +
`recv`, no ftkit code), beside a bare datagram (the board's transport before, with a file
for what a datagram could not take) and beside files (a file written and renamed, a byte
down the receiver's named pipe; the receiver looks, sleeps in `select`, reads the file and
removes it: the transport before the datagrams).

Two processes take turns: one sends, the other (asleep in its wait) receives, every 2 ms.
Printed: CPU microseconds per message on each side (thread CPU; the receiver's includes its
wake), medians over rounds.

    .venv/bin/python benchmarks/board_messages.py [--messages 400] [--rounds 3] [--bytes 300]
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import statistics
import struct
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _board_side(me: int, root: str, n: int, payload: bytes) -> tuple[float, float]:
    from ftkit.coord.nodelocal import NodeBoard, step_message

    os.environ["FTKIT_RAM_DIR"] = root
    board = NodeBoard("bench", "node0", leader=me == 0, kind="commit")
    board.mailbox(me)
    return _turns(
        me,
        n,
        lambda i: board.send(step_message((0, i), f"w-r{me}"), payload, [1 - me]),
        lambda i: board.collect({1 - me: step_message((0, i), f"w-r{1 - me}")}, 30.0, 1 << 20, me),
    )


def _floor_side(me: int, root: str, n: int, payload: bytes) -> tuple[float, float]:
    mine, theirs = os.path.join(root, f"box-{me}"), os.path.join(root, f"box-{1 - me}")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(mine)
    listener.listen(8)
    time.sleep(0.2)  # both listening
    out = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    out.connect(theirs)
    conn, _ = listener.accept()
    poll = select.poll()
    poll.register(conn, select.POLLIN)

    def receive(i: int) -> None:
        poll.poll(30e3)
        conn.recv(1 << 18)

    message = struct.pack("!I", len(payload) + 14) + b"0-0-w-r0.json\0" + payload
    return _turns(me, n, lambda i: out.sendall(message), receive)


def _datagram_side(me: int, root: str, n: int, payload: bytes) -> tuple[float, float]:
    mine, theirs = os.path.join(root, f"box-{me}"), os.path.join(root, f"box-{1 - me}")
    box = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    box.bind(mine)
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def receive(i: int) -> None:
        select.select([box], [], [], 30.0)
        box.recv(1 << 17)

    return _turns(me, n, lambda i: sender.sendto(b"M" + f"{i}".encode() + b"\0" + payload, theirs), receive)


def _files_side(me: int, root: str, n: int, payload: bytes) -> tuple[float, float]:
    """The board's transport before the mailboxes (ftkit 8deb016 and earlier), written plainly."""
    bell = os.path.join(root, f"bell-{me}")
    os.mkfifo(bell, 0o600)
    rfd = os.open(bell, os.O_RDONLY | os.O_NONBLOCK)
    keep = os.open(bell, os.O_WRONLY | os.O_NONBLOCK)  # noqa: F841 (held open: the pipe never reads as closed)

    def send(i: int) -> None:
        path = os.path.join(root, f"m{i}")
        fd = os.open(f"{path}.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        os.write(fd, payload)
        os.close(fd)
        os.replace(f"{path}.tmp", path)
        ring = os.open(os.path.join(root, f"bell-{1 - me}"), os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        os.fstat(ring)
        os.write(ring, b"\0")
        os.close(ring)

    def receive(i: int) -> None:
        path = os.path.join(root, f"m{i}")
        while True:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except FileNotFoundError:
                select.select([rfd], [], [], 0.02)
                os.read(rfd, 4096)
                continue
            os.read(fd, os.fstat(fd).st_size + 1)
            os.close(fd)
            os.unlink(path)
            return

    return _turns(me, n, send, receive)


def _turns(me: int, n: int, send, receive) -> tuple[float, float]:
    time.sleep(0.3)  # both sides ready
    sent = got = 0.0
    for i in range(n):
        if i % 2 == me:
            time.sleep(0.002)  # the receiver is asleep in its wait
            c0 = time.thread_time()
            send(i)
            sent += time.thread_time() - c0
        else:
            c0 = time.thread_time()
            receive(i)
            got += time.thread_time() - c0
    return sent / (n / 2), got / (n / 2)


def run_pair(side, n: int, payload: bytes) -> tuple[float, float]:
    """(send, receive) CPU seconds per message, the mean of the two processes."""
    root = tempfile.mkdtemp(prefix="ftkit-bench-msg-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        s, g = side(1, root, n, payload)
        os.write(w, f"{s} {g}".encode())
        os._exit(0)
    os.close(w)
    s0, g0 = side(0, root, n, payload)
    os.waitpid(pid, 0)
    s1, g1 = (float(x) for x in os.read(r, 100).split())
    os.close(r)
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    return (s0 + s1) / 2, (g0 + g1) / 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bytes", type=int, default=300, help="payload of a message (a report is a few hundred)")
    a = ap.parse_args()
    payload = b"x" * a.bytes
    sides = {
        "ftkit board (connection)": _board_side,
        "floor (bare stream connection)": _floor_side,
        "bare datagram (before)": _datagram_side,
        "files + pipe (before that)": _files_side,
    }
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
    for _ in range(a.rounds):
        for name, side in sides.items():  # interleaved: the machine's speed drifts
            results[name].append(run_pair(side, a.messages, payload))
    print(f"one {a.bytes}-byte message between two processes, every 2 ms; CPU per message, median of {a.rounds} rounds")
    for name, runs in results.items():
        send = statistics.median(s for s, _ in runs) * 1e6
        recv = statistics.median(g for _, g in runs) * 1e6
        print(f"  {name:30s} send {send:6.1f} us   receive (with its wake) {recv:6.1f} us   both {send + recv:6.1f} us")


if __name__ == "__main__":
    main()

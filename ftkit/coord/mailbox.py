"""A rank's mailbox on its node's board: a Unix datagram socket, `box-r<rank>` in the board's
directory, through which the node's ranks hand each other a step's messages (commit/shared.py
NodeGroup: reports, outcomes, the relayed peer reports) in one system call each way.

    box = Mailbox.open(address, path)   # the receiving rank, once: binds box-r<rank>
    box.wait(timeout_s)                 # True when a message came (else the timeout, at most FALLBACK_S)
    box.drain()                         # every message waiting: [(name, payload or None)]
    post(address, frame)                # a peer: one datagram (message_frame / notice_frame)

Why not files: a message posted as a file, then a byte in a doorbell pipe, cost its sender a
temporary file, a rename and the pipe's open, write and close, and its receiver a failed look,
the wake, the open, stat, read and close of the file and its unlink: about 155 us of CPU per
message on this VM, both sides, against 120 through the mailboxes and 65 for a bare datagram
(benchmarks/board_messages.py). A datagram arrives whole or not at all: nothing to frame.

A mailbox queues a few messages (net.unix.max_dgram_qlen, 10 by default); a sender finding it
full waits for room, up to PATIENCE_S (once: a mailbox that made it wait in vain gets no more
waiting until it takes a message again). A message bigger than MAX_FRAME, or one a mailbox
cannot take (not bound yet, still full, its rank gone), is posted as a file on the board with,
where possible, a notice naming it; the receiver reads the board's files at its first look
after binding and whenever FALLBACK_S pass with nothing in its mailbox, so no message is
lost, only later. The board's directory is private (0700, this user's: tiers/ram.py); what
arrives is untrusted all the same: a datagram that does not parse is dropped, and payloads
decode through the caller's checks.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import select
import socket
import stat
import struct
import threading
import time
import weakref

FALLBACK_S = 0.02  # the longest a receiver sleeps between two looks at the board's files
PATIENCE_S = 1.0  # the longest a sender waits for room in a full mailbox before posting a file
MAX_FRAME = 60 * 1024  # a datagram at most (under the default socket buffers); bigger goes as a file
MESSAGE, NOTICE = b"M", b"F"  # a frame's kind: the message itself, or "it is a file on the board"
MAX_DRAIN = 4096  # datagrams read by one drain (a flood stops there)
_NAME_RE = re.compile(rb"[A-Za-z0-9._-]{1,128}")
_AF_UNIX_PATH_MAX = 100  # sun_path holds 108 bytes; longer addresses go through /proc/self/fd


def box_name(rank: int) -> str:
    return f"box-r{rank}"


def message_frame(name: str, payload: bytes) -> bytes:
    return MESSAGE + name.encode() + b"\0" + payload


def notice_frame(name: str) -> bytes:
    return NOTICE + name.encode() + b"\0"


def parse_frame(frame: bytes) -> tuple[str, bytes | None] | None:
    """(name, payload; None for a notice) of one datagram; None if it is not a frame."""
    kind, sep_at = frame[:1], frame.find(b"\0", 1)
    if kind not in (MESSAGE, NOTICE) or sep_at < 0 or not _NAME_RE.fullmatch(frame, 1, sep_at):
        return None
    name = frame[1:sep_at].decode()
    if kind == NOTICE:
        return (name, None) if sep_at == len(frame) - 1 else None
    return name, frame[sep_at + 1 :]


class Addresses:
    """Where the mailboxes of one board directory are reached from this process: their paths,
    or, where a path is too long for a socket address, the same names under /proc/self/fd of
    a descriptor of the directory, which this object holds: its addresses hold while it lives."""

    def __init__(self, directory: str):
        self.directory = directory
        self._via: str | None = None  # the directory as /proc/self/fd/<fd>, once needed
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize | None = None

    def of(self, rank: int) -> str | None:
        path = os.path.join(self.directory, box_name(rank))
        if len(os.fsencode(path)) < _AF_UNIX_PATH_MAX:
            return path
        with self._lock:
            if self._via is None:
                self._via = self._open_dir()
        return f"{self._via}/{box_name(rank)}" if self._via else None

    def _open_dir(self) -> str:
        """The directory as /proc/self/fd/<fd>; "" where that cannot be had (no /proc)."""
        try:
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            return ""
        self._finalizer = weakref.finalize(self, _close_fd, fd)
        via = f"/proc/self/fd/{fd}"
        return via if os.path.isdir(via) else ""

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()


class Mailbox:
    """The receiving end of one rank's mailbox. One per (directory, rank) in a process
    (`Mailbox.open` hands out the same one again while it lives)."""

    _open: weakref.WeakValueDictionary[str, Mailbox] = weakref.WeakValueDictionary()
    _open_lock = threading.Lock()

    def __init__(self, sock: socket.socket, path: str, inode: int):
        self._sock = sock
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._buf = bytearray(MAX_FRAME + 1)
        self.fresh = True  # nothing looked at yet: messages posted before it was bound are files
        self._finalizer = weakref.finalize(self, _close_box, sock, path, inode)

    @classmethod
    def open(cls, address: str, path: str) -> Mailbox | None:
        """The mailbox at `path` (bound through `address`, the path or its /proc/self/fd form);
        None where none can be had: no Unix sockets, or something other than a socket at the
        name (left alone: the board's directory is untrusted)."""
        with cls._open_lock:
            box = cls._open.get(path)
            if box is None:
                box = cls._bind(address, path)
                if box is not None:
                    cls._open[path] = box
            return box

    @staticmethod
    def _bind(address: str, path: str) -> Mailbox | None:
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except (OSError, AttributeError):
            return None
        try:
            try:
                sock.bind(address)
            except OSError as e:
                # A socket left at the name by an earlier mailbox of this rank (the directory is this
                # attempt's; nobody else binds this rank's name): replaced. Anything else: left alone.
                if e.errno != errno.EADDRINUSE or not stat.S_ISSOCK(os.lstat(path).st_mode):
                    raise
                os.unlink(path)
                sock.bind(address)
            sock.setblocking(False)
            return Mailbox(sock, path, os.lstat(path).st_ino)
        except OSError:
            sock.close()
            return None

    def fileno(self) -> int:
        return self._sock.fileno()

    def wait(self, timeout_s: float) -> bool:
        """Until a message is waiting (True) or `timeout_s`, at most FALLBACK_S, passes (False)."""
        pause = max(0.0, min(timeout_s, FALLBACK_S))
        try:  # (poll, not select: a training process can hold more than 1024 descriptors)
            ready = self._poll.poll(pause * 1e3) if self._sock.fileno() >= 0 else None
        except OSError:
            ready = None
        if ready == []:  # the pause passed
            return False
        if ready and any(events & select.POLLIN for _, events in ready):
            return True
        time.sleep(pause)  # closed under it, or in error: wait all the same, the board's files remain
        return False

    def drain(self) -> list[tuple[str, bytes | None]]:
        """Every message waiting, in arrival order: (name, payload), payload None for a notice
        (the message is a file on the board). A datagram that is not a frame is dropped."""
        got = []
        for _ in range(MAX_DRAIN):
            try:
                n = self._sock.recv_into(self._buf)
            except OSError:
                break
            frame = parse_frame(bytes(memoryview(self._buf)[:n])) if n <= MAX_FRAME else None
            if frame is not None:
                got.append(frame)
        return got

    def close(self) -> None:
        self._finalizer()


_sender: socket.socket | None = None
_sender_lock = threading.Lock()
# Mailboxes that kept this process waiting PATIENCE_S in vain (a rank alive but not reading):
# no more waiting on them until one takes a message again, so a stuck rank costs its
# senders one wait, not one per message.
_unheeded: set[str] = set()


def post(address: str | None, frame: bytes, patient: bool = True) -> bool:
    """Send one frame to the mailbox at `address`; False where it cannot take it (none bound
    there, too big, or its queue still full after PATIENCE_S: a node's ranks can send its
    collector more at once than a mailbox queues): the sender posts a file instead.
    `patient` False: not even that wait (the training thread's sends), nor where this mailbox
    already let a sender wait in vain and has taken nothing since."""
    if address is None or len(frame) > MAX_FRAME:
        return False
    sender = _sender or _open_sender()
    if sender is None:
        return False
    patient = patient and address not in _unheeded
    try:
        sent = sender.sendto(frame, 0 if patient else socket.MSG_DONTWAIT, address)
    except OSError as e:  # ENOENT / ECONNREFUSED: nobody there; EAGAIN: still full; ENOTSOCK and the like: not a box
        if patient and e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            _unheeded.add(address)
        return False
    _unheeded.discard(address)
    return sent == len(frame)


def _open_sender() -> socket.socket | None:
    """This process's sending socket: blocking, for at most PATIENCE_S (SO_SNDTIMEO), while a
    mailbox's queue is full; a mailbox not bound, or whose rank is gone, refuses at once."""
    global _sender
    with _sender_lock:
        if _sender is None:
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                whole = int(PATIENCE_S)
                patience = struct.pack("ll", whole, int((PATIENCE_S - whole) * 1e6))  # (a struct timeval)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, patience)
            except (OSError, AttributeError, struct.error):
                return None
            _sender = s
        return _sender


def _close_fd(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _close_box(sock: socket.socket, path: str, inode: int) -> None:
    sock.close()
    with contextlib.suppress(OSError):
        if os.lstat(path).st_ino == inode:  # still the socket this box bound
            os.unlink(path)

"""A rank's mailbox on its node's board: a Unix stream socket at `box-r<rank>` over which the
node's ranks hand each other a step's messages (commit/node.py NodeGroup).

    box = Mailbox.open(address, path)   # the receiving rank, once
    box.wait(timeout_s)                 # True when something came, False at the timeout
    box.drain()                         # every whole message waiting: [(name, payload)]
    link = Link(address)                # a sender, one per mailbox it sends to, kept
    link.send(frame(name, payload), patience_s)   # True once written whole

Each message is one length-prefixed frame, in order on its connection (a layout arrives
before the report naming it); a stream has no datagram's size limit or short queue. The
kernel buffer is the backpressure, up to the sender's patience; a frame not written whole
closes its connection and is lost, as to a gone rank. What arrives is untrusted: a frame
over MAX_MESSAGE ends its connection, one whose name does not parse is dropped.
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

PATIENCE_S = 5.0  # a sender's wait for room in a mailbox, or for it to listen, unless told (a commit: its timeout)
MAX_MESSAGE = 256 * 2**20 + 256  # a frame's name and payload at most; longer ends its connection
MAX_CONNECTIONS = 1024  # connections a mailbox keeps (a node's ranks open one or two each, per tier)
READ_BYTES = 1 << 18  # one recv
MAX_DRAIN_READS = 64  # recvs per connection in one drain (a flood stops there, the rest waits)
_HEADER = struct.Struct("!I")
_NAME_RE = re.compile(rb"[A-Za-z0-9._-]{1,128}")
_AF_UNIX_PATH_MAX = 100  # sun_path holds 108 bytes; longer addresses go through /proc/self/fd
_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)  # a gone receiver is an error, never a SIGPIPE


def box_name(rank: int) -> str:
    return f"box-r{rank}"


def frame(name: str, payload: bytes) -> bytes:
    """One message as it goes down a connection: its length, its name, a NUL, its payload."""
    head = name.encode() + b"\0"
    return _HEADER.pack(len(head) + len(payload)) + head + payload


def split_frames(buf: bytearray) -> tuple[list[tuple[str, bytes]], bool]:
    """The whole frames at the front of `buf`, taken out of it, and whether what follows can
    still be a frame (False: a length over MAX_MESSAGE, the connection is not to be read on)."""
    got: list[tuple[str, bytes]] = []
    at = 0
    while len(buf) - at >= _HEADER.size:
        (n,) = _HEADER.unpack_from(buf, at)
        if n > MAX_MESSAGE:
            del buf[:at]
            return got, False
        end = at + _HEADER.size + n
        if end > len(buf):
            break
        body = bytes(buf[at + _HEADER.size : end])  # its name, a NUL, its payload
        sep_at = body.find(b"\0", 0, 130)
        if sep_at >= 1 and _NAME_RE.fullmatch(body, 0, sep_at):  # (else dropped)
            got.append((body[:sep_at].decode(), body[sep_at + 1 :]))
        at = end
    del buf[:at]
    return got, True


class Addresses:
    """Where the mailboxes of one board directory are reached from this process: their paths, or
    where a path is too long for a socket address, under /proc/self/fd of a descriptor it holds."""

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
    """The receiving end of one rank's mailbox: its listening socket and its senders' connections.
    One per (directory, rank) in a process (`Mailbox.open` hands out the same one while it lives)."""

    _open: weakref.WeakValueDictionary[str, Mailbox] = weakref.WeakValueDictionary()
    _open_lock = threading.Lock()

    def __init__(self, listener: socket.socket, path: str, inode: int):
        self._listener = listener
        self._poll = select.poll()
        self._poll.register(listener, select.POLLIN)
        # The senders' connections, by descriptor: the socket, and what it sent not parsed yet.
        self._conns: dict[int, tuple[socket.socket, bytearray]] = {}
        self._ready: list[tuple[int, int]] | None = None  # what the last `wait` found ready, not drained yet
        self._finalizer = weakref.finalize(self, _close_box, listener, self._conns, path, inode)

    @classmethod
    def open(cls, address: str, path: str) -> Mailbox | None:
        """The mailbox at `path` (bound through `address`, the path or its /proc/self/fd form);
        None where none can be had (no Unix sockets, or something else at the name: left alone)."""
        with cls._open_lock:
            box = cls._open.get(path)
            if box is None:
                box = cls._listen(address, path)
                if box is not None:
                    cls._open[path] = box
            return box

    @staticmethod
    def _listen(address: str, path: str) -> Mailbox | None:
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except (OSError, AttributeError):
            return None
        try:
            try:
                sock.bind(address)
            except OSError as e:
                # A socket left by an earlier mailbox of this rank is replaced; anything else left alone.
                if e.errno != errno.EADDRINUSE or not stat.S_ISSOCK(os.lstat(path).st_mode):
                    raise
                os.unlink(path)
                sock.bind(address)
            sock.listen(128)
            sock.setblocking(False)
            return Mailbox(sock, path, os.lstat(path).st_ino)
        except OSError:
            sock.close()
            return None

    def fileno(self) -> int:
        return self._listener.fileno()

    def wait(self, timeout_s: float) -> bool:
        """Until something came (a connection, a message, a sender gone: True) or `timeout_s`
        passes (False)."""
        pause = max(0.0, timeout_s)
        self._ready = self._ready_now(pause)
        if self._ready is None:  # closed under it: nothing will come
            time.sleep(pause)
            return False
        return bool(self._ready)

    def _ready_now(self, timeout_s: float) -> list[tuple[int, int]] | None:
        try:  # (poll, not select: a training process can hold more than 1024 descriptors)
            return self._poll.poll(timeout_s * 1e3) if self._listener.fileno() >= 0 else None
        except OSError:
            return None

    def drain(self) -> list[tuple[str, bytes]]:
        """Every whole message waiting, in each connection's order: (name, payload). A connection
        that sent a frame too long, or ended inside one, is closed and the piece dropped."""
        ready, self._ready = self._ready, None
        if ready is None:  # (not just woken by `wait`: what is ready now)
            ready = self._ready_now(0) or []
        got: list[tuple[str, bytes]] = []
        fds = [fd for fd, _ in ready]
        if self._listener.fileno() in fds:
            fds += self._accept()  # (read at once: a new sender's first message is there already)
        for fd in fds:
            if fd in self._conns:
                got += self._read(fd)
        return got

    def _read(self, fd: int) -> list[tuple[str, bytes]]:
        conn, buf = self._conns[fd]
        open_ = True
        for _ in range(MAX_DRAIN_READS):
            try:
                data = conn.recv(READ_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                data = b""
            if not data:
                open_ = False
                break
            buf += data
            if len(data) < READ_BYTES:
                break
        frames, sound = split_frames(buf)
        if not (open_ and sound):
            self._drop(fd)
        return frames

    def _accept(self) -> list[int]:
        """The connections opened since the last look, taken in: their descriptors."""
        new: list[int] = []
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # (BlockingIOError: none waiting; a closed mailbox: none to come)
                return new
            if len(self._conns) >= MAX_CONNECTIONS:
                conn.close()
                continue
            conn.setblocking(False)
            self._conns[conn.fileno()] = (conn, bytearray())
            self._poll.register(conn, select.POLLIN)
            new.append(conn.fileno())

    def _drop(self, fd: int) -> None:
        conn, _ = self._conns.pop(fd)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._poll.unregister(fd)
        conn.close()

    def close(self) -> None:
        self._finalizer()


class Link:
    """A sender's connection to one mailbox, opened at its first message and kept; thread-safe.
    `once`: the names sent once over this connection (sent again over a new one)."""

    def __init__(self, address: str | None):
        self.address = address
        self.once: set[str] = set()
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def send(self, data: bytes, patience_s: float) -> bool:
        """Write the frame `data` whole, waiting for room (or for the mailbox to listen) up to
        `patience_s`; False where it could not (the connection is then closed)."""
        if self.address is None:
            return False
        with self._lock:
            deadline = time.monotonic() + patience_s
            sock = self._sock or self._connect(deadline)
            if sock is not None and _write(sock, data, deadline):
                return True
            self._close()  # full, or its rank gone: a piece written is dropped at the other end
            return False

    def _connect(self, deadline: float) -> socket.socket | None:
        """A new connection, or None: no mailbox there (its rank not listening yet: tried again
        until `deadline`; refused: its rank is gone)."""
        assert self.address is not None
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(max(1e-3, deadline - time.monotonic()))
                sock.connect(self.address)
            except OSError as e:
                sock.close()
                left = deadline - time.monotonic()
                if e.errno != errno.ENOENT or left <= 0:
                    return None
                time.sleep(min(0.005, left))
                continue
            sock.setblocking(False)  # (every write tries at once: one system call, `_write`)
            self._sock = sock
            return sock

    def _close(self) -> None:
        """Close the connection; what went `once` over it goes again over the next one."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self.once.clear()

    def close(self) -> None:
        with self._lock:
            self._close()


def _write(sock: socket.socket, data: bytes, deadline: float) -> bool:
    """Write `data` down the non-blocking `sock`, waiting for room until `deadline`."""
    view = memoryview(data)
    poll: select.poll | None = None
    while view:
        try:
            view = view[sock.send(view, _FLAGS) :]
            continue
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if poll is None:
            poll = select.poll()
            poll.register(sock, select.POLLOUT)
        poll.poll(left * 1e3)
    return True


def _close_fd(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _close_box(listener: socket.socket, conns: dict[int, tuple[socket.socket, bytearray]], path: str, ino: int) -> None:
    listener.close()
    for conn, _ in conns.values():
        conn.close()
    conns.clear()
    with contextlib.suppress(OSError):
        if os.lstat(path).st_ino == ino:  # still the socket this box bound
            os.unlink(path)

"""A rank's doorbell on its node's board: a named pipe its peers write a byte to after
posting a message for it, so a rank waiting for its node's messages sleeps in `select`
instead of polling the board's directory (polling cost a waiting rank about 0.1 ms of CPU a
poll, over a millisecond per committed step; a wait now costs one wake per message).

    bell = Bell.listen(path)     # the waiting rank, once: creates and opens bell-r<rank>
    bell.wait(timeout_s)         # until rung (or the timeout); drains the rings
    ring(path)                   # a peer, after each message it posts

The bell only shortens waits: a waiter still reads the board after every wake and wakes
at least every `FALLBACK_S` (a ring lost to another waiter of the same bell, or sent
before the bell existed). Where a pipe cannot be made (a filesystem without them, or
something other than a pipe at the name: the board's directory is untrusted, a planted
regular file would read as always ringing) there is no bell and the waiter polls.
"""

from __future__ import annotations

import contextlib
import os
import select
import stat
import weakref

FALLBACK_S = 0.02  # the longest a waiter sleeps between two looks at the board


def bell_name(rank: int) -> str:
    return f"bell-r{rank}"


class Bell:
    """The read end of one rank's doorbell (and a write end of its own, so that the pipe
    never reads as closed while no peer has it open)."""

    def __init__(self, read_fd: int, keep_fd: int):
        self._fd = read_fd
        self._finalizer = weakref.finalize(self, _close_fds, read_fd, keep_fd)

    @staticmethod
    def listen(path: str) -> Bell | None:
        """The bell at `path`, made if missing; None where no pipe can be had."""
        try:
            os.mkfifo(path, 0o600)
        except FileExistsError:
            pass
        except OSError:
            return None
        read_fd = _open_fifo(path, os.O_RDONLY)
        if read_fd is None:
            return None
        keep_fd = _open_fifo(path, os.O_WRONLY)
        if keep_fd is None:
            os.close(read_fd)
            return None
        return Bell(read_fd, keep_fd)

    def wait(self, timeout_s: float) -> None:
        """Until a peer rings or `timeout_s` (at most FALLBACK_S) passes; then drain the rings."""
        with contextlib.suppress(OSError, ValueError):
            ready, _, _ = select.select([self._fd], [], [], max(0.0, min(timeout_s, FALLBACK_S)))
            if ready:  # one read drains it (a ring is a byte; more than 4 KiB of them only wakes us again)
                os.read(self._fd, 4096)

    def close(self) -> None:
        self._finalizer()


def ring(path: str) -> None:
    """Ring the bell at `path`, if someone listens there (nothing happens otherwise)."""
    fd = _open_fifo(path, os.O_WRONLY)  # ENXIO: nobody listening; ENOENT: no bell yet
    if fd is None:
        return
    try:
        os.write(fd, b"\0")
    except OSError:  # full: it has rung already
        pass
    finally:
        os.close(fd)


def _open_fifo(path: str, mode: int) -> int | None:
    """A non-blocking descriptor of the pipe at `path`; None if it is not one (or cannot open)."""
    try:
        fd = os.open(path, mode | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)

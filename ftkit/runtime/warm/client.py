"""The thin worker torchrun starts for a warm start: ``python -u .../runtime/warm/client.py [--module] TARGET ARGS``.

Standard library only, and run by its path (``-m ftkit...`` would import torch). It asks
this node's zygote (``$FTKIT_ZYGOTE``) to fork a worker that runs TARGET with this
process's arguments, environment, working directory and standard streams, then stands in
for it towards torchrun:

* signals sent here are passed on to the worker;
* the worker's end is this process's end: the same exit code, or death by the same signal;
* if this process is killed, the zygote SIGKILLs the worker; if torchrun's agent dies,
  the kernel SIGKILLs this process (``_end_with_agent``), and so the worker.

Without a zygote (unset, or no answer) this process execs ``python -m ftkit.runtime.launch``.

With ``$FTKIT_REPLACE_DEAD`` = N > 0 (``ftkit run --replace-dead N``), a worker SIGKILLed
while it recovers in process (ftkit.run_in_process keeps ``$FTKIT_REPLACEABLE`` while it
runs), and with no ending signal from torchrun, is replaced by a new one, at most N times:
torchrun never sees a death, and the new worker (``$FTKIT_REJOIN``) joins the survivors'
next generation (inprocess.py).

Wire format (shared with the zygote): a 4-byte big-endian length and a JSON object; the
request carries the three standard streams as SCM_RIGHTS file descriptors.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys
import time
from typing import Any, NoReturn

ZYGOTE_ENV = "FTKIT_ZYGOTE"  # the zygote's socket path
PROCESS_T_ENV = "FTKIT_PROCESS_T"  # (ftkit/coord/boot.py reads it: when this process started)
LAUNCHER_PID_ENV = "FTKIT_LAUNCHER_PID"  # the pid torchrun knows the worker by
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
ENDING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)  # what torchrun ends a group with
MAX_MESSAGE = 4 << 20  # an environment is a few kB; anything this large is not ours
REPLACE_ENV = "FTKIT_REPLACE_DEAD"  # how many times a killed worker may be replaced (0: never)
REPLACEABLE_ENV = "FTKIT_REPLACEABLE"  # a path: exists while the worker recovers in process
REJOIN_ENV = "FTKIT_REJOIN"  # on a replacement: which replacement it is (joins the next generation)


def send_message(sock: socket.socket, doc: dict, fds: list[int] | None = None) -> None:
    body = json.dumps(doc).encode()
    data = struct.pack(">I", len(body)) + body
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return buf


def recv_message(sock: socket.socket) -> dict:
    (size,) = struct.unpack(">I", recv_exact(sock, 4))
    if size > MAX_MESSAGE:
        raise ValueError(f"message of {size} bytes")
    doc = json.loads(recv_exact(sock, size))
    if not isinstance(doc, dict):
        raise ValueError("message is not an object")
    return doc


def _stat_field(pid: Any, index: int, missing: str | None = None) -> str | None:
    """Field `index` of /proc/PID/stat after the command name; `missing` without such a process,
    None without a pid or where it cannot be read (no /proc)."""
    if not pid:
        return None
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[index]
    except FileNotFoundError:
        return missing
    except (OSError, ValueError, IndexError):
        return None


def process_gone(pid: Any) -> bool:
    """A process on this host has exited (or is a zombie waiting for torchrun to reap it)."""
    return _stat_field(pid, 0, missing="X") in ("Z", "X")


def process_stopped(pid: Any) -> bool:
    """A process on this host is stopped (SIGSTOP, job control, a debugger)."""
    return _stat_field(pid, 0) in ("T", "t")


def process_start(pid: Any) -> int | None:
    """When a process on this host started, in clock ticks since boot (stat field 22), or None.

    With its pid it names one process for good (a reused pid has another start). Not psutil's
    create_time(): that adds a boot time that moves with the wall clock."""
    start = _stat_field(pid, 19)
    return int(start) if start is not None and start.isdigit() else None


def _cold(argv: list[str]) -> NoReturn:
    """Become the cold launcher in this process (torchrun keeps its pid), without what a warm
    agent's own client put in the environment."""
    os.environ.pop(PROCESS_T_ENV, None)
    os.environ.pop(LAUNCHER_PID_ENV, None)
    os.execv(sys.executable, [sys.executable, "-u", "-m", "ftkit.runtime.launch", *argv])


def die_like(status: dict) -> NoReturn:
    """End this process as the worker that ended with `status` ({"signal": N} or {"exit": code}) did,
    what it printed flushed first (neither way of ending does)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # (closed, or a pipe nobody reads)
            stream.flush()
    sig = status.get("signal")
    if isinstance(sig, int) and sig > 0:
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # (those two cannot be handled, so need no reset)
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        time.sleep(1)  # a stopped-and-continued or ignored signal: fall through to an exit code
        os._exit(128 + sig)
    code = status.get("exit")
    os._exit(code if isinstance(code, int) and 0 <= code < 256 else 1)


def _request(path: str, argv: list[str], env: dict[str, str]) -> tuple[socket.socket, int]:
    """Ask the zygote for a worker; (the connection its end comes back on, its pid)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        send_message(sock, {"argv": argv, "env": env, "cwd": os.getcwd()}, [0, 1, 2])
        reply = recv_message(sock)
        if "error" in reply:
            raise ValueError(f"refused: {reply['error']}")
        return sock, int(reply["pid"])
    except BaseException:
        sock.close()
        raise


def replacements_allowed() -> int:
    """How many times a killed worker may be replaced (``$FTKIT_REPLACE_DEAD``; 0 when unset or not a number)."""
    try:
        return max(0, int(os.environ.get(REPLACE_ENV, "0") or 0))
    except ValueError:
        return 0


def _replaceable(status: dict, ending: bool, replaced: int, allowed: int, mark: str) -> bool:
    """Whether a worker that ended with `status` is replaced rather than passed on to torchrun."""
    return status.get("signal") == signal.SIGKILL and not ending and replaced < allowed and os.path.exists(mark)


def _end_with_agent() -> None:
    """Have the kernel SIGKILL this process when its parent, torchrun's agent, dies (Linux's
    PR_SET_PDEATHSIG; kept across a cold start's exec): workers of a lost agent would otherwise
    train on as orphans. With this client gone the zygote ends a warm worker too."""
    parent = os.getppid()
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


def main(argv: list[str]) -> None:
    started = time.time()
    _end_with_agent()
    path = os.environ.get(ZYGOTE_ENV)
    if not argv:
        print("usage: client.py [--module] TARGET [ARGS...]", file=sys.stderr)
        os._exit(2)
    if not path:
        _cold(argv)
    env = {**os.environ, PROCESS_T_ENV: repr(started), LAUNCHER_PID_ENV: str(os.getpid())}
    allowed = replacements_allowed()
    mark = os.path.join(os.path.dirname(path), f"replaceable-{os.getpid()}")
    if allowed:
        env[REPLACEABLE_ENV] = mark
    try:
        sock, worker = _request(path, argv, env)
    except (OSError, EOFError, ValueError) as e:
        print(f"ftkit: warm start unavailable ({path}: {e}); starting the worker cold", file=sys.stderr, flush=True)
        _cold(argv)
    ending = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal ending
        ending = ending or signum in ENDING
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signum)
            if signum in ENDING and process_stopped(worker):
                # A stopped worker cannot act on it: end it now, not after torchrun's shutdown timeout.
                os.killpg(worker, signal.SIGKILL)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    replaced = 0
    while True:
        try:
            status = recv_message(sock)  # blocks until the worker ends (signals are forwarded meanwhile)
        except (OSError, EOFError, ValueError) as e:
            # The zygote is gone: the worker's end cannot be learnt, so end it rather than leave it behind.
            print(f"ftkit: lost the zygote ({e}); ending worker {worker}", file=sys.stderr, flush=True)
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
            os._exit(1)
        sock.close()
        replace = _replaceable(status, ending, replaced, allowed, mark)
        with contextlib.suppress(OSError):
            os.unlink(mark)
        if not replace:
            die_like(status)
        replaced += 1
        print(f"ftkit: worker {worker} was killed; starting replacement {replaced} of {allowed}", file=sys.stderr)
        try:
            sock, worker = _request(path, argv, {**env, REJOIN_ENV: str(replaced), PROCESS_T_ENV: repr(time.time())})
        except (OSError, EOFError, ValueError) as e:
            print(f"ftkit: no replacement ({e}); ending as the worker did", file=sys.stderr, flush=True)
            die_like(status)


if __name__ == "__main__":
    main(sys.argv[1:])

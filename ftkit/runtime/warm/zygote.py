"""The per-node zygote: torch imported once, a worker forked from it per request.

The starter (``ftkit run``, the drill) calls :func:`start`, which binds the listening socket
itself (clients may connect at once and wait in the backlog while the zygote imports);
each client (client.py) sends a request; :func:`serve` forks a worker per request, which
runs the script through ``ftkit.runtime.launch`` (:func:`main`); :meth:`Zygote.stop` ends it.
A zygote whose starter is gone (killed: nobody is left to stop it) ends by itself once the
workers it serves have ended (torchrun may outlive the starter, and be running them still).

The zygote is single-threaded (a selector loop), never initialises CUDA and runs no tensor
operation, so forking it is as safe as PyTorch's fork-started DataLoader workers. A worker
gets the client's process state, a fresh session (its own process group) and fresh seeds;
a client whose connection closes gets its worker's process group SIGKILLed. Only the
zygote's own user may connect (SO_PEERCRED). A request is read as it arrives: a
connection with no whole request within REQUEST_TIMEOUT_S is dropped, delaying no one
else (at most MAX_PENDING are read at once; the rest wait in the backlog).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import random
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ftkit.runtime.warm import agent
from ftkit.runtime.warm import client as wire

# torch._dynamo: the first optimizer.step() imports it
DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.optim", "ftkit", "ftkit.runtime.launch")
REQUEST_TIMEOUT_S = 5.0  # a client sends its request as soon as it connects: one silent this long is dropped
MAX_PENDING = 64  # requests read at once; more connections wait in the listener's backlog (bounded fds)


class Zygote:
    def __init__(self, proc: subprocess.Popen, directory: str, starter_end: int):
        self.proc = proc
        self.directory = directory
        self.socket_path = os.path.join(directory, "zygote.sock")
        self._starter_end = os.fdopen(starter_end, "wb")  # the zygote reads EOF once the starter has closed it

    def env(self) -> dict[str, str]:
        """What the workers' environment needs so their clients find this zygote."""
        return {wire.ZYGOTE_ENV: self.socket_path}

    def stop(self, timeout: float = 10.0) -> None:
        """End the zygote and every worker it still has; remove its directory. Idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()  # it SIGKILLs its workers' groups, then exits
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # Its socket, and replaceable-<pid> marks that killed clients left (client.py).
        shutil.rmtree(self.directory, ignore_errors=True)
        self._starter_end.close()


def client_path() -> str:
    """The thin client's file, for torchrun's command line (it runs by path: no ftkit import)."""
    return os.path.abspath(wire.__file__)


def torchrun_command(zygote: Zygote | None, torchrun_args: list[str]) -> list[str]:
    """torchrun's command line, running ftkit/runtime/warm/agent.py: by path in a new
    interpreter without a zygote, else forked warm through the thin client, as a worker is
    (the job's environment then needs zygote.env())."""
    if zygote is None:
        return [sys.executable, agent.__file__, *torchrun_args]
    return [sys.executable, "-u", client_path(), "--module", "ftkit.runtime.warm.agent", *torchrun_args]


def start(
    env: dict[str, str] | None = None,
    preload: tuple[str, ...] = (),
    stderr: Any = None,
    parent: str | None = None,
    spawn: Callable[..., subprocess.Popen] = subprocess.Popen,
) -> Zygote:
    """Start a zygote with `env` (the workers' environment, less torchrun's per-worker variables).

    `parent`: where its private directory (the socket) goes (default: the temporary
    directory); `spawn`: what starts its process (Popen's signature; ftkit/drill/hosts.py
    starts it inside an emulated host)."""
    directory = tempfile.mkdtemp(prefix="ftkit-zygote-", dir=parent)  # 0700: only this user can reach the socket
    path = os.path.join(directory, "zygote.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Only this process holds the write end (not inherited): the zygote reads EOF once it is gone,
    # however it ends, whichever thread called this.
    starter_r, starter_w = os.pipe()
    try:
        listener.bind(path)
        listener.listen(512)
        cmd = [sys.executable, "-m", "ftkit.runtime.warm.zygote", "--fd", str(listener.fileno())]
        cmd += ["--starter-fd", str(starter_r)]
        if preload:
            cmd += ["--preload", ",".join(preload)]
        proc = spawn(
            cmd,
            env=env if env is not None else dict(os.environ),
            pass_fds=[listener.fileno(), starter_r],
            stdin=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,  # a terminal's Ctrl-C reaches workers through their clients, once
        )
    except BaseException:
        os.close(starter_w)
        raise
    finally:
        listener.close()  # the zygote holds it now; if it dies, waiting clients see the socket close
        os.close(starter_r)
    return Zygote(proc, directory, starter_w)


# ------------------------------------------------------------------ the server side
def _preload(modules: tuple[str, ...]) -> None:
    t0 = time.perf_counter()
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # a missing optional module costs its workers the import, nothing else
            _say(f"cannot preload {name}: {type(e).__name__}: {e}")
    _say(f"preloaded {', '.join(modules)} in {time.perf_counter() - t0:.2f}s", quiet=True)


def _say(message: str, quiet: bool = False) -> None:
    # print, not logging: a worker forked from here must find logging as a fresh interpreter has it
    if not quiet or os.environ.get("FTKIT_ZYGOTE_VERBOSE"):
        print(f"ftkit zygote: {message}", file=sys.stderr, flush=True)


class _Pending:
    """A non-blocking connection whose request is still arriving, dropped at its own deadline."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.data = bytearray()
        self.fds: list[int] = []

    def read(self, conn: socket.socket) -> tuple[dict, list[int]] | None:
        """Take what `conn` has sent so far: the request (and its streams) once it is whole, else
        None. Raises on a closed connection or a malformed request; `close()` then."""
        try:
            data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
        except BlockingIOError:  # (woken with nothing to read after all)
            return None
        self.fds += fds
        if not data:
            raise EOFError("connection closed")
        self.data += data
        if len(self.data) < 4:
            return None
        (size,) = struct.unpack_from(">I", self.data)
        if size > wire.MAX_MESSAGE:
            raise ValueError(f"request of {size} bytes")
        if len(self.data) < 4 + size:
            return None
        doc = json.loads(self.data[4:])  # (bytes past `size` make it malformed, as they should)
        if (
            not isinstance(doc, dict)
            or not isinstance(doc.get("argv"), list)
            or not all(isinstance(a, str) for a in doc["argv"])
            or not isinstance(doc.get("env"), dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in doc["env"].items())
            or not isinstance(doc.get("cwd"), str)
            or len(self.fds) != 3
        ):
            raise ValueError("malformed request")
        fds, self.fds = self.fds, []  # the caller's now
        return doc, fds

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


def _same_user(conn: socket.socket) -> bool:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.getuid()


def _status(raw: int) -> dict:
    if os.WIFSIGNALED(raw):
        return {"signal": os.WTERMSIG(raw)}
    return {"exit": os.waitstatus_to_exitcode(raw) if os.WIFEXITED(raw) else 1}


def _become_worker(request: dict, fds: list[int], close: list[Any]) -> list[str]:
    """In the forked child: shed the zygote, take on the client's process state; the arguments
    it runs ftkit.runtime.launch with (the client's)."""
    from ftkit.coord import boot

    forked_t = time.time()
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for thing in close:
        with contextlib.suppress(OSError):
            if isinstance(thing, int):
                os.close(thing)
            else:
                thing.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.setsid()
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    # The client's PYTHONPATH on sys.path, ahead of site-packages as a cold interpreter has it.
    entries = [os.path.abspath(e) for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    for i, entry in enumerate(e for e in entries if e not in sys.path):
        sys.path.insert(1 + i, entry)
    random.seed()  # its own seeds, as a freshly started interpreter would have
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    torch, threads = sys.modules.get("torch"), os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))
    boot.reset()
    boot.mark("forked", forked_t)
    return list(request["argv"])


def serve(listener: socket.socket, starter: int) -> list[str] | None:
    """Fork a worker per request until SIGTERM, or until `starter` (a pipe's read end) reads EOF
    and no worker is left. Returns only in a forked child (its launch arguments)."""
    me = os.getpid()
    stopping = orphaned = False

    def on_term(_sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    listener.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    sel.register(starter, selectors.EVENT_READ)  # (nothing is written to it: readable means EOF)
    listening = True
    pending: dict[socket.socket, _Pending] = {}  # in the order accepted: their deadlines' order too
    by_pid: dict[int, socket.socket | None] = {}  # None: its client is gone (a served one's selector data: the pid)

    def reap() -> None:
        while by_pid:
            try:
                pid, raw = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = by_pid.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    sel.unregister(conn)
                with contextlib.suppress(OSError):
                    wire.send_message(conn, _status(raw))
                conn.close()

    def drop(conn: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn)
        pending.pop(conn).close()
        conn.close()

    def accept() -> None:
        while len(pending) < MAX_PENDING:
            try:
                conn, _ = listener.accept()
            except OSError:  # (BlockingIOError: none left in the backlog)
                return
            try:
                if not _same_user(conn):
                    wire.send_message(conn, {"error": "not the zygote's user"})
                    conn.close()
                    continue
                conn.setblocking(False)
            except OSError as e:
                _say(f"a bad connection: {e}")
                conn.close()
                continue
            pending[conn] = _Pending(time.monotonic() + REQUEST_TIMEOUT_S)
            sel.register(conn, selectors.EVENT_READ, pending[conn])

    def fork(conn: socket.socket, request: dict, fds: list[int]) -> list[str] | None:
        pid = os.fork()
        if pid == 0:
            sel.close()
            others = [fd for p in pending.values() for fd in p.fds]  # other clients' streams are not its own
            served = [c for c in by_pid.values() if c is not None]
            return _become_worker(request, fds, [listener, conn, *served, *pending, *others, wake_r, wake_w, starter])
        for fd in fds:
            os.close(fd)
        conn.setblocking(True)  # (its replies are a few bytes: they never wait)
        try:
            wire.send_message(conn, {"pid": pid})
        except OSError:  # the client is gone already: so must the worker be
            _kill_group(pid)
        by_pid[pid] = conn
        sel.register(conn, selectors.EVENT_READ, pid)
        return None

    try:
        while not stopping:
            now = time.monotonic()
            while pending:  # the oldest first: theirs are the nearest deadlines
                conn, p = next(iter(pending.items()))
                if p.deadline > now:
                    break
                _say(f"dropped a client that sent no whole request within {REQUEST_TIMEOUT_S:.0f}s")
                drop(conn)
            if listening != (len(pending) < MAX_PENDING):  # full: the rest wait in the backlog
                listening = not listening
                if listening:
                    sel.register(listener, selectors.EVENT_READ)
                else:
                    sel.unregister(listener)
            timeout = 1.0 if not pending else min(1.0, max(0.0, next(iter(pending.values())).deadline - now))
            for key, _ in sel.select(timeout=timeout):
                if key.fileobj is listener:
                    accept()
                elif key.fileobj is wake_r:
                    with contextlib.suppress(OSError):
                        while os.read(wake_r, 512):
                            pass
                elif key.fileobj == starter:
                    sel.unregister(starter)
                    orphaned = True
                    _say(f"its starter is gone: ending once its {len(by_pid)} worker(s) have", quiet=True)
                elif isinstance(key.data, _Pending):  # a request arriving
                    conn = key.fileobj  # type: ignore[assignment]
                    try:
                        whole = key.data.read(conn)
                    except (OSError, EOFError, ValueError, RecursionError) as e:  # (deep JSON: RecursionError)
                        _say(f"a bad request: {e}")
                        drop(conn)
                        continue
                    if whole is None:
                        continue
                    sel.unregister(conn)
                    del pending[conn]
                    argv = fork(conn, *whole)
                    if argv is not None:
                        return argv
                else:  # a served client spoke or closed: it has nothing to say, so it is gone
                    conn = key.fileobj  # type: ignore[assignment]
                    gone = True
                    with contextlib.suppress(OSError):
                        gone = conn.recv(1) == b""
                    if gone:
                        sel.unregister(conn)
                        _kill_group(key.data)  # reaped below; nobody left to tell
                        by_pid[key.data] = None
            reap()
            stopping = stopping or (orphaned and not by_pid)
    finally:
        if os.getpid() == me:
            for conn in list(pending):
                drop(conn)
            for pid in list(by_pid):
                _kill_group(pid)
            deadline = time.monotonic() + 5
            while by_pid and time.monotonic() < deadline:
                reap()
                time.sleep(0.01)
    return None


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):  # its group (set up right after the fork), else the process
        try:
            kill(pid, signal.SIGKILL)
            return
        except (ProcessLookupError, PermissionError):
            continue


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ftkit.runtime.warm.zygote")
    p.add_argument("--fd", type=int, required=True, help="the listening Unix socket, bound by the starter")
    p.add_argument("--starter-fd", type=int, required=True, help="a pipe that reads EOF once the starter is gone")
    p.add_argument("--preload", default="", help="more modules to import, comma-separated")
    args = p.parse_args(argv)
    listener = socket.socket(fileno=args.fd)
    extra = tuple(m for m in args.preload.split(",") if m)
    _preload(DEFAULT_PRELOAD + extra)
    # The imports are never garbage: keep them out of every collection, and so out of the
    # pages a collection would touch (copy-on-write would copy them in each worker).
    gc.freeze()
    directory = os.path.dirname(listener.getsockname())
    argv = serve(listener, args.starter_fd)
    if argv is None:
        shutil.rmtree(directory, ignore_errors=True)  # (its starter's stop() would, if it is there)
        return
    from ftkit.runtime.launch import main as launch

    launch(argv)  # the script's SystemExit, exceptions and exit are the worker's own


if __name__ == "__main__":
    main()

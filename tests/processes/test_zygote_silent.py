"""The zygote (ftkit/runtime/warm/zygote.py) reads requests as they arrive: connections that send
nothing, or half a request, are dropped at their own deadline and hold up no warm start. It
ends with its starter (ftkit run, a drill), once the workers it serves have ended.

Real processes: a zygote of its own, raw connections to its socket, a real client started
as torchrun starts one (``python -u .../client.py SCRIPT ARGS``).
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time

from conftest import warm_target

from ftkit.runtime.warm import zygote
from ftkit.runtime.warm.client import process_gone
from ftkit.runtime.warm.zygote import client_path

SCRIPT = """
import os, sys
with open(sys.argv[1], "w") as f:
    f.write(str(os.getpid()))
print("served", sys.stdin.readline().strip(), flush=True)  # runs until the test says so
"""


def _open(sock: socket.socket) -> bool:
    """Whether the zygote still holds `sock`'s other end (it never writes to a silent client)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)


def _wait_for(path, timeout: float = 60.0) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if os.path.exists(path) and os.path.getsize(path):
            return open(path).read()
        time.sleep(0.02)
    raise AssertionError(f"{path} never appeared")


def test_silent_clients_are_dropped_at_their_deadline_and_hold_up_no_warm_start(tmp_path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    log = tmp_path / "zygote.err"
    with open(log, "w") as err:
        z = zygote.start(stderr=err)
    silent: list[socket.socket] = []
    try:
        # Three same-user connections ahead of the real client: one says nothing, one half a
        # length, one a length and part of the body (a slow client); none ever says more.
        for sent in (b"", b"\x00\x00", b'\x00\x00\x00\x40{"argv": ['):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(z.socket_path)
            s.sendall(sent)
            silent.append(s)
        out = tmp_path / "worker.pid"
        client = subprocess.Popen(
            [sys.executable, "-u", zygote.client_path(), str(script), str(out)],
            env={**os.environ, **z.env()},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        worker = int(_wait_for(out))
        # Served while all three still wait for their deadline (served one at a time, with a 5 s
        # read each, the first would have been dropped before this client was even read).
        assert [_open(s) for s in silent] == [True, True, True]
        # Each is dropped at its deadline, while the worker runs: it holds none of them open.
        for s in silent:
            s.settimeout(60)
            assert s.recv(1) == b""
        assert client.poll() is None and os.path.exists(f"/proc/{worker}")
        # A request too deeply nested to decode is refused like any malformed one; the zygote serves on.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as deep:
            deep.connect(z.socket_path)
            deep.sendall(struct.pack(">I", 100_000) + b"[" * 100_000)
            deep.settimeout(60)
            assert deep.recv(1) == b""
        stdout, stderr = client.communicate(input="ok\n", timeout=60)
        assert client.returncode == 0, stderr
        assert stdout == "served ok\n" and "cold" not in stderr  # a warm worker, not the cold fallback
    finally:
        for s in silent:
            s.close()
        z.stop()
    assert z.proc.returncode == 0  # it served on to the end, and stopped when told
    text = log.read_text()
    assert text.count("dropped a client that sent no whole request") == 3 and "a bad request" in text


STARTER = """
import os, sys, time
from ftkit.runtime.warm import zygote
with open(sys.argv[1], "w") as err:
    z = zygote.start(env={**os.environ, "FTKIT_ZYGOTE_VERBOSE": "1"}, stderr=err)
print(os.getpid(), z.proc.pid, z.socket_path, flush=True)
time.sleep(600)
"""


def test_the_zygote_ends_with_its_starter_once_its_workers_have(tmp_path, zygote) -> None:
    """Its starter (ftkit run) SIGKILLed, as a batch system kills a job's process group: the zygote,
    in a session of its own, was left running for good with its preloaded torch. It serves the
    worker it has to its end (torchrun may still be running it), then ends and removes its socket."""
    (tmp_path / "starter.py").write_text(STARTER)
    (tmp_path / "script.py").write_text(SCRIPT)
    log, out = tmp_path / "zygote.err", tmp_path / "worker.pid"
    # The starter is forked warm from this session's zygote (no torch import of its own to wait for).
    starter = subprocess.Popen(
        [sys.executable, "-u", *warm_target(zygote, [str(tmp_path / "starter.py"), str(log)])],
        env={**os.environ, **zygote.env()},
        stdout=subprocess.PIPE,
        text=True,
    )
    pid, zygote_pid, socket_path = starter.stdout.readline().split()
    client = subprocess.Popen(
        [sys.executable, "-u", client_path(), str(tmp_path / "script.py"), str(out)],
        env={**os.environ, "FTKIT_ZYGOTE": socket_path},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        worker = int(_wait_for(out))
        os.kill(int(pid), signal.SIGKILL)
        assert starter.wait(timeout=30) == -signal.SIGKILL
        end = time.monotonic() + 60
        while "starter is gone" not in log.read_text() and time.monotonic() < end:
            time.sleep(0.05)
        assert "starter is gone" in log.read_text()
        assert not process_gone(zygote_pid) and not process_gone(worker)  # its worker runs on, served
        stdout, stderr = client.communicate(input="ok\n", timeout=60)
        assert client.returncode == 0 and stdout == "served ok\n", stderr
        end = time.monotonic() + 60
        while not process_gone(zygote_pid) and time.monotonic() < end:
            time.sleep(0.05)
        assert process_gone(zygote_pid) and not os.path.exists(os.path.dirname(socket_path))
    finally:
        client.kill()
        if not process_gone(zygote_pid):  # (left running for good before)
            os.kill(int(zygote_pid), signal.SIGKILL)

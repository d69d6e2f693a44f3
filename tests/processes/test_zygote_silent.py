"""The zygote (ftkit/runtime/warm/zygote.py) reads requests as they arrive: connections that send
nothing, or half a request, are dropped at their own deadline and hold up no warm start.

Real processes: a zygote of its own, raw connections to its socket, a real client started
as torchrun starts one (``python -u .../client.py SCRIPT ARGS``).
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time

from ftkit.runtime.warm import zygote

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

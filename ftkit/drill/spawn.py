"""Helpers for the local servers ftkit spawns (the S3 server): free port pairs,
and a child process that the kernel stops when its parent dies."""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import sys
import threading
from pathlib import Path

HOST = "127.0.0.1"
# weed derives each gRPC port as HTTP port + 10000 (GrpcPortOffset in
# weed/command/mini.go); we pass them explicitly but keep that layout.
GRPC_PORT_OFFSET = 10000


def _port_is_free(port: int) -> bool:
    # weed refuses an explicitly requested port unless it is free both on the
    # bind ip and on all interfaces, so check both.
    for host in (HOST, "0.0.0.0"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def _ephemeral_port_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def pick_ports(names) -> dict[str, int]:
    """Free HTTP ports P, one per name, such that P + 10000 is free too.

    Ports are drawn below the kernel's ephemeral range when possible: while
    the server is down for a restart, clients retrying connections consume
    ephemeral ports, and one of them could grab a port we must rebind.
    Falls back to kernel-assigned ports (bind to port 0).
    """
    chosen: dict[str, int] = {}
    taken: set[int] = set()

    def usable(port: int) -> bool:
        grpc = port + GRPC_PORT_OFFSET
        return grpc < 65536 and not {port, grpc} & taken and _port_is_free(port) and _port_is_free(grpc)

    def take(name: str, port: int) -> None:
        chosen[name] = port
        taken.update((port, port + GRPC_PORT_OFFSET))

    lo, hi = 10000, min(_ephemeral_port_range()[0], 65536) - GRPC_PORT_OFFSET
    rng = random.SystemRandom()
    for name in names:
        for _ in range(200 if hi > lo else 0):
            port = rng.randrange(lo, hi)
            if usable(port):
                take(name, port)
                break
        else:
            for _ in range(200):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((HOST, 0))
                    port = s.getsockname()[1]
                if usable(port):
                    take(name, port)
                    break
            else:
                raise RuntimeError("could not find free ports for the S3 server")
    return chosen


def pdeathsig_preexec():
    """preexec_fn making the kernel SIGTERM weed when our process dies, or None.

    Guards against orphaned servers when pytest is SIGKILLed. Linux only, and
    only when called from the main thread: PR_SET_PDEATHSIG fires when the
    *thread* that forked exits, so a server (re)started from a short-lived
    worker thread would otherwise be killed as soon as that thread ends.
    """
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    parent = os.getpid()

    def preexec() -> None:  # runs in the child between fork and exec
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # parent already died before prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec

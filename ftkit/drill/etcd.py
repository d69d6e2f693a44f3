"""A real etcd (Debian's ``etcd-server``, v2 API on) on a host of its own in a :class:`Fabric`, for
torch's ``etcd`` and ``etcd-v2`` rendezvous (client: ``python-etcd``). Its data dir is on the etcd
host's private /tmp: nothing outlives the fabric."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import time
from typing import IO, Any

from ftkit.drill.hosts import Fabric, Host, HostsError, hosts_unavailable

CLIENT_PORT = 2379

# Run inside the etcd host: exit 0 once etcd answers /health as healthy and serves the v2 API.
_PROBE = r"""
import json, sys, urllib.request
base = sys.argv[1]
try:
    ok = json.load(urllib.request.urlopen(base + "/health", timeout=1)).get("health") == "true"
    urllib.request.urlopen(base + "/v2/keys/", timeout=1).read()
except Exception as e:
    print(type(e).__name__, e)
    sys.exit(1)
sys.exit(0 if ok else 1)
"""


def etcd_unavailable() -> str | None:
    """None where :class:`Etcd` can run here, else one line saying why not."""
    reason = hosts_unavailable()
    if reason:
        return reason
    if shutil.which("etcd") is None:
        return "etcd is not on PATH (scripts/setup.sh installs Debian's etcd-server where it runs as root)"
    if importlib.util.find_spec("etcd") is None:  # python-etcd: torch's etcd rendezvous client
        return "python-etcd is not installed (pip install ftkit[drill])"
    return None


class Etcd:
    """One etcd member on `host` (default: a new host ``etcd`` added to `fabric`); `log` takes its output.
    ``with Etcd(fab) as etcd:`` (or :meth:`start` ... :meth:`stop`), then ``--rdzv-endpoint`` :attr:`endpoint`.
    """

    port = CLIENT_PORT  # its client port, on its host's address

    def __init__(self, fabric: Fabric, host: Host | None = None, *, log: IO[Any] | None = None) -> None:
        self.fabric = fabric
        self.host = host
        self.log = log
        self.proc: subprocess.Popen[Any] | None = None

    @property
    def endpoint(self) -> str:
        """``address:port`` of its client URL, as ``--rdzv-endpoint`` wants it."""
        if self.host is None:
            raise HostsError("etcd is not started")
        return f"{self.host.address}:{self.port}"

    def start(self, timeout: float = 30.0) -> Etcd:
        """Start etcd and wait until it is healthy with the v2 API on."""
        if shutil.which("etcd") is None:
            raise HostsError("etcd is not on PATH (scripts/setup.sh installs Debian's etcd-server)")
        host = self.host = self.host or self.fabric.add_host("etcd")
        argv = ["etcd", "--name", "ftkh-etcd", "--data-dir", "/tmp/ftkh-etcd", "--enable-v2"]
        argv += ["--listen-client-urls", f"http://0.0.0.0:{self.port}"]
        argv += ["--advertise-client-urls", f"http://{self.endpoint}"]
        peer = "http://127.0.0.1:2380"  # one member: peers on its own loopback
        argv += ["--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer]
        argv += ["--initial-cluster", f"ftkh-etcd={peer}", "--logger", "zap", "--log-outputs", "stderr"]
        out = self.log if self.log is not None else subprocess.DEVNULL
        self.proc = proc = host.run(argv, stdout=out, stderr=out)
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None:
                r = host.call([sys.executable, "-S", "-c", _PROBE, f"http://127.0.0.1:{self.port}"], timeout=10)
                if r.returncode == 0:
                    return self
                if time.monotonic() > deadline:
                    raise HostsError(f"etcd not healthy after {timeout:.0f} s: {r.stdout.strip() or r.stderr.strip()}")
                time.sleep(0.1)
            raise HostsError(f"etcd exited with {proc.returncode} before it was healthy")
        except BaseException:  # (a probe that hung, a signal): `with` does not call __exit__ then
            self.stop()
            raise

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, SIGKILL after `timeout`; nothing if not running (or its host was lost)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> Etcd:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

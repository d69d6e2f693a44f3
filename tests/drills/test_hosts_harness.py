"""The emulated-hosts harness itself (ftkit/drill/hosts.py): isolation, faults, cleanup."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid

import psutil
import pytest

from ftkit.drill.etcd import Etcd, etcd_unavailable
from ftkit.drill.hosts import NETNS_DIR, Fabric, cleanup_stale, hosts_unavailable, leftovers

_WHY = hosts_unavailable()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")

PY = sys.executable
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Serves "hi" to every connection on port $1 (inside a host), until killed.
SERVER = "import socket,sys\ns=socket.create_server(('',int(sys.argv[1])))\nwhile 1: s.accept()[0].sendall(b'hi')"
# Prints what host $1 port $2 answers within $3 s ("hi"), else the error (exit 1).
CLIENT = textwrap.dedent(
    """
    import socket, sys
    try:
        print(socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).recv(2).decode())
    except OSError as e:
        print(type(e).__name__, e); sys.exit(1)
    """
)


def reaches(host, target: str, port: int, timeout: float = 2.0) -> bool:
    r = host.call([PY, "-S", "-c", CLIENT, target, str(port), str(timeout)], timeout=timeout + 20)
    return r.returncode == 0 and r.stdout.strip() == "hi"


def serve(host, port: int = 9000) -> subprocess.Popen:
    proc = host.run([PY, "-S", "-c", SERVER, str(port)])
    deadline = time.monotonic() + 10
    while not reaches(host, "127.0.0.1", port, 1):
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    return proc


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def fabric(tmp_path):
    with Fabric(2, shared=[str(tmp_path)]) as fab:
        yield fab
    assert leftovers(fab.id) == []


def test_hosts_reach_each_other_and_nothing_else(fabric):
    h1, h2 = fabric.hosts
    serve(h1)
    assert reaches(h2, "host1", 9000) and reaches(h2, h1.address, 9000)
    # a service on the root namespace's loopback (and any address of it) is out of reach
    with socket.create_server(("127.0.0.1", 0)) as root_srv:
        assert not reaches(h2, "127.0.0.1", root_srv.getsockname()[1])
    r = h2.call(["ip", "route"])
    assert "default" not in r.stdout and r.stdout.strip().startswith(str(fabric.subnet))
    r = h2.call([PY, "-S", "-c", CLIENT, "192.0.2.1", "80", "2"])
    assert r.returncode == 1 and "unreachable" in r.stdout.lower()
    assert "ftkh" not in subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout


def test_own_hostname_shm_and_tmp(fabric):
    h1, h2 = fabric.hosts
    assert h1.call(["hostname"]).stdout.strip() == "host1"
    assert h2.call([PY, "-S", "-c", "import socket; print(socket.gethostname(), socket.getfqdn())"]).stdout.split() == [
        "host2",
        "host2",
    ]
    name = f"ftkh-test-{uuid.uuid4().hex}"
    assert h1.call(["sh", "-c", f"echo a > /dev/shm/{name} && echo a > /tmp/{name}"]).returncode == 0
    for d in ("/dev/shm", "/tmp"):
        assert h1.call(["test", "-e", f"{d}/{name}"]).returncode == 0
        assert h2.call(["test", "-e", f"{d}/{name}"]).returncode == 1
        assert not os.path.exists(f"{d}/{name}")  # nor in the root namespace
        assert os.path.exists(h1.path(f"{d}/{name}"))
    # two processes of one host share them
    assert h1.call(["cat", f"/dev/shm/{name}"]).stdout == "a\n"


def test_shared_paths(fabric, tmp_path):
    h1, h2 = fabric.hosts
    assert str(tmp_path).startswith("/tmp/")  # hidden by the hosts' own /tmp, but for `shared`
    assert h1.call(["sh", "-c", f"echo b > {tmp_path}/f"]).returncode == 0
    assert h2.call(["cat", f"{tmp_path}/f"]).stdout == "b\n" and (tmp_path / "f").read_text() == "b\n"


def test_kill_all_keeps_the_host_and_lose_removes_it(fabric):
    h1, h2 = fabric.hosts
    serve(h2)
    h2.run(["sh", "-c", "setsid sleep 1000 & sleep 1000 & wait"])  # a daemon escapes its parent, not its host
    h2.call(["sh", "-c", "echo x > /dev/shm/kept"])
    deadline = time.monotonic() + 10
    while len(h2.pids()) < 4:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pids = h2.pids()
    h2.kill_all()
    assert not any(alive(p) for p in pids) and h2.pids() == []
    assert os.path.exists(h2.path("/dev/shm/kept"))  # the host is still up
    serve(h2)
    pids, init = h2.pids(), h2.init_pid
    mnt = os.stat(f"/proc/{init}/ns/mnt").st_ino
    h2.lose()
    assert not any(alive(p) for p in [*pids, init])
    # its mount namespace (and so its tmpfs) is held by no process any more
    assert all(os.stat(f"/proc/{p}/ns/mnt").st_ino != mnt for p in psutil.pids() if os.path.exists(f"/proc/{p}/ns/mnt"))
    assert not os.path.exists(os.path.join(NETNS_DIR, h2.netns))
    assert subprocess.run(["ip", "-n", fabric.netns, "link", "show", h2.link], capture_output=True).returncode != 0
    assert not reaches(h1, "host2", 9000, 1)
    assert "host2" not in h1.call(["cat", "/etc/hosts"]).stdout
    h3 = fabric.add_host()  # a replacement
    serve(h3)
    assert reaches(h1, "host3", 9000) and h3.call(["test", "-e", "/dev/shm/kept"]).returncode == 1


def test_partition_and_heal(fabric):
    h1, h2 = fabric.hosts
    serve(h1)
    assert reaches(h2, "host1", 9000)
    h2.partition()
    assert not reaches(h2, "host1", 9000, 1) and not reaches(h1, "host2", 22, 1)
    h2.heal()
    assert reaches(h2, "host1", 9000)
    h2.partition(seconds=1.0)
    assert not reaches(h2, "host1", 9000, 0.5)
    time.sleep(1.5)
    assert reaches(h2, "host1", 9000)


HARNESS = """
import sys, time
from ftkit.drill.hosts import Fabric
with Fabric(2) as fab:
    for h in fab.hosts:
        h.run(["sleep", "1000"])
        h.call(["sh", "-c", "echo x > /dev/shm/x"])
    print(fab.id, *(p for h in fab.hosts for p in [h.init_pid, *h.pids()]), flush=True)
    time.sleep(1000)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGHUP])  # (SIGHUP: a closed terminal)
def test_cleanup_after_the_harness_is_killed(sig):
    proc = subprocess.Popen([PY, "-c", HARNESS], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        run_id, *pids = proc.stdout.readline().split()
        assert leftovers(run_id) and all(alive(int(p)) for p in pids)
        proc.send_signal(sig)
        proc.wait(30)
    finally:
        proc.kill()
        proc.wait()
    if sig == signal.SIGKILL:
        assert leftovers(run_id) and all(alive(int(p)) for p in pids)  # a SIGKILL leaves it all behind...
        with Fabric(1):  # ...and the next start removes it
            pass
    else:
        assert proc.returncode == 128 + sig  # the harness cleaned up on its way out
    assert leftovers(run_id) == []
    assert not any(alive(int(p)) for p in pids)
    assert run_id not in cleanup_stale()


def test_a_start_survives_a_cleaner_that_runs_as_its_lock_file_is_made(monkeypatch):
    """Another fabric's start (cleanup_stale) between a lock file's creation and its lock took it for a
    dead run's and removed it: this start then failed ("No such file or directory: ...tmp")."""
    real_open, raced = os.open, []

    def open_then_race(path, flags, *args, **kw):
        fd = real_open(path, flags, *args, **kw)
        if str(path).endswith(".tmp") and flags & os.O_CREAT and not raced:
            raced.append(path)
            cleanup_stale()  # as a concurrent start does, at the worst moment
        return fd

    monkeypatch.setattr(os, "open", open_then_race)
    with Fabric(1) as fab:
        assert raced and fab.hosts[0].call(["hostname"]).stdout == "host1\n"
    assert leftovers(fab.id) == []


@pytest.mark.skipif(etcd_unavailable() is not None, reason=etcd_unavailable() or "")
def test_etcd_on_its_own_host():
    with Fabric(1) as fab, Etcd(fab) as etcd:
        assert etcd.host is not None and etcd.host.name == "etcd" and etcd.host.call(["hostname"]).stdout == "etcd\n"
        client = f"import etcd; c = etcd.Client('etcd', {etcd.port}); c.write('/k', 'v'); print(c.read('/k').value)"
        r = fab.hosts[0].call([PY, "-c", client])  # python-etcd, as torch's etcd-v2 rendezvous uses it
        assert r.stdout == "v\n", r.stderr
        assert etcd.endpoint == f"{etcd.host.address}:2379"
        assert not os.path.exists("/tmp/ftkh-etcd")  # its data dir is on its host's own /tmp
        assert os.path.isdir(etcd.host.path("/tmp/ftkh-etcd"))


@pytest.mark.skipif(etcd_unavailable() is not None, reason=etcd_unavailable() or "")
def test_an_etcd_whose_health_probe_hangs_is_stopped_by_start(monkeypatch):
    with Fabric(1) as fab:
        host = fab.add_host("etcd")

        def hung_probe(*args, **kwargs):
            raise subprocess.TimeoutExpired("probe", 10)

        monkeypatch.setattr(host, "call", hung_probe)
        etcd = Etcd(fab, host)
        with pytest.raises(subprocess.TimeoutExpired):
            etcd.start()
        assert etcd.proc is None
        assert host.pids() == []  # its etcd is gone, not only forgotten (another fabric's may run)

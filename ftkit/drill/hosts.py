"""Emulated hosts on one Linux machine: namespaces, a private bridge, one cgroup per host.

A host is a network namespace joined by a veth to a bridge, a UTS namespace (its hostname) and a
mount namespace with private tmpfs at /dev/shm and /tmp and its own /etc/hosts (every live host by
name; no DNS, IPv4 on ``eth0`` only). The bridge lives in a fabric namespace of its own, so the
root namespace gets no interface, route or mount, and nothing routes off the machine. The rest of
the filesystem is shared, as a network filesystem would be.

A long-lived init (``sleep``) holds each host's namespaces; commands enter them with ``nsenter``
and land in the host's cgroup (v2, where writable; else found by their network namespace), so
``cgroup.kill`` ends all of a host's processes at once::

    with Fabric(2, shared=[d]) as fab:          # host1, host2; d (e.g. under /tmp) seen by all
        h1, h2 = fab.hosts
        p = h1.run(["torchrun", ...], env=h1.env(FOO="1"))   # a Popen; its pid is torchrun's
        h2.partition(seconds=5)                 # or h2.heal(), h2.kill_all(), h2.lose()
        h3 = fab.add_host()                     # or fab.add_host(h2.name, h2.address)
    # leaving (an exception, SIGINT, SIGTERM, SIGHUP included) removes every process, namespace, link,
    # mount, cgroup and state file it made

Names start with ``ftkh-<id>-``; a live fabric holds the flock ``/run/ftkh/<id>.lock``, so
:func:`cleanup_stale` (run by every start) removes dead runs' state, never a live one's.
Needs root and iproute2 + util-linux: :func:`hosts_unavailable` says what is missing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import ipaddress
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import psutil

PREFIX = "ftkh-"
STATE_DIR = "/run/ftkh"
NETNS_DIR = "/var/run/netns"
IFNAME = "eth0"  # the interface of every host (GLOO_SOCKET_IFNAME / TP_SOCKET_IFNAME)
BRIDGE = "br0"
SUBNETS = ("10.213.0.0/24", "10.214.0.0/24", "172.30.213.0/24", "192.168.213.0/24")
FIRST_HOST = 10  # host N gets .(10 + N)
TOOLS = ("ip", "nsenter", "unshare", "mount", "umount")

# A host's init: $0 hostname, $1 the hosts file, then the shared paths, staged on the new /dev/shm
# (a bind's source must be in this mount namespace, and the new /tmp hides the old one) and moved into place.
# /var/run/netns is detached so this mount namespace pins no network namespace (others', lost hosts').
_INIT = r"""
set -e
echo "$0" > /proc/sys/kernel/hostname
umount -l /var/run/netns 2>/dev/null || true
mount -t tmpfs -o mode=1777,nosuid,nodev ftkh-shm /dev/shm
mount --bind "$1" /etc/hosts
shift
i=0
for p in "$@"; do
    i=$((i + 1)); s=/dev/shm/.ftkh-share-$i
    if [ -d "$p" ]; then mkdir "$s"; else : > "$s"; fi
    mount --bind "$p" "$s"
done
mount -t tmpfs -o mode=1777,nosuid,nodev ftkh-tmp /tmp
i=0
for p in "$@"; do
    i=$((i + 1)); s=/dev/shm/.ftkh-share-$i
    if [ -d "$s" ]; then mkdir -p "$p"; else mkdir -p "$(dirname "$p")"; [ -e "$p" ] || : > "$p"; fi
    mount --move "$s" "$p"
    if [ -d "$s" ]; then rmdir "$s"; else rm -f "$s"; fi
done
echo ready
exec sleep infinity
"""
# Joins the host's cgroup ($0: its cgroup.procs), then enters its namespaces (nsenter execs: one pid).
_JOIN_CGROUP = 'echo $$ > "$0" || exit 126; exec "$@"'
_CHDIR = 'cd "$0" || exit 126; exec "$@"'


class HostsError(RuntimeError):
    """An emulated host could not be made, used or removed."""


@functools.lru_cache(maxsize=1)
def hosts_unavailable() -> str | None:
    """None where emulated hosts can be made here, else one line saying why not."""
    if not sys.platform.startswith("linux"):
        return f"emulated hosts need Linux namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return f"emulated hosts need root (network namespaces, mounts, cgroups): running as uid {os.geteuid()}"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"emulated hosts need {', '.join(missing)} on PATH (iproute2, util-linux)"
    probe = "ip link add ftkh-a type veth peer name ftkh-b && ip link add ftkh-br type bridge && mount -t tmpfs t /mnt"
    argv = ["unshare", "--net", "--uts", "--mount", "--propagation", "private", "--", "sh", "-c", probe]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"emulated hosts: namespaces cannot be made here ({e})"
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        return f"emulated hosts: namespaces, veth or bridge cannot be made here ({why})"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise HostsError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


@functools.lru_cache(maxsize=1)
def _cgroup2_root() -> str | None:
    """The mount point of the cgroup v2 hierarchy (``/sys/fs/cgroup`` or, hybrid, its ``unified``)."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    points = [m[1] for m in mounts if len(m) > 2 and m[2] == "cgroup2"]
    for p in sorted(points, key=len):
        if os.access(p, os.W_OK) and os.path.exists(os.path.join(p, "cgroup.procs")):
            return p
    return None


def _ns_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _pids_in_ns(ns: tuple[int, int]) -> list[int]:
    """Every process whose network namespace is `ns` (zombies have none and are left out)."""
    return [pid for pid in psutil.pids() if _ns_id(f"/proc/{pid}/ns/net") == ns]


def _kill_pids(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _cgroup_populated(cg: str) -> bool:
    try:
        with open(os.path.join(cg, "cgroup.events")) as f:
            return any(line.split() == ["populated", "1"] for line in f)
    except FileNotFoundError:
        return False


def _cgroup_kill(cg: str, timeout: float = 10.0) -> None:
    """SIGKILL every process in cgroup `cg` and its children; return once it is empty."""
    if not os.path.isdir(cg):
        return
    deadline = time.monotonic() + timeout
    kill_file = os.path.join(cg, "cgroup.kill")
    while _cgroup_populated(cg):
        if os.path.exists(kill_file):
            with contextlib.suppress(OSError), open(kill_file, "w") as f:
                f.write("1")
        else:  # before Linux 5.14: one process at a time, every cgroup below
            for d, _dirs, _files in os.walk(cg):
                with contextlib.suppress(OSError), open(os.path.join(d, "cgroup.procs")) as f:
                    _kill_pids(int(x) for x in f.read().split())
        if time.monotonic() > deadline:
            raise HostsError(f"processes of cgroup {cg} still alive after {timeout:.0f} s")
        time.sleep(0.01)


def _cgroup_remove(cg: str) -> None:
    if not os.path.isdir(cg):
        return
    for d, _dirs, _files in sorted(os.walk(cg), key=lambda w: -len(w[0])):
        for _ in range(100):  # rmdir fails (EBUSY) for a moment after the last process exits
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError as e:
                if e.errno != errno.EBUSY:
                    raise
                time.sleep(0.02)


def _ls(d: str | None) -> list[str]:
    """The names in directory `d`; none where it does not exist (or is None: no cgroup hierarchy)."""
    try:
        return os.listdir(d) if d else []
    except FileNotFoundError:
        return []


def _netns_names(run_id: str | None = None) -> list[str]:
    head = PREFIX + (f"{run_id}-" if run_id else "")
    return sorted(n for n in _ls(NETNS_DIR) if n.startswith(head))


def _remove_netns(name: str) -> None:
    """Kill every process still in network namespace `name`, then remove it (its veths go with it)."""
    ns = _ns_id(os.path.join(NETNS_DIR, name))
    if ns is not None:
        for _ in range(100):
            if not (pids := _pids_in_ns(ns)):
                break
            _kill_pids(pids)
            time.sleep(0.01)
    _ip("netns", "delete", name, check=False)


def _try_lock(path: str) -> int | None:
    """An fd holding an exclusive flock on `path` (which exists and is the file locked), or None."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if _ns_id(path) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino):  # (else unlinked meanwhile)
            return fd
    os.close(fd)
    return None


def _remove_run(run_id: str) -> None:
    """Remove every process, namespace, link, mount, cgroup and state file of run `run_id`."""
    cg_root = _cgroup2_root()
    if cg_root is not None:
        with contextlib.suppress(HostsError):
            _cgroup_kill(os.path.join(cg_root, PREFIX + run_id))
    names = _netns_names(run_id)
    for name in sorted(names, key=lambda n: n.endswith("-fabric")):  # the hosts, then the fabric
        _remove_netns(name)
    if cg_root is not None:
        with contextlib.suppress(OSError):
            _cgroup_remove(os.path.join(cg_root, PREFIX + run_id))
    shutil.rmtree(os.path.join(STATE_DIR, run_id), ignore_errors=True)


def _stale_ids() -> set[str]:
    ids = {n[len(PREFIX) :].split("-", 1)[0] for n in _netns_names()}
    ids |= {n[len(PREFIX) :] for n in _ls(_cgroup2_root()) if n.startswith(PREFIX)}
    ids |= {n.split(".", 1)[0] for n in _ls(STATE_DIR)}
    return {i for i in ids if i}


def cleanup_stale() -> list[str]:
    """Remove everything of every fabric whose owner is gone (its lock free); returns their run ids."""
    removed = []
    for n in _ls(STATE_DIR):  # a lock file its owner died before publishing
        if n.startswith(".") and n.endswith(".tmp") and (fd := _try_lock(os.path.join(STATE_DIR, n))) is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(STATE_DIR, n))
            os.close(fd)
    for run_id in sorted(_stale_ids()):
        lock = os.path.join(STATE_DIR, f"{run_id}.lock")
        if os.path.exists(lock):
            fd = _try_lock(lock)
            if fd is None:
                continue  # alive
        else:
            fd = None  # an owner creates its lock before anything else: none left means it is gone
        try:
            _remove_run(run_id)
            removed.append(run_id)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def _pick_subnet() -> ipaddress.IPv4Network:
    """The first candidate /24 that no address or route here touches (only to keep logs unambiguous)."""
    used = []
    for args in (("-4", "-o", "addr"), ("-4", "route")):
        for word in _ip(*args, check=False).stdout.split():
            with contextlib.suppress(ValueError):
                if "/" in word or word.count(".") == 3:
                    used.append(ipaddress.ip_network(word, strict=False))
    for cand in SUBNETS:
        net = ipaddress.IPv4Network(cand)
        if not any(net.overlaps(u) for u in used if isinstance(u, ipaddress.IPv4Network) and u.prefixlen > 0):
            return net
    return ipaddress.IPv4Network(SUBNETS[0])


class Host:
    """One emulated host of a :class:`Fabric`, made by it; `name` resolves on every host of the fabric."""

    def __init__(self, fabric: Fabric, index: int, name: str, address: str) -> None:
        self.fabric = fabric
        self.index = index
        self.name = name
        self.address = address
        self.ifname = IFNAME
        self.netns = f"{fabric.prefix}h{index}"
        self.link = f"v{index}"  # its veth's end on the bridge, in the fabric namespace
        self.lost = False
        self.partitioned = False
        self.init_pid = 0
        self._netns_id: tuple[int, int] | None = None
        self._procs: list[subprocess.Popen[Any]] = []
        self._init: subprocess.Popen[bytes] | None = None
        self._heal_timer: threading.Timer | None = None
        self._cg = os.path.join(fabric.cgroup, name) if fabric.cgroup else None
        self._cg_init = os.path.join(fabric.cgroup, f"{name}.init") if fabric.cgroup else None
        self.hosts_file = os.path.join(fabric.state_dir, f"h{index}.hosts")

    def __repr__(self) -> str:
        state = "lost" if self.lost else "partitioned" if self.partitioned else "up"
        return f"Host({self.name}, {self.address}, {state})"

    def _create(self) -> None:
        fab = self.fabric
        assert fab.subnet is not None
        _ip("netns", "add", self.netns)
        self._netns_id = _ns_id(os.path.join(NETNS_DIR, self.netns))
        _ip("-n", fab.netns, "link", "add", self.link, "type", "veth", "peer", "name", self.ifname, "netns", self.netns)
        _ip("-n", fab.netns, "link", "set", self.link, "master", BRIDGE, "up")
        _ip("-n", self.netns, "link", "set", "lo", "up")
        _ip("-n", self.netns, "addr", "add", f"{self.address}/{fab.subnet.prefixlen}", "dev", self.ifname)
        _ip("-n", self.netns, "link", "set", self.ifname, "up")
        # IPv4 only: no link-local IPv6 address for gloo or getaddrinfo to pick instead of the bridge's
        v6 = "for f in /proc/sys/net/ipv6/conf/*/disable_ipv6; do echo 1 > $f; done 2>/dev/null || true"
        subprocess.run(["nsenter", f"--net={NETNS_DIR}/{self.netns}", "--", "sh", "-c", v6], check=False, timeout=30)
        for cg in (self._cg, self._cg_init):
            if cg:
                os.mkdir(cg)
        argv = ["nsenter", f"--net={NETNS_DIR}/{self.netns}", "--"]
        argv += ["unshare", "--uts", "--mount", "--propagation", "private", "--"]
        argv += ["sh", "-c", _INIT, self.name, self.hosts_file, *fab.shared]
        if self._cg_init:
            argv = ["sh", "-c", _JOIN_CGROUP, os.path.join(self._cg_init, "cgroup.procs"), *argv]
        init = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        self.init_pid = init.pid
        self._init = init
        assert init.stdout is not None and init.stderr is not None
        ready, _, _ = select.select([init.stdout], [], [], 20)
        line = init.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            init.kill()
            err = init.stderr.read().decode(errors="replace").strip() if init.wait(5) is not None else ""
            raise HostsError(f"host {self.name}: its init did not start: {err or line!r}")
        init.stdout.close()
        init.stderr.close()

    def _check(self) -> None:
        if self.lost:
            raise HostsError(f"host {self.name} is lost")

    def env(self, base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
        """`base` (default: os.environ) with gloo and TensorPipe bound to the host's interface, and `extra`."""
        env = dict(os.environ if base is None else base)
        env.update(GLOO_SOCKET_IFNAME=self.ifname, TP_SOCKET_IFNAME=self.ifname)
        env.update(extra)
        return env

    def run(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None, **popen_kw: Any
    ) -> subprocess.Popen[Any]:
        """Start `argv` inside the host, in `cwd` (default: ours); `popen_kw` as Popen's (default: stdin
        DEVNULL, a new session). The Popen's pid is `argv[0]`'s own (execs only), so ``p.kill()`` kills
        exactly that process; :meth:`kill_all` its children too."""
        self._check()
        cwd = cwd or os.getcwd()  # (shared into every host when it lies under /tmp: _software_paths)
        p = self.init_pid
        wrapped = ["nsenter", f"--net=/proc/{p}/ns/net", f"--uts=/proc/{p}/ns/uts", f"--mount=/proc/{p}/ns/mnt"]
        wrapped += ["--", "sh", "-c", _CHDIR, cwd, *argv]
        if self._cg:
            wrapped = ["sh", "-c", _JOIN_CGROUP, os.path.join(self._cg, "cgroup.procs"), *wrapped]
        popen_kw = {"stdin": subprocess.DEVNULL, "start_new_session": True, **popen_kw}
        proc = subprocess.Popen(wrapped, env=dict(env) if env is not None else None, **popen_kw)
        self._procs = [q for q in self._procs if q.poll() is None] + [proc]
        return proc

    def call(self, argv: Sequence[str], *, timeout: float = 30, **kw: Any) -> subprocess.CompletedProcess[str]:
        """Run `argv` inside the host to its end; its output captured as text."""
        proc = self.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)

    def pids(self) -> list[int]:
        """The processes of the host (its init left out)."""
        if self.lost:
            return []
        found: set[int] = set()
        if self._cg:
            with contextlib.suppress(OSError), open(os.path.join(self._cg, "cgroup.procs")) as f:
                found |= {int(x) for x in f.read().split()}
        if self._netns_id is not None:
            found |= set(_pids_in_ns(self._netns_id))
        found.discard(self.init_pid)
        return sorted(found)

    def path(self, path: str) -> str:
        """Where the root namespace reads the host's file `path` (e.g. in its /dev/shm or /tmp)."""
        self._check()
        return f"/proc/{self.init_pid}/root{os.path.join('/', path)}"

    def kill_all(self, timeout: float = 10.0) -> None:
        """SIGKILL every process of the host at once (not its init: the host stays up and usable)."""
        if self.lost:
            return
        if self._cg:
            _cgroup_kill(self._cg, timeout)
        deadline = time.monotonic() + timeout
        while pids := self.pids():  # without cgroups; and anything that entered the namespace otherwise
            _kill_pids(pids)
            if time.monotonic() > deadline:
                raise HostsError(f"host {self.name}: processes {pids} still alive after {timeout:.0f} s")
            time.sleep(0.01)
        self._reap()

    def _reap(self) -> None:
        for q in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                q.wait(timeout=1)
        self._procs = [q for q in self._procs if q.poll() is None]

    def lose(self, abrupt: bool = True) -> None:
        """The host is gone: its processes, tmpfs, init, link and namespaces; a replacement is
        ``fabric.add_host()``. `abrupt` (a power loss): the link goes first, so the dead processes'
        FIN/RST reach no one and peers find out by their own timeouts; else peers see resets at once."""
        if self.lost:
            return
        with self.fabric._lock:
            self._cancel_heal()
            if abrupt:
                _ip("-n", self.fabric.netns, "link", "del", self.link, check=False)
            self.kill_all()
            umount = ["nsenter", f"--mount=/proc/{self.init_pid}/ns/mnt", "--", "umount", "-l", "/dev/shm", "/tmp"]
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                subprocess.run(umount, capture_output=True, timeout=10)
            if self._cg_init:
                _cgroup_kill(self._cg_init)
            _kill_pids([self.init_pid])
            if self._init is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._init.wait(timeout=10)
            _ip("-n", self.fabric.netns, "link", "del", self.link, check=False)
            _remove_netns(self.netns)
            for cg in (self._cg, self._cg_init):
                if cg:
                    _cgroup_remove(cg)
            self.lost = True
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.hosts_file)
            self.fabric._write_hosts_files()

    def partition(self, seconds: float | None = None) -> None:
        """Take its link on the bridge down (TCP connections stay open and time out); up again after
        `seconds` if given, else at :meth:`heal`."""
        self._check()
        with self.fabric._lock:
            self._cancel_heal()
            _ip("-n", self.fabric.netns, "link", "set", self.link, "down")
            self.partitioned = True
            if seconds is not None:
                self._heal_timer = threading.Timer(seconds, self.heal)
                self._heal_timer.daemon = True
                self._heal_timer.start()

    def heal(self) -> None:
        """End a partition; the link works when this returns."""
        with self.fabric._lock:
            self._cancel_heal()
            if self.lost or self.fabric.closed:
                return
            _ip("-n", self.fabric.netns, "link", "set", self.link, "up")
            self.partitioned = False
            # linkwatch brings the link up asynchronously: wait for both ends, or the next packet is dropped
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                ends = [(self.fabric.netns, self.link), (self.netns, self.ifname)]
                if all(" state UP " in _ip("-n", ns, "-o", "link", "show", d, check=False).stdout for ns, d in ends):
                    break
                time.sleep(0.02)
            # neighbour entries that failed during the partition would fail new connections (EHOSTUNREACH)
            for h in self.fabric.live:
                _ip("-n", h.netns, "neigh", "flush", "dev", h.ifname, check=False)

    def _cancel_heal(self) -> None:
        t, self._heal_timer = self._heal_timer, None
        if t is not None and t is not threading.current_thread():
            t.cancel()


def _software_paths() -> list[str]:
    """This Python's, ftkit's and the working directory's paths that a host's private /tmp or
    /dev/shm would hide (a CI job may keep them under /tmp)."""
    import ftkit

    candidates = [sys.prefix, os.path.dirname(os.path.dirname(os.path.abspath(ftkit.__file__))), os.getcwd()]
    tops = [os.path.realpath(p) for p in candidates]
    return [t for t in tops if t.startswith(("/tmp/", "/dev/shm/"))]


def _outermost(paths: Sequence[str]) -> list[str]:
    """`paths` without duplicates and without those inside another one (bound once, with it)."""
    out: list[str] = []
    for p in sorted(set(paths), key=len):
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return out


class Fabric:
    """N emulated hosts on a private bridge, as a context manager (see the module's docstring).
    `hosts`: a count (``host1``..``hostN``) or the names. `shared`: paths bound at the same path
    into every host, which their private /tmp would hide. While the fabric lives, SIGTERM and SIGHUP
    (where no handler is set) raise SystemExit, so that ``with`` cleans up.
    """

    def __init__(self, hosts: int | Sequence[str] = 2, *, shared: Sequence[str] = ()) -> None:
        for p in shared:
            if not os.path.exists(p):
                raise HostsError(f"shared path {os.path.abspath(p)} does not exist")
        self.shared = _outermost([*(os.path.abspath(p) for p in shared), *_software_paths()])
        self.names = [f"host{i + 1}" for i in range(hosts)] if isinstance(hosts, int) else list(hosts)
        self.subnet: ipaddress.IPv4Network | None = None  # the first of SUBNETS unused here, at start()
        self.id = secrets.token_hex(3)
        self.prefix = f"{PREFIX}{self.id}-"
        self.netns = f"{self.prefix}fabric"
        self.state_dir = os.path.join(STATE_DIR, self.id)
        cg_root = _cgroup2_root()
        self.cgroup = os.path.join(cg_root, PREFIX + self.id) if cg_root else None
        self.hosts: list[Host] = []
        self.closed = False
        self.started = False
        self._lock = threading.RLock()
        self._lock_fd: int | None = None
        self._signals: list[signal.Signals] = []  # those that raise SystemExit, until close()

    def __enter__(self) -> Fabric:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        problems = self.close()
        if problems and exc_type is None:
            raise HostsError("cleanup left: " + "; ".join(problems))

    def start(self) -> None:
        """Remove stale state of dead runs, then make the fabric and its first hosts."""
        reason = hosts_unavailable()
        if reason:
            raise HostsError(reason)
        os.makedirs(STATE_DIR, exist_ok=True)
        cleanup_stale()
        # the lock appears already held (renamed into place), so no cleaner ever finds it free while we live
        tmp = os.path.join(STATE_DIR, f".{self.id}.tmp")
        while (fd := _try_lock(tmp)) is None:  # (a cleaner may take it for a dead run's before we lock it)
            os.close(os.open(tmp, os.O_RDWR | os.O_CREAT, 0o600))
        self._lock_fd = fd
        os.write(fd, f"{os.getpid()}\n".encode())
        os.rename(tmp, os.path.join(STATE_DIR, f"{self.id}.lock"))
        self.started = True
        self._signals = exit_on_stop_signals()
        os.makedirs(self.state_dir, exist_ok=True)
        if self.cgroup:
            try:
                os.mkdir(self.cgroup)
            except OSError:  # not writable after all: processes are found by their network namespace
                self.cgroup = None
        self.subnet = _pick_subnet()
        _ip("netns", "add", self.netns)
        _ip("-n", self.netns, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0", "forward_delay", "0")
        _ip("-n", self.netns, "link", "set", BRIDGE, "up")
        for name in self.names:
            self.add_host(name)

    def add_host(self, name: str | None = None, address: str | None = None) -> Host:
        """A new host: ``host<index>`` at ``.(10 + index)`` unless `name` / `address` are given (a
        lost host's may be reused); every live host's /etc/hosts then lists it."""
        with self._lock:
            if self.closed or not self.started:
                raise HostsError("the fabric is not running")
            assert self.subnet is not None
            index = max((h.index for h in self.hosts), default=0) + 1
            name = name or f"host{index}"
            address = address or str(self.subnet.network_address + FIRST_HOST + index)
            live = [h for h in self.hosts if not h.lost]
            if any(h.name == name for h in live):
                raise HostsError(f"a live host is already named {name}")
            if any(h.address == address for h in live):
                raise HostsError(f"a live host already has address {address}")
            if not name.replace("-", "").isalnum() or len(name) > 63:
                raise HostsError(f"bad host name {name!r}: letters, digits and '-' only")
            host = Host(self, index, name, address)
            self.hosts.append(host)
            self._write_hosts_files()
            try:
                host._create()
            except BaseException:
                with contextlib.suppress(Exception):
                    host.lose()
                host.lost = True
                raise
            # A reused address: the other hosts still map it to the lost link's MAC; forget that.
            for h in live:
                _ip("-n", h.netns, "neigh", "flush", "to", address, check=False)
            return host

    def host(self, name: str) -> Host:
        """The live host named `name`."""
        for h in self.live:
            if h.name == name:
                return h
        raise KeyError(name)

    @property
    def live(self) -> list[Host]:
        return [h for h in self.hosts if not h.lost]

    def _write_hosts_files(self) -> None:
        lines = ["127.0.0.1\tlocalhost"] + [f"{h.address}\t{h.name}" for h in self.live]
        text = "\n".join(lines) + "\n"
        for h in self.live:
            with open(h.hosts_file, "w") as f:  # in place: it is bind-mounted on the host's /etc/hosts
                f.write(text)

    def close(self) -> list[str]:
        """Remove every process, namespace, link, cgroup and file of the fabric; returns what is left."""
        with self._lock:
            if self.closed:
                return []
            self.closed = True
        problems: list[str] = []
        try:
            for h in self.hosts:
                h._cancel_heal()
            if self._lock_fd is not None:
                try:
                    _remove_run(self.id)
                except Exception as e:  # keep going: the next start removes what is left
                    problems.append(f"{type(e).__name__}: {e}")
                for h in self.hosts:
                    h.lost = True
                    h._reap()
                    if h._init is not None:
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            h._init.wait(timeout=5)
                problems += [x for x in leftovers(self.id) if not x.endswith(f"/{self.id}.lock")]
                if not problems:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(STATE_DIR, f"{self.id}.lock"))
                os.close(self._lock_fd)
                self._lock_fd = None
        finally:
            if threading.current_thread() is threading.main_thread():
                for sig in self._signals:
                    signal.signal(sig, signal.SIG_DFL)
                self._signals = []
        return problems


def exit_on_term(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def exit_on_stop_signals() -> list[signal.Signals]:
    """In the main thread, make SIGTERM (`timeout`, a scheduler) and SIGHUP (a closed terminal or
    ssh session) raise SystemExit where they are at their default, so that cleanup runs; the
    signals changed, for the caller to set back to SIG_DFL."""
    if threading.current_thread() is not threading.main_thread():
        return []
    changed = [s for s in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) in (signal.SIG_DFL, None)]
    for sig in changed:
        signal.signal(sig, exit_on_term)
    return changed


def leftovers(run_id: str | None = None) -> list[str]:
    """What is left of run `run_id` (of every run if None): namespaces, cgroups, files, mounts, links."""
    head = PREFIX + (f"{run_id}-" if run_id else "")
    out = [f"netns {n}" for n in _netns_names(run_id)]
    cg_root = _cgroup2_root()
    out += [f"cgroup {cg_root}/{n}" for n in _ls(cg_root) if n.startswith(PREFIX + (run_id or ""))]
    out += [f"file {STATE_DIR}/{n}" for n in _ls(STATE_DIR) if n.startswith(run_id or "")]
    with open("/proc/self/mountinfo") as f:
        out += [f"mount {line.split()[4]}" for line in f if head in line]
    links = _ip("-o", "link", check=False).stdout
    out += [f"link {w}" for w in links.split() if w.startswith(PREFIX)]
    return out

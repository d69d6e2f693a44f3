"""A training job over emulated hosts: one zygote and one torchrun agent per host (hosts.py).

The agents meet in a dynamic rendezvous: torch's ``etcd-v2`` on an etcd host of its own (the
default: it outlives every training host), or ``c10d`` on the first host's agent (which dies with
that host: docs/operations.md). Node identity is the hostname, as in production. Spare hosts'
agents wait in the rendezvous until a host is lost. What a drill reads (the event log, the fault
points, the durable tier) lives under `root`, which every host sees::

    with Cluster(root, entry, hosts=3, spares=1, ranks_per_host=2) as c:
        c.rank_hosts()                         # {rank: host name} of the newest attempt
        c.lose("host2"); c.host("host1").partition(5.0); c.kill_agent("host3"); c.start_agent("host3")
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

from ftkit.coord.events import read_events
from ftkit.coord.faultpoints import FAULT_POINTS_ENV
from ftkit.drill.etcd import Etcd
from ftkit.drill.hosts import Fabric, Host
from ftkit.drill.job import latest_attempt, starts
from ftkit.runtime.warm.zygote import Zygote, client_path, torchrun_command
from ftkit.runtime.warm.zygote import start as start_zygote

C10D_PORT = 29400
# A lost host leaves the next round after keep_alive_interval x keep_alive_max_attempt seconds, and a
# round closes last_call_timeout after it has its minimum: torch's defaults make a recovery slow, and
# 1 x 2 let a late heartbeat split the group.
RDZV_CONF = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3, "last_call_timeout": 2, "join_timeout": 120}


class Cluster:
    """`hosts` training hosts (host1..hostN) and `spares` more, `ranks_per_host` ranks each, running
    `entry` (``-m module args`` or ``script args``)."""

    def __init__(
        self,
        root: str,
        entry: Sequence[str],
        hosts: int = 3,
        spares: int = 0,
        ranks_per_host: int = 2,
        rdzv: str = "etcd",
        env: dict[str, str] | None = None,
        warm: bool = True,
    ):
        if rdzv not in ("etcd", "c10d"):
            raise ValueError(f"rendezvous backend {rdzv!r}: etcd or c10d")
        self.root = os.path.abspath(root)
        self.entry = list(entry)
        self.names = [f"host{i}" for i in range(1, hosts + spares + 1)]
        self.training = self.names[:hosts]
        self.ranks_per_host = ranks_per_host
        self.rdzv = rdzv
        self.extra_env = dict(env or {})
        self.warm = warm
        self.run_dir = os.path.join(self.root, "run")
        self.fault_request = os.path.join(self.root, "fault-request")
        self.agents: dict[str, subprocess.Popen] = {}
        self.zygotes: dict[str, Zygote] = {}
        self.logs: dict[str, Any] = {}
        self.fabric: Fabric | None = None
        self.etcd: Etcd | None = None

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        names = [*self.names, *(["etcd"] if self.rdzv == "etcd" else [])]
        self.fabric = Fabric(names, shared=[self.root])
        self.fabric.start()
        if self.rdzv == "etcd":
            self.logs["etcd"] = open(os.path.join(self.root, "etcd.log"), "a")
            self.etcd = Etcd(self.fabric, self.fabric.host("etcd"), log=self.logs["etcd"])
            self.etcd.start()
        for name in self.training:
            self.start_agent(name)
        # The training hosts form the first group; spares wait in the rendezvous for a place after that.
        if not self.wait_started(world=len(self.training) * self.ranks_per_host, timeout=180):
            raise RuntimeError(f"the training hosts did not form their group (see {self.root}/host*.log)")
        for name in self.names[len(self.training) :]:
            self.start_agent(name)

    def close(self) -> None:
        for proc in self.agents.values():
            if proc.poll() is None:
                proc.kill()
        # A host may be gone already: the fabric removes what is left.
        for stop in [z.stop for z in self.zygotes.values()] + ([self.etcd.stop] if self.etcd else []):
            with contextlib.suppress(Exception):
                stop()
        if self.fabric is not None:
            self.fabric.close()
        for f in self.logs.values():
            f.close()

    def host(self, name: str) -> Host:
        assert self.fabric is not None
        return self.fabric.host(name)

    def _env(self, host: Host) -> dict[str, str]:
        # Node identity comes from the host (its hostname), as in production.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FTKIT_NODE_ID", "FTKIT_RANKS_PER_NODE"))}
        env.update(self.extra_env, FTKIT_RUN_DIR=self.run_dir, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env[FAULT_POINTS_ENV] = self.fault_request
        return host.env(env)

    def agent_args(self) -> list[str]:
        if self.rdzv == "etcd":
            assert self.etcd is not None
            backend, endpoint = "etcd-v2", self.etcd.endpoint
        else:
            backend, endpoint = "c10d", f"{self.training[0]}:{C10D_PORT}"
        conf = ",".join(f"{k}={v}" for k, v in RDZV_CONF.items())
        return [
            f"--nnodes=1:{len(self.training)}",
            f"--nproc-per-node={self.ranks_per_host}",
            f"--rdzv-backend={backend}",
            f"--rdzv-endpoint={endpoint}",
            "--rdzv-id=drill",
            f"--rdzv-conf={conf}",
            "--max-restarts=10",
            "--monitor-interval=0.1",
        ]

    def start_agent(self, name: str) -> subprocess.Popen:
        """Start (or start again) the zygote and torchrun agent of host `name`."""
        host = self.host(name)
        env = self._env(host)
        zygote = None
        if self.warm:
            old = self.zygotes.pop(name, None)
            if old is not None:
                old.stop()
            # A short path every host sees (a socket's path is at most 107 bytes), removed with the fabric.
            assert self.fabric is not None
            zdir = os.path.join(self.fabric.state_dir, "zygotes")
            os.makedirs(zdir, exist_ok=True)
            zygote = start_zygote(env=env, preload=("ftkit.drill.reference",), parent=zdir, spawn=host.run)
            self.zygotes[name] = zygote
            env.update(zygote.env())
        entry = self.entry
        if zygote is not None:
            entry = [client_path(), "--module", *entry[1:]] if entry[0] == "-m" else [client_path(), *entry]
        if name not in self.logs:
            self.logs[name] = open(os.path.join(self.root, f"{name}.log"), "a")
        cmd = torchrun_command(zygote, [*self.agent_args(), *entry])
        proc = host.run(cmd, env=env, stdout=self.logs[name], stderr=subprocess.STDOUT, cwd=self.root)
        self.agents[name] = proc
        return proc

    def kill_agent(self, name: str) -> None:
        """Kill only `name`'s torchrun agent (SIGKILL): its workers end with it (ftkit/runtime/warm/client.py)."""
        proc = self.agents[name]
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    def lose(self, name: str) -> None:
        """The host is gone, as in a power loss: link first, every process, its tmpfs (its RAM tier)."""
        self.host(name).lose()
        z = self.zygotes.pop(name, None)
        if z is not None:
            with contextlib.suppress(Exception):  # its processes are gone with the host
                z.stop()

    def bring_back(self, name: str) -> None:
        """A new machine under a lost host's name and address (empty RAM, a new agent) joins."""
        assert self.fabric is not None
        lost = [h for h in self.fabric.hosts if h.name == name and h.lost]
        if not lost:
            raise RuntimeError(f"{name} is not a lost host")
        self.fabric.add_host(name, lost[-1].address)
        self.start_agent(name)

    def events(self) -> list[dict[str, Any]]:
        return read_events(self.run_dir)

    def attempt(self) -> tuple[int, int]:
        return latest_attempt(self.events())

    def rank_hosts(self, attempt: tuple[int, int] | None = None) -> dict[int, str]:
        """{rank: host name} of `attempt` (default: the newest), from the ranks' start events."""
        events = self.events()
        return {e["rank"]: e["node"] for e in starts(events, latest_attempt(events) if attempt is None else attempt)}

    def wait_started(
        self,
        world: int | None = None,
        after: tuple[int, int] = (-1, 0),
        timeout: float = 120,
        restarting: Callable[[], bool] = lambda: False,
    ) -> bool:
        """Until an attempt newer than `after` has every rank started (`world` ranks, when given);
        False after `timeout`, or once every agent has ended and none is `restarting` (a host or
        an agent brought back later)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            # (before the events are read: an agent that has ended has logged all it will)
            ended = not restarting() and all(p.poll() is not None for p in self.agents.values())
            events = self.events()
            at = latest_attempt(events)
            if at > after and (started := starts(events, at)):
                size = started[0]["world_size"]
                if len({e["rank"] for e in started}) == size and world in (None, size):
                    return True
            if ended:
                return False
            time.sleep(0.1)
        return False

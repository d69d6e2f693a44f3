"""The fault schedule: a small language, parsed into pure Fault records.

    KIND@STEP[:key=value...][,KIND@STEP...]

    kill@12:rank=1              SIGKILL (a crash the OS sees)
    term@20:rank=0              SIGTERM (a preemption notice: save, exit, come back)
    hang@24:rank=2              SIGSTOP (alive, silent: the watchdog's case)
    crash@30:rank=3             an exception raised in the training loop
    slow@40:rank=0:factor=3:seconds=10  the rank runs at 1/factor speed for a while
    node@36:node=1              every rank of a simulated node dies and its RAM tier is wiped
    enospc@20:seconds=3         the durable tier is full for a while; likewise
                                unavailable (an outage), latency (factor = seconds per
                                write), torn-write (files cut short), bitflip
    s3-outage@30:seconds=5      the drill's own S3 server is stopped, then restarted

Over emulated hosts (``ftkit drill --hosts N``; ``node`` is then ``host``):

    host@30:host=2              host 2 is lost whole: every process, its RAM tier, its link
                                (``for=S``: a new machine of that name comes back S s later)
    partition@40:host=rank0     its link goes down (``for=S``: up again S s later)
    agent@50:host=3             only its torchrun agent dies (``for=S``: restarted S s later)

    host= is a host number (1..N), ``rank0`` (the host of rank 0 when the fault strikes) or
    ``rendezvous`` (the host serving the rendezvous: c10d's endpoint; with etcd, whose store
    moves to each round's rank 0, the host of rank 0)

Options: rank=, node=, host=, factor=, seconds= (for= is the same), and during= one of
    step       at the end of the step's compute, before its snapshot (the default)
    snapshot   while the rank copies the state into its staging buffer
    persist    inside a durable-tier persist: data written, not yet reported
    replicate  inside the RAM tier's peer replication
    commit     on rank 0, with every share durable and the manifest not yet written
A fault `during` a persist or commit lands at the first durable persist at or
after STEP (the durable tier is written every few steps).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

PROCESS_KINDS = ("kill", "term", "hang", "crash", "node", "slow")
STORAGE_KINDS = ("enospc", "unavailable", "latency", "torn-write", "bitflip")
OBJECT_STORE_KINDS = ("s3-outage",)
HOST_KINDS = ("host", "partition", "agent")  # over emulated hosts only
KINDS = PROCESS_KINDS + STORAGE_KINDS + OBJECT_STORE_KINDS + HOST_KINDS
ALIASES = {"torn": "torn-write"}
PHASES = ("step", "snapshot", "persist", "replicate", "commit")
HOST_TARGETS = ("rank0", "rendezvous")
# Faults after which torchrun restarts the worker group.
RESTARTING = ("kill", "term", "hang", "crash", "node", *HOST_KINDS)
# Faults that happen inside one training step and cannot be moved into the persist pipeline.
_LOOP_ONLY = {"crash": ("step", "snapshot"), "slow": ("step",)}
# A fault's options: key=value -> (Fault field, its type).
_OPTIONS = {"rank": ("rank", int), "node": ("node", int), "host": ("host", str), "during": ("during", str)}
_OPTIONS |= {"factor": ("factor", float), "seconds": ("seconds", float), "for": ("back_s", float)}


@dataclass
class Fault:
    kind: str
    step: int
    rank: int | None = None
    node: int | None = None
    during: str = "step"
    factor: float = 3.0
    seconds: float = 6.0
    host: str | None = None  # host faults: "1".."N", "rank0" or "rendezvous"
    back_s: float | None = None  # host faults: the host (its link, its agent) comes back this much later
    # What happened (filled in by the drill):
    injected_t: float | None = None
    injected_step: int | None = None
    attempt: int | None = None
    gen: int | None = None  # the in-process generation of `attempt` it struck
    outcome: dict[str, Any] = field(default_factory=dict)

    @property
    def restarts(self) -> bool:
        return self.kind in RESTARTING

    def where(self) -> str:
        if self.kind in HOST_KINDS:
            return f"host {self.host}"
        if self.kind == "node":
            return f"node {self.node}"
        if self.kind in STORAGE_KINDS:
            return "durable tier"
        if self.kind in OBJECT_STORE_KINDS:
            return "S3 server"
        return f"rank {self.rank}"

    def label(self) -> str:
        phase = "" if self.during == "step" else f" during {self.during}"
        return f"{self.kind}@{self.step} ({self.where()}{phase})"


def _is_number(s: str) -> bool:
    """ASCII digits only: str.isdigit() is true of "²" too, which int() refuses."""
    return s.isascii() and s.isdigit()


def _check(f: Fault, part: str, nproc: int, ranks_per_node: int, hosts: int | None = None) -> None:
    nodes = nproc // ranks_per_node
    # isfinite: NaN passes every comparison test, and inf seconds would never end
    if not (math.isfinite(f.factor) and f.factor > 0 and math.isfinite(f.seconds) and f.seconds >= 0):
        raise ValueError(f"{part!r}: factor must be a finite number > 0 and seconds a finite number >= 0")
    if f.back_s is not None and not (math.isfinite(f.back_s) and f.back_s >= 0):
        raise ValueError(f"{part!r}: for= must be a finite number of seconds >= 0")
    if f.kind == "slow" and f.factor < 1:
        raise ValueError(f"{part!r}: a slow rank runs at 1/factor speed: factor must be at least 1")
    if hosts is None and f.kind in HOST_KINDS:
        raise ValueError(f"{part!r}: a {f.kind} fault needs emulated hosts (ftkit drill --hosts N)")
    if hosts is not None and f.kind == "node":
        raise ValueError(f"{part!r}: over emulated hosts a node is a host: host@STEP:host=H")
    if f.during not in PHASES:
        raise ValueError(f"{part!r}: during={f.during} is not one of {', '.join(PHASES)}")
    if f.kind in HOST_KINDS:
        f.host = f.host or "1"
        if not (f.host in HOST_TARGETS or (_is_number(f.host) and 1 <= int(f.host) <= (hosts or 0))):
            raise ValueError(f"{part!r}: host={f.host} is not 1..{hosts}, rank0 or rendezvous")
        if f.during == "commit" and f.host not in ("rank0", "rendezvous"):
            raise ValueError(f"{part!r}: only rank 0 commits (host=rank0)")
        return
    if f.kind in _LOOP_ONLY and f.during not in _LOOP_ONLY[f.kind]:
        raise ValueError(
            f"{part!r}: a {f.kind} fault happens in the training loop (during={' or '.join(_LOOP_ONLY[f.kind])})"
        )
    if f.kind == "node":
        f.node = 0 if f.node is None else f.node
        if not 0 <= f.node < nodes:
            raise ValueError(f"{part!r}: node {f.node} does not exist ({nodes} nodes)")
        if f.during == "commit" and f.node != 0:
            raise ValueError(f"{part!r}: only rank 0 (node 0) commits")
    else:
        f.rank = 0 if f.rank is None else f.rank
        if not 0 <= f.rank < nproc:
            raise ValueError(f"{part!r}: rank {f.rank} does not exist ({nproc} ranks)")
        if f.during == "commit" and f.rank != 0:
            raise ValueError(f"{part!r}: only rank 0 commits (rank=0)")


def parse_faults(spec: str, nproc: int, ranks_per_node: int, hosts: int | None = None) -> list[Fault]:
    """Parse a schedule (`hosts`: over that many emulated hosts); a ValueError names the bad part."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        head, *opts = part.split(":")
        kind, _, step = head.partition("@")
        kind = ALIASES.get(kind, kind)
        if kind not in KINDS or not _is_number(step) or int(step) < 1:
            raise ValueError(f"bad fault {part!r}: expected KIND@STEP (STEP >= 1) with KIND one of {', '.join(KINDS)}")
        f = Fault(kind, int(step))
        for o in opts:
            k, _, v = o.partition("=")
            try:
                if k not in _OPTIONS or not v:
                    raise ValueError
                setattr(f, _OPTIONS[k][0], _OPTIONS[k][1](v))
            except ValueError:
                raise ValueError(
                    f"bad option {o!r} in {part!r} (rank=, node=, host=, during=, factor=, seconds=, for=)"
                ) from None
        _check(f, part, nproc, ranks_per_node, hosts)
        faults.append(f)
    steps = [f.step for f in faults]
    if steps != sorted(steps) or len(set(steps)) != len(steps):
        raise ValueError("faults must be at distinct, increasing steps")
    return faults


def random_faults(
    seed: int, steps: int, nproc: int, ranks_per_node: int, count: int = 3, peer: bool = True
) -> list[Fault]:
    """`count` restarting faults at random steps, ranks and phases: the same seed, the same schedule."""
    rng = random.Random(seed)
    lo, hi = 4, steps - 6
    if hi - lo < 4 * count:
        raise ValueError(f"--steps {steps} is too short for {count} random faults (need {4 * count + 10})")
    at: list[int] = []
    while len(at) < count:  # at least 4 steps apart, so each recovery is seen whole
        s = rng.randrange(lo, hi)
        if all(abs(s - a) >= 4 for a in at):
            at.append(s)
    phases = ["step", "step", "snapshot", "persist", "commit"] + (["replicate"] if peer else [])
    out = []
    for n, s in enumerate(sorted(at)):
        kind = rng.choice(("kill", "term", "hang", "crash", "node") if peer else ("kill", "term", "hang", "crash"))
        if kind == "term" and n < count - 1:
            # A term's stop is agreed through heartbeats, many short steps later: a later fault could
            # come before it, or never. So a term comes last; earlier draws become kills.
            kind = "kill"
        during = rng.choice(_LOOP_ONLY.get(kind, phases))
        f = Fault(kind, s, during=during)
        if kind == "node":
            f.node = 0 if during == "commit" else rng.randrange(nproc // ranks_per_node)
        else:
            f.rank = 0 if during == "commit" else rng.randrange(nproc)
        out.append(f)
    return out

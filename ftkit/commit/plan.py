"""The commit plan: for one world (each rank's node, the kind of tier, the replicas), who
does what in a step's commit and the messages each rank sends and awaits, in order. Pure
data, unit-tested without processes; `ftkit commit-plan` prints it and docs/protocol.md,
generated from it, describes the roles. The executors (commit/shared.py, commit/ram.py)
run one rank's `steps()`, which cost O(its node and its partners) to work out."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

SHARED = "shared"
RAM = "ram"


class Act(str, Enum):
    """What one step of a rank's commit does."""

    WRITE = "write"  # write this rank's data file
    SEND = "send"  # send a message
    AWAIT = "await"  # wait for a message from each of `peers`
    PART = "part"  # write the node's part of the manifest from its ranks' reports
    REPLICATE = "replicate"  # send the data file to the replica targets, keep the sources' copies
    SOURCE_PARTS = "source-parts"  # write the parts of the nodes whose replicas this node holds
    COMMIT = "commit"  # write the index: the step is committed
    INDEX_COPY = "index-copy"  # keep rank 0's index beside rank 0's replicas


class Via(str, Enum):
    """The transport a message goes over."""

    BOARD = "board"  # the node's board (coord/nodelocal.py): inside one node
    STORE = "store"  # the job's c10d store: between nodes, small
    PEERS = "peers"  # the replica peer group (tiers/peers.py): data files between nodes


class Msg(str, Enum):
    """The messages of a commit (their bodies: commit/reports.py and the executors)."""

    REPORT = "report"  # a rank's write to its collector (its layout by name: commit/layouts.py)
    EXCHANGE = "exchange"  # a node's reports and part name, for its replica partners
    RELAY = "relay"  # the partners' reports, relayed by a collector to its node
    REPLICA = "replica"  # a data file, to a replica holder
    OUTCOME = "outcome"  # a rank's replication errors (and the parts it wrote) to its collector
    RECORD = "record"  # a node's record to rank 0: its part, or its errors
    INDEX = "index"  # the committed index, from rank 0 to the nodes keeping its copy


@dataclass(frozen=True)
class Step:
    """One step of a rank's commit. SEND: to `peers`; AWAIT: from each of `peers`."""

    act: Act
    msg: Msg | None = None
    peers: tuple[int, ...] = ()
    via: Via | None = None

    def __str__(self) -> str:
        if self.msg is None:
            return self.act.value
        arrow = "->" if self.act is Act.SEND else "<-"
        return f"{self.act.value} {self.msg.value} {arrow} {_ranks(self.peers)} ({self.via.value if self.via else ''})"


@dataclass(frozen=True)
class NodeRoles:
    ranks: tuple[int, ...]
    collector: int
    exchanger: int

    @property
    def leader(self) -> int:
        return self.ranks[0]


@dataclass(frozen=True)
class CommitPlan:
    """The commit of one world: `nodes[r]` is rank r's node, `tier` SHARED or RAM, `replicas`
    the RAM tier's copies of each rank's data on other nodes (0: none)."""

    nodes: tuple[str, ...]
    tier: str = SHARED
    replicas: int = 0

    def __post_init__(self) -> None:
        if self.tier not in (SHARED, RAM):
            raise ValueError(f"unknown tier kind {self.tier!r}")
        if not self.nodes or self.replicas < 0 or (self.replicas and self.tier != RAM):
            raise ValueError("a commit plan needs ranks, and replicas only on the RAM tier")

    @staticmethod
    def of(nodes: Sequence[str], tier: str = SHARED, replicas: int = 0) -> CommitPlan:
        return CommitPlan(tuple(nodes), tier, replicas)

    # ------------------------------------------------------------------ the world
    @property
    def world(self) -> int:
        return len(self.nodes)

    @property
    def distributed(self) -> bool:
        return len(self.nodes) > 1

    @functools.cached_property
    def order(self) -> tuple[str, ...]:
        """Node ids in order of their first rank."""
        return tuple(dict.fromkeys(self.nodes))

    @functools.cached_property
    def _members(self) -> dict[str, tuple[int, ...]]:
        members: dict[str, list[int]] = {}
        for r, n in enumerate(self.nodes):
            members.setdefault(n, []).append(r)
        return {n: tuple(m) for n, m in members.items()}

    @functools.cached_property
    def _position(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.order)}

    @functools.cached_property
    def _local_index(self) -> tuple[int, ...]:
        seen: dict[str, int] = {}
        out = []
        for n in self.nodes:
            out.append(seen.get(n, 0))
            seen[n] = out[-1] + 1
        return tuple(out)

    @functools.cached_property
    def members(self) -> Mapping[int, tuple[int, ...]]:
        """Every node's ranks, by the node's leader."""
        return {m[0]: m for m in self._members.values()}

    @functools.cached_property
    def _roles(self) -> dict[str, NodeRoles]:
        return {}  # filled by roles(), for the nodes a rank asks about

    def roles(self, node: str) -> NodeRoles:
        hit = self._roles.get(node)
        if hit is None:
            ranks = self._members[node]
            # On the RAM tier another rank collects rank 0's node: one rank with both duties was the slowest.
            several = self.tier == RAM and node == self.nodes[0] and len(ranks) > 1 and len(self.order) > 1
            collector = ranks[1] if several else ranks[0]
            exchanger = next((r for r in ranks if r not in (0, collector)), collector)
            hit = self._roles[node] = NodeRoles(ranks, collector, exchanger)
        return hit

    def roles_of(self, rank: int) -> NodeRoles:
        return self.roles(self.nodes[rank])

    @property
    def exchanges(self) -> bool:
        """Whether nodes exchange reports and data files for replicas (a world of one node has none to hold them)."""
        return self.tier == RAM and self.replicas > 0 and len(self.order) > 1

    @functools.cached_property
    def record_senders(self) -> tuple[int, ...]:
        """The ranks whose node record rank 0 awaits: every node's collector but rank 0."""
        return tuple(c for c in (self.roles(n).collector for n in self.order) if c != 0)

    # ------------------------------------------------------------------ replicas
    def _copies(self) -> int:
        return min(self.replicas, len(self.order) - 1) if self.exchanges else 0

    def target_nodes(self, node: str) -> list[str]:
        """The nodes `node`'s ranks send their replicas to: the k after it, in node order."""
        start, count = self._position[node], len(self.order)
        return [self.order[(start + j) % count] for j in range(1, self._copies() + 1)]

    def source_nodes(self, node: str) -> list[str]:
        """The nodes whose ranks send `node`'s ranks their replicas: the k before it."""
        start, count = self._position[node], len(self.order)
        return [self.order[(start - j) % count] for j in range(1, self._copies() + 1)]

    def replica_targets(self, rank: int) -> list[int]:
        """The ranks holding `rank`'s replicas: its local index on each target node."""
        out = []
        for n in self.target_nodes(self.nodes[rank]):
            peers = self._members[n]
            out.append(peers[self._local_index[rank] % len(peers)])
        return out

    def replica_sources(self, rank: int) -> list[int]:
        """The ranks whose replicas `rank` holds."""
        return [src for src, dst in self.transfers(rank) if dst == rank]

    def transfers(self, rank: int) -> list[tuple[int, int]]:
        """The (source, destination) transfers `rank` takes part in, in an order all ranks agree on."""
        out: list[tuple[int, int, int]] = []  # (j, src, dst)
        for j, node in enumerate(self.source_nodes(self.nodes[rank])):
            out += [(j, src, rank) for src in self._members[node] if self.replica_targets(src)[j] == rank]
        out += [(j, rank, dst) for j, dst in enumerate(self.replica_targets(rank))]
        return [(src, dst) for _, src, dst in sorted(out)]

    def holds_index(self, node: str) -> bool:
        """Whether `node` keeps the RAM tier's index: rank 0's node and those holding its replicas."""
        return node == self.nodes[0] or node in self.target_nodes(self.nodes[0])

    def index_copiers(self) -> tuple[int, ...]:
        """The ranks that keep a copy of rank 0's index: the exchangers of the nodes that hold it, but rank 0's."""
        return tuple(self.roles(n).exchanger for n in self.target_nodes(self.nodes[0]))

    def peer_readers(self, node: str) -> tuple[int, ...]:
        """The ranks of `node` that read its partners' exchange records: its collector, and rank 0
        where another rank collects rank 0's node (rank 0 is never relayed to)."""
        c = self.roles(node).collector
        return (c, 0) if node == self.nodes[0] and c != 0 else (c,)

    def relay_receivers(self, node: str) -> tuple[int, ...]:
        """The ranks of `node` its collector relays the partners' reports to (not itself, not rank 0)."""
        roles = self.roles(node)
        return tuple(r for r in roles.ranks if r not in (roles.collector, 0))

    def partners(self, node: str) -> list[str]:
        """The nodes `node` exchanges replicas with: the k before it and the k after it."""
        return list(dict.fromkeys(self.source_nodes(node) + self.target_nodes(node)))

    def exchange_readers(self, node: str) -> tuple[int, ...]:
        """Who awaits `node`'s exchange record: its partners' peer readers, and rank 0 for its own node."""
        readers = [r for m in self.partners(node) for r in self.peer_readers(m)]
        if node == self.nodes[0] and self.roles(node).collector != 0:
            readers.append(0)
        return tuple(dict.fromkeys(readers))

    def exchange_sources(self, rank: int) -> tuple[int, ...]:
        """The collectors whose exchange records `rank` (a peer reader) awaits."""
        node = self.nodes[rank]
        out = [self.roles(m).collector for m in self.partners(node)]
        if rank == 0 and self.roles(node).collector != 0:
            out.append(self.roles(node).collector)
        return tuple(dict.fromkeys(out))

    # ------------------------------------------------------------------ the steps
    def steps(self, rank: int) -> tuple[Step, ...]:
        """Rank `rank`'s commit, in order (worked out once per rank)."""
        hit = self._steps.get(rank)
        if hit is None:
            hit = self._steps[rank] = tuple(self._ram_steps(rank) if self.tier == RAM else self._shared_steps(rank))
        return hit

    @functools.cached_property
    def _steps(self) -> dict[int, tuple[Step, ...]]:
        return {}

    def _report_steps(self, rank: int, roles: NodeRoles) -> Iterator[Step]:
        """The write, and the reports to the node's collector, who writes the node's part."""
        yield Step(Act.WRITE)
        if rank != roles.collector:
            yield Step(Act.SEND, Msg.REPORT, (roles.collector,), Via.BOARD)
            return
        others = tuple(r for r in roles.ranks if r != rank)
        if others:
            yield Step(Act.AWAIT, Msg.REPORT, others, Via.BOARD)
        yield Step(Act.PART)

    def _commit_steps(self) -> Iterator[Step]:
        """Rank 0's: every other node's record, then the index."""
        if self.record_senders:
            yield Step(Act.AWAIT, Msg.RECORD, self.record_senders, Via.STORE)
        yield Step(Act.COMMIT)

    def _shared_steps(self, rank: int) -> Iterator[Step]:
        roles = self.roles_of(rank)
        yield from self._report_steps(rank, roles)
        if rank == 0:  # (on a shared tier, its node's collector)
            yield from self._commit_steps()
        elif rank == roles.collector:
            yield Step(Act.SEND, Msg.RECORD, (0,), Via.STORE)

    def _ram_steps(self, rank: int) -> Iterator[Step]:
        node = self.nodes[rank]
        roles = self.roles(node)
        collector = rank == roles.collector
        # 1. Reports: to the node's collector, who writes the node's part and tells its partners.
        yield from self._report_steps(rank, roles)
        readers = self.exchange_readers(node) if collector and self.exchanges else ()
        if readers:
            yield Step(Act.SEND, Msg.EXCHANGE, readers, Via.STORE)
        # 2. Replicas: partners' reports, the transfers, and the sources' parts.
        if self.exchanges:
            if rank in self.peer_readers(node):
                sources = self.exchange_sources(rank)
                if sources:
                    yield Step(Act.AWAIT, Msg.EXCHANGE, sources, Via.STORE)
                relay = self.relay_receivers(node) if collector else ()
                if relay:
                    yield Step(Act.SEND, Msg.RELAY, relay, Via.BOARD)
            else:
                yield Step(Act.AWAIT, Msg.RELAY, (roles.collector,), Via.BOARD)
            targets, holds = tuple(self.replica_targets(rank)), tuple(self.replica_sources(rank))
            if targets:
                yield Step(Act.SEND, Msg.REPLICA, targets, Via.PEERS)
            if holds:
                yield Step(Act.AWAIT, Msg.REPLICA, holds, Via.PEERS)
            yield Step(Act.REPLICATE)
            if rank == roles.exchanger:
                yield Step(Act.SOURCE_PARTS)
        # 3. Outcomes: to the collector, who sends the node's record to rank 0 (rank 0 keeps its own).
        if self.distributed:
            if not collector:
                if rank != 0:
                    yield Step(Act.SEND, Msg.OUTCOME, (roles.collector,), Via.BOARD)
            else:
                outcome_from = tuple(r for r in roles.ranks if r not in (rank, 0))
                if outcome_from:
                    yield Step(Act.AWAIT, Msg.OUTCOME, outcome_from, Via.BOARD)
                if rank != 0:
                    yield Step(Act.SEND, Msg.RECORD, (0,), Via.STORE)
        # 4. The commit: rank 0 writes the index and sends it to the nodes that keep a copy.
        if rank == 0:
            yield from self._commit_steps()
            copiers = self.index_copiers() if self.exchanges else ()
            if copiers:
                yield Step(Act.SEND, Msg.INDEX, copiers, Via.STORE)
        elif self.exchanges and rank in self.index_copiers():
            yield Step(Act.AWAIT, Msg.INDEX, (0,), Via.STORE)
            yield Step(Act.INDEX_COPY)

    # ------------------------------------------------------------------ printing
    def role_names(self, rank: int) -> list[str]:
        roles, ex = self.roles_of(rank), self.exchanges
        names = {
            "leader": rank == roles.leader,
            "collector": rank == roles.collector,
            "exchanger": ex and rank == roles.exchanger,
            "committer": rank == 0,
            "index holder": ex and rank in self.index_copiers(),
        }
        return [name for name, holds in names.items() if holds]

    def describe(self) -> str:
        """The plan as text: each rank's roles and steps."""
        head = f"commit plan: {self.tier} tier, {self.world} ranks on {len(self.order)} nodes"
        lines = [head + (f", {self.replicas} replica(s)" if self.replicas else "")]
        for r in range(self.world):
            lines.append(f"rank {r} (node {self.nodes[r]}: {', '.join(self.role_names(r)) or 'writer'})")
            lines += [f"  {i}. {s}" for i, s in enumerate(self.steps(r), 1)]
        return "\n".join(lines)

    def sequence(self) -> list[tuple[int, Msg, int, Via]]:
        """Every message as (sender, message, receiver, transport) in an order the plan runs in, or `Stuck`."""
        pending = {r: list(self.steps(r)) for r in range(self.world)}
        sent: set[tuple[int, Msg, int]] = set()
        out: list[tuple[int, Msg, int, Via]] = []
        while any(pending.values()):
            progressed = False
            for r, steps in pending.items():
                while steps:
                    s = steps[0]
                    if s.act is Act.AWAIT and not all((p, s.msg, r) in sent for p in s.peers):
                        break
                    if s.act is Act.SEND:
                        assert s.msg is not None and s.via is not None
                        for p in s.peers:
                            sent.add((r, s.msg, p))
                            out.append((r, s.msg, p, s.via))
                    steps.pop(0)
                    progressed = True
            if not progressed:
                stuck = {r: str(steps[0]) for r, steps in pending.items() if steps}
                raise Stuck(f"the commit plan cannot finish; waiting: {stuck}")
        return out

    def mermaid(self) -> str:
        """The plan's messages as a Mermaid sequence diagram (docs/protocol.md)."""
        lines = ["sequenceDiagram"]
        lines += [f"    participant r{r} as rank {r} ({self.nodes[r]})" for r in range(self.world)]
        for src, msg, dst, via in self.sequence():
            lines.append(f"    r{src}->>r{dst}: {msg.value} ({via.value})")
        return "\n".join(lines)


class Stuck(Exception):
    """A plan whose waits cannot all be answered."""


def _ranks(ranks: tuple[int, ...]) -> str:
    return "rank " + str(ranks[0]) if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))

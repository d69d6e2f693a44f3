"""The RAM tier's commit: node-local parts and index, with peer replicas, in O(nodes) store
requests. `persist_node_local` runs this rank's steps of the plan (docs/protocol.md) with
`RamCommit`; store requests per role: docs/architecture.md. The index lives where rank 0's
data lives (its node and the nodes holding its replicas); a node keeps only the parts of
the files it holds, and gets what it lacks at restore through the store (restore/read.py)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ftkit.commit.keys import delete_keys, exchange_key, index_key, older_keys, ram_records_key
from ftkit.commit.layouts import Layout, from_store, lookup
from ftkit.commit.manifests import check_files_present, commit_index
from ftkit.commit.messages import Exchange, Outcome, Record, Relay, Report, Written
from ftkit.commit.node import NodeGroup, StepExecutor, runner
from ftkit.commit.parts import write_part
from ftkit.commit.plan import RAM, Act, Msg, Step
from ftkit.commit.replicas import PeerWord, read_exchanges, read_relay, replicate, store_parts
from ftkit.commit.shared import gather_records, raise_if_failed, send_record
from ftkit.coord.dist import DistContext
from ftkit.coord.nodelocal import step_message
from ftkit.errors import AlreadyCommitted, FormatError, RecoveryRequested, StorageError
from ftkit.format.index import INDEX_VERSION, parse_index
from ftkit.format.manifest import MANIFEST_NAME, step_dir_name
from ftkit.format.validate import parse_header
from ftkit.save.write import RankWrite, discard, write_share
from ftkit.tiers.peers import PeerGroup
from ftkit.tiers.storage import Storage

log = logging.getLogger(__name__)


@dataclass
class NodeShare:
    """A collector's share of its node's step: the reports, its part or errors, other nodes' parts."""

    texts: dict[int, bytes]  # the ranks' reports, as sent
    errors: list[str]
    skipped: bool  # a rank of the node skipped the step (policy "skip")
    files: list[str] = field(default_factory=list)  # the data files its ranks reported
    written: Written | None = None  # the node's part as store_part wrote it
    layouts: list[Layout] = field(default_factory=list)  # of the reports sent by reference
    others: list[str] = field(default_factory=list)  # parts of the replica sources, written here

    def exchanged(self) -> Exchange:
        """What this node's replica partners read: the reports, and the part's name and checksum."""
        part = (self.written.part.file, self.written.part.checksum) if self.written is not None else None
        return Exchange(self.texts, part)

    def record(self, errors: list[str]) -> Record:
        w = self.written
        part = w.part if w is not None and not errors else None
        files, stored = (w.files, w.stored) if w is not None else ({}, 0)
        return Record(part, files, stored, tuple(self.errors + errors), self.skipped, tuple(self.others))

    def own_files(self) -> list[str]:
        """What this step put in the node's directory that a failed commit removes."""
        return self.files + ([self.written.part.file] if self.written else []) + self.others


# A failure in these steps is this rank's error in its outcome: its node still sends its record.
_EXCHANGE = {(Act.AWAIT, Msg.EXCHANGE), (Act.REPLICATE, None), (Act.SOURCE_PARTS, None)}
_EXCHANGE |= {(act, msg) for act in (Act.SEND, Act.AWAIT) for msg in (Msg.RELAY, Msg.REPLICA)}


@dataclass(eq=False)
class RamCommit(StepExecutor):
    """One rank's commit of one step to the RAM tier; a replication failure skips the rest of the exchange."""

    peers: PeerGroup | None = None
    cpu: dict[str, float] = field(default_factory=dict)  # this thread's CPU seconds in "write" and "replicate"

    def __post_init__(self) -> None:
        super().__post_init__()
        assert self.plan.tier == RAM, "the RAM tier's commit runs a RAM tier's plan"
        self.collector = self.ctx.rank == self.group.collector
        self.write_: RankWrite | None = None
        self.node: NodeShare | None = None  # the collector's: its node's part, or errors
        self.word = PeerWord({}, True, {})  # the partners' reports (none in a job of one node)
        self.layouts: Callable[[int, str], Layout | None] | None = None
        self.others: list[str] = []  # the exchanger's: the sources' parts it wrote
        self.errors: list[str] = []  # replication errors: its own, and (a collector) its node's outcomes
        self.exchange_failed = False
        self.records: list[Record] | None = None  # rank 0's: every node's record
        self.own_record: Record | None = None  # rank 0's: its node's
        self.index_data = b""

    def do(self, step: Step) -> None:
        if (step.act, step.msg) not in _EXCHANGE:
            super().do(step)
        elif not self.exchange_failed:
            try:
                super().do(step)
            except RecoveryRequested:  # the generation is over: not a replication error
                raise
            except Exception as e:
                self.exchange_failed = True
                self.errors.append(f"rank {self.ctx.rank}: replication failed: {e}")
                log.error("rank %d: step %d: replication failed: %s", self.ctx.rank, self.step, e)

    # ------------------------------------------------------------------ every rank
    def write(self, _: Step) -> None:
        c0 = time.thread_time()
        try:
            self.write_, self.error = write_share(
                self.storage, self.step, self.slot, self.pieces, self.compress, self.ctx.rank
            )
        except AlreadyCommitted as e:  # this node has the step, another may not: still take part
            self.write_, self.error = None, e
        self.cpu["write"] = time.thread_time() - c0
        self.report_write(self.write_)

    def send_outcome(self, step: Step) -> None:
        outcome = Outcome(tuple(self.errors), tuple(self.others))
        self.group.send(self.at, "r", self.ctx.rank, outcome.encode(), step.peers, self.ctx.timeout_s)

    # ------------------------------------------------------------------ a node's collector
    def part(self, _: Step) -> None:
        reports = self.node_reports()
        written, errors = write_part(self.storage, self.step, reports, self.ctx.world_size, self.group.memo)
        sent = list({r.layout.digest: r.layout for r in reports if r.layout is not None}.values()) if written else []
        files = [r.file for r in reports if r.file is not None]
        self.node = NodeShare(self.texts, errors, any(r.skipped for r in reports), files, written, sent)

    def send_exchange(self, _: Step) -> None:
        assert self.node is not None
        self.group.published.publish(self.ctx, self.group.leader, self.node.layouts)  # before the record naming them
        self.ctx.store.set(exchange_key(self.key, self.group.leader), self.node.exchanged().encode())

    def send_relay(self, step: Step) -> None:
        word, to_exchanger = self.word, self.group.exchanger in step.peers  # which needs more than the reports
        relay = Relay(word.texts, word.parts, word.own_part) if to_exchanger else Relay(word.texts)
        self.group.node_board().send(step_message(self.at, "peers"), relay.encode(), step.peers, self.ctx.timeout_s)

    def await_outcome(self, step: Step) -> None:
        assert self.node is not None
        for r, raw in self.collect("r", step.peers).items():
            self.errors += _outcome_errors(r, raw, self.node.others if r == self.group.exchanger else None)

    def send_record(self, _: Step) -> None:
        assert self.node is not None
        send_record(self.ctx, self.group, ram_records_key(self.key), self.node.record(self.errors))

    # ------------------------------------------------------------------ replicas
    def await_exchange(self, step: Step) -> None:
        own_text = self.text if not self.collector else None  # rank 0, where another rank collects
        self.word = read_exchanges(self.group, self.ctx, self.key, step.peers, own_text)
        if self.collector:  # bodies its partners are past: they sent these reports after the step before
            self.group.published.retire(self.ctx, self.group.leader, self.word.texts.values())
        node = self.group.node
        if self.collector and self.node is not None and node != self.plan.nodes[0] and self.plan.holds_index(node):
            self.word.own_part = self.node.written  # the index must name it (its exchanger checks)

    def await_relay(self, step: Step) -> None:
        exchanger = self.ctx.rank == self.group.exchanger
        relayed = read_relay(self.group, self.ctx, self.at, exchanger)
        if relayed is None:  # the collector skipped the step: read the partners' reports here
            partners = tuple(self.plan.roles(n).collector for n in self.plan.partners(self.group.node))
            word = read_exchanges(self.group, self.ctx, self.key, partners, None)
            relayed = PeerWord(word.texts, False, word.parts if exchanger else {})
        self.word = relayed

    def send_replica(self, _: Step) -> None:
        """A replica's send and receive: posted all at once by the REPLICATE step (tiers/peers.py)."""

    await_replica = send_replica

    def replicate(self, _: Step) -> None:
        assert self.peers is not None
        sending = self.write_ if self.word.may_send and self.error is None else None
        self.layouts = lookup(from_store(self.ctx.store, self.plan), self.group.memo)
        args = (self.storage, self.step, sending, self.word.texts, self.plan, self.ctx, self.peers, self.slot)
        c0 = time.thread_time()
        try:
            replicate(*args, self.compress, self.group.memo, self.layouts)
        finally:
            self.cpu["replicate"] = time.thread_time() - c0

    def source_parts(self, _: Step) -> None:
        texts, parts, world = self.word.texts, self.word.parts, self.ctx.world_size
        self.others = store_parts(self.storage, self.step, parts, texts, self.group, world, self.layouts)
        if self.node is not None:  # the collector is its node's exchanger
            self.node.others = self.others

    # ------------------------------------------------------------------ rank 0 and the index
    def await_record(self, step: Step) -> None:
        """Rank 0: every node's record, the others' from their collectors (`step.peers`). Older
        keys go once all are in: every index holder has read a step's index before it sends its
        records of the next."""
        collectors = step.peers
        self.record_keys = [exchange_key(self.key, n) for n in self.group.members if self.plan.exchanges]
        older = self.stack.enter_context(older_keys(self.ledger, self.at))
        self.records = [self.node.record(self.errors)] if self.node is not None else []
        self.own_record = self.records[0] if self.records else None
        got, complete = gather_records(self.ctx, self.group, ram_records_key(self.key), collectors)
        for c, record in zip(collectors, got, strict=True):
            self.records.append(record)
            if self.plan.roles_of(c).leader == 0:
                self.own_record = record
        if complete and not any(r.skipped for r in self.records):
            delete_keys(self.ctx, older)
        elif not complete and self.ledger is not None:  # a late node sets its keys again: a later step deletes them
            self.ledger.record(self.at, self.key)

    def commit(self, _: Step) -> None:
        if self.records is None:  # a job of one node: rank 0 collected every report itself
            self.await_record(Step(Act.AWAIT, Msg.RECORD))
        assert self.records is not None
        own_errors = [] if self.node is not None else self.errors  # a collector's are in its record
        raise_if_failed(self.step, "the RAM tier", self.records, own_errors)
        own = self.own_record
        assert own is not None and own.part is not None
        local = {own.part.file, *own.others}  # the parts in rank 0's node's directory
        args = (self.storage, self.step, self.ctx.world_size, self.records, self.skeleton)
        self.committed = commit_index(*args, local_parts=local)

    def send_index(self, _: Step) -> None:
        assert self.committed is not None
        self.ctx.store.set(index_key(self.key), self.committed.manifest_json)
        self._ledger_index_key()

    def await_index(self, _: Step) -> None:
        if self.error is not None:  # this rank wrote nothing to keep the index beside
            raise self.error
        self.index_data = self.ctx.get_raw(index_key(self.key))

    def index_copy(self, _: Step) -> None:
        write_index_copy(self.storage, self.step, self.index_data, self.word.own_part)

    def not_committed(self) -> None:
        """Rank 0's failure: remove the step's files from its node, tell index holders not to wait."""
        if self.records is not None:
            own = self.own_record
            files = self.node.own_files() if self.node is not None else own.local_files() if own is not None else []
            discard(self.storage, self.step, files)
        if self.plan.exchanges and self.committed is None:
            with contextlib.suppress(Exception):  # the store is gone: they time out instead
                self.ctx.put(index_key(self.key), "")
                self._ledger_index_key()

    def _ledger_index_key(self) -> None:
        if self.ledger is not None:  # deleted after the next step's records: every index holder has read it then
            self.ledger.record_key(self.at, index_key(self.key))


# Persist one step to the RAM tier (`persist_node_local(storage, step, slot, skeleton, compress=..., ...)`).
persist_node_local = runner(RamCommit)


def write_index_copy(storage: Storage, step: int, data: bytes, written: Written | None) -> None:
    """Write rank 0's index (`data`) on an index holder, once it names the node's part as its
    collector wrote it (`written`) and the node's files are in place."""
    if data in (b"", b'""'):  # rank 0's "not committed" (put as JSON "")
        discard(storage, step, [name for name, _ in storage.list_dir(step_dir_name(step))])
        raise StorageError(f"step {step} was not committed to the RAM tier (rank 0 gave up)")
    where = f"the index of step {step} from rank 0"
    doc, version = parse_header(data, where)
    if version != INDEX_VERSION:
        raise FormatError(f"{where} has format version {version}, not {INDEX_VERSION}")
    index = parse_index(doc, where, expect_step=step)
    mine = written.part if written else None
    if written is None or mine is None or (mine.file, mine.checksum) not in {(p.file, p.checksum) for p in index.parts}:
        raise StorageError(f"step {step}: {where} does not name this node's part")
    check_files_present(storage, step, {**written.files, mine.file: mine.nbytes})
    storage.write_bytes_atomic(f"{step_dir_name(step)}/{MANIFEST_NAME}", data)


def _outcome_errors(rank: int, raw: bytes | None, parts: list[str] | None = None) -> list[str]:
    """A rank's replication errors from its outcome (untrusted); `parts` gets the exchanger's parts."""
    if raw is None:
        return [f"rank {rank}: no replication outcome"]
    try:
        outcome = Outcome.decode(raw, f"rank {rank}'s outcome")
    except FormatError as e:
        return [f"rank {rank}: {e}"]
    if parts is not None:
        parts += outcome.parts
    return list(outcome.errors)


def report_skipped_node_local(
    ctx: DistContext, group: NodeGroup, key: str, at: tuple[int, int], reason: str, exchange: bool
) -> None:
    """Policy "skip" on the RAM tier, from the training thread: tell this rank's collector (and,
    from a collector, rank 0 and with `exchange` the replica partners) so nobody waits for it."""
    text = Report.failed(reason, skipped=True).encode()
    if ctx.rank == 0 and exchange:
        ctx.put(index_key(key), "")  # the index holders wait for no index
    collector = (group.collector,)
    if ctx.rank != group.collector:
        group.send(at, "w", ctx.rank, text, collector, 0.0)
        if ctx.rank != 0:  # rank 0's outcome is never collected
            group.send(at, "r", ctx.rank, Outcome().encode(), collector, 0.0)
        return
    others = tuple(r for r in group.ranks if r != ctx.rank)
    group.node_board().send(step_message(at, "skip"), reason.encode(), others, 0.0)  # no replicas this step
    if exchange:
        ctx.store.set(exchange_key(key, group.leader), Exchange({ctx.rank: text}).encode())
    if ctx.rank != 0:  # rank 0 collecting its own node awaits no record
        send_record(ctx, group, ram_records_key(key), Record.failed([f"rank {ctx.rank}: {reason}"], skipped=True))

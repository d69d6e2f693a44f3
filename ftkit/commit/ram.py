"""The RAM tier's commit: node-local, with peer replicas, in O(nodes) store requests: the
executor of a RAM tier's commit plan (commit/plan.py; `ftkit commit-plan` prints it, and
docs/protocol.md shows it for a few worlds). `persist_node_local` runs this rank's steps of
the plan in order (`RamCommit`, one handler per kind of step). The step's manifest has
format version 4, as on a shared tier: one part per node and an index (format/index.py)::

    every rank:   WRITE           write_share(...): its data file, in its node's directory
                  SEND report     its `Report` to its collector (the board; no store request): its
                                  layout once (commit/layouts.py), then its per-step values
    collectors:   AWAIT report    the node's reports
                  PART            the node's part, checked, beside its data
    with replicas (commit/replicas.py):
      collectors  SEND exchange   the reports and the part as one record, `key`/w/<node> (a node
                                  is named by its first rank), for the k nodes before and after
                  AWAIT exchange  those nodes' records
                  SEND relay      their reports, the names and checksums of the sources' parts
                                  and (on an index holder) the node's own part's, to the node
      rank 0      AWAIT exchange  (where another rank collects) those records, and its node's
      every rank  REPLICATE       sends its file to its targets, stores verified copies of what
                                  its sources send (tiers/peers.py)
      exchangers  SOURCE_PARTS    the parts of the k nodes before theirs (a node keeps the parts
                                  of the ranks whose files it holds)
    every rank:   SEND outcome    its replication errors (and the parts it wrote) to its
                                  collector; rank 0 keeps its own
    collectors:   AWAIT outcome, SEND record: the node's record for rank 0, appended to `key`/r
                                  (DistContext.send_to_root): its part's name, size and checksum
                                  (and the parts its exchanger wrote), or the node's errors
    rank 0:       AWAIT record    every node's record: one wait and one read of that key, which
                                  it then deletes (DistContext.collect_at_root)
                  COMMIT          the index (manifest.json, the commit)
                  SEND index      with replicas, the index under `key`/manifest ("" when the
                                  step is not committed)
    the exchangers of the k nodes that hold rank 0's node's replicas:
                  AWAIT index, INDEX_COPY: check it names their node's part and their files are
                                  in place, write it
    rank 0, after retention (tiers/backend.py): the commit news (coord/news.py), which
                  the other leaders hear with their heartbeats and keep or drop steps by

The index lives where rank 0's data lives (its node and the nodes holding its replicas):
losing all of them loses rank 0's share of the step, so the step anyway. The other
nodes read nothing back: at restore, a node without the index gets it through the
store from a node that has it (restore/read.py), as it gets the parts it lacks.

Why three roles: one rank carrying them all was the slowest of a commit (bench_dist.py,
2 nodes of 2 ranks, the same hour: 2.6-3.1 ms of coordination CPU per snapshot on rank 0
and 2.3-2.8 on the other leader, 0.6-0.7 on the other ranks; 1.7-2.1 on every rank with
the roles spread). A rank with no role makes no store request; a collector two (its
node's record for rank 0: an append and an add, and the last of them a set), with replicas
three more (its reports; the records of the k nodes before and after it, in one wait and
one multi_get); an exchanger of the k index holders two (a wait and a get of the index);
rank 0 a wait, a read and three deletes for the records, with replicas a delete for every
node's exchange and two more where it does not collect (a wait and a multi_get of its
partners' records and its node's), and the news. Per step: 2 x nodes + 7 requests without
replicas, 6 x nodes + 2k + 10 with (fewer where rank 0 collects its own node). A wait and the read
after it count as two: on the persist thread's own connection they are one multi_get, which
waits itself (DistContext.wait_get). Rank 0 handles O(nodes) bytes, a collector its node's
entries and those of k other nodes. A node holds the parts of the ranks whose files it
holds, not every part: at restore, parts a node lacks come through the store from a node
that has them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ftkit.commit.keys import KeyLedger, delete_keys, exchange_key, index_key, older_keys, ram_records_key
from ftkit.commit.layouts import Layout, from_board, from_store, lookup
from ftkit.commit.manifests import Committed, check_files_present, commit_index, store_part
from ftkit.commit.memo import CommitMemo
from ftkit.commit.messages import Exchange, Outcome, Record, Relay, Report, Written
from ftkit.commit.node import NodeGroup, StepExecutor
from ftkit.commit.parts import build_part
from ftkit.commit.plan import RAM, Act, Msg, Step
from ftkit.commit.replicas import PeerWord, read_exchanges, read_relay, replicate, store_parts
from ftkit.commit.reports import decode_report
from ftkit.commit.shared import gather_records, raise_if_failed, send_record
from ftkit.coord.dist import DistContext
from ftkit.coord.nodelocal import step_message
from ftkit.errors import AlreadyCommitted, FormatError, RecoveryRequested, StorageError
from ftkit.format.index import INDEX_VERSION, parse_index
from ftkit.format.manifest import MANIFEST_NAME, step_dir_name
from ftkit.format.validate import parse_header
from ftkit.save.sharding import Piece
from ftkit.save.staging import Slot
from ftkit.save.write import RankWrite, discard, write_share
from ftkit.tiers.peers import PeerGroup
from ftkit.tiers.storage import Storage

log = logging.getLogger(__name__)


@dataclass
class NodeShare:
    """A leader's view of its node's share of a step: the ranks' reports, the part it
    wrote of them (or the node's errors), and the parts of other nodes it wrote."""

    texts: dict[int, bytes]  # the ranks' reports, as sent
    errors: list[str]
    skipped: bool  # a rank of the node skipped the step (policy "skip")
    files: list[str] = field(default_factory=list)  # the data files its ranks reported
    written: Written | None = None  # the node's part as store_part wrote it
    layouts: list[Layout] = field(default_factory=list)  # of the reports sent by reference
    others: list[str] = field(default_factory=list)  # parts of the replica sources, written here

    def exchanged(self) -> Exchange:
        """What the nodes exchanging replicas with this one read (`key`/w/<leader>): the
        reports, and the part's name and checksum (its holders rebuild its bytes from the
        reports, commit/replicas.py store_parts, and check them against the checksum)."""
        part = (self.written.part.file, self.written.part.checksum) if self.written is not None else None
        return Exchange(dict(self.texts), part)

    def record(self, errors: list[str]) -> Record:
        """The node's record for rank 0 (sent under `key`/r: shared.send_record)."""
        w = self.written
        part = w.part if w is not None and not errors else None
        files, stored = (w.files, w.stored) if w is not None else ({}, 0)
        return Record(part, files, stored, tuple(self.errors + errors), self.skipped, tuple(self.others))

    def own_files(self) -> list[str]:
        """What this step put in the node's directory that a failed commit removes."""
        return self.files + ([self.written.part.file] if self.written else []) + self.others


# The steps of the replica exchange: a failure there is this rank's error in its outcome (the
# step is not committed), not an exception, so its node still sends rank 0 its record.
_EXCHANGE = {
    (Act.AWAIT, Msg.EXCHANGE),
    (Act.SEND, Msg.RELAY),
    (Act.AWAIT, Msg.RELAY),
    (Act.SEND, Msg.REPLICA),
    (Act.AWAIT, Msg.REPLICA),
    (Act.REPLICATE, None),
    (Act.SOURCE_PARTS, None),
}


class RamCommit(StepExecutor):
    """One rank's commit of one step to the RAM tier (StepExecutor). A failure in the replica
    exchange is this rank's error in its outcome, and the rest of the exchange is skipped."""

    HANDLERS: ClassVar[dict[tuple[Act, Msg | None], Callable[[RamCommit, Step], None]]] = {}

    def __init__(self, *args: Any, peers: PeerGroup | None, cpu: dict[str, float]):
        super().__init__(*args)
        self.peers, self.cpu = peers, cpu
        self.collector = self.ctx.rank == self.group.collector
        self.write_: RankWrite | None = None
        self.texts: dict[int, bytes] = {}  # the collector's: its node's reports
        self.node: NodeShare | None = None  # the collector's: its node's part, or errors
        # The partners' reports: none where the node has no partner (a job of one node).
        self.word = PeerWord({}, True, {})
        self.layouts: Callable[[str], Layout | None] | None = None
        self.others: list[str] = []  # the exchanger's: the sources' parts it wrote
        self.errors: list[str] = []  # replication errors: its own, and (a collector) its node's outcomes
        self.exchange_failed = False
        self.mine: tuple[Record, list[str]] | None = None  # rank 0 collecting: its node's record, files
        self.records: list[Record] | None = None  # rank 0's: every node's record
        self.own_record: Record | None = None  # rank 0's: its node's
        self.index_data = b""

    def do(self, step: Step) -> None:
        if (step.act, step.msg) not in _EXCHANGE:
            super().do(step)
        elif not self.exchange_failed:  # (after a failure, the rest of the exchange is skipped)
            try:
                super().do(step)
            except RecoveryRequested:  # (the generation is over: not this step's replication error)
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
        self.group.send(self.at, "r", self.ctx.rank, outcome.encode(), step.peers)

    # ------------------------------------------------------------------ a node's collector
    def await_reports(self, step: Step) -> None:
        self.texts = _collect_texts(self.group, self.at, "w", self.ctx, step.peers)

    def part(self, _: Step) -> None:
        ctx, memo = self.ctx, self.group.memo
        assert self.own is not None
        memo.decoded.put((ctx.rank, self.text), self.own)  # its own: not parsed back
        texts = {ctx.rank: self.text, **self.texts}
        layouts = lookup(from_board(self.group.board, ctx.rank), memo)
        self.node = node_part(self.storage, self.step, texts, self.group.ranks, ctx.world_size, memo, layouts)

    def send_exchange(self, _: Step) -> None:
        assert self.node is not None
        self.group.published.publish(self.ctx.store, self.node.layouts)  # before the record that names them
        self.ctx.store.set(exchange_key(self.key, self.group.leader), self.node.exchanged().encode())

    def send_relay(self, step: Step) -> None:
        relay = Relay(self.word.texts)
        if self.group.exchanger in step.peers:  # what the exchanger needs besides the reports
            relay = Relay(self.word.texts, self.word.parts, self.word.own_part)
        self.group.send_named(step_message(self.at, "peers"), relay.encode(), step.peers)

    def await_outcomes(self, step: Step) -> None:
        assert self.node is not None
        for r, raw in self.group.collect(self.at, "r", self.ctx, step.peers, self.ctx.timeout_s).items():
            self.errors += _outcome_errors(r, raw, self.node.others if r == self.group.exchanger else None)

    def send_record(self, _: Step) -> None:
        assert self.node is not None
        send_record(self.ctx, self.group, ram_records_key(self.key), self.node.record(self.errors))

    # ------------------------------------------------------------------ replicas
    def await_exchanges(self, step: Step) -> None:
        own_text = self.text if not self.collector else None  # (rank 0, where another rank collects)
        self.word = read_exchanges(self.group, self.ctx, self.key, step.peers, own_text)
        if self.collector and self.node is not None and self._keeps_index_copy():
            self.word.own_part = self.node.written  # the index must name it (its exchanger checks)

    def await_relay(self, step: Step) -> None:
        exchanger = self.ctx.rank == self.group.exchanger
        relayed = read_relay(self.group, self.ctx, self.at, exchanger)
        if relayed is None:  # the collector skipped the step: read the partners' reports here
            partners = tuple(self.plan.roles(n).collector for n in self.plan.partners(self.group.node))
            word = read_exchanges(self.group, self.ctx, self.key, partners, None)
            relayed = PeerWord(word.texts, False, word.parts if exchanger else {})
        self.word = relayed

    def replicate(self, _: Step) -> None:
        assert self.peers is not None
        sending = self.write_ if self.word.may_send and self.error is None else None
        self.layouts = lookup(from_store(self.ctx.store), self.group.memo)
        c0 = time.thread_time()
        try:
            replicate(
                self.storage,
                self.step,
                sending,
                self.word.texts,
                self.plan,
                self.ctx,
                self.peers,
                self.slot,
                self.compress,
                self.group.memo,
                self.layouts,
            )
        finally:
            self.cpu["replicate"] = time.thread_time() - c0

    def source_parts(self, _: Step) -> None:
        texts, world = self.word.texts, self.ctx.world_size
        parts = self.word.parts
        self.others = store_parts(self.storage, self.step, parts, texts, self.group, world, self.layouts)
        if self.node is not None:  # (the collector is its node's exchanger)
            self.node.others = self.others

    # ------------------------------------------------------------------ rank 0 and the index
    def await_records(self, step: Step) -> None:
        self._gather_records(step.peers)

    def commit(self, _: Step) -> None:
        if self.records is None:  # a job of one node: rank 0 collected every report itself
            self._gather_records(())
        assert self.records is not None
        own_errors = [] if self.node is not None else self.errors  # (a collector's are in its record)
        raise_if_failed(self.step, "the RAM tier", self.records, own_errors)
        own = self.own_record
        assert own is not None and own.part is not None
        local = {own.part.file, *own.others}  # the parts in rank 0's node's directory
        world = self.ctx.world_size
        self.committed = commit_index(self.storage, self.step, world, self.records, self.skeleton, local_parts=local)

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

    def _keeps_index_copy(self) -> bool:
        node = self.group.node
        return node != self.plan.nodes[0] and self.plan.holds_index(node)

    def _gather_records(self, collectors: tuple[int, ...]) -> None:
        """Rank 0: its node's record (where it collects it) and every other node's, from one
        exchange (commit/shared.py gather_records); the older keys are deleted once they are
        all in (every index holder has read the index of a step before it sends its records
        of the next)."""
        members = self.group.members
        self.record_keys = [exchange_key(self.key, n) for n in members if self.plan.exchanges]
        older = self.stack.enter_context(older_keys(self.ledger, self.at))
        if self.node is not None:
            self.mine = (self.node.record(self.errors), self.node.own_files())
        self.records = [self.mine[0]] if self.mine is not None else []
        self.own_record = self.records[0] if self.records else None
        got, complete = gather_records(self.ctx, self.group, ram_records_key(self.key), collectors)
        for c, record in zip(collectors, got, strict=True):
            self.records.append(record)
            if self.plan.roles_of(c).leader == 0:
                self.own_record = record
        if complete and not any(r.skipped for r in self.records):  # nobody reads the older keys any more
            delete_keys(self.ctx, older)

    def not_committed(self) -> None:
        """Rank 0's failure: remove what the step put in its node's directory, and tell the
        index holders there is no index to wait for."""
        if self.records is not None:
            own = self.own_record
            files = self.mine[1] if self.mine is not None else own.local_files() if own is not None else []
            discard(self.storage, self.step, files)
        if self.plan.exchanges and self.committed is None:
            with contextlib.suppress(Exception):  # (the store is gone: they time out instead)
                self.ctx.put(index_key(self.key), "")
                self._ledger_index_key()

    def _ledger_index_key(self) -> None:
        if self.ledger is not None:  # deleted after the next step's records: every index holder has read it then
            self.ledger.record_key(self.at, index_key(self.key))


def _posted_together(self: RamCommit, _: Step) -> None:
    """A replica's send and receive: posted all at once by the REPLICATE step (tiers/peers.py)."""


RamCommit.HANDLERS.update(
    {
        (Act.WRITE, None): RamCommit.write,
        (Act.SEND, Msg.REPORT): RamCommit.send_report,
        (Act.AWAIT, Msg.REPORT): RamCommit.await_reports,
        (Act.PART, None): RamCommit.part,
        (Act.SEND, Msg.EXCHANGE): RamCommit.send_exchange,
        (Act.AWAIT, Msg.EXCHANGE): RamCommit.await_exchanges,
        (Act.SEND, Msg.RELAY): RamCommit.send_relay,
        (Act.AWAIT, Msg.RELAY): RamCommit.await_relay,
        (Act.SEND, Msg.REPLICA): _posted_together,
        (Act.AWAIT, Msg.REPLICA): _posted_together,
        (Act.REPLICATE, None): RamCommit.replicate,
        (Act.SOURCE_PARTS, None): RamCommit.source_parts,
        (Act.SEND, Msg.OUTCOME): RamCommit.send_outcome,
        (Act.AWAIT, Msg.OUTCOME): RamCommit.await_outcomes,
        (Act.SEND, Msg.RECORD): RamCommit.send_record,
        (Act.AWAIT, Msg.RECORD): RamCommit.await_records,
        (Act.COMMIT, None): RamCommit.commit,
        (Act.SEND, Msg.INDEX): RamCommit.send_index,
        (Act.AWAIT, Msg.INDEX): RamCommit.await_index,
        (Act.INDEX_COPY, None): RamCommit.index_copy,
    }
)


def persist_node_local(
    storage: Storage,
    step: int,
    slot: Slot,
    skeleton: dict[str, Any],
    *,
    compress: str | None,
    pieces: Mapping[str, Piece] | None,
    rank_state: dict[str, Any] | None,
    ctx: DistContext,
    key: str,
    group: NodeGroup | None = None,
    peers: PeerGroup | None = None,
    ledger: KeyLedger | None = None,
    at: tuple[int, int] = (0, 0),
    cpu: dict[str, float] | None = None,
) -> Committed | None:
    """Persist one step to the RAM tier, with peer replicas (the plan's, `group.plan`);
    returns what was committed on rank 0, None elsewhere. `cpu`, when given, gets this
    thread's CPU seconds spent writing the data file ("write") and moving replicas
    ("replicate"): the rest of the call is the commit's coordination.

    `ledger` (rank 0's): the manifest keys of earlier steps, and every key of a step
    rank 0 skipped; deleted once this step's records are all in.
    """
    group = group or NodeGroup.of(ctx, None, RAM)
    assert group.plan.tier == RAM, "the RAM tier's commit runs a RAM tier's plan"
    args = (storage, step, slot, skeleton, compress, pieces, rank_state, ctx, key, ledger, at, group)
    return RamCommit(*args, peers=peers, cpu={} if cpu is None else cpu).run()


def write_index_copy(storage: Storage, step: int, data: bytes, written: Written | None) -> None:
    """An index holder's exchanger writes rank 0's index (`data`) into its node's directory, once
    it has checked that the index names its node's part as its collector wrote it (`written`:
    store_part's record) and the node's files are in place."""
    if data in (b"", b'""'):  # rank 0's "not committed" (put as JSON "")
        discard(storage, step, [name for name, _ in storage.list_dir(step_dir_name(step))])
        raise StorageError(f"step {step} was not committed to the RAM tier (rank 0 gave up)")
    where = f"the index of step {step} from rank 0"
    doc, version = parse_header(data, where)
    if version != INDEX_VERSION:
        raise FormatError(f"{where} has format version {version}, not {INDEX_VERSION}")
    index = parse_index(doc, where, expect_step=step)
    mine = written.part if written else None
    if (
        written is None
        or mine is None
        or not any(p.file == mine.file and p.checksum == mine.checksum for p in index.parts)
    ):
        raise StorageError(f"step {step}: {where} does not name this node's part")
    check_files_present(storage, step, {**written.files, mine.file: mine.nbytes})
    storage.write_bytes_atomic(f"{step_dir_name(step)}/{MANIFEST_NAME}", data)


def node_part(
    storage: Storage,
    step: int,
    texts: dict[int, bytes],
    ranks: tuple[int, ...],
    world: int,
    memo: CommitMemo,
    layouts: Callable[[str], Layout | None] | None = None,
) -> NodeShare:
    """A leader's part of its node: the ranks' reports checked and written as the node's
    part, beside their data files; or the node's errors. `layouts`: where the layouts of
    reports sent by reference are found (layouts.lookup)."""
    reports = [decode_report(r, texts[r], layouts, memo) for r in ranks]
    errors = [f"rank {r.rank}: {r.error}" for r in reports if r.error]
    skipped = any(r.skipped for r in reports)
    files = [r.file for r in reports if r.file is not None]
    if errors:
        return NodeShare(texts, errors, skipped, files)
    try:
        name, data, entries = build_part(step, reports, world, memo)
        written = store_part(storage, step, name, data, entries, list(ranks))
    except Exception as e:  # a malformed report or a storage failure: the node's error
        return NodeShare(texts, [f"node of rank {ranks[0]}: {e}"], skipped, files)
    layouts_sent = list({r.layout.digest: r.layout for r in reports if r.layout is not None}.values())
    return NodeShare(texts, [], skipped, files, written, layouts_sent)


def _collect_texts(
    group: NodeGroup, at: tuple[int, int], what: str, ctx: DistContext, senders: tuple[int, ...]
) -> dict[int, bytes]:
    lost = Report.failed(f"no report within {ctx.timeout_s:.0f}s").encode()
    return {r: raw or lost for r, raw in group.collect(at, what, ctx, senders, ctx.timeout_s).items()}


def _outcome_errors(rank: int, raw: bytes | None, parts: list[str] | None = None) -> list[str]:
    """A rank's replication outcome (untrusted, from the board): its errors; from the node's
    exchanger (`parts`: extended with them) also the parts of other nodes it wrote here."""
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
    """Policy "skip" on the RAM tier: this rank will not write the step of `key` (the training
    thread says so at once, while the step's commit may run): its leader, or, from a leader,
    rank 0 and (`exchange`: the tier keeps replicas) the leaders that take its node's replicas,
    hear it, so nobody waits for it. (A collector's record costs the training thread one store
    round trip: its count, shared.send_record.)"""
    text = Report.failed(reason, skipped=True).encode()
    if ctx.rank == 0 and exchange:
        ctx.put(index_key(key), "")  # the index holders wait for no index
    collector = (group.collector,)
    if ctx.rank != group.collector:
        # (From the training thread: it never waits for room in a mailbox, NodeBoard.send.)
        group.send(at, "w", ctx.rank, text, collector, patient=False)
        if ctx.rank != 0:  # (rank 0's outcome is never collected: the plan)
            group.send(at, "r", ctx.rank, Outcome().encode(), collector, patient=False)
        return
    others = tuple(r for r in group.ranks if r != ctx.rank)
    group.send_named(step_message(at, "skip"), reason.encode(), others, patient=False)  # no replicas this step
    if exchange:
        ctx.store.set(exchange_key(key, group.leader), Exchange({ctx.rank: text}).encode())
    if ctx.rank != 0:  # (rank 0 collecting its own node awaits no record)
        skipped = NodeShare({}, [f"rank {ctx.rank}: {reason}"], True)
        send_record(ctx, group, ram_records_key(key), skipped.record([]))

"""Commit a step to a shared tier (any fsspec URL) in O(nodes) store requests: the executor
of a shared tier's commit plan (commit/plan.py; `ftkit commit-plan --tier shared` prints it).

Every rank calls `persist`, which runs its steps of the plan in order::

    every rank:    WRITE              write_share(...): its data file, durable
                   SEND report        to its node's leader, over the node's board (no store request):
                                      its layout once (commit/layouts.py), then its per-step values
    node leaders:  AWAIT report       the node's reports
                   PART               build_part(...), store_part(...): one part file per node
                   SEND record        to rank 0, appended to `key`/n (DistContext.send_to_root):
                                      its part, or the node's errors
    rank 0:        AWAIT record       every other node's record: one wait and one read of that
                                      key, which it then deletes (DistContext.collect_at_root)
                   COMMIT             commit_index(...): manifest.json, the index of the parts

Store requests per step: an append and an add per node but rank 0's, a set by the last,
rank 0's wait and multi_get and three deletes: 2 x nodes + 4, whatever the number of
ranks or tensors. Rank 0 makes five of them, and handles one small record per node; the
tensor entries stay in the parts.

Data file names carry a random token, so a crashed or concurrent writer can never
overwrite bytes that a committed manifest points at, and a step that already has
a manifest is never written again. A failure before the commit removes what the
step's writers wrote and leaves every committed step untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from ftkit.commit.keys import KeyLedger, delete_keys, older_keys, shared_records_key
from ftkit.commit.layouts import from_board, lookup
from ftkit.commit.manifests import Committed, commit_index, store_part
from ftkit.commit.memo import CommitMemo
from ftkit.commit.messages import Record, Report
from ftkit.commit.node import NodeGroup, StepExecutor
from ftkit.commit.parts import build_part
from ftkit.commit.plan import Act, Msg, Step
from ftkit.commit.reports import RankReport, decode_report, failed
from ftkit.coord.dist import DistContext
from ftkit.coord.faultpoints import fault_point
from ftkit.errors import FormatError, StorageError
from ftkit.save.sharding import Piece
from ftkit.save.staging import Slot
from ftkit.save.write import discard, write_share
from ftkit.tiers.storage import Storage

log = logging.getLogger(__name__)


class SharedCommit(StepExecutor):
    """One rank's commit of one step to a shared tier (StepExecutor). Rank 0's failure after
    its node's part removes what the step wrote."""

    HANDLERS: ClassVar[dict[tuple[Act, Msg | None], Callable[[SharedCommit, Step], None]]] = {}

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.reports: dict[int, RankReport] = {}
        self.records: list[Record] = []  # rank 0's: its node's record first

    def not_committed(self) -> None:
        if self.records:
            discard(self.storage, self.step, [f for r in self.records for f in r.local_files()])

    def write(self, _: Step) -> None:
        write, self.error = write_share(self.storage, self.step, self.slot, self.pieces, self.compress, self.ctx.rank)
        fault_point("persist", self.step, self.ctx.rank)  # data written, not yet reported
        self.report_write(write)

    def await_reports(self, step: Step) -> None:
        timeout = self.ctx.timeout_s
        layouts = lookup(from_board(self.group.board, self.ctx.rank), self.group.memo)
        for r, raw in self.group.collect(self.at, "w", self.ctx, step.peers, timeout).items():
            lost = failed(r, f"no report within {timeout:.0f}s")
            self.reports[r] = decode_report(r, raw, layouts, self.group.memo) if raw is not None else lost

    def part(self, _: Step) -> None:
        assert self.own is not None
        self.reports[self.ctx.rank] = self.own
        reports = [self.reports[r] for r in self.group.ranks]
        self.records = [_node_record(self.storage, self.step, reports, self.ctx.world_size, self.group.memo)]

    def send_record(self, _: Step) -> None:
        send_record(self.ctx, self.group, shared_records_key(self.key), self.records[0])

    def await_records(self, step: Step) -> None:
        older = self.stack.enter_context(older_keys(self.ledger, self.at))
        records, complete = gather_records(self.ctx, self.group, shared_records_key(self.key), step.peers)
        self.records += records
        if complete:  # every leader sent the records of the steps before first
            delete_keys(self.ctx, older)

    def commit(self, _: Step) -> None:
        raise_if_failed(self.step, self.storage.display_url, self.records)
        fault_point("commit", self.step, 0)  # every part is durable, the index not yet written
        self.committed = commit_index(self.storage, self.step, self.ctx.world_size, self.records, self.skeleton)


SharedCommit.HANDLERS.update(
    {
        (Act.WRITE, None): SharedCommit.write,
        (Act.SEND, Msg.REPORT): SharedCommit.send_report,
        (Act.AWAIT, Msg.REPORT): SharedCommit.await_reports,
        (Act.PART, None): SharedCommit.part,
        (Act.SEND, Msg.RECORD): SharedCommit.send_record,
        (Act.AWAIT, Msg.RECORD): SharedCommit.await_records,
        (Act.COMMIT, None): SharedCommit.commit,
    }
)


def persist(
    storage: Storage,
    step: int,
    slot: Slot,
    skeleton: dict[str, Any],
    *,
    compress: str | None,
    pieces: Mapping[str, Piece] | None = None,
    rank_state: dict[str, Any] | None = None,
    ctx: DistContext | None = None,
    key: str = "",
    ledger: KeyLedger | None = None,
    at: tuple[int, int] = (0, 0),
    group: NodeGroup | None = None,
) -> Committed | None:
    """Persist one step: every rank writes its data, node leaders write the parts, rank 0
    commits after every node did. Returns what was committed on rank 0, None elsewhere.

    Rank 0 commits only when every rank succeeded within the timeout; otherwise the
    step stays uncommitted (invisible) and its files are removed. `ledger` (rank
    0's) holds the records of steps rank 0 skipped, which nobody read: they are
    deleted once this step's records are all in (every leader's persist thread
    takes its steps in order, so it has sent those first).
    """
    ctx = ctx or DistContext()
    group = group or NodeGroup.of(ctx, None)
    args = (storage, step, slot, skeleton, compress, pieces, rank_state, ctx, key, ledger, at, group)
    return SharedCommit(*args).run()


def _node_record(storage: Storage, step: int, reports: Sequence[RankReport], world: int, memo: CommitMemo) -> Record:
    """The leader's record of its node for rank 0: the part it wrote, or the node's errors."""
    errors = [f"rank {r.rank}: {r.error}" for r in reports if r.error]
    if not errors:
        try:
            name, data, files = build_part(step, reports, world, memo)
            written = store_part(storage, step, name, data, files, [r.rank for r in reports])
            return Record(written.part, written.files, written.stored)
        except Exception as e:  # a malformed report or a storage failure: the node's error
            errors = [f"node of rank {reports[0].rank}: {e}"]
    return Record.failed(errors, {r.file: r.nbytes for r in reports if r.file is not None})


def send_record(ctx: DistContext, group: NodeGroup, key: str, record: Record) -> None:
    """A node's record to rank 0 (both tiers' commits), sent by its collector under `key`."""
    ctx.send_to_root(key, group.leader, record.encode(), len(group.record_ids))


def gather_records(
    ctx: DistContext, group: NodeGroup, key: str, collectors: Sequence[int]
) -> tuple[list[Record], bool]:
    """Rank 0: the record of the node of each of `collectors` (the plan's AWAIT RECORD), in
    their order, from one exchange under `key` (DistContext.collect_at_root), and whether every
    one came. A record that did not come, or does not decode, is that node's error: the step
    is not committed."""
    leaders = [group.plan.roles_of(c).leader for c in collectors]
    try:
        raws = ctx.collect_at_root(key, leaders)
        lost = f"no record within {ctx.timeout_s:.0f}s"
    except FormatError as e:
        raws, lost = dict.fromkeys(leaders), f"unreadable records: {e}"
    records = [
        Record.failed([f"node of rank {n}: {lost}"]) if raw is None else read_node_record(n, raw, group.members[n])
        for n, raw in raws.items()
    ]
    return records, None not in raws.values()


def raise_if_failed(step: int, where: str, records: Sequence[Record], own_errors: Sequence[str] = ()) -> None:
    """Raise StorageError if any node's record (or rank 0's own `own_errors`) holds an error:
    the step is not committed. The message names the first few, and how many in all."""
    failures = list(dict.fromkeys([e for r in records for e in r.errors] + list(own_errors)))
    if failures:
        more = f" ({len(failures)} errors in all)" if len(failures) > 8 else ""
        raise StorageError(f"step {step} not committed to {where}: {'; '.join(failures[:8])}{more}")


def read_node_record(leader: int, raw: bytes, ranks: Sequence[int]) -> Record:
    """A node's record as rank 0 reads it from the store (both tiers' commits): untrusted.
    One that does not decode reads as that node's error, and the step is simply not committed."""
    where = f"the record of the node of rank {leader}"
    try:
        return Record.decode(raw, ranks, where)
    except FormatError as e:
        return Record.failed([f"unreadable record: {e}"])


def report_skipped_shared(ctx: DistContext, group: NodeGroup, key: str, at: tuple[int, int], reason: str) -> None:
    """Policy "skip" on a shared tier: this rank will not write the step of `key`; tell its
    leader at once (a leader tells rank 0, with its node's record), so nobody waits. (A
    leader's record costs the training thread one store round trip: its count, send_record.)"""
    if ctx.rank != group.leader:
        report = Report.failed(reason).encode()
        group.send(at, "w", ctx.rank, report, (group.leader,), patient=False)  # (the training thread: never waits)
    elif ctx.rank != 0:
        send_record(ctx, group, shared_records_key(key), Record.failed([f"rank {ctx.rank}: {reason}"]))

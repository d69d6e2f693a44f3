"""Commit a step to a shared tier (any fsspec URL) in O(nodes) store requests: `persist`
runs this rank's steps of the plan (docs/protocol.md) with `SharedCommit`. A failure
before the commit removes what the step wrote. Also the record helpers both tiers share."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ftkit.commit.keys import delete_keys, older_keys, shared_records_key
from ftkit.commit.manifests import commit_index
from ftkit.commit.messages import Record, Report
from ftkit.commit.node import NodeGroup, StepExecutor, runner
from ftkit.commit.parts import write_part
from ftkit.commit.plan import Step
from ftkit.coord.dist import DistContext
from ftkit.coord.faultpoints import fault_point
from ftkit.errors import FormatError, StorageError
from ftkit.save.write import discard, write_share

log = logging.getLogger(__name__)


class SharedCommit(StepExecutor):
    def __post_init__(self) -> None:
        super().__post_init__()
        self.records: list[Record] = []  # rank 0's: its node's record first

    def not_committed(self) -> None:
        if self.records:
            discard(self.storage, self.step, [f for r in self.records for f in r.local_files()])

    def write(self, _: Step) -> None:
        write, self.error = write_share(self.storage, self.step, self.slot, self.pieces, self.compress, self.ctx.rank)
        fault_point("persist", self.step, self.ctx.rank)  # data written, not yet reported
        self.report_write(write)

    def part(self, _: Step) -> None:
        reports = self.node_reports()
        written, errors = write_part(self.storage, self.step, reports, self.ctx.world_size, self.group.memo)
        files = {r.file: r.nbytes for r in reports if r.file is not None}
        record = Record(written.part, written.files, written.stored) if written else Record.failed(errors, files)
        self.records = [record]

    def send_record(self, _: Step) -> None:
        send_record(self.ctx, self.group, shared_records_key(self.key), self.records[0])

    def await_record(self, step: Step) -> None:
        older = self.stack.enter_context(older_keys(self.ledger, self.at))
        records, complete = gather_records(self.ctx, self.group, shared_records_key(self.key), step.peers)
        self.records += records
        if complete:  # every leader sent the older steps' records first
            delete_keys(self.ctx, older)
        elif self.ledger is not None:  # a record still to come sets its keys again: a later step deletes them
            self.ledger.record(self.at, self.key)

    def commit(self, _: Step) -> None:
        raise_if_failed(self.step, self.storage.display_url, self.records)
        fault_point("commit", self.step, 0)  # every part is durable, the index not yet written
        self.committed = commit_index(self.storage, self.step, self.ctx.world_size, self.records, self.skeleton)


# Persist one step to a shared tier (`persist(storage, step, slot, skeleton, compress=..., ctx=..., ...)`).
persist = runner(SharedCommit)


def send_record(ctx: DistContext, group: NodeGroup, key: str, record: Record) -> None:
    """A node's record to rank 0, sent by its collector under `key`."""
    ctx.send_to_root(key, group.leader, record.encode(), len(group.record_ids))


def gather_records(
    ctx: DistContext, group: NodeGroup, key: str, collectors: Sequence[int]
) -> tuple[list[Record], bool]:
    """Rank 0: the records of the nodes of `collectors`, in order, and whether every one came.
    A record that did not come or does not decode is that node's error."""
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
    """Raise StorageError naming the first errors of the records and `own_errors`, if any."""
    failures = list(dict.fromkeys([e for r in records for e in r.errors] + list(own_errors)))
    if failures:
        more = f" ({len(failures)} errors in all)" if len(failures) > 8 else ""
        raise StorageError(f"step {step} not committed to {where}: {'; '.join(failures[:8])}{more}")


def read_node_record(leader: int, raw: bytes, ranks: Sequence[int]) -> Record:
    """A node's record as rank 0 reads it (untrusted): one that does not decode is the node's error."""
    where = f"the record of the node of rank {leader}"
    try:
        return Record.decode(raw, ranks, where)
    except FormatError as e:
        return Record.failed([f"unreadable record: {e}"])


def report_skipped_shared(ctx: DistContext, group: NodeGroup, key: str, at: tuple[int, int], reason: str) -> None:
    """Policy "skip" on a shared tier, from the training thread: tell the leader (which tells rank 0)."""
    if ctx.rank != group.leader:
        report = Report.failed(reason).encode()
        group.send(at, "w", ctx.rank, report, (group.leader,), 0.0)
    elif ctx.rank != 0:
        send_record(ctx, group, shared_records_key(key), Record.failed([f"rank {ctx.rank}: {reason}"]))

"""Commit a step to a shared tier (any fsspec URL) in O(nodes) store requests.

Order of calls for one step (`persist` does all of it; every rank calls it; the
RAM tier's node-local commit is commit/ram.py)::

    every rank:    write_share(...)       its data file, durable
                   post its report (the file it wrote or its error, its RNG state) to
                   its node's board: a file in the node's shared memory, not the store
    node leaders:  collect the node's reports; write_part(...): one part file per node
                   set one record under `key`/n/<leader>: its part, or the node's errors
    rank 0:        read every node's record (one wait, one multi_get), then
                   commit_index(...): manifest.json, the index of the parts (the commit)
                   delete the records

Store requests per step: one set per node, rank 0's wait and multi_get, and one
delete per node: 2 x nodes + 2, whatever the number of ranks or tensors. Rank 0
handles one small record per node; the tensor entries stay in the parts.

Data file names carry a random token, so a crashed or concurrent writer can never
overwrite bytes that a committed manifest points at, and a step that already has
a manifest is never written again. A failure before the commit removes what the
step's writers wrote and leaves every committed step untouched.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ftkit.commit.keys import KeyLedger, delete_keys, older_keys
from ftkit.commit.layouts import Published
from ftkit.commit.manifests import Committed, commit_index, write_part
from ftkit.commit.reports import shared_report
from ftkit.coord.dist import DistContext
from ftkit.coord.faultpoints import fault_point
from ftkit.coord.nodelocal import NodeBoard, step_message
from ftkit.errors import FormatError, StorageError
from ftkit.format.index import is_part_name, rank_runs
from ftkit.format.validate import CHECKSUM_RE, MAX_INT, check_file_name, parse_json
from ftkit.save.sharding import Piece
from ftkit.save.staging import Slot
from ftkit.save.write import discard, write_share
from ftkit.tiers.storage import Storage

log = logging.getLogger(__name__)

MAX_REPORT_BYTES = 256 * 2**20  # one rank's tensor entries: megabytes at most


@dataclass(frozen=True)
class NodeGroup:
    """This rank's node as a shared tier's commit sees it (computed once, at start)."""

    board: NodeBoard | None  # where the node's ranks post their reports (None: a world of one)
    ranks: tuple[int, ...]  # this node's ranks; the first is its leader
    members: Mapping[int, tuple[int, ...]]  # every node's ranks, by leader (rank 0 checks records against it)
    published: Published = field(default_factory=Published, compare=False)  # the RAM tier's layouts in the store

    @staticmethod
    def of(ctx: DistContext, board: NodeBoard | None) -> NodeGroup:
        members: dict[str, list[int]] = {}
        for r, n in enumerate(ctx.nodes):
            members.setdefault(n, []).append(r)
        return NodeGroup(board, tuple(members[ctx.node]), {m[0]: tuple(m) for m in members.values()})

    @property
    def leader(self) -> int:
        return self.ranks[0]

    # The RAM tier's commit (commit/ram.py) spreads a node's share over its ranks: one rank
    # carrying the collector's, the exchanger's and rank 0's duties was the slowest of a commit
    # (bench_dist.py, 2 nodes of 2 ranks: 2.3-2.8 ms of CPU per snapshot on rank 0, 0.5 on rank 1).
    def collector_of(self, node: int) -> int:
        """The rank that collects the reports and outcomes of the node `node` (by its first
        rank) in the RAM tier's commit and writes its part and records: its leader, but on
        rank 0's node of a job of several nodes the next rank (rank 0 commits the step). In a
        job of one node rank 0 keeps it: its commit is small there, and a collector that is
        not rank 0 ties the two ranks' persists to each other's pace (a step a rank killed
        mid-persist never finished is one more step lost)."""
        ranks = self.members[node]
        return ranks[1] if node == 0 and len(ranks) > 1 and len(self.members) > 1 else ranks[0]

    @functools.cached_property
    def collector(self) -> int:
        """This node's collector (`collector_of`)."""
        return self.collector_of(self.ranks[0])

    @functools.cached_property
    def exchanger(self) -> int:
        """The rank that writes the parts of the nodes whose replicas this node holds, and on
        a node holding rank 0's replicas the index (commit/replicas.py): the node's first rank
        that neither collects nor commits; the collector where there is none."""
        return next((r for r in self.ranks if r not in (0, self.collector)), self.collector)

    @functools.cached_property
    def record_ids(self) -> tuple[int, ...]:
        """The nodes (by first rank) whose record rank 0 reads from the store in the RAM tier's
        commit, `key`/r/<id>: every node whose collector is not rank 0."""
        return tuple(n for n in self.members if self.collector_of(n) != 0)

    def node_board(self) -> NodeBoard:
        """The node's board, which every commit of a world of several ranks posts through."""
        assert self.board is not None, "a node of several ranks commits through its board"
        return self.board

    def to_leader(
        self,
        at: tuple[int, int],
        what: str,
        me: int,
        message: str | dict[str, Any],
        to: int | None = None,
        patient: bool = True,
    ) -> None:
        """Post this rank's message `what` of the step at `at` for its leader (`collect`), or
        for the rank `to` that collects it (the RAM tier's `collector`). `patient` False: from
        the training thread, which never waits for room in a mailbox (NodeBoard.send)."""
        name = step_message(at, f"{what}-r{me}")
        data = message.encode() if isinstance(message, str) else json.dumps(message, separators=(",", ":")).encode()
        self.node_board().send(name, data, (self.leader if to is None else to,), patient)

    def to_ranks(self, name: str, doc: Any, me: int, patient: bool = True, but: tuple[int, ...] = ()) -> None:
        """Post `doc` as `name` for the node's other ranks but those in `but` (the leader's word to them)."""
        data = json.dumps(doc, separators=(",", ":")).encode()
        self.node_board().send(name, data, [r for r in self.ranks if r != me and r not in but], patient)

    def collect(
        self, at: tuple[int, int], what: str, me: int, timeout_s: float, but: tuple[int, ...] = ()
    ) -> dict[int, bytes | None]:
        """The leader's wait for message `what` of the step at `at` from each other rank of its
        node but those in `but` (None: none came within `timeout_s`), then removing them and
        whatever an earlier step left that nobody collected (a step this leader skipped)."""
        names = {r: step_message(at, f"{what}-r{r}") for r in self.ranks if r != me and r not in but}
        if not names:
            return {}
        board = self.node_board()
        got = board.collect(names, timeout_s, MAX_REPORT_BYTES, me=me, only_reader=True)
        board.prune_before(at)
        return got


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
    write, error = write_share(storage, step, slot, pieces, compress, ctx.rank)
    fault_point("persist", step, ctx.rank)  # data written, not yet reported
    report: dict[str, Any] = {
        "write": write.to_json() if write else None,
        "error": str(error) if error else None,
        "rank_state": rank_state or {},
    }
    if ctx.rank != group.leader:
        group.to_leader(at, "w", ctx.rank, report)
    else:
        record = node_share(storage, step, report, group, ctx, at)
        if ctx.rank == 0:
            return commit_step(storage, step, record, group, ctx, key, skeleton, ledger, at)
        ctx.put(f"{key}/n/{ctx.rank}", record)
    if error is not None:
        raise error
    return None


def node_share(
    storage: Storage, step: int, report: dict[str, Any], group: NodeGroup, ctx: DistContext, at: tuple[int, int]
) -> dict[str, Any]:
    """A node leader's part of the commit: its node's reports (its own `report` and the
    others' from the board), then its part file; returns the node's record for rank 0."""
    reports = {
        r: shared_report(r, raw, ctx.world_size)
        if raw is not None
        else {"error": f"rank {r}: no report within {ctx.timeout_s:.0f}s", "write": None}
        for r, raw in group.collect(at, "w", ctx.rank, ctx.timeout_s).items()
    }
    reports[ctx.rank] = report
    return _node_record(storage, step, reports, group.ranks, ctx.world_size)


def commit_step(
    storage: Storage,
    step: int,
    record: dict[str, Any],
    group: NodeGroup,
    ctx: DistContext,
    key: str,
    skeleton: dict[str, Any],
    ledger: KeyLedger | None = None,
    at: tuple[int, int] = (0, 0),
) -> Committed:
    """Rank 0's part: every other node's record (one wait, one multi_get), then the index."""
    leaders = [leader for leader in group.members if leader != 0]
    keys = [f"{key}/n/{leader}" for leader in leaders]
    with older_keys(ledger, at) as older:
        records = [record]
        try:
            raws = ctx.wait_get(keys) if keys else []
            records += [
                read_node_record(leader, raw, group.members[leader], ctx.world_size)
                for leader, raw in zip(leaders, raws, strict=True)
            ]
            delete_keys(ctx, older)
            failures = [e for r in records for e in r["errors"]]
            if failures:
                raise StorageError(f"step {step} not committed to {storage.display_url}: {'; '.join(failures)}")
            fault_point("commit", step, 0)  # every part is durable, the index not yet written
            return commit_index(storage, step, ctx.world_size, records, skeleton)
        except BaseException:
            parts = [r["part"]["file"] for r in records if r["part"]]
            discard(storage, step, [f for r in records for f in r["files"]] + parts)
            raise
        finally:
            ctx.delete(*keys)


def _node_record(
    storage: Storage, step: int, reports: Mapping[int, dict[str, Any]], ranks: Sequence[int], world: int
) -> dict[str, Any]:
    """The leader's record of its node for rank 0: the part it wrote, or the node's errors."""
    writes = [reports[r]["write"] for r in ranks if reports[r].get("write")]
    files = {w["file"]: w.get("nbytes") for w in writes}
    errors = [f"rank {r}: {reports[r]['error']}" for r in ranks if reports[r].get("error")]
    if not errors:
        try:
            rank_state = {str(r): reports[r].get("rank_state", {}) for r in ranks}
            return {**write_part(storage, step, writes, rank_state, list(ranks), world), "errors": []}
        except Exception as e:  # a malformed report or a storage failure: the node's error
            errors = [f"node of rank {ranks[0]}: {e}"]
    return {"part": None, "files": files, "stored": 0, "errors": errors}


def read_node_record(leader: int, raw: bytes, ranks: Sequence[int], world: int) -> dict[str, Any]:
    """A node's record as rank 0 reads it from the store (both tiers' commits): untrusted.
    One that does not validate reads as that node's error, and the step is simply not
    committed. "skipped": whether a rank of the node skipped the step (the RAM tier's)."""
    where = f"the record of the node of rank {leader}"
    try:
        doc = parse_json(raw, where, "")
        if not isinstance(doc, dict):
            raise FormatError(f"{where} is not an object")
        errors, files, part = doc.get("errors"), doc.get("files"), doc.get("part")
        if not isinstance(errors, list) or not all(isinstance(e, str) for e in errors):
            raise FormatError(f"{where} has malformed errors")
        if not isinstance(files, dict):
            raise FormatError(f"{where} has malformed files")
        for name in files:
            check_file_name(name)
        stored = doc.get("stored")
        if type(stored) is not int or not 0 <= stored <= MAX_INT:
            raise FormatError(f"{where} has a bad byte count")
        if part is None:
            if not errors:
                raise FormatError(f"{where} has neither a part nor an error")
        elif not (
            isinstance(part, dict)
            and check_file_name(part.get("file"))
            and type(part.get("bytes")) is int
            and 0 < part["bytes"] <= MAX_INT
            and isinstance(part.get("checksum"), str)
            and CHECKSUM_RE.match(part["checksum"])
            and part.get("ranks") == rank_runs(list(ranks))
        ):
            raise FormatError(f"{where} names no valid part of its ranks")
        others = doc.get("others", [])  # (the RAM tier's: parts of other nodes its exchanger wrote there)
        if not isinstance(others, list) or not all(is_part_name(o) for o in others):
            raise FormatError(f"{where} names malformed parts of other nodes")
        return {
            "part": part,
            "files": files,
            "stored": stored,
            "errors": errors,
            "skipped": doc.get("skipped") is True,
            "others": others,
        }
    except FormatError as e:
        errors = [f"unreadable record: {e}"]
        return {"part": None, "files": {}, "stored": 0, "errors": errors, "skipped": False, "others": []}


def report_skipped_shared(ctx: DistContext, group: NodeGroup, key: str, at: tuple[int, int], reason: str) -> None:
    """Policy "skip" on a shared tier: this rank will not write the step of `key`; tell its
    leader at once (a leader tells rank 0, with its node's record), so nobody waits."""
    report: dict[str, Any] = {"write": None, "error": reason, "rank_state": {}}
    if ctx.rank != group.leader:
        group.to_leader(at, "w", ctx.rank, report, patient=False)  # (the training thread: never waits)
    elif ctx.rank != 0:
        errors = [f"rank {ctx.rank}: {reason}"]
        ctx.put(f"{key}/n/{ctx.rank}", {"part": None, "files": {}, "stored": 0, "errors": errors})

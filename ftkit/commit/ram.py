"""The RAM tier's commit: node-local, with peer replicas, in O(nodes) store requests.

A node's share of a commit is spread over its ranks (commit/shared.py NodeGroup): its
*collector* (its first rank; on rank 0's node of a job of several nodes the next one, as
rank 0 commits) collects the reports and outcomes and writes the part and the records;
its *exchanger* (a rank that neither collects nor commits, else the collector) writes the
parts of the nodes whose replicas it holds and, on a node holding rank 0's replicas, the
index; rank 0 commits. Order of calls for one step (`persist_node_local`; every rank
calls it; the shared tiers' commit is commit/shared.py). The step's manifest has format
version 3, as on a shared tier: one part per node and an index (format/index.py)::

    every rank:   write_share(...): its data file, in its node's directory
                  post its report (`NodeReport`) to its collector's mailbox (coord/mailbox.py; no store request)
    collectors:   collect the node's reports; write the node's part (checked, beside its data)
    with replicas (commit/replicas.py):
      collectors  set the reports and the part as one record, `key`/w/<node> (a node is named
                  by its first rank); read the records of the k nodes before theirs (whose
                  ranks send this node their replicas) and of the k after; post the reports,
                  the names and checksums of the sources' parts and (on an index holder) the
                  node's own part's, on the board, for every rank of the node but rank 0
      rank 0      (where another rank collects) reads those records, and its node's, itself
      every rank  sends its file to its targets, stores verified copies of what its sources
                  send (tiers/peers.py), posts its outcome to the board (rank 0 keeps its own)
      exchangers  write the parts of the k nodes before theirs (a node keeps the parts of the
                  ranks whose files it holds), and name them in their outcome
    collectors:   collect the outcomes (but rank 0's, which it keeps); set the node's record
                  for rank 0, `key`/r/<node>: its part's name, size and checksum (and the parts
                  its exchanger wrote), or the node's errors (a few hundred bytes)
    rank 0:       (ram_index.py) read every node's record (one wait, one multi_get; its own
                  node's too, but where it collects it itself), add its own replication errors
                  to its node's, write the index (manifest.json,
                  the commit), delete the step's records; with replicas, set the index under
                  `key`/manifest (or "" when the step is not committed)
    the exchangers of the k nodes that hold rank 0's node's replicas (ram_index.py): read
                  the index, check it names their node's part (as their collector relayed it)
                  and their files are in place, write it
    rank 0, after retention (tiers/backend.py): the commit news (coord/news.py), which
                  the other leaders hear with their heartbeats and keep or drop steps by

The index lives where rank 0's data lives (its node and the nodes holding its replicas):
losing all of them loses rank 0's share of the step, so the step anyway. The other
nodes read nothing back: at restore, a node without the index gets it through the
store from a node that has it (restore/read.py), as it gets the parts it lacks.

Why three roles: one rank carrying them all was the slowest of a commit (bench_dist.py,
2 nodes of 2 ranks, the same hour: 2.6-3.1 ms of coordination CPU per snapshot on rank 0
and 2.3-2.8 on the other leader, 0.6-0.7 on the other ranks; 1.7-2.1 on every rank with
the roles spread). A rank with no role makes no store request; a collector one (its
node's record for rank 0), with replicas three more (its reports; the records of the k
nodes before and after it, in one wait and one multi_get); an exchanger of the k index
holders two (a wait and a get of the index); rank 0 one delete for every node's record
(two with replicas) and the news, with replicas two more where it does not collect (a wait
and a multi_get of its partners' records and its node's). Per step: 2 x nodes + 3 requests
without replicas, 6 x nodes + 2k + 6 with (four fewer where rank 0 collects its own node). A wait and the read
after it count as two: on the persist thread's own connection they are one multi_get, which
waits itself (DistContext.wait_get). Rank 0 handles O(nodes) bytes, a collector its node's
entries and those of k other nodes. A node holds the parts of the ranks whose files it
holds, not every part: at restore, parts a node lacks come through the store from a node
that has them.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ftkit.commit.keys import KeyLedger, older_keys
from ftkit.commit.layouts import Layout, board_name, from_board, from_store, layout_of, lookup
from ftkit.commit.manifests import Committed, store_part
from ftkit.commit.part_template import node_part_bytes
from ftkit.commit.ram_index import commit_from_records, holds_index, write_index_copy
from ftkit.commit.replicas import peer_reports, replicate, store_parts
from ftkit.commit.reports import NodeReport, decode_report, keep_own
from ftkit.commit.shared import NodeGroup
from ftkit.coord.dist import DistContext
from ftkit.coord.nodelocal import step_message
from ftkit.errors import AlreadyCommitted, FormatError
from ftkit.format.index import is_part_name
from ftkit.format.validate import parse_json
from ftkit.save.sharding import Piece
from ftkit.save.staging import Slot
from ftkit.save.write import write_share
from ftkit.tiers.peers import PeerGroup, ReplicaLayout
from ftkit.tiers.storage import Storage

log = logging.getLogger(__name__)


@dataclass
class NodeShare:
    """A leader's view of its node's share of a step: the ranks' reports, the part it
    wrote of them (or the node's errors), and the parts of other nodes it wrote."""

    texts: dict[int, str]
    errors: list[str]
    skipped: bool  # a rank of the node skipped the step (policy "skip")
    files: list[str] = field(default_factory=list)  # the data files its ranks reported
    written: dict[str, Any] | None = None  # store_part's record of the node's part
    layouts: list[Layout] = field(default_factory=list)  # of the reports sent by reference
    others: list[str] = field(default_factory=list)  # parts of the replica sources, written here

    def exchanged(self) -> dict[str, Any]:
        """The record the nodes exchanging replicas with this one read (`key`/w/<leader>): the
        reports, and the part's name and checksum (its holders rebuild its bytes from the
        reports, commit/replicas.py store_parts, and check them against the checksum)."""
        doc: dict[str, Any] = {str(r): t for r, t in self.texts.items()}
        if self.written is not None:
            doc["part"] = {"file": self.written["part"]["file"], "checksum": self.written["part"]["checksum"]}
        return doc

    def record(self, errors: list[str]) -> dict[str, Any]:
        """The node's record for rank 0 (`key`/r/<leader>; commit.read_node_record reads it)."""
        w = self.written
        return {
            "part": w["part"] if w and not errors else None,
            "files": w["files"] if w else {},
            "stored": w["stored"] if w else 0,
            "errors": self.errors + errors,
            "skipped": self.skipped,
            **({"others": self.others} if self.others else {}),
        }

    def own_files(self) -> list[str]:
        """What this step put in the node's directory that a failed commit removes."""
        return self.files + ([self.written["part"]["file"]] if self.written else []) + self.others


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
    layout: ReplicaLayout | None = None,
    peers: PeerGroup | None = None,
    replicas: int = 0,
    ledger: KeyLedger | None = None,
    at: tuple[int, int] = (0, 0),
    cpu: dict[str, float] | None = None,
) -> Committed | None:
    """Persist one step to a node-local tier (the RAM tier), with peer replicas; returns
    what was committed on rank 0, None elsewhere. `cpu`, when given, gets this thread's
    CPU seconds spent writing the data file ("write") and moving replicas ("replicate"):
    the rest of the call is the commit's coordination.

    `ledger` (rank 0's): the manifest keys of earlier steps, and every key of a step
    rank 0 skipped; deleted once this step's records are all in (every index holder reads
    the index of a step before it sends its records of the next).
    """
    group = group or NodeGroup.of(ctx, None)
    cpu = {} if cpu is None else cpu
    c0 = time.thread_time()
    try:
        write, error = write_share(storage, step, slot, pieces, compress, ctx.rank)
    except AlreadyCommitted as e:  # this node has the step, another may not: still take part below
        write, error = None, e
    cpu["write"] = time.thread_time() - c0
    # Uncompressed, a rank's chunks keep their places: its layout goes once, by reference.
    ref = layout_of(write) if write is not None and compress is None else None
    text = NodeReport.encode(write, str(error) if error else None, rank_state, ref=ref)
    collector = ctx.rank == group.collector  # (the node's leader but on rank 0's node: NodeGroup.collector)
    node_id = group.ranks[0]  # the node's name in the store's keys
    exchange = replicas > 0 and peers is not None and ctx.distributed  # nodes swap reports for replicas
    # A node holding rank 0's replicas keeps its index too (written by the node's exchanger).
    holder = exchange and ctx.node != ctx.nodes[0] and holds_index(ctx, layout, replicas)
    node: NodeShare | None = None
    # 1. Reports: to the node's collector, who writes the node's part and publishes both (one key per node).
    if ctx.distributed and not collector:
        if ref is not None:
            group.node_board().post_once(board_name(ref[0].digest), ref[0].body)
        group.to_leader(at, "w", ctx.rank, text, to=group.collector)
    else:
        if write is not None and error is None:
            keep_own(text, write, rank_state, ref, ctx.world_size)  # (node_part decodes it: not parsed back)
        texts = {ctx.rank: text, **(_collect_texts(group, at, "w", ctx) if ctx.distributed else {})}
        node = node_part(storage, step, texts, group.ranks, ctx.world_size, lookup(from_board(group.board)))
        if exchange:
            group.published.publish(ctx.store, node.layouts)  # before the record that names them
            ctx.store.set(f"{key}/w/{node_id}", json.dumps(node.exchanged()))
    # 2. Replicas: each rank sends its file to its targets and stores what its sources send;
    #    the node's exchanger writes the sources' parts (replicas.py).
    rep_error = None
    own_part: dict[str, Any] | None = None  # the exchanger's, on an index holder: its node's part
    others: list[str] = []  # the parts of the ranks whose replicas this node now holds (the exchanger's)
    if exchange:
        assert layout is not None and peers is not None
        try:
            own = node.written if node is not None and holder else None
            word = peer_reports(group, layout, replicas, ctx, key, at, collector, own, text)
            reports, own_part = word.texts, word.own_part
            sending = write if word.may_send and error is None else None
            layouts = lookup(from_store(ctx.store))
            c0 = time.thread_time()
            try:
                replicate(storage, step, sending, reports, layout, replicas, ctx, peers, slot, compress, layouts)
            finally:
                cpu["replicate"] = time.thread_time() - c0
            if ctx.rank == group.exchanger:
                others = store_parts(storage, step, word.parts, reports, group, ctx.world_size, layouts)
        except Exception as e:
            rep_error = f"replication failed: {e}"
            log.error("rank %d: step %d: %s", ctx.rank, step, rep_error)
    # 3. Outcomes: to the collector, who publishes the node's record. Rank 0 keeps its own: it
    #    commits from that record and adds its errors there (a message and a wait less on its node,
    #    and its collector need not wait for rank 0's replicas to be in).
    errors = [f"rank {ctx.rank}: {rep_error}"] if rep_error else []
    if ctx.distributed and not collector:
        if ctx.rank != 0:
            outcome = {"errors": errors, "parts": others} if others else {"errors": errors}
            group.to_leader(at, "r", ctx.rank, outcome, to=group.collector)
    elif ctx.distributed:
        assert node is not None
        node.others = others
        for r, raw in group.collect(at, "r", ctx.rank, ctx.timeout_s, but=(0,)).items():
            errors += _outcome_errors(r, raw, node.others if r == group.exchanger else None)
        if ctx.rank != 0:
            ctx.put(f"{key}/r/{node_id}", node.record(errors))
    if ctx.rank == 0:
        with older_keys(ledger, at) as older:
            mine = (node.record(errors), node.own_files()) if node is not None else None
            own_errors = [] if node is not None else errors  # (a collector's are in its record)
            return commit_from_records(
                storage, step, skeleton, ctx, key, group, mine, older, ledger, at, exchange, own_errors
            )
    if error is not None:
        raise error
    if holder and ctx.rank == group.exchanger:
        write_index_copy(storage, step, ctx, key, own_part)
    return None


def node_part(
    storage: Storage,
    step: int,
    texts: dict[int, str],
    ranks: tuple[int, ...],
    world: int,
    layouts: Callable[[str], Layout | None] | None = None,
) -> NodeShare:
    """A leader's part of its node: the ranks' reports checked and written as the node's
    part, beside their data files; or the node's errors. `layouts`: where the layouts of
    reports sent by reference are found (layouts.lookup)."""
    reports = [decode_report(r, texts[r], world, layouts) for r in ranks]
    errors = [f"rank {r.rank}: {r.error}" for r in reports if r.error]
    skipped = any(r.skipped for r in reports)
    files = [r.file for r in reports if r.file is not None]
    if errors:
        return NodeShare(texts, errors, skipped, files)
    try:
        name, data, entries = node_part_bytes(storage, step, reports, ranks, world)
        written = store_part(storage, step, name, data, entries, list(ranks))
    except Exception as e:  # a malformed report or a storage failure: the node's error
        return NodeShare(texts, [f"node of rank {ranks[0]}: {e}"], skipped, files)
    by_ref = list({r.layout.digest: r.layout for r in reports if r.layout is not None}.values())
    return NodeShare(texts, [], skipped, files, written, by_ref)


def _collect_texts(group: NodeGroup, at: tuple[int, int], what: str, ctx: DistContext) -> dict[int, str]:
    out = {}
    for r, raw in group.collect(at, what, ctx.rank, ctx.timeout_s).items():
        text = None
        if raw is not None:
            try:
                text = raw.decode()
            except UnicodeDecodeError:
                pass
        if text is None:
            text = NodeReport.encode(None, f"no report within {ctx.timeout_s:.0f}s", None)
        out[r] = text
    return out


def _outcome_errors(rank: int, raw: bytes | None, parts: list[str] | None = None) -> list[str]:
    """A rank's replication outcome (untrusted, from the board): its errors; from the node's
    exchanger (`parts`: extended with them) also the parts of other nodes it wrote here."""
    if raw is None:
        return [f"rank {rank}: no replication outcome"]
    try:
        doc = parse_json(raw, f"rank {rank}'s outcome", "")
    except FormatError as e:
        return [f"rank {rank}: {e}"]
    errors = doc.get("errors") if isinstance(doc, dict) else None
    if not isinstance(errors, list) or not all(isinstance(e, str) for e in errors):
        return [f"rank {rank}: a malformed replication outcome"]
    if parts is not None:
        named = doc.get("parts", [])
        if not isinstance(named, list) or not all(is_part_name(n) for n in named):
            return [*errors, f"rank {rank}: a malformed list of the parts it wrote"]
        parts += named
    return errors


def report_skipped_node_local(
    ctx: DistContext, group: NodeGroup, key: str, at: tuple[int, int], reason: str, exchange: bool
) -> None:
    """Policy "skip" on the RAM tier: this rank will not write the step of `key` (the training
    thread says so at once, while the step's commit may run): its leader, or, from a leader,
    rank 0 and (`exchange`: the tier keeps replicas) the leaders that take its node's replicas,
    hear it, so nobody waits for it."""
    text = NodeReport.encode(None, reason, None, skipped=True)
    if ctx.rank == 0 and exchange:
        ctx.put(f"{key}/manifest", "")  # the index holders wait for no index
    if ctx.rank != group.collector:
        # (From the training thread: it never waits for room in a mailbox, NodeBoard.send.)
        group.to_leader(at, "w", ctx.rank, text, to=group.collector, patient=False)
        if ctx.rank != 0:  # (rank 0's outcome is never collected: persist_node_local)
            group.to_leader(at, "r", ctx.rank, {"errors": []}, to=group.collector, patient=False)
        return
    group.to_ranks(step_message(at, "skip"), {"reason": reason}, ctx.rank, patient=False)  # no replicas this step
    node_id = group.ranks[0]
    if exchange:
        ctx.store.set(f"{key}/w/{node_id}", json.dumps({str(ctx.rank): text}))
    if ctx.rank != 0 or not exchange:
        skipped = NodeShare({}, [f"rank {ctx.rank}: {reason}"], True)
        ctx.put(f"{key}/r/{node_id}", skipped.record([]))

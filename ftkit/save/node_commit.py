"""The RAM tier's commit: node-local, with peer replicas, in O(nodes) store requests.

Order of calls for one step (`persist_node_local`; every rank calls it; the shared
tiers' commit is save/commit.py). The step's manifest has format version 3, as on a
shared tier: one part per node and an index (format/index.py)::

    every rank:   write_share(...): its data file, in its node's directory
                  post its report (`NodeReport`) to its node's board (a file, no store request)
    node leaders: collect the node's reports; write the node's part (checked, beside its
                  data); set the reports and the part as one record, `key`/w/<leader>
    with replicas:
      leaders     read the records of the k nodes before theirs (whose ranks send this
                  node their replicas) and of the k after; post the reports on the board
      every rank  sends its file to its targets, stores verified copies of what its
                  sources send (tiers/peers.py), posts its outcome to the board
      leaders     write the parts of the k nodes before theirs: a node keeps the parts of
                  the ranks whose files it holds
    node leaders: collect the outcomes; set the node's record for rank 0, `key`/r/<leader>:
                  its part's name, size and checksum, or the node's errors (a few hundred bytes)
    rank 0:       read every node's record (one wait, one multi_get), write the index
                  (manifest.json, the commit), set it under `key`/manifest (or "" when the
                  step is not committed), delete the step's records
    node leaders: read the index, check it names their part and their files are in
                  place, write it

A non-leader rank makes no store request; a leader makes a constant number (its
two records, the k before and after it, the index); rank 0 two for every node's
records. Rank 0 handles O(nodes) bytes, a leader its node's entries, those of k
other nodes and the index (O(nodes) bytes, ~110 per node). A node holds the parts
of the ranks whose files it holds, not every part: at restore, parts a node lacks
come through the store from a node that has them (restore/read.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ftkit.coord.dist import DistContext
from ftkit.coord.faultpoints import fault_point
from ftkit.coord.nodelocal import step_message
from ftkit.errors import AlreadyCommitted, CorruptCheckpointError, FormatError, StorageError
from ftkit.format import codec
from ftkit.format.index import INDEX_VERSION, is_part_file, parse_index
from ftkit.format.manifest import MANIFEST_NAME, step_dir_name
from ftkit.format.validate import check_file_name, parse_header, parse_json
from ftkit.save.commit import MAX_REPORT_BYTES, NodeGroup, read_node_record
from ftkit.save.keys import KeyLedger, delete_keys, older_keys
from ftkit.save.manifests import Committed, build_part, check_files_present, commit_index, store_part
from ftkit.save.reports import NodeReport, decode_report
from ftkit.save.sharding import Piece
from ftkit.save.staging import Slot
from ftkit.save.write import discard, write_share
from ftkit.tiers.peers import PeerGroup, ReplicaLayout, Transfer
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
    part_text: str = ""
    others: list[str] = field(default_factory=list)  # parts of the replica sources, written here

    def exchanged(self) -> dict[str, Any]:
        """The record the nodes exchanging replicas with this one read (`key`/w/<leader>)."""
        doc: dict[str, Any] = {str(r): t for r, t in self.texts.items()}
        if self.written is not None:
            doc["part"] = {"file": self.written["part"]["file"], "text": self.part_text}
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
    rng: Any,
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
    rank 0 skipped; deleted once this step's records are all in (every leader reads
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
    text = NodeReport.encode(write, str(error) if error else None, rng)
    leader = ctx.rank == group.leader
    node: NodeShare | None = None
    # 1. Reports: to the node's leader, who writes the node's part and publishes both (one key per node).
    if ctx.distributed and not leader:
        _board(group).write_text(step_message(at, f"w-r{ctx.rank}"), text)
    else:
        texts = {ctx.rank: text, **(_collect_texts(group, at, "w", ctx) if ctx.distributed else {})}
        node = node_part(storage, step, texts, group.ranks, ctx.world_size)
        if ctx.distributed:
            ctx.store.set(f"{key}/w/{ctx.rank}", json.dumps(node.exchanged()))
    # 2. Replicas: each rank sends its file to its targets and stores what its sources send.
    rep_error = None
    if peers is not None and replicas > 0 and ctx.distributed:
        assert layout is not None
        try:
            reports, may_send, parts = _peer_reports(group, layout, replicas, ctx, key, at, leader)
            sending = write if may_send and error is None else None
            c0 = time.thread_time()
            try:
                _replicate(storage, step, sending, reports, layout, replicas, ctx, peers, slot, compress)
            finally:
                cpu["replicate"] = time.thread_time() - c0
            if node is not None:  # the parts of the ranks whose replicas this node now holds
                node.others = _store_parts(storage, step, parts)
        except Exception as e:
            rep_error = f"replication failed: {e}"
            log.error("rank %d: step %d: %s", ctx.rank, step, rep_error)
    # 3. Outcomes: to the leader, who publishes the node's record.
    errors = [f"rank {ctx.rank}: {rep_error}"] if rep_error else []
    if ctx.distributed and not leader:
        _board(group).write(step_message(at, f"r-r{ctx.rank}"), {"errors": errors})
    elif ctx.distributed:
        for r, raw in group.collect(at, "r", ctx.rank, ctx.timeout_s).items():
            errors += _outcome_errors(r, raw)
        if ctx.rank != 0:
            assert node is not None
            ctx.put(f"{key}/r/{ctx.rank}", node.record(errors))
    if ctx.rank == 0:
        assert node is not None
        with older_keys(ledger, at) as older:
            return _commit(storage, step, skeleton, ctx, key, group, node, errors, older, ledger, at)
    if error is not None:
        raise error
    if node is not None:  # write rank 0's index into this node's directory
        _write_index(storage, step, ctx, key, node)
    return None


def node_part(storage: Storage, step: int, texts: dict[int, str], ranks: tuple[int, ...], world: int) -> NodeShare:
    """A leader's part of its node: the ranks' reports checked and written as the node's
    part, beside their data files; or the node's errors."""
    reports = [decode_report(r, texts[r], world) for r in ranks]
    errors = [f"rank {r.rank}: {r.error}" for r in reports if r.error]
    skipped = any(r.skipped for r in reports)
    files = [r.file for r in reports if r.file is not None]
    if errors:
        return NodeShare(texts, errors, skipped, files)
    try:
        writes = [r.write_doc() for r in reports if r.file]
        rank_state = {str(r.rank): {"rng": r.rng} for r in reports}
        name, data, entries = build_part(storage, step, writes, rank_state, list(ranks), world)
        written = store_part(storage, step, name, data, entries, list(ranks))
    except Exception as e:  # a malformed report or a storage failure: the node's error
        return NodeShare(texts, [f"node of rank {ranks[0]}: {e}"], skipped, files)
    return NodeShare(texts, [], skipped, files, written, data.decode())


def _board(group: NodeGroup):
    assert group.board is not None, "a distributed RAM tier commits through its node's board"
    return group.board


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


def _outcome_errors(rank: int, raw: bytes | None) -> list[str]:
    if raw is None:
        return [f"rank {rank}: no replication outcome"]
    try:
        doc = parse_json(raw, f"rank {rank}'s outcome", "")
    except FormatError as e:
        return [f"rank {rank}: {e}"]
    errors = doc.get("errors") if isinstance(doc, dict) else None
    if not isinstance(errors, list) or not all(isinstance(e, str) for e in errors):
        return [f"rank {rank}: a malformed replication outcome"]
    return errors


def _node_doc(raw: bytes, where: str) -> dict[str, Any]:
    try:
        doc = parse_json(raw, where, "")
    except FormatError:
        doc = None
    return doc if isinstance(doc, dict) else {}


def _node_texts(doc: dict[str, Any], ranks: tuple[int, ...], where: str) -> dict[int, str]:
    """A node's reports as read from the store (untrusted): one text per rank of the node;
    one missing or malformed reads as an error report."""
    out = {}
    for r in ranks:
        t = doc.get(str(r))
        out[r] = t if isinstance(t, str) else NodeReport.encode(None, f"no report in {where}", None)
    return out


def _node_part_text(doc: dict[str, Any]) -> tuple[str, str] | None:
    """(file name, text) of the part in a node's record, if it names one properly (its
    bytes are checked against the index's checksum by whoever reads them)."""
    part = doc.get("part")
    if not isinstance(part, dict) or not isinstance(part.get("text"), str):
        return None
    try:
        name = check_file_name(part.get("file"))
    except FormatError:
        return None
    return (name, part["text"]) if is_part_file(name) else None


def _peer_reports(
    group: NodeGroup, layout: ReplicaLayout, k: int, ctx: DistContext, key: str, at: tuple[int, int], leader: bool
) -> tuple[dict[int, str], bool, dict[str, str]]:
    """The reports of the nodes this node exchanges replicas with (the k before it send,
    the k after it receive), read from the store by the leader and relayed to its ranks
    through the board; whether this rank may send its own file; and (the leader's) the
    parts of the nodes that send it replicas, {file: text}. When the leader skipped the
    step, its ranks read the reports themselves (their sources send them replicas all
    the same) and send nothing (the leader's record, which their targets read, does not
    hold their reports)."""
    name, skip = step_message(at, "peers"), step_message(at, "skip")
    if not leader:
        raw = _board(group).collect({0: name}, ctx.timeout_s, MAX_REPORT_BYTES, give_up=skip)[0]
        if raw is not None:
            doc = parse_json(raw, "the peer nodes' reports", "")
            if not isinstance(doc, dict):
                raise StorageError("this node's leader relayed malformed peer reports")
            return {int(r): t for r, t in doc.items() if r.isdigit() and isinstance(t, str)}, True, {}
        if _board(group).read_bytes(skip, 1024) is None:
            raise StorageError(f"this node's leader (rank {group.leader}) sent no word on the replicas to exchange")
    sources = layout.source_nodes(ctx.rank, ctx.nodes, k)
    nodes = dict.fromkeys(sources + layout.target_nodes(ctx.rank, ctx.nodes, k))
    leaders = [layout.members[n][0] for n in nodes]
    raws = ctx.wait_get([f"{key}/w/{s}" for s in leaders]) if leaders else []
    texts: dict[int, str] = {}
    parts: dict[str, str] = {}
    source_leaders = {layout.members[n][0] for n in sources}
    for s, raw in zip(leaders, raws, strict=True):
        where = f"the reports of the node of rank {s}"
        doc = _node_doc(raw, where)
        texts.update(_node_texts(doc, group.members[s], where))
        part = _node_part_text(doc) if s in source_leaders else None
        if part is not None:
            parts[part[0]] = part[1]
    if leader:
        _board(group).write(name, {str(r): t for r, t in texts.items()})
    return texts, leader, parts


def _store_parts(storage: Storage, step: int, parts: dict[str, str]) -> list[str]:
    """Write the parts of the nodes whose replicas this node holds (a reader checks each
    against the index's size and checksum before it parses it)."""
    step_dir = step_dir_name(step)
    for name, text in parts.items():
        storage.write_bytes_atomic(f"{step_dir}/{name}", text.encode())
    return list(parts)


def _replicate(
    storage: Storage,
    step: int,
    write,
    reports: dict[int, str],
    layout: ReplicaLayout,
    k: int,
    ctx: DistContext,
    peers: PeerGroup,
    slot: Slot,
    compress: str | None,
) -> None:
    """Send this rank's file (`write`; None: nothing to send) to its replica targets; store
    verified copies of what its sources send (`reports`: theirs and the targets').
    Both ends of a transfer decide from the same report: a rank that could not write
    sends nothing and its targets expect nothing from it; nobody sends to a target
    that skipped the step (its persist thread never runs it). The step will not be
    committed then anyway."""
    import torch

    step_dir = step_dir_name(step)
    incoming: dict[str, tuple[list[dict[str, Any]], int]] = {}
    plan: list[Transfer] = []
    for t in layout.transfers_of(ctx.rank, ctx.nodes, k):
        if t.src == ctx.rank:
            if write is not None and not decode_report(t.dst, reports.get(t.dst, ""), ctx.world_size).skipped:
                plan.append(Transfer(t.src, t.dst, write.file))
            continue
        report = decode_report(t.src, reports.get(t.src, ""), ctx.world_size)
        if report.file is None or report.error:
            continue
        incoming[report.file] = (report.tensors(), report.nbytes)  # validated: checked on arrival
        plan.append(Transfer(t.src, t.dst, report.file))
    sizes = {(t.src, t.file): (write.nbytes if t.src == ctx.rank else incoming[t.file][1]) for t in plan}
    own = slot.image() if compress is None else None  # uncompressed, the data file is the slot's image

    def read(name: str):
        if own is not None:
            return own
        buf = torch.empty(write.nbytes, dtype=torch.uint8)
        with storage.open_read(f"{step_dir}/{name}") as f:
            if buf.numel():
                f.readinto(buf.numpy().data)
        return buf

    def store(name: str, buf) -> None:
        data = buf.numpy().data
        tensors, nbytes = incoming[name]
        if len(data) != nbytes:
            raise CorruptCheckpointError(f"replica {name} of step {step}: {len(data)} bytes arrived, {nbytes} reported")
        for t in tensors:
            for sh in t["shards"]:
                for c in sh["chunks"]:
                    codec.check(
                        data[c["offset"] : c["offset"] + c["length"]],
                        c["checksum"],
                        f"replica {name} of step {step} (tensor {t['name']!r})",
                    )
        with storage.open_write(f"{step_dir}/{name}", recycle=True) as f:
            f.write(data)

    fault_point("replicate", step, ctx.rank)
    peers.run(plan, read, store, sizes, keep_buffers=True)


def _commit(
    storage: Storage,
    step: int,
    skeleton: dict[str, Any],
    ctx: DistContext,
    key: str,
    group: NodeGroup,
    node: NodeShare,
    errors: list[str],
    older: list,
    ledger: KeyLedger | None,
    at: tuple[int, int],
) -> Committed:
    """Rank 0: every node's record, the index, and the word to the leaders."""
    leaders = [leader for leader in group.members if leader != 0]
    keys = [f"{key}/r/{leader}" for leader in leaders]
    records = [node.record(errors)]
    try:
        try:
            raws = ctx.wait_get(keys) if leaders else []
        except Exception as e:  # a node never answered: the step is not committed
            raise StorageError(f"step {step} not committed to the RAM tier: {e}") from None
        records += [
            read_node_record(leader, raw, group.members[leader], ctx.world_size)
            for leader, raw in zip(leaders, raws, strict=True)
        ]
        if not any(r["skipped"] for r in records):  # nobody reads the older keys any more
            delete_keys(ctx, older)
        failures = [e for r in records for e in r["errors"]]
        if failures:
            raise StorageError(f"step {step} not committed to the RAM tier: {'; '.join(failures)}")
        local = {r["part"]["file"] for r in records[:1]} | set(node.others)
        committed = commit_index(storage, step, ctx.world_size, records, skeleton, local_parts=local)
    except BaseException:
        discard(storage, step, node.own_files())
        if ctx.distributed:
            ctx.put(f"{key}/manifest", "")
            _record_manifest(ledger, at, key)
        raise
    finally:
        ctx.delete(*keys, *(f"{key}/w/{leader}" for leader in group.members))
    if ctx.distributed:
        ctx.store.set(f"{key}/manifest", committed.manifest_json)
        _record_manifest(ledger, at, key)
    return committed


def _record_manifest(ledger: KeyLedger | None, at: tuple[int, int], key: str) -> None:
    if ledger is not None:  # deleted after the next step's records: every leader has read it then
        ledger.record_key(at, f"{key}/manifest")


def _write_index(storage: Storage, step: int, ctx: DistContext, key: str, node: NodeShare) -> None:
    """A node leader writes rank 0's index into its node's directory, once it has checked
    that the index names this node's part as written and its files are in place."""
    data = ctx.get_raw(f"{key}/manifest")
    if data in (b"", b'""'):  # rank 0's "not committed" (put as JSON "")
        discard(storage, step, [name for name, _ in storage.list_dir(step_dir_name(step))])
        raise StorageError(f"step {step} was not committed to the RAM tier (rank 0 gave up)")
    where = f"the index of step {step} from rank 0"
    doc, version = parse_header(data, where)
    if version != INDEX_VERSION:
        raise FormatError(f"{where} has format version {version}, not {INDEX_VERSION}")
    index = parse_index(doc, where, expect_step=step)
    mine = node.written["part"] if node.written else None
    if mine is None or not any(p.file == mine["file"] and p.checksum == mine["checksum"] for p in index.parts):
        raise StorageError(f"step {step}: {where} does not name this node's part")
    check_files_present(storage, step, {**node.written["files"], mine["file"]: mine["bytes"]})  # type: ignore[index]
    storage.write_bytes_atomic(f"{step_dir_name(step)}/{MANIFEST_NAME}", data)


def report_skipped_node_local(ctx: DistContext, group: NodeGroup, key: str, at: tuple[int, int], reason: str) -> None:
    """Policy "skip" on the RAM tier: this rank will not write the step of `key` (the training
    thread says so at once, while the step's commit may run): its leader, or, from a leader,
    rank 0 and the leaders that take its node's replicas, hear it, so nobody waits for it."""
    text = NodeReport.encode(None, reason, None, skipped=True)
    board = _board(group)
    if ctx.rank != group.leader:
        board.write_text(step_message(at, f"w-r{ctx.rank}"), text)
        board.write(step_message(at, f"r-r{ctx.rank}"), {"errors": []})
        return
    board.write(step_message(at, "skip"), {"reason": reason})  # its ranks: no replicas this step
    ctx.store.set(f"{key}/w/{ctx.rank}", json.dumps({str(ctx.rank): text}))
    if ctx.rank == 0:
        ctx.put(f"{key}/manifest", "")  # the leaders wait for no index
    else:
        skipped = NodeShare({}, [f"rank {ctx.rank}: {reason}"], True)
        ctx.put(f"{key}/r/{ctx.rank}", skipped.record([]))

"""The RAM tier's commit: node-local, with peer replicas, in O(nodes) store requests.

Order of calls for one step (`persist_node_local`; every rank calls it; the shared
tiers' commit is save/commit.py)::

    every rank:   write_share(...): its data file, in its node's directory
                  post its report (`NodeReport`) to its node's board (a file, no store request)
    node leaders: collect the node's reports; set them as one record, `key`/w/<leader>
    with replicas:
      leaders     read the records of the k nodes before theirs (whose ranks send this
                  node their replicas) and post them on the board for their ranks
      every rank  sends its file to its targets, stores verified copies of what its
                  sources send (tiers/peers.py), posts its outcome to the board
    node leaders: collect the outcomes; set one record, `key`/r/<leader>
    rank 0:       read every node's reports and outcomes (one wait, one multi_get),
                  commit the single-document manifest, set it under `key`/manifest
                  (or "" when the step is not committed), delete the step's records
    node leaders: read the manifest, check it and their node's files, write it

A non-leader rank makes no store request; a leader makes a constant number (its
records, k records of other nodes, the manifest); rank 0 two for every node's
records. What still grows with the world: rank 0 handles every rank's entries
(the manifest is one document, kept whole by every node), and every leader reads
that manifest (docs/architecture.md, "Coordination").
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from ftkit.coord.dist import DistContext
from ftkit.coord.faultpoints import fault_point
from ftkit.coord.nodelocal import step_message
from ftkit.errors import AlreadyCommitted, CorruptCheckpointError, FormatError, StorageError
from ftkit.format import codec
from ftkit.format.manifest import MANIFEST_NAME, manifest_from_json, step_dir_name
from ftkit.format.validate import parse_json
from ftkit.save.commit import MAX_REPORT_BYTES, NodeGroup
from ftkit.save.keys import KeyLedger, delete_keys, older_keys
from ftkit.save.manifests import Committed, check_files_present, commit_docs
from ftkit.save.reports import NodeReport, decode_report
from ftkit.save.sharding import Piece
from ftkit.save.staging import Slot
from ftkit.save.write import discard, write_share
from ftkit.tiers.peers import PeerGroup, ReplicaLayout, Transfer
from ftkit.tiers.storage import Storage

log = logging.getLogger(__name__)


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
) -> Committed | None:
    """Persist one step to a node-local tier (the RAM tier), with peer replicas; returns
    what was committed on rank 0, None elsewhere.

    `ledger` (rank 0's): the manifest keys of earlier steps, and every key of a step
    rank 0 skipped; deleted once this step's records are all in (every leader reads
    the manifest of a step before it sends its records of the next).
    """
    group = group or NodeGroup.of(ctx, None)
    try:
        write, error = write_share(storage, step, slot, pieces, compress, ctx.rank)
    except AlreadyCommitted as e:  # this node has the step, another may not: still take part below
        write, error = None, e
    text = NodeReport.encode(write, str(error) if error else None, rng)
    leader = ctx.rank == group.leader
    # 1. Reports: to the node's leader, who publishes the node's (one key per node).
    if not ctx.distributed:
        node_texts = {ctx.rank: text}
    elif not leader:
        _board(group).write_text(step_message(at, f"w-r{ctx.rank}"), text)
    else:
        node_texts = {ctx.rank: text, **_collect_texts(group, at, "w", ctx)}
        ctx.store.set(f"{key}/w/{ctx.rank}", json.dumps({str(r): t for r, t in node_texts.items()}))
    # 2. Replicas: each rank sends its file to its targets and stores what its sources send.
    rep_error = None
    if peers is not None and replicas > 0 and ctx.distributed:
        assert layout is not None
        try:
            reports, may_send = _peer_reports(group, layout, replicas, ctx, key, at, leader)
            sending = write if may_send and error is None else None
            _replicate(storage, step, sending, reports, layout, replicas, ctx, peers, slot, compress)
        except Exception as e:
            rep_error = f"replication failed: {e}"
            log.error("rank %d: step %d: %s", ctx.rank, step, rep_error)
    # 3. Outcomes: to the leader, who publishes the node's.
    errors = [f"rank {ctx.rank}: {rep_error}"] if rep_error else []
    if ctx.distributed and not leader:
        _board(group).write(step_message(at, f"r-r{ctx.rank}"), {"errors": errors})
    elif ctx.distributed:
        for r, raw in group.collect(at, "r", ctx.rank, ctx.timeout_s).items():
            errors += _outcome_errors(r, raw)
        if ctx.rank != 0:
            ctx.put(f"{key}/r/{ctx.rank}", {"errors": errors})
    if ctx.rank == 0:
        with older_keys(ledger, at) as older:
            return _commit(storage, step, skeleton, ctx, key, group, node_texts, errors, older, ledger, at)
    if error is not None:
        raise error
    if leader:  # write rank 0's manifest into this node's directory
        _write_manifest(storage, step, ctx, key, node_texts)
    return None


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


def _node_texts(raw: bytes, ranks: tuple[int, ...], where: str) -> dict[int, str]:
    """A node's reports as read from the store (untrusted): one text per rank of the node;
    one missing or malformed reads as an error report."""
    try:
        doc = parse_json(raw, where, "")
    except FormatError:
        doc = None
    doc = doc if isinstance(doc, dict) else {}
    out = {}
    for r in ranks:
        t = doc.get(str(r))
        out[r] = t if isinstance(t, str) else NodeReport.encode(None, f"no report in {where}", None)
    return out


def _peer_reports(
    group: NodeGroup, layout: ReplicaLayout, k: int, ctx: DistContext, key: str, at: tuple[int, int], leader: bool
) -> tuple[dict[int, str], bool]:
    """The reports of the nodes this node exchanges replicas with (the k before it send,
    the k after it receive), read from the store by the leader and relayed to its ranks
    through the board; and whether this rank may send its own file. When the leader
    skipped the step, its ranks read them themselves (their sources send them replicas
    all the same) and send nothing (the leader's record, which their targets read,
    does not hold their reports)."""
    name, skip = step_message(at, "peers"), step_message(at, "skip")
    if not leader:
        raw = _board(group).collect({0: name}, ctx.timeout_s, MAX_REPORT_BYTES, give_up=skip)[0]
        if raw is not None:
            doc = parse_json(raw, "the peer nodes' reports", "")
            if not isinstance(doc, dict):
                raise StorageError("this node's leader relayed malformed peer reports")
            return {int(r): t for r, t in doc.items() if r.isdigit() and isinstance(t, str)}, True
        if _board(group).read_bytes(skip, 1024) is None:
            raise StorageError(f"this node's leader (rank {group.leader}) sent no word on the replicas to exchange")
    nodes = dict.fromkeys(layout.source_nodes(ctx.rank, ctx.nodes, k) + layout.target_nodes(ctx.rank, ctx.nodes, k))
    leaders = [layout.members[n][0] for n in nodes]
    raws = ctx.wait_get([f"{key}/w/{s}" for s in leaders]) if leaders else []
    texts: dict[int, str] = {}
    for s, raw in zip(leaders, raws, strict=True):
        texts.update(_node_texts(raw, group.members[s], f"the reports of the node of rank {s}"))
    if leader:
        _board(group).write(name, {str(r): t for r, t in texts.items()})
    return texts, leader


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
    own_texts: dict[int, str],
    errors: list[str],
    older: list,
    ledger: KeyLedger | None,
    at: tuple[int, int],
) -> Committed:
    """Rank 0: every node's reports and outcomes, the manifest, and the word to the leaders."""
    leaders = [leader for leader in group.members if leader != 0]
    keys = [f"{key}/w/{leader}" for leader in leaders] + [f"{key}/r/{leader}" for leader in leaders]
    texts = dict(own_texts)
    failures = list(errors)
    reports: list[NodeReport] = []
    try:
        try:
            raws = ctx.wait_get(keys) if leaders else []
        except Exception as e:  # a node never answered: the step is not committed
            raise StorageError(f"step {step} not committed to the RAM tier: {e}") from None
        for leader, raw in zip(leaders, raws[: len(leaders)], strict=True):
            texts.update(_node_texts(raw, group.members[leader], f"the reports of the node of rank {leader}"))
        for leader, raw in zip(leaders, raws[len(leaders) :], strict=True):
            failures += _outcome_errors(leader, raw)
        reports = [decode_report(r, texts[r], ctx.world_size) for r in range(ctx.world_size)]
        if not any(r.skipped for r in reports):  # nobody reads the older keys any more
            delete_keys(ctx, older)
        failures = [f"rank {r.rank}: {r.error}" for r in reports if r.error] + failures
        if failures:
            raise StorageError(f"step {step} not committed to the RAM tier: {'; '.join(failures)}")
        committed = commit_docs(
            storage,
            step,
            [r.write_doc() for r in reports if r.file],
            skeleton,
            ctx.world_size,
            {str(r.rank): {"rng": r.rng} for r in reports},
            present={r.file for r in reports if r.file and ctx.nodes[r.rank] == ctx.node},
        )
    except BaseException:
        discard(storage, step, [r.file for r in reports if r.file and ctx.nodes[r.rank] == ctx.node])
        if ctx.distributed:
            ctx.put(f"{key}/manifest", "")
            _record_manifest(ledger, at, key)
        raise
    finally:
        ctx.delete(*keys, f"{key}/w/0")
    if ctx.distributed:
        ctx.store.set(f"{key}/manifest", committed.manifest_json)
        _record_manifest(ledger, at, key)
    return committed


def _record_manifest(ledger: KeyLedger | None, at: tuple[int, int], key: str) -> None:
    if ledger is not None:  # deleted after the next step's records: every leader has read it then
        ledger.record_key(at, f"{key}/manifest")


def _write_manifest(storage: Storage, step: int, ctx: DistContext, key: str, node_texts: dict[int, str]) -> None:
    """A node leader writes rank 0's manifest into its node's directory, checked first."""
    data = ctx.get_raw(f"{key}/manifest")
    if data in (b"", b'""'):  # rank 0's "not committed" (put as JSON "")
        discard(storage, step, [name for name, _ in storage.list_dir(step_dir_name(step))])
        raise StorageError(f"step {step} was not committed to the RAM tier (rank 0 gave up)")
    manifest = manifest_from_json(data, f"the manifest of step {step} from rank 0", expect_step=step)
    ours = {r.file for r in (decode_report(n, t, ctx.world_size) for n, t in node_texts.items()) if r.file}
    check_files_present(storage, step, {f: manifest.files[f]["bytes"] for f in ours if f in manifest.files})
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
        ctx.put(f"{key}/manifest", "")  # the leaders wait for no manifest
    else:
        ctx.put(f"{key}/r/{ctx.rank}", {"errors": [f"rank {ctx.rank}: {reason}"]})

"""The RAM tier's replica exchange inside a step's commit (commit/ram.py calls it).

A node's collector (NodeGroup.collector: its leader, but on rank 0's node of a job of
several nodes the next rank) reads, from the store, the records of the k nodes before its
own (whose ranks send this node their replicas) and of the k after (which this node's ranks
send theirs to), and relays their reports, and the names and checksums of its sources'
parts, to its ranks on the node's board. Each rank then sends its data file to its targets
and stores verified copies of what its sources send (tiers/peers.py); the node's exchanger
(NodeGroup.exchanger: a rank that neither collects nor commits, where there is one) writes
the manifest parts of its sources, so a node keeps the parts that describe the files it
holds, and names them in its outcome to the collector. Records and parts are untrusted:
a report that does not parse reads as an error report, a part is checked against the
index by whoever reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftkit.commit.layouts import Layout
from ftkit.commit.part_template import node_part_bytes
from ftkit.commit.reports import NodeReport, decode_report
from ftkit.commit.shared import MAX_REPORT_BYTES, NodeGroup
from ftkit.coord.dist import DistContext
from ftkit.coord.faultpoints import fault_point
from ftkit.coord.nodelocal import step_message
from ftkit.errors import CorruptCheckpointError, FormatError, StorageError
from ftkit.format import codec
from ftkit.format.index import is_part_file
from ftkit.format.manifest import step_dir_name
from ftkit.format.validate import CHECKSUM_RE, check_file_name, parse_json
from ftkit.save.staging import Slot
from ftkit.tiers.peers import PeerGroup, ReplicaLayout, Transfer
from ftkit.tiers.storage import Storage


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


def _node_part_ref(doc: dict[str, Any]) -> tuple[str, str] | None:
    """(file name, checksum) of the part in a node's record, if it names one properly."""
    part = doc.get("part")
    if not isinstance(part, dict) or not isinstance(part.get("checksum"), str):
        return None
    try:
        name = check_file_name(part.get("file"))
    except FormatError:
        return None
    return (name, part["checksum"]) if is_part_file(name) and CHECKSUM_RE.fullmatch(part["checksum"]) else None


@dataclass(frozen=True)
class PeerWord:
    """What a rank learns of the replica exchange of one step (`peer_reports`)."""

    texts: dict[int, str]  # the reports of the nodes it exchanges replicas with
    may_send: bool  # whether it sends its own file (its report is in its node's record)
    parts: dict[str, tuple[int, str]]  # the exchanger's: the sources' parts, {file: (their leader, checksum)}
    own_part: dict[str, Any] | None = None  # the exchanger's, on a node holding the index: its node's part


def peer_reports(
    group: NodeGroup,
    layout: ReplicaLayout,
    k: int,
    ctx: DistContext,
    key: str,
    at: tuple[int, int],
    collector: bool,
    own_part: dict[str, Any] | None = None,
    own_text: str | None = None,
) -> PeerWord:
    """The reports of the nodes this node exchanges replicas with (the k before it send,
    the k after it receive), read from the store by the node's collector (NodeGroup.collector:
    its leader but on rank 0's node) and relayed to its ranks through the board, with what
    the node's exchanger (NodeGroup.exchanger) needs: the parts of the nodes that send it
    replicas, and `own_part` (the collector's, where the node holds rank 0's index: its
    part's store_part record, which the index must name).

    When the collector skipped the step, its ranks read the reports themselves (their
    sources send them replicas all the same) and send nothing (the collector's record, which
    their targets read, does not hold their reports); the step is not committed then, and
    nobody writes the sources' parts.

    Rank 0, where another rank collects its node, is never relayed to: it reads the records
    itself, with its node's own in the same request, and sends its file only where that
    record holds its report as it sent it (`own_text`), as its targets decide from that record.
    (Its collector then relays to nobody on a node of two ranks; rank 0 has a request more.)"""
    name, skip = step_message(at, "peers"), step_message(at, "skip")
    exchanger = ctx.rank == group.exchanger
    reads_itself = ctx.rank == 0 and not collector  # (rank 0 is never relayed to)
    if not collector and not reads_itself:
        raw = group.node_board().collect({0: name}, ctx.timeout_s, MAX_REPORT_BYTES, give_up=skip, me=ctx.rank)[0]
        if raw is not None:
            doc = parse_json(raw, "the peer nodes' reports", "")
            if not isinstance(doc, dict):
                raise StorageError("this node's collector relayed malformed peer reports")
            relayed = {int(r): t for r, t in doc.items() if r.isdigit() and isinstance(t, str)}
            if not exchanger:
                return PeerWord(relayed, True, {})
            return PeerWord(relayed, True, _relayed_parts(doc.get("parts"), group), _relayed_part(doc.get("own")))
        if not group.node_board().has(skip, ctx.rank):
            who = f"this node's collector (rank {group.collector})"
            raise StorageError(f"{who} sent no word on the replicas to exchange")
    sources = layout.source_nodes(ctx.rank, ctx.nodes, k)
    nodes = dict.fromkeys(sources + layout.target_nodes(ctx.rank, ctx.nodes, k))
    leaders = [layout.members[n][0] for n in nodes]
    # Rank 0 reads its own node's record too: its targets decide from it whether it sends.
    keys = [f"{key}/w/{s}" for s in leaders] + ([f"{key}/w/{group.ranks[0]}"] if reads_itself else [])
    raws = ctx.wait_get(keys) if keys else []
    texts: dict[int, str] = {}
    parts: dict[str, tuple[int, str]] = {}
    source_leaders = {layout.members[n][0] for n in sources}
    for s, raw in zip(leaders, raws[: len(leaders)], strict=True):
        where = f"the reports of the node of rank {s}"
        doc = _node_doc(raw, where)
        texts.update(_node_texts(doc, group.members[s], where))
        part = _node_part_ref(doc) if s in source_leaders else None
        if part is not None:
            parts[part[0]] = (s, part[1])
    if reads_itself:
        mine = _node_doc(raws[-1], "the reports of this node").get("0")
        return PeerWord(texts, own_text is not None and mine == own_text, {})
    if collector and any(r not in (ctx.rank, 0) for r in group.ranks):  # (rank 0 reads for itself)
        relay: dict[str, Any] = {str(r): t for r, t in texts.items()}
        if not exchanger:
            relay["parts"] = {n: [s, checksum] for n, (s, checksum) in parts.items()}
            if own_part is not None:
                relay["own"] = own_part
        group.to_ranks(name, relay, ctx.rank, but=(0,))
    return PeerWord(texts, collector, parts if exchanger else {}, own_part if exchanger else None)


def _relayed_part(doc: Any) -> dict[str, Any] | None:
    """The node's own part as its collector relayed it (store_part's record: {"part": {"file",
    "bytes", "checksum", ...}, "files": {name: bytes}}), checked; None if it is not one."""
    try:
        part, files = doc["part"], doc["files"]
        check_file_name(part["file"])
        ok = (
            type(part["bytes"]) is int
            and part["bytes"] > 0
            and isinstance(part["checksum"], str)
            and CHECKSUM_RE.fullmatch(part["checksum"]) is not None
            and isinstance(files, dict)
            and all(type(n) is int and n >= 0 and check_file_name(f) for f, n in files.items())
        )
    except (TypeError, KeyError, FormatError):
        return None
    return {"part": part, "files": files} if ok else None


def _relayed_parts(doc: Any, group: NodeGroup) -> dict[str, tuple[int, str]]:
    """The sources' parts as the collector relayed them (untrusted, from the board): a malformed
    one is left out, and the commit then finds it missing where the index names it."""
    parts: dict[str, tuple[int, str]] = {}
    for n, ref in (doc if isinstance(doc, dict) else {}).items():
        if isinstance(ref, list) and len(ref) == 2 and type(ref[0]) is int and ref[0] in group.members:
            got = _node_part_ref({"part": {"file": n, "checksum": ref[1]}})
            if got is not None:
                parts[got[0]] = (ref[0], got[1])
    return parts


def store_parts(
    storage: Storage,
    step: int,
    parts: dict[str, tuple[int, str]],
    texts: dict[int, str],
    group: NodeGroup,
    world: int,
    layouts: Callable[[str], Layout | None] | None,
) -> list[str]:
    """Write the parts of the nodes whose replicas this node holds: each rebuilt from its
    node's reports (`texts`) as its leader built it (part_template.py: the same bytes), and
    checked against the checksum its leader sent, which is the index's."""
    step_dir = step_dir_name(step)
    for name, (leader, checksum) in parts.items():
        ranks = group.members[leader]
        reports = [decode_report(r, texts.get(r, ""), world, layouts) for r in ranks]
        failed = [f"rank {r.rank}: {r.error}" for r in reports if r.error]
        if failed:
            raise StorageError(f"the part of the node of rank {leader} cannot be rebuilt: {'; '.join(failed)}")
        _, data, _ = node_part_bytes(storage, step, reports, ranks, world, name=name)
        if codec.checksum(data) != checksum:
            raise StorageError(f"the part of the node of rank {leader} rebuilt here differs from its leader's")
        storage.write_bytes_atomic(f"{step_dir}/{name}", data)
    return list(parts)


def replicate(
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
    layouts: Callable[[str], Layout | None] | None = None,
) -> None:
    """Send this rank's file (`write`; None: nothing to send) to its replica targets; store
    verified copies of what its sources send (`reports`: theirs and the targets').
    Both ends of a transfer decide from the same report: a rank that could not write
    sends nothing and its targets expect nothing from it; nobody sends to a target
    that skipped the step (its persist thread never runs it). The step will not be
    committed then anyway. `layouts`: where the layouts of reports sent by reference are
    found (layouts.lookup)."""
    import torch

    step_dir = step_dir_name(step)
    incoming: dict[str, tuple[list[tuple[str, int, int, str]], int]] = {}
    plan: list[Transfer] = []
    for t in layout.transfers_of(ctx.rank, ctx.nodes, k):
        if t.src == ctx.rank:
            target = decode_report(t.dst, reports.get(t.dst, ""), ctx.world_size, layouts)  # (kept: often a source too)
            if write is not None and not target.skipped:
                plan.append(Transfer(t.src, t.dst, write.file))
            continue
        report = decode_report(t.src, reports.get(t.src, ""), ctx.world_size, layouts)
        if report.file is None or report.error:
            continue
        incoming[report.file] = (report.chunks(), report.nbytes)  # validated: checked on arrival
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
        chunks, nbytes = incoming[name]
        if len(data) != nbytes:
            raise CorruptCheckpointError(f"replica {name} of step {step}: {len(data)} bytes arrived, {nbytes} reported")
        for tensor, offset, length, checksum in chunks:
            codec.check(data[offset : offset + length], checksum, f"replica {name} of step {step} (tensor {tensor!r})")
        with storage.open_write(f"{step_dir}/{name}", recycle=True) as f:
            f.write(data)

    fault_point("replicate", step, ctx.rank)
    peers.run(plan, read, store, sizes, keep_buffers=True)

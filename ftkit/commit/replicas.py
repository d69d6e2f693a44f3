"""The RAM tier's replica exchange inside a step's commit: collectors read their partners'
exchange records from the store and relay them to their ranks, each rank sends its file to
its targets and stores verified copies of its sources' (tiers/peers.py), and the exchanger
writes its sources' parts, so a node keeps the parts of the files it holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ftkit.commit.keys import exchange_key
from ftkit.commit.layouts import Layout
from ftkit.commit.memo import CommitMemo
from ftkit.commit.messages import Exchange, Relay, Report, Written
from ftkit.commit.node import MAX_REPORT_BYTES, NodeGroup
from ftkit.commit.parts import build_part
from ftkit.commit.plan import CommitPlan
from ftkit.commit.reports import decode_report
from ftkit.coord.dist import DistContext
from ftkit.coord.faultpoints import fault_point
from ftkit.coord.nodelocal import step_message
from ftkit.errors import CorruptCheckpointError, FormatError, StorageError
from ftkit.format import codec
from ftkit.format.manifest import step_dir_name
from ftkit.save.staging import Slot
from ftkit.tiers.peers import PeerGroup, Transfer
from ftkit.tiers.storage import Storage


def _exchange(raw: bytes, ranks: tuple[int, ...], where: str) -> Exchange:
    """A node's exchange record as read (untrusted); every rank it lacks has an error report."""
    try:
        got = Exchange.decode(raw, where)
    except FormatError:
        got = Exchange({})
    if all(r in got.reports for r in ranks):
        return Exchange({r: got.reports[r] for r in ranks}, got.part)
    lost = Report.failed(f"no report in {where}").encode()
    return Exchange({r: got.reports.get(r, lost) for r in ranks}, got.part)


@dataclass
class PeerWord:
    """What a rank learns of the replica exchange of one step: the partners' reports."""

    texts: dict[int, bytes]  # the reports of the nodes it exchanges replicas with
    may_send: bool  # whether it sends its own file (its report is in its node's record)
    parts: dict[str, tuple[int, str]]  # the exchanger's: the sources' parts, {file: (their leader, checksum)}
    own_part: Written | None = None  # the exchanger's, on a node holding the index: its node's part


def read_exchanges(
    group: NodeGroup, ctx: DistContext, key: str, collectors: tuple[int, ...], own_text: bytes | None
) -> PeerWord:
    """The exchange records of `collectors`' nodes, in one read: their ranks' reports, and the
    sources' part names and checksums. Rank 0, where another rank collects its node, reads its
    own node's record too and sends its file only where it holds its report (`own_text`) as
    sent: its targets decide from that record."""
    plan = group.plan
    sources = set(plan.source_nodes(group.node))
    nodes = [plan.nodes[c] for c in collectors]
    leaders = [plan.roles(n).leader for n in nodes]
    raws = ctx.wait_get([exchange_key(key, leader) for leader in leaders]) if leaders else []
    word = PeerWord({}, True, {})
    for node, leader, raw in zip(nodes, leaders, raws, strict=True):
        got = _exchange(raw, group.members[leader], f"the reports of the node of rank {leader}")
        if node == group.node:  # rank 0's own node
            word.may_send = own_text is not None and got.reports.get(0) == own_text
            continue
        word.texts.update(got.reports)
        if node in sources and got.part is not None:
            word.parts[got.part[0]] = (leader, got.part[1])
    return word


def read_relay(group: NodeGroup, ctx: DistContext, at: tuple[int, int], exchanger: bool) -> PeerWord | None:
    """The partners' reports as this node's collector relayed them (None: it skipped the step,
    and its ranks read them themselves and send nothing; their targets expect nothing)."""
    name, skip = step_message(at, "peers"), step_message(at, "skip")
    board = group.node_board()
    raw = board.collect({0: name}, ctx.timeout_s, MAX_REPORT_BYTES, ctx.rank, skip, ctx.generation)[0]
    if raw is None:
        if not board.has(skip, ctx.rank):
            who = f"this node's collector (rank {group.collector})"
            raise StorageError(f"{who} sent no word on the replicas to exchange")
        return None
    try:
        relay = Relay.decode(raw, "the peer nodes' reports as this node's collector relayed them")
    except FormatError as e:
        raise StorageError(str(e)) from None
    if not exchanger:
        return PeerWord(relay.reports, True, {})
    parts = {n: ref for n, ref in relay.parts.items() if ref[0] in group.members}  # others: found missing
    return PeerWord(relay.reports, True, parts, relay.own)


def store_parts(
    storage: Storage,
    step: int,
    parts: dict[str, tuple[int, str]],
    texts: dict[int, bytes],
    group: NodeGroup,
    world: int,
    layouts: Callable[[int, str], Layout | None] | None,
) -> list[str]:
    """Write the parts of this node's replica sources, rebuilt from their reports and checked."""
    step_dir = step_dir_name(step)
    for name, (leader, checksum) in parts.items():
        ranks = group.members[leader]
        reports = [decode_report(r, texts.get(r, b""), layouts, group.memo) for r in ranks]
        failed = [f"rank {r.rank}: {r.error}" for r in reports if r.error]
        if failed:
            raise StorageError(f"the part of the node of rank {leader} cannot be rebuilt: {'; '.join(failed)}")
        _, data, _ = build_part(step, reports, world, group.memo, name=name)
        if codec.checksum(data) != checksum:
            raise StorageError(f"the part of the node of rank {leader} rebuilt here differs from its leader's")
        storage.write_bytes_atomic(f"{step_dir}/{name}", data)
    return list(parts)


def replicate(
    storage: Storage,
    step: int,
    write,
    reports: dict[int, bytes],
    plan: CommitPlan,
    ctx: DistContext,
    peers: PeerGroup,
    slot: Slot,
    compress: str | None,
    memo: CommitMemo,
    layouts: Callable[[int, str], Layout | None] | None = None,
) -> None:
    """Send this rank's file (`write`; None: nothing) to its replica targets; store verified
    copies of what its sources send. Both ends decide from the same reports (`reports`:
    the sources' and the targets'): nobody sends from a rank that could not write or to a
    target that skipped the step."""
    import torch

    step_dir = step_dir_name(step)
    incoming: dict[str, tuple[list[tuple[str, int, int, str]], int]] = {}
    transfers: list[Transfer] = []
    for src, dst in plan.transfers(ctx.rank):
        if src == ctx.rank:
            target = decode_report(dst, reports.get(dst, b""), layouts, memo)
            if write is not None and not target.skipped:
                transfers.append(Transfer(src, dst, write.file))
            continue
        report = decode_report(src, reports.get(src, b""), layouts, memo)
        if report.file is None or report.error:
            continue
        incoming[report.file] = (report.chunks(), report.nbytes)  # validated: checked on arrival
        transfers.append(Transfer(src, dst, report.file))
    sizes = {(t.src, t.file): (write.nbytes if t.src == ctx.rank else incoming[t.file][1]) for t in transfers}
    own = slot.image() if compress is None else None  # uncompressed, the file is the slot's image

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
    peers.run(transfers, read, store, sizes, keep_buffers=True)

"""The RAM tier's commit: node-local, with peer replicas (save/commit.py is the shared one).

1. every rank writes its data file into its node's directory and reports it;
2. with peers, every rank sends its file to its replica targets on other nodes
   and receives theirs, verifying checksums before storing them;
3. rank 0 commits once every rank has written and replicated, and hands the
   manifest to the first rank of every other node, which validates it and
   writes it there.

Reports travel through the store as two JSON lines (`NodeReport`): a small head
every rank reads, and the tensor entries, decoded only by rank 0 and by the
ranks receiving that rank's replica.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ftkit.coord.agree import agree
from ftkit.coord.dist import DistContext
from ftkit.coord.faultpoints import fault_point
from ftkit.errors import AlreadyCommitted, CorruptCheckpointError, StorageError
from ftkit.format import codec
from ftkit.format.manifest import MANIFEST_NAME, manifest_from_json, step_dir_name
from ftkit.save.keys import KeyLedger, delete_keys, older_keys
from ftkit.save.manifests import Committed, check_files_present, commit_docs
from ftkit.save.reports import NodeReport, decode_report
from ftkit.save.sharding import Piece
from ftkit.save.staging import Slot
from ftkit.save.write import discard, write_share
from ftkit.tiers.peers import PeerGroup, replication_plan
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
    peers: PeerGroup | None = None,
    replicas: int = 0,
    ledger: KeyLedger | None = None,
    at: tuple[int, int] = (0, 0),
) -> Committed | None:
    """Persist one step to a node-local tier (the RAM tier), with peer replicas.

    1. every rank writes its data file into its node's directory and reports it;
    2. with peers, every rank sends its file to its replica targets on other
       nodes and receives theirs, verifying checksums before storing them;
    3. rank 0 commits once every rank has written and replicated, and hands the
       manifest to the first rank of every other node, which writes it there.
    Returns what was committed on rank 0, None elsewhere.

    `ledger`: this rank's keys of earlier calls, deleted once step 1's gather shows
    that every rank has moved past them (this call's keys, at `at` = (restore
    epoch, step), are added for a later call); a job that snapshots every step
    would otherwise grow the store by every report it ever sent. A report from a
    persist thread proves it: that thread takes its steps in order. A skip report
    does not (the training thread sends it while earlier steps may still be
    queued), so then they wait for the next call.
    """
    with older_keys(ledger, at) as older:
        if ledger:
            ledger.record(at, key)
        return _persist_node_local(
            storage, step, slot, skeleton, compress, pieces, rng, ctx, key, peers, replicas, older
        )


def _persist_node_local(
    storage, step, slot, skeleton, compress, pieces, rng, ctx, key, peers, replicas, older: list
) -> Committed | None:
    """persist_node_local's work; empties `older` once it has deleted those keys."""
    try:
        write, error = write_share(storage, step, slot, pieces, compress, ctx.rank)
    except AlreadyCommitted as e:  # this node has the step, another may not: still take part below
        write, error = None, e
    text = NodeReport.encode(write, str(error) if error else None, rng)
    texts = ctx.gather_text(f"{key}/w", text) if ctx.distributed else [text]
    reports = [decode_report(r, t, ctx.world_size) for r, t in enumerate(texts)]
    if not any(r.skipped for r in reports):  # nobody reads the older keys any more
        delete_keys(ctx, older)
    rep_error = None
    # A step some rank could not write (or skipped) will not be committed, and that rank
    # takes no part in replication: every rank sees the same reports and skips it too.
    if peers is not None and replicas > 0 and not any(r.error for r in reports):
        try:  # uncompressed, the data file is the slot's byte image: send the slot, not the file
            _replicate(storage, step, reports, ctx, peers, replicas, slot.image() if compress is None else None)
        except Exception as e:
            rep_error = f"replication failed: {e}"
            log.error("rank %d: step %d: %s", ctx.rank, step, rep_error)
    # Only rank 0 reads the replication outcomes; the others just report theirs.
    done = agree(ctx, f"{key}/r", error=rep_error, decider=0)
    if done is not None:
        failures = [f"rank {r.rank}: {r.error}" for r in reports if r.error]
        failures += [f"rank {r}: {e}" for r, e in done.failures]
        writes = [{"file": r.file} for r in reports if r.file]  # what to discard if this goes wrong
        try:
            if error is not None:  # still tell the node leaders, who wait for the manifest
                raise error
            writes = [r.write_doc() for r in reports if r.file]
            if failures:
                raise StorageError(f"step {step} not committed to the RAM tier: {'; '.join(failures)}")
            committed = commit_docs(
                storage,
                step,
                writes,
                skeleton,
                ctx.world_size,
                {str(r.rank): {"rng": r.rng} for r in reports},
                present={r.file for r in reports if r.file and ctx.nodes[r.rank] == ctx.node},
            )
        except BaseException:
            discard(storage, step, [w["file"] for w in writes])
            if ctx.distributed:
                ctx.put(f"{key}/manifest", "")
            raise
        if ctx.distributed:
            ctx.store.set(f"{key}/manifest", committed.manifest_json)
        return committed
    if error is not None:
        raise error
    if ctx.node_leader(ctx.rank):  # write rank 0's manifest into this node's directory
        data = ctx.get_raw(f"{key}/manifest")
        if data in (b"", b'""'):  # rank 0's "not committed" (put as JSON "")
            discard(storage, step, [name for name, _ in storage.list_dir(step_dir_name(step))])
            raise StorageError(f"step {step} was not committed to the RAM tier (rank 0 gave up)")
        manifest = manifest_from_json(data, f"the manifest of step {step} from rank 0", expect_step=step)
        ours = {r.file for r in reports if r.file and ctx.nodes[r.rank] == ctx.node}
        check_files_present(storage, step, {f: manifest.files[f]["bytes"] for f in ours if f in manifest.files})
        storage.write_bytes_atomic(f"{step_dir_name(step)}/{MANIFEST_NAME}", data)
    return None


def _replicate(
    storage: Storage,
    step: int,
    reports: list[NodeReport],
    ctx: DistContext,
    peers: PeerGroup,
    replicas: int,
    own_bytes=None,
) -> None:
    """Send this rank's file to its replica targets; store verified copies of what arrives.

    `own_bytes`: this rank's data file as a uint8 tensor when it is in memory
    (the staging slot's image); otherwise the file is read back.
    """
    import torch

    files = [r.file for r in reports]
    plan = replication_plan(files, ctx.nodes, replicas)
    step_dir = step_dir_name(step)
    # Only the writes this rank receives are decoded (their chunks are checked on arrival).
    incoming = {t.file: (reports[t.src].tensors(), reports[t.src].nbytes) for t in plan if t.dst == ctx.rank}

    def read(name: str):
        if own_bytes is not None:
            return own_bytes
        buf = torch.empty(reports[ctx.rank].nbytes, dtype=torch.uint8)
        with storage.open_read(f"{step_dir}/{name}") as f:
            if buf.numel():
                f.readinto(buf.numpy().data)
        return buf

    def write(name: str, buf) -> None:
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

    sizes = {(r.rank, r.file): r.nbytes for r in reports if r.file}
    fault_point("replicate", step, ctx.rank)
    peers.run(plan, read, write, sizes, keep_buffers=True)

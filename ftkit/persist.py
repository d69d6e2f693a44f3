"""Write a staged snapshot to one tier, two-phase: data first, manifest last.

Order of calls for one step on one tier (`persist` does all of it)::

    every rank:  write_data(storage, step, slot, ...) -> RankWrite  (its data file, durable)
                 report the RankWrite (or its error) to rank 0 through the store
    rank 0:      wait for every rank's report, then
                 commit(storage, step, [RankWrite...]) -> Manifest  (manifest.json: the commit)

Data file names carry a random token, so a crashed or concurrent writer can never
overwrite bytes that a committed manifest points at, and a step that already has
a manifest is never written again. A failure before the commit removes what this
writer wrote and leaves every committed step untouched.
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from . import codec
from .dist import DistContext
from .errors import FtkitError, StorageError
from .faults import fault_point
from .format import (MANIFEST_NAME, Chunk, Manifest, Shard, TensorEntry, manifest_to_json, step_dir_name,
                     tensor_entry_doc, tensor_entry_from_doc)
from .peers import PeerGroup, replication_plan
from .sharding import REPLICATED, Piece
from .staging import Slot
from .storage import Storage

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 * 2**20


class AlreadyCommitted(FtkitError):
    """The tier already holds a committed manifest for this step."""


@dataclass(frozen=True)
class RankWrite:
    """What one rank wrote for a step: its data file and the tensor pieces in it."""

    rank: int
    file: str
    nbytes: int
    tensors: tuple[TensorEntry, ...]

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "file": self.file, "nbytes": self.nbytes,
                "tensors": [tensor_entry_doc(t) for t in self.tensors]}

    @staticmethod
    def from_json(doc: dict[str, Any]) -> "RankWrite":
        """A report from another rank of this job (to_json's output): taken as is, since the
        manifest built from it is validated whenever it is read back."""
        tensors = tuple(tensor_entry_from_doc(t) for t in doc["tensors"])
        return RankWrite(int(doc["rank"]), doc["file"], int(doc["nbytes"]), tensors)


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def write_data(storage: Storage, step: int, slot: Slot, pieces: Mapping[str, Piece] | None = None, *,
               compress: str | None, rank: int = 0,
               progress: Callable[[int], None] | None = None) -> RankWrite:
    """Write every staged tensor of `slot` into one new data file of `step`.

    `pieces` says which region of which global tensor each staged tensor is
    (default: each is a whole, replicated tensor). Uncompressed, the file is the
    slot's byte image (`Slot.image`: every tensor at its staging offset), written
    in one call; peers are then sent the slot itself rather than the file.
    """
    step_dir = step_dir_name(step)
    if storage.exists(f"{step_dir}/{MANIFEST_NAME}"):
        raise AlreadyCommitted(f"{storage.where(step_dir)} is already committed")
    file_name = f"rank-{rank:05d}-{uuid.uuid4().hex[:8]}.data"
    rel = f"{step_dir}/{file_name}"
    entries = []
    offset = 0
    slot.ready()
    assert slot.layout is not None
    image = compress is None
    with storage.open_write(rel) as f:
        if image:
            f.write(memoryview(slot.image().numpy()))
        for e in slot.layout.entries:
            raw = slot.bytes_of(e)
            chunks = []
            for raw_off in range(0, e.nbytes, CHUNK_BYTES):
                piece = raw[raw_off:raw_off + CHUNK_BYTES]
                if image:
                    codec_name, stored, at = "raw", piece, e.offset + raw_off
                else:
                    codec_name, stored = codec.encode(piece, compress)
                    f.write(stored)
                    at, offset = offset, offset + len(stored)
                chunks.append(Chunk(file_name, at, len(stored), raw_off, len(piece), codec_name,
                                    codec.checksum(stored)))
                if progress:
                    progress(len(piece))
            p = (pieces or {}).get(e.name) or Piece(e.name, REPLICATED, e.shape, (0,) * len(e.shape), e.shape)
            entries.append(TensorEntry(e.name, dtype_name(e.dtype), p.global_shape,
                                       (Shard(p.offsets, p.lengths, tuple(chunks), rank),), p.kind))
    return RankWrite(rank, file_name, slot.layout.total_bytes if image else offset, tuple(entries))


def merge_writes(writes: list[RankWrite]) -> tuple[TensorEntry, ...]:
    """One entry per tensor, holding the shards every rank wrote of it."""
    merged: dict[str, TensorEntry] = {}
    for w in sorted(writes, key=lambda w: w.rank):
        for t in w.tensors:
            prev = merged.get(t.name)
            if prev is None:
                merged[t.name] = t
                continue
            if (prev.dtype, prev.shape, prev.kind) != (t.dtype, t.shape, t.kind):
                raise FtkitError(f"ranks disagree about tensor {t.name!r}: {prev.dtype}{list(prev.shape)} "
                                 f"vs {t.dtype}{list(t.shape)}")
            merged[t.name] = TensorEntry(t.name, t.dtype, t.shape, prev.shards + t.shards, t.kind)
    return tuple(merged.values())


def commit(storage: Storage, step: int, writes: list[RankWrite], skeleton: dict[str, Any],
           world_size: int = 1, rank_state: dict[str, Any] | None = None) -> Manifest:
    """Write the manifest that makes `step` exist. Atomic on every backend."""
    return _commit(storage, step, writes, skeleton, world_size, rank_state)[0]


def _commit(storage: Storage, step: int, writes: list[RankWrite], skeleton: dict[str, Any],
            world_size: int, rank_state: dict[str, Any] | None) -> tuple[Manifest, bytes]:
    """commit(), also returning the manifest's JSON as written."""
    manifest = Manifest(
        step=step,
        world_size=world_size,
        tensors=merge_writes(writes),
        skeleton=skeleton,
        files={w.file: {"bytes": w.nbytes, "rank": w.rank} for w in writes},
        rank_state=rank_state or {},
        created_at=time.time(),
        writer=_writer_info(),
    )
    rel = f"{step_dir_name(step)}/{MANIFEST_NAME}"
    if storage.exists(rel):
        raise AlreadyCommitted(f"{storage.where(rel)} already exists")
    data = manifest_to_json(manifest)
    storage.write_bytes_atomic(rel, data)
    return manifest, data


def _write_share(storage: Storage, step: int, slot: Slot, pieces, compress, rank: int, rng: Any):
    """Write this rank's data file; return (write, error, the report rank 0 gets)."""
    write, error = None, None
    try:
        write = write_data(storage, step, slot, pieces, compress=compress, rank=rank)
    except AlreadyCommitted:
        raise
    except Exception as e:  # reported to rank 0 first, raised afterwards
        error = e
    report = {"write": write.to_json() if write else None, "error": str(error) if error else None, "rng": rng}
    return write, error, report


def persist(storage: Storage, step: int, slot: Slot, skeleton: dict[str, Any], *,
            compress: str | None, pieces: Mapping[str, Piece] | None = None, rng: Any = None,
            ctx: DistContext | None = None, key: str = "") -> Manifest | None:
    """Persist one step: every rank writes its data, rank 0 commits after all did.

    Ranks report to rank 0 through the store (`key`/rank): the file they wrote,
    or their error. Rank 0 commits only when every rank succeeded within the
    timeout; otherwise the step stays uncommitted (invisible) and its files are
    removed. Returns the manifest on rank 0, None elsewhere.
    """
    ctx = ctx or DistContext()
    write, error, report = _write_share(storage, step, slot, pieces, compress, ctx.rank, rng)
    fault_point("persist", step, ctx.rank)  # data written, not yet reported
    if ctx.distributed:
        ctx.put(f"{key}/{ctx.rank}", report)
    if error is not None:
        raise error
    assert write is not None
    if ctx.rank != 0:
        return None
    writes, rank_state, failures = [write], {"0": {"rng": rng}}, []
    try:
        for r in range(1, ctx.world_size):
            doc = ctx.get(f"{key}/{r}")
            if doc["error"]:
                failures.append(f"rank {r}: {doc['error']}")
            else:
                writes.append(RankWrite.from_json(doc["write"]))
                rank_state[str(r)] = {"rng": doc["rng"]}
        if failures:
            raise StorageError(f"step {step} not committed to {storage.display_url}: {'; '.join(failures)}")
        fault_point("commit", step, 0)  # every share is durable, the manifest not yet written
        return commit(storage, step, writes, skeleton, ctx.world_size, rank_state)
    except BaseException:
        discard(storage, step, [w.file for w in writes])
        raise
    finally:
        ctx.delete(*(f"{key}/{r}" for r in range(ctx.world_size)))


def persist_node_local(storage: Storage, step: int, slot: Slot, skeleton: dict[str, Any], *,
                       compress: str | None, pieces: Mapping[str, Piece] | None, rng: Any,
                       ctx: DistContext, key: str, peers: PeerGroup | None = None,
                       replicas: int = 0) -> Manifest | None:
    """Persist one step to a node-local tier (the RAM tier), with peer replicas.

    1. every rank writes its data file into its node's directory and reports it;
    2. with peers, every rank sends its file to its replica targets on other
       nodes and receives theirs, verifying checksums before storing them;
    3. rank 0 commits once every rank has written and replicated, and hands the
       manifest to the first rank of every other node, which writes it there.
    Returns the manifest on rank 0, None elsewhere.
    """
    try:
        write, error, report = _write_share(storage, step, slot, pieces, compress, ctx.rank, rng)
    except AlreadyCommitted as e:  # this node has the step, another may not: still take part below
        write, error, report = None, e, {"write": None, "error": str(e), "rng": rng}
    reports = ctx.gather(f"{key}/w", report) if ctx.distributed else [report]
    rep_error = None
    if peers is not None and replicas > 0 and error is None:
        try:  # uncompressed, the data file is the slot's byte image: send the slot, not the file
            _replicate(storage, step, reports, ctx, peers, replicas, slot.image() if compress is None else None)
        except Exception as e:
            rep_error = f"replication failed: {e}"
            log.error("rank %d: step %d: %s", ctx.rank, step, rep_error)
    if ctx.rank == 0:  # only rank 0 reads the replication outcomes; the others just report theirs
        done = ctx.gather(f"{key}/r", rep_error) if ctx.distributed else [rep_error]
        failures = [f"rank {r}: {d['error']}" for r, d in enumerate(reports) if d["error"]]
        failures += [f"rank {r}: {e}" for r, e in enumerate(done) if e]
        writes = [write] if write else []
        writes += [RankWrite.from_json(d["write"]) for d in reports[1:] if d["write"]]
        try:
            if error is not None:  # still tell the node leaders, who wait for the manifest
                raise error
            if failures:
                raise StorageError(f"step {step} not committed to the RAM tier: {'; '.join(failures)}")
            manifest, data = _commit(storage, step, writes, skeleton, ctx.world_size,
                                     {str(r): {"rng": d["rng"]} for r, d in enumerate(reports)})
        except BaseException:
            discard(storage, step, [w.file for w in writes])
            if ctx.distributed:
                ctx.put(f"{key}/manifest", "")
            raise
        if ctx.distributed:
            ctx.put(f"{key}/manifest", data.decode())
        return manifest
    ctx.put(f"{key}/r/{ctx.rank}", rep_error)
    if error is not None:
        raise error
    if ctx.node_leader(ctx.rank):  # write rank 0's manifest into this node's directory
        doc = ctx.get(f"{key}/manifest")
        if not doc:
            discard(storage, step, [name for name, _ in storage.list_dir(step_dir_name(step))])
            raise StorageError(f"step {step} was not committed to the RAM tier (rank 0 gave up)")
        storage.write_bytes_atomic(f"{step_dir_name(step)}/{MANIFEST_NAME}", doc.encode())
    return None


def _replicate(storage: Storage, step: int, reports: list[dict], ctx: DistContext, peers: PeerGroup,
               replicas: int, own_bytes=None) -> None:
    """Send this rank's file to its replica targets; store verified copies of what arrives.

    `own_bytes`: this rank's data file as a uint8 tensor when it is in memory
    (the staging slot's image); otherwise the file is read back.
    """
    import torch

    docs = {r: d["write"] for r, d in enumerate(reports) if d["write"]}
    files = [docs[r]["file"] if r in docs else None for r in range(ctx.world_size)]
    plan = replication_plan(files, ctx.nodes, replicas)
    step_dir = step_dir_name(step)
    # Only the writes this rank receives are decoded (their chunks are checked on arrival).
    incoming = {t.file: RankWrite.from_json(docs[t.src]) for t in plan if t.dst == ctx.rank}

    def read(name: str):
        if own_bytes is not None:
            return own_bytes
        buf = torch.empty(docs[ctx.rank]["nbytes"], dtype=torch.uint8)
        with storage.open_read(f"{step_dir}/{name}") as f:
            if buf.numel():
                f.readinto(memoryview(buf.numpy()))
        return buf

    def write(name: str, buf) -> None:
        data = memoryview(buf.numpy())
        for t in incoming[name].tensors:
            for sh in t.shards:
                for c in sh.chunks:
                    codec.check(data[c.offset:c.offset + c.length], c.checksum,
                                f"replica {name} of step {step} (tensor {t.name!r})")
        with storage.open_write(f"{step_dir}/{name}") as f:
            f.write(data)

    sizes = {(r, d["file"]): d["nbytes"] for r, d in docs.items()}
    fault_point("replicate", step, ctx.rank)
    peers.run(plan, read, write, sizes, keep_buffers=True)


def discard(storage: Storage, step: int, files: list[str]) -> None:
    """Remove data files of an uncommitted step (never touches a committed one)."""
    step_dir = step_dir_name(step)
    try:
        if storage.exists(f"{step_dir}/{MANIFEST_NAME}"):
            return
        for name in files:
            storage.remove(f"{step_dir}/{name}")
    except StorageError as e:
        log.warning("could not clean up uncommitted files of step %d: %s", step, e)


def delete_step(storage: Storage, step: int) -> None:
    """Remove a step: manifest first, so it stops existing before its data goes."""
    d = step_dir_name(step)
    storage.remove(f"{d}/{MANIFEST_NAME}")
    storage.remove(d, recursive=True)


def _writer_info() -> dict[str, Any]:
    import torch

    from . import __version__

    return {"ftkit": __version__, "torch": torch.__version__, "host": socket.gethostname()}

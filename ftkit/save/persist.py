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

import contextlib
import json
import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from ftkit.format import codec
from ftkit.coord.dist import DistContext
from ftkit.errors import AlreadyCommitted, CorruptCheckpointError, FormatError, FtkitError, StorageError
from ftkit.coord.faultpoints import fault_point
from ftkit.tiers.lifecycle import delete_step  # noqa: F401  (re-exported: retention imports it from here)
from ftkit.format.manifest import (MANIFEST_NAME, Chunk, Manifest, Shard, TensorEntry, manifest_from_json, manifest_json,
                     step_dir_name, tensor_entry_doc)
from ftkit.tiers.peers import PeerGroup, replication_plan
from ftkit.save.sharding import REPLICATED, Piece
from ftkit.save.staging import Slot
from ftkit.format.validate import MAX_INT, check_file_name, parse_json, report_tensors
from ftkit.tiers.storage import Storage

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 * 2**20


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
    with storage.open_write(rel, recycle=True) as f:
        whole = memoryview(slot.image().numpy()).cast("B") if image else None
        if whole is not None:
            f.write(whole)
        for e in slot.layout.entries:
            # One view of the image, sliced per tensor: a tensor view per entry costs more than its hash.
            raw = whole[e.offset:e.offset + e.nbytes] if whole is not None else slot.bytes_of(e)
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


def commit(storage: Storage, step: int, writes: list[RankWrite], skeleton: dict[str, Any],
           world_size: int = 1, rank_state: dict[str, Any] | None = None) -> Manifest:
    """Write the manifest that makes `step` exist (atomic on every backend); return it as read back."""
    done = _commit_docs(storage, step, [w.to_json() for w in writes], skeleton, world_size, rank_state or {})
    assert done.manifest is not None
    return done.manifest


@dataclass(frozen=True)
class Committed:
    """What rank 0 gets back from committing a step (persist, persist_node_local)."""

    stored_bytes: int
    manifest_json: bytes
    manifest: Manifest | None = None  # as validated before it was written


def merge_write_docs(writes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One tensor entry per tensor, holding the shards every rank wrote of it.

    Works on the writes as reported (RankWrite.to_json() documents)."""
    merged: dict[str, dict[str, Any]] = {}
    for w in sorted(writes, key=lambda w: w["rank"]):
        for t in w["tensors"]:
            prev = merged.get(t["name"])
            if prev is None:
                merged[t["name"]] = {**t, "shards": list(t["shards"])}
            elif (prev["dtype"], prev["shape"], prev["kind"]) != (t["dtype"], t["shape"], t["kind"]):
                raise FtkitError(f"ranks disagree about tensor {t['name']!r}: {prev['dtype']}{prev['shape']} "
                                 f"vs {t['dtype']}{t['shape']}")
            else:
                prev["shards"].extend(t["shards"])
    return list(merged.values())


def _commit_docs(storage: Storage, step: int, writes: list[dict[str, Any]], skeleton: dict[str, Any],
                 world_size: int, rank_state: dict[str, Any], present: set[str] | None = None) -> Committed:
    """commit() from the ranks' reports as they arrived: the manifest is assembled from
    the JSON documents, never rebuilt as dataclasses, then validated as any reader
    would validate it (the reports came through the store: untrusted) before it is
    written. `present`: the data files that must be in the step directory now (all,
    by default; a node-local tier holds only its node's), checked last, so a step
    whose data someone removed meanwhile is not committed."""
    rel = f"{step_dir_name(step)}/{MANIFEST_NAME}"
    if storage.exists(rel):
        raise AlreadyCommitted(f"{storage.where(rel)} already exists")
    try:
        files = {w["file"]: {"bytes": w["nbytes"], "rank": w["rank"]} for w in writes}
        tensors = merge_write_docs(writes)
    except (KeyError, TypeError, AttributeError) as e:  # reports that do not have the reports' shape
        raise FormatError(f"{storage.where(rel)}: a rank's report is malformed ({type(e).__name__}: {e})") from None
    data = manifest_json(step, world_size, tensors, skeleton, files, rank_state, time.time(), _writer_info())
    manifest = manifest_from_json(data, storage.where(rel), step)
    _check_files_present(storage, step, {f: info["bytes"] for f, info in files.items()
                                         if present is None or f in present})
    storage.write_bytes_atomic(rel, data)
    return Committed(sum(w["nbytes"] for w in writes), data, manifest)


def _check_files_present(storage: Storage, step: int, expected: dict[str, int]) -> None:
    """Every file of `expected` ({name: bytes}) is in the step directory at its size."""
    if not expected:
        return
    sizes = storage.list_sizes(step_dir_name(step))
    for name, nbytes in expected.items():
        if sizes.get(name) != nbytes:
            what = "is gone" if name not in sizes else f"is {sizes[name]} bytes, not {nbytes}"
            raise StorageError(f"step {step} not committed to {storage.display_url}: data file {name} {what} "
                               "(removed or changed by someone else?)")


def _write_share(storage: Storage, step: int, slot: Slot, pieces, compress, rank: int):
    """Write this rank's data file; return (write, error). AlreadyCommitted is raised."""
    try:
        return write_data(storage, step, slot, pieces, compress=compress, rank=rank), None
    except AlreadyCommitted:
        raise
    except Exception as e:  # reported to rank 0 first, raised afterwards
        return None, e


def persist(storage: Storage, step: int, slot: Slot, skeleton: dict[str, Any], *,
            compress: str | None, pieces: Mapping[str, Piece] | None = None, rng: Any = None,
            ctx: DistContext | None = None, key: str = "", ledger: KeyLedger | None = None,
            at: tuple[int, int] = (0, 0)) -> Committed | None:
    """Persist one step: every rank writes its data, rank 0 commits after all did.

    Ranks report to rank 0 through the store (`key`/rank): the file they wrote,
    or their error. Rank 0 commits only when every rank succeeded within the
    timeout; otherwise the step stays uncommitted (invisible) and its files are
    removed. Returns what was committed on rank 0, None elsewhere.

    Rank 0 deletes every report once it has read them. `ledger` (rank 0's) holds
    the reports of steps rank 0 skipped, which nobody read: they are deleted once
    this step's reports are all in, since each rank's persist thread takes its
    steps in order and so has sent those older reports first.
    """
    ctx = ctx or DistContext()
    write, error = _write_share(storage, step, slot, pieces, compress, ctx.rank)
    fault_point("persist", step, ctx.rank)  # data written, not yet reported
    if ctx.distributed:
        ctx.put(f"{key}/{ctx.rank}", {"write": write.to_json() if write else None,
                                      "error": str(error) if error else None, "rng": rng})
    if error is not None:
        raise error
    assert write is not None
    if ctx.rank != 0:
        return None
    writes, rank_state, failures = [write.to_json()], {"0": {"rng": rng}}, []
    with _older_keys(ledger, at) as older:
        try:
            for r in range(1, ctx.world_size):
                doc = _shared_report(r, ctx.get_raw(f"{key}/{r}"), ctx.world_size)
                if doc["error"]:
                    failures.append(f"rank {r}: {doc['error']}")
                else:
                    writes.append(doc["write"])
                    rank_state[str(r)] = {"rng": doc.get("rng")}
            _delete_keys(ctx, older)
            if failures:
                raise StorageError(f"step {step} not committed to {storage.display_url}: {'; '.join(failures)}")
            fault_point("commit", step, 0)  # every share is durable, the manifest not yet written
            return _commit_docs(storage, step, writes, skeleton, ctx.world_size, rank_state)
        except BaseException:
            discard(storage, step, [w["file"] for w in writes])
            raise
        finally:
            ctx.delete(*(f"{key}/{r}" for r in range(ctx.world_size)))


def _shared_report(rank: int, raw: bytes, world_size: int) -> dict[str, Any]:
    """A rank's report to rank 0 (persist), read from the store: untrusted, validated
    like a manifest's parts; one that does not validate reads as that rank's error."""
    where = f"rank {rank}'s report"
    try:
        doc = parse_json(raw, where, "")
        if not isinstance(doc, dict) or not isinstance(doc.get("error"), (str, type(None))):
            raise FormatError(f"{where} is malformed")
        if doc["error"] is None:  # the tensors are validated with the manifest they become part of
            w = doc.get("write")
            if not isinstance(w, dict) or w.get("rank") != rank or not isinstance(w.get("tensors"), list):
                raise FormatError(f"{where} has no write of rank {rank}")
            check_file_name(w.get("file"))
        return doc
    except FormatError as e:
        return {"error": f"unreadable report: {e}", "write": None}


@dataclass(frozen=True)
class _Report:
    """One rank's report of its RAM-tier write, as gathered by every rank.

    Sent as two JSON lines: a small head that every rank reads, then the tensor
    entries, which only rank 0 (for the manifest) and the ranks receiving this
    rank's replica (for its checksums) decode.
    """

    rank: int
    file: str | None
    nbytes: int
    error: str | None
    rng: Any
    tensors_json: str
    skipped: bool = False  # sent by the training thread (policy "skip"), not by a persist thread
    world_size: int = 1

    @staticmethod
    def encode(write: RankWrite | None, error: str | None, rng: Any, skipped: bool = False) -> str:
        head = {"file": write.file if write else None, "nbytes": write.nbytes if write else 0,
                "error": error, "rng": rng, "skipped": skipped}
        tensors = [tensor_entry_doc(t) for t in write.tensors] if write else []
        return json.dumps(head) + "\n" + json.dumps(tensors)  # json.dumps never emits a raw newline

    @staticmethod
    def decode(rank: int, text: str, world_size: int) -> "_Report":
        """A report as read from the store: untrusted, so its head is validated here
        (a file name is a plain name inside the step directory) and its tensors by
        `tensors()`, the only way they are read."""
        where = f"rank {rank}'s report"
        head_text, _, tensors = text.partition("\n")
        h = parse_json(head_text, where, "head")
        if not isinstance(h, dict) or not isinstance(h.get("error"), (str, type(None))):
            raise FormatError(f"{where} is malformed")
        file = h.get("file")
        if file is not None:
            check_file_name(file)
        nbytes = h.get("nbytes", 0)
        if type(nbytes) is not int or not 0 <= nbytes <= MAX_INT:
            raise FormatError(f"{where} has a bad byte count")
        return _Report(rank, file, nbytes, h["error"], h.get("rng"), tensors or "[]", h.get("skipped") is True,
                       world_size)

    def tensors(self, validate: bool = True) -> list[dict[str, Any]]:
        """The reported tensor entries, validated against this report's file
        (validate.report_tensors) unless the caller validates what it builds of them."""
        docs = parse_json(self.tensors_json, f"rank {self.rank}'s report", "tensor list")
        if self.file is None:
            if docs:
                raise FormatError(f"rank {self.rank}'s report lists tensors but no file")
            return []
        if validate:
            entries = report_tensors(docs, self.file, self.nbytes, self.world_size, f"rank {self.rank}'s report")
            if not entries and self.nbytes:
                raise FormatError(f"rank {self.rank}'s report lists no tensor for its {self.nbytes}-byte file")
        return docs

    def write_doc(self) -> dict[str, Any]:
        """For rank 0's commit, which validates the whole manifest it assembles."""
        return {"rank": self.rank, "file": self.file, "nbytes": self.nbytes, "tensors": self.tensors(validate=False)}


def _decode_report(rank: int, text: str, world_size: int) -> _Report:
    """A report, or (when it does not even parse) an error report in its place, so that
    every rank sees the same outcome and the step is simply not committed."""
    try:
        return _Report.decode(rank, text, world_size)
    except FormatError as e:
        return _Report(rank, None, 0, f"unreadable report: {e}", None, "[]", False, world_size)


def commit_key(tier: int, epoch: int, step: int) -> str:
    """The store keys of one step's commit to one tier. `epoch` (restore() calls so far)
    keeps a step snapshotted again after an in-process restore from meeting the keys
    of its first commit."""
    return f"commit/{tier}/{epoch}/{step}"


def report_skipped(ctx: DistContext, key: str, node_local: bool, reason: str) -> None:
    """Policy "skip": tell the other ranks at once that this rank will not write the
    step of `key`, so nobody waits for its share (or, from rank 0, for a manifest)."""
    if not node_local:
        ctx.put(f"{key}/{ctx.rank}", {"write": None, "rng": None, "error": reason})
        return
    ctx.store.set(f"{key}/w/{ctx.rank}", _Report.encode(None, reason, None, skipped=True))
    ctx.put(f"{key}/r/{ctx.rank}", None)
    if ctx.rank == 0:
        ctx.put(f"{key}/manifest", "")


class KeyLedger:
    """Store keys that calls of one tier's commit left behind, each with the (restore
    epoch, step) it belongs to; a later call deletes those of earlier steps once it
    is safe. `names(key)` lists what one call with `key` may leave behind."""

    def __init__(self, names: Callable[[str], list[str]]):
        self._names = names
        self._lock = threading.Lock()  # the training thread records skips; the persist thread the rest
        self._keys: list[tuple[tuple[int, int], str]] = []

    @staticmethod
    def node_local(rank: int) -> "KeyLedger":
        """persist_node_local's keys of one rank: its reports, and rank 0's manifest."""
        manifest = ["manifest"] if rank == 0 else []
        return KeyLedger(lambda key: [f"{key}/{n}" for n in (f"w/{rank}", f"r/{rank}", *manifest)])

    @staticmethod
    def shared(world_size: int) -> "KeyLedger":
        """persist's keys of a step rank 0 skipped: every rank's report, which rank 0 would have deleted."""
        return KeyLedger(lambda key: [f"{key}/{r}" for r in range(world_size)])

    def record(self, at: tuple[int, int], key: str) -> None:
        with self._lock:
            self._keys += [(at, k) for k in self._names(key)]

    @contextlib.contextmanager
    def older_than(self, at: tuple[int, int]) -> Iterator[list[tuple[tuple[int, int], str]]]:
        """The (at, key) pairs of calls before `at`, for this call to delete (emptying
        the list); whatever is still in the list at the end is kept for a later call."""
        with self._lock:
            older = [(t, k) for t, k in self._keys if t < at]
            self._keys = [(t, k) for t, k in self._keys if t >= at]
        try:
            yield older
        finally:
            if older:  # not deleted this time
                with self._lock:
                    self._keys += older


def _older_keys(ledger: KeyLedger | None, at: tuple[int, int]):
    return ledger.older_than(at) if ledger else contextlib.nullcontext([])


def _delete_keys(ctx: DistContext, older: list[tuple[tuple[int, int], str]]) -> None:
    if older:
        ctx.delete(*(k for _, k in older))
        older.clear()


def persist_node_local(storage: Storage, step: int, slot: Slot, skeleton: dict[str, Any], *,
                       compress: str | None, pieces: Mapping[str, Piece] | None, rng: Any,
                       ctx: DistContext, key: str, peers: PeerGroup | None = None,
                       replicas: int = 0, ledger: KeyLedger | None = None,
                       at: tuple[int, int] = (0, 0)) -> Committed | None:
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
    with _older_keys(ledger, at) as older:
        if ledger:
            ledger.record(at, key)
        return _persist_node_local(storage, step, slot, skeleton, compress, pieces, rng, ctx, key, peers,
                                   replicas, older)


def _persist_node_local(storage, step, slot, skeleton, compress, pieces, rng, ctx, key, peers, replicas,
                        older: list) -> Committed | None:
    """persist_node_local's work; empties `older` once it has deleted those keys."""
    try:
        write, error = _write_share(storage, step, slot, pieces, compress, ctx.rank)
    except AlreadyCommitted as e:  # this node has the step, another may not: still take part below
        write, error = None, e
    text = _Report.encode(write, str(error) if error else None, rng)
    texts = ctx.gather_text(f"{key}/w", text) if ctx.distributed else [text]
    reports = [_decode_report(r, t, ctx.world_size) for r, t in enumerate(texts)]
    if not any(r.skipped for r in reports):  # nobody reads the older keys any more
        _delete_keys(ctx, older)
    rep_error = None
    # A step some rank could not write (or skipped) will not be committed, and that rank
    # takes no part in replication: every rank sees the same reports and skips it too.
    if peers is not None and replicas > 0 and not any(r.error for r in reports):
        try:  # uncompressed, the data file is the slot's byte image: send the slot, not the file
            _replicate(storage, step, reports, ctx, peers, replicas, slot.image() if compress is None else None)
        except Exception as e:
            rep_error = f"replication failed: {e}"
            log.error("rank %d: step %d: %s", ctx.rank, step, rep_error)
    if ctx.rank == 0:  # only rank 0 reads the replication outcomes; the others just report theirs
        done = ctx.gather(f"{key}/r", rep_error) if ctx.distributed else [rep_error]
        failures = [f"rank {r.rank}: {r.error}" for r in reports if r.error]
        failures += [f"rank {r}: {e}" for r, e in enumerate(done) if e]
        writes = [{"file": r.file} for r in reports if r.file]  # what to discard if this goes wrong
        try:
            if error is not None:  # still tell the node leaders, who wait for the manifest
                raise error
            writes = [r.write_doc() for r in reports if r.file]
            if failures:
                raise StorageError(f"step {step} not committed to the RAM tier: {'; '.join(failures)}")
            committed = _commit_docs(storage, step, writes, skeleton, ctx.world_size,
                                     {str(r.rank): {"rng": r.rng} for r in reports},
                                     present={r.file for r in reports if r.file and ctx.nodes[r.rank] == ctx.node})
        except BaseException:
            discard(storage, step, [w["file"] for w in writes])
            if ctx.distributed:
                ctx.put(f"{key}/manifest", "")
            raise
        if ctx.distributed:
            ctx.store.set(f"{key}/manifest", committed.manifest_json)
        return committed
    ctx.put(f"{key}/r/{ctx.rank}", rep_error)
    if error is not None:
        raise error
    if ctx.node_leader(ctx.rank):  # write rank 0's manifest into this node's directory
        data = ctx.get_raw(f"{key}/manifest")
        if data in (b"", b'""'):  # rank 0's "not committed" (put as JSON "")
            discard(storage, step, [name for name, _ in storage.list_dir(step_dir_name(step))])
            raise StorageError(f"step {step} was not committed to the RAM tier (rank 0 gave up)")
        manifest = manifest_from_json(data, f"the manifest of step {step} from rank 0", expect_step=step)
        ours = {r.file for r in reports if r.file and ctx.nodes[r.rank] == ctx.node}
        _check_files_present(storage, step, {f: manifest.files[f]["bytes"] for f in ours if f in manifest.files})
        storage.write_bytes_atomic(f"{step_dir_name(step)}/{MANIFEST_NAME}", data)
    return None


def _replicate(storage: Storage, step: int, reports: list[_Report], ctx: DistContext, peers: PeerGroup,
               replicas: int, own_bytes=None) -> None:
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
                f.readinto(memoryview(buf.numpy()))
        return buf

    def write(name: str, buf) -> None:
        data = memoryview(buf.numpy())
        tensors, nbytes = incoming[name]
        if len(data) != nbytes:
            raise CorruptCheckpointError(f"replica {name} of step {step}: {len(data)} bytes arrived, {nbytes} reported")
        for t in tensors:
            for sh in t["shards"]:
                for c in sh["chunks"]:
                    codec.check(data[c["offset"]:c["offset"] + c["length"]], c["checksum"],
                                f"replica {name} of step {step} (tensor {t['name']!r})")
        with storage.open_write(f"{step_dir}/{name}", recycle=True) as f:
            f.write(data)

    sizes = {(r.rank, r.file): r.nbytes for r in reports if r.file}
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


def _writer_info() -> dict[str, Any]:
    import torch

    from ftkit import __version__

    return {"ftkit": __version__, "torch": torch.__version__, "host": socket.gethostname()}

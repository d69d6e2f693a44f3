"""ftkit as PyTorch Distributed Checkpoint's storage: `dcp.save`, `dcp.async_save` and
`dcp.load`, called as they are, write and read ftkit steps on ftkit tiers.

DCP keeps its planning, resharding and collectives; ftkit adds where the bytes live (every
tier due; the node's RAM on a job of one node), checksums, no pickle (convert.py),
retention after each commit, and verification of every chunk a load reads.

Order of calls, as DCP makes them (torch/distributed/checkpoint/storage.py)::

    save:  reset(checkpoint_id) -> set_up_storage_writer -> prepare_local_plan ->
           prepare_global_plan (coordinator) -> write_data (every rank: its data file on
           each tier due) -> finish (coordinator: the manifest, then retention)
    load:  reset(checkpoint_id: the step chosen) -> read_metadata (every rank: the step chosen,
           if reset did not, or reset's error raised) -> set_up_storage_reader -> prepare_local_plan ->
           prepare_global_plan -> read_data

`checkpoint_id`: the step number, or a path or URL whose last component ends in it
(``.../step-100``, as torchtitan names its folders); without one the writer needs
`step=` and the reader takes the newest usable step.
"""

from __future__ import annotations

import io
import logging
import os
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ftkit import __version__
from ftkit.config import Tier, resolve_tiers
from ftkit.coord.dist import node_id
from ftkit.dcp import convert
from ftkit.errors import (
    AlreadyCommitted,
    CaptureError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FtkitError,
    StorageError,
    one_line,
)
from ftkit.format import codec
from ftkit.format.data import check_file_sizes, read_regions
from ftkit.format.index import encode_index, index_doc, part_file_name, part_ref
from ftkit.format.manifest import MANIFEST_NAME, Chunk, Manifest, chunk_doc, step_dir_name
from ftkit.format.part import encode_part_docs
from ftkit.format.reader import committed_steps, load_manifest, manifest_from, parse_manifest_header
from ftkit.save.write import CHUNK_BYTES
from ftkit.tiers.lifecycle import retire_step
from ftkit.tiers.ram import RunHold, hold_run, open_node_dir, retire_earlier_lives, run_identity, run_tokens
from ftkit.tiers.retention import apply_job_retention
from ftkit.tiers.storage import Storage

log = logging.getLogger("ftkit")
_STEP_RE = re.compile(r"([0-9]+)/*\Z")


def step_of(checkpoint_id: Any) -> int:
    """The step a DCP checkpoint_id names: an int, or the digits ending its last component."""
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool) and checkpoint_id >= 0:
        return checkpoint_id
    m = _STEP_RE.search(os.fspath(checkpoint_id)) if isinstance(checkpoint_id, (str, os.PathLike)) else None
    if m is None:
        raise FtkitError(
            f"checkpoint_id {str(checkpoint_id)[:120]!r} names no step: give the step number, or a path ending in it"
        )
    return int(m.group(1))


def _open(tiers: list[Tier]) -> tuple[list[Storage], RunHold | None]:
    """Each tier's storage, the RAM tier's this node's directory of the run; and this process's
    hold on that RAM tier (tiers/ram.py hold_run), which `ftkit gc ram` refuses to remove while
    the writer or reader keeping it lives (the kernel drops it when the process ends)."""
    if not any(t.is_ram for t in tiers):
        return [t.open() for t in tiers], None
    rank, _, one_node = _world()
    if not one_node:
        raise FtkitError(
            "the RAM tier through DCP needs a job of one node (its manifest is written by DCP's "
            "coordinator only); use ftkit.Checkpointer for RAM snapshots with replicas across nodes"
        )
    # The run's identity (tiers/ram.py run_identity), as a Checkpointer's: $FTKIT_RUN_ID, else the
    # durable tiers and their tokens, which rank 0 makes where missing and the other ranks wait for
    # (no store of ftkit's here), so that every rank names the same life of the run.
    durable = [t for t in tiers if not t.is_ram]
    first = _first_rank(rank)
    identity = run_identity([t.url for t in durable], tokens=run_tokens(durable, make=first))
    hold = hold_run(identity)  # (first: no `ftkit gc ram` removes what is opened next)
    ram = Storage(open_node_dir(identity, node_id(rank)), private=True)
    if first:  # (the node's leader: the job has one node)
        retire_earlier_lives(identity)
    return [ram if t.is_ram else t.open() for t in tiers], hold


def _first_rank(rank: int) -> bool:
    """Whether this process is the job's rank 0: torch.distributed's, or before it is initialized
    the launcher's ($RANK, as torchrun sets it)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return rank == 0
    return os.environ.get("RANK", "0").strip() in ("", "0")


def _world() -> tuple[int, int, bool]:
    """(rank, world size, whether every rank is on this node) of the job, or of one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, True
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return dist.get_rank(), dist.get_world_size(), local == dist.get_world_size()


class _LeavesPlansToDCP:
    """What ftkit's writer and reader leave to DCP: its plans as planned, and the checkpoint_id
    as passed (never DCP's guess from a path)."""

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


class FtkitStorageWriter(_LeavesPlansToDCP, StorageWriter):
    """DCP's storage writer onto ftkit tiers: `tiers` as a Checkpointer's (each with its
    `every`, `keep`, `keep_every`, `compress`); `step` when `dcp.save` has no checkpoint_id."""

    def __init__(self, tiers: Sequence[Any], step: int | None = None):
        super().__init__()
        self.tiers = resolve_tiers(tiers)
        self.step = step
        self.rank, self.world, _ = _world()
        storages, self._ram_hold = _open(self.tiers)
        self._storages = list(zip(self.tiers, storages, strict=True))

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.step = step_of(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = kwargs.get("rank", self.rank)

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        """The coordinator, before any rank writes: on each tier due, a committed step of this number
        whose data files are missing or torn is retired (a load passed over it for the step before,
        and the run resumed from there saves it again; refused, every restart would fail here)."""
        for _, storage in self._due():
            _retire_if_torn(storage, self.step)
        return plans

    def _due(self) -> list[tuple[Tier, Storage]]:
        if self.step is None:
            raise FtkitError("dcp.save through ftkit needs a step: checkpoint_id=STEP, or FtkitStorageWriter(step=)")
        due = [(t, s) for t, s in self._storages if self.step % t.every == 0]
        if not due:
            raise FtkitError(f"step {self.step} is due on no tier (every: {[t.every for t in self.tiers]})")
        return due

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """This rank's items into one data file of the step on every tier due; the results
        carry what the coordinator's manifest needs (convert.manifest_parts)."""
        due = self._due()
        assert self.step is not None
        step_dir = step_dir_name(self.step)
        # The data once, resolved in the plan's order: tensors to CPU bytes, values to JSON.
        items: list[tuple[Any, Any]] = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                items.append((item, convert.encode_value(item.index.fqn, _value_of(planner, item))))
            else:
                t = planner.resolve_data(item).detach()
                items.append((item, t.to("cpu").contiguous()))
        results: list[WriteResult] = []
        for n, (tier, storage) in enumerate(due):
            if storage.exists(f"{step_dir}/{MANIFEST_NAME}"):
                raise AlreadyCommitted(f"{storage.where(step_dir)} is already committed")
            name = f"rank-{self.rank:05d}-{uuid.uuid4().hex[:8]}.data"
            written = _write_file(storage, f"{step_dir}/{name}", name, items, tier.compress)
            if n == 0:
                results = written
            else:  # every tier holds the same items; the first tier's results name the rest by position
                for r, w in zip(results, written, strict=True):
                    r.storage_data.setdefault("tiers", []).append(w.storage_data)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        """The coordinator commits the step on every tier due (one part, then the index), then
        applies a job's retention: the tier's `keep`, and the steps older than this one that never
        committed (abandoned saves), as a Checkpointer's persist does."""
        assert self.step is not None
        for n, (tier, storage) in enumerate(self._due()):
            tier_results = [[_for_tier(r, n) for r in rank] for rank in results]
            tensors, skeleton, files, record = convert.manifest_parts(metadata, tier_results)
            _commit(storage, self.step, self.world, tensors, skeleton, files, record)
            try:
                apply_job_retention(storage, tier.keep, tier.keep_every, protect=self.step)
            except StorageError as e:  # the step is committed: what retention left stays for `ftkit gc`
                log.warning("ftkit: retention after step %d of %s failed: %s", self.step, storage.display_url, e)


def _retire_if_torn(storage: Storage, step: int | None) -> None:
    """Retire `step` if it is committed with data files missing or of other sizes than its manifest
    says (as a Checkpointer's restore retires the steps it supersedes: tiers/lifecycle.py). A manifest
    this ftkit cannot read, or a step whose files are whole, is left alone: write_data refuses it."""
    if step is None or not storage.exists(f"{step_dir_name(step)}/{MANIFEST_NAME}"):
        return
    try:
        manifest = load_manifest(storage, step)
    except (CorruptCheckpointError, CheckpointNotFoundError):
        return
    try:
        check_file_sizes(storage, manifest)
    except CorruptCheckpointError as e:
        log.warning(
            "ftkit: step %d of %s is committed but unusable (%s); retired, to be saved again",
            step,
            storage.display_url,
            e,
        )
        retire_step(storage, step)


def _value_of(planner: SavePlanner, item: Any) -> Any:
    """A non-tensor item's value: from the planner (DefaultSavePlanner.lookup_object), else
    DCP's bytes of it read back with weights_only (what fails needs pickle: refused)."""
    fqn = item.index.fqn
    lookup = getattr(planner, "lookup_object", None)
    if callable(lookup):
        return lookup(item.index)
    raw = planner.resolve_data(item)
    raw.seek(0)
    try:
        return torch.load(raw, weights_only=True)
    except Exception as e:  # (an unsupported global: an object only pickle could hold)
        raise CaptureError(f"cannot store {fqn!r} without pickle ({one_line(e, 120)})") from None


def _for_tier(r: WriteResult, n: int) -> WriteResult:
    if n == 0:
        return r
    return WriteResult(r.index, r.size_in_bytes, r.storage_data["tiers"][n - 1])


def _write_file(storage: Storage, rel: str, name: str, items: list[tuple[Any, Any]], compress: str | None):
    """One data file of `items` (a tensor's chunks, checksummed, raw or zstd); a WriteResult each."""
    results = []
    offset = 0
    with storage.open_write(rel) as f:
        for item, data in items:
            if item.type == WriteItemType.BYTE_IO:
                results.append(WriteResult(item.index, 0, {"file": None, "file_bytes": 0, "value": data}))
                continue
            raw = data.view(-1).view(torch.uint8).numpy().data if data.numel() else memoryview(b"")
            chunks = []
            for raw_off in range(0, len(raw), CHUNK_BYTES):
                piece = raw[raw_off : raw_off + CHUNK_BYTES]
                codec_name, stored = codec.encode(piece, compress)
                f.write(stored)
                c = Chunk(name, offset, len(stored), raw_off, len(piece), codec_name, codec.checksum(stored))
                chunks.append(chunk_doc(c))
                offset += len(stored)
            td = item.tensor_data
            results.append(
                WriteResult(
                    item.index,
                    len(raw),
                    {
                        "file": name,
                        "offsets": list(td.chunk.offsets),
                        "lengths": list(td.chunk.sizes),
                        "chunks": chunks,
                    },
                )
            )
    for r in results:
        if r.storage_data["file"] is not None:
            r.storage_data["file_bytes"] = offset
    return results


def _commit(storage: Storage, step: int, world: int, tensors, skeleton, files, record) -> None:
    """Write the step's one part and its index (the commit), checked first as a reader will."""
    step_dir = step_dir_name(step)
    ranks = list(range(world))
    name = part_file_name(0)
    data = encode_part_docs(step, ranks, files, tensors, {})
    writer = {"ftkit": __version__, "torch": torch.__version__, convert.DCP_KEY: record}
    index = encode_index(index_doc(step, world, [part_ref(name, data, ranks)], skeleton, time.time(), writer))
    parsed = parse_manifest_header(index, f"the index of step {step}", step)
    check = manifest_from(storage, step, index, parsed, {name: data})
    check_file_sizes(storage, check)
    storage.write_bytes_atomic(f"{step_dir}/{name}", data)
    storage.write_bytes_atomic(f"{step_dir}/{MANIFEST_NAME}", index)
    # An abandoned save of this same step (a job killed mid-save, then restarted) left its data here.
    stale = [n for n, kind in storage.list_dir(step_dir) if kind == "file" and n.endswith(".data") and n not in files]
    try:
        for n in stale:
            storage.remove(f"{step_dir}/{n}")
    except StorageError as e:  # the step is committed: what is left stays for `ftkit gc`
        log.warning("ftkit: could not remove an abandoned save's files from step %d: %s", step, e)


class FtkitStorageReader(_LeavesPlansToDCP, StorageReader):
    """DCP's storage reader of ftkit steps: `checkpoint_id` (or `step`) names the step; without
    one, the newest step that validates and has its files, from the fastest tier that has it."""

    def __init__(self, tiers: Sequence[Any], step: int | None = None):
        super().__init__()
        self.tiers = sorted(resolve_tiers(tiers), key=lambda t: t.speed_rank)
        self.step = step
        self._storages, self._ram_hold = _open(self.tiers)
        self.manifest: Manifest | None = None
        self.storage: Storage | None = None
        self._chosen: tuple[Storage, Manifest] | CheckpointNotFoundError | None = None  # by reset

    def reset(self, checkpoint_id: Any = None) -> None:
        """`dcp.load` calls this first when given a checkpoint_id, before its collectives: the step
        is chosen here. A step on no tier raises CheckpointNotFoundError here in a process alone (the
        one-line error); with several ranks, from read_metadata, whose error DCP gathers so every
        rank fails together (raised here, the others would wait in DCP's next collective)."""
        self.step = step_of(checkpoint_id) if checkpoint_id is not None else self.step
        self.manifest = self.storage = None
        try:
            self._chosen = self._choose() if checkpoint_id is not None else None
        except CheckpointNotFoundError as e:
            if _world()[1] == 1:
                raise
            self._chosen = e

    def read_metadata(self, *args: Any) -> Any:  # (no **kwargs: DCP then asks for no per-rank metadata)
        chosen, self._chosen = self._chosen, None
        if isinstance(chosen, CheckpointNotFoundError):
            raise chosen
        self.storage, self.manifest = chosen or self._choose()
        return convert.metadata_of(self.manifest)

    def latest_step(self) -> int | None:
        """The step a load without checkpoint_id would read, or None when there is none."""
        try:
            return self._choose()[1].step
        except CheckpointNotFoundError:
            return None

    def _choose(self) -> tuple[Storage, Manifest]:
        problems = []
        candidates = []
        for storage in self._storages:
            try:
                steps = committed_steps(storage)
            except StorageError as e:
                problems.append(str(e))
                continue
            candidates += [(s, storage) for s in steps if self.step is None or s == self.step]
        for s, storage in sorted(candidates, key=lambda c: -c[0]):  # newest first, fastest tier first
            try:
                m = load_manifest(storage, s)
                check_file_sizes(storage, m)
                return storage, m
            except (CorruptCheckpointError, StorageError, CheckpointNotFoundError) as e:
                problems.append(str(e))
                log.warning("ftkit: step %d of %s is unusable: %s", s, storage.display_url, e)
        where = ", ".join(s.display_url for s in self._storages)
        what = "no usable step" + (f" {self.step}" if self.step is not None else "")
        raise CheckpointNotFoundError(f"{what} in {where}" + (f": {problems[0]}" if problems else ""))

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Every item of this rank's plan: a value decoded from JSON, or a tensor region read,
        verified, and copied into the tensor DCP resolves for it."""
        assert self.manifest is not None and self.storage is not None
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(convert.skeleton_value(self.manifest, req.storage_index.fqn), buf)  # (DCP's own bytes)
                buf.seek(0)
                planner.load_bytes(req, buf)
                continue
            fqn = req.storage_index.fqn
            base = tuple(req.storage_index.offset or ())
            offsets = tuple(b + o for b, o in zip(base, req.storage_offsets))
            got = read_regions(self.storage, self.manifest, {fqn: (offsets, tuple(req.lengths))})[fqn]
            target = planner.resolve_tensor(req).detach()
            if tuple(target.shape) != tuple(got.shape):
                raise CorruptCheckpointError(
                    f"{fqn}: the step holds {tuple(got.shape)} where DCP asked for {tuple(target.shape)}"
                )
            target.copy_(got)
            planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

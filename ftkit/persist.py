"""Write a staged snapshot to one tier, two-phase: data first, manifest last.

Order of calls for one step on one tier::

    write_data(storage, step, slot, ...)  -> RankWrite  (data file complete and durable)
    commit(storage, step, [RankWrite...]) -> Manifest   (manifest.json appears: the commit)

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
from typing import Any, Callable

from . import codec
from .errors import FtkitError, StorageError
from .format import (MANIFEST_NAME, Chunk, Manifest, Shard, TensorEntry, manifest_to_json,
                     step_dir_name)
from .staging import Slot
from .storage import Storage

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 * 2**20


class AlreadyCommitted(FtkitError):
    """The tier already holds a committed manifest for this step."""


@dataclass(frozen=True)
class RankWrite:
    """What one rank wrote for a step: its data file and the tensor entries in it."""

    rank: int
    file: str
    nbytes: int
    tensors: tuple[TensorEntry, ...]


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def write_data(storage: Storage, step: int, slot: Slot, *, compress: str | None, rank: int = 0,
               progress: Callable[[int], None] | None = None) -> RankWrite:
    """Write every staged tensor of `slot` into one new data file of `step`."""
    step_dir = step_dir_name(step)
    if storage.exists(f"{step_dir}/{MANIFEST_NAME}"):
        raise AlreadyCommitted(f"{storage.where(step_dir)} is already committed")
    file_name = f"rank-{rank:05d}-{uuid.uuid4().hex[:8]}.data"
    rel = f"{step_dir}/{file_name}"
    entries = []
    offset = 0
    slot.ready()
    assert slot.layout is not None
    with storage.open_write(rel) as f:
        for e in slot.layout.entries:
            raw = slot.raw(e.name)
            chunks = []
            for raw_off in range(0, e.nbytes, CHUNK_BYTES):
                piece = raw[raw_off:raw_off + CHUNK_BYTES]
                codec_name, stored = codec.encode(piece, compress)
                f.write(stored)
                chunks.append(Chunk(file_name, offset, len(stored), raw_off, len(piece), codec_name,
                                    codec.checksum(stored)))
                offset += len(stored)
                if progress:
                    progress(len(piece))
            region = tuple(0 for _ in e.shape)
            entries.append(TensorEntry(e.name, dtype_name(e.dtype), e.shape,
                                       (Shard(region, e.shape, tuple(chunks), rank),)))
    return RankWrite(rank, file_name, offset, tuple(entries))


def commit(storage: Storage, step: int, writes: list[RankWrite], skeleton: dict[str, Any],
           world_size: int = 1) -> Manifest:
    """Write the manifest that makes `step` exist. Atomic on every backend."""
    manifest = Manifest(
        step=step,
        world_size=world_size,
        tensors=tuple(t for w in sorted(writes, key=lambda w: w.rank) for t in w.tensors),
        skeleton=skeleton,
        files={w.file: {"bytes": w.nbytes, "rank": w.rank} for w in writes},
        created_at=time.time(),
        writer=_writer_info(),
    )
    rel = f"{step_dir_name(step)}/{MANIFEST_NAME}"
    if storage.exists(rel):
        raise AlreadyCommitted(f"{storage.where(rel)} already exists")
    storage.write_bytes_atomic(rel, manifest_to_json(manifest))
    return manifest


def persist(storage: Storage, step: int, slot: Slot, skeleton: dict[str, Any], *,
            compress: str | None) -> Manifest:
    """Single-process persist of one step: data, then manifest; clean up on failure."""
    write = None
    try:
        write = write_data(storage, step, slot, compress=compress)
        return commit(storage, step, [write], skeleton)
    except AlreadyCommitted:
        raise
    except BaseException:
        if write is not None:
            discard(storage, step, [write.file])
        raise


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

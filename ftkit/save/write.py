"""One rank's share of a step: its data file, written in one go from a staging slot. File
names carry a random token, so a crashed or concurrent writer never overwrites bytes a
committed manifest points at; a step with a manifest is never written again."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from ftkit.errors import AlreadyCommitted, StorageError
from ftkit.format import codec
from ftkit.format.manifest import MANIFEST_NAME, Chunk, Shard, TensorEntry, step_dir_name
from ftkit.format.validate import MAX_CHUNK_RAW
from ftkit.save.sharding import REPLICATED, Piece
from ftkit.save.staging import Slot
from ftkit.tiers.storage import Storage

log = logging.getLogger(__name__)

CHUNK_BYTES = MAX_CHUNK_RAW  # (readers refuse a larger chunk)


@dataclass(frozen=True)
class RankWrite:
    """What one rank wrote for a step: its data file and the tensor pieces in it."""

    rank: int
    file: str
    nbytes: int
    tensors: tuple[TensorEntry, ...]


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def write_data(
    storage: Storage,
    step: int,
    slot: Slot,
    pieces: Mapping[str, Piece] | None = None,
    *,
    compress: str | None,
    rank: int = 0,
) -> RankWrite:
    """Write every staged tensor of `slot` into one new data file of `step`. `pieces`: the
    region of a global tensor each is (default: whole, replicated). Uncompressed, the file
    is the slot's image, written in one call (and peers are sent the slot, not the file)."""
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
        whole = slot.image().numpy().data.cast("B")
        if image:
            f.write(whole)
        for e in slot.layout.entries:
            # Slices of one view of the image: a tensor view per entry costs more than its hash.
            raw = whole[e.offset : e.offset + e.nbytes]
            chunks = []
            for raw_off in range(0, e.nbytes, CHUNK_BYTES):
                piece = raw[raw_off : raw_off + CHUNK_BYTES]
                stored: memoryview | bytes
                if image:
                    codec_name, stored, at = "raw", piece, e.offset + raw_off
                else:
                    codec_name, stored = codec.encode(piece, compress)
                    f.write(stored)
                    at, offset = offset, offset + len(stored)
                chunks.append(
                    Chunk(file_name, at, len(stored), raw_off, len(piece), codec_name, codec.checksum(stored))
                )
            p = (pieces or {}).get(e.name) or Piece(e.name, REPLICATED, e.shape, (0,) * len(e.shape), e.shape)
            shard = Shard(p.offsets, p.lengths, tuple(chunks), rank)
            entries.append(TensorEntry(e.name, dtype_name(e.dtype), p.global_shape, (shard,), p.kind))
    return RankWrite(rank, file_name, slot.layout.total_bytes if image else offset, tuple(entries))


def write_share(storage: Storage, step: int, slot: Slot, pieces, compress, rank: int):
    """Write this rank's data file; return (write, error). AlreadyCommitted is raised."""
    try:
        return write_data(storage, step, slot, pieces, compress=compress, rank=rank), None
    except AlreadyCommitted:
        raise
    except Exception as e:  # reported to rank 0 first, raised afterwards
        return None, e


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

"""Find, verify and read checkpoints on one tier.

A step exists only if its directory holds a manifest that parses and validates.
Reading verifies the checksum of every chunk before any byte is handed out, so a
caller either gets the whole step, correct, or a CorruptCheckpointError that says
which file and tensor are bad.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from . import codec
from .errors import CheckpointNotFoundError, CorruptCheckpointError, FormatError
from .format import MANIFEST_NAME, Chunk, Manifest, manifest_from_json, parse_step_dir, step_dir_name
from .storage import Storage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepDir:
    step: int
    committed: bool  # has a manifest (not yet validated)


def scan(storage: Storage) -> list[StepDir]:
    """Every step directory under the root, oldest first."""
    out = []
    for name, kind in storage.list_dir():
        step = parse_step_dir(name)
        if step is None or kind != "directory":
            continue
        out.append(StepDir(step, storage.exists(f"{name}/{MANIFEST_NAME}")))
    return sorted(out, key=lambda s: s.step)


def committed_steps(storage: Storage) -> list[int]:
    return [s.step for s in scan(storage) if s.committed]


def load_manifest(storage: Storage, step: int) -> Manifest:
    rel = f"{step_dir_name(step)}/{MANIFEST_NAME}"
    try:
        data = storage.read_bytes(rel)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{storage.where(step_dir_name(step))}: no manifest (step {step} "
                                      "is not committed)") from None
    return manifest_from_json(data, storage.where(rel), expect_step=step)


def newest_manifest(storage: Storage, step: int | None = None) -> Manifest:
    """The manifest of `step`, or of the newest committed step."""
    if step is not None:
        return load_manifest(storage, step)
    steps = committed_steps(storage)
    if not steps:
        raise CheckpointNotFoundError(f"{storage.display_url}: no checkpoint found")
    return load_manifest(storage, steps[-1])


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _chunk_jobs(manifest: Manifest):
    """(chunk, tensor name, shard index) grouped by file, in file order: sequential reads."""
    by_file: dict[str, list] = {}
    for t in manifest.tensors:
        for si, s in enumerate(t.shards):
            for c in s.chunks:
                by_file.setdefault(c.file, []).append((c, t.name, si))
    for name in by_file:
        by_file[name].sort(key=lambda x: x[0].offset)
    return by_file


def _check_file_sizes(storage: Storage, manifest: Manifest) -> None:
    step_dir = step_dir_name(manifest.step)
    for name, info in manifest.files.items():
        rel = f"{step_dir}/{name}"
        try:
            size = storage.size(rel)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{storage.where(rel)}: data file is missing") from None
        if size != info["bytes"]:
            raise CorruptCheckpointError(
                f"{storage.where(rel)}: data file is {size} bytes, manifest says {info['bytes']} (truncated?)")


def _read_exact(f, length: int, where: str) -> bytes:
    data = f.read(length)
    if len(data) != length:
        raise CorruptCheckpointError(f"{where}: file ends early (truncated)")
    return data


def verify(storage: Storage, manifest: Manifest, progress: Callable[[int], None] | None = None) -> None:
    """Check sizes and every chunk's checksum; raise CorruptCheckpointError on the first problem."""
    _check_file_sizes(storage, manifest)
    step_dir = step_dir_name(manifest.step)
    for name, jobs in _chunk_jobs(manifest).items():
        rel = f"{step_dir}/{name}"
        with storage.open_read(rel) as f:
            for c, tname, _ in jobs:
                f.seek(c.offset)
                data = _read_exact(f, c.length, storage.where(rel))
                codec.check(data, c.checksum, f"{storage.where(rel)} (tensor {tname!r})")
                if progress:
                    progress(c.raw_length)


def read_tensors(storage: Storage, manifest: Manifest, names: Iterable[str] | None = None,
                 out: dict[str, torch.Tensor] | None = None,
                 progress: Callable[[int], None] | None = None) -> dict[str, torch.Tensor]:
    """Read (and verify) whole tensors into contiguous CPU tensors.

    `out` may supply destination tensors (e.g. reused staging views) of the right
    shape and dtype; others are allocated. Nothing is returned unless every chunk
    verified.
    """
    wanted = set(names) if names is not None else {t.name for t in manifest.tensors}
    entries = {t.name: t for t in manifest.tensors if t.name in wanted}
    dest: dict[str, torch.Tensor] = {}
    for name, t in entries.items():
        given = (out or {}).get(name)
        if given is not None and tuple(given.shape) == t.shape and given.dtype == torch_dtype(t.dtype) \
                and given.is_contiguous() and given.device.type == "cpu":
            dest[name] = given
        else:
            dest[name] = torch.empty(t.shape, dtype=torch_dtype(t.dtype))
    _check_file_sizes(storage, manifest)
    # A shard covering its whole tensor decodes straight into the destination; a
    # partial one (saved by several ranks) decodes into a temporary, then its region.
    partial: dict[tuple[str, int], torch.Tensor] = {}
    step_dir = step_dir_name(manifest.step)
    for fname, jobs in _chunk_jobs(manifest).items():
        rel = f"{step_dir}/{fname}"
        where = storage.where(rel)
        with storage.open_read(rel) as f:
            for c, tname, si in jobs:
                if tname not in entries:
                    continue
                entry = entries[tname]
                shard = entry.shards[si]
                if _covers_all(shard, entry.shape):
                    target = dest[tname]
                else:
                    target = partial.get((tname, si))
                    if target is None:
                        target = partial[(tname, si)] = torch.empty(shard.lengths, dtype=dest[tname].dtype)
                _read_chunk(f, c, _raw_bytes(target), f"{where} (tensor {tname!r})")
                if progress:
                    progress(c.raw_length)
    for (tname, si), tmp in partial.items():
        shard = entries[tname].shards[si]
        region = dest[tname]
        for dim, (o, n) in enumerate(zip(shard.offsets, shard.lengths)):
            region = region.narrow(dim, o, n)
        region.copy_(tmp)
    return dest


def _covers_all(shard, shape) -> bool:
    return all(o == 0 for o in shard.offsets) and tuple(shard.lengths) == tuple(shape)


def _raw_bytes(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(bytearray())
    return memoryview(t.view(-1).view(torch.uint8).numpy())


def _read_chunk(f, c: Chunk, target: memoryview, where: str) -> None:
    dest = target[c.raw_offset:c.raw_offset + c.raw_length]
    if len(dest) != c.raw_length:
        raise FormatError(f"{where}: chunk lies outside its shard")
    f.seek(c.offset)
    if c.codec == "raw" and hasattr(f, "readinto"):
        n = f.readinto(dest)
        if n != c.length:
            raise CorruptCheckpointError(f"{where}: file ends early (truncated)")
        codec.check(dest, c.checksum, where)
        return
    data = _read_exact(f, c.length, where)
    codec.check(data, c.checksum, where)
    codec.decode_into(c.codec, data, dest, where)

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
from .sharding import byte_span, overlap
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


def _check_file_sizes(storage: Storage, manifest: Manifest, only: set[str] | None = None) -> None:
    step_dir = step_dir_name(manifest.step)
    for name, info in manifest.files.items():
        if only is not None and name not in only:
            continue
        rel = f"{step_dir}/{name}"
        try:
            size = storage.size(rel)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{storage.where(rel)}: data file is missing") from None
        if size != info["bytes"]:
            raise CorruptCheckpointError(
                f"{storage.where(rel)}: data file is {size} bytes, manifest says {info['bytes']} (truncated?)")


def _read_exact(f, length: int, where: str) -> bytes:
    """`length` bytes, looping over short reads (pipes, network files); the file ending first is truncation."""
    parts, got = [], 0
    while got < length:
        data = f.read(length - got)
        if not data:
            raise CorruptCheckpointError(f"{where}: file ends early (truncated)")
        parts.append(data)
        got += len(data)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _readinto_exact(f, dest: memoryview, where: str) -> None:
    got = 0
    while got < len(dest):
        n = f.readinto(dest[got:])
        if not n:
            raise CorruptCheckpointError(f"{where}: file ends early (truncated)")
        got += n


def verify(storage: Storage, manifest: Manifest, progress: Callable[[int], None] | None = None,
           names: Iterable[str] | None = None) -> None:
    """Check sizes and every chunk's checksum (of the `names` tensors, default all); raise on the first problem."""
    wanted = set(names) if names is not None else None
    jobs_by_file = {f: [j for j in jobs if wanted is None or j[1] in wanted]
                    for f, jobs in _chunk_jobs(manifest).items()}
    jobs_by_file = {f: jobs for f, jobs in jobs_by_file.items() if jobs}
    _check_file_sizes(storage, manifest, set(jobs_by_file) if wanted is not None else None)
    step_dir = step_dir_name(manifest.step)
    for name, jobs in jobs_by_file.items():
        rel = f"{step_dir}/{name}"
        with storage.open_read(rel) as f:
            for c, tname, _ in jobs:
                f.seek(c.offset)
                data = _read_exact(f, c.length, storage.where(rel))
                codec.check(data, c.checksum, f"{storage.where(rel)} (tensor {tname!r})")
                if progress:
                    progress(c.raw_length)


def read_tensors(storage: Storage, manifest: Manifest, names: Iterable[str] | None = None,
                 progress: Callable[[int], None] | None = None) -> dict[str, torch.Tensor]:
    """Read (and verify) whole tensors into new contiguous CPU tensors."""
    wanted = set(names) if names is not None else {t.name for t in manifest.tensors}
    regions = {t.name: ((0,) * len(t.shape), t.shape) for t in manifest.tensors if t.name in wanted}
    return read_regions(storage, manifest, regions, progress=progress)


Region = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, lengths)


def read_regions(storage: Storage, manifest: Manifest, regions: dict[str, Region],
                 progress: Callable[[int], None] | None = None,
                 out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Read a region of each named tensor, touching only the chunks that overlap it.

    Shards that match their region exactly decode straight into the result; any
    other overlapping shard decodes its needed chunks into a temporary, from
    which the overlap is copied. Every chunk read is verified; nothing is
    returned unless all of them pass.
    """
    entries = {t.name: t for t in manifest.tensors}
    missing = [n for n in regions if n not in entries]
    if missing:
        raise CorruptCheckpointError(f"{storage.where(step_dir_name(manifest.step))}: "
                                     f"no tensor {missing[0]!r} in the checkpoint")
    dest: dict[str, torch.Tensor] = {}
    # (chunk, tensor name, bytes of the target it decodes into) jobs, and the copies to do after decoding.
    jobs: list[tuple[Chunk, str, memoryview]] = []
    copies: list[tuple[torch.Tensor, Region, Region, torch.Tensor, str]] = []
    for name, (offs, lens) in regions.items():
        entry = entries[name]
        dtype = torch_dtype(entry.dtype)
        given = (out or {}).get(name)
        if given is not None:  # the caller's tensor (e.g. the live one): must match exactly
            assert tuple(given.shape) == tuple(lens) and given.dtype == dtype and given.is_contiguous()
        dest[name] = given if given is not None else torch.empty(tuple(lens), dtype=dtype)
        out_t = dest[name]
        covered = 0
        for shard in entry.shards:
            ov = overlap(offs, lens, shard.offsets, shard.lengths)
            if ov is None:
                continue
            covered += _numel(ov[1])
            if tuple(shard.offsets) == tuple(offs) and tuple(shard.lengths) == tuple(lens):
                target, needed = out_t, shard.chunks
            elif _row_block_inside(shard, offs, lens):
                # A block of whole rows inside the region: decode straight into its rows.
                target, needed = out_t.narrow(0, shard.offsets[0] - offs[0], shard.lengths[0]), shard.chunks
            else:
                target = torch.empty(shard.lengths, dtype=dtype)
                lo, hi = byte_span(ov[0], ov[1], shard.offsets, shard.lengths, target.element_size())
                needed = tuple(c for c in shard.chunks if c.raw_offset < hi and c.raw_offset + c.raw_length > lo)
                copies.append((target, (shard.offsets, shard.lengths), ov, out_t, name))
            raw = _raw_bytes(target)
            jobs += [(c, name, raw) for c in needed]
        if covered != _numel(lens):
            raise CorruptCheckpointError(f"{storage.where(step_dir_name(manifest.step))}: the saved shards of "
                                         f"{name!r} do not cover the region to restore")
    _check_file_sizes(storage, manifest, {c.file for c, _, _ in jobs})
    by_file: dict[str, list[tuple[Chunk, str, memoryview]]] = {}
    for job in jobs:
        by_file.setdefault(job[0].file, []).append(job)
    step_dir = step_dir_name(manifest.step)
    for fname, file_jobs in by_file.items():
        rel = f"{step_dir}/{fname}"
        where = storage.where(rel)
        with storage.open_read(rel) as f:
            for c, name, raw in sorted(file_jobs, key=lambda j: j[0].offset):
                _read_chunk(f, c, raw, f"{where} (tensor {name!r})")
                if progress:
                    progress(c.raw_length)
    for shard_tensor, (s_off, _), (o_off, o_len), out, name in copies:
        src = shard_tensor
        dst = out
        for dim, (o, n) in enumerate(zip(o_off, o_len)):
            src = src.narrow(dim, o - s_off[dim], n)
            dst = dst.narrow(dim, o - regions[name][0][dim], n)
        dst.copy_(src)
    return dest


def _row_block_inside(shard, offs, lens) -> bool:
    """Whether `shard` spans whole trailing dimensions of the region and lies within its rows."""
    return (len(lens) >= 1 and tuple(shard.offsets[1:]) == tuple(offs[1:])
            and tuple(shard.lengths[1:]) == tuple(lens[1:])
            and offs[0] <= shard.offsets[0] and shard.offsets[0] + shard.lengths[0] <= offs[0] + lens[0])


def _numel(lengths) -> int:
    n = 1
    for x in lengths:
        n *= x
    return n


def _raw_bytes(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(bytearray())
    return memoryview(t.view(-1).view(torch.uint8).numpy())


def _read_chunk(f, c: Chunk, target: memoryview, where: str) -> None:
    dest = target[c.raw_offset:c.raw_offset + c.raw_length]
    if len(dest) != c.raw_length:
        raise FormatError(f"{where}: chunk lies outside its shard")
    f.seek(c.offset)
    if c.codec == "raw" and hasattr(f, "readinto") and c.length == len(dest):
        _readinto_exact(f, dest, where)
        codec.check(dest, c.checksum, where)
        return
    data = _read_exact(f, c.length, where)
    codec.check(data, c.checksum, where)
    codec.decode_into(c.codec, data, dest, where)

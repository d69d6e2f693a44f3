"""A step's data files: sizes checked against the manifest, chunks verified as read.

Order of calls: a manifest from reader.py, then `verify` (every chunk) or `read_tensors` /
`read_regions` (only the chunks a region needs); each runs `check_file_sizes` first,
before anything is allocated on the manifest's word.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import psutil
import torch

from ftkit.errors import CorruptCheckpointError, FormatError
from ftkit.format import codec
from ftkit.format.manifest import Chunk, Manifest, step_dir_name
from ftkit.format.store import StepStore as Storage
from ftkit.format.tiling import byte_span, overlap


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def check_file_sizes(storage: Storage, manifest: Manifest, only: Iterable[str] | None = None) -> None:
    """The data files (of `only`, default all) exist with the sizes the manifest declares:
    validation bounded every byte count by those, this binds them to what storage holds."""
    step_dir = step_dir_name(manifest.step)
    names = sorted(set(only) if only is not None else manifest.files)
    if not names:
        return
    sizes = storage.list_sizes(step_dir)
    for name in names:
        rel = f"{step_dir}/{name}"
        if name not in sizes:
            raise CorruptCheckpointError(f"{storage.where(rel)}: data file is missing")
        if sizes[name] != manifest.files[name]["bytes"]:
            raise CorruptCheckpointError(
                f"{storage.where(rel)}: data file is {sizes[name]} bytes, manifest says "
                f"{manifest.files[name]['bytes']} (truncated?)"
            )


@contextlib.contextmanager
def _data_file(storage: Storage, rel: str) -> Iterator[None]:
    """A data file gone since the manifest was read (a gc, another job's retention) is that
    step's corruption: restore moves on to the next candidate, the CLI says which file."""
    try:
        yield
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{storage.where(rel)}: data file is missing") from None


def _readinto_exact(f, dest: memoryview, where: str) -> None:
    """Fill `dest`, looping over short reads; the file ending first is truncation."""
    got = 0
    while got < len(dest):
        n = f.readinto(dest[got:])
        if not n:
            raise CorruptCheckpointError(f"{where}: file ends early (truncated)")
        got += n


# Remote reads fetch a file's chunks as spans of neighbouring chunks, several spans at once.
SPAN_BYTES = 32 * 2**20  # a span: neighbouring chunks up to this many stored bytes, one request
SPAN_GAP = 2**20  # chunks this close share a span (the bytes between are read and dropped)
BATCH_BYTES = 256 * 2**20  # spans in flight at once: the memory a remote read holds beyond its results


def _spans(chunks: list[Chunk]) -> list[tuple[int, int, list[int]]]:
    """(start, end, indices into `chunks`) of each span; `chunks` sorted by offset."""
    spans: list[tuple[int, int, list[int]]] = []
    for i, c in enumerate(chunks):
        if spans:
            start, end, members = spans[-1]
            if c.offset >= end and c.offset - end <= SPAN_GAP and c.offset + c.length - start <= SPAN_BYTES:
                members.append(i)
                spans[-1] = (start, c.offset + c.length, members)
                continue
        spans.append((c.offset, c.offset + c.length, [i]))
    return spans


def chunk_bytes(storage: Storage, rel: str, chunks: list[Chunk]) -> Iterator[tuple[int, memoryview]]:
    """(index, stored bytes) of each of `chunks` (sorted by offset) of file `rel`, in order;
    a file shorter than a chunk's end is truncation."""
    if storage.is_local:
        with _data_file(storage, rel), storage.open_read(rel) as f:
            for i, c in enumerate(chunks):
                f.seek(c.offset)
                stored = memoryview(bytearray(c.length))
                _readinto_exact(f, stored, storage.where(rel))
                yield i, stored
        return
    spans, at = _spans(chunks), 0
    while at < len(spans):
        batch, size = [spans[at]], spans[at][1] - spans[at][0]
        at += 1
        while at < len(spans) and size + spans[at][1] - spans[at][0] <= BATCH_BYTES:
            batch.append(spans[at])
            size += spans[at][1] - spans[at][0]
            at += 1
        with _data_file(storage, rel):
            got = storage.read_ranges(rel, [(start, end) for start, end, _ in batch])
        for (start, end, members), data in zip(batch, got, strict=True):
            if len(data) != end - start:
                raise CorruptCheckpointError(f"{storage.where(rel)}: file ends early (truncated)")
            view = memoryview(data)
            for i in members:
                c = chunks[i]
                yield i, view[c.offset - start : c.offset - start + c.length]


def verify(storage: Storage, manifest: Manifest, progress: Callable[[int], None] | None = None) -> None:
    """Check sizes, every chunk's checksum and that it decodes to its raw length; raise on the
    first problem. Never skips checksums."""
    check_file_sizes(storage, manifest)
    by_file: dict[str, list[tuple[Chunk, str]]] = {}
    for t in manifest.tensors:
        for c in (c for s in t.shards for c in s.chunks):
            by_file.setdefault(c.file, []).append((c, t.name))
    for (c, _), data, where in _stored_chunks(storage, step_dir_name(manifest.step), by_file):
        codec.check(data, c.checksum, where)
        codec.decode(c.codec, data, c.raw_length, where)
        if progress:
            progress(c.raw_length)


def _stored_chunks(storage: Storage, step_dir: str, by_file: dict[str, list[Any]]) -> Iterator[tuple[Any, Any, str]]:
    """(job, its chunk's stored bytes, where) for each job (chunk, tensor name, ...) of `by_file`,
    a file's in offset order, read as chunk_bytes groups them."""
    for fname, jobs in by_file.items():
        rel = f"{step_dir}/{fname}"
        where = storage.where(rel)
        ordered = sorted(jobs, key=lambda j: j[0].offset)
        for i, data in chunk_bytes(storage, rel, [j[0] for j in ordered]):
            yield ordered[i], data, f"{where} (tensor {ordered[i][1]!r})"


def read_tensors(
    storage: Storage, manifest: Manifest, progress: Callable[[int], None] | None = None
) -> dict[str, torch.Tensor]:
    """Read (and verify) every tensor whole into new contiguous CPU tensors; refused before any
    allocation when they need more memory than the host has available (a zstd chunk may decode
    to 32768 times its stored bytes: a small crafted step can claim far more than the host has)."""
    regions = {t.name: ((0,) * len(t.shape), t.shape) for t in manifest.tensors}
    free = int(psutil.virtual_memory().available)
    return read_regions(storage, manifest, regions, progress=progress, memory_limit=free)


Region = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, lengths)


def read_regions(
    storage: Storage,
    manifest: Manifest,
    regions: dict[str, Region],
    progress: Callable[[int], None] | None = None,
    out: dict[str, torch.Tensor] | None = None,
    memory_limit: int | None = None,
) -> dict[str, torch.Tensor]:
    """Read a region of each named tensor, touching only the chunks that overlap it.

    `out`: tensors to read into (contiguous CPU, of the region's shape and dtype); each
    byte is written by exactly one verified chunk, since validation proved the chunks
    tile the tensor. `memory_limit`: the most bytes it may allocate, checked before the
    first allocation. Raises CorruptCheckpointError on the first chunk that fails, or
    when memory would not suffice: the caller must then not use what was read.
    """
    entries = {t.name: t for t in manifest.tensors}
    step_where = storage.where(step_dir_name(manifest.step))
    missing = [n for n in regions if n not in entries]
    if missing:
        raise CorruptCheckpointError(f"{step_where}: no tensor {missing[0]!r} in the checkpoint")
    # 1. Plan: per region, the overlapping shards and how each is decoded. No allocation.
    plans: list[tuple[str, list[tuple[Any, Any]]]] = []
    files: set[str] = set()
    for name, (offs, lens) in regions.items():
        entry = entries[name]
        shards, covered = [], 0
        for shard in entry.shards:
            ov = overlap(offs, lens, shard.offsets, shard.lengths)
            if ov is None:
                continue
            covered += math.prod(ov[1])
            # Whole rows inside the region (or all of it) decode into its rows, others through a temporary.
            shards.append((shard, None if _row_block_inside(shard, offs, lens) else ov))
            files.update(c.file for c in shard.chunks)
        if covered != math.prod(lens):
            raise CorruptCheckpointError(
                f"{step_where}: the saved shards of {name!r} do not cover the region to restore"
            )
        plans.append((name, shards))
    # 2. Only once the files hold what the manifest says, and it fits, may its sizes be allocated.
    check_file_sizes(storage, manifest, files)
    if memory_limit is not None:
        new_bytes = _new_bytes(entries, regions, plans, out or {})
        if new_bytes > memory_limit:
            held = " for tensors the live state does not hold" if out else ""
            raise CorruptCheckpointError(
                f"{step_where}: restoring it needs {new_bytes / 2**30:.1f} GiB of new memory{held}, "
                f"more than the {memory_limit / 2**30:.1f} GiB available"
            )
    # 3. Allocate.
    dest: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[tuple[Chunk, str, memoryview]]] = {}  # the chunks to read, by file
    copies: list[tuple[torch.Tensor, Region, Region, torch.Tensor, str]] = []
    for name, shards in plans:
        entry, (offs, lens) = entries[name], regions[name]
        dtype = torch_dtype(entry.dtype)
        given = (out or {}).get(name)
        if given is not None and (
            tuple(given.shape) != tuple(lens)
            or given.dtype != dtype
            or not given.is_contiguous()
            or given.device.type != "cpu"
        ):
            raise ValueError(
                f"read_regions: the tensor given for {name!r} is not a contiguous CPU {entry.dtype}{list(lens)}"
            )
        out_t = dest[name] = given if given is not None else _empty(tuple(lens), dtype, step_where)
        for shard, ov in shards:
            if ov is None:
                target = out_t.narrow(0, shard.offsets[0] - offs[0], shard.lengths[0]) if lens else out_t
                needed = shard.chunks
            else:
                target = _empty(shard.lengths, dtype, step_where)
                lo, hi = byte_span(ov[0], ov[1], shard.offsets, shard.lengths, target.element_size())
                needed = tuple(c for c in shard.chunks if c.raw_offset < hi and c.raw_offset + c.raw_length > lo)
                copies.append((target, (shard.offsets, shard.lengths), ov, out_t, name))
            raw = target.view(-1).view(torch.uint8).numpy().data if target.numel() else memoryview(bytearray())
            for c in needed:
                by_file.setdefault(c.file, []).append((c, name, raw))
    # 4. Read every chunk once, verifying it where it lands.
    skip = codec.skipping_checksums(step_where)
    step_dir = step_dir_name(manifest.step)
    if storage.is_local:
        _read_local(storage, step_dir, by_file, skip, progress)
    else:  # remote: several spans at once (chunk_bytes)
        for (c, _, raw), data, where in _stored_chunks(storage, step_dir, by_file):
            _place_chunk(c, data, _chunk_dest(c, raw, where), where, skip)
            if progress:
                progress(c.raw_length)
    for shard_tensor, (s_off, _), (o_off, o_len), out_t, name in copies:
        src, dst = shard_tensor, out_t
        for dim, (o, n) in enumerate(zip(o_off, o_len)):
            src = src.narrow(dim, o - s_off[dim], n)
            dst = dst.narrow(dim, o - regions[name][0][dim], n)
        dst.copy_(src)
    return dest


# Local reads: spans of neighbouring chunks, several read at once (reads and checksums release the GIL).
LOCAL_SPAN_BYTES = 64 * 2**20
LOCAL_THREADS = min(8, os.cpu_count() or 1)


def _read_local(storage: Storage, step_dir: str, by_file: dict, skip: bool, progress) -> None:
    """Local files' chunks straight into their tensors, as spans of up to LOCAL_SPAN_BYTES read by
    LOCAL_THREADS threads (one when there is less than a span); the first failure is raised once
    no span is being read any more."""
    spans: list[tuple[str, list[tuple[Chunk, str, memoryview]]]] = []
    for fname, file_jobs in by_file.items():
        rel, size = f"{step_dir}/{fname}", 0
        span: list[tuple[Chunk, str, memoryview]] = []
        for job in sorted(file_jobs, key=lambda j: j[0].offset):
            if span and size + job[0].raw_length > LOCAL_SPAN_BYTES:
                spans.append((rel, span))
                span, size = [], 0
            span.append(job)
            size += job[0].raw_length
        if span:
            spans.append((rel, span))

    def read_span(rel: str, jobs: list) -> int:
        where = storage.where(rel)
        with _data_file(storage, rel), storage.open_read(rel) as f:
            for c, name, raw in jobs:
                _read_chunk(f, c, raw, f"{where} (tensor {name!r})", skip)
        return sum(c.raw_length for c, _, _ in jobs)

    total = sum(c.raw_length for _, jobs in spans for c, _, _ in jobs)
    if total <= LOCAL_SPAN_BYTES or LOCAL_THREADS == 1:
        for rel, jobs in spans:
            done = read_span(rel, jobs)
            if progress:
                progress(done)
        return
    with ThreadPoolExecutor(LOCAL_THREADS, thread_name_prefix="ftkit-read") as pool:
        futures = [pool.submit(read_span, rel, jobs) for rel, jobs in spans]
        try:
            for fut in as_completed(futures):
                done = fut.result()
                if progress:
                    progress(done)
        finally:
            for fut in futures:  # after a failure: start no more spans (the pool waits for those reading)
                fut.cancel()


def _new_bytes(entries, regions, plans, given) -> int:
    """The bytes read_regions allocates for a plan: its results not in `given`, and temporaries."""
    total = 0
    for name, shards in plans:
        itemsize = torch_dtype(entries[name].dtype).itemsize
        if name not in given:
            total += math.prod(regions[name][1]) * itemsize
        total += sum(math.prod(shard.lengths) * itemsize for shard, ov in shards if ov is not None)
    return total


def _empty(shape, dtype: torch.dtype, where: str) -> torch.Tensor:
    try:
        return torch.empty(shape, dtype=dtype)
    except (MemoryError, RuntimeError) as e:  # (torch's allocator raises RuntimeError)
        raise CorruptCheckpointError(f"{where}: cannot allocate {list(shape)} {dtype} to restore into ({e})") from None


def _row_block_inside(shard, offs, lens) -> bool:
    """Whether `shard` spans whole trailing dimensions of the region and lies within its rows (a
    scalar's one shard: always)."""
    return not lens or (
        tuple(shard.offsets[1:]) == tuple(offs[1:])
        and tuple(shard.lengths[1:]) == tuple(lens[1:])
        and offs[0] <= shard.offsets[0]
        and shard.offsets[0] + shard.lengths[0] <= offs[0] + lens[0]
    )


def _chunk_dest(c: Chunk, target: memoryview, where: str) -> memoryview:
    dest = target[c.raw_offset : c.raw_offset + c.raw_length]
    if len(dest) != c.raw_length:
        raise FormatError(f"{where}: chunk lies outside its shard")
    return dest


def _read_chunk(f, c: Chunk, target: memoryview, where: str, skip: bool) -> None:
    """A chunk of a local file into its place in `target`: a raw one read straight there."""
    dest = _chunk_dest(c, target, where)
    f.seek(c.offset)
    if c.codec == "raw":  # (validated: a raw chunk stores exactly its raw bytes)
        _readinto_exact(f, dest, where)
        codec.check(dest, c.checksum, where, skip)
        return
    data = memoryview(bytearray(c.length))
    _readinto_exact(f, data, where)
    _place_chunk(c, data, dest, where, skip)


def _place_chunk(c: Chunk, data: bytes | memoryview, dest: memoryview, where: str, skip: bool) -> None:
    codec.check(data, c.checksum, where, skip)
    codec.decode(c.codec, data, len(dest), where, dest)

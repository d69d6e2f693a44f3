"""Regions of tensors (offsets, lengths), and validate.py's proofs that no two chunks share
stored bytes and a tensor's shards cover it exactly once."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ftkit.errors import FormatError
from ftkit.format.manifest import Shard, TensorEntry

MAX_IRREGULAR_SHARDS = 4096  # shards that are no grid are checked pairwise


def check_no_shared_bytes(tensors: tuple[TensorEntry, ...] | list[TensorEntry]) -> None:
    """No two chunks share stored bytes: so the raw bytes of raw chunks never exceed the files."""
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for t in tensors:
        for s in t.shards:
            for c in s.chunks:
                by_file.setdefault(c.file, []).append((c.offset, c.offset + c.length, t.name))
    for file, spans in by_file.items():
        spans.sort()
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                raise FormatError(f"chunks of {a[:80]!r} and {b[:80]!r} share bytes of {file!r}")


def check_shards_tile(shape: tuple[int, ...], shards: tuple[Shard, ...], what: str) -> None:
    """The non-empty shards cover every element of `shape` exactly once."""
    total = math.prod(shape)
    full = [s for s in shards if math.prod(s.lengths) > 0]
    covered = sum(math.prod(s.lengths) for s in full)
    if covered != total:
        raise FormatError(
            f"the shards of {what} cover {covered} of its {total} elements"
            if covered < total
            else f"the shards of {what} overlap ({covered} elements saved for {total})"
        )
    if len(full) <= 1 or _is_grid(shape, full):
        return  # one shard inside the tensor with the full volume, or cells of a grid: exact
    if len(full) > MAX_IRREGULAR_SHARDS:
        raise FormatError(f"{what} has {len(full)} shards that form no grid; too many to check")
    # Equal volumes and no overlap: an exact cover. A sweep along the dimension whose starts
    # differ most compares each shard only with those still open there (all pairs: a crafted
    # part of bricks cost minutes).
    d = max(range(len(shape)), key=lambda i: len({s.offsets[i] for s in full}))
    opened: list[Shard] = []
    for a in sorted(full, key=lambda s: s.offsets[d]):
        opened = [b for b in opened if b.offsets[d] + b.lengths[d] > a.offsets[d]]
        for b in opened:
            if all(ao < bo + bl and bo < ao + al for ao, al, bo, bl in zip(a.offsets, a.lengths, b.offsets, b.lengths)):
                raise FormatError(f"two shards of {what} overlap")
        opened.append(a)


def _is_grid(shape: tuple[int, ...], shards: list[Shard]) -> bool:
    """Whether the shards are the distinct cells of a grid that partitions `shape`."""
    cuts = []
    for d, size in enumerate(shape):
        intervals = sorted({(s.offsets[d], s.lengths[d]) for s in shards})
        at = 0
        for o, n in intervals:
            if o != at:
                return False
            at += n
        if at != size:
            return False
        cuts.append(len(intervals))
    cells = {(s.offsets, s.lengths) for s in shards}
    return len(cells) == len(shards) == math.prod(cuts)


def overlap(a_off: Sequence[int], a_len: Sequence[int], b_off: Sequence[int], b_len: Sequence[int]):
    """The intersection of two regions as (offsets, lengths), or None if empty."""
    offs, lens = [], []
    for ao, al, bo, bl in zip(a_off, a_len, b_off, b_len):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if hi <= lo:
            return None
        offs.append(lo)
        lens.append(hi - lo)
    return tuple(offs), tuple(lens)


def byte_span(
    region_off: Sequence[int],
    region_len: Sequence[int],
    shard_off: Sequence[int],
    shard_len: Sequence[int],
    itemsize: int,
) -> tuple[int, int]:
    """[start, stop) bytes of a shard's row-major data that cover `region` (a superset)."""
    strides = [math.prod(shard_len[d + 1 :]) for d in range(len(shard_len))]
    first = sum((o - so) * s for o, so, s in zip(region_off, shard_off, strides))
    last = sum((o + n - 1 - so) * s for o, n, so, s in zip(region_off, region_len, shard_off, strides))
    return first * itemsize, (last + 1) * itemsize

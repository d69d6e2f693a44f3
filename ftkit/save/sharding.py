"""Who saves which region of which tensor, and which saved bytes a rank needs back: pure
functions over shapes. A DTensor is saved as each rank's local shard, an RNG tensor whole by
its rank, any other tensor once in total (big ones in row blocks, one per rank; small ones
whole, spread to balance bytes). At load, :func:`overlap` intersects regions with shards."""

from __future__ import annotations

import heapq
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ftkit.format.tiling import byte_span, overlap  # noqa: F401 (region geometry lives with the format)
from ftkit.save.capture import RNG_KEY
from ftkit.save.layout import Layout

SPLIT_BYTES = 1 << 20  # replicated tensors at least this big are split across ranks
RNG_TENSORS = f"{RNG_KEY}/"

REPLICATED, SHARDED, RANK_LOCAL = "replicated", "sharded", "rank-local"


@dataclass(frozen=True)
class Piece:
    """The region of one global tensor that one rank saves."""

    name: str
    kind: str  # REPLICATED, SHARDED or RANK_LOCAL
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


_DTENSOR: type | None = None


def is_dtensor(t: torch.Tensor) -> bool:
    # No DTensor exists until its module is imported, which is slow: look, don't import.
    global _DTENSOR
    if _DTENSOR is None:
        module = sys.modules.get("torch.distributed.tensor")
        if module is None:
            return False
        _DTENSOR = module.DTensor
    return isinstance(t, _DTENSOR)


def dtensor_region(t) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """(offsets, lengths, is_primary) of this rank's local shard of DTensor `t`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in t.placements:
        if not isinstance(p, (Shard, Replicate)):
            raise ValueError(f"placement {p} is not supported (only Shard and Replicate)")
    lengths, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    coords = t.device_mesh.get_coordinate() or []
    primary = all(c == 0 for c, p in zip(coords, t.placements) if isinstance(p, Replicate))
    return tuple(offsets), tuple(lengths), primary


def row_block(n: int, parts: int, i: int) -> tuple[int, int]:
    """[start, stop) of block i when n rows are cut into `parts` near-equal blocks."""
    return n * i // parts, n * (i + 1) // parts


def plan_pieces(
    named: Sequence[tuple[str, torch.Tensor]], rank: int, world_size: int, owners: dict[str, int] | None = None
) -> list[tuple[Piece, torch.Tensor]]:
    """The pieces this rank saves, each with the source tensor (view) to copy from. `owners`:
    whole_owners(named, world_size), when the caller plans every rank of a world."""
    if owners is not None:
        return _plan_pieces(named, rank, world_size, owners)
    return planned(named, rank, world_size)[0]


def _split(t: torch.Tensor, world_size: int) -> bool:
    """Whether a replicated tensor is cut into row blocks, one per rank (else one rank saves it whole)."""
    return world_size > 1 and t.numel() * t.element_size() >= SPLIT_BYTES and t.dim() >= 1 and t.shape[0] >= world_size


def whole_owners(named: Sequence[tuple[str, torch.Tensor]], world_size: int) -> dict[str, int]:
    """The rank that saves each replicated tensor kept whole: the one with the fewest bytes
    assigned so far, the lowest on a tie (the row blocks of split tensors load every rank
    alike, so they change no choice). A heap: O(W + T log W), not O(T x W), at 16,384 ranks."""
    heap = [(0, r) for r in range(world_size)]  # (bytes assigned, rank): sorted, so a heap
    owners: dict[str, int] = {}
    for name, t in named:
        if is_dtensor(t) or name.startswith(RNG_TENSORS) or _split(t, world_size):
            continue
        load, owner = heapq.heappop(heap)
        owners[name] = owner
        heapq.heappush(heap, (load + t.numel() * t.element_size(), owner))
    return owners


def planned(
    named: Sequence[tuple[str, torch.Tensor]],
    rank: int,
    world_size: int,
    plans: dict[tuple, Any] | None = None,
    layouts: dict[tuple, Layout] | None = None,
) -> tuple[list[tuple[Piece, torch.Tensor]], Layout]:
    """The pieces (as `plan_pieces`) and their staging layout. Without DTensors both depend
    only on names, shapes and dtypes: they are kept in `plans` and `layouts` (the
    Checkpointer's and its arena's; None: made anew) and only the sources are sliced."""
    if any(is_dtensor(t) for _, t in named):
        pieces = _plan_pieces(named, rank, world_size)
        return pieces, Layout.of([(p.name, src) for p, src in pieces], layouts)
    signature = (rank, world_size, tuple((n, t.shape, t.dtype) for n, t in named))
    cached = plans.get(signature) if plans is not None else None
    if cached is None:
        index = {n: i for i, (n, _) in enumerate(named)}
        pieces = _plan_pieces(named, rank, world_size)
        steps = [(p, index[p.name], p.offsets[0] if p.lengths != p.global_shape else None) for p, _ in pieces]
        cached = (steps, Layout.of([(p.name, src) for p, src in pieces]))
        if plans is not None:
            plans.clear()  # one state per Checkpointer: keep only the latest plan
            plans[signature] = cached
    steps, layout = cached
    sources = [
        (p, named[i][1] if start is None else named[i][1][start : start + p.lengths[0]]) for p, i, start in steps
    ]
    return sources, layout


def _plan_pieces(
    named: Sequence[tuple[str, torch.Tensor]], rank: int, world_size: int, owners: dict[str, int] | None = None
) -> list[tuple[Piece, torch.Tensor]]:
    if owners is None:
        owners = whole_owners(named, world_size)
    mine: list[tuple[Piece, torch.Tensor]] = []
    for name, t in named:
        shape = tuple(t.shape)
        if is_dtensor(t):
            offsets, lengths, primary = dtensor_region(t)
            if primary:
                mine.append((Piece(name, SHARDED, shape, offsets, lengths), t.to_local()))
            continue
        if name.startswith(RNG_TENSORS):  # this rank's RNG and RankLocal state
            mine.append((Piece(name, RANK_LOCAL, shape, (0,) * len(shape), shape), t))
            continue
        if _split(t, world_size):
            start, stop = row_block(shape[0], world_size, rank)
            offsets = (start,) + (0,) * (len(shape) - 1)
            lengths = (stop - start,) + shape[1:]
            mine.append((Piece(name, REPLICATED, shape, offsets, lengths), t[start:stop]))
        elif owners[name] == rank:
            mine.append((Piece(name, REPLICATED, shape, (0,) * len(shape), shape), t))
    return mine

"""Offline resharding (``ftkit restore SRC --out DST --world-size M``): a step rewritten as if
M ranks had saved it: replicated tensors split by a live job's plan, sharded ones cut into M row
blocks, the RNG state of ranks 0..M-1 kept. Tensors are read whole and verified first, so this
needs memory for the largest step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ftkit.commit.manifests import commit
from ftkit.format.data import read_tensors
from ftkit.format.manifest import Manifest
from ftkit.save.layout import Layout
from ftkit.save.sharding import RANK_LOCAL, SHARDED, Piece, plan_pieces, row_block, whole_owners
from ftkit.save.staging import StagingArena
from ftkit.save.write import discard, write_data
from ftkit.tiers.storage import Storage


def plan_for_world(
    manifest: Manifest,
    tensors: dict[str, torch.Tensor],
    rank: int,
    world_size: int,
    owners: dict[str, int],
) -> list[tuple[Piece, torch.Tensor]]:
    """The pieces rank `rank` of `world_size` would save of this checkpoint's tensors
    (`owners`: sharding.whole_owners of its replicated tensors, worked out once per world)."""
    kinds = {t.name: t.kind for t in manifest.tensors}
    out = plan_pieces(_replicated(manifest, tensors), rank, world_size, owners)
    for name, t in tensors.items():
        if kinds[name] == SHARDED:
            shape = tuple(t.shape)
            if shape and shape[0] >= world_size:
                start, stop = row_block(shape[0], world_size, rank)
                offs, lens = (start,) + (0,) * (len(shape) - 1), (stop - start,) + shape[1:]
                out.append((Piece(name, SHARDED, shape, offs, lens), t[start:stop]))
            elif rank == 0:
                out.append((Piece(name, SHARDED, shape, (0,) * len(shape), shape), t))
        elif kinds[name] == RANK_LOCAL and name.startswith(f"_rng/r{rank}/"):
            out.append((Piece(name, RANK_LOCAL, tuple(t.shape), (0,) * t.dim(), tuple(t.shape)), t))
    return out


def _replicated(manifest: Manifest, tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors a live job's plan spreads over its ranks (not sharded, not a rank's own)."""
    kinds = {t.name: t.kind for t in manifest.tensors}
    return [(n, t) for n, t in tensors.items() if kinds[n] not in (SHARDED, RANK_LOCAL)]


def reshard(
    src: Storage,
    manifest: Manifest,
    dst: Storage,
    world_size: int,
    *,
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Write `manifest`'s step to `dst` laid out for `world_size` ranks; return the new manifest."""
    tensors = read_tensors(src, manifest, progress=progress)
    arena = StagingArena(slots=1, pin=False)
    writes = []
    owners = whole_owners(_replicated(manifest, tensors), world_size)  # once for all ranks
    try:
        for rank in range(world_size):
            pieces = plan_for_world(manifest, tensors, rank, world_size, owners)
            named = [(p.name, t) for p, t in pieces]
            slot = arena.acquire(Layout.of(named), wait=True)
            assert slot is not None  # waiting without a timeout always gets one
            try:
                slot.fill(named)
                writes.append(
                    write_data(dst, manifest.step, slot, {p.name: p for p, _ in pieces}, compress=None, rank=rank)
                )
            finally:
                arena.release(slot)
        rank_state = {r: v for r, v in manifest.rank_state.items() if int(r) < world_size}
        # Another writer's fields (DCP's planner data) stay with the step; ftkit's are this writer's.
        extra = {k: v for k, v in manifest.writer.items() if k not in ("ftkit", "torch", "host")}
        return commit(dst, manifest.step, writes, manifest.skeleton, world_size, rank_state, writer_extra=extra)
    except BaseException:
        discard(dst, manifest.step, [w.file for w in writes])
        raise
    finally:
        arena.close()

"""What the tiers hold, as each rank sees it at the start of a restore (I/O; the
planning over it is restore/plan.py)."""

from __future__ import annotations

import logging
from typing import Any

from ftkit.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from ftkit.format.manifest import Manifest, step_dir_name
from ftkit.format.reader import load_manifest, scan
from ftkit.restore.context import RestoreContext

log = logging.getLogger("ftkit")


def ram_inventory(rc: RestoreContext) -> tuple[dict[str, Any], dict[int, Manifest]]:
    """What this rank's node holds in the RAM tier: {step: {"have": [...], "need": [...]}},
    and the manifests parsed on the way (the read of a candidate reuses them)."""
    i = rc.ram
    manifests: dict[int, Manifest] = {}
    if i is None:
        return {}, manifests
    storage = rc.storages[i]
    out: dict[str, Any] = {}
    try:
        for d in scan(storage):
            names = [n for n, kind in storage.list_dir(step_dir_name(d.step)) if kind == "file"]
            have = [n for n in names if n.endswith(".data")]
            need = None
            if d.committed:
                try:
                    manifests[d.step] = load_manifest(storage, d.step)
                    need = sorted(manifests[d.step].files)
                except (CorruptCheckpointError, CheckpointNotFoundError) as e:
                    log.warning("RAM tier manifest of step %d is unusable: %s", d.step, e)
            out[str(d.step)] = {"have": have, "need": need}
    except StorageError as e:
        log.warning("cannot list the RAM tier: %s", e)
    return out, manifests


def shared_listings(rc: RestoreContext) -> tuple[list[tuple[int, list[int]]], list[str]]:
    """(tier index, committed steps) of every shared tier, fastest first, and the errors
    of those that could not be listed."""
    listings, unreachable = [], []
    order = sorted(
        (i for i, t in enumerate(rc.tiers) if not (t.is_ram or t.is_peer)), key=lambda i: rc.tiers[i].speed_rank
    )
    for i in order:
        try:
            listings.append((i, [d.step for d in scan(rc.storages[i]) if d.committed]))
        except StorageError as e:
            log.warning("cannot list %s: %s", rc.storages[i].display_url, e)
            unreachable.append(str(e))
    return listings, unreachable

"""What the tiers hold, as each rank sees it at the start of a restore (I/O; plan.py plans)."""

from __future__ import annotations

import logging

from ftkit.commit.messages import Held, Inventory
from ftkit.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError, one_line
from ftkit.format import codec
from ftkit.format.manifest import Manifest
from ftkit.format.reader import load_index, manifest_from, missing_parts
from ftkit.restore.context import RestoreContext

log = logging.getLogger("ftkit")


def ram_inventory(rc: RestoreContext) -> tuple[Inventory, dict[int, Manifest]]:
    """What this rank's node holds in the RAM tier, and the manifests parsed on the way (a
    candidate's read reuses them). A node lacking some of a step's manifest parts lists the
    index's checksum and the parts it names instead: the step cannot be read here alone."""
    i = rc.ram
    manifests: dict[int, Manifest] = {}
    if i is None:
        return Inventory(), manifests
    backend = rc.backends[i]
    held = []
    try:
        for step, (have, committed) in backend.inventory().items():
            need = digest = index = parts = problem = None
            if committed:
                try:
                    data, parsed = load_index(backend.storage, step)
                    if parsed is not None and missing_parts(backend.storage, step, parsed.parts):
                        index = codec.checksum(data)
                        parts = tuple(sorted(ref.file for ref in parsed.parts))
                    else:
                        manifests[step] = manifest_from(backend.storage, step, data, parsed)
                        need = tuple(sorted(manifests[step].files))
                        digest = codec.checksum("\n".join(need).encode())
                except (CorruptCheckpointError, CheckpointNotFoundError) as e:
                    problem = one_line(e, 300)
                    log.warning("RAM tier manifest of step %d is unusable: %s", step, problem)
            held.append(Held(step, tuple(have), need, digest, index, parts, problem))
    except StorageError as e:
        log.warning("cannot list the RAM tier: %s", e)
    return Inventory(tuple(held)), manifests


def shared_listings(rc: RestoreContext) -> tuple[list[tuple[int, list[int]]], list[str]]:
    """(tier index, committed steps) of every shared tier, fastest first, and the errors of
    those that could not be listed."""
    listings, unreachable = [], []
    shared = [i for i, b in enumerate(rc.backends) if not b.node_local]
    for i in sorted(shared, key=lambda i: rc.backends[i].tier.speed_rank):
        try:
            listings.append((i, rc.backends[i].committed_steps()))
        except StorageError as e:
            log.warning("cannot list %s: %s", rc.backends[i].display_url, e)
            unreachable.append(str(e))
    return listings, unreachable

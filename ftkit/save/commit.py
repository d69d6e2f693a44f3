"""Write a staged snapshot to one tier, two-phase: data first, manifest last.

Order of calls for one step on one tier (`persist` does all of it; the RAM tier's
node-local commit is save/node_commit.py)::

    every rank:  write_data(storage, step, slot, ...) -> RankWrite  (its data file, durable)
                 report the RankWrite (or its error) to rank 0 through the store
    rank 0:      wait for every rank's report, then
                 commit(storage, step, [RankWrite...]) -> Manifest  (manifest.json: the commit)

Data file names carry a random token, so a crashed or concurrent writer can never
overwrite bytes that a committed manifest points at, and a step that already has
a manifest is never written again. A failure before the commit removes what this
writer wrote and leaves every committed step untouched.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ftkit.coord.dist import DistContext
from ftkit.coord.faultpoints import fault_point
from ftkit.errors import AlreadyCommitted, FormatError, FtkitError, StorageError
from ftkit.format.manifest import MANIFEST_NAME, Manifest, manifest_from_json, manifest_json, step_dir_name
from ftkit.save.keys import KeyLedger, delete_keys, older_keys
from ftkit.save.reports import shared_report
from ftkit.save.sharding import Piece
from ftkit.save.staging import Slot
from ftkit.save.write import RankWrite, discard, write_share
from ftkit.tiers.storage import Storage

log = logging.getLogger(__name__)


def commit(
    storage: Storage,
    step: int,
    writes: list[RankWrite],
    skeleton: dict[str, Any],
    world_size: int = 1,
    rank_state: dict[str, Any] | None = None,
) -> Manifest:
    """Write the manifest that makes `step` exist (atomic on every backend); return it as read back."""
    done = commit_docs(storage, step, [w.to_json() for w in writes], skeleton, world_size, rank_state or {})
    assert done.manifest is not None
    return done.manifest


@dataclass(frozen=True)
class Committed:
    """What rank 0 gets back from committing a step (persist, persist_node_local)."""

    stored_bytes: int
    manifest_json: bytes
    manifest: Manifest | None = None  # as validated before it was written


def merge_write_docs(writes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One tensor entry per tensor, holding the shards every rank wrote of it.

    Works on the writes as reported (RankWrite.to_json() documents)."""
    merged: dict[str, dict[str, Any]] = {}
    for w in sorted(writes, key=lambda w: w["rank"]):
        for t in w["tensors"]:
            prev = merged.get(t["name"])
            if prev is None:
                merged[t["name"]] = {**t, "shards": list(t["shards"])}
            elif (prev["dtype"], prev["shape"], prev["kind"]) != (t["dtype"], t["shape"], t["kind"]):
                raise FtkitError(
                    f"ranks disagree about tensor {t['name']!r}: {prev['dtype']}{prev['shape']} "
                    f"vs {t['dtype']}{t['shape']}"
                )
            else:
                prev["shards"].extend(t["shards"])
    return list(merged.values())


def commit_docs(
    storage: Storage,
    step: int,
    writes: list[dict[str, Any]],
    skeleton: dict[str, Any],
    world_size: int,
    rank_state: dict[str, Any],
    present: set[str] | None = None,
) -> Committed:
    """commit() from the ranks' reports as they arrived: the manifest is assembled from
    the JSON documents, never rebuilt as dataclasses, then validated as any reader
    would validate it (the reports came through the store: untrusted) before it is
    written. `present`: the data files that must be in the step directory now (all,
    by default; a node-local tier holds only its node's), checked last, so a step
    whose data someone removed meanwhile is not committed."""
    rel = f"{step_dir_name(step)}/{MANIFEST_NAME}"
    if storage.exists(rel):
        raise AlreadyCommitted(f"{storage.where(rel)} already exists")
    try:
        files = {w["file"]: {"bytes": w["nbytes"], "rank": w["rank"]} for w in writes}
        tensors = merge_write_docs(writes)
    except (KeyError, TypeError, AttributeError) as e:  # reports that do not have the reports' shape
        raise FormatError(f"{storage.where(rel)}: a rank's report is malformed ({type(e).__name__}: {e})") from None
    data = manifest_json(step, world_size, tensors, skeleton, files, rank_state, time.time(), writer_info())
    manifest = manifest_from_json(data, storage.where(rel), step)
    check_files_present(
        storage, step, {f: info["bytes"] for f, info in files.items() if present is None or f in present}
    )
    storage.write_bytes_atomic(rel, data)
    return Committed(sum(w["nbytes"] for w in writes), data, manifest)


def check_files_present(storage: Storage, step: int, expected: dict[str, int]) -> None:
    """Every file of `expected` ({name: bytes}) is in the step directory at its size."""
    if not expected:
        return
    sizes = storage.list_sizes(step_dir_name(step))
    for name, nbytes in expected.items():
        if sizes.get(name) != nbytes:
            what = "is gone" if name not in sizes else f"is {sizes[name]} bytes, not {nbytes}"
            raise StorageError(
                f"step {step} not committed to {storage.display_url}: data file {name} {what} "
                "(removed or changed by someone else?)"
            )


def persist(
    storage: Storage,
    step: int,
    slot: Slot,
    skeleton: dict[str, Any],
    *,
    compress: str | None,
    pieces: Mapping[str, Piece] | None = None,
    rng: Any = None,
    ctx: DistContext | None = None,
    key: str = "",
    ledger: KeyLedger | None = None,
    at: tuple[int, int] = (0, 0),
) -> Committed | None:
    """Persist one step: every rank writes its data, rank 0 commits after all did.

    Ranks report to rank 0 through the store (`key`/rank): the file they wrote,
    or their error. Rank 0 commits only when every rank succeeded within the
    timeout; otherwise the step stays uncommitted (invisible) and its files are
    removed. Returns what was committed on rank 0, None elsewhere.

    Rank 0 deletes every report once it has read them. `ledger` (rank 0's) holds
    the reports of steps rank 0 skipped, which nobody read: they are deleted once
    this step's reports are all in, since each rank's persist thread takes its
    steps in order and so has sent those older reports first.
    """
    ctx = ctx or DistContext()
    write, error = write_share(storage, step, slot, pieces, compress, ctx.rank)
    fault_point("persist", step, ctx.rank)  # data written, not yet reported
    if ctx.distributed:
        ctx.put(
            f"{key}/{ctx.rank}",
            {"write": write.to_json() if write else None, "error": str(error) if error else None, "rng": rng},
        )
    if error is not None:
        raise error
    assert write is not None
    if ctx.rank != 0:
        return None
    writes, rank_state, failures = [write.to_json()], {"0": {"rng": rng}}, []
    with older_keys(ledger, at) as older:
        try:
            for r in range(1, ctx.world_size):
                doc = shared_report(r, ctx.get_raw(f"{key}/{r}"), ctx.world_size)
                if doc["error"]:
                    failures.append(f"rank {r}: {doc['error']}")
                else:
                    writes.append(doc["write"])
                    rank_state[str(r)] = {"rng": doc.get("rng")}
            delete_keys(ctx, older)
            if failures:
                raise StorageError(f"step {step} not committed to {storage.display_url}: {'; '.join(failures)}")
            fault_point("commit", step, 0)  # every share is durable, the manifest not yet written
            return commit_docs(storage, step, writes, skeleton, ctx.world_size, rank_state)
        except BaseException:
            discard(storage, step, [w["file"] for w in writes])
            raise
        finally:
            ctx.delete(*(f"{key}/{r}" for r in range(ctx.world_size)))


def writer_info() -> dict[str, Any]:
    import torch

    from ftkit import __version__

    return {"ftkit": __version__, "torch": torch.__version__, "host": socket.gethostname()}

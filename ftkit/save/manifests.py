"""A step's manifest, built from the ranks' reports of what they wrote and written last.

Two forms (FORMAT.md):

* **indexed** (version 3, shared tiers): each node's leader writes a part with its
  ranks' entries (`write_part`); rank 0 writes the index naming the parts
  (`commit_index`). Rank 0 handles one small record per node, whatever the
  number of tensors or ranks;
* **single document** (version 2, the RAM tier, where every node keeps a whole
  copy): rank 0 merges every rank's entries (`commit_docs`).

Reports are plain JSON documents (RankWrite.to_json()) that came through the
store or a node's board: untrusted. What is written is validated first, as a
reader would validate it, and the data files it names must be in place.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from typing import Any

from ftkit.errors import AlreadyCommitted, FormatError, FtkitError, StorageError
from ftkit.format.index import check_part, index_json, parse_index, part_file_name, part_json, part_ref
from ftkit.format.manifest import MANIFEST_NAME, Manifest, manifest_from_json, manifest_json, step_dir_name
from ftkit.save.write import RankWrite
from ftkit.tiers.storage import Storage


@dataclass(frozen=True)
class Committed:
    """What the committing rank gets back (persist, persist_node_local)."""

    stored_bytes: int
    manifest_json: bytes
    manifest: Manifest | None = None  # as validated before it was written (single document only)


def commit(
    storage: Storage,
    step: int,
    writes: list[RankWrite],
    skeleton: dict[str, Any],
    world_size: int = 1,
    rank_state: dict[str, Any] | None = None,
) -> Manifest:
    """Commit `step` from one process that wrote every rank's data (`ftkit reshard`): one
    part, then the index. Returns the manifest as a reader reads it back."""
    from ftkit.format.reader import load_manifest
    from ftkit.save.write import discard

    docs = [w.to_json() for w in writes]
    record = write_part(storage, step, docs, rank_state or {}, list(range(world_size)), world_size)
    try:
        commit_index(storage, step, world_size, [record], skeleton)
    except BaseException:
        discard(storage, step, [record["part"]["file"]])
        raise
    return load_manifest(storage, step)


def merge_write_docs(writes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One tensor entry per tensor, holding the shards every rank wrote of it."""
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


def _merged(writes: list[dict[str, Any]], where: str) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """(files, tensor entries) of the ranks' writes."""
    try:
        files = {w["file"]: {"bytes": w["nbytes"], "rank": w["rank"]} for w in writes}
        return files, merge_write_docs(writes)
    except (KeyError, TypeError, AttributeError) as e:  # reports that do not have the reports' shape
        raise FormatError(f"{where}: a rank's report is malformed ({type(e).__name__}: {e})") from None


def write_part(
    storage: Storage,
    step: int,
    writes: list[dict[str, Any]],
    rank_state: dict[str, Any],
    ranks: list[int],
    world_size: int,
) -> dict[str, Any]:
    """A node leader's share of the commit: its ranks' entries as one part file, checked
    and durable. Returns the node's record for rank 0: {"part": the index's entry for
    it, "files": {data file: bytes}, "stored": bytes, "errors": []}."""
    step_dir = step_dir_name(step)
    name = part_file_name(min(ranks))
    files, tensors = _merged(writes, storage.where(step_dir))
    data = part_json(step, ranks, files, tensors, rank_state)
    check_part(data, step, ranks, world_size, f"the part of ranks {ranks[0]}-{ranks[-1]} of step {step}")
    for f, info in files.items():  # one stat per file of this node, not a listing of every rank's
        try:
            size = storage.size(f"{step_dir}/{f}")
        except (StorageError, FileNotFoundError):
            size = None
        if size != info["bytes"]:
            what = "is gone" if size is None else f"is {size} bytes, not {info['bytes']}"
            raise StorageError(f"step {step} not committed to {storage.display_url}: data file {f} {what}")
    storage.write_bytes_atomic(f"{step_dir}/{name}", data)
    stored = sum(info["bytes"] for info in files.values())
    return {"part": part_ref(name, data, ranks), "files": {f: i["bytes"] for f, i in files.items()}, "stored": stored}


def commit_index(
    storage: Storage, step: int, world_size: int, records: list[dict[str, Any]], skeleton: dict[str, Any]
) -> Committed:
    """Rank 0's share: the index naming every node's part, written last (the commit).
    `records` are write_part()'s, one per node, validated by the caller's protocol."""
    rel = f"{step_dir_name(step)}/{MANIFEST_NAME}"
    if storage.exists(rel):
        raise AlreadyCommitted(f"{storage.where(rel)} already exists")
    parts = sorted((r["part"] for r in records), key=lambda p: p["ranks"][0][0])
    data = index_json(step, world_size, parts, skeleton, time.time(), writer_info())
    parse_index(json.loads(data), storage.where(rel), step)
    check_files_present(storage, step, {p["file"]: p["bytes"] for p in parts})
    storage.write_bytes_atomic(rel, data)
    return Committed(sum(r["stored"] for r in records), data)


def commit_docs(
    storage: Storage,
    step: int,
    writes: list[dict[str, Any]],
    skeleton: dict[str, Any],
    world_size: int,
    rank_state: dict[str, Any],
    present: set[str] | None = None,
) -> Committed:
    """A single-document manifest from the ranks' reports as they arrived: assembled
    from the JSON documents, never rebuilt as dataclasses, then validated as any
    reader would validate it before it is written. `present`: the data files that
    must be in the step directory now (all, by default; a node-local tier holds only
    its node's), checked last, so a step whose data someone removed meanwhile is not
    committed."""
    rel = f"{step_dir_name(step)}/{MANIFEST_NAME}"
    if storage.exists(rel):
        raise AlreadyCommitted(f"{storage.where(rel)} already exists")
    files, tensors = _merged(writes, storage.where(rel))
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
    sizes = storage.list_sizes(step_dir_name(step), list(expected))
    for name, nbytes in expected.items():
        if sizes.get(name) != nbytes:
            what = "is gone" if name not in sizes else f"is {sizes[name]} bytes, not {nbytes}"
            raise StorageError(
                f"step {step} not committed to {storage.display_url}: file {name} {what} "
                "(removed or changed by someone else?)"
            )


def writer_info() -> dict[str, Any]:
    import torch

    from ftkit import __version__

    return {"ftkit": __version__, "torch": torch.__version__, "host": socket.gethostname()}

"""A step's manifest (format version 4, FORMAT.md): each node's part (`store_part`), then
rank 0's index naming them (`commit_index`), written last. What is written is validated
first, as a reader would, and the data files it names must be in place."""

from __future__ import annotations

import contextlib
import functools
import json
import socket
import time
from dataclasses import dataclass
from typing import Any

from ftkit.commit.messages import PartEntry, Record, Report, Written
from ftkit.errors import AlreadyCommitted, StorageError
from ftkit.format.index import encode_index, index_doc, parse_index, part_ref
from ftkit.format.manifest import MANIFEST_NAME, Manifest, step_dir_name
from ftkit.save.write import RankWrite
from ftkit.tiers.storage import Storage


@dataclass(frozen=True)
class Committed:
    """What the committing rank gets back (persist, persist_node_local)."""

    stored_bytes: int
    manifest_json: bytes


def commit(
    storage: Storage,
    step: int,
    writes: list[RankWrite],
    skeleton: dict[str, Any],
    world_size: int = 1,
    rank_state: dict[str, Any] | None = None,
    writer_extra: dict[str, Any] | None = None,
) -> Manifest:
    """Commit `step` from one process that wrote every rank's data (`ftkit reshard`): one part,
    then the index; returns the manifest as read back. `writer_extra`: kept in the index's
    "writer" field beside ftkit's own (a DCP-written step's planner data)."""
    from ftkit.commit.layouts import layout_of
    from ftkit.commit.memo import CommitMemo
    from ftkit.commit.parts import build_part
    from ftkit.commit.reports import RankReport
    from ftkit.format.reader import load_manifest
    from ftkit.save.write import discard

    memo, by_rank = CommitMemo(), {w.rank: w for w in writes}
    states = rank_state or {}
    reports = []
    for r in range(world_size):
        if r in by_rank:
            layout, report = layout_of(by_rank[r], memo, states.get(str(r)))
            reports.append(RankReport(r, report, layout))
        else:
            reports.append(RankReport(r, Report(None, state=json.dumps(states.get(str(r), {})))))
    name, data, files = build_part(step, reports, world_size, memo)
    written = store_part(storage, step, name, data, files, list(range(world_size)))
    try:
        record = Record(written.part, written.files, written.stored)
        commit_index(storage, step, world_size, [record], skeleton, writer_extra=writer_extra)
    except BaseException:
        discard(storage, step, [written.part.file])
        raise
    return load_manifest(storage, step)


def store_part(storage: Storage, step: int, name: str, data: bytes, files: dict[str, int], ranks: list[int]) -> Written:
    """Write a built part once its node's data files ({name: size}) are in place."""
    check_files_present(storage, step, files, one_by_one=True)
    storage.write_bytes_atomic(f"{step_dir_name(step)}/{name}", data)
    return Written(PartEntry.of(part_ref(name, data, ranks)), dict(files), sum(files.values()))


def commit_index(
    storage: Storage,
    step: int,
    world_size: int,
    records: list[Record],
    skeleton: dict[str, Any],
    local_parts: set[str] | None = None,
    writer_extra: dict[str, Any] | None = None,
) -> Committed:
    """Rank 0's share: the index naming every node's part (`records`, one per node, validated),
    written last. `local_parts`: the parts that must be in the step directory (default all)."""
    rel = f"{step_dir_name(step)}/{MANIFEST_NAME}"
    if storage.exists(rel):
        raise AlreadyCommitted(f"{storage.where(rel)} already exists")
    parts = sorted((r.part.doc() for r in records if r.part is not None), key=lambda p: p["ranks"][0][0])
    doc = index_doc(step, world_size, parts, skeleton, time.time(), {**(writer_extra or {}), **writer_info()})
    parse_index(doc, storage.where(rel), step)
    data = encode_index(doc)
    local = [p for p in parts if local_parts is None or p["file"] in local_parts]
    check_files_present(storage, step, {p["file"]: p["bytes"] for p in local})
    storage.write_bytes_atomic(rel, data)
    return Committed(sum(r.stored for r in records), data)


def check_files_present(storage: Storage, step: int, expected: dict[str, int], one_by_one: bool = False) -> None:
    """Every file of `expected` ({name: bytes}) is in the step directory at its size: listed,
    or `one_by_one` a stat each on an object store (a node's few files in a large directory)."""
    step_dir, sizes = step_dir_name(step), {}
    if one_by_one and not storage.is_local:
        for name in expected:
            with contextlib.suppress(StorageError, FileNotFoundError):
                sizes[name] = storage.size(f"{step_dir}/{name}")
    elif expected:
        sizes = storage.list_sizes(step_dir, list(expected))
    for name, nbytes in expected.items():
        if sizes.get(name) != nbytes:
            what = "is gone" if name not in sizes else f"is {sizes[name]} bytes, not {nbytes}"
            raise StorageError(
                f"step {step} not committed to {storage.display_url}: file {name} {what} "
                "(removed or changed by someone else?)"
            )


@functools.cache
def writer_info() -> dict[str, Any]:
    """Who wrote a manifest (its "writer" field): the same for the whole process (kept: not to be changed)."""
    import torch

    from ftkit import __version__

    return {"ftkit": __version__, "torch": torch.__version__, "host": socket.gethostname()}

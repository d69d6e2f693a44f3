"""A step's manifest, built from the ranks' reports of what they wrote and written last.

Format version 3 on every tier (FORMAT.md): each node's leader writes a part with
its ranks' entries (`write_part`, or `build_part` then `store_part`); rank 0
writes the index naming the parts (`commit_index`). Rank 0 handles one small
record per node, whatever the number of tensors or ranks.

Reports are plain JSON documents (RankWrite.to_json()) that came through the
store or a node's board: untrusted. What is written is validated first, as a
reader would validate it, and the data files it names must be in place.
"""

from __future__ import annotations

import functools
import socket
import time
from dataclasses import dataclass
from typing import Any

from ftkit.commit.index_text import encode_index_reusing
from ftkit.commit.memo import Lru
from ftkit.commit.messages import PartEntry, Record, Written
from ftkit.errors import AlreadyCommitted, FormatError, FtkitError, StorageError
from ftkit.format.index import LayoutMemo, check_part, index_doc, parse_index, part_file_name, part_json, part_ref
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
    """Commit `step` from one process that wrote every rank's data (`ftkit reshard`): one
    part, then the index. `writer_extra`: records kept in the index's "writer" field beside
    ftkit's own (a DCP-written step's planner data, carried across a reshard). Returns the
    manifest as a reader reads it back."""
    from ftkit.format.reader import load_manifest
    from ftkit.save.write import discard

    docs = [w.to_json() for w in writes]
    written = write_part(storage, step, docs, rank_state or {}, list(range(world_size)), world_size)
    try:
        record = Record(written.part, written.files, written.stored)
        commit_index(storage, step, world_size, [record], skeleton, writer_extra=writer_extra)
    except BaseException:
        discard(storage, step, [written.part.file])
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


def files_and_tensors(
    writes: list[dict[str, Any]], where: str
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
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
    checked: LayoutMemo | None = None,
) -> Written:
    """A node leader's share of the commit: its ranks' entries as one part file, checked
    and durable. `checked`: the part layouts the tier has validated (CommitMemo.checked_parts)."""
    name, data, files = build_part(storage, step, writes, rank_state, ranks, world_size, checked)
    return store_part(storage, step, name, data, files, ranks)


def build_part(
    storage: Storage,
    step: int,
    writes: list[dict[str, Any]],
    rank_state: dict[str, Any],
    ranks: list[int],
    world_size: int,
    checked: LayoutMemo | None = None,
) -> tuple[str, bytes, dict[str, dict[str, Any]]]:
    """(its file name, its bytes, {data file: info}) of a node's part, checked as a reader
    checks one part alone."""
    files, tensors = files_and_tensors(writes, storage.where(step_dir_name(step)))
    data = part_json(step, ranks, files, tensors, rank_state)
    where = f"the part of ranks {ranks[0]}-{ranks[-1]} of step {step}"
    check_part(data, step, ranks, world_size, where, checked)
    return part_file_name(min(ranks)), data, files


def store_part(
    storage: Storage, step: int, name: str, data: bytes, files: dict[str, dict[str, Any]], ranks: list[int]
) -> Written:
    """Write a built part once its node's data files are in place: the index's entry for it,
    the node's data files and their sizes, the bytes stored."""
    step_dir = step_dir_name(step)
    sizes = _sizes(storage, step_dir, list(files))
    for f, info in files.items():
        size = sizes.get(f)
        if size != info["bytes"]:
            what = "is gone" if size is None else f"is {size} bytes, not {info['bytes']}"
            raise StorageError(f"step {step} not committed to {storage.display_url}: data file {f} {what}")
    storage.write_bytes_atomic(f"{step_dir}/{name}", data)
    stored = sum(info["bytes"] for info in files.values())
    return Written(PartEntry.of(part_ref(name, data, ranks)), {f: i["bytes"] for f, i in files.items()}, stored)


def _sizes(storage: Storage, step_dir: str, names: list[str]) -> dict[str, int]:
    """{name: bytes} of `names` in the step directory, those there: one stat per file of
    this node, not a listing of every rank's (locally one call for them all)."""
    if storage.is_local:
        return storage.list_sizes(step_dir, names)
    out = {}
    for f in names:
        try:
            out[f] = storage.size(f"{step_dir}/{f}")
        except (StorageError, FileNotFoundError):
            pass
    return out


def commit_index(
    storage: Storage,
    step: int,
    world_size: int,
    records: list[Record],
    skeleton: dict[str, Any],
    local_parts: set[str] | None = None,
    writer_extra: dict[str, Any] | None = None,
    texts: Lru[bytes, str] | None = None,
) -> Committed:
    """Rank 0's share: the index naming every node's part, written last (the commit).
    `records`: one per node, each naming its part, validated by the caller's protocol.
    `local_parts`: the parts that must be in the step directory now (all, by default;
    a node of the RAM tier holds only its own and its replica sources'). `texts`: the index
    texts of the steps before (CommitMemo.index_texts; commit/index_text.py)."""
    rel = f"{step_dir_name(step)}/{MANIFEST_NAME}"
    if storage.exists(rel):
        raise AlreadyCommitted(f"{storage.where(rel)} already exists")
    parts = sorted((r.part.doc() for r in records if r.part is not None), key=lambda p: p["ranks"][0][0])
    doc = index_doc(step, world_size, parts, skeleton, time.time(), {**(writer_extra or {}), **writer_info()})
    parse_index(doc, storage.where(rel), step)  # (its parts came from records checked one by one)
    data = encode_index_reusing(doc, texts if texts is not None else Lru(16))
    check_files_present(
        storage, step, {p["file"]: p["bytes"] for p in parts if local_parts is None or p["file"] in local_parts}
    )
    storage.write_bytes_atomic(rel, data)
    return Committed(sum(r.stored for r in records), data)


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
    """Who wrote a manifest (its "writer" field): the same for the whole process."""
    return dict(_writer_info())


@functools.cache
def _writer_info() -> tuple[tuple[str, str], ...]:
    import torch

    from ftkit import __version__

    return (("ftkit", __version__), ("torch", torch.__version__), ("host", socket.gethostname()))

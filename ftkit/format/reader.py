"""Find and load checkpoints on one tier: which steps exist, and their manifests.

A step exists only if its manifest (its index and every part it names) parses and
validates. Reading a step's data is data.py's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ftkit.errors import CheckpointNotFoundError, CorruptCheckpointError, FormatError
from ftkit.format.index import (
    FIRST_INDEX_VERSION,
    MAX_MANIFEST_BYTES,
    MAX_PART_BYTES,
    Index,
    PartRef,
    assemble,
    check_part_bytes,
    parse_index,
)
from ftkit.format.manifest import (
    MANIFEST_NAME,
    RETIRED_MANIFEST,
    Manifest,
    parse_step_dir,
    step_dir_name,
)
from ftkit.format.store import StepStore as Storage
from ftkit.format.validate import parse_header, parse_manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepDir:
    step: int
    # "committed" (a manifest that is a regular file, not yet validated), "partial" (no manifest),
    # "retired" (lifecycle.py), "empty" (not a step), "link" (never followed) or "bad"
    # (manifest.json is no regular file)
    status: str = "committed"

    @property
    def committed(self) -> bool:
        return self.status == "committed"


def scan(storage: Storage, include_empty: bool = False) -> list[StepDir]:
    """Every step directory under the root, oldest first; an empty one (or an object store's
    empty prefix) is not a step: left out unless `include_empty`."""
    out = []
    for name, kind in storage.list_dir():
        step = parse_step_dir(name)
        if step is None or kind not in ("directory", "link"):
            continue
        entries = dict(storage.list_dir(name)) if kind == "directory" else {}
        if kind == "link":
            status = "link"
        elif not entries:
            status = "empty"
        elif MANIFEST_NAME in entries:
            status = "committed" if entries[MANIFEST_NAME] == "file" else "bad"
        else:
            status = "retired" if RETIRED_MANIFEST in entries else "partial"
        if status != "empty" or include_empty:
            out.append(StepDir(step, status))
    return sorted(out, key=lambda s: s.step)


def committed_steps(storage: Storage) -> list[int]:
    return [s.step for s in scan(storage) if s.committed]


def load_manifest(storage: Storage, step: int) -> Manifest:
    """The validated manifest of `step`: a single document, or an index with its parts assembled."""
    return manifest_from(storage, step, *load_index(storage, step))


def load_index(storage: Storage, step: int) -> tuple[bytes, Index | None]:
    """The bytes of `step`'s manifest.json and its index, validated (None: a single document,
    validated later by parse_manifest)."""
    step_dir = step_dir_name(step)
    rel = f"{step_dir}/{MANIFEST_NAME}"
    if storage.is_link(step_dir):
        raise FormatError(f"{storage.where(step_dir)} is a symbolic link; ftkit does not follow links in a tier")
    try:
        data = read_metadata(storage, rel, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{storage.where(step_dir)}: no manifest (step {step} is not committed)"
        ) from None
    return data, parse_manifest_header(data, storage.where(rel), step)


def parse_manifest_header(data: bytes, where: str, step: int) -> Index | None:
    """The index of a manifest.json of version 3 or 4, validated; None for a single document."""
    doc, version = parse_header(data, where)
    return parse_index(doc, where, expect_step=step) if version >= FIRST_INDEX_VERSION else None


def manifest_from(
    storage: Storage, step: int, data: bytes, index: Index | None, sent: Mapping[str, bytes] | None = None
) -> Manifest:
    """The manifest whose manifest.json is `data` (`index`: as parsed from it); the index's
    parts are taken from `sent` (other nodes', at a RAM-tier restore) or read from the step
    directory, each checked against its size and checksum before it is parsed."""
    where = storage.where(f"{step_dir_name(step)}/{MANIFEST_NAME}")
    if index is None:
        return parse_manifest(data, where, expect_step=step)
    sent = sent or {}
    local = [ref for ref in index.parts if ref.file not in sent]
    missing = missing_parts(storage, step, local)
    if missing:
        name, why = missing[0]
        raise FormatError(f"{storage.where(f'{step_dir_name(step)}/{name}')}: manifest part {why}")
    read = dict(zip((ref.file for ref in local), read_parts(storage, step, local), strict=True))
    for ref in index.parts:
        if ref.file in sent:
            check_part_bytes(ref, sent[ref.file], f"{where}: part {ref.file} (sent by another node)")
    return assemble(index, [sent[r.file] if r.file in sent else read[r.file] for r in index.parts], where)


def missing_parts(storage: Storage, step: int, refs: Sequence[PartRef]) -> list[tuple[str, str]]:
    """(file, what is wrong) of each part of `refs` not in the step directory at its size."""
    if not refs:
        return []
    sizes = storage.list_sizes(step_dir_name(step))  # regular files only: a part that is a link is missing
    return [
        (ref.file, "is missing" if ref.file not in sizes else f"is {sizes[ref.file]} bytes, not {ref.nbytes}")
        for ref in refs
        if sizes.get(ref.file) != ref.nbytes
    ]


def read_parts(storage: Storage, step: int, refs) -> list[bytes]:
    """The bytes of the parts `refs`, each checked against its size and checksum."""
    if len(refs) <= 2:
        return [read_part(storage, step, ref) for ref in refs]
    with ThreadPoolExecutor(min(16, len(refs))) as pool:  # an object store answers many reads at once
        return list(pool.map(lambda ref: read_part(storage, step, ref), refs))


def read_part(storage: Storage, step: int, ref: PartRef) -> bytes:
    rel = f"{step_dir_name(step)}/{ref.file}"
    try:
        part = read_metadata(storage, rel, min(ref.nbytes, MAX_PART_BYTES))
    except FileNotFoundError:
        raise FormatError(f"{storage.where(rel)}: manifest part is missing") from None
    try:
        check_part_bytes(ref, part, storage.where(rel))
    except CorruptCheckpointError as e:
        raise FormatError(str(e)) from None
    return part


def read_metadata(storage: Storage, rel: str, max_bytes: int) -> bytes:
    """The bytes of a manifest.json or part; FormatError, before reading, when there are more
    than `max_bytes` or, on a local filesystem, when the file has holes (JSON never has one:
    a crafted sparse file would cost its size in memory to find out)."""
    where = storage.where(rel)
    with storage.open_read(rel) as f:
        # (an object store's file knows its size before any read)
        size = os.fstat(f.fileno()).st_size if storage.is_local else getattr(f, "size", None)
        if size is not None and size > max_bytes:
            raise FormatError(f"{where}: {size} bytes, more than any manifest ftkit writes ({max_bytes})")
        if storage.is_local and size:
            try:
                hole = os.lseek(f.fileno(), 0, os.SEEK_HOLE)
            except OSError:  # (a filesystem without SEEK_HOLE: no holes reported)
                hole = size
            if hole < size:
                raise FormatError(f"{where}: a sparse file (a hole at byte {hole} of {size}); ftkit never writes one")
            os.lseek(f.fileno(), 0, os.SEEK_SET)
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise FormatError(f"{where}: more than {max_bytes} bytes, more than any manifest ftkit writes")
    return bytes(data)


def newest_manifest(storage: Storage, step: int | None = None) -> Manifest:
    """The manifest of `step`, or of the newest committed step."""
    if step is not None:
        return load_manifest(storage, step)
    steps = committed_steps(storage)
    if not steps:
        raise CheckpointNotFoundError(f"{storage.display_url}: no checkpoint found")
    return load_manifest(storage, steps[-1])

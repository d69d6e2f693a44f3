"""The on-storage checkpoint format's dataclasses and encoding: pure data, no I/O.

A step directory holds data files and manifest.json, written last: its presence commits
the step. FORMAT.md documents the manifest field by field; validate.py is the one place
that decodes it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from typing import Any

FORMAT_NAME = "ftkit-checkpoint"
# 2: Python's RNG state as a tensor; 3: an index of per-node parts (index.py); 4: each part
# as three JSON lines (part.py), what every tier writes. Every older version is still read.
FORMAT_VERSION = 4
SINGLE_DOC_VERSION = 2
MANIFEST_NAME = "manifest.json"
RETIRED_MANIFEST = "manifest.retired.json"  # a step superseded by a restore of an older one (tiers/lifecycle.py)
# ASCII digits and no trailing newline: a look-alike directory (an Arabic-Indic digit, a name
# ending in "\n") read as step 3 made gc delete the real step 3 for it.
STEP_DIR_RE = re.compile(r"^step-([0-9]{12})\Z")
# Data files are plain names inside their step directory: no separators, no "..".
SAFE_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}\Z")

CODECS = ("raw", "zstd")
ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
DTYPES = tuple(ITEMSIZE)  # the names a manifest may give a tensor's dtype
KINDS = ("replicated", "sharded", "rank-local")


def step_dir_name(step: int) -> str:
    return f"step-{step:012d}"


def parse_step_dir(name: str) -> int | None:
    m = STEP_DIR_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True, slots=True)  # no __dict__: one object a piece (thousands a snapshot)
class Chunk:
    """A run of a shard's bytes stored in one file, checksummed as stored."""

    file: str
    offset: int  # byte offset in `file`
    length: int  # stored bytes
    raw_offset: int  # offset of these bytes within the shard's raw bytes
    raw_length: int  # bytes after decoding
    codec: str  # "raw" or "zstd"
    checksum: str  # "xxh3_64:<hex>" over the stored bytes


def chunk_doc(c: Chunk) -> dict[str, Any]:
    """A chunk as the manifest stores it: its fields, in order."""
    return {f.name: getattr(c, f.name) for f in fields(Chunk)}


@dataclass(frozen=True, slots=True)
class Shard:
    """A rectangular region of a tensor, stored row-major."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    rank: int = 0  # the rank that wrote it


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]  # global shape
    shards: tuple[Shard, ...]
    kind: str = "replicated"  # "replicated", "sharded" (DTensor) or "rank-local" (RNG)


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    tensors: tuple[TensorEntry, ...]
    skeleton: dict[str, Any]
    files: dict[str, dict[str, Any]]  # file name -> {"bytes": n, "rank": r}
    rank_state: dict[str, Any] = field(default_factory=dict)  # str(rank) -> {"rng": ..., "local": {...}}
    created_at: float = 0.0
    writer: dict[str, Any] = field(default_factory=dict)
    format_version: int = SINGLE_DOC_VERSION
    parts: dict[str, dict[str, Any]] = field(default_factory=dict)  # versions 3-4: part file -> {"bytes", "checksum"}

    @property
    def total_raw_bytes(self) -> int:
        return sum(c.raw_length for t in self.tensors for s in t.shards for c in s.chunks)

    @property
    def total_stored_bytes(self) -> int:
        return sum(c.length for t in self.tensors for s in t.shards for c in s.chunks)

    def tensor(self, name: str) -> TensorEntry:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


def tensor_entry_doc(t: TensorEntry) -> dict[str, Any]:
    """A tensor entry as plain JSON types (hand-written: asdict deep-copies, much slower)."""
    return {
        "name": t.name,
        "dtype": t.dtype,
        "shape": list(t.shape),
        "kind": t.kind,
        "shards": [
            {
                "offsets": list(s.offsets),
                "lengths": list(s.lengths),
                "rank": s.rank,
                "chunks": [chunk_doc(c) for c in s.chunks],
            }
            for s in t.shards
        ],
    }


def manifest_json(
    step: int,
    world_size: int,
    tensor_docs: list[dict[str, Any]],
    skeleton: dict[str, Any],
    files: dict[str, dict[str, Any]],
    rank_state: dict[str, Any],
    created_at: float,
    writer: dict[str, Any],
) -> bytes:
    """A single-document manifest's bytes, the tensors already as tensor_entry_doc()s."""
    # Identifying fields first, so the first bytes of the file say what it is.
    doc = {
        "format": FORMAT_NAME,
        "format_version": SINGLE_DOC_VERSION,
        "step": step,
        "world_size": world_size,
        "tensors": tensor_docs,
        "skeleton": skeleton,
        "files": files,
        "rank_state": rank_state,
        "created_at": created_at,
        "writer": writer,
    }
    return encode_json(doc)


def encode_json(doc: Any) -> bytes:
    """A document as ftkit writes JSON: compact, no NaN or Infinity."""
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()

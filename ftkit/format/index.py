"""Format versions 3 and 4: a step's manifest as a small index plus one part per node.

Each node's leader writes its ranks' tensor entries, files and RNG state as a part;
manifest.json, written last, is the index: the skeleton and, per part, its size,
checksum and ranks, so rank 0 never rewrites every rank's entries. A reader checks
each part's size and checksum before parsing it and validates the assembled manifest
as a version-2 one (validate.py), so FORMAT.md's invariants hold across parts. A part
may describe only its own ranks. Version-3 parts are one JSON document, version-4
parts (what is written) three JSON lines (part.py).
"""

from __future__ import annotations

import bisect
import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any

from ftkit.errors import FormatError
from ftkit.format import codec
from ftkit.format.manifest import FORMAT_NAME, Manifest, encode_json
from ftkit.format.part import PART_FORMAT, PART_VERSION, decode_part, rank_runs
from ftkit.format.skeleton_values import check_rank_state
from ftkit.format.tiling import check_no_shared_bytes
from ftkit.format.validate import (
    CHECKSUM_RE,
    MAX_STEP,
    MAX_WORLD,
    _files,
    _int,
    _list,
    check_file_name,
    manifest_from_doc,
    parse_json,
    rank_key,
    tensor_entry,
)

FIRST_INDEX_VERSION = 3  # manifest.json is an index of parts from this version on
INDEX_VERSION = PART_VERSION  # the version written
# No real writer makes a part or a manifest near this size: larger files are refused unread.
MAX_PART_BYTES = 2**30
MAX_MANIFEST_BYTES = 2**30


def part_file_name(first_rank: int) -> str:
    """A part's file name: its node's first rank and a random token (never reused)."""
    return f"part-{first_rank:05d}-{uuid.uuid4().hex[:8]}.json"


def is_part_file(name: str) -> bool:
    return name.startswith("part-") and name.endswith(".json")


def part_ref(name: str, data: bytes, ranks: list[int]) -> dict[str, Any]:
    """The index's entry for a part written as `data`."""
    return {"file": name, "bytes": len(data), "checksum": codec.checksum(data), "ranks": rank_runs(ranks)}


encode_index = encode_json


def index_doc(
    step: int,
    world_size: int,
    parts: list[dict[str, Any]],
    skeleton: dict[str, Any],
    created_at: float,
    writer: dict[str, Any],
) -> dict[str, Any]:
    return {
        "format": FORMAT_NAME,
        "format_version": INDEX_VERSION,
        "step": step,
        "world_size": world_size,
        "parts": parts,
        "skeleton": skeleton,
        "created_at": created_at,
        "writer": writer,
    }


@dataclass(frozen=True)
class PartRef:
    file: str
    nbytes: int
    checksum: str
    runs: tuple[tuple[int, int], ...]  # its ranks as sorted [start, stop) runs, neighbours merged

    def holds(self, rank: Any) -> bool:
        """Whether `rank` is one of this part's (by its runs: a set of 2**24 ranks costs GBs)."""
        if type(rank) is not int:
            return False
        i = bisect.bisect_right(self.runs, (rank, MAX_WORLD + 1)) - 1
        return i >= 0 and rank < self.runs[i][1]


@dataclass(frozen=True)
class Index:
    step: int
    world_size: int
    parts: tuple[PartRef, ...]
    doc: dict[str, Any]  # the index as parsed (skeleton, created_at, writer: validated on assembly)


def parse_index(doc: Any, where: str, expect_step: int | None = None) -> Index:
    """An index of version 3 or 4 (format and version already checked): its parts are plain file
    names, with sizes, checksums, and ranks that cover the world exactly once."""
    try:
        step = _int(doc.get("step"), "step", 0, MAX_STEP)
        world = _int(doc.get("world_size"), "world_size", 1, MAX_WORLD)
        listed: list[tuple[str, int, str, list[tuple[int, int]]]] = []
        names: set[str] = set()
        for p in _list(doc.get("parts"), "parts"):
            if not isinstance(p, dict):
                raise FormatError("a part entry is not an object")
            name = check_file_name(p.get("file"))
            if not name.endswith(".json") or name in names:
                raise FormatError(f"part {name!r} is not a .json file or is listed twice")
            names.add(name)
            nbytes = _int(p.get("bytes"), f"byte count of part {name!r}", 1, MAX_PART_BYTES)
            checksum = p.get("checksum")
            if not isinstance(checksum, str) or not CHECKSUM_RE.match(checksum):
                raise FormatError(f"part {name!r} has no valid checksum")
            listed.append((name, nbytes, checksum, _runs(p.get("ranks"), world, f"part {name!r}")))
        # Every rank in exactly one part, checked on the runs before any set of ranks is built:
        # a few hundred crafted bytes could otherwise claim 2**24 ranks per part, GBs each.
        at = 0
        for start, stop in sorted(run for *_, runs in listed for run in runs):
            if start != at:
                raise FormatError(f"the parts do not hold every one of the {world} ranks exactly once")
            at = stop
        if at != world:
            raise FormatError(f"the parts do not hold every one of the {world} ranks exactly once")
        refs = tuple(PartRef(n, b, c, _merged(runs) or ()) for n, b, c, runs in listed)  # (disjoint: above)
    except FormatError as e:
        raise FormatError(f"{where}: {e}") from None
    if expect_step is not None and step != expect_step:
        raise FormatError(f"{where}: manifest says step {step}, directory says {expect_step}")
    return Index(step, world, refs, doc)


def _merged(runs: list[tuple[int, int]]) -> tuple[tuple[int, int], ...] | None:
    """Runs sorted, neighbours joined: two lists of runs hold the same ranks when these are
    equal. None when two runs overlap."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted(runs):
        if out and start < out[-1][1]:
            return None
        if out and start == out[-1][1]:
            out[-1] = (out[-1][0], stop)
        else:
            out.append((start, stop))
    return tuple(out)


def _runs(runs: Any, world: int, what: str) -> list[tuple[int, int]]:
    """A part's ranks as [start, stop) runs within the world, checked; not yet for overlap."""
    out = []
    for run in _list(runs, f"the ranks of {what}"):
        if not isinstance(run, list) or len(run) != 2:
            raise FormatError(f"the ranks of {what} are not [start, stop) pairs")
        start = _int(run[0], f"a rank of {what}", 0, world - 1)
        out.append((start, _int(run[1], f"a rank of {what}", start + 1, world)))
    if not out:
        raise FormatError(f"{what} holds no rank")
    return out


def parse_part(data: bytes, version: int, where: str) -> Any:
    """A part's document as its index's `version` has it (3: one JSON document; 4: three
    lines, decoded to the same dict), not yet validated; FormatError naming `where`."""
    return decode_part(data, where) if version >= PART_VERSION else parse_json(data, where, "part")


def check_part_bytes(ref: PartRef, data: bytes, where: str) -> None:
    if len(data) != ref.nbytes:
        raise FormatError(f"{where}: part is {len(data)} bytes, the index says {ref.nbytes}")
    codec.check(memoryview(data), ref.checksum, where)


def assemble(index: Index, parts: list[bytes], where: str) -> Manifest:
    """The step's manifest from its index and its parts' bytes (in the index's order, each
    already checked by check_part_bytes), validated as a whole like a version-2 manifest."""
    files: dict[str, dict[str, Any]] = {}
    tensors: dict[str, dict[str, Any]] = {}
    rank_state: dict[str, Any] = {}
    version = index.doc.get("format_version", FIRST_INDEX_VERSION)
    for ref, data in zip(index.parts, parts, strict=True):
        pwhere = f"{where}: part {ref.file}"
        doc = parse_part(data, version, pwhere)
        try:
            _merge_part(doc, ref, index, files, tensors, rank_state)
        except FormatError as e:
            raise FormatError(f"{pwhere}: {e}") from None
    whole = {**index.doc, "tensors": list(tensors.values()), "files": files, "rank_state": rank_state}
    try:
        m = manifest_from_doc(whole)
    except FormatError as e:
        raise FormatError(f"{where}: {e}") from None
    refs = {r.file: {"bytes": r.nbytes, "checksum": r.checksum} for r in index.parts}
    return dataclasses.replace(m, parts=refs)


def _merge_part(doc: Any, ref: PartRef, index: Index, files: dict, tensors: dict, rank_state: dict) -> None:
    """Add one part's files, tensor shards and RNG state; a part speaks only for its ranks."""
    if not isinstance(doc, dict) or doc.get("format") != PART_FORMAT:
        raise FormatError("not an ftkit manifest part")
    runs = _runs(doc.get("ranks"), index.world_size, "the part")
    if doc.get("step") != index.step or _merged(runs) != ref.runs:
        raise FormatError("its step or ranks differ from the index's")
    part_files = doc.get("files")
    if not isinstance(part_files, dict):
        raise FormatError("'files' must be an object")
    for name, info in part_files.items():
        if name in files:
            raise FormatError(f"file {str(name)[:80]!r} is listed by two parts")
        if not isinstance(info, dict) or not _own(info.get("rank", 0), ref):
            raise FormatError(f"file {str(name)[:80]!r} belongs to a rank of another part")
        files[name] = info
    for t in _list(doc.get("tensors"), "tensors"):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise FormatError("a tensor entry is not an object with a name")
        shards = _list(t.get("shards"), f"the shards of tensor {t['name'][:80]!r}")
        if any(not isinstance(s, dict) or not _own(s.get("rank", 0), ref) for s in shards):
            raise FormatError(f"a shard of tensor {t['name'][:80]!r} belongs to a rank of another part")
        prev = tensors.get(t["name"])
        if prev is None:
            tensors[t["name"]] = {**t, "shards": list(shards)}
        elif any(prev.get(k) != t.get(k) for k in ("dtype", "shape", "kind")):
            raise FormatError(f"tensor {t['name'][:80]!r} has another dtype, shape or kind than in an earlier part")
        else:
            prev["shards"].extend(shards)
    states = doc.get("rank_state", {})
    if not isinstance(states, dict):
        raise FormatError("'rank_state' must be an object")
    for r, st in states.items():
        if not ref.holds(rank_key(r)):
            raise FormatError(f"rank_state has an entry for rank {str(r)[:20]!r} of another part")
        rank_state[r] = st


def check_part(data: bytes, step: int, ranks: list[int], world_size: int, where: str) -> None:
    """Everything a reader checks of one (version-4) part alone: what a node's collector checks
    of its ranks' untrusted reports before writing. The tiling across parts is checked on assembly."""
    ref = PartRef("", len(data), "", _merged([(r, r + 1) for r in set(ranks)]) or ())
    index = Index(step, world_size, (ref,), {})
    files: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    states: dict[str, Any] = {}
    try:
        _merge_part(parse_part(data, PART_VERSION, where), ref, index, files, tensors, states)
        checked = _files(files, world_size)
        entries = [tensor_entry(t, checked, world_size, whole=False) for t in tensors.values()]
        check_no_shared_bytes(entries)
        for r, st in states.items():
            own = {t.name for t in entries if t.kind == "rank-local" and t.name.startswith(f"_rng/r{r}/")}
            if not isinstance(st, dict):
                raise FormatError(f"rank_state of rank {r} is not an object")
            check_rank_state(st, own, f"rank_state of rank {r}")
    except FormatError as e:
        raise FormatError(f"{where}: {e}") from None


def _own(rank: Any, ref: PartRef) -> bool:
    return ref.holds(rank)

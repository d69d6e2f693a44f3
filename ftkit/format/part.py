"""Format version 4: a manifest part as three JSON lines, its layout apart from its values.

    {"format":"ftkit-checkpoint-part","format_version":4,"step":120,"ranks":[[0,4]]}      the head
    {"tensors":[{"name":...,"shards":[{...,"chunks":[{"raw_offset":0,"raw_length":n}]}]}]}  the layout
    {"files":[[name,bytes,rank]],"chunks":[[file,offset,length,codec,checksum]],"rank_state":{...}}

The layout (names, dtypes, shapes, shards, their chunks' raw ranges) is the same from one
step to the next, so a writer may reuse its encoded line; the values line holds one
``[file index, offset, length, codec, checksum]`` per chunk, in layout order.
:func:`decode_part` turns a part back into a version-3 part's dict for index.py to validate.
"""

from __future__ import annotations

from typing import Any

from ftkit.errors import FormatError
from ftkit.format.manifest import encode_json
from ftkit.format.validate import MAX_STEP, _int, _list, parse_json

PART_VERSION = 4
PART_FORMAT = "ftkit-checkpoint-part"
_VALUE_TYPES = [int, int, int, str, str]  # a chunk's [file index, offset, length, codec, checksum]


def _line(doc: Any) -> bytes:
    return encode_json(doc) + b"\n"


def rank_runs(ranks: list[int]) -> list[list[int]]:
    """Sorted ranks as [start, stop) runs: a node's ranks are usually one run."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and runs[-1][1] == r:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    return runs


# ------------------------------------------------------------------ writing
def layout_docs(tensors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tensor entry docs as the layout holds them: each chunk only its raw_offset and raw_length."""
    return [
        {
            **t,
            "shards": [
                {**s, "chunks": [{"raw_offset": c["raw_offset"], "raw_length": c["raw_length"]} for c in s["chunks"]]}
                for s in t["shards"]
            ],
        }
        for t in tensors
    ]


def encode_layout(layout_entries: list[dict[str, Any]]) -> bytes:
    """The layout line (with its newline) of layout_docs()'s entries."""
    return _line({"tensors": layout_entries})


def encode_part(
    step: int,
    ranks: list[int],
    layout: bytes,
    files: list[tuple[str, int, int]],
    chunks: list[list[Any]] | list[tuple[Any, ...]],
    rank_state: dict[str, Any],
) -> bytes:
    """A version-4 part: its head, `layout` (encode_layout's bytes, as given) and its values."""
    head = _line({"format": PART_FORMAT, "format_version": PART_VERSION, "step": step, "ranks": rank_runs(ranks)})
    return head + layout + _line({"files": files, "chunks": chunks, "rank_state": rank_state})


def encode_part_docs(
    step: int,
    ranks: list[int],
    files: dict[str, dict[str, Any]],
    tensors: list[dict[str, Any]],
    rank_state: dict[str, Any],
) -> bytes:
    """A version-4 part from a version-3 part's fields ({name: {"bytes", "rank"}}, tensor
    entry docs); its files in the order of `files`. FormatError for a chunk of a file not in
    `files` (a writer's reports are untrusted)."""
    index = {name: i for i, name in enumerate(files)}
    listed = [(name, info["bytes"], info["rank"]) for name, info in files.items()]
    try:
        chunks = [
            [index[c["file"]], c["offset"], c["length"], c["codec"], c["checksum"]]
            for t in tensors
            for s in t["shards"]
            for c in s["chunks"]
        ]
    except KeyError as e:
        raise FormatError(f"a chunk names a file the part does not list ({str(e)[:80]})") from None
    return encode_part(step, ranks, encode_layout(layout_docs(tensors)), listed, chunks, rank_state)


# ------------------------------------------------------------------ reading
def decode_part(data: bytes | bytearray | memoryview, where: str) -> dict[str, Any]:
    """A version-4 part's bytes (untrusted) as a version-3 part's dict, for index.py to merge
    and validate; FormatError naming `where` on any problem of its form."""
    lines = bytes(data).split(b"\n")
    if len(lines) != 4 or lines[3]:
        raise FormatError(f"{where}: a version-4 part is three JSON lines ending in newlines, not this")
    head = parse_json(lines[0], where, "part head")
    layout = parse_json(lines[1], where, "part layout")
    values = parse_json(lines[2], where, "part values")
    try:
        return _decode(head, layout, values)
    except FormatError as e:
        raise FormatError(f"{where}: {e}") from None


def _decode(head: Any, layout: Any, values: Any) -> dict[str, Any]:
    if not isinstance(head, dict) or head.get("format") != PART_FORMAT:
        raise FormatError("not an ftkit manifest part")
    if type(head.get("format_version")) is not int or head["format_version"] != PART_VERSION:
        raise FormatError(f"part format version is {str(head.get('format_version'))[:20]}, not {PART_VERSION}")
    step = _int(head.get("step"), "the part's step", 0, MAX_STEP)
    ranks = _list(head.get("ranks"), "the part's ranks")
    if not isinstance(layout, dict) or not isinstance(values, dict):
        raise FormatError("the part's layout or values line is not an object")
    names: list[str] = []
    files: dict[str, dict[str, Any]] = {}
    for f in _list(values.get("files"), "the part's files"):
        if not (type(f) is list and list(map(type, f)) == [str, int, int]):
            raise FormatError(f"a file of the part is not [name, bytes, rank] ({str(f)[:80]})")
        if f[0] in files:
            raise FormatError(f"file {f[0][:80]!r} is listed twice")
        names.append(f[0])
        files[f[0]] = {"bytes": f[1], "rank": f[2]}
    values_chunks = _list(values.get("chunks"), "the part's chunks")
    nfiles, at = len(names), 0
    tensors = []
    for t in _list(layout.get("tensors"), "the part's tensors"):
        if type(t) is not dict:
            raise FormatError("a tensor entry is not an object")
        what = f"tensor {str(t.get('name'))[:80]!r}"
        shards = []
        for s in _list(t.get("shards"), f"the shards of {what}"):
            if type(s) is not dict:
                raise FormatError(f"a shard of {what} is not an object")
            chunks = []
            for c in _list(s.get("chunks"), f"the chunks of a shard of {what}"):
                if type(c) is not dict or type(c.get("raw_offset")) is not int or type(c.get("raw_length")) is not int:
                    raise FormatError(f"a chunk of {what} is not {{raw_offset, raw_length}} integers")
                if at >= len(values_chunks):
                    raise FormatError(f"the layout has more chunks than the values ({len(values_chunks)})")
                v = values_chunks[at]
                at += 1
                if not (type(v) is list and list(map(type, v)) == _VALUE_TYPES and 0 <= v[0] < nfiles):
                    raise FormatError(
                        f"chunk {at - 1} of the values is not [file index, offset, length, codec, checksum] "
                        f"with a file index below {nfiles} ({str(v)[:80]})"
                    )
                chunks.append(
                    {**c, "file": names[v[0]], "offset": v[1], "length": v[2], "codec": v[3], "checksum": v[4]}
                )
            shards.append({**s, "chunks": chunks})
        tensors.append({**t, "shards": shards})
    if at != len(values_chunks):
        raise FormatError(f"the values have {len(values_chunks)} chunks, the layout {at}")
    return {
        "format": PART_FORMAT,
        "step": step,
        "ranks": ranks,
        "files": files,
        "tensors": tensors,
        "rank_state": values.get("rank_state", {}),
    }

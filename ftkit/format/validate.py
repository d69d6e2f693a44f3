"""The one validator of untrusted checkpoint metadata: a manifest or a rank's report of
its writes becomes frozen dataclasses, or a FormatError naming what is wrong and where.

Nothing else decodes these documents, so everything downstream may rely on what is
proven here (FORMAT.md, "Invariants"): types and ranges, chunks inside their files and
sharing no bytes, chunks tiling their shard and shards their tensor, well-formed skeleton
tags. So a manifest never makes a reader allocate more than its files store (x32768 for
zstd), and data.check_file_sizes binds those sizes to storage before any allocation.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, NoReturn

from ftkit.errors import FormatError, one_line
from ftkit.format.manifest import (
    CODECS,
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    ITEMSIZE,
    KINDS,
    SAFE_FILE_RE,
    Chunk,
    Manifest,
    Shard,
    TensorEntry,
)
from ftkit.format.skeleton_values import _list, check_rank_state, check_value
from ftkit.format.tiling import check_no_shared_bytes, check_shards_tile

MAX_INT = 2**62  # offsets, sizes, byte counts: anything larger is not a real checkpoint
MAX_STEP = 10**12 - 1  # step directories have 12 digits
MAX_WORLD = 2**24
MAX_NDIM = 64
MAX_NAME = 4096
MAX_NUMBER_CHARS = 400
RANK_KEY_RE = re.compile(r"^(0|[1-9][0-9]{0,7})\Z")  # ASCII only: str.isdigit() takes "²", which int() refuses
MAX_CREATED_AT = 2.0**40  # seconds since 1970: tens of thousands of years
ZSTD_MAX_RATIO = 32768  # a zstd block of <= 128 KiB needs >= 4 stored bytes
# Every writer cuts a shard's bytes in chunks of at most 16 MiB (save/write.py): a reader holds a
# chunk's stored bytes at once, so a larger one (free to claim in a sparse file) is refused unread.
MAX_CHUNK_RAW = 16 * 2**20
CHECKSUM_RE = re.compile(r"^xxh3_64:[0-9a-f]{16}\Z")
NOT_NUMPY = ("bfloat16", "float8_e4m3fn", "float8_e5m2")  # no numpy dtype: cannot back an $ndarray


# ----------------------------------------------------------------- manifests
def parse_manifest(data: bytes | str, where: str, expect_step: int) -> Manifest:
    """Parse and validate a single-document manifest (versions 1 and 2: the reader tells an
    index apart by its version first); FormatError naming `where` on any problem."""
    doc, _ = parse_header(data, where)
    try:
        m = manifest_from_doc(doc)
    except FormatError as e:
        raise FormatError(f"{where}: {e}") from None
    if m.step != expect_step:
        raise FormatError(f"{where}: manifest says step {m.step}, directory says {expect_step}")
    return m


def parse_header(data: bytes | str, where: str) -> tuple[dict[str, Any], int]:
    """A manifest document and its format version, which this ftkit can read."""
    doc = parse_json(data, where, "manifest")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        v = doc.get("format") if isinstance(doc, dict) else None
        raise FormatError(f"{where}: not an ftkit checkpoint manifest (format field is {repr(v)[:40]})")
    version = doc.get("format_version")
    if type(version) is not int or version < 1:
        raise FormatError(f"{where}: manifest has no valid integer format_version")
    if version > FORMAT_VERSION:
        raise FormatError(
            f"{where}: manifest format version {version} is newer than this ftkit supports "
            f"({FORMAT_VERSION}); upgrade ftkit to read it"
        )
    return doc, version


def parse_json(data: bytes | str | bytearray | memoryview, where: str, what: str) -> Any:
    """The one parser of untrusted JSON (manifests, parts, store and board messages): JSON as
    ftkit writes it (UTF-8, no NaN/Infinity, no overflowing float); anything else, whatever
    Python's own conversions raise, is a FormatError naming `where`, and nothing else escapes."""
    try:
        text = bytes(data).decode() if isinstance(data, (bytes, bytearray, memoryview)) else data
        return _DECODER.decode(text)
    except FormatError as e:
        raise FormatError(f"{where}: {what} {e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{where}: {what} is not valid JSON ({getattr(e, 'msg', None) or e})") from None
    except RecursionError:
        raise FormatError(f"{where}: {what} is nested too deeply") from None
    except (ValueError, OverflowError, TypeError, MemoryError) as e:  # Python's own conversion limits
        raise FormatError(f"{where}: {what} is unreadable ({one_line(e, 80)})") from None


def parse_message(raw: bytes | str | None) -> Any:
    """A store or node-board message as JSON, or None when it is empty or not ftkit's JSON
    (untrusted input that does not parse is silence to its reader, never an exception)."""
    if not raw:
        return None
    try:
        return parse_json(raw, "message", "")
    except FormatError:
        return None


def _no_constant(name: str) -> Any:
    raise FormatError(f"holds {name}, which ftkit never writes")


def _finite_float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise FormatError(f"holds a number of {len(text)} characters")
    value = float(text)
    if not math.isfinite(value):
        raise FormatError(f"holds the number {text[:40]}, which overflows")
    return value


# An over-long integer is Python's own ValueError (sys.int_max_str_digits), which parse_json
# turns into a FormatError; the fields that hold integers bound them.
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)


def manifest_from_doc(doc: dict[str, Any]) -> Manifest:
    """A Manifest from a parsed manifest document (format and version already checked)."""
    step = _int(doc.get("step"), "step", 0, MAX_STEP)
    world = _int(doc.get("world_size"), "world_size", 1, MAX_WORLD)
    files = _files(doc.get("files"), world)
    tensor_docs = _list(doc.get("tensors"), "tensors")
    tensors = tuple(tensor_entry(t, files, world) for t in tensor_docs)
    names = {t.name for t in tensors}
    shared = {t.name for t in tensors if t.kind != "rank-local"}
    numpy_ok = {t.name for t in tensors if t.dtype not in NOT_NUMPY}
    if len(names) != len(tensors):
        dup = next(t.name for i, t in enumerate(tensors) if t.name in {u.name for u in tensors[:i]})
        raise FormatError(f"tensor {dup[:80]!r} is listed twice")
    check_no_shared_bytes(tensors)
    skeleton = doc.get("skeleton")
    if not isinstance(skeleton, dict) or not isinstance(skeleton.get("entries"), dict):
        raise FormatError("'skeleton' must be an object with an 'entries' object")
    for key, entry in skeleton["entries"].items():
        if (
            not isinstance(entry, dict)
            or entry.get("kind") not in ("stateful", "tensor", "value")
            or "value" not in entry
        ):
            raise FormatError(f"skeleton entry {key[:80]!r} is not {{'kind': ..., 'value': ...}}")
        check_value(entry["value"], shared, f"skeleton entry {key[:80]!r}", numpy_ok=numpy_ok)
    rank_state = doc.get("rank_state", {})
    if not isinstance(rank_state, dict):
        raise FormatError("'rank_state' must be an object")
    for r, st in rank_state.items():
        if rank_key(r, world) is None or not isinstance(st, dict):
            raise FormatError(f"rank_state has a bad entry for rank {r[:20]!r}")
        own = {t.name for t in tensors if t.kind == "rank-local" and t.name.startswith(f"_rng/r{r}/")}
        check_rank_state(st, own, f"rank_state of rank {r}", numpy_ok)
    created = doc.get("created_at", 0.0)
    if type(created) not in (int, float) or not 0 <= created <= MAX_CREATED_AT:
        raise FormatError(f"'created_at' must be a time in seconds since 1970 ({str(created)[:40]!r})")
    writer = doc.get("writer", {})
    if not isinstance(writer, dict):
        raise FormatError("'writer' must be an object")
    return Manifest(
        step=step,
        world_size=world,
        tensors=tensors,
        skeleton=skeleton,
        files=files,
        rank_state=rank_state,
        created_at=float(created),
        writer=writer,
        format_version=doc["format_version"],
    )


def _files(files: Any, world: int) -> dict[str, dict[str, Any]]:
    if not isinstance(files, dict):
        raise FormatError("'files' must be an object")
    for name, info in files.items():
        check_file_name(name)
        if not isinstance(info, dict):
            raise FormatError(f"file {name!r} has no {{'bytes': ..., 'rank': ...}} record")
        _int(info.get("bytes"), f"byte count of file {name!r}", 0, MAX_INT)
        _int(info.get("rank", 0), f"rank of file {name!r}", 0, world - 1)
    return files


def is_file_name(name: Any) -> bool:
    """Whether `name` is a plain name inside a step directory, as every file of a step is."""
    return isinstance(name, str) and SAFE_FILE_RE.match(name) is not None and ".." not in name


def check_file_name(name: Any) -> str:
    """A data file's name: a plain name inside its step directory."""
    if not is_file_name(name):
        raise FormatError(f"manifest names a file outside its step directory: {str(name)[:80]!r}")
    return name


# ------------------------------------------------------------------- tensors
def tensor_entry(t: Any, files: dict[str, dict[str, Any]], world: int, whole: bool = True) -> TensorEntry:
    """One validated tensor entry whose chunks point into `files` ({name: {"bytes": n}});
    `whole`: its shards must tile the tensor (a manifest's entries; not one rank's report)."""
    if not isinstance(t, dict):
        raise FormatError("a tensor entry is not an object")
    name = t.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
        raise FormatError(f"a tensor entry has no valid name ({str(name)[:80]!r})")
    what = f"tensor {name[:120]!r}"
    dtype = t.get("dtype")
    if dtype not in DTYPES:
        raise FormatError(f"{what} has unknown dtype {str(dtype)[:40]!r}")
    shape = _dims(t.get("shape"), f"shape of {what}", None)
    kind = t.get("kind", "replicated")
    if kind not in KINDS:
        raise FormatError(f"{what} has unknown kind {str(kind)[:40]!r}")
    itemsize = ITEMSIZE[dtype]
    if math.prod(shape) * itemsize > MAX_INT:
        raise FormatError(f"{what} claims {shape}: more bytes than any checkpoint holds")
    shards = tuple(_shard(s, shape, itemsize, files, world, what) for s in _list(t.get("shards"), f"shards of {what}"))
    if whole:
        check_shards_tile(shape, shards, what)
    return TensorEntry(name, dtype, shape, shards, kind)


def _shard(s: Any, shape: tuple[int, ...], itemsize: int, files: dict[str, Any], world: int, what: str) -> Shard:
    # Hot (every shard of every commit): plain tests first, the precise message only when one fails.
    if type(s) is not dict:
        _shard_problem(s, shape, world, what)
    offsets, lengths, rank = s.get("offsets"), s.get("lengths"), s.get("rank", 0)
    ndim = len(shape)
    if not (
        type(offsets) is list
        and type(lengths) is list
        and len(offsets) == len(lengths) == ndim
        and all(
            type(o) is int and type(n) is int and 0 <= o and 0 <= n and o + n <= d
            for o, n, d in zip(offsets, lengths, shape)
        )
        and type(rank) is int
        and 0 <= rank < world
    ):
        _shard_problem(s, shape, world, what)
    chunk_docs = s.get("chunks")
    if type(chunk_docs) is not list:
        raise FormatError(f"the chunks of a shard of {what} are not a list")
    chunks = tuple(_chunk(c, files, what) for c in chunk_docs)
    # The chunks tile the shard's raw bytes exactly: sorted by raw offset, back to back.
    need = math.prod(lengths) * itemsize
    at = 0
    for c in chunks if len(chunks) < 2 else sorted(chunks, key=lambda c: c.raw_offset):
        if c.raw_offset != at:
            problem = "a gap" if c.raw_offset > at else "overlapping chunks"
            raise FormatError(f"the chunks of a shard of {what} do not tile its {need} bytes ({problem} at byte {at})")
        at += c.raw_length
    if at != need:
        raise FormatError(f"the chunks of a shard of {what} hold {at} bytes; the shard {tuple(lengths)} needs {need}")
    return Shard(tuple(offsets), tuple(lengths), chunks, rank)


def _shard_problem(s: Any, shape: tuple[int, ...], world: int, what: str) -> NoReturn:
    """Raise the precise FormatError for a shard that failed _shard's quick test."""
    if not isinstance(s, dict):
        raise FormatError(f"a shard of {what} is not an object")
    offsets = _dims(s.get("offsets"), f"shard offsets of {what}", len(shape))
    lengths = _dims(s.get("lengths"), f"shard lengths of {what}", len(shape))
    if any(o + n > d for o, n, d in zip(offsets, lengths, shape)):
        raise FormatError(f"a shard of {what} lies outside the tensor")
    _int(s.get("rank", 0), f"shard rank of {what}", 0, world - 1)
    raise FormatError(f"a shard of {what} is malformed")  # not reached: one test above failed


def _chunk(c: Any, files: dict[str, Any], what: str) -> Chunk:
    if type(c) is dict:
        file, offset, length = c.get("file"), c.get("offset"), c.get("length")
        raw_offset, raw_length = c.get("raw_offset"), c.get("raw_length")
        codec, checksum = c.get("codec"), c.get("checksum")
        # `files` holds only validated names, so membership checks the name too.
        if (
            type(file) is str
            and file in files
            and type(offset) is int
            and type(length) is int
            and type(raw_offset) is int
            and type(raw_length) is int
            and 0 <= offset
            and 1 <= length
            and 0 <= raw_offset <= MAX_INT
            and 1 <= raw_length <= MAX_CHUNK_RAW
            and offset + length <= files[file]["bytes"]
            and (
                codec == "raw"
                and length == raw_length
                or codec == "zstd"
                and raw_length <= ZSTD_MAX_RATIO * length
                and length <= zstd_bound(raw_length)
            )
            and type(checksum) is str
            and CHECKSUM_RE.match(checksum)
        ):
            return Chunk(file, offset, length, raw_offset, raw_length, codec, checksum)
    _chunk_problem(c, files, what)


def _chunk_problem(c: Any, files: dict[str, Any], what: str) -> NoReturn:
    """Raise the precise FormatError for a chunk that failed _chunk's quick test."""
    if not isinstance(c, dict):
        raise FormatError(f"a chunk of {what} is not an object")
    file = check_file_name(c.get("file"))
    if file not in files:
        raise FormatError(f"a chunk of {what} names unlisted file {file!r}")
    offset = _int(c.get("offset"), f"chunk offset of {what}", 0, MAX_INT)
    length = _int(c.get("length"), f"chunk length of {what}", 1, MAX_INT)
    _int(c.get("raw_offset"), f"chunk raw_offset of {what}", 0, MAX_INT)
    raw_length = _int(c.get("raw_length"), f"chunk raw_length of {what}", 1, MAX_INT)
    if raw_length > MAX_CHUNK_RAW:
        raise FormatError(f"a chunk of {what} holds {raw_length} raw bytes, more than the {MAX_CHUNK_RAW} of any chunk")
    codec = c.get("codec")
    if codec not in CODECS:
        raise FormatError(f"a chunk of {what} has unknown codec {str(codec)[:40]!r}")
    if codec == "raw" and length != raw_length:
        raise FormatError(f"a raw chunk of {what} stores {length} bytes for {raw_length} raw bytes")
    if codec == "zstd" and raw_length > ZSTD_MAX_RATIO * length:
        raise FormatError(f"a zstd chunk of {what} claims {raw_length} raw bytes from {length} stored bytes")
    if codec == "zstd" and length > zstd_bound(raw_length):
        raise FormatError(
            f"a zstd chunk of {what} stores {length} bytes for {raw_length} raw bytes, more than zstd ever needs"
        )
    checksum = c.get("checksum")
    if not isinstance(checksum, str) or not CHECKSUM_RE.match(checksum):
        raise FormatError(f"a chunk of {what} has no valid checksum ({str(checksum)[:40]!r})")
    if offset + length > files[file]["bytes"]:
        raise FormatError(f"a chunk of {what} runs past the end of {file!r}")
    raise FormatError(f"a chunk of {what} is malformed")  # not reached


# -------------------------------------------------------------------- basics
def zstd_bound(n: int) -> int:
    """The most bytes one zstd frame takes to store `n` bytes (libzstd's ZSTD_compressBound)."""
    return n + (n >> 8) + ((128 * 1024 - n) >> 11 if n < 128 * 1024 else 0)


def rank_key(key: Any, world: int | None = None) -> int | None:
    """A rank written as an object key ("12"), below `world` when given; None if it is not one."""
    if not isinstance(key, str) or not RANK_KEY_RE.match(key):
        return None
    rank = int(key)
    return rank if world is None or rank < world else None


def _int(v: Any, what: str, lo: int, hi: int) -> int:
    if type(v) is not int:
        raise FormatError(f"{what} is not an integer ({str(v)[:40]!r})")
    if not lo <= v <= hi:
        raise FormatError(f"{what} is out of range ({str(v)[:40]})")
    return v


def _dims(v: Any, what: str, ndim: int | None) -> tuple[int, ...]:
    dims = _list(v, what)
    if len(dims) > MAX_NDIM or (ndim is not None and len(dims) != ndim):
        raise FormatError(f"{what} has {len(dims)} dimensions" + ("" if ndim is None else f", not {ndim}"))
    return tuple(_int(x, what, 0, MAX_INT) for x in dims)

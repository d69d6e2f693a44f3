"""The messages between the ranks of a commit, typed, each with one versioned binary encoding:
``b"FTKM" | version (u8) | kind (u8) | count (u32) | count x u64 | strings (u32) | length
(u32) | blob | messages (u32) | their lengths (u32 each) | their bytes``, its strings one
UTF-8 blob split on NUL. What is read is untrusted: `decode` checks every field, and
anything else is a FormatError, which the executors read as that node's or rank's error."""

from __future__ import annotations

import operator
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any

from ftkit.errors import FormatError
from ftkit.format.index import is_part_file, rank_runs
from ftkit.format.manifest import SAFE_FILE_RE
from ftkit.format.validate import CHECKSUM_RE, MAX_INT

MAGIC = b"FTKM"
VERSION = 2
MAX_COUNT = 1 << 20  # numbers in one message, entries in one list
_NAME = SAFE_FILE_RE.pattern.removeprefix("^").removesuffix(r"\Z")  # a plain file name inside a step directory
_NAMES = re.compile(f"{_NAME}(?:\0{_NAME})*")  # several, NUL-separated
_U32 = struct.Struct("<I")


CODECS = ("raw", "zstd")  # a chunk's codec, by its number in a Report


class Kind(IntEnum):
    REPORT = 6
    RECORD = 1
    OUTCOME = 2
    EXCHANGE = 3
    RELAY = 4
    NEWS = 5
    INVENTORY = 7


# ------------------------------------------------------------------ the encoding
def _pack(kind: Kind, numbers: list[int], strings: list[str], carried: Sequence[bytes] = ()) -> bytes:
    blob = "\0".join(strings).encode()
    n, m = len(numbers), len(carried)
    head = struct.pack(f"<4sBBI{n}QII", MAGIC, VERSION, kind, n, *numbers, len(strings), len(blob))
    return b"".join((head, blob, struct.pack(f"<I{m}I", m, *map(len, carried)), *carried))


def _unpack(data: bytes, kind: Kind, where: str) -> tuple[tuple[int, ...], list[str], list[bytes]]:
    """(the numbers, the strings, the messages carried) of a message of `kind`, its frame checked."""
    if data[:4] != MAGIC or len(data) < 6:
        raise FormatError(f"{where} is not a commit message")
    if data[4] != VERSION:
        raise FormatError(f"{where} has message version {data[4]}, not {VERSION}")
    if data[5] != kind:
        raise FormatError(f"{where} is a message of another kind ({data[5]}, not {int(kind)})")
    try:
        (n,) = _U32.unpack_from(data, 6)
        if n > MAX_COUNT:
            raise FormatError(f"{where} has {n} numbers")
        numbers = struct.unpack_from(f"<{n}Q", data, 10)
        count, length = struct.unpack_from("<II", data, 10 + 8 * n)
        at = 18 + 8 * n + length
        (m,) = _U32.unpack_from(data, at)
        if m > MAX_COUNT:
            raise FormatError(f"{where} carries {m} messages")
        lengths = struct.unpack_from(f"<{m}I", data, at + 4)
    except struct.error:
        raise FormatError(f"{where} is cut short") from None
    start, end = 18 + 8 * n, at + 4 + 4 * m
    if len(data) != end + sum(lengths):
        what = "is cut short" if len(data) < end + sum(lengths) else f"has {len(data) - end - sum(lengths)} bytes more"
        raise FormatError(f"{where} {what} than its fields")
    try:
        strings = data[start:at].decode().split("\0") if count else []
    except UnicodeDecodeError:
        raise FormatError(f"{where} has a string that is not UTF-8") from None
    if len(strings) != count:
        raise FormatError(f"{where} has {len(strings)} strings, not the {count} it says")
    carried = []
    for size in lengths:
        carried.append(data[end : end + size])
        end += size
    return numbers, strings, carried


class _Fields:
    """The numbers and strings of a message, taken in order (running out is a FormatError)."""

    def __init__(self, data: bytes, kind: Kind, where: str) -> None:
        self.numbers, self.strings, self.carried = _unpack(data, kind, where)
        self.n = self.s = 0
        self.where = where

    def num(self, limit: int = MAX_INT) -> int:
        if self.n >= len(self.numbers):
            raise FormatError(f"{self.where} has fewer numbers than its fields")
        v = self.numbers[self.n]
        self.n += 1
        if v > limit:
            raise FormatError(f"{self.where} has a number out of range ({v})")
        return v

    def nums(self, count: int) -> tuple[int, ...]:
        if count > len(self.numbers) - self.n:
            raise FormatError(f"{self.where} has fewer numbers than its fields")
        out = self.numbers[self.n : self.n + count]
        self.n += count
        if out and max(out) > MAX_INT:
            raise FormatError(f"{self.where} has a number out of range")
        return out

    def strs(self, count: int) -> list[str]:
        if count > len(self.strings) - self.s:
            raise FormatError(f"{self.where} has fewer strings than its fields")
        out = self.strings[self.s : self.s + count]
        self.s += count
        return out

    def names(self, count: int) -> list[str]:
        """`count` plain file names inside a step directory."""
        out = self.strs(count)
        if not _plain(out):
            raise FormatError(f"{self.where} names a file outside its step directory")
        return out

    def parts(self, count: int) -> list[str]:
        out = self.names(count)
        if not all(is_part_file(n) for n in out):
            raise FormatError(f"{self.where} names malformed parts")
        return out

    def checksums(self, count: int) -> list[str]:
        out = self.strs(count)
        if not all(CHECKSUM_RE.match(c) for c in out):
            raise FormatError(f"{self.where} has a malformed checksum")
        return out

    def messages(self, count: int) -> list[bytes]:
        """The `count` messages carried (all of them: a message carries one list)."""
        if count != len(self.carried):
            raise FormatError(f"{self.where} carries {len(self.carried)} messages, not {count}")
        return self.carried

    def end(self) -> None:
        if self.n != len(self.numbers) or self.s != len(self.strings):
            raise FormatError(f"{self.where} has fields more than its kind")


def _plain(names: Sequence[str]) -> bool:
    """Whether every name is a plain file name inside a step directory (checked in one go)."""
    joined = "\0".join(names)
    return not names or (_NAMES.fullmatch(joined) is not None and ".." not in joined)


def _text(s: str) -> str:
    return s.replace("\0", "\ufffd")  # NUL is the string separator


# ------------------------------------------------------------------ the messages
@dataclass(frozen=True)
class PartEntry:
    """A node's part as the index names it (format/index.py part_ref)."""

    file: str
    nbytes: int
    checksum: str
    ranks: tuple[tuple[int, int], ...]  # [start, stop) runs

    @staticmethod
    def of(doc: dict[str, Any]) -> PartEntry:
        return PartEntry(doc["file"], doc["bytes"], doc["checksum"], tuple((a, b) for a, b in doc["ranks"]))

    def doc(self) -> dict[str, Any]:
        ranks = [list(r) for r in self.ranks]
        return {"file": self.file, "bytes": self.nbytes, "checksum": self.checksum, "ranks": ranks}

    def _put(self, numbers: list[int], strings: list[str]) -> None:
        numbers += [self.nbytes, len(self.ranks), *(x for run in self.ranks for x in run)]
        strings += [self.file, self.checksum]

    @staticmethod
    def _take(f: _Fields) -> PartEntry:
        nbytes, n_runs = f.num(), f.num(MAX_COUNT)
        runs = f.nums(2 * n_runs)
        (file,), (checksum,) = f.parts(1), f.checksums(1)
        if nbytes == 0:
            raise FormatError(f"{f.where} names an empty part")
        return PartEntry(file, nbytes, checksum, tuple(zip(runs[0::2], runs[1::2], strict=True)))


_SUMS = re.compile(r"(?:xxh3_64:[0-9a-f]{16}\0)*")  # checksums, each followed by a NUL
_DIGEST = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class Report:
    """A rank's report of its write, or its error: its data file and size, its layout's name
    (commit/layouts.py), and per chunk, in the layout's order, what changes from step to step.
    `state` is the rank's manifest `rank_state` entry as JSON text."""

    file: str | None
    nbytes: int = 0
    layout: str | None = None  # the layout's name (blake2b-160, hex)
    offsets: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()
    codecs: tuple[int, ...] = ()  # CODECS' numbers
    checksums: tuple[str, ...] = ()
    state: str = "{}"
    error: str | None = None
    skipped: bool = False  # sent by the training thread (policy "skip"), not by a persist thread

    @staticmethod
    def failed(error: str, skipped: bool = False) -> Report:
        return Report(None, error=error, skipped=skipped)

    def encode(self) -> bytes:
        n = len(self.offsets)
        flags = [int(self.file is not None), int(self.layout is not None), int(self.error is not None)]
        numbers = [*flags, int(self.skipped), self.nbytes, n, *self.offsets, *self.lengths, *self.codecs]
        strings = [*((self.file,) if self.file is not None else ()), *((self.layout,) if self.layout else ())]
        strings += [*((_text(self.error),) if self.error is not None else ()), self.state, *self.checksums]
        return _pack(Kind.REPORT, numbers, strings)

    @staticmethod
    def decode(data: bytes, where: str) -> Report:
        """A report as read from a board or the store, every field checked."""
        f = _Fields(data, Kind.REPORT, where)
        has_file, has_layout, has_error, skipped = f.num(1), f.num(1), f.num(1), f.num(1)
        nbytes, n = f.num(), f.num(MAX_COUNT)
        offsets, lengths, codecs = f.nums(n), f.nums(n), f.nums(n)
        file = f.names(1)[0] if has_file else None
        layout = f.strs(1)[0] if has_layout else None
        error = f.strs(1)[0] if has_error else None
        state, sums = f.strs(1)[0], f.strs(n)
        f.end()
        if layout is not None and not _DIGEST.fullmatch(layout):
            raise FormatError(f"{where} names a malformed layout")
        if file is not None and layout is None and error is None:
            raise FormatError(f"{where} names a file but no layout")
        if n and (file is None or max(codecs) >= len(CODECS) or min(lengths) == 0):
            raise FormatError(f"{where} has malformed chunks")
        if file is not None and nbytes and not n:  # a replica of it would be stored unchecked
            raise FormatError(f"{where} lists no chunk for its {nbytes}-byte file")
        if n and max(map(operator.add, offsets, lengths)) > nbytes:
            raise FormatError(f"{where} has a chunk beyond its {nbytes}-byte file")
        if not _SUMS.fullmatch("\0".join(sums) + "\0" if sums else ""):
            raise FormatError(f"{where} has a malformed checksum")
        return Report(file, nbytes, layout, offsets, lengths, codecs, tuple(sums), state, error, bool(skipped))


@dataclass(frozen=True)
class Record:
    """A node's record for rank 0: its part (None: `errors` say why), its data files and
    sizes, the bytes stored; on the RAM tier also whether a rank skipped the step and the
    parts of other nodes its exchanger wrote there."""

    part: PartEntry | None
    files: dict[str, int]
    stored: int
    errors: tuple[str, ...] = ()
    skipped: bool = False
    others: tuple[str, ...] = ()

    @staticmethod
    def failed(errors: list[str], files: dict[str, int] | None = None, skipped: bool = False) -> Record:
        return Record(None, files or {}, 0, tuple(errors), skipped)

    def local_files(self) -> list[str]:
        """What the step put in the node's directory (a failed commit removes it)."""
        return [*self.files, *([self.part.file] if self.part else []), *self.others]

    def encode(self) -> bytes:
        numbers = [int(self.part is not None), int(self.skipped), self.stored]
        strings: list[str] = []
        if self.part is not None:
            self.part._put(numbers, strings)
        numbers += [len(self.files), *self.files.values(), len(self.errors), len(self.others)]
        strings += [*self.files, *map(_text, self.errors), *self.others]
        return _pack(Kind.RECORD, numbers, strings)

    @staticmethod
    def decode(data: bytes, ranks: Sequence[int], where: str) -> Record:
        """A record of the node of `ranks`: its part must be of exactly those ranks. (Rank 0
        reads one per node at every step: its fields are taken by index.)"""
        nums, strs, carried = _unpack(data, Kind.RECORD, where)
        try:
            has_part, skipped, stored = nums[0], nums[1], nums[2]
            at, part = 3, None
            if has_part:
                nbytes, n_runs = nums[3], nums[4]
                runs = nums[5 : 5 + 2 * n_runs]
                at = 5 + 2 * n_runs
                part = PartEntry(strs[0], nbytes, strs[1], tuple(zip(runs[0::2], runs[1::2], strict=True)))
            n_files = nums[at]
            sizes = nums[at + 1 : at + 1 + n_files]
            n_errors, n_others = nums[at + 1 + n_files], nums[at + 2 + n_files]
        except (IndexError, ValueError):
            raise FormatError(f"{where} has fewer numbers than its fields") from None
        first = 2 if has_part else 0
        if (
            carried
            or has_part > 1
            or skipped > 1
            or len(sizes) != n_files
            or len(nums) != at + 3 + n_files
            or len(strs) != first + n_files + n_errors + n_others
        ):
            raise FormatError(f"{where} is malformed")
        if max((stored, *sizes)) > MAX_INT:
            raise FormatError(f"{where} has a number out of range")
        if part is not None:
            if not (is_part_file(part.file) and _plain([part.file]) and CHECKSUM_RE.match(part.checksum)):
                raise FormatError(f"{where} names no valid part")
            if part.nbytes == 0 or part.nbytes > MAX_INT:
                raise FormatError(f"{where} names an empty part")
            if [list(x) for x in part.ranks] != rank_runs(list(ranks)):
                raise FormatError(f"{where} names no valid part of its ranks")
        names = strs[first : first + n_files]
        if not _plain(names):
            raise FormatError(f"{where} names a file outside its step directory")
        errors = tuple(strs[first + n_files : first + n_files + n_errors])
        others = tuple(strs[first + n_files + n_errors :])
        if part is None and not errors:
            raise FormatError(f"{where} has neither a part nor an error")
        if not (all(map(is_part_file, others)) and _plain(others)):
            raise FormatError(f"{where} names a file outside its step directory")
        return Record(part, dict(zip(names, sizes, strict=True)), stored, errors, bool(skipped), others)


@dataclass(frozen=True)
class Outcome:
    """A rank's replication errors, and (from its node's exchanger) the other nodes' parts it wrote."""

    errors: tuple[str, ...] = ()
    parts: tuple[str, ...] = ()

    def encode(self) -> bytes:
        return _pack(Kind.OUTCOME, [len(self.errors), len(self.parts)], [*map(_text, self.errors), *self.parts])

    @staticmethod
    def decode(data: bytes, where: str) -> Outcome:
        f = _Fields(data, Kind.OUTCOME, where)
        n_errors, n_parts = f.num(MAX_COUNT), f.num(MAX_COUNT)
        outcome = Outcome(tuple(f.strs(n_errors)), tuple(f.parts(n_parts)))
        f.end()
        return outcome


@dataclass(frozen=True)
class Exchange:
    """A node's reports (rank -> its `Report` as sent) and its part's name and checksum, for its
    replica partners, who rebuild the part from the reports (commit/replicas.py store_parts)."""

    reports: dict[int, bytes]
    part: tuple[str, str] | None = None  # (file, checksum)

    def encode(self) -> bytes:
        numbers = [int(self.part is not None), len(self.reports), *self.reports]
        return _pack(Kind.EXCHANGE, numbers, [*(self.part or ())], list(self.reports.values()))

    @staticmethod
    def decode(data: bytes, where: str) -> Exchange:
        f = _Fields(data, Kind.EXCHANGE, where)
        has_part, n = f.num(1), f.num(MAX_COUNT)
        ranks = f.nums(n)
        part = (f.parts(1)[0], f.checksums(1)[0]) if has_part else None
        exchange = Exchange(dict(zip(ranks, f.messages(n), strict=True)), part)
        f.end()
        return exchange


@dataclass(frozen=True)
class Written:
    """A part as its collector wrote it (commit/manifests.py store_part)."""

    part: PartEntry
    files: dict[str, int]
    stored: int


@dataclass(frozen=True)
class Relay:
    """The partners' reports as a collector relays them to its node; for the exchanger also the
    sources' parts ({file: (their leader, checksum)}) and, on an index holder, its own (`own`)."""

    reports: dict[int, bytes]
    parts: dict[str, tuple[int, str]] = field(default_factory=dict)
    own: Written | None = None

    def encode(self) -> bytes:
        numbers = [len(self.reports), *self.reports, len(self.parts), *(leader for leader, _ in self.parts.values())]
        strings = [*self.parts, *(checksum for _, checksum in self.parts.values())]
        numbers.append(int(self.own is not None))
        if self.own is not None:
            self.own.part._put(numbers, strings)
            numbers += [self.own.stored, len(self.own.files), *self.own.files.values()]
            strings += self.own.files
        return _pack(Kind.RELAY, numbers, strings, list(self.reports.values()))

    @staticmethod
    def decode(data: bytes, where: str) -> Relay:
        f = _Fields(data, Kind.RELAY, where)
        ranks = f.nums(f.num(MAX_COUNT))
        n_parts = f.num(MAX_COUNT)
        leaders = f.nums(n_parts)
        reports = dict(zip(ranks, f.messages(len(ranks)), strict=True))
        names, checksums = f.parts(n_parts), f.checksums(n_parts)
        parts = dict(zip(names, zip(leaders, checksums, strict=True), strict=True))
        own = None
        if f.num(1):
            part = PartEntry._take(f)
            stored, n_files = f.num(), f.num(MAX_COUNT)
            sizes = f.nums(n_files)
            own = Written(part, dict(zip(f.names(n_files), sizes, strict=True)), stored)
        f.end()
        return Relay(reports, parts, own)


@dataclass(frozen=True)
class Settled:
    """Rank 0's word on one restore epoch's RAM-tier steps: all up to `settled` are decided, `kept` kept."""

    epoch: int
    settled: int
    kept: frozenset[int]

    def encode(self) -> bytes:
        return _pack(Kind.NEWS, [self.epoch, self.settled, len(self.kept), *sorted(self.kept)], [])

    @staticmethod
    def decode(data: bytes, where: str = "the RAM tier's commit news") -> Settled:
        f = _Fields(data, Kind.NEWS, where)
        epoch, settled = f.num(), f.num()
        kept = f.nums(f.num(MAX_COUNT))
        f.end()
        if kept and max(kept) > settled:
            raise FormatError(f"{where} keeps a step it has not settled")
        return Settled(epoch, settled, frozenset(kept))


@dataclass(frozen=True)
class Held:
    """What a node holds of one RAM-tier step: its files; from a node with the whole manifest
    the files it names (`need`: rank 0's only, the others send `digest`), or from a node with
    the index but not every part the index's checksum and its parts (`index`, `parts`); from
    a node whose committed manifest cannot be read, why (`problem`)."""

    step: int
    have: tuple[str, ...]
    need: tuple[str, ...] | None = None
    digest: str | None = None
    index: str | None = None
    parts: tuple[str, ...] | None = None
    problem: str | None = None

    @property
    def whole(self) -> bool:
        """Whether the node has the whole manifest."""
        return self.need is not None or self.digest is not None


@dataclass(frozen=True)
class Inventory:
    """A node's RAM tier as its leader lists it at a restore (restore/inventory.py)."""

    steps: tuple[Held, ...] = ()

    def without_lists(self) -> Inventory:
        """The same, less the lists only rank 0's inventory need carry."""
        return Inventory(tuple(replace(h, need=None, parts=None) for h in self.steps))

    def encode(self) -> bytes:
        numbers, strings = [len(self.steps)], []
        for h in self.steps:
            flags = [h.digest is not None, h.index is not None, h.problem is not None]
            numbers += [h.step, len(h.have), _count(h.need), _count(h.parts), *flags]
            strings += [*h.have, *(h.need or ()), *(h.parts or ()), *filter(None, (h.digest, h.index, h.problem))]
        return _pack(Kind.INVENTORY, numbers, strings)

    @staticmethod
    def decode(data: bytes, where: str) -> Inventory:
        f = _Fields(data, Kind.INVENTORY, where)
        steps = []
        for _ in range(f.num(MAX_COUNT)):
            step, n_have, n_need, n_parts = f.num(), f.num(MAX_COUNT), f.num(MAX_COUNT + 1), f.num(MAX_COUNT + 1)
            has_digest, has_index, has_problem = f.num(1), f.num(1), f.num(1)
            have = tuple(f.names(n_have))
            need = tuple(f.names(n_need - 1)) if n_need else None
            parts = tuple(f.parts(n_parts - 1)) if n_parts else None
            digest = f.checksums(1)[0] if has_digest else None
            index = f.checksums(1)[0] if has_index else None
            problem = f.strs(1)[0] if has_problem else None
            steps.append(Held(step, have, need, digest, index, parts, problem))
        f.end()
        return Inventory(tuple(steps))


def _count(names: tuple[str, ...] | None) -> int:
    """A list that may be absent, counted: 0 for none, else one more than its length."""
    return 0 if names is None else len(names) + 1

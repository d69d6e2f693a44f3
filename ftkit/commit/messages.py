"""The messages between the ranks of a commit, typed, each with one versioned binary encoding.

A message is ``b"FTKM" | version (u8) | kind (u8) | fields``: integers little-endian, strings
UTF-8 after their u32 length, lists after their u32 count, an absent value a 0 flag. What is
read is untrusted (anyone who can write the job's store or a node's board can forge it):
`decode` checks the header, every length against what is left and against a bound, every
file name and checksum, and that nothing is left over; anything else is a FormatError, which
the executors read as that node's or rank's error, so the step is simply not committed.

* `Record`: a node's record for rank 0 (both tiers): its part, or its errors.
* `Outcome`: a rank's replication outcome for its collector (the RAM tier).
* `Exchange`: a node's reports and part, for the nodes it exchanges replicas with.
* `Relay`: the partners' reports as a collector relays them to its node's ranks.
* `Settled`: rank 0's commit news, which RAM-tier steps it keeps (coord/news.py).

A rank's report (commit/reports.py) travels inside Exchange and Relay as the text it was
sent as. Version 1 is the only version; a message of another version is refused by name.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from ftkit.errors import FormatError
from ftkit.format.index import is_part_name, rank_runs
from ftkit.format.manifest import SAFE_FILE_RE
from ftkit.format.validate import CHECKSUM_RE, MAX_INT, check_file_name

MAGIC = b"FTKM"
VERSION = 1
MAX_COUNT = 1 << 20  # entries in one list: a node's files, a few ranks' reports
MAX_TEXT = 256 * 2**20  # one string: a report of a rank's tensor entries at most
_NAME = SAFE_FILE_RE.pattern.strip("^$")  # a plain file name inside a step directory
_NAMES = re.compile(f"{_NAME}(?:\0{_NAME})*")  # several, NUL-separated


class Kind(IntEnum):
    RECORD = 1
    OUTCOME = 2
    EXCHANGE = 3
    RELAY = 4
    NEWS = 5


_RECORD_HEADER = MAGIC + bytes((VERSION, Kind.RECORD))


# ------------------------------------------------------------------ the encoding
class _Writer:
    def __init__(self, kind: Kind) -> None:
        self.out = [MAGIC, bytes((VERSION, kind))]

    def u64(self, v: int) -> None:
        self.out.append(struct.pack("<Q", v))

    def flag(self, v: bool) -> None:
        self.out.append(b"\1" if v else b"\0")

    def text(self, s: str) -> None:
        data = s.encode()
        self.out += [struct.pack("<I", len(data)), data]

    def texts(self, items: list[str] | tuple[str, ...]) -> None:
        self.out.append(struct.pack("<I", len(items)))
        for s in items:
            self.text(s)

    def data(self) -> bytes:
        return b"".join(self.out)


class _Reader:
    def __init__(self, data: bytes, kind: Kind, where: str) -> None:
        self.data, self.at, self.where = memoryview(data), 6, where
        if bytes(self.data[:4]) != MAGIC or len(data) < 6:
            raise FormatError(f"{where} is not a commit message")
        if data[4] != VERSION:
            raise FormatError(f"{where} has message version {data[4]}, not {VERSION}")
        if data[5] != kind:
            raise FormatError(f"{where} is a message of another kind ({data[5]}, not {int(kind)})")

    def take(self, n: int) -> memoryview:
        if n > len(self.data) - self.at:
            raise FormatError(f"{self.where} is cut short")
        piece = self.data[self.at : self.at + n]
        self.at += n
        return piece

    def u64(self, limit: int = MAX_INT) -> int:
        (v,) = struct.unpack("<Q", self.take(8))
        if v > limit:
            raise FormatError(f"{self.where} has a number out of range ({v})")
        return v

    def flag(self) -> bool:
        v = self.take(1)[0]
        if v > 1:
            raise FormatError(f"{self.where} has a malformed flag")
        return v == 1

    def count(self) -> int:
        (n,) = struct.unpack("<I", self.take(4))
        if n > MAX_COUNT:
            raise FormatError(f"{self.where} has a list of {n} entries")
        return n

    def text(self) -> str:
        (n,) = struct.unpack("<I", self.take(4))
        if n > MAX_TEXT:
            raise FormatError(f"{self.where} has a string of {n} bytes")
        try:
            return str(self.take(n), "utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"{self.where} has a string that is not UTF-8") from None

    def texts(self) -> list[str]:
        return [self.text() for _ in range(self.count())]

    def file(self) -> str:
        return check_file_name(self.text())

    def checksum(self) -> str:
        s = self.text()
        if not CHECKSUM_RE.match(s):
            raise FormatError(f"{self.where} has a malformed checksum")
        return s

    def end(self) -> None:
        if self.at != len(self.data):
            raise FormatError(f"{self.where} has {len(self.data) - self.at} bytes more than its fields")


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
        return {
            "file": self.file,
            "bytes": self.nbytes,
            "checksum": self.checksum,
            "ranks": [list(r) for r in self.ranks],
        }

    def _write(self, w: _Writer) -> None:
        w.text(self.file)
        w.u64(self.nbytes)
        w.text(self.checksum)
        w.u64(len(self.ranks))
        for a, b in self.ranks:
            w.u64(a)
            w.u64(b)

    @staticmethod
    def _read(r: _Reader) -> PartEntry:
        file, nbytes, checksum = r.file(), r.u64(), r.checksum()
        if not is_part_name(file) or nbytes == 0:
            raise FormatError(f"{r.where} names no valid part")
        runs = tuple((r.u64(), r.u64()) for _ in range(r.u64(MAX_COUNT)))
        return PartEntry(file, nbytes, checksum, runs)


@dataclass(frozen=True)
class Record:
    """A node's record for rank 0: the part its collector wrote (None: the node's `errors`
    say why not), its data files and their sizes, the bytes stored; on the RAM tier also
    whether a rank skipped the step and the parts of other nodes its exchanger wrote there."""

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

    # Rank 0 decodes one record per node at every step: its fields go as one struct of
    # counts, the numbers as packed arrays, and every string in one blob split on NUL (no
    # file name holds one; an error's are escaped), so a record is a few C calls each way.
    _HEAD = struct.Struct("<BQQIIII")  # flags (1: a part, 2: skipped), part bytes, stored, counts

    def encode(self) -> bytes:
        part = self.part
        runs = [x for run in part.ranks for x in run] if part else []
        strings = [part.file, part.checksum] if part else []
        strings += [*self.files, *(e.replace("\0", "\\0") for e in self.errors), *self.others]
        blob = "\0".join(strings).encode()
        flags = (1 if part else 0) | (2 if self.skipped else 0)
        counts = (len(runs) // 2, len(self.files), len(self.errors), len(self.others))
        return b"".join(
            (
                _RECORD_HEADER,
                self._HEAD.pack(flags, part.nbytes if part else 0, self.stored, *counts),
                struct.pack(f"<{len(runs) + len(self.files)}Q", *runs, *self.files.values()),
                struct.pack("<I", len(blob)),
                blob,
            )
        )

    @staticmethod
    def decode(data: bytes, ranks: Sequence[int], where: str) -> Record:
        """A record of the node of `ranks`: its part must be of exactly those ranks."""
        if data[:6] != _RECORD_HEADER:
            _Reader(data, Kind.RECORD, where)  # (says which way it is not one)
        head = Record._HEAD
        try:
            flags, nbytes, stored, n_runs, n_files, n_errors, n_others = head.unpack_from(data, 6)
            if max(n_runs, n_files, n_errors, n_others) > MAX_COUNT:
                raise FormatError(f"{where} has a list of more than {MAX_COUNT} entries")
            k = 2 * n_runs + n_files
            numbers = struct.unpack_from(f"<{k}Q", data, 6 + head.size)
            at = 6 + head.size + 8 * k
            (n,) = struct.unpack_from("<I", data, at)
        except struct.error:
            raise FormatError(f"{where} is cut short") from None
        if len(data) != at + 4 + n:
            raise FormatError(f"{where} is cut short or has bytes more than its fields")
        if flags > 3 or max(nbytes, stored, *numbers) > MAX_INT:
            raise FormatError(f"{where} is malformed")
        try:
            strings = data[at + 4 :].decode().split("\0") if n else []
        except UnicodeDecodeError:
            raise FormatError(f"{where} has a string that is not UTF-8") from None
        has_part = flags & 1
        if len(strings) != 2 * has_part + n_files + n_errors + n_others:
            raise FormatError(f"{where} has {len(strings)} strings, not what its counts say")
        part = None
        if has_part:
            runs = tuple(zip(numbers[0 : 2 * n_runs : 2], numbers[1 : 2 * n_runs : 2], strict=True))
            part = PartEntry(strings[0], nbytes, strings[1], runs)
            if not is_part_name(part.file) or not CHECKSUM_RE.match(part.checksum) or nbytes == 0:
                raise FormatError(f"{where} names no valid part")
            if [list(x) for x in runs] != rank_runs(list(ranks)):
                raise FormatError(f"{where} names no valid part of its ranks")
        first = 2 * has_part
        names = strings[first : first + n_files]
        joined = "\0".join(names)  # (checked in one go: a record names a node's files, every step)
        if names and (not _NAMES.fullmatch(joined) or ".." in joined):
            raise FormatError(f"{where} names a file outside its step directory")
        errors = tuple(e.replace("\\0", "\0") for e in strings[first + n_files : first + n_files + n_errors])
        others = tuple(strings[first + n_files + n_errors :])
        if part is None and not errors:
            raise FormatError(f"{where} has neither a part nor an error")
        if not all(is_part_name(o) for o in others):
            raise FormatError(f"{where} names malformed parts of other nodes")
        return Record(
            part, dict(zip(names, numbers[2 * n_runs :], strict=True)), stored, errors, bool(flags & 2), others
        )


@dataclass(frozen=True)
class Outcome:
    """A rank's replication outcome: its errors, and (from its node's exchanger) the parts
    of other nodes it wrote in the node's directory."""

    errors: tuple[str, ...] = ()
    parts: tuple[str, ...] = ()

    def encode(self) -> bytes:
        w = _Writer(Kind.OUTCOME)
        w.texts(self.errors)
        w.texts(self.parts)
        return w.data()

    @staticmethod
    def decode(data: bytes, where: str) -> Outcome:
        r = _Reader(data, Kind.OUTCOME, where)
        errors, parts = tuple(r.texts()), tuple(r.texts())
        r.end()
        if not all(is_part_name(p) for p in parts):
            raise FormatError(f"{where} names malformed parts")
        return Outcome(errors, parts)


@dataclass(frozen=True)
class Exchange:
    """A node's reports (rank -> its report's text) and the name and checksum of its part,
    for its replica partners: the holders of its ranks' replicas rebuild the part from the
    reports (commit/replicas.py store_parts) and check it against the checksum."""

    reports: dict[int, str]
    part: tuple[str, str] | None = None  # (file, checksum)

    def encode(self) -> bytes:
        w = _Writer(Kind.EXCHANGE)
        _write_reports(w, self.reports)
        w.flag(self.part is not None)
        if self.part is not None:
            w.text(self.part[0])
            w.text(self.part[1])
        return w.data()

    @staticmethod
    def decode(data: bytes, where: str) -> Exchange:
        r = _Reader(data, Kind.EXCHANGE, where)
        reports = _read_reports(r)
        part = (r.file(), r.checksum()) if r.flag() else None
        r.end()
        if part is not None and not is_part_name(part[0]):
            raise FormatError(f"{where} names no valid part")
        return Exchange(reports, part)


@dataclass(frozen=True)
class Written:
    """A part as its collector wrote it (commit/manifests.py store_part): the index's entry
    for it, the node's data files and their sizes, the bytes stored."""

    part: PartEntry
    files: dict[str, int]
    stored: int


@dataclass(frozen=True)
class Relay:
    """The partners' reports as a collector relays them to its node; for the node's exchanger
    also the parts of the nodes that send this node replicas ({file: (their leader, checksum)})
    and, where the node holds rank 0's index, the node's own part as written (`own`)."""

    reports: dict[int, str]
    parts: dict[str, tuple[int, str]] = field(default_factory=dict)
    own: Written | None = None

    def encode(self) -> bytes:
        w = _Writer(Kind.RELAY)
        _write_reports(w, self.reports)
        w.texts(list(self.parts))
        for leader, checksum in self.parts.values():
            w.u64(leader)
            w.text(checksum)
        w.flag(self.own is not None)
        if self.own is not None:
            self.own.part._write(w)
            w.texts(list(self.own.files))
            for n in self.own.files.values():
                w.u64(n)
            w.u64(self.own.stored)
        return w.data()

    @staticmethod
    def decode(data: bytes, where: str) -> Relay:
        r = _Reader(data, Kind.RELAY, where)
        reports = _read_reports(r)
        names = r.texts()
        parts = {check_file_name(n): (r.u64(), r.checksum()) for n in names}
        own = None
        if r.flag():
            part = PartEntry._read(r)
            files = {check_file_name(n): 0 for n in r.texts()}
            files = {n: r.u64() for n in files}
            own = Written(part, files, r.u64())
        r.end()
        if not all(is_part_name(n) for n in parts):
            raise FormatError(f"{where} names malformed parts")
        return Relay(reports, parts, own)


@dataclass(frozen=True)
class Settled:
    """Rank 0's word on one restore epoch's RAM-tier steps: every step up to `settled` is
    decided, and `kept` are those still committed (coord/news.py)."""

    epoch: int
    settled: int
    kept: frozenset[int]

    def encode(self) -> bytes:
        w = _Writer(Kind.NEWS)
        w.u64(self.epoch)
        w.u64(self.settled)
        w.u64(len(self.kept))
        for step in sorted(self.kept):
            w.u64(step)
        return w.data()

    @staticmethod
    def decode(data: bytes, where: str = "the RAM tier's commit news") -> Settled:
        r = _Reader(data, Kind.NEWS, where)
        epoch, settled = r.u64(), r.u64()
        kept = frozenset(r.u64(settled) for _ in range(r.u64(MAX_COUNT)))
        r.end()
        return Settled(epoch, settled, kept)


def _write_reports(w: _Writer, reports: dict[int, str]) -> None:
    w.u64(len(reports))
    for rank, text in reports.items():
        w.u64(rank)
        w.text(text)


def _read_reports(r: _Reader) -> dict[int, str]:
    return {r.u64(MAX_INT): r.text() for _ in range(r.u64(MAX_COUNT))}

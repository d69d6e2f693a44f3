"""A node's heartbeat slots: one file on the node's board (coord/nodelocal.py), with a
fixed slot for each rank of the node, written in place: a rank writes its beat with one
`pwrite`, the leader reads the node's with one `pread`.

A slot is a header (magic, payload length, CRC-32 of the payload) and the packed beat.
A tmpfs read takes no lock against a write, so a slot can be seen half written: one whose
checksum fails is read once more, then it is silence for this round, as is anything
malformed (the judges take a missing beat for no news). Slots are untrusted input.

    slots = board.beats(node_ranks)      # every rank of the node, the same list
    slots.write(rank, beat)              # each rank, each interval
    slots.read(others)                   # the leader: {rank: Beat or None}
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from collections.abc import Iterable, Sequence

from ftkit.coord.judge import Beat
from ftkit.errors import FtkitError
from ftkit.tiers.localfs import open_regular

NAME = "beats.bin"
SLOT_BYTES = 512  # a beat is ~40 bytes and its host id (tens of bytes, at most MAX_HOST)
_HEADER = struct.Struct("<4sII")  # magic, payload length, CRC-32 of the payload
_MAGIC = b"ftb1"
_ROOM = SLOT_BYTES - _HEADER.size
# A beat: seq, step, busy, interval (NaN: none), pid (0: none), flags, the host id's length.
_BEAT = struct.Struct("<qqddIBH")
_START = struct.Struct("<Q")  # after the host id, only with _HAS_START (older beats lack it): process start
_DONE, _FAILED, _PREEMPT, _STOPPED, _HAS_STEP, _HAS_START, _WAITING = 1, 2, 4, 8, 16, 32, 64
MAX_HOST = _ROOM - _BEAT.size - _START.size


class BeatSlots:
    """The heartbeat slots of one node's ranks: `ranks[i]` (ascending, as every rank lists them) owns slot i."""

    def __init__(self, board_path: str, ranks: Sequence[int]):
        self.path = os.path.join(board_path, NAME)
        self._slot = {r: i for i, r in enumerate(ranks)}
        self._bytes = len(self._slot) * SLOT_BYTES

    def write(self, rank: int, beat: Beat) -> None:
        """`rank`'s slot holds `beat` (one pwrite; the file is made by whoever writes first)."""
        payload = pack_beat(beat)
        record = _HEADER.pack(_MAGIC, len(payload), zlib.crc32(payload)) + payload
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        try:
            os.pwrite(fd, record, self._slot[rank] * SLOT_BYTES)
        finally:
            os.close(fd)

    def read(self, ranks: Iterable[int]) -> dict[int, Beat | None]:
        """The latest beat in each of `ranks`' slots; None where there is none, or it is malformed or torn."""
        data = self._read()
        beats, torn = {}, []
        for r in ranks:
            beats[r], again = _decode(data, self._slot.get(r))
            if again:
                torn.append(r)
        if torn:
            data = self._read()
            for r in torn:
                beats[r], _ = _decode(data, self._slot[r])
        return beats

    def read_one(self, rank: int) -> Beat | None:
        return self.read([rank])[rank]

    def _read(self) -> bytes:
        try:
            with open_regular(self.path, NAME) as f:
                return f.read(self._bytes)
        except (OSError, FtkitError):
            return b""


def _decode(data: bytes, slot: int | None) -> tuple[Beat | None, bool]:
    """(the slot's beat or None, whether it looked torn: worth reading again)."""
    if slot is None:
        return None, False
    at = slot * SLOT_BYTES
    if len(data) < at + _HEADER.size:
        return None, False
    magic, length, crc = _HEADER.unpack_from(data, at)
    if magic != _MAGIC:
        return None, False
    payload = data[at + _HEADER.size : at + _HEADER.size + length]
    if length > _ROOM or len(payload) != length or zlib.crc32(payload) != crc:
        return None, True
    return unpack_beat(payload), False


def pack_beat(beat: Beat) -> bytes:
    host = (beat.host_id or "").encode()
    if len(host) > MAX_HOST:
        raise ValueError(f"a host id of {len(host)} bytes does not fit a {SLOT_BYTES}-byte heartbeat slot")
    flags = (
        (_DONE if beat.done else 0)
        | (_FAILED if beat.failed else 0)
        | (_PREEMPT if beat.preempt else 0)
        | (_STOPPED if beat.stopped else 0)
        | (_HAS_STEP if beat.step is not None else 0)
        | (_HAS_START if beat.start is not None else 0)
        | (_WAITING if beat.waiting else 0)
    )
    nan = math.nan
    busy, interval = beat.busy, beat.interval
    fields = (beat.seq, beat.step or 0, nan if busy is None else busy, nan if interval is None else interval)
    start = _START.pack(beat.start) if beat.start is not None else b""
    return _BEAT.pack(*fields, beat.pid or 0, flags, len(host)) + host + start


def unpack_beat(payload: bytes) -> Beat | None:
    """The beat in `payload`, or None if it is malformed; a field out of its range reads as unknown."""
    if len(payload) < _BEAT.size:
        return None
    seq, step, busy, interval, pid, flags, host_len = _BEAT.unpack_from(payload)
    end = _BEAT.size + host_len
    if not 0 <= seq <= 2**62 or len(payload) != end + (_START.size if flags & _HAS_START else 0):
        return None
    (start,) = _START.unpack_from(payload, end) if flags & _HAS_START else (None,)
    try:
        host_id = payload[_BEAT.size : end].decode() or None
    except UnicodeDecodeError:
        host_id = None
    return Beat(
        seq,
        step if flags & _HAS_STEP and -1 <= step <= 2**62 else None,
        busy if 0.0 <= busy <= 1e9 else None,  # (NaN fails both)
        interval if 0.0 <= interval <= 1e9 else None,
        pid if 1 <= pid <= 2**31 else None,
        host_id,
        bool(flags & _DONE),
        bool(flags & _FAILED),
        bool(flags & _PREEMPT),
        bool(flags & _STOPPED),
        start if start is not None and start < 2**62 else None,
        bool(flags & _WAITING),
    )

"""A node's heartbeat slots (ftkit/coord/beatslots.py): each rank writes its own slot of one
file in place; the leader reads them all at once, and anything torn, malformed or planted
reads as silence, never as another beat."""

from __future__ import annotations

import math
import os
import struct
import threading
import zlib

import pytest

from ftkit.coord.beatslots import MAX_HOST, NAME, SLOT_BYTES, BeatSlots, pack_beat, unpack_beat
from ftkit.coord.judge import Beat
from ftkit.coord.nodelocal import NodeBoard

RANKS = [8, 9, 10, 11]  # the node's ranks (not from 0: a slot is the rank's place in this list)
HOST = "node-17.cluster/0f3c9d1e-5b8a-4c2e-9e61-2d7f4a1b8c90/pid:[4026531836]"


def test_each_rank_writes_its_slot_and_the_leader_reads_them_all(tmp_path):
    beats = {r: Beat(r * 3, 100 + r, 0.05, 0.1, pid=4000 + r, host_id=HOST) for r in RANKS}
    for r in (10, 8, 11):  # in any order, each through its own view of the file
        BeatSlots(str(tmp_path), RANKS).write(r, beats[r])
    leader = BeatSlots(str(tmp_path), RANKS)
    assert leader.read([9, 10, 11]) == {9: None, 10: beats[10], 11: beats[11]}  # 9: none yet, not a zeroed one
    BeatSlots(str(tmp_path), RANKS).write(10, Beat(99, 7))  # a later, shorter beat
    assert leader.read_one(10) == Beat(99, 7)
    assert leader.read_one(8) == beats[8]
    assert os.path.getsize(tmp_path / NAME) <= len(RANKS) * SLOT_BYTES
    assert leader.read_one(12) is None  # not a rank of this node


@pytest.mark.parametrize(
    "beat",
    [
        Beat(0),
        Beat(2**62, -1, 0.0, 1e9, 2**31, "", done=True, failed=True, preempt=True, stopped=True, waiting=True),
        Beat(5, None, None, 0.25, None, "h" * MAX_HOST, stopped=True),
        Beat(6, 2**40, 1.5e-7, None, 1, "hôte/ß/pid:[1]"),
    ],
)
def test_every_field_of_a_beat_comes_back_as_written(beat):
    expected = beat if beat.host_id else Beat(**{**{f: getattr(beat, f) for f in beat.__slots__}, "host_id": None})
    assert unpack_beat(pack_beat(beat)) == expected


def test_each_field_out_of_its_range_reads_as_unknown_and_a_bad_frame_as_no_beat():
    good = pack_beat(Beat(3, 4, 0.1, 0.2, 55, "h"))
    fields = struct.Struct("<qqddIBH")

    def forged(**changes):
        seq, step, busy, interval, pid, flags, n = fields.unpack_from(good)
        values = {"seq": seq, "step": step, "busy": busy, "interval": interval, "pid": pid, "flags": flags, "n": n}
        values.update(changes)
        return fields.pack(*values.values()) + good[fields.size :]

    assert unpack_beat(forged(busy=math.nan, interval=-1.0, pid=0, step=-7)) == Beat(3, None, None, None, None, "h")
    assert unpack_beat(forged(busy=math.inf, interval=2e9, pid=2**32 - 1)) == Beat(3, 4, None, None, None, "h")
    assert unpack_beat(forged(flags=0)) == Beat(3, None, 0.1, 0.2, 55, "h")  # no step given
    assert unpack_beat(forged(seq=-1)) is None
    assert unpack_beat(forged(n=2)) is None  # the host id's length disagrees with the bytes
    assert unpack_beat(good[:10]) is None
    assert unpack_beat(good[:-1] + b"\xff").host_id is None  # not UTF-8: the host is unknown, not a crash


def _slot_bytes(payload: bytes, crc: int | None = None, length: int | None = None) -> bytes:
    size = len(payload) if length is None else length
    return struct.pack("<4sII", b"ftb1", size, zlib.crc32(payload) if crc is None else crc) + payload


@pytest.mark.parametrize(
    "planted",
    [
        _slot_bytes(pack_beat(Beat(5)), crc=1),  # checksum fails (torn, and still torn when read again)
        _slot_bytes(pack_beat(Beat(5)), length=SLOT_BYTES * 4),  # a length past the slot
        _slot_bytes(b'{"seq": 5}'),  # intact, but no beat
        b"ftb2" + b"\0" * 20,  # another format's magic
        b"\xff" * 7,  # shorter than a header
    ],
)
def test_a_malformed_slot_is_silence_and_the_other_slots_still_read(tmp_path, planted):
    slots = BeatSlots(str(tmp_path), RANKS)
    slots.write(8, Beat(1))
    slots.write(10, Beat(3))
    with open(tmp_path / NAME, "r+b") as f:
        f.seek(1 * SLOT_BYTES)  # rank 9's slot
        f.write(planted)
    assert slots.read(RANKS) == {8: Beat(1), 9: None, 10: Beat(3), 11: None}


def test_a_slot_torn_at_the_first_read_is_read_again(tmp_path, monkeypatch):
    slots = BeatSlots(str(tmp_path), RANKS)
    slots.write(9, Beat(2, host_id=HOST))
    whole = (tmp_path / NAME).read_bytes()
    torn = whole[: SLOT_BYTES + 60] + b"X" + whole[SLOT_BYTES + 61 :]  # a byte of the host id not yet copied
    reads = iter([torn, whole])
    monkeypatch.setattr(slots, "_read", lambda: next(reads))
    assert slots.read([9]) == {9: Beat(2, host_id=HOST)}


def test_a_reader_racing_a_writer_sees_only_whole_beats(tmp_path):
    """Beats of different lengths written as fast as possible while the leader reads: every
    read is one of the written beats, or silence, never a mix of two."""
    writer, reader = BeatSlots(str(tmp_path), RANKS), BeatSlots(str(tmp_path), RANKS)
    beats = [Beat(i, i * 10, i / 100, i / 50, 100 + i, "x" * (i % 7 * 40 + 1)) for i in range(50)]
    writer.write(11, beats[0])
    stop = threading.Event()

    def write_forever():
        i = 0
        while not stop.is_set():
            writer.write(11, beats[i % len(beats)])
            i += 1

    t = threading.Thread(target=write_forever)
    t.start()
    try:
        seen = [reader.read_one(11) for _ in range(20000)]
    finally:
        stop.set()
        t.join()
    assert all(b is None or b == beats[b.seq] for b in seen)
    assert sum(b is not None for b in seen) > len(seen) // 2


def test_a_link_or_a_directory_in_place_of_the_file_is_never_used(tmp_path):
    target = tmp_path / "elsewhere"
    planted = _slot_bytes(pack_beat(Beat(1))).ljust(SLOT_BYTES, b"\0") * 4
    target.write_bytes(planted)
    board = tmp_path / "board"
    board.mkdir()
    (board / NAME).symlink_to(target)
    slots = BeatSlots(str(board), RANKS)
    assert slots.read(RANKS) == dict.fromkeys(RANKS)  # the link is not followed
    with pytest.raises(OSError):
        slots.write(8, Beat(2))
    assert target.read_bytes() == planted  # and not written through
    (board / NAME).unlink()
    (board / NAME).mkdir()
    assert slots.read(RANKS) == dict.fromkeys(RANKS)


def test_a_host_id_too_long_for_a_slot_is_refused_before_anything_is_written(tmp_path):
    slots = BeatSlots(str(tmp_path), RANKS)
    slots.write(9, Beat(1))
    with pytest.raises(ValueError, match="does not fit"):
        slots.write(8, Beat(2, host_id="h" * (MAX_HOST + 1)))
    assert slots.read(RANKS) == {8: None, 9: Beat(1), 10: None, 11: None}


def test_the_board_goes_once_every_rank_of_the_node_wrote_its_stopped_beat(tmp_path, monkeypatch):
    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "ram"))
    board = NodeBoard("scope", "node0", leader=True)
    slots = board.beats(RANKS)
    for r in RANKS[:-1]:
        slots.write(r, Beat(1, done=True, stopped=True))
    slots.write(RANKS[-1], Beat(1))  # still running
    board.remove_when_all_stopped(RANKS)
    assert os.path.isdir(board.path)
    slots.write(RANKS[-1], Beat(2, done=True, stopped=True))
    board.remove_when_all_stopped(RANKS)
    assert not os.path.exists(board.path)


def test_the_last_board_of_a_job_removed_takes_the_jobs_emptied_directories_with_it(tmp_path, monkeypatch):
    # (every multi-rank run left hb/<job>/<attempt>/ and commit/<job>/<attempt>/ behind in /dev/shm)
    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "ram"))
    monkeypatch.setenv("MASTER_PORT", "29500")
    node0, node1 = NodeBoard("scope", "node0", leader=True), NodeBoard("scope", "node1", leader=True)
    monkeypatch.setenv("MASTER_PORT", "29501")  # another job on this host
    other = NodeBoard("scope", "node0", leader=True)
    hb = os.path.dirname(os.path.dirname(os.path.dirname(node0.path)))
    node0.remove()
    assert os.path.isdir(node1.path)  # the job's other node on this host keeps its board
    node1.remove()
    job = os.path.dirname(os.path.dirname(node1.path))
    assert not os.path.exists(job) and os.path.isdir(other.path)
    assert os.listdir(hb) == [os.path.basename(os.path.dirname(os.path.dirname(other.path)))]
    NodeBoard("scope", "node0", leader=True).remove()  # (its parents made again, then removed)
    assert os.listdir(hb) == []


def test_a_board_write_that_cannot_land_leaves_no_temporary_file(tmp_path, monkeypatch):
    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "ram"))
    board = NodeBoard("scope", "node0", leader=True)
    board.write("verdict.json", {"v": 1})
    assert board.read("verdict.json") == {"v": 1}
    os.mkdir(os.path.join(board.path, "preempt.json"))  # the rename onto it fails
    with pytest.raises(OSError):
        board.write("preempt.json", {"p": 1})
    assert sorted(os.listdir(board.path)) == ["preempt.json", "verdict.json"]

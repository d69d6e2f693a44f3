"""The commit's messages (ftkit/commit/messages.py): each decodes to what was encoded, and
anything else (another version, another kind, cut short, bytes left over, a file outside its
step directory, a part of other ranks) is a FormatError that names the message."""

from __future__ import annotations

import struct

import pytest

from ftkit.commit.messages import VERSION, Exchange, Outcome, PartEntry, Record, Relay, Report, Written
from ftkit.errors import FormatError

SUM = "xxh3_64:" + "ab" * 8
PART = PartEntry("part-00002-0badf00d.json", 512, SUM, ((2, 4),))


@pytest.mark.parametrize(
    "record",
    [
        Record(PART, {"rank-00002-aaaaaaaa.data": 64, "rank-00003-bbbbbbbb.data": 0}, 64),
        Record(PART, {}, 0, (), True, ("part-00000-0badf00d.json",)),
        Record.failed(["rank 3: no report within 10s", "é"], {"rank-00002-aaaaaaaa.data": 64}),
    ],
)
def test_a_record_decodes_to_what_was_encoded(record):
    assert Record.decode(record.encode(), (2, 3), "r") == record


def test_the_other_messages_decode_to_what_was_encoded():
    for message in (
        Outcome(("rank 1: replication failed: x",), ("part-00000-0badf00d.json",)),
        Exchange({2: b"line\none\0", 3: b""}, ("part-00002-0badf00d.json", SUM)),
        Exchange({}),
        Exchange({7: Report.failed("x").encode()}),
        Report("rank-00002-aaaaaaaa.data", 64, "ab" * 20, (0, 32), (32, 32), (0, 1), (SUM, SUM), '{"a":1}'),
        Report.failed("no report within 10s", skipped=True),
        Report("rank-00002-aaaaaaaa.data", 0, "ab" * 20),
        Outcome(("",)),
        Relay({0: b"r", 1: b""}, {"part-00000-0badf00d.json": (0, SUM)}, Written(PART, {"rank-00002-a.data": 1}, 1)),
    ):
        assert type(message).decode(message.encode(), "m") == message


def test_a_message_that_is_not_this_version_or_kind_or_is_cut_or_padded_is_refused():
    data = Record(PART, {}, 0).encode()
    with pytest.raises(FormatError, match="the record of node 2 is not a commit message"):
        Record.decode(b'{"part": null}', (2, 3), "the record of node 2")
    with pytest.raises(FormatError, match=f"message version {VERSION + 1}, not {VERSION}"):
        Record.decode(data[:4] + bytes([VERSION + 1]) + data[5:], (2, 3), "r")
    with pytest.raises(FormatError, match="another kind"):
        Outcome.decode(data, "r")
    for cut in range(6, len(data)):
        with pytest.raises(FormatError, match="cut short"):
            Record.decode(data[:cut], (2, 3), "r")
    with pytest.raises(FormatError, match="1 bytes more"):
        Record.decode(data + b"\0", (2, 3), "r")
    with pytest.raises(FormatError, match="fields more than its kind"):  # a number more, framed right
        Outcome.decode(Outcome().encode()[:6] + struct.pack("<I3QIII", 3, 0, 0, 0, 0, 0, 0), "o")


def test_a_forged_record_reads_as_an_error_not_as_a_part():
    with pytest.raises(FormatError, match="no valid part of its ranks"):
        Record.decode(Record(PART, {}, 0).encode(), (2, 3, 4), "r")  # the part of other ranks
    with pytest.raises(FormatError, match="neither a part nor an error"):
        Record.decode(Record(None, {}, 0).encode(), (2, 3), "r")
    with pytest.raises(FormatError, match="outside its step directory"):
        Record.decode(Record.failed(["x"], {"../../etc/passwd": 1}).encode(), (2, 3), "r")
    with pytest.raises(FormatError, match="no valid part"):  # a checksum of another form
        Record.decode(Record(PartEntry(PART.file, 1, "md5:00", PART.ranks), {}, 0).encode(), (2, 3), "r")
    with pytest.raises(FormatError, match="names a file outside its step directory"):
        Record.decode(Record(PART, {}, 0, others=("../x",)).encode(), (2, 3), "r")
    huge = Record.failed(["x"]).encode()[:6] + struct.pack("<I", 1 << 30)  # 2**30 numbers announced
    with pytest.raises(FormatError, match="1073741824 numbers"):
        Record.decode(huge, (2, 3), "r")
    with pytest.raises(FormatError, match="strings, not the"):  # a file name holding a NUL
        Record.decode(Record.failed(["x"], {"a.data\0b.data": 1}).encode(), (2, 3), "r")

"""A rank's report (commit/messages.py Report) with its layout sent once by name
(commit/layouts.py), and the node's part built of the reports (commit/parts.py). What a
receiver reads must be what the rank wrote, a replica holder must rebuild its source's
part byte for byte, and anything forged reads as that rank's error."""

from __future__ import annotations

import json

import pytest

from ftkit.commit import parts
from ftkit.commit.layouts import Layout, board_name, from_board, layout_of, lookup
from ftkit.commit.memo import CommitMemo
from ftkit.commit.messages import Report
from ftkit.commit.parts import build_part
from ftkit.commit.reports import RankReport, decode_report
from ftkit.errors import FormatError
from ftkit.format import codec
from ftkit.format.manifest import Chunk, Shard, TensorEntry
from ftkit.save.write import RankWrite

WORLD = 4


def _write(rank: int, token: str, step: int = 0, names=("w", "b"), compressed: bool = False, at: int = 64) -> RankWrite:
    """Rank `rank`'s write of two 16-float tensors, sharded 4 ways; checksums vary by step,
    and so do a compressed write's places in its file."""
    file = f"rank-{rank:05d}-{token}.data"
    tensors = []
    for i, name in enumerate(names):
        offset, length = (40 * i + step, 40) if compressed else (at * i, 64)
        chunk = Chunk(
            file, offset, length, 0, 64, "zstd" if compressed else "raw", f"xxh3_64:{step * 100 + rank * 10 + i:016x}"
        )
        tensors.append(TensorEntry(name, "float32", (64,), (Shard((16 * rank,), (16,), (chunk,), rank),), "sharded"))
    return RankWrite(rank, file, 128, tuple(tensors))


def _chunks(write: RankWrite) -> list[tuple[str, int, int, str]]:
    return [(t.name, c.offset, c.length, c.checksum) for t in write.tensors for s in t.shards for c in s.chunks]


@pytest.mark.parametrize("compressed", [False, True])
def test_a_report_reads_as_the_write_and_its_layout_goes_once(compressed):
    memo = CommitMemo()
    state = {"rng": {"python": {"$tensor": "_rng/r1/python"}}}
    for step in (1, 2, 3):
        write = _write(1, f"{step:08x}", step, compressed=compressed)
        layout, report = layout_of(write, memo, state)
        data = report.encode()
        got = decode_report(1, data, lookup(None, memo))
        assert got.error is None and got.file == write.file and got.nbytes == 128
        assert got.chunks() == _chunks(write) and got.state == state
        assert len(data) < len(layout.body)  # the values only: the layout goes by name
    assert len(memo.sent) == 1  # one layout for the three steps


def test_a_layout_holds_no_per_step_value_and_a_new_structure_is_a_new_layout():
    memo = CommitMemo()
    raw, _ = layout_of(_write(1, "aaaaaaaa", 1), memo)
    packed, _ = layout_of(_write(1, "bbbbbbbb", 2, compressed=True), CommitMemo())
    assert raw.digest == packed.digest  # the same tensors: compression changes only the values
    assert "aaaaaaaa" not in raw.body and "xxh3" not in raw.body
    renamed, _ = layout_of(_write(1, "cccccccc", names=("w", "c")), memo)
    assert renamed.digest != raw.digest


def test_layout_bodies_hash_to_their_names_and_have_the_shape_of_a_layout():
    layout, _ = layout_of(_write(1, "aaaaaaaa"), CommitMemo())
    assert Layout.of_body(layout.body, layout.digest) == layout and len(layout.chunk_names) == 2
    with pytest.raises(FormatError, match="does not hash to its name"):
        Layout.of_body(layout.body + " ", layout.digest)
    for body in ('{"w": 1}', '[{"name": "w"}]', "[1]", "not json"):
        with pytest.raises(FormatError, match="layout"):
            Layout.of_body(body)


def test_a_layout_is_fetched_once_and_a_forged_body_is_not_taken():
    layout, report = layout_of(_write(2, "aaaaaaaa"), CommitMemo())
    data = report.encode()
    memo = CommitMemo()  # a receiver that has never seen it
    fetched = []
    forged = layout.body.replace('"float32"', '"float16"')
    bad = decode_report(2, data, lookup(lambda _, d: fetched.append(d) or forged.encode(), memo))
    assert bad.file is None and "which was not to be found" in (bad.error or "")
    good = decode_report(2, data, lookup(lambda _, d: fetched.append(d) or layout.body.encode(), memo))
    assert good.error is None and good.layout == layout
    assert decode_report(2, data, lookup(lambda _, d: None, CommitMemo()), None).error is not None
    assert decode_report(2, data, lookup(lambda _, d: None, memo)).error is None  # kept: no second fetch
    assert fetched == [layout.digest, layout.digest]


def _forge(report: Report, **change) -> bytes:
    return Report(**{**report.__dict__, **change}).encode()


@pytest.mark.parametrize(
    "change, why",
    [
        (
            lambda r: _forge(
                r, offsets=r.offsets[:1], lengths=r.lengths[:1], codecs=r.codecs[:1], checksums=r.checksums[:1]
            ),
            "1 chunks for a layout of 2",
        ),
        (lambda r: _forge(r, checksums=(r.checksums[0], r.checksums[1] + "\n")), "malformed checksum"),
        (lambda r: _forge(r, checksums=(r.checksums[0], "md5:00")), "malformed checksum"),
        (lambda r: _forge(r, layout=r.layout[:-1] + "G"), "malformed layout"),
        (lambda r: _forge(r, layout="0" * 40), "which was not to be found"),
        (lambda r: _forge(r, layout=None), "names a file but no layout"),
        (lambda r: _forge(r, nbytes=100), "beyond its 100-byte file"),  # 128 bytes of chunks in 100
        (lambda r: _forge(r, offsets=(), lengths=(), codecs=(), checksums=()), "no chunk for its 128-byte file"),
        (lambda r: _forge(r, codecs=(0, 9)), "malformed chunks"),
        (lambda r: _forge(r, file="../escaped.data"), "outside its step directory"),
        (lambda r: _forge(r, state="[1, 2]"), "rank state that is not an object"),
        (lambda r: _forge(r, state="{"), "not valid JSON"),
        (lambda r: r.encode()[:-3], "cut short"),
        (lambda r: b'{"file": "rank-00003-aaaaaaaa.data"}\n', "not a commit message"),
    ],
)
def test_a_forged_report_reads_as_that_ranks_error(change, why):
    memo = CommitMemo()
    _, report = layout_of(_write(3, "aaaaaaaa"), memo)
    got = decode_report(3, change(report), lookup(None, memo))
    assert got.file is None and "unreadable report" in (got.error or "") and why in (got.error or "")


def test_a_collector_reads_its_ranks_layouts_from_the_board(tmp_path, monkeypatch):
    """A rank sends its layout once per connection, ahead of its reports; its collector takes
    it from its mailbox and keeps it. One it never got reads as that rank's error, not a hang."""
    from ftkit.coord.nodelocal import NodeBoard

    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path))
    collector = NodeBoard("scope", "node0", True, "t", kind="commit")
    rank = NodeBoard("scope", "node0", False, "t", kind="commit")
    collector.mailbox(0)
    layout, report = layout_of(_write(1, "aaaaaaaa"), CommitMemo())
    data = report.encode()
    memo = CommitMemo()
    assert "not to be found" in (decode_report(1, data, lookup(from_board(collector, 0), memo)).error or "")
    rank.send_once(board_name(layout.digest), layout.body.encode(), [0])
    rank.send_once(board_name(layout.digest), layout.body.encode(), [0])  # (once per connection)
    rank.send("0-1-w-r1.json", data, [0])
    assert collector.collect({1: "0-1-w-r1.json"}, 5.0, 1 << 20, 0) == {1: data}
    assert decode_report(1, data, lookup(from_board(collector, 0), memo)).error is None
    assert decode_report(1, data, lookup(None, memo)).error is None  # kept
    assert collector.take(board_name(layout.digest), 0, 1 << 20) is None  # taken once, sent once


def _node(step: int, memo: CommitMemo, state=None) -> tuple[dict[int, bytes], list[RankReport]]:
    """Ranks 0 and 1's reports of `step` as sent, and as their collector holds them."""
    sent, held = {}, []
    for r in (0, 1):
        layout, report = layout_of(_write(r, f"{step:07x}{r}", step), memo, state)
        sent[r] = report.encode()
        held.append(RankReport(r, report, layout))
    return sent, held


def test_a_replica_holder_rebuilds_its_sources_part_byte_for_byte(tmp_path):
    """The node's exchange carries its reports and its part's name and checksum; the holder of
    its replicas rebuilds the part from the reports (commit/replicas.py store_parts): the bytes
    its collector wrote, or, when they differ from the checksum, an error and no part written.
    The collector's own report is the one it encoded (not parsed back), whose rank state's
    Python form is not its JSON form: the bytes are the same all the same."""
    import ftkit
    from ftkit.commit.node import NodeGroup
    from ftkit.commit.plan import RAM
    from ftkit.commit.replicas import store_parts
    from ftkit.coord.dist import DistContext

    memo = CommitMemo()
    holder = ftkit.Tier(str(tmp_path / "node1")).open()
    group = NodeGroup.of(DistContext(2, WORLD, None, "node1", 10.0, ["node0", "node0", "node1", "node1"]), None, RAM, 1)
    state = {
        "rng": {"numpy": {"$tuple": ("MT19937", 623, 0.0)}},
        "local": {"x": {"kind": "stateful", "value": {"a": (1.5, None, True)}}},
    }
    for step in (1, 2):
        sent, held = _node(step, memo, state)
        name, data, files = build_part(step, held, WORLD, memo)
        assert files == {f"rank-{r:05d}-{step:07x}{r}.data": 128 for r in (0, 1)}
        written = store_parts(holder, step, {name: (0, codec.checksum(data))}, sent, group, WORLD, lookup(None, memo))
        assert written == [name]
        assert (tmp_path / "node1" / f"step-{step:012d}" / name).read_bytes() == data
    with pytest.raises(ftkit.StorageError, match="differs from its leader's"):
        store_parts(
            holder, 3, {"part-00000-0badf00d.json": (0, "xxh3_64:" + "0" * 16)}, sent, group, WORLD, lookup(None, memo)
        )
    assert not (tmp_path / "node1" / "step-000000000003" / "part-00000-0badf00d.json").exists()


def test_a_part_is_the_layout_line_between_the_steps_head_and_values(tmp_path):
    from ftkit.format.part import decode_part

    memo = CommitMemo()
    lines = set()
    for step in (1, 2):
        _, held = _node(step, memo)
        _, data, _ = build_part(step, held, WORLD, memo)
        head, layout, values = data.split(b"\n")[:3]
        lines.add(layout)
        doc = decode_part(data, "the part")
        got = [
            (t["name"], c["offset"], c["length"], c["checksum"])
            for t in doc["tensors"]
            for s in t["shards"]
            for c in s["chunks"]
        ]
        want = [c for r in held for c in r.chunks()]  # merged: w's shards (rank 0, 1), then b's
        assert sorted(got) == sorted(want) and [g[0] for g in got] == ["w", "w", "b", "b"]
        assert json.loads(head)["step"] == step and doc["files"][held[1].file] == {"bytes": 128, "rank": 1}
    assert len(lines) == 1  # the same layout line at both steps


def test_a_part_of_a_geometry_checked_before_is_not_checked_again_but_another_is(monkeypatch):
    """Every collector checks the part it builds as a reader checks one; a part of the layouts
    and geometry it checked before (only file tokens and checksums differ, which decoding
    checked) passes at once. Chunks that overlap in a file make another geometry: checked, refused."""
    full = []
    real = parts.check_part
    monkeypatch.setattr(parts, "check_part", lambda data, *a: full.append(a[0]) or real(data, *a))
    memo = CommitMemo()
    for step in (1, 2, 3):
        _, held = _node(step, memo)
        build_part(step, held, WORLD, memo)
    assert full == [1]
    layout, report = layout_of(_write(1, "0000000b", 4, at=0), memo)  # both chunks at offset 0
    _, held = _node(4, memo)
    with pytest.raises(FormatError, match="the part of ranks 0-1 of step 4"):
        build_part(4, [held[0], RankReport(1, report, layout)], WORLD, memo)
    with pytest.raises(FormatError):  # refused again: a refused part is never remembered as checked
        build_part(4, [held[0], RankReport(1, report, layout)], WORLD, memo)
    assert full == [1, 4, 4]


def test_a_collector_refuses_to_write_a_part_for_another_nodes_rank(tmp_path):
    """Node 0's collector (ranks 0 and 1) is given, as rank 1's report, one whose shards are
    rank 2's: the part is refused, nothing is written."""
    memo = CommitMemo()
    _, held = _node(1, memo)
    layout, report = layout_of(_write(2, "0000000c", 1), memo)
    with pytest.raises(FormatError, match="another part"):
        build_part(1, [held[0], RankReport(1, report, layout)], WORLD, memo)


def test_a_step_not_committed_names_the_first_errors_once_each_and_counts_them():
    """At 2,048 nodes a store that fails every record would give 2,048 errors: the failure names
    eight, each once, and says how many there were."""
    import pytest

    from ftkit.commit.messages import Record
    from ftkit.commit.shared import raise_if_failed
    from ftkit.errors import StorageError

    records = [Record.failed([f"node of rank {8 * n}: no record within 120s"]) for n in range(20)]
    records += [Record.failed(["unreadable records: cut short"])] * 3
    with pytest.raises(StorageError) as e:
        raise_if_failed(5, "the RAM tier", records, ["rank 0: replication failed"])
    text = str(e.value)
    assert text.startswith("step 5 not committed to the RAM tier: node of rank 0: no record within 120s; ")
    assert text.count("no record") == 8 and "node of rank 64:" not in text
    assert text.endswith("(22 errors in all)")  # 20 nodes, the unreadable records once, rank 0's own
    raise_if_failed(5, "the RAM tier", [Record.failed([])])  # no error: committed


def test_a_collector_deletes_a_layout_from_the_store_once_no_partner_can_still_read_it():
    """A node's bodies are in the store under its leader (layout/<leader>/<name>). One its
    reports stop naming goes after a step whose partner reports are all writes, each sent
    after its rank finished the step before (the last naming it); not while a partner skips
    (it may be behind) or after a failed part (its reports may name any). Named again: set again."""
    import torch.distributed as dist

    from ftkit.commit.layouts import Published, from_store
    from ftkit.commit.plan import RAM, CommitPlan
    from ftkit.coord.dist import DistContext

    nodes = ["node0", "node0", "node1", "node1"]
    ctx = DistContext(3, WORLD, dist.HashStore(), "node1", 1.0, nodes)
    fetch = from_store(ctx.store, CommitPlan.of(nodes, RAM, 1))
    a, b = (layout_of(_write(3, "aaaaaaaa", names=n), CommitMemo())[0] for n in (("w", "b"), ("w", "v")))
    wrote = [layout_of(_write(0, "cccccccc"), CommitMemo())[1].encode()]  # a partner rank's report
    skipped = [wrote[0], Report.failed("no free staging slot", skipped=True).encode()]
    published = Published()

    def held() -> list[Layout]:
        return [x for x in (a, b) if fetch(3, x.digest) == x.body.encode()]

    for layouts, partners, want in [
        ([a], wrote, [a]),
        ([b], skipped, [a, b]),
        ([b], wrote, [b]),
        ([a], skipped, [a, b]),
        ([], wrote, [a, b]),
        ([a], wrote, [a]),
    ]:
        published.publish(ctx, 2, layouts)
        published.retire(ctx, 2, partners)
        assert held() == want, (layouts, want)
    assert fetch(1, a.digest) is None  # another node's namespace

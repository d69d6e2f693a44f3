"""The RAM tier's reports by reference (commit/layouts.py): a rank's tensor layout goes
once, named by its hash; then only its file's name and its checksums. What a receiver reads
must be what the whole report said, and anything forged reads as that rank's error."""

from __future__ import annotations

import json

import pytest

from ftkit.commit import part_template, reports
from ftkit.commit.layouts import Layout, board_name, from_board, layout_of, lookup
from ftkit.commit.memo import CommitMemo
from ftkit.commit.reports import NodeReport, decode_report
from ftkit.format import codec
from ftkit.format.manifest import Chunk, Shard, TensorEntry
from ftkit.save.write import RankWrite

WORLD = 4


def _write(rank: int, token: str, step: int = 0, names=("w", "b"), elsewhere: bool = False) -> RankWrite:
    """Rank `rank`'s write of two 16-float tensors, sharded 4 ways; checksums vary by step."""
    file = f"rank-{rank:05d}-{token}.data"
    tensors = []
    for i, name in enumerate(names):
        chunk_file = f"rank-{rank:05d}-0ther000.data" if elsewhere and i else file
        chunk = Chunk(chunk_file, 64 * i, 64, 0, 64, "raw", f"xxh3_64:{step * 100 + rank * 10 + i:016x}")
        tensors.append(TensorEntry(name, "float32", (64,), (Shard((16 * rank,), (16,), (chunk,), rank),), "sharded"))
    return RankWrite(rank, file, 128, tuple(tensors))


def _fresh() -> CommitMemo:
    """A tier's commit that has seen no layout and decoded no report."""
    return CommitMemo()


def test_a_report_by_reference_reads_as_the_whole_report(monkeypatch):
    memo = _fresh()
    for step in (1, 2, 3):
        write = _write(1, f"{step:08x}", step)
        ref = layout_of(write, memo)
        assert ref is not None
        by_ref = NodeReport.encode(write, None, {"python": None}, ref=ref)
        whole = NodeReport.encode(write, None, {"python": None})
        assert len(by_ref) < len(whole) / 2 and by_ref.endswith("\n")
        a, b = decode_report(1, by_ref, WORLD, lookup(None, memo)), decode_report(1, whole, WORLD)
        assert a.error is None and b.error is None
        assert a.tensors() == b.tensors() and a.checksums() == b.checksums() and a.chunks() == b.chunks()
        assert a.write_doc() == b.write_doc() == write.to_json()
    assert len(memo.sent) == 1  # one layout for the three steps


def test_a_new_structure_is_a_new_layout_and_markers_in_names_go_whole(monkeypatch):
    memo = _fresh()
    one, two = layout_of(_write(1, "aaaaaaaa"), memo), layout_of(_write(1, "bbbbbbbb", names=("w", "c")), memo)
    assert one is not None and two is not None and one[0].digest != two[0].digest
    assert layout_of(_write(1, "cccccccc", names=("w", "@ftkit-sum@")), memo) is None  # sent whole, not confused
    assert layout_of(_write(1, "dddddddd", elsewhere=True), memo) is None  # a chunk in another file


def test_a_layout_is_fetched_once_and_a_forged_body_is_not_taken(monkeypatch):
    memo = _fresh()
    write = _write(2, "aaaaaaaa")
    ref = layout_of(write, memo)
    assert ref is not None
    layout = ref[0]
    text = NodeReport.encode(write, None, None, ref=ref)
    memo = _fresh()  # a receiver that has never seen it
    fetched = []
    forged = layout.body.replace('"float32"', '"float16"')

    def fetch(digest: str) -> bytes:
        fetched.append(digest)
        return forged.encode()

    bad = decode_report(2, text, WORLD, lookup(fetch, memo))
    assert bad.file is None and "which was not to be found" in (bad.error or "")
    good = decode_report(2, text, WORLD, lookup(lambda d: fetched.append(d) or layout.body.encode(), memo))
    assert good.error is None and good.tensors() == json.loads(NodeReport.encode(write, None, None).split("\n")[1])
    assert decode_report(2, text, WORLD, lookup(lambda d: None, memo)).error is None  # kept: no second fetch
    assert fetched == [layout.digest, layout.digest]


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda h: {**h, "sums": h["sums"][:-1]}, "1 checksums for a layout of 2 chunks"),
        (lambda h: {**h, "sums": [h["sums"][0], h["sums"][1] + "\n"]}, "malformed checksums"),
        (lambda h: {**h, "sums": [h["sums"][0], 7]}, "malformed checksums"),
        (lambda h: {**h, "sums": "xxh3_64:" + "0" * 16}, "malformed checksums"),
        (lambda h: {**h, "layout": h["layout"][:-1] + "G"}, "malformed layout"),
        (lambda h: {**h, "file": None}, "malformed layout"),
        (lambda h: {**h, "layout": "0" * 40}, "which was not to be found"),
    ],
)
def test_a_forged_report_by_reference_reads_as_that_ranks_error(monkeypatch, change, why):
    memo = _fresh()
    write = _write(3, "aaaaaaaa")
    head = json.loads(NodeReport.encode(write, None, None, ref=layout_of(write, memo)))
    got = decode_report(3, json.dumps(change(head)) + "\n", WORLD, lookup(None, memo))
    assert got.file is None and why in (got.error or "")


def test_a_layout_that_does_not_validate_is_refused_at_every_step(monkeypatch):
    """A layout whose chunks run past the file the report names: refused when first used, and
    again at the next step (a refused layout is never remembered as checked)."""
    memo = _fresh()
    write = _write(1, "aaaaaaaa")
    text = NodeReport.encode(write, None, None, ref=layout_of(write, memo))
    short = json.dumps({**json.loads(text), "nbytes": 100}) + "\n"  # 128 bytes of chunks in a 100-byte file
    for _ in range(2):
        with pytest.raises(Exception, match="rank 1's report"):
            decode_report(1, short, WORLD, lookup(None, memo)).tensors()


def test_a_leader_reads_its_ranks_layouts_from_the_board(tmp_path, monkeypatch):
    from ftkit.coord.nodelocal import NodeBoard

    memo = _fresh()
    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path))
    board = NodeBoard("scope", "node0", True, "t", kind="commit")
    write = _write(1, "aaaaaaaa")
    ref = layout_of(write, memo)
    assert ref is not None
    board.post_once(board_name(ref[0].digest), ref[0].body)
    text = NodeReport.encode(write, None, None, ref=ref)
    memo = _fresh()  # the leader's
    assert decode_report(1, text, WORLD, lookup(from_board(board), memo)).error is None
    memo = _fresh()
    (tmp_path / board.path / board_name(ref[0].digest)).unlink()  # gone: the rank's error, not a hang
    assert "not to be found" in (decode_report(1, text, WORLD, lookup(from_board(board), memo)).error or "")
    board.post_once(board_name(ref[0].digest), ref[0].body)  # posted again, since it is gone
    assert decode_report(1, text, WORLD, lookup(from_board(board), memo)).error is None


def test_a_replica_holder_rebuilds_its_sources_part_byte_for_byte(tmp_path, monkeypatch):
    """The node's record carries its reports and its part's name and checksum; the holder of
    its replicas rebuilds the part from the reports (commit/replicas.py store_parts): the bytes
    its leader wrote, or, when they differ from the checksum, an error and no part written."""
    import ftkit
    from ftkit.commit.node import NodeGroup
    from ftkit.commit.plan import RAM
    from ftkit.commit.replicas import store_parts
    from ftkit.coord.dist import DistContext

    memo = _fresh()
    leader = ftkit.Tier(str(tmp_path / "node0")).open()
    holder = ftkit.Tier(str(tmp_path / "node1")).open()
    group = NodeGroup.of(DistContext(2, WORLD, None, "node1", 10.0, ["node0", "node0", "node1", "node1"]), None, RAM, 1)
    for step in (1, 2):
        writes = [_write(r, f"{step:07x}{r}", step) for r in (0, 1)]
        texts = {w.rank: NodeReport.encode(w, None, {"python": [step]}, ref=layout_of(w, memo)) for w in writes}
        reports = [decode_report(r, texts[r], WORLD, lookup(None, memo)) for r in (0, 1)]
        name, data, _ = part_template.node_part_bytes(leader, step, reports, (0, 1), WORLD, memo)
        written = store_parts(holder, step, {name: (0, codec.checksum(data))}, texts, group, WORLD, lookup(None, memo))
        assert written == [name]
        assert (tmp_path / "node1" / f"step-{step:012d}" / name).read_bytes() == data
    with pytest.raises(ftkit.StorageError, match="differs from its leader's"):
        store_parts(
            holder, 3, {"part-00000-0badf00d.json": (0, "xxh3_64:" + "0" * 16)}, texts, group, WORLD, lookup(None, memo)
        )
    assert not (tmp_path / "node1" / "step-000000000003" / "part-00000-0badf00d.json").exists()


def test_layout_bodies_hash_to_their_names():
    body = json.dumps([{"name": "w", "shards": [{"chunks": [{"file": "@ftkit-file@", "checksum": "@ftkit-sum@"}]}]}])
    layout = Layout.of_body(body)
    assert Layout.of_body(body, layout.digest) == layout and layout.n_sums == 1
    with pytest.raises(Exception, match="does not hash to its name"):
        Layout.of_body(body + " ", layout.digest)


@pytest.mark.parametrize("by_reference", [True, False])
def test_a_collectors_own_report_kept_unparsed_is_the_report_its_holders_decode(tmp_path, monkeypatch, by_reference):
    """A collector keeps its own report as it encoded it (reports.keep_own) instead of parsing
    its text back: it must be the report decoding that text gives, and the part built of it
    byte for byte the part the replica holders rebuild from the text."""
    import ftkit

    memo = _fresh()
    storage = ftkit.Tier(str(tmp_path / "node0")).open()
    # A rank state whose Python form is not its JSON form (a tuple, an int key, a float).
    state = {"rng": {"numpy": {"$tuple": ("MT19937", 623, 0.0)}, 7: [1.5, None, True]}}
    write = _write(1, "aaaaaaaa", 1)
    ref = layout_of(write, memo) if by_reference else None
    text = NodeReport.encode(write, None, state, ref=ref)
    reports.keep_own(text, write, state, ref, WORLD, memo)
    kept = decode_report(1, text, WORLD, lookup(None, memo), memo)
    other_memo = CommitMemo()  # another rank's: it knows the layout, and decodes the text
    other_memo.layouts = memo.layouts
    parsed = decode_report(1, text, WORLD, lookup(None, other_memo), other_memo)
    assert kept is not parsed and kept.error is None and parsed.error is None
    assert (kept.file, kept.nbytes, kept.layout, kept.sums, kept.tensors_json) == (
        parsed.file,
        parsed.nbytes,
        parsed.layout,
        parsed.sums,
        parsed.tensors_json,
    )
    assert kept.write_doc() == parsed.write_doc() and kept.chunks() == parsed.chunks()
    other = decode_report(0, NodeReport.encode(_write(0, "bbbbbbbb", 1), None, {}), WORLD)
    _, from_kept, _ = part_template.node_part_bytes(storage, 1, [other, kept], (0, 1), WORLD, CommitMemo())
    _, from_text, _ = part_template.node_part_bytes(storage, 1, [other, parsed], (0, 1), WORLD, CommitMemo())
    assert from_kept == from_text

"""Format version 3: a step's manifest as an index of per-node parts (format/index.py).

A step saved by 4 ranks on 2 nodes is built for real (`ftkit restore --world-size 4
--out`, then its part split by node the way two node leaders write it), read back
whole, and then attacked across parts: a part speaking for another node's ranks,
ranks covered twice or not at all, parts changed, missing, linked, disagreeing.
Steps in the single-document form of version 2 are still read.
"""

from __future__ import annotations

import json
import os
import uuid

import pytest
import torch
import xxhash
from conftest import make_state, run_cli, snapshot_values

import ftkit
from ftkit.commit.manifests import merge_write_docs, write_part
from ftkit.errors import FormatError
from ftkit.format.data import read_tensors
from ftkit.format.manifest import MANIFEST_NAME, manifest_json, step_dir_name
from ftkit.format.reader import load_manifest

NODES = ({0, 1}, {2, 3})


def _runs(ranks):
    return [[min(ranks), max(ranks) + 1]]


def _split(part: dict, ranks: set[int]) -> dict:
    """The part one node's leader would have written: only its ranks' files, shards, RNG."""
    tensors = []
    for t in part["tensors"]:
        shards = [s for s in t["shards"] if s["rank"] in ranks]
        if shards:
            tensors.append({**t, "shards": shards})
    return {
        "format": "ftkit-checkpoint-part",
        "step": part["step"],
        "ranks": _runs(ranks),
        "files": {f: i for f, i in part["files"].items() if i["rank"] in ranks},
        "tensors": tensors,
        "rank_state": {r: v for r, v in part["rank_state"].items() if int(r) in ranks},
    }


def _write_parts(step_dir, index: dict, parts: list[dict], ranks=None) -> None:
    for f in step_dir.glob("part-*.json"):
        f.unlink()
    refs = []
    for i, p in enumerate(parts):
        data = json.dumps(p).encode()
        name = f"part-{i:05d}-{uuid.uuid4().hex[:8]}.json"
        (step_dir / name).write_bytes(data)
        r = ranks[i] if ranks else p["ranks"]
        refs.append({"file": name, "bytes": len(data), "checksum": "xxh3_64:" + xxhash.xxh3_64_hexdigest(data)})
        refs[-1]["ranks"] = r
    (step_dir / MANIFEST_NAME).write_text(json.dumps({**index, "parts": refs}))


@pytest.fixture
def two_nodes(tmp_path):
    """(root, index, [part of node 0, part of node 1], saved values) of a 4-rank step."""
    state = make_state(0, width=32)
    state["grid"] = torch.arange(600, dtype=torch.int64).reshape(20, 30)
    state["big"] = torch.randn(512, 1024)  # 2 MiB: split in row blocks over the 4 ranks, so over both parts
    src = tmp_path / "src"
    with ftkit.Checkpointer(state, [str(src)]) as ck:
        ck.snapshot(1)
    root = tmp_path / "four"
    assert run_cli("restore", str(src), "--out", str(root), "--world-size", "4").returncode == 0
    step_dir = root / step_dir_name(1)
    index = json.loads((step_dir / MANIFEST_NAME).read_text())
    (ref,) = index["parts"]
    whole = json.loads((step_dir / ref["file"]).read_text())
    parts = [_split(whole, n) for n in NODES]
    _write_parts(step_dir, index, parts)
    return root, index, parts, snapshot_values(state)


def _assert_restores(root, values) -> None:
    """A fresh state of the same shapes restores step 1 from `root` with the saved values."""
    state = make_state(1, width=32)
    state["grid"] = torch.zeros(20, 30, dtype=torch.int64)
    state["big"] = torch.zeros(512, 1024)
    with ftkit.Checkpointer(state, [str(root)]) as ck:
        assert ck.restore() == 1
    for name, v in snapshot_values(state).items():
        assert torch.equal(v, values[name]), name


def _load(root):
    return load_manifest(ftkit.Tier(str(root)).open(), 1)


def test_a_step_of_two_parts_reads_whole_and_restores(two_nodes):
    root, index, parts, values = two_nodes
    m = _load(root)
    assert m.format_version == 3 and m.world_size == 4 and len(m.parts) == 2
    assert {f["rank"] for f in m.files.values()} == {0, 1, 2, 3}
    got = read_tensors(ftkit.Tier(str(root)).open(), m)
    _assert_restores(root, values)
    assert got  # every tensor readable directly too
    r = run_cli("verify", str(root))
    assert r.returncode == 0, r.stdout
    r = run_cli("inspect", str(root), "--json")
    assert r.returncode == 0 and len(json.loads(r.stdout)["parts"]) == 2, r.stdout
    assert "manifest in 2 part(s)" in run_cli("inspect", str(root)).stdout


def _refused(root, needle: str) -> None:
    with pytest.raises(FormatError, match=needle):
        _load(root)
    r = run_cli("verify", str(root))
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr


def test_a_part_may_not_speak_for_another_nodes_ranks(two_nodes):
    root, index, parts, _ = two_nodes
    stolen = next(f for f, i in parts[0]["files"].items() if i["rank"] == 0)
    parts[1]["files"][stolen] = {**parts[0]["files"][stolen]}  # node 1 claims rank 0's file
    _write_parts(root / step_dir_name(1), index, parts)
    _refused(root, "another part|listed by two parts")


def test_a_shard_of_another_nodes_rank_is_refused(two_nodes):
    root, index, parts, _ = two_nodes
    parts[1]["tensors"][0]["shards"][0]["rank"] = 0
    _write_parts(root / step_dir_name(1), index, parts)
    _refused(root, "belongs to a rank of another part")


@pytest.mark.parametrize(
    "ranks, needle",
    [
        ([[[0, 2]], [[1, 4]]], "overlap|exactly once"),  # rank 1 twice
        ([[[0, 2]], [[3, 4]]], "exactly once|differ"),  # rank 2 in no part
        ([[[0, 2]], [[2, 5]]], "out of range"),  # a rank past the world
    ],
)
def test_the_parts_cover_every_rank_exactly_once(two_nodes, ranks, needle):
    root, index, parts, _ = two_nodes
    _write_parts(root / step_dir_name(1), index, parts, ranks=ranks)
    _refused(root, needle)


def test_a_changed_missing_or_linked_part_is_refused(two_nodes, tmp_path):
    root, index, parts, _ = two_nodes
    step_dir = root / step_dir_name(1)
    refs = json.loads((step_dir / MANIFEST_NAME).read_text())["parts"]
    p = step_dir / refs[1]["file"]
    data = p.read_bytes()
    p.write_bytes(data.replace(b'"float32"', b'"float64"', 1))  # same size, other bytes
    _refused(root, "checksum")
    p.write_bytes(data + b" ")
    _refused(root, "bytes, not")
    p.unlink()
    _refused(root, "missing")
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes(data)
    os.symlink(outside, p)
    _refused(root, "missing")


def test_parts_that_disagree_about_a_tensor_are_refused(two_nodes):
    root, index, parts, _ = two_nodes
    names = {t["name"] for t in parts[1]["tensors"]}
    other = next(t for t in parts[0]["tensors"] if t["name"] in names)
    other["dtype"] = "float64" if other["dtype"] != "float64" else "float32"
    _write_parts(root / step_dir_name(1), index, parts)
    _refused(root, "another dtype, shape or kind")


def test_parts_that_cover_a_tensor_twice_are_refused(two_nodes):
    root, index, parts, _ = two_nodes
    t0 = next(t for t in parts[0]["tensors"] if t["name"] == "big")
    t1 = next(t for t in parts[1]["tensors"] if t["name"] == "big")
    t1["shards"] = [{**s, "rank": 2} for s in t0["shards"]]  # node 1 repeats node 0's region
    _write_parts(root / step_dir_name(1), index, parts)
    _refused(root, "cover|overlap|more than|volume")


def test_a_leader_refuses_to_write_a_part_for_another_nodes_rank(two_nodes):
    root, index, parts, _ = two_nodes
    storage = ftkit.Tier(str(root)).open()
    m = _load(root)
    write = next(f for f, i in m.files.items() if i["rank"] == 2)
    entries = [{**t, "shards": [s for s in t["shards"] if s["rank"] == 2]} for t in parts[1]["tensors"] if t["shards"]]
    report = {"rank": 2, "file": write, "nbytes": m.files[write]["bytes"], "tensors": entries}
    before = sorted(os.listdir(root / step_dir_name(1)))
    with pytest.raises(FormatError, match="another part"):
        write_part(storage, 1, [report], {}, [0, 1], 4)  # node 0's leader given rank 2's report
    assert sorted(os.listdir(root / step_dir_name(1))) == before  # no part written


def test_the_single_document_of_version_2_is_still_read(two_nodes, tmp_path):
    """A step written before version 3 (as every tier did, the RAM tier until version 3) reads and restores."""
    root, index, parts, values = two_nodes
    step_dir = root / step_dir_name(1)
    whole = [
        {"rank": r, "file": f, "nbytes": i["bytes"], "tensors": _split(parts[r // 2], {r})["tensors"]}
        for p in parts
        for f, i in p["files"].items()
        for r in [i["rank"]]
    ]
    rank_state = {k: v for p in parts for k, v in p["rank_state"].items()}
    for f in step_dir.glob("*.json"):
        f.unlink()
    files = {w["file"]: {"bytes": w["nbytes"], "rank": w["rank"]} for w in whole}
    data = manifest_json(1, 4, merge_write_docs(whole), index["skeleton"], files, rank_state, 0.0, {})
    (step_dir / MANIFEST_NAME).write_bytes(data)
    doc = json.loads((step_dir / MANIFEST_NAME).read_text())
    assert doc["format_version"] == 2 and "tensors" in doc
    assert _load(root).format_version == 2
    _assert_restores(root, values)


def test_a_leaders_part_check_remembers_layouts_and_still_refuses_what_differs(two_nodes, monkeypatch):
    # A leader checks its node's part at every step; from one step to the next only the step,
    # the data files' tokens and the checksums change. The same layout is checked once; a part
    # that differs anywhere else (a shard naming a file the part does not list, a malformed
    # checksum) is checked in full and refused, whatever was checked before.
    from ftkit.format import index as fmt

    _root, _index, parts, _ = two_nodes
    part = parts[0]

    def text(step: int, token: str, checksum: str = "", shard_token: str = "") -> bytes:
        doc = json.dumps({k: part[k] for k in ("files", "tensors", "rank_state")})
        for name in part["files"]:
            old = name.split("-")[-1].split(".")[0]
            doc = doc.replace(f'"{name}"', f'"{name.replace(old, token)}"', 1)  # the files' key
            doc = doc.replace(old, shard_token or token)  # and every shard's reference
        if checksum:
            doc = doc.replace('"xxh3_64:', f'"{checksum}', 1)
        d = json.loads(doc)
        return fmt.part_json(step, [0, 1], d["files"], d["tensors"], d["rank_state"])

    full_checks = []
    real = fmt._check_part
    monkeypatch.setattr(fmt, "_check_part", lambda *a: full_checks.append(a[1]) or real(*a))
    checked = fmt.LayoutMemo()  # the writer's memo of the layouts it checked
    fmt.check_part(text(7, "aaaaaaaa"), 7, [0, 1], 4, "step 7", checked)
    fmt.check_part(text(8, "bbbbbbbb"), 8, [0, 1], 4, "step 8", checked)  # same layout: not parsed again
    assert full_checks == [7]
    with pytest.raises(FormatError, match="step 9"):  # shards name a file the part does not list
        fmt.check_part(text(9, "cccccccc", shard_token="dddddddd"), 9, [0, 1], 4, "step 9", checked)
    with pytest.raises(FormatError, match="step 10"):  # a checksum of another form
        fmt.check_part(text(10, "eeeeeeee", checksum="XXH3_64:"), 10, [0, 1], 4, "step 10", checked)
    assert full_checks == [7, 9, 10]


def test_a_leaders_part_from_its_template_is_the_part_built_in_full(two_nodes, tmp_path, monkeypatch):
    # A leader builds the first part of its ranks' layouts in full and later ones by filling a
    # template with each step's file tokens and checksums (commit/part_template.py): the bytes
    # are those of the full build, at every step; a report of another layout is built in full.
    import random

    from ftkit.commit import part_template
    from ftkit.commit.manifests import build_part
    from ftkit.commit.memo import CommitMemo
    from ftkit.commit.reports import decode_report

    _root, _index, parts, _ = two_nodes
    part = parts[0]
    storage = ftkit.Tier(str(tmp_path / "leader")).open()
    built = []
    real_build = part_template.build_part
    monkeypatch.setattr(part_template, "build_part", lambda *a: built.append(a[1]) or real_build(*a))
    memo = CommitMemo()  # the leader's tier's
    rng = random.Random(0)

    def reports(step: int, rows: int | None = None, own: dict | None = None) -> list:
        out = []
        for r in (0, 1):
            (old,) = [f for f, i in part["files"].items() if i["rank"] == r]
            new = old.rsplit("-", 1)[0] + f"-{rng.getrandbits(32):08x}.data"
            tensors = []
            for t in part["tensors"]:
                shards = [s for s in t["shards"] if s["rank"] == r]
                for s in shards:
                    for c in s["chunks"]:
                        c["file"], c["checksum"] = new, f"xxh3_64:{rng.getrandbits(64):016x}"
                if shards:
                    tensors.append({**t, "shards": shards})
            if rows is not None:
                tensors[0] = {**tensors[0], "shape": [rows, *tensors[0]["shape"][1:]]}
            head = {
                "file": new,
                "nbytes": part["files"][old]["bytes"],
                "error": None,
                "rank_state": own if own is not None and r == 0 else part["rank_state"].get(str(r), {}),
                "skipped": False,
            }
            part["files"][new] = part["files"].pop(old)
            out.append(decode_report(r, json.dumps(head) + "\n" + json.dumps(tensors), 4))
        return out

    def check(step: int, got: list) -> None:
        name, data, files = part_template.node_part_bytes(storage, step, got, [0, 1], 4, memo)
        writes = [r.write_doc() for r in got]
        rank_state = {str(r.rank): r.rank_state for r in got}
        _, want, want_files = build_part(storage, step, writes, rank_state, [0, 1], 4)
        assert data == want and files == want_files and name.startswith("part-00000-")

    for step in (7, 8, 9):
        check(step, reports(step))
    assert built == [7]  # steps 8 and 9 came from the template
    own = json.loads(json.dumps(part["rank_state"]["0"]).replace('"gauss": null', '"gauss": 0.25'))
    assert own != part["rank_state"]["0"]
    check(10, reports(10, own=own))  # the ranks' own state changed (Python's RNG): built in full
    check(11, reports(11, own=own))
    assert built == [7, 10]
    with pytest.raises(FormatError):  # a shape its shards do not fit: refused, not filled in
        part_template.node_part_bytes(storage, 12, reports(12, rows=3), [0, 1], 4, memo)


def test_rank_0s_index_bytes_reusing_earlier_skeleton_text_are_json_dumps_of_the_index():
    """commit/index_text.py keeps the JSON of the skeleton's containers seen at earlier steps, by
    their marshal bytes. Values that compare equal but encode differently (1, 1.0 and True;
    0.0 and -0.0) must not share a text: every index is json.dumps of its document."""
    from ftkit.commit.index_text import encode_index_reusing
    from ftkit.commit.memo import CommitMemo
    from ftkit.format.index import encode_index, index_doc

    texts = CommitMemo().index_texts  # rank 0's tier's, kept from one step to the next
    placeholders = {f"layer{i}.weight": {"$tensor": f"model/layer{i}.weight"} for i in range(40)}
    parts = [{"file": "part-00000.json", "bytes": 10, "checksum": "xxh3_64:" + "0" * 16, "ranks": [[0, 1]]}]
    seen = set()
    for step, v in enumerate([1, 1.0, True, 0.0, -0.0, 1, [1, 2], {"x": None}, 1, "1"]):
        group = {"lr": v, "params": list(range(100)), "note": "é"}  # (big enough to be kept)
        skeleton = {
            "entries": {
                "model": {"kind": "state_dict", "value": placeholders},
                "optim": {"kind": "stateful", "value": {"state": {"$items": []}, "param_groups": [group]}},
                "sched": {"kind": "stateful", "value": {"last_epoch": step}},
            }
        }
        doc = index_doc(step, 1, parts, skeleton, 1.5, {"ftkit": "test"})
        data = encode_index_reusing(doc, texts)
        assert data == encode_index(doc)
        assert json.loads(data)["skeleton"]["entries"]["optim"]["value"]["param_groups"][0]["lr"] == v
        assert type(json.loads(data)["skeleton"]["entries"]["optim"]["value"]["param_groups"][0]["lr"]) is type(v)
        seen.add(data)
    assert len(seen) == 10

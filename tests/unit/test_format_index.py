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
from ftkit.errors import FormatError
from ftkit.format.data import read_tensors
from ftkit.format.index import parse_index
from ftkit.format.manifest import MANIFEST_NAME, manifest_json, step_dir_name
from ftkit.format.part import decode_part, encode_part_docs
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
        ranks_of = [r for a, b in p["ranks"] for r in range(a, b)]
        data = encode_part_docs(p["step"], ranks_of, p["files"], p["tensors"], p["rank_state"])
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
    whole = decode_part((step_dir / ref["file"]).read_bytes(), ref["file"])
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
    assert m.format_version == 4 and m.world_size == 4 and len(m.parts) == 2
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
    (own,) = [f for f, i in parts[1]["files"].items() if i["rank"] == 2]
    copied = [{**s, "rank": 2, "chunks": [{**c, "file": own} for c in s["chunks"]]} for s in t0["shards"]]
    t1["shards"] = copied  # node 1 repeats node 0's region
    _write_parts(root / step_dir_name(1), index, parts)
    _refused(root, "cover|overlap|more than|volume")


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
    tensors: dict = {}
    for w in whole:  # one entry per tensor, holding every rank's shards of it
        for t in w["tensors"]:
            tensors.setdefault(t["name"], {**t, "shards": []})["shards"] += t["shards"]
    data = manifest_json(1, 4, list(tensors.values()), index["skeleton"], files, rank_state, 0.0, {})
    (step_dir / MANIFEST_NAME).write_bytes(data)
    doc = json.loads((step_dir / MANIFEST_NAME).read_text())
    assert doc["format_version"] == 2 and "tensors" in doc
    assert _load(root).format_version == 2
    _assert_restores(root, values)


def test_a_parts_rank_runs_may_not_overlap():
    # [0, 6) holds [2, 3) without sharing its ends; the set of ranks alone covers the world
    ref = {"file": "part-00000-aaaaaaaa.json", "bytes": 1, "checksum": "xxh3_64:" + "0" * 16}
    doc = {"step": 1, "world_size": 7, "parts": [{**ref, "ranks": [[2, 3], [0, 6]]}]}
    doc["parts"].append({**ref, "file": "part-00006-bbbbbbbb.json", "ranks": [[6, 7]]})
    with pytest.raises(FormatError, match="exactly once"):
        parse_index(doc, "the index")


def test_parts_claiming_the_largest_world_twice_are_refused_before_any_rank_set_is_built():
    """Two parts of a few bytes each claiming all 2**24 ranks: refused at once (the set of ranks
    built first took GBs and ended in MemoryError)."""
    ref = {"bytes": 1, "checksum": "xxh3_64:" + "0" * 16, "ranks": [[0, 2**24]]}
    parts = [{**ref, "file": f"part-{i:05d}-aaaaaaaa.json"} for i in range(6)]
    with pytest.raises(FormatError, match="exactly once"):
        parse_index({"step": 1, "world_size": 2**24, "parts": parts}, "the index")


def test_a_step_whose_one_part_holds_the_largest_world_is_read_without_a_set_of_its_ranks(tmp_path):
    """A valid step of 400 bytes: world_size 2**24, one part holding every rank. `ftkit ls` built
    the set of its 2**24 ranks twice (2.4 GB, 6 s), and so did every rank of a job restoring."""
    import subprocess
    import sys

    step_dir = tmp_path / step_dir_name(1)
    step_dir.mkdir()
    world = 2**24
    part = encode_part_docs(1, [0], {}, [], {})
    part = part.replace(b'"ranks":[[0,1]]', b'"ranks":[[0,%d]]' % world)
    (step_dir / "part-00000-aaaaaaaa.json").write_bytes(part)
    index = {"format": "ftkit-checkpoint", "format_version": 4, "step": 1, "world_size": world}
    index |= {"skeleton": {"entries": {}}, "created_at": 0, "writer": {}}
    ref = {"file": "part-00000-aaaaaaaa.json", "bytes": len(part), "ranks": [[0, world]]}
    ref["checksum"] = "xxh3_64:" + xxhash.xxh3_64_hexdigest(part)
    (step_dir / MANIFEST_NAME).write_text(json.dumps({**index, "parts": [ref]}))
    script = (
        "import json, resource, sys\n"
        "from ftkit.tools.cli import main\n"
        "rc = main(['ls', sys.argv[1], '--json'])\n"
        "print(json.dumps({'rc': rc, 'rss': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}), file=sys.stderr)\n"
    )
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    got = json.loads(r.stderr.strip().splitlines()[-1])
    assert got["rc"] == 0 and json.loads(r.stdout)["steps"][0]["world_size"] == world, r.stdout
    assert got["rss"] < 1024 * 1024, f"{got['rss'] // 1024} MiB"  # (KiB) python and torch alone: ~400 MiB


def test_the_shard_overlap_sweep_agrees_with_comparing_every_pair():
    """Random irregular covers (guillotine cuts: no grid), and the same with one shard moved
    onto another: check_shards_tile refuses exactly the layouts in which some pair overlaps."""
    import itertools
    import random

    from ftkit.format.manifest import Shard
    from ftkit.format.tiling import check_shards_tile

    def cuts(offsets, lengths, rng, depth):
        d = rng.randrange(len(lengths))
        if depth == 0 or lengths[d] < 2:
            return [(tuple(offsets), tuple(lengths))]
        k = rng.randrange(1, lengths[d])
        lo, hi = list(lengths), list(lengths)
        lo[d], hi[d] = k, lengths[d] - k
        moved = list(offsets)
        moved[d] += k
        return cuts(offsets, lo, rng, depth - 1) + cuts(moved, hi, rng, depth - 1)

    def overlaps(regions):
        return any(
            all(ao < bo + bl and bo < ao + al for ao, al, bo, bl in zip(a[0], a[1], b[0], b[1]))
            for a, b in itertools.combinations(regions, 2)
        )

    rng = random.Random(11)
    refused = 0
    for _ in range(300):
        shape = tuple(rng.randrange(2, 9) for _ in range(rng.choice([2, 3])))
        regions = cuts([0] * len(shape), list(shape), rng, rng.randrange(2, 7))
        if rng.random() < 0.5 and len(regions) > 1:  # move one shard, keeping it inside the tensor
            i = rng.randrange(len(regions))
            off, ln = regions[i]
            d = rng.randrange(len(shape))
            room = [o for o in range(shape[d] - ln[d] + 1) if o != off[d]]
            if room:
                regions[i] = (off[:d] + (rng.choice(room),) + off[d + 1 :], ln)
        shards = tuple(Shard(off, ln, ()) for off, ln in regions)
        try:
            check_shards_tile(shape, shards, "t")
            ok = True
        except FormatError:
            ok = False
            refused += 1
        assert ok == (not overlaps(regions)), regions
    assert 0 < refused < 300

"""Format version 4: a manifest part as three JSON lines, its layout apart from its values
(format/part.py). Steps are written by hand (data files, parts, index) and read back by the
real reader; version-3 steps are still read; corrupt parts are refused as corrupt."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from conftest import REPO

import ftkit
from ftkit.errors import FormatError
from ftkit.format.data import read_tensors, verify
from ftkit.format.index import check_part, encode_index, index_doc, part_ref
from ftkit.format.manifest import MANIFEST_NAME, step_dir_name
from ftkit.format.part import decode_part, encode_layout, encode_part, encode_part_docs, layout_docs
from ftkit.format.reader import load_manifest

STEP = 120
FILES = ("rank-00000-1f3a9c2e.data", "rank-00001-9a0b7d11.data")
W = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
B = torch.arange(10, dtype=torch.int64) * 3


def part_json(step: int, ranks: list[int], files: dict, tensors: list, rank_state: dict) -> bytes:
    """A version-3 part, one JSON document, as ftkit wrote them before version 4."""
    doc = {"format": "ftkit-checkpoint-part", "step": step, "ranks": [[min(ranks), max(ranks) + 1]]}
    doc.update(files=files, tensors=tensors, rank_state=rank_state)
    return json.dumps(doc, separators=(",", ":")).encode()


def _sum(data: bytes) -> str:
    return "xxh3_64:" + xxhash.xxh3_64_hexdigest(data)


def _chunk(file: str, offset: int, stored: bytes, raw_offset: int, raw_length: int, codec: str) -> dict:
    return {
        "file": file,
        "offset": offset,
        "length": len(stored),
        "raw_offset": raw_offset,
        "raw_length": raw_length,
        "codec": codec,
        "checksum": _sum(stored),
    }


def _docs() -> tuple[list[dict], dict[int, bytes]]:
    """Per rank: (files, tensors) of its part, and the data files' bytes. Rank 0 holds
    model/fc.weight in one raw chunk; rank 1 holds `b` in a raw chunk and a zstd chunk, after a gap."""
    w = W.numpy().tobytes()
    b = B.numpy().tobytes()
    z = zstandard.ZstdCompressor().compress(b[40:])
    data1 = b[:40] + bytes(24) + z
    parts = [
        (
            {FILES[0]: {"bytes": len(w), "rank": 0}},
            [
                {
                    "name": "model/fc.weight",
                    "dtype": "float32",
                    "shape": [3, 4],
                    "kind": "replicated",
                    "shards": [
                        {
                            "offsets": [0, 0],
                            "lengths": [3, 4],
                            "rank": 0,
                            "chunks": [_chunk(FILES[0], 0, w, 0, 48, "raw")],
                        }
                    ],
                }
            ],
        ),
        (
            {FILES[1]: {"bytes": len(data1), "rank": 1}},
            [
                {
                    "name": "b",
                    "dtype": "int64",
                    "shape": [10],
                    "kind": "replicated",
                    "shards": [
                        {
                            "offsets": [0],
                            "lengths": [10],
                            "rank": 1,
                            "chunks": [
                                _chunk(FILES[1], 0, b[:40], 0, 40, "raw"),
                                _chunk(FILES[1], 64, z, 40, 40, "zstd"),
                            ],
                        }
                    ],
                }
            ],
        ),
    ]
    return parts, {0: w, 1: data1}


SKELETON = {
    "entries": {
        "w": {"kind": "tensor", "value": {"$tensor": "model/fc.weight"}},
        "b": {"kind": "tensor", "value": {"$tensor": "b"}},
    }
}


def _write_step(root, parts: list[bytes], version: int = 4) -> list[str]:
    """A committed step of world size 2 (one part per rank) from the parts' bytes."""
    step_dir = root / step_dir_name(STEP)
    step_dir.mkdir(parents=True, exist_ok=True)
    for f in step_dir.glob("part-*.json"):
        f.unlink()
    _, data = _docs()
    for r, name in enumerate(FILES):
        (step_dir / name).write_bytes(data[r])
    names, refs = [], []
    for r, p in enumerate(parts):
        name = f"part-{r:05d}-0000000{r}.json"
        (step_dir / name).write_bytes(p)
        names.append(name)
        refs.append(part_ref(name, p, [r]))
    doc = index_doc(STEP, 2, refs, SKELETON, 1.0, {"ftkit": "test"})
    doc["format_version"] = version
    (step_dir / MANIFEST_NAME).write_bytes(encode_index(doc))
    return names


def _v4_parts() -> list[bytes]:
    docs, _ = _docs()
    return [encode_part_docs(STEP, [r], files, tensors, {}) for r, (files, tensors) in enumerate(docs)]


def _load(root):
    return load_manifest(ftkit.Tier(str(root)).open(), STEP)


def test_a_part_round_trips_and_its_layout_is_cached_bytes():
    docs, _ = _docs()
    files = {**docs[0][0], **docs[1][0]}
    tensors = docs[0][1] + docs[1][1]
    rank_state = {"0": {"rng": {"torch": None}}, "1": {}}
    data = encode_part_docs(STEP, [1, 0], files, tensors, rank_state)
    head, layout, values = data.split(b"\n")[:3]
    assert data.count(b"\n") == 3 and data.endswith(b"\n")
    assert json.loads(head) == {
        "format": "ftkit-checkpoint-part",
        "format_version": 4,
        "step": STEP,
        "ranks": [[0, 2]],
    }
    chunks = [c for t in json.loads(layout)["tensors"] for s in t["shards"] for c in s["chunks"]]
    assert len(chunks) == 3 and all(set(c) == {"raw_offset", "raw_length"} for c in chunks)
    assert json.loads(values)["files"] == [[FILES[0], 48, 0], [FILES[1], len(_docs()[1][1]), 1]]
    assert [v[0] for v in json.loads(values)["chunks"]] == [0, 1, 1]
    got = decode_part(data, "p")
    assert got["step"] == STEP and got["ranks"] == [[0, 2]]
    assert got["files"] == files and got["tensors"] == tensors and got["rank_state"] == rank_state
    # A writer keeps the layout line and fills in each step's values: the same bytes.
    cached = encode_layout(layout_docs(tensors))
    values_doc = json.loads(values)
    again = encode_part(STEP, [0, 1], cached, [tuple(f) for f in values_doc["files"]], values_doc["chunks"], rank_state)
    assert again == data


def test_a_version_4_step_is_read_and_its_tensors_restored(tmp_path):
    _write_step(tmp_path, _v4_parts())
    m = _load(tmp_path)
    assert m.format_version == 4 and m.world_size == 2 and len(m.parts) == 2
    storage = ftkit.Tier(str(tmp_path)).open()
    verify(storage, m)
    got = read_tensors(storage, m)
    assert torch.equal(got["model/fc.weight"], W) and torch.equal(got["b"], B)


def test_a_version_3_step_is_still_read(tmp_path):
    docs, _ = _docs()
    parts = [part_json(STEP, [r], files, tensors, {}) for r, (files, tensors) in enumerate(docs)]
    _write_step(tmp_path, parts, version=3)
    m = _load(tmp_path)
    assert m.format_version == 3
    got = read_tensors(ftkit.Tier(str(tmp_path)).open(), m)
    assert torch.equal(got["model/fc.weight"], W) and torch.equal(got["b"], B)


def test_parts_of_the_other_version_are_refused(tmp_path):
    docs, _ = _docs()
    v3 = [part_json(STEP, [r], files, tensors, {}) for r, (files, tensors) in enumerate(docs)]
    names = _write_step(tmp_path, v3, version=4)  # a version-4 index naming one-document parts
    with pytest.raises(FormatError, match=re.escape(names[0])):
        _load(tmp_path)
    names = _write_step(tmp_path, _v4_parts(), version=3)
    with pytest.raises(FormatError, match=re.escape(names[0])):
        _load(tmp_path)


def _edit_values(data: bytes, fn) -> bytes:
    head, layout, values, _ = data.split(b"\n")
    v = json.loads(values)
    fn(v)
    return b"\n".join([head, layout, json.dumps(v).encode(), b""])


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda d: b"\n".join(d.split(b"\n")[:2]) + b"\n",  # two lines
        lambda d: d + b"{}\n",  # four lines
        lambda d: d.rstrip(b"\n"),  # no final newline
        lambda d: _edit_values(d, lambda v: v["chunks"].pop()),  # fewer values than layout chunks
        lambda d: _edit_values(d, lambda v: v["chunks"].append(v["chunks"][0])),  # more
        lambda d: _edit_values(d, lambda v: v["chunks"][0].__setitem__(0, 1)),  # file index out of range
        lambda d: _edit_values(d, lambda v: v["chunks"][0].__setitem__(0, True)),  # a bool is no index
        lambda d: _edit_values(d, lambda v: v["chunks"][0].__setitem__(1, "0")),  # offset not an int
        lambda d: _edit_values(d, lambda v: v["chunks"][0].__setitem__(2, 48.0)),  # length not an int
        lambda d: _edit_values(d, lambda v: v["chunks"].__setitem__(0, v["chunks"][0][:4])),
        lambda d: _edit_values(d, lambda v: v["files"].append(v["files"][0])),  # a file listed twice
        lambda d: _edit_values(d, lambda v: v.__setitem__("files", {})),
        lambda d: d.replace(b'"format_version":4', b'"format_version":3', 1),
        lambda d: d.replace(b'"raw_offset":0', b'"raw_offset":"0"', 1),
        lambda d: d.replace(b'{"tensors":', b'{"tensors" ', 1),  # bad JSON
        lambda d: d.replace(b"[[0,1]]", b"[[0,1]", 1),  # bad JSON in the head
        lambda d: d.replace(b'"rank_state":{}', b'"rank_state":{"0":NaN}', 1),
    ],
)
def test_a_corrupt_version_4_part_is_refused_naming_it(tmp_path, corrupt):
    parts = _v4_parts()
    parts[0] = corrupt(parts[0])
    names = _write_step(tmp_path, parts)
    with pytest.raises(FormatError, match=re.escape(names[0])):
        _load(tmp_path)
    with pytest.raises(FormatError, match="node 0"):  # the writer's check of the same bytes
        check_part(parts[0], STEP, [0], 2, "node 0")


def test_decode_part_raises_only_format_errors():
    good = _v4_parts()[1]
    for i in range(0, len(good), 7):  # every truncation and a flipped byte: never another exception
        for bad in (good[:i], good[:i] + b"\x00" + good[i + 1 :]):
            try:
                decode_part(bad, "p")
            except FormatError as e:
                assert str(e).startswith("p")


def test_the_writers_check_accepts_a_good_version_4_part():
    docs, _ = _docs()
    for r, part in enumerate(_v4_parts()):
        check_part(part, STEP, [r], 2, f"node {r}")
    files, tensors = docs[1]
    stolen = encode_part_docs(STEP, [0], files, tensors, {})  # rank 1's file and shard in rank 0's part
    with pytest.raises(FormatError, match="another part"):
        check_part(stolen, STEP, [0], 2, "node 0")
    with pytest.raises(FormatError, match="does not list"):  # a chunk of a file the part does not list
        encode_part_docs(STEP, [0], docs[0][0], tensors, {})


@pytest.mark.parametrize("version", [4, 3])
def test_format_md_recipe_reads_a_hand_written_step_without_ftkit(tmp_path, version):
    docs, _ = _docs()
    if version == 4:
        _write_step(tmp_path, _v4_parts())
    else:
        _write_step(tmp_path, [part_json(STEP, [r], f, t, {}) for r, (f, t) in enumerate(docs)], version=3)
    recipe = re.search(r"```python\n(.*?)```", open(os.path.join(REPO, "FORMAT.md")).read(), re.S).group(1)
    script = (
        "import sys; sys.modules['ftkit'] = None\n"  # prove ftkit is not needed
        + recipe.replace('"ckpt/step-000000000120"', repr(str(tmp_path / step_dir_name(STEP))))
        + "\nnp.save(sys.argv[1], w)\n"
    )
    out = tmp_path / "w.npy"
    r = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert np.array_equal(np.load(out), W.numpy())

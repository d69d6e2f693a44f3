"""Trust at the boundaries (issue 12, items 1-7): crafted and malformed checkpoints
never reach a live tensor, never crash, never make `verify` say OK, and never cost
a good step. Every case is a real file on disk, read by the real CLI and library."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, edit_manifest, manifest_doc, run_cli, write_manifest_doc

import ftkit
from ftkit.format.manifest import MANIFEST_NAME, step_dir_name
from ftkit.format.reader import committed_steps, scan

N = 4096


@pytest.fixture
def two_steps(tmp_path):
    """Steps 1 and 2 of {"w": float32[4096]} filled with 1.0 and 2.0; step 2 gets damaged."""
    root = tmp_path / "ckpt"
    state = {"w": torch.zeros(N)}
    with ftkit.Checkpointer(state, [ftkit.Tier(str(root), keep=5)], rng=False) as ck:
        for step in (1, 2):
            state["w"].fill_(step)
            ck.snapshot(step)
            ck.wait()
    return root


def _manifest_path(root, step=2):
    return root / step_dir_name(step) / MANIFEST_NAME


def _edit(root, fn, step=2):
    edit_manifest(_manifest_path(root, step), fn)


def _chunks(doc):
    return doc["tensors"][0]["shards"][0]["chunks"]


def _restore(root, fill=-1.0):
    state = {"w": torch.full((N,), fill)}
    with ftkit.Checkpointer(state, [str(root)], rng=False) as ck:
        step = ck.restore()
    return step, state["w"]


def _assert_one_line(r, code):
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ftkit: error: "), r.stderr


def _assert_rejected_everywhere(root, needle: str | None = None):
    """verify says FAILED, export and reshard exit 1 writing nothing, restore() falls back to step 1."""
    r = run_cli("verify", str(root), "--step", "2")
    assert r.returncode == 1 and "FAILED" in r.stdout, (r.stdout, r.stderr)
    assert "Traceback" not in r.stdout + r.stderr
    if needle:
        assert needle in r.stdout, r.stdout
    out = root.parent / "out.pt"
    _assert_one_line(run_cli("restore", str(root), "--step", "2", "--out", str(out)), 1)
    assert not out.exists()
    resharded = root.parent / "resharded"
    _assert_one_line(run_cli("restore", str(root), "--step", "2", "--out", str(resharded), "--world-size", "2"), 1)
    assert not any(resharded.rglob(MANIFEST_NAME)) if resharded.exists() else True
    step, w = _restore(root)
    assert step == 1 and torch.equal(w, torch.full((N,), 1.0))
    assert run_cli("verify", str(root), "--step", "1").returncode == 0


# ------------------------------------------------ 1. chunks cover tensors exactly
@pytest.mark.parametrize(
    "damage, needle",
    [
        (lambda d: _chunks(d).clear(), "hold 0 bytes"),
        (lambda d: _chunks(d).append(dict(_chunks(d)[0])), "tile"),
        (lambda d: d["tensors"][0].update(dtype="float64"), "needs"),
        (
            lambda d: _chunks(d)[0].update(
                raw_length=_chunks(d)[0]["raw_length"] // 2, length=_chunks(d)[0]["length"] // 2
            ),
            "needs",
        ),
        (lambda d: d["tensors"][0]["shards"].append(d["tensors"][0]["shards"][0]), "overlap"),
        (
            lambda d: (
                d["tensors"][0]["shards"][0].update(lengths=[N // 2]),
                _chunks(d)[0].update(raw_length=2 * N, length=2 * N),
            ),
            "cover 2048 of its 4096",
        ),
    ],
)
def test_chunks_and_shards_must_tile_exactly(two_steps, damage, needle):
    _edit(two_steps, damage)
    _assert_rejected_everywhere(two_steps, needle)


def test_a_chunk_beyond_the_real_file_is_refused(two_steps):
    def lie(d):
        name = next(iter(d["files"]))
        d["files"][name]["bytes"] += 4096
        _chunks(d)[0]["offset"] += 4096

    _edit(two_steps, lie)
    _assert_rejected_everywhere(two_steps, "bytes, manifest says")


# ------------------------------------------------ 2. no allocation from untrusted sizes
def test_a_huge_shape_allocates_nothing_and_falls_back(two_steps):
    def huge(d):  # 4 TB of float32 in one chunk (refused as a chunk no writer makes, before the file size)
        t = d["tensors"][0]
        t["shape"] = [10**12]
        t["shards"][0]["lengths"] = [10**12]
        c = _chunks(d)[0]
        c["length"] = c["raw_length"] = 4 * 10**12
        name = next(iter(d["files"]))
        d["files"][name]["bytes"] = 4 * 10**12

    _edit(two_steps, huge)
    _assert_rejected_everywhere(two_steps, "of any chunk")
    out = two_steps.parent / "out.pt"
    r = run_cli("restore", str(two_steps), "--step", "2", "--out", str(out))
    assert "'w'" in r.stderr or "step-000000000002" in r.stderr, r.stderr  # says what and where


def _sparse_chunk(root, codec: str, stored: int, raw: int):
    """Step 2's one chunk made to store `stored` bytes (a sparse file: no disk blocks) that
    decode to `raw`, as `codec`; the tensor's shape to match."""

    def lie(d):
        t, c = d["tensors"][0], _chunks(d)[0]
        t["shape"] = t["shards"][0]["lengths"] = [raw // 4]
        c.update(offset=0, length=stored, raw_length=raw, codec=codec)
        d["files"][c["file"]]["bytes"] = stored
        os.truncate(root / step_dir_name(2) / c["file"], stored)

    _edit(root, lie)


@pytest.mark.parametrize(
    "codec, stored, raw, needle",
    [
        ("raw", 2**26, 2**26, "67108864 raw bytes, more than the 16777216"),
        ("zstd", 2**26, 4 * N, "stores 67108864 bytes for 16384 raw bytes"),
    ],
)
def test_a_chunk_larger_than_any_writer_makes_is_refused_unread(two_steps, monkeypatch, codec, stored, raw, needle):
    # A sparse data file claims any size for free: a chunk of 64 MiB (or 64 GiB) of it made
    # verify and gc allocate and read all of it (a raw chunk), and restore too (the stored bytes
    # of a zstd chunk, whatever it decodes to). Every writer cuts chunks of at most 16 MiB, and
    # zstd never needs more than ZSTD_compressBound(raw) bytes to store raw ones.
    from ftkit.format import data

    _sparse_chunk(two_steps, codec, stored, raw)
    real = data.chunk_bytes

    def read(storage, rel, chunks):
        assert step_dir_name(2) not in rel, "a chunk of step 2 was read"
        return real(storage, rel, chunks)

    monkeypatch.setattr(data, "chunk_bytes", read)
    r = run_cli("ls", str(two_steps), "--json")
    assert [s["status"] for s in json.loads(r.stdout)["steps"]] == ["committed", "bad-manifest"]
    _assert_rejected_everywhere(two_steps, needle)
    r = run_cli("gc", str(two_steps), "--keep", "1", "--json")
    assert r.returncode == 0 and needle in json.loads(r.stdout)["failed_verification"]["2"], r.stdout


def test_a_step_that_decodes_to_more_than_the_host_has_is_refused_before_it_is_allocated(tmp_path, monkeypatch):
    # A zstd chunk decodes to up to 32768 times what it stores: 18 KB of a real step are
    # 512 MiB here (a crafted step of 1 MB claims 32 GiB). Exporting or resharding it read
    # every tensor into new memory however little the host had, to be killed by the OOM killer
    # (or to have it kill another process) part way through.
    import psutil

    root = tmp_path / "ckpt"
    with ftkit.Checkpointer({"w": torch.zeros(2**27)}, [ftkit.Tier(str(root), compress="zstd")], rng=False) as ck:
        ck.snapshot(1)
    stored = sum(f.stat().st_size for f in (root / step_dir_name(1)).glob("*.data"))
    assert stored < 2**20
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=2**28))
    out, resharded, dcp = tmp_path / "out.pt", tmp_path / "resharded", tmp_path / "dcp"
    for args in (
        ("restore", str(root), "--out", str(out)),
        ("restore", str(root), "--out", str(resharded), "--world-size", "2"),
        ("export", str(root), "--out", str(dcp), "--format", "dcp"),
    ):
        r = run_cli(*args)
        _assert_one_line(r, 1)
        assert "0.5 GiB" in r.stderr and "0.2 GiB available" in r.stderr and "step-000000000001" in r.stderr, r.stderr
    assert not out.exists() and not resharded.exists() and not dcp.exists()
    assert list(tmp_path.iterdir()) == [root]
    assert run_cli("verify", str(root)).returncode == 0  # verify decodes into a scratch buffer


# ------------------------------------------------ 3. malformed but valid JSON
MALFORMED = {
    "files not a dict": lambda d: d.update(files=["x"]),
    "file record not a dict": lambda d: d["files"].update({next(iter(d["files"])): 7}),
    "skeleton a list": lambda d: d.update(skeleton=[1, 2]),
    "entries missing": lambda d: d["skeleton"].pop("entries"),
    "tensors missing": lambda d: d.pop("tensors"),
    "offset 1e400": lambda d: _chunks(d)[0].update(offset="__1e400__"),
    "offset a float": lambda d: _chunks(d)[0].update(offset=0.0),
    "offset a bool": lambda d: _chunks(d)[0].update(offset=False),
    "negative shape": lambda d: d["tensors"][0].update(shape=[-N]),
    "huge shape": lambda d: d["tensors"][0].update(shape=[2**70]),
    "shape a string": lambda d: d["tensors"][0].update(shape="4096"),
    "unknown tensor reference": lambda d: d["skeleton"]["entries"]["w"].update(value={"$tensor": "nope"}),
    "tag beside keys": lambda d: d["skeleton"]["entries"]["w"].update(value={"$tensor": "w", "x": 1}),
    "bad $float": lambda d: d["skeleton"]["entries"].update(v={"kind": "value", "value": {"$float": "1"}}),
    "deep nesting": lambda d: d["skeleton"]["entries"].update(v={"kind": "value", "value": "__deep__"}),
    "nesting past the validator's bound": lambda d: d["skeleton"]["entries"].update(
        v={"kind": "value", "value": "__300__"}
    ),
    "step a string": lambda d: d.update(step="2"),
    "world size zero": lambda d: d.update(world_size=0),
    "shard rank out of range": lambda d: d["tensors"][0]["shards"][0].update(rank=5),
    "checksum not hex": lambda d: _chunks(d)[0].update(checksum="xxh3_64:zz"),
    "tensor not an object": lambda d: d["tensors"].append(3),
    "rank_state a list": lambda d: d.update(rank_state=[]),
    "rank-local state naming a shared tensor": lambda d: d["rank_state"].update(
        {"0": {"rng": None, "local": {"x": {"kind": "stateful", "value": {"$tensor": "w"}}}}}
    ),
    "rank-local state not an object": lambda d: d["rank_state"].update({"0": {"rng": None, "local": [1]}}),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_manifests_are_format_errors(two_steps, name):
    p = _manifest_path(two_steps)
    doc = manifest_doc(p)
    MALFORMED[name](doc)

    def inject(text):
        text = text.replace('"__1e400__"', "1e400").replace('"__deep__"', "[" * 5000 + "]" * 5000)
        return text.replace('"__300__"', "[" * 300 + "]" * 300)

    write_manifest_doc(p, doc, inject)
    r = run_cli("ls", str(two_steps), "--json")
    assert r.returncode == 0 and "Traceback" not in r.stderr
    assert [s["status"] for s in json.loads(r.stdout)["steps"]] == ["committed", "bad-manifest"]
    _assert_one_line(run_cli("inspect", str(two_steps), "--step", "2"), 1)
    _assert_rejected_everywhere(two_steps)


# ------------------------------------------------ 4. decode before overwrite
def test_a_zstd_chunk_that_does_not_decode_never_reaches_the_live_tensor(tmp_path):
    """A crafted chunk with a valid checksum over bytes that are no zstd frame: verify and
    restore refuse it, and the live tensor ends up exactly at the older step."""
    import xxhash

    root = tmp_path / "ckpt"
    state = {"w": torch.zeros(N)}
    with ftkit.Checkpointer(state, [ftkit.Tier(str(root), keep=5, compress="zstd")], rng=False) as ck:
        for step in (1, 2):
            state["w"].fill_(step)  # constant: compresses, so the chunk is a zstd frame
            ck.snapshot(step)
            ck.wait()
    doc = manifest_doc(_manifest_path(root))
    c = _chunks(doc)[0]
    assert c["codec"] == "zstd"
    data_path = root / step_dir_name(2) / c["file"]
    data = bytearray(data_path.read_bytes())
    garbage = bytes(range(256)) * (c["length"] // 256 + 1)
    data[c["offset"] : c["offset"] + c["length"]] = garbage[: c["length"]]
    data_path.write_bytes(bytes(data))
    c["checksum"] = "xxh3_64:" + xxhash.xxh3_64_hexdigest(garbage[: c["length"]])
    write_manifest_doc(_manifest_path(root), doc)
    r = run_cli("verify", str(root), "--step", "2")
    assert r.returncode == 1 and "does not decode" in r.stdout, r.stdout
    step, w = _restore(root, fill=7.0)
    assert step == 1 and torch.equal(w, torch.full((N,), 1.0))


def test_when_no_candidate_verifies_restore_raises(two_steps):
    for step in (1, 2):
        f = next((two_steps / step_dir_name(step)).glob("*.data"))
        raw = bytearray(f.read_bytes())
        raw[100] ^= 0xFF
        f.write_bytes(bytes(raw))
    state = {"w": torch.zeros(N)}
    with ftkit.Checkpointer(state, [str(two_steps)], rng=False) as ck:
        with pytest.raises(ftkit.CorruptCheckpointError, match="2 candidate"):
            ck.restore()


# ------------------------------------------------ 5. a failed candidate destroys nothing
def _two_ram_steps(tmp_path, monkeypatch, run_id: str) -> str:
    """RAM-tier steps 1 and 2 of `run_id` (w filled with the step) under tmp_path/shm; the tier's root."""
    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "shm"))
    state = {"w": torch.zeros(N)}
    with ftkit.Checkpointer(state, [ftkit.Tier("ram", keep=5)], rng=False, run_id=run_id) as ck:
        for step in (1, 2):
            state["w"].fill_(step)
            ck.snapshot(step)
            ck.wait()
        return ck._backends[0].storage.root


def test_a_failed_ram_candidate_is_not_dropped(tmp_path, monkeypatch):
    """RAM steps 1 and 2; step 2's data is unreadable for a moment and step 1 is corrupt:
    restore fails, and once step 2's bytes are back, it is still there to restore."""
    ram = _two_ram_steps(tmp_path, monkeypatch, "failed-candidate")
    files = {s: next((tmp_path / "shm").rglob(f"{step_dir_name(s)}/*.data")) for s in (1, 2)}
    good2 = files[2].read_bytes()
    files[2].write_bytes(b"\0" * len(good2))  # the transient fault
    raw = bytearray(files[1].read_bytes())
    raw[0] ^= 1
    files[1].write_bytes(bytes(raw))
    state = {"w": torch.zeros(N)}
    with ftkit.Checkpointer(state, ["ram"], rng=False, run_id="failed-candidate") as ck:
        with pytest.raises(ftkit.CorruptCheckpointError):
            ck.restore()
    assert [d.step for d in scan(ftkit.tiers.storage.Storage(ram)) if d.committed] == [1, 2]
    files[2].write_bytes(good2)
    with ftkit.Checkpointer(state, ["ram"], rng=False, run_id="failed-candidate") as ck:
        assert ck.restore() == 2
    assert torch.equal(state["w"], torch.full((N,), 2.0))


def test_ram_steps_whose_manifests_cannot_be_read_are_an_error_not_a_fresh_start(tmp_path, monkeypatch):
    """A RAM-only run whose every committed step has an unreadable manifest (corrupt, or from a
    newer ftkit): restore raises as a shared tier's would, naming the step; it does not start
    over at 0 and drop the steps at the first snapshot."""
    ram = _two_ram_steps(tmp_path, monkeypatch, "unreadable")
    state = {"w": torch.zeros(N)}
    manifests = sorted((tmp_path / "shm").rglob(MANIFEST_NAME))
    assert len(manifests) == 2
    kept = {m: m.read_bytes() for m in manifests}
    for m in manifests:
        m.write_bytes(b'{"format": "ftkit-checkpoint", "format_version": 99}')
    with ftkit.Checkpointer(state, ["ram"], rng=False, run_id="unreadable") as ck:
        with pytest.raises(ftkit.CorruptCheckpointError, match=r"RAM tier step 2 on node .*version"):
            ck.restore()
        with pytest.raises(ftkit.CheckpointNotFoundError, match=r"step 1 is not .*RAM tier step 1 on node"):
            ck.restore(step=1)
    assert sorted(d.step for d in scan(ftkit.tiers.storage.Storage(ram))) == [1, 2]
    for m, data in kept.items():
        m.write_bytes(data)
    with ftkit.Checkpointer(state, ["ram"], rng=False, run_id="unreadable") as ck:
        assert ck.restore() == 2
    assert torch.equal(state["w"], torch.full((N,), 2.0))


# ------------------------------------------------ 6. the lineage after an older restore
@pytest.mark.parametrize("tiers", [["disk"], ["ram", "disk"]])
def test_restoring_an_older_step_supersedes_newer_ones(tmp_path, monkeypatch, caplog, tiers):
    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "shm"))
    root = tmp_path / "ckpt"
    spec = [ftkit.Tier(str(root), keep=10) if t == "disk" else ftkit.Tier("ram", keep=10) for t in tiers]
    state = {"w": torch.zeros(N)}
    with ftkit.Checkpointer(state, spec, rng=False, run_id="lineage") as ck:
        for step in range(1, 6):  # the abandoned future: steps 4 and 5 with values 4, 5
            state["w"].fill_(step)
            ck.snapshot(step)
        ck.wait()
    with ftkit.Checkpointer(state, spec, rng=False, run_id="lineage") as ck:
        assert ck.restore(step=3) == 3
        for step in (4, 5):  # the new future: values 40, 50
            state["w"].fill_(step * 10)
            with caplog.at_level("WARNING", logger="ftkit"):
                ck.snapshot(step)  # the first one retires the old 4 and 5 first, and says so
        assert "newer step(s) [4, 5]" in caplog.text
        ck.wait()
        assert ck.stats.failed == 0
    status = {d.step: d.status for d in scan(ftkit.Tier(str(root)).open())}
    assert status[4] == status[5] == "committed"
    # A restart resumes the new future, from every tier.
    for only in spec:
        fresh = {"w": torch.zeros(N)}
        with ftkit.Checkpointer(fresh, [only], rng=False, run_id="lineage") as ck:
            assert ck.restore() == 5
        assert torch.equal(fresh["w"], torch.full((N,), 50.0)), only.url


def test_retired_steps_are_listed_and_collected(tmp_path):
    root = tmp_path / "ckpt"
    state = {"w": torch.zeros(N)}
    with ftkit.Checkpointer(state, [ftkit.Tier(str(root), keep=10)], rng=False) as ck:
        for step in range(1, 5):
            ck.snapshot(step)
        ck.wait()
    with ftkit.Checkpointer(state, [ftkit.Tier(str(root), keep=10)], rng=False) as ck:
        assert ck.restore(step=1) == 1
        assert ck.last_restore["superseded"] == {str(root): [2, 3, 4]}
        assert committed_steps(ftkit.Tier(str(root)).open()) == [1, 2, 3, 4]  # nothing changes before a snapshot
        ck.snapshot(2)  # the run goes on from step 1: 2, 3 and 4 of the old future leave the timeline first
        ck.wait()
    rows = json.loads(run_cli("ls", str(root), "--json").stdout)["steps"]
    assert [(r["step"], r["status"]) for r in rows] == [
        (1, "committed"),
        (2, "committed"),
        (3, "retired"),
        (4, "retired"),
    ]
    r = run_cli("gc", str(root), "--keep", "2", "--grace", "0", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["removed_partial"] == [3, 4]
    assert [d.step for d in scan(ftkit.Tier(str(root)).open(), include_empty=True)] == [1, 2]


def test_a_process_that_only_restores_retires_nothing(tmp_path):
    """An evaluation that restores an older step of a training run's tier must not touch
    the run's newer steps: retiring happens only before this process's own first snapshot."""
    root = tmp_path / "ckpt"
    state = {"w": torch.zeros(N)}
    with ftkit.Checkpointer(state, [ftkit.Tier(str(root), keep=10)], rng=False) as ck:
        for step in range(1, 4):
            ck.snapshot(step)
        ck.wait()
    with ftkit.Checkpointer(state, [str(root)], rng=False) as ck:
        assert ck.restore(step=1) == 1
    assert committed_steps(ftkit.Tier(str(root)).open()) == [1, 2, 3]


# ------------------------------------------------ 7. FTKIT_UNSAFE_SKIP_CHECKSUMS
def test_unsafe_skip_checksums_takes_a_second_key_and_never_fools_verify(two_steps):
    f = next((two_steps / step_dir_name(2)).glob("*.data"))
    raw = bytearray(f.read_bytes())
    raw[8] ^= 0x40
    f.write_bytes(bytes(raw))
    env = {**os.environ, "FTKIT_UNSAFE_SKIP_CHECKSUMS": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "ftkit", "verify", str(two_steps), "--step", "2"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 1 and "checksum mismatch" in r.stdout, r.stdout + r.stderr

    def restore(opt_in: str) -> tuple[list[str], str]:
        code = (
            "import ftkit, torch, logging; logging.basicConfig();"
            f"{opt_in}"
            f"s={{'w': torch.zeros({N})}};"
            f"ck=ftkit.Checkpointer(s, [{str(two_steps)!r}], rng=False); step = ck.restore();"
            "print(step, float(s['w'][0]), ck.last_restore.get('checksums_skipped', False)); ck.close()"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout.split(), r.stderr

    # The variable alone, in an ordinary training process: ignored (with a warning); the
    # bit-flipped step 2 fails its checksum and step 1 is restored, verified.
    out, err = restore("")
    assert out == ["1", "1.0", "False"], (out, err)
    assert "is ignored" in err and "checksum mismatch" in err
    # With the drills' second key, the corrupt step loads, and last_restore says how.
    out, err = restore("from ftkit.format.codec import allow_skipping_checksums; allow_skipping_checksums();")
    assert out[0] == "2" and out[2] == "True", (out, err)
    assert "WITHOUT verifying checksums" in err


# ------------------------------------------------ 10. store messages are data, not paths
def _staged(value: float):
    from ftkit.save.layout import Layout
    from ftkit.save.staging import StagingArena

    arena = StagingArena(slots=1, pin=False)
    t = torch.full((N,), value)
    slot = arena.acquire(Layout.of([("w", t)]), wait=True)
    slot.fill([("w", t)])
    return arena, slot


SKELETON = {"entries": {"w": {"kind": "tensor", "value": {"$tensor": "w"}}}}


def test_a_forged_report_cannot_write_outside_the_ram_directory(tmp_path, monkeypatch):
    """Rank 0's report, as its node's collector (rank 1: rank 0 commits a job of two nodes)
    reads it from the node's board, names ../../../escaped.data: it is an error report, nothing is written or
    deleted outside, and the node's record for rank 0 says why the step cannot be committed."""
    import torch.distributed as dist

    from ftkit.commit.node import NodeGroup
    from ftkit.commit.plan import RAM
    from ftkit.commit.ram import persist_node_local
    from ftkit.commit.shared import read_node_record
    from ftkit.coord.dist import DistContext
    from ftkit.coord.nodelocal import NodeBoard, step_message
    from ftkit.tiers.storage import Storage

    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "shm"))
    store = dist.HashStore()
    ctx = DistContext(1, 4, store, "node0", 10.0, ["node0", "node0", "node1", "node1"])
    group = NodeGroup.of(ctx, NodeBoard("k", "node0", True, "test", kind="commit"), RAM)
    assert group.collector == 1
    node = tmp_path / "ram" / "job" / "node0"
    storage = Storage(str(node))
    (tmp_path / "escaped.data").write_text("precious")
    from ftkit.commit.messages import Report

    sums = ("xxh3_64:" + "0" * 16,)
    forged = Report("../../../escaped.data", 8, "ab" * 20, (0,), (8,), (0,), sums).encode()
    group.board.mailbox(1)  # (the collector listens from the start: tiers/opened.py)
    NodeBoard("k", "node0", False, "test", kind="commit").send(step_message((0, 0), "w-r0"), forged, [1])
    arena, slot = _staged(1.0)
    try:
        persist_node_local(
            storage, 1, slot, SKELETON, compress=None, pieces=None, rank_state=None, ctx=ctx, key="k", group=group
        )
    finally:
        arena.release(slot)
        arena.close()
    root = DistContext(0, 4, store, "node0", 1.0, ["node0", "node0", "node1", "node1"])
    record = read_node_record(0, root.collect_at_root("k/r", [0])[0], (0, 1))
    assert record.part is None
    assert any("unreadable report" in e and "outside its step directory" in e for e in record.errors), record
    assert (tmp_path / "escaped.data").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["escaped.data", "ram", "shm"]
    assert not list(tmp_path.rglob("*.data.tmp-*")) and not list((tmp_path / "ram").rglob(MANIFEST_NAME))
    assert not store.check(["k/manifest"])  # one node, no replicas: nobody else waits for an index


def test_a_report_with_no_tensors_for_its_bytes_is_refused():
    from ftkit.commit.messages import Report
    from ftkit.errors import FormatError

    data = Report("rank-00001-abcdef01.data", 4096, "ab" * 20).encode()
    with pytest.raises(FormatError, match="no chunk for its 4096-byte file"):
        Report.decode(data, "rank 1's report")  # a replica target would store 4096 unchecked bytes


def _index_of(name: str, nbytes: int) -> dict:
    return {"parts": [{"file": name, "bytes": nbytes, "checksum": "xxh3_64:" + "0" * 16, "ranks": [[0, 2]]}]}


@pytest.mark.parametrize(
    "forged, why",
    [
        (_index_of("../../evil.json", 1), "outside its step directory"),
        ({"format_version": 2, "tensors": [], "files": {}, "rank_state": {}}, "format version 2, not 4"),
        (_index_of("part-00000-0badf00d.json", 9), "does not name this node's part"),
    ],
)
def test_an_index_holder_validates_the_index_it_receives(tmp_path, forged, why):
    """Node1 holds rank 0's replicas, so it keeps the index too (CommitPlan.holds_index;
    its exchanger writes it, given the node's part as its leader relayed it); the index it
    reads from the store is forged (a part outside the directory, a document of another
    version, an index without this node's part): it writes no manifest, and says why."""

    from ftkit.commit.messages import PartEntry, Written
    from ftkit.commit.ram import write_index_copy
    from ftkit.tiers.storage import Storage

    node = tmp_path / "node1"
    storage = Storage(str(node))
    doc = {"format": "ftkit-checkpoint", "format_version": 4, "step": 1, "world_size": 2, "skeleton": {"entries": {}}}
    data = json.dumps({**doc, **forged}).encode()  # as rank 0 sent it through the store
    part = PartEntry("part-00001-0badf00d.json", 9, "xxh3_64:" + "1" * 16, ((1, 2),))
    with pytest.raises(ftkit.FtkitError, match=why):
        write_index_copy(storage, 1, data, Written(part, {}, 0))
    with pytest.raises(ftkit.FtkitError, match=why):  # the leader relayed no part (or none that checked)
        write_index_copy(storage, 1, data, None)
    assert not list(node.rglob(MANIFEST_NAME))


def test_what_a_leader_relays_to_its_exchanger_is_checked_like_any_board_message():
    """The node's exchanger writes the parts of its replica sources and (on an index holder)
    the index, from what its collector relayed on the node's board, and tells the collector
    which parts it wrote: a board's messages are untrusted, so a part named outside the step
    directory, a checksum of another form, or a name that is not a part's refuses the message
    (the exchange fails: the step is not committed), and a leader that is not one is left out."""
    from ftkit.commit.messages import Outcome, PartEntry, Relay, Written
    from ftkit.commit.node import NodeGroup
    from ftkit.commit.plan import RAM
    from ftkit.commit.ram import _outcome_errors
    from ftkit.commit.replicas import read_relay
    from ftkit.coord.dist import DistContext
    from ftkit.coord.nodelocal import NodeBoard, step_message

    good = "xxh3_64:" + "1" * 16
    own = Written(PartEntry("part-00002-0badf00d.json", 9, good, ((2, 4),)), {"rank-00002-0badf00d.data": 64}, 64)
    relay = Relay({2: b"a report"}, {"part-00000-0badf00d.json": (0, good), "part-00004-0badf00d.json": (4, good)}, own)
    assert Relay.decode(relay.encode(), "relay") == relay
    for parts in (
        {"../part-00002-evil.json": (2, good)},
        {"part-00002-0badf00d.json": (2, "md5:1234")},
        {"manifest.json": (0, good)},
    ):
        with pytest.raises(ftkit.FormatError):
            Relay.decode(Relay({}, parts).encode(), "relay")
    for bad in (
        Written(PartEntry("../x.json", 9, good, ((2, 4),)), {}, 0),
        Written(PartEntry("part-00002-0badf00d.json", 0, good, ((2, 4),)), {}, 0),
        Written(own.part, {"../r2.data": 64}, 64),
    ):
        with pytest.raises(ftkit.FormatError):
            Relay.decode(Relay({}, {}, bad).encode(), "relay")
    # On the board: the exchanger (rank 3 of node1) takes the parts of real nodes only.
    import tempfile

    with tempfile.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
        mp.setenv("FTKIT_RAM_DIR", d)
        nodes = ["node0", "node0", "node1", "node1"]
        group = NodeGroup.of(DistContext(3, 4, None, "node1", 5.0, nodes), None, RAM, 1)
        board = NodeBoard("k", "node1", False, "test", kind="commit")
        group = NodeGroup(board, group.plan, "node1")
        board.mailbox(3)
        collector = NodeBoard("k", "node1", True, "test", kind="commit")  # (rank 2's)
        collector.send(step_message((0, 1), "peers"), relay.encode(), [3])
        word = read_relay(group, DistContext(3, 4, None, "node1", 5.0, nodes), (0, 1), exchanger=True)
        assert word is not None and word.parts == {"part-00000-0badf00d.json": (0, good)} and word.own_part == own
        collector.send(step_message((0, 2), "peers"), b'{"2": "a report"}', [3])  # not a commit message
        with pytest.raises(ftkit.StorageError, match="not a commit message"):
            read_relay(group, DistContext(3, 4, None, "node1", 5.0, nodes), (0, 2), exchanger=True)
    # The exchanger's outcome names the parts it wrote: the collector takes only plain part names.
    parts: list[str] = []
    assert _outcome_errors(1, Outcome((), ("part-00002-0badf00d.json",)).encode(), parts) == []
    assert parts == ["part-00002-0badf00d.json"]
    errors = _outcome_errors(1, Outcome((), ("../../etc/passwd",)).encode(), parts)
    assert errors == ["rank 1: rank 1's outcome names a file outside its step directory"]
    assert parts == ["part-00002-0badf00d.json"]
    assert _outcome_errors(1, b'{"errors": []}', parts) == ["rank 1: rank 1's outcome is not a commit message"]

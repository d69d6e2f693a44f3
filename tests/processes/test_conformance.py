"""One conformance suite for every storage tier: local path, file:// URL, real S3, node RAM.

Each backend must: round-trip a state exactly, detect corruption, hide partial
steps, apply retention, and serve concurrent readers consistent steps while a
writer is committing new ones.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from conftest import assert_same_values, make_state, run_cli, snapshot_values, train_one

import ftkit
from ftkit.errors import CorruptCheckpointError
from ftkit.format.data import verify
from ftkit.format.manifest import step_dir_name
from ftkit.format.reader import committed_steps, load_manifest
from ftkit.save.layout import Layout
from ftkit.save.staging import StagingArena
from ftkit.save.write import write_data


@pytest.fixture(params=["local", "file", "s3", "ram"])
def tier(request, tmp_path, monkeypatch):
    """A Tier factory for one backend: tier(keep=..., ...)."""
    if request.param == "ram":  # this run's RAM tier, in a private root of the test's own
        monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "shm"))
        monkeypatch.setenv("FTKIT_RUN_ID", "conformance")
        url, opts = "ram", {}
    elif request.param == "local":
        url, opts = str(tmp_path / "ckpt"), {}
    elif request.param == "file":
        url, opts = f"file://{tmp_path}/ckpt", {}
    else:
        server = request.getfixturevalue("s3_server")
        url, opts = request.getfixturevalue("s3_url"), server.storage_options()

    def make(**kw) -> ftkit.Tier:
        return ftkit.Tier(url, storage_options=opts, **kw)

    return make


def _storage(t: ftkit.Tier):
    """Where the tier's steps are, to inspect them directly (the RAM tier: this node's directory)."""
    if t.is_ram:
        from ftkit.coord.dist import node_id
        from ftkit.tiers.ram import open_node_dir, run_identity
        from ftkit.tiers.storage import Storage

        return Storage(open_node_dir(run_identity([]), node_id(0)))
    return t.open()


def _fill(state, step):
    state["w"].fill_(step)
    state["step_value"] = step


def _saved_steps(t: ftkit.Tier, steps, numel=2048, **tier_kw):
    state = {"w": torch.zeros(numel), "step_value": 0}
    with ftkit.Checkpointer(state, [t], rng=False) as ck:
        for s in steps:
            _fill(state, s)
            ck.snapshot(s)
            ck.wait()
    return state


def test_round_trip(tier):
    t = tier(compress="zstd")
    state = make_state()
    with ftkit.Checkpointer(state, [t]) as ck:
        for step in (1, 2):
            train_one(state)
            ck.snapshot(step)
    expect = snapshot_values(state)
    fresh = make_state(seed=7)
    with ftkit.Checkpointer(fresh, [t]) as ck:
        assert ck.restore() == 2
    assert_same_values(expect, snapshot_values(fresh))
    assert fresh["epoch"] == state["epoch"]


def test_corruption_is_detected_and_restore_falls_back(tier):
    t = tier(keep=3)
    _saved_steps(t, [1, 2])
    storage = _storage(t)
    m = load_manifest(storage, 2)
    rel = f"{step_dir_name(2)}/{next(iter(m.files))}"
    data = bytearray(storage.fs.cat_file(storage.path(rel)))
    data[len(data) // 3] ^= 0xFF
    storage.write_bytes_atomic(rel, bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        verify(storage, m)
    state = {"w": torch.zeros(2048), "step_value": 0}
    with ftkit.Checkpointer(state, [t], rng=False) as ck:
        assert ck.restore() == 1
    assert state["step_value"] == 1 and torch.equal(state["w"], torch.full((2048,), 1.0))


def test_partial_step_is_invisible(tier):
    t = tier(keep=5)
    _saved_steps(t, [1])
    storage = _storage(t)
    arena = StagingArena(slots=1)
    src = [("w", torch.full((2048,), 3.0))]
    slot = arena.acquire(Layout.of(src), wait=True)
    slot.fill(src)
    write_data(storage, 3, slot, compress=None)  # data without a commit: a writer died here
    arena.close()
    assert committed_steps(storage) == [1]
    url = storage.url if t.is_ram else t.url  # the CLI reads the RAM tier by its directory
    r = run_cli("ls", url, "--json", "--storage-options", json.dumps(dict(t.storage_options)))
    assert [(s["step"], s["status"]) for s in json.loads(r.stdout)["steps"]] == [(1, "committed"), (3, "partial")]
    state = {"w": torch.zeros(2048), "step_value": 0}
    with ftkit.Checkpointer(state, [t], rng=False) as ck:
        assert ck.restore() == 1


def test_retention_keeps_newest_and_every_mth(tier):
    t = tier(keep=2, keep_every=3)
    _saved_steps(t, range(1, 8))
    assert committed_steps(_storage(t)) == [3, 6, 7]


def test_concurrent_readers_see_only_complete_steps(tier):
    t = tier(keep=3)
    numel = 64 * 1024
    writer_state = {"w": torch.zeros(numel), "step_value": 0}
    _fill(writer_state, 1)
    done = threading.Event()
    seen: list[int] = []
    bad: list[str] = []

    def reader():
        state = {"w": torch.zeros(numel), "step_value": 0}
        ck = ftkit.Checkpointer(state, [t], rng=False)
        try:
            while not done.is_set() or not seen:
                try:
                    step = ck.restore()
                except CorruptCheckpointError:
                    continue  # every candidate was retired while being read: try again
                if step == 0:
                    continue
                seen.append(step)
                if state["step_value"] != step or not torch.all(state["w"] == step):
                    bad.append(f"restore said step {step}, got value {state['step_value']}")
        finally:
            ck.close()

    th = threading.Thread(target=reader)
    with ftkit.Checkpointer(writer_state, [t], rng=False) as ck:
        ck.snapshot(1)
        ck.wait()
        th.start()
        for step in range(2, 9):
            _fill(writer_state, step)
            ck.snapshot(step)
    done.set()
    th.join(timeout=120)
    assert not th.is_alive()
    assert not bad, bad
    assert seen and all(1 <= s <= 8 for s in seen)

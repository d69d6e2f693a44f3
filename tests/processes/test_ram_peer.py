"""RAM and peer tiers on simulated nodes: 4 gloo ranks, 2 per node, each node its own RAM dir."""

from __future__ import annotations

import shutil

import dist_worker
import pytest
from ranks import run_ranks

import ftkit
from ftkit.commit.messages import Settled


@pytest.fixture
def job(tmp_path):
    env = {"FTKIT_RAM_DIR": str(tmp_path / "shm"), "FTKIT_RANKS_PER_NODE": "2", "FTKIT_JOB_ID": "job"}
    refs = tmp_path / "refs"
    refs.mkdir()
    return {
        "env": env,
        "disk": str(tmp_path / "disk"),
        "refs": str(refs),
        "node": lambda n: tmp_path / "shm" / "job" / f"node{n}",
    }


def _save(job, disk_every=100, parallel="ddp"):
    run_ranks(4, dist_worker.ram_save, parallel, job["disk"], job["refs"], 3, disk_every, env=job["env"])


def _restore(job, disk_every=100, parallel="ddp", world=4):
    return run_ranks(world, dist_worker.ram_restore, parallel, job["disk"], job["refs"], disk_every, env=job["env"])


def test_worker_restart_restores_from_node_ram(job):
    _save(job)
    node0 = job["node"](0)
    files = sorted(p.name for p in (node0 / "step-000000000003").iterdir())
    # node0 holds its ranks' data, the replicas of node1's ranks, both nodes' manifest parts
    # (its own, and node1's, whose files it holds) and the index
    assert "manifest.json" in files
    assert [f[:10] for f in files if f.startswith("part-")] == ["part-00000", "part-00002"]
    assert sorted(f[:10] for f in files if f.endswith(".data")) == [
        "rank-00000",
        "rank-00001",
        "rank-00002",
        "rank-00003",
    ]
    assert (node0.parent.stat().st_mode & 0o777) == 0o700
    out = _restore(job)
    assert [o["step"] for o in out] == [3] * 4
    assert {o["source"] for o in out} == {"ram"}


def test_replicas_in_a_job_of_one_node_commit_every_step_to_its_ram(job):
    """Peer replicas configured and every rank on one node (a laptop, a job shrunk to one host):
    no replica can be kept elsewhere, and every step still commits to the node's RAM tier."""
    job["env"]["FTKIT_RANKS_PER_NODE"] = "4"
    _save(job)
    out = _restore(job)
    assert [o["step"] for o in out] == [3] * 4 and {o["source"] for o in out} == {"ram"}


@pytest.mark.parametrize("compress", [None, "zstd"])
def test_lost_node_restores_from_peer_replicas_not_disk(job, compress):
    # Uncompressed, ranks send their tensor layouts once and then only checksums
    # (commit/layouts.py); compressed, their chunks move, and reports go whole.
    job["env"]["FTKIT_TEST_RAM_COMPRESS"] = compress or ""
    _save(job)
    shutil.rmtree(job["node"](1))  # node 1 died: its RAM is gone; its ranks restart elsewhere
    out = _restore(job)
    assert [o["step"] for o in out] == [3] * 4  # the newest step, though the disk tier has none
    assert [o["source"] for o in out] == ["ram", "ram", "ram+peer", "ram+peer"]
    assert out[2]["from_peers"] == 4
    # The node's four files came once each, received and stored half by each of its ranks.
    got = [o["received"] for o in out]
    assert got[:2] == [[], []] and len(got[2]) == len(got[3]) == 2
    assert sorted(got[2] + got[3]) == sorted(f.name for f in (job["node"](1) / "step-000000000003").glob("*.data"))


def test_a_node_lacking_manifest_parts_reads_them_from_the_node_that_has_them(job):
    # With more than k+1 nodes no node keeps every part of a step (each keeps those of the
    # ranks whose files it holds): here node1 loses its copy of node0's part of step 3.
    _save(job)
    for p in (job["node"](1) / "step-000000000003").glob("part-00000-*.json"):
        p.unlink()
    out = _restore(job)
    assert [o["step"] for o in out] == [3] * 4 and {o["source"] for o in out} == {"ram"}
    # A part on no node at all: step 3 cannot be read from RAM; nobody waits for the part,
    # and the step before it is restored (still bitwise equal to its reference).
    for p in (job["node"](0) / "step-000000000003").glob("part-00000-*.json"):
        p.unlink()
    out = _restore(job)
    assert [o["step"] for o in out] == [2] * 4 and {o["source"] for o in out} == {"ram"}


def test_snapshots_every_step_do_not_grow_the_store(job):
    """Each RAM-tier commit leaves ~10 small keys (reports, the manifest) in torchrun's
    store; the next commit deletes them, or a job snapshotting every step for days
    would fill the agent's memory. The state grows by a tensor at every step here: each
    new layout's body (megabytes at scale) replaces the old one in the store, and the
    replicas made with the new layouts restore a lost node bitwise."""
    out = run_ranks(4, dist_worker.ram_store_growth, job["disk"], (4, 24), env=job["env"])
    before, after = out[0]["keys"]
    assert after - before < 10, f"{after - before} store keys more after 20 more snapshots"
    assert [o["step"] for o in out] == [24] * 4
    assert [o["source"] for o in out] == ["ram", "ram", "ram+peer", "ram+peer"]


def test_rank0_skipping_a_snapshot_costs_the_other_nodes_no_wait(job):
    """Under policy "skip" a rank 0 that skips a step never writes its manifest: the
    other nodes' leaders must hear so at once, not after the commit timeout (300 s),
    while their persist threads hold every later snapshot back."""
    out = run_ranks(4, dist_worker.ram_skip_on_rank0, env=job["env"], timeout=90)
    assert [o["skipped"] for o in out] == [1, 0, 0, 0]
    assert all(o["committed"] == [1, 3] for o in out)  # step 2 exists on no node


def test_a_step_whose_replication_failed_on_rank_0_is_not_committed(job):
    """Rank 0's replication outcome goes to no collector (it commits, and adds its own errors
    to its node's record): a failure there must still leave the step uncommitted on every node."""
    out = run_ranks(4, dist_worker.ram_rank0_replication_fails, env=job["env"], timeout=120)
    assert all(o["committed"] == [1, 3] for o in out), out
    assert any("rank 0: replication failed: injected" in e for e in out[0]["errors"]), out[0]


def test_a_replica_that_cannot_be_stored_fails_only_its_step(job):
    """A replica holder that cannot store one replica (its write fails: a full /dev/shm, a
    size limit) fails that step; the transfers themselves went through, so the peer group
    still works and every later step commits on every node."""
    out = run_ranks(4, dist_worker.ram_replica_store_fails, env=job["env"], timeout=150)
    assert all(o["committed"] == [1, 3, 4] for o in out), out
    assert [e[:50] for e in out[0]["errors"]] == ["step 2 not committed to the RAM tier: rank 3: repl"], out[0]


@pytest.mark.parametrize("skipper", [1, 2, 3])
def test_any_rank_skipping_a_ram_step_costs_nobody_a_wait(job, skipper):
    """A non-leader (1, 3) or the leader of node 1 (2) skips step 2. Replicas go both ways
    between the two nodes: both ends of every transfer must agree that it happens, or a
    send waits for a receiver that is not there. Step 2 exists on no node, the others on
    both, and the store holds no key more at the end."""
    out = run_ranks(4, dist_worker.skip_one_step, "ram", skipper, env=job["env"], timeout=120)
    assert [o["skipped"] for o in out] == [int(r == skipper) for r in range(4)]
    assert all(o["committed"] == [1, 3, 4] for o in out), out
    assert out[0]["new_keys"] <= 2  # the last step's manifest key, deleted by the next commit


def test_steps_snapshotted_again_after_an_in_process_restore_are_the_new_ones(job):
    out = run_ranks(4, dist_worker.ram_rewind_and_redo, env=job["env"], timeout=90)
    assert out == [{"step": 3, "value": 30.0, "all_equal": True}] * 4


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


@pytest.mark.parametrize("damage", [_flip, _truncate])
def test_corrupt_replica_is_detected_and_an_older_step_is_used(job, damage):
    _save(job)
    shutil.rmtree(job["node"](1))
    replica = next(job["node"](0).glob("step-000000000003/rank-00003-*.data"))
    damage(replica)  # the only surviving copy of rank 3's share of step 3
    out = _restore(job)
    assert [o["step"] for o in out] == [2] * 4  # values checked against step 2's reference


def test_corrupt_local_ram_falls_back_to_disk_for_the_same_step(job):
    _save(job, disk_every=1)
    own = next(job["node"](0).glob("step-000000000003/rank-00000-*.data"))
    _flip(own)
    out = _restore(job, disk_every=1)
    assert [o["step"] for o in out] == [3] * 4
    assert {o["source"] for o in out} == {job["disk"]}


def test_fsdp_state_reshards_from_ram_to_three_ranks(job):
    _save(job, parallel="fsdp")
    out = _restore(job, parallel="fsdp", world=3)
    assert [o["step"] for o in out] == [3] * 3


def test_gc_removes_a_finished_jobs_ram_tier(job, monkeypatch):
    from conftest import run_cli

    _save(job)
    for k, v in job["env"].items():
        monkeypatch.setenv(k, v)
    r = run_cli("gc", "ram", "--job", "job", "--dry-run")
    assert r.returncode == 0 and job["node"](0).exists()
    r = run_cli("gc", "ram", "--job", "job", "--json")
    assert r.returncode == 0, r.stderr
    assert not job["node"](0).parent.exists()
    assert run_cli("gc", "ram", "--job", "job").returncode == 1


# ------------------------------------------ one process: the RAM tier's in-place read
@pytest.fixture
def solo_ram(tmp_path, monkeypatch):
    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("FTKIT_JOB_ID", "solo")
    monkeypatch.setenv("FTKIT_NODE_ID", "n0")
    return tmp_path / "shm" / "solo" / "n0"


def _ram_steps(steps):
    import torch

    import ftkit

    state = {"w": torch.zeros(300_000), "b": torch.zeros(7)}
    with ftkit.Checkpointer(state, [ftkit.Tier("ram", keep=3)], rng=False) as ck:
        for step in steps:
            state["w"].fill_(step)
            state["b"].fill_(-step)
            ck.snapshot(step)
            ck.wait()
    return state


def test_ram_restore_overwrites_a_corrupt_steps_bytes_with_the_next_candidate(solo_ram):
    import torch

    import ftkit

    state = _ram_steps((1, 2))
    _flip(next(solo_ram.glob("step-000000000002/*.data")))  # inside "w": read into it, then rejected
    w, b = state["w"], state["b"]
    w.zero_()
    b.zero_()
    with ftkit.Checkpointer(state, ["ram"], rng=False) as ck:
        assert ck.restore() == 1
        assert ck.last_restore["source"] == "ram"
    assert state["w"] is w and state["b"] is b  # read into the live tensors themselves
    assert torch.equal(w, torch.full_like(w, 1.0)) and torch.equal(b, torch.full_like(b, -1.0))


def test_ram_restore_raises_when_no_step_verifies(solo_ram):
    import ftkit

    state = _ram_steps((1,))
    _flip(next(solo_ram.glob("step-000000000001/*.data")))
    with ftkit.Checkpointer(state, ["ram"], rng=False) as ck:
        with pytest.raises(ftkit.CorruptCheckpointError, match="checksum mismatch"):
            ck.restore()  # the live tensors may now hold part of the bad bytes (restore.py)


def test_ram_restore_of_a_mismatched_state_touches_no_live_byte(solo_ram):
    import torch

    import ftkit
    from ftkit.errors import StateMismatchError

    _ram_steps((1,))
    live = {"w": torch.full((10,), 7.0), "b": torch.full((7,), 7.0)}  # "b" fits, "w" does not
    with ftkit.Checkpointer(live, ["ram"], rng=False) as ck:
        with pytest.raises(StateMismatchError, match=r"w: shape \(300000,\) in checkpoint, \(10,\) live"):
            ck.restore()
    assert torch.equal(live["b"], torch.full((7,), 7.0)) and torch.equal(live["w"], torch.full((10,), 7.0))


def test_ram_tier_writes_new_steps_over_the_pages_of_removed_ones(solo_ram):
    import torch

    import ftkit

    def data_inodes(step):
        return {p.stat().st_ino for p in solo_ram.glob(f"step-{step:012d}/*.data")}

    state = {"w": torch.zeros(300_000)}
    with ftkit.Checkpointer(state, [ftkit.Tier("ram", keep=1)], rng=False) as ck:
        ck.snapshot(1)
        ck.wait()
        first = data_inodes(1)
        for step in (2, 3):  # keep=1: step 1's file becomes a spare, step 2 is written over it, ...
            state["w"].fill_(step)
            ck.snapshot(step)
            ck.wait()
        assert data_inodes(3) == first  # the same file, renamed and overwritten
        assert not (solo_ram / "step-000000000001").exists()
        state["w"].zero_()
        assert ck.restore() == 3
    assert torch.equal(state["w"], torch.full_like(state["w"], 3.0))


def test_a_longer_spare_is_cut_to_what_was_written(tmp_path):
    from ftkit.tiers.ram import SparePool
    from ftkit.tiers.storage import Storage

    storage = Storage(str(tmp_path / "node"))
    (tmp_path / "node").mkdir()
    storage.spares = SparePool(str(tmp_path / "node"), limit=1)
    old = tmp_path / "node" / "old.data"
    old.write_bytes(b"x" * 4096)
    assert storage.spares.give([str(old)]) == [] and not old.exists()
    assert storage.spares.give([str(tmp_path / "gone.data")]) == [str(tmp_path / "gone.data")]  # full: not kept
    storage.write_bytes_atomic("step-000000000001/manifest.json", b"{}")  # small files never take a spare
    assert any((tmp_path / "node" / ".spare").iterdir())
    with storage.open_write("step-000000000001/new.data", recycle=True) as f:
        f.write(b"new bytes")
    assert storage.fs.cat_file(storage.path("step-000000000001/new.data")) == b"new bytes"
    assert not any((tmp_path / "node" / ".spare").iterdir())  # taken
    with storage.open_write("step-000000000001/next.data", recycle=True) as f:  # none left: a new file as before
        f.write(b"more")
    assert storage.fs.cat_file(storage.path("step-000000000001/next.data")) == b"more"


def test_only_the_nodes_holding_rank_0s_data_keep_the_index_and_the_rest_follow_its_news(job, tmp_path):
    """4 nodes of one rank, one replica each: the index (the commit) is written on rank 0's
    node and on node 1, which holds rank 0's replica; nodes 2 and 3 hand in their records and
    read nothing back, and drop the steps rank 0's retention let go (keep=2) by the news their
    heartbeats carry (coord/news.py). A restore from RAM still reads the newest step bitwise:
    nodes 2 and 3 get the index through the store."""
    env = {**job["env"], "FTKIT_RANKS_PER_NODE": "1"}
    run_ranks(4, dist_worker.ram_save, "ddp", job["disk"], job["refs"], 6, 100, env=env)

    def steps(n: int, with_index: bool) -> list[int]:
        d = job["node"](n)
        return sorted(int(p.name[5:]) for p in d.glob("step-*") if not with_index or (p / "manifest.json").is_file())

    assert steps(0, True) == steps(1, True) == [5, 6]
    for n in (2, 3):
        assert steps(n, True) == []
        held = steps(n, False)
        # Retention by the news: what rank 0 keeps, plus at most UNHEARD_LIMIT steps not yet heard of.
        assert held[-1] == 6 and held[0] >= 3 and len(held) <= 4, (n, held)
    out = run_ranks(4, dist_worker.ram_restore, "ddp", job["disk"], job["refs"], 100, env=env)
    # (bitwise equal to the reference, ram_restore checks; each node fetched the files it lacks)
    assert [o["step"] for o in out] == [6] * 4 and {o["source"] for o in out} == {"ram+peer"}


def _node_tier(tmp_path, rank: int = 2):
    import torch.distributed as dist

    from ftkit.commit.node import NodeGroup
    from ftkit.commit.plan import RAM
    from ftkit.coord.dist import DistContext
    from ftkit.tiers.backend import NodeRamTier
    from ftkit.tiers.storage import Storage

    nodes = ["node0", "node1", "node2", "node3"]
    ctx = DistContext(rank, 4, dist.HashStore(), nodes[rank], 10.0, nodes)
    storage = Storage(str(tmp_path / nodes[rank]))
    return NodeRamTier(ftkit.Tier("ram", keep=2), storage, 0, None, NodeGroup.of(ctx, None, RAM)), ctx, storage


def _steps_held(storage) -> list[int]:
    from ftkit.format.reader import scan

    return [d.step for d in scan(storage)]


def test_a_node_without_the_index_drops_only_what_rank_0s_news_settled_and_did_not_keep(tmp_path):
    from types import SimpleNamespace

    from ftkit.coord.news import NEWS_KEY, Settled

    tier, ctx, storage = _node_tier(tmp_path)
    for s in range(1, 4):
        storage.write_bytes_atomic(f"step-{s:012d}/rank-00002-x.data", b"x")
    job = SimpleNamespace(epoch=1, step=3)
    assert tier.retain(ctx, job) == [] and _steps_held(storage) == [1, 2, 3]  # no news: nothing goes
    tier.news.heard(Settled(0, 3, frozenset({3})).encode())  # another epoch's (before a restore)
    assert tier.retain(ctx, job) == [] and _steps_held(storage) == [1, 2, 3]
    tier.news.heard(Settled(1, 2, frozenset({1})).encode())  # step 2 failed, 1 committed, 3 in flight
    assert tier.retain(ctx, job) == [2] and _steps_held(storage) == [1, 3]
    tier.news.heard(Settled(1, 1, frozenset({1})).encode())  # older news of the epoch changes nothing
    assert tier.news.of_epoch(1).settled == 2
    # Snapshots outpace the heartbeats: more than UNHEARD_LIMIT steps unheard of -> it asks the store.
    for s in (4, 5):
        storage.write_bytes_atomic(f"step-{s:012d}/rank-00002-x.data", b"x")
    ctx.store.set(NEWS_KEY, Settled(1, 4, frozenset({3, 4})).encode())
    assert tier.retain(ctx, SimpleNamespace(epoch=1, step=5)) == [1] and _steps_held(storage) == [3, 4, 5]
    # The node of rank 0 follows its index instead, and tells the others what it keeps.
    tier0, ctx0, storage0 = _node_tier(tmp_path, rank=0)
    storage0.write_bytes_atomic("step-000000000007/manifest.json", b"{}")
    tier0.retain(ctx0, SimpleNamespace(epoch=1, step=7))
    assert Settled.decode(ctx0.store.get(NEWS_KEY)) == Settled(1, 7, frozenset({7}))


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not a message",
        b'{"epoch": 1, "settled": 5, "kept": [4]}',  # the news as JSON, before typed messages
        Settled(1, 5, frozenset({6})).encode(),  # a step kept that is not settled
        Settled(1, 5, frozenset({4})).encode()[:-1],  # cut short
        Settled(1, 5, frozenset({4})).encode() + b"\0",
        b"FTKM\x09" + Settled(1, 5, frozenset({4})).encode()[5:],  # another version
    ],
)
def test_malformed_commit_news_is_ignored_and_nothing_is_dropped(tmp_path, raw):
    """The news comes through the store: anything malformed is no news, and no news keeps."""
    from types import SimpleNamespace

    with pytest.raises(ftkit.FormatError):
        Settled.decode(raw)
    tier, ctx, storage = _node_tier(tmp_path)
    for s in (1, 2):
        storage.write_bytes_atomic(f"step-{s:012d}/rank-00002-x.data", b"x")
    tier.news.heard(raw)
    assert tier.retain(ctx, SimpleNamespace(epoch=1, step=2)) == [] and _steps_held(storage) == [1, 2]


def test_a_nodes_commit_duties_are_spread_over_its_ranks():
    """The RAM tier's commit gives a node's duties to different ranks where it has them
    (commit/plan.py): the collector (reports, part, records) is the node's first
    rank but on rank 0's node, which commits, when the job has several nodes; the exchanger
    (the replica sources' parts, the index on a holder) is a third rank, else the collector."""
    from ftkit.commit.node import NodeGroup
    from ftkit.commit.plan import RAM
    from ftkit.coord.dist import DistContext

    def roles(nodes: list[str]) -> dict[int, tuple[int, int, list[int]]]:
        out = {}
        for rank in range(len(nodes)):
            g = NodeGroup.of(DistContext(rank, len(nodes), None, nodes[rank], 1.0, nodes), None, RAM, 1)
            out[rank] = (g.collector, g.exchanger, list(g.record_ids))
        return out

    two_by_two = roles(["a", "a", "b", "b"])
    assert two_by_two[0] == two_by_two[1] == (1, 1, [0, 2])  # rank 0 commits only
    assert two_by_two[2] == two_by_two[3] == (2, 3, [0, 2])
    three = roles(["a", "a", "a", "b", "b", "b"])
    assert three[0] == (1, 2, [0, 3]) and three[3] == (3, 4, [0, 3])
    assert roles(["a", "a"])[1] == (0, 1, [])  # one node: rank 0 collects and commits
    assert roles(["a", "b"]) == {0: (0, 0, [1]), 1: (1, 1, [1])}  # a rank a node: each does all

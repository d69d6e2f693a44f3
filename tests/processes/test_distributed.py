"""Multi-rank snapshots with real processes: gloo on CPU, and torchrun for a crash.

4 ranks save; 4, 2 and 3 ranks restore, and every restored tensor, gathered to
full size, equals the saved one (DDP-replicated and FSDP2-sharded state).
"""

from __future__ import annotations

import os
import subprocess

import dist_worker
import pytest
from conftest import REPO, run_cli, warm_target
from ranks import run_ranks

import ftkit
from ftkit.format.reader import committed_steps, scan
from ftkit.runtime.warm.zygote import torchrun_command

WORKER = os.path.join(REPO, "tests", "support", "dist_worker.py")


def torchrun(zygote, nproc: int, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    target = warm_target(zygote, [WORKER, *args])
    cmd = torchrun_command(zygote, ["--standalone", f"--nproc-per-node={nproc}", *target])
    env = {**os.environ, "OMP_NUM_THREADS": "1", **zygote.env()}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_save_on_4_restore_on_4_2_3(tmp_path, parallel):
    ckpt, ref = str(tmp_path / "ckpt"), str(tmp_path / "ref.pt")
    run_ranks(4, dist_worker.save, parallel, ckpt, ref)
    manifest = ftkit.format.reader.newest_manifest(ftkit.Tier(ckpt).open())
    assert manifest.world_size == 4 and manifest.step == 3
    writers = {s.rank for t in manifest.tensors for s in t.shards}
    assert writers == {0, 1, 2, 3}  # every rank persisted a share
    if parallel == "ddp":
        big = manifest.tensor("model/module.2.weight")
        assert big.kind == "replicated" and len(big.shards) == 4  # split, written once in total
    else:
        assert manifest.tensor("model/2.weight").kind == "sharded"
    for world in (4, 2, 3):
        out = run_ranks(world, dist_worker.restore, parallel, ckpt, ref)
        assert out == [f"RESTORED rank={r} world={world} step=3" for r in range(world)]
    # Offline: rewrite the step for 3 ranks, then 3 ranks restore from that copy.
    resharded = str(tmp_path / "ckpt3")
    r = run_cli("restore", ckpt, "--out", resharded, "--world-size", "3")
    assert r.returncode == 0, r.stderr
    m3 = ftkit.format.reader.newest_manifest(ftkit.Tier(resharded).open())
    assert m3.world_size == 3 and {s.rank for t in m3.tensors for s in t.shards} == {0, 1, 2}
    out = run_ranks(3, dist_worker.restore, parallel, resharded, ref)
    assert out == [f"RESTORED rank={r} world=3 step=3" for r in range(3)]
    r = run_cli("restore", ckpt, "--out", resharded, "--world-size", "3")
    assert r.returncode == 2 and "already holds step 3" in r.stderr


def test_step_one_rank_never_finished_is_invisible(tmp_path, zygote):
    ckpt, ref = str(tmp_path / "ckpt"), str(tmp_path / "ref.pt")
    r = torchrun(
        zygote, 4, "--mode", "save", "--ckpt", ckpt, "--ref", ref, "--die", "2:2", "--commit-timeout", "10", "--sync"
    )
    assert r.returncode != 0 and "DYING rank=2 step=2" in r.stdout
    storage = ftkit.Tier(ckpt).open()
    assert committed_steps(storage) == [1]
    partial = [d.step for d in scan(storage) if not d.committed]
    assert partial in ([], [2])  # other ranks' step-2 data may be there, never a manifest


def test_rank0_skipping_a_durable_step_leaves_no_store_keys(tmp_path):
    """Rank 0 deletes each step's reports once read; the reports of a step it skipped
    are read by nobody, so its next commit deletes them, or a job under policy "skip"
    would grow torchrun's store by a report per rank at every skip."""
    out = run_ranks(4, dist_worker.durable_skip_on_rank0, str(tmp_path / "disk"), timeout=90)
    assert [o["skipped"] for o in out] == [1, 0, 0, 0]
    assert out[0]["committed"] == [1, 2, 4]  # step 3 is on no tier
    assert out[0]["new_keys"] == 0


@pytest.mark.parametrize("skipper", [1, 2, 3])
def test_any_rank_skipping_a_shared_tier_step_costs_nobody_a_wait(tmp_path, skipper):
    """Two nodes of two ranks; a non-leader (1, 3) or a node's leader (2) skips step 2: its
    leader, or rank 0, hears it at once through the node board or the leader's record;
    step 2 exists nowhere, the others do, and the store holds no key more at the end."""
    env = {"FTKIT_RANKS_PER_NODE": "2"}
    out = run_ranks(4, dist_worker.skip_one_step, str(tmp_path / "disk"), skipper, env=env, timeout=90)
    assert [o["skipped"] for o in out] == [int(r == skipper) for r in range(4)]
    assert out[0]["committed"] == [1, 3, 4]
    assert out[0]["new_keys"] == 0


def test_a_collector_busy_longer_than_a_senders_patience_still_gets_its_nodes_reports(tmp_path):
    """A node's collector busy for seconds before it collects (a slow write, rank 0's commit
    or retention of the step before) while a rank sends it more than a connection's buffer
    holds (its first layout: thousands of tensors): the sender waits for room as long as the
    commit would, and the step is committed."""
    points = str(tmp_path / "points.json")
    env = {"FTKIT_RANKS_PER_NODE": "2", "FTKIT_FAULT_POINTS": points}
    out = run_ranks(2, dist_worker.busy_collector, str(tmp_path / "disk"), points, env=env, timeout=120)
    assert out == [[1, 2], [1, 2]]


def test_a_record_sent_after_rank_0_gave_up_on_its_step_leaves_no_store_keys(tmp_path):
    """A node whose record comes after rank 0's commit timeout (rank 0 has failed the step and
    deleted its keys) sets them again: a later commit deletes them, or every such step would
    leave keys in torchrun's store for the rest of the job."""
    points = str(tmp_path / "points.json")
    env = {"FTKIT_RANKS_PER_NODE": "1", "FTKIT_FAULT_POINTS": points}
    out = run_ranks(2, dist_worker.late_record, str(tmp_path / "disk"), points, env=env, timeout=120)
    assert out[0]["committed"] == [1, 3, 4]
    assert out[0]["new_keys"] == 0


def test_agreement_reports_every_ranks_failure_to_every_rank():
    out = run_ranks(3, dist_worker.agreement, env={"FTKIT_RANKS_PER_NODE": "2"}, timeout=60)
    for rank, o in enumerate(out):
        assert o["values"] == [0, 10, 20]
        assert o["failures"] == [(1, "disk full")]
        assert o["first"] == ("disk full" if rank == 1 else "disk full (on rank 1)")
        assert o["raised"] == ["step 3 not committed: rank 1: bad 1; rank 2: bad 2", [(1, "bad 1"), (2, "bad 2")]]
        assert o["nodes"] == [out[0]["nodes"][0]] * 2 + [out[2]["nodes"][2]] and o["nodes"][0] != o["nodes"][2]


def test_an_agreement_costs_each_rank_the_same_store_requests_and_bytes_whatever_the_world():
    """coord/agree.py at 8 and at 64 ranks (threads, each with its own client of a real
    TCPStore): a rank other than 0 makes the same requests and reads the same bytes at both
    sizes (only rank 0 reads every ballot); every rank gets every failure and value."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from ftkit.coord.agree import agree
    from ftkit.coord.dist import DistContext

    class Counted:
        def __init__(self, store):
            self.store, self.requests, self.read = store, 0, 0

        def __getattr__(self, name):
            def call(*a, **k):
                self.requests += 1
                out = getattr(self.store, name)(*a, **k)
                self.read += sum(map(len, out)) if name == "multi_get" else len(out) if name == "get" else 0
                return out

            return call

    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))

    def run(world: int) -> tuple[set[int], set[int]]:
        stores = [Counted(dist.TCPStore("127.0.0.1", server.port, is_master=False)) for _ in range(world)]
        nodes = [f"n{r // 8}" for r in range(world)]
        outcomes: dict[int, object] = {}

        def rank(r: int) -> None:
            ctx = DistContext(r, world, stores[r], nodes[r], 60.0, nodes)
            error = "disk full" if r == 5 else None
            outcomes[r] = agree(ctx, f"vote{world}", error=error, value=[r] if r in (0, 6) else None)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(outcomes) == world
        for o in outcomes.values():
            assert o.failures == [(5, "disk full")]
            assert o.values == [[r] if r in (0, 6) else None for r in range(world)]
        return {s.requests for s in stores[1:]}, {s.read for s in stores[1:]}

    small, large = run(8), run(64)
    assert small[1] == large[1] and len(large[1]) == 1 and max(large[1]) < 100  # rank 0's outcome alone
    # A send (an append and a count; the last sender also marks the ballots done), then rank
    # 0's outcome (a wait and a get): four or five requests at any size.
    assert small[0] | large[0] <= {4, 5}


def test_a_persist_threads_own_connection_waits_itself_and_times_out_like_a_wait():
    """DistContext.own_connection gives its thread a store client whose timeout is the
    context's, so a read of keys is one multi_get that waits for them (no wait request of
    ours first); a key that never comes is a PeerTimeout naming it, as from our own wait; the
    connection it was cloned from keeps its timeout."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from ftkit.coord.dist import DistContext
    from ftkit.errors import PeerTimeout

    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    base = dist.PrefixStore("job/", server)
    ctx = DistContext(0, 2, base, "node0", 1.0, ["node0", "node1"]).scoped("ck1/")
    own = ctx.own_connection()
    assert own.waits_itself and not ctx.waits_itself
    assert own.scoped("sub/").waits_itself
    assert base.timeout == timedelta(seconds=30)  # the original's callers keep theirs
    ctx.store.set("here", "1")
    late = threading.Timer(0.3, lambda: ctx.store.set("late", "2"))
    late.start()
    t0 = time.monotonic()
    assert own.wait_get(["here", "late"]) == [b"1", b"2"]  # waited for the late one
    assert time.monotonic() - t0 >= 0.25
    assert own.get("here") == 1 and own.get_raw("late") == b"2"
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout, match="'never'"):
        own.wait_get(["here", "never"])
    assert time.monotonic() - t0 < 10
    assert own.wait_get(["here"]) == [b"1"]  # the connection still answers after a timeout


def test_values_sent_to_rank_0_come_in_one_exchange_its_keys_deleted_after():
    """DistContext.send_to_root / collect_at_root over a real TCPStore, each sender a client of
    its own: rank 0 gets every sender's bytes (binary, empty, large), by sender; the store keeps
    no key of the exchange afterwards; a sender that never sends is None once the wait is over,
    and what the others sent still arrives; a second value from one sender replaces its first;
    a cut-short value is a FormatError, not bytes taken as someone's."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from ftkit.coord.dist import DistContext, to_root_keys
    from ftkit.errors import FormatError

    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    view = dist.PrefixStore("job/", server)  # (what the contexts below see)
    nodes = [f"n{r}" for r in range(6)]

    def ctx(rank: int, timeout_s: float = 10.0) -> DistContext:
        client = dist.TCPStore("127.0.0.1", server.port, 1, is_master=False, timeout=timedelta(seconds=30))
        return DistContext(rank, 6, dist.PrefixStore("job/", client), nodes[rank], timeout_s, nodes)

    values = {1: b"\x00\x01binary", 2: b"", 3: bytes(range(256)) * 400, 5: b"five"}
    senders = [threading.Thread(target=ctx(r).send_to_root, args=("k", r, v, len(values))) for r, v in values.items()]
    for t in senders:
        t.start()
    root = ctx(0)
    assert root.collect_at_root("k", [1, 2, 3, 5]) == values
    for t in senders:
        t.join()
    assert not any(view.check([k]) for k in to_root_keys("k"))

    late = ctx(0, timeout_s=1.0)
    ctx(1).send_to_root("t", 1, b"one", 2)  # rank 2 never sends
    assert late.collect_at_root("t", [1, 2]) == {1: b"one", 2: None}
    assert not any(view.check([k]) for k in to_root_keys("t"))

    sender = ctx(1)
    sender.send_to_root("d", 1, b"first", 2)
    sender.send_to_root("d", 1, b"again", 2)  # counts as two: rank 2's place is taken
    assert ctx(0, timeout_s=1.0).collect_at_root("d", [1, 2]) == {1: b"again", 2: None}

    view.append("c/all", b"\x01\x00\x00\x00\xff\x00\x00\x00abc")  # says 255 bytes, has 3
    view.set("c/done", b"")
    with pytest.raises(FormatError, match="is cut short"):
        root.collect_at_root("c", [1])
    assert not any(view.check([k]) for k in to_root_keys("c"))


def test_gather_to_root_names_the_ranks_that_sent_nothing():
    from datetime import timedelta

    import torch.distributed as dist

    from ftkit.coord.dist import DistContext
    from ftkit.errors import PeerTimeout

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    nodes = ["a"] * 4
    for r in (1, 3):
        assert DistContext(r, 4, store, "a", 1.0, nodes).gather_to_root("g", {"r": r}, [0, 1, 3]) is None
    assert DistContext(0, 4, store, "a", 1.0, nodes).gather_to_root("g", {"r": 0}, [0, 1, 3]) == {
        0: {"r": 0},
        1: {"r": 1},
        3: {"r": 3},
    }
    DistContext(1, 4, store, "a", 1.0, nodes).gather_to_root("h", b"x", [1, 2, 3], raw=True)
    with pytest.raises(PeerTimeout, match=r"nothing from rank\(s\) 2, 3 for 'h' within 1s"):
        DistContext(0, 4, store, "a", 1.0, nodes).gather_to_root("h", b"x", [1, 2, 3], raw=True)
    # Values that do not unpack (forged: says 255 bytes, has 3) read as malformed, on rank 0 only
    # as on the others: no exception for rank 0 alone while they wait for its word.
    store.append("m/all", b"\x01\x00\x00\x00\xff\x00\x00\x00abc")
    store.set("m/done", b"")
    root = DistContext(0, 4, store, "a", 1.0, nodes)
    assert root.gather_to_root("m", {"r": 0}, [0, 1]) == {0: {"r": 0}, 1: None}
    store.append("n/all", b"\x01\x00\x00\x00\xff\x00\x00\x00abc")
    store.set("n/done", b"")
    assert root.gather_to_root("n", b"mine", [0, 1], raw=True) == {0: b"mine", 1: b""}


def test_a_failed_ranks_persist_still_running_at_close_still_logs_its_events(tmp_path):
    """close(failed=True) on several ranks does not wait for the persist in flight; the events
    that persist logs when it ends are still written, after the close event."""
    root = str(tmp_path / "ckpt")
    run_dir = str(tmp_path / "run")
    out = run_ranks(2, dist_worker.close_failed_mid_persist, f"faulty://{root}", root, run_dir, timeout=120)
    for rank, events in enumerate(out):
        names = [e["event"] for e in events]
        assert names[0] == "close", (rank, names)  # the persist was still running at close
        assert [e["step"] for e in events if e["event"] == "persist_job"] == [1], (rank, names)
        assert [e["step"] for e in events if e["event"] == "persist"] == [1], (rank, names)


def test_a_wait_for_a_staging_slot_longer_than_the_hang_bound_is_no_hang(tmp_path):
    """Slow writes fill both staging slots: snapshot() waits (policy "wait") longer than the
    hang bound, and the other rank waits for it in a collective. The watchdog ended the job
    (exit 75) as hung; the wait inside ftkit now shows in the heartbeat."""
    root = str(tmp_path / "ckpt")
    out = run_ranks(2, dist_worker.slow_slot_wait, f"faulty://{root}", root, env={"TORCHELASTIC_RUN_ID": "t"})
    assert out == [[1, 2, 3, 4]] * 2


def test_a_preemption_final_save_longer_than_the_hang_bound_is_no_hang(tmp_path):
    """The final save after SIGTERM uploads for longer than the hang bound: both ranks save the
    agreed step and exit 143 (the watchdog ended them as hung, and the final save was lost)."""
    root = str(tmp_path / "ckpt")
    out = run_ranks(
        2, dist_worker.slow_preemption_save, f"faulty://{root}", root, env={"TORCHELASTIC_RUN_ID": "t"}, timeout=180
    )
    (code, final, committed), other = out
    assert other == out[0] and code == 128 + 15 and final > 5 and committed[-1] == final


def test_a_final_flush_longer_than_the_hang_bound_is_no_hang(tmp_path):
    """The loop is over and close() waits for a slow last persist: the watchdog must not call
    that a hang (it ended the job with exit 75, and torchrun restarted a finished run)."""
    root = str(tmp_path / "ckpt")
    out = run_ranks(2, dist_worker.slow_final_flush, f"faulty://{root}", root, env={"TORCHELASTIC_RUN_ID": "t"})
    assert out == [list(range(1, 11))] * 2


def test_a_step_number_written_again_after_a_fallback_on_s3_is_committed(s3_server, s3_url):
    """Every rank reads the newest step (2) at a restore and falls back to step 1 past a
    damaged chunk; step 2 is retired, and the run's next snapshot of step 2 must be committed.
    A rank answering from the listing it made while reading the old step 2 took it for still
    committed, wrote nothing, and rank 0 waited out the commit timeout: step 2 was lost."""
    from ftkit.format.data import read_tensors
    from ftkit.format.manifest import step_dir_name
    from ftkit.format.reader import load_manifest
    from ftkit.tiers.storage import Storage

    opts = s3_server.storage_options()
    assert run_ranks(2, dist_worker.fall_back_and_redo, s3_url, opts, "save") == [{"restored": 0, "error": None}] * 2
    storage = Storage(s3_url, opts)
    step2 = step_dir_name(2)
    damaged = storage.path(f"{step2}/{max(n for n, _ in storage.list_dir(step2) if n.endswith('.data'))}")
    data = bytearray(storage.fs.cat_file(damaged))
    data[100] ^= 0xFF
    storage.fs.pipe_file(damaged, bytes(data))
    out = run_ranks(2, dist_worker.fall_back_and_redo, s3_url, opts, "redo", timeout=90)
    assert out == [{"restored": 1, "error": None}] * 2
    assert committed_steps(storage) == [1, 2]
    assert read_tensors(storage, load_manifest(storage, 2))["w"].eq(20).all()

"""The Checkpointer in a plain training loop: snapshot, background persist, restore."""

from __future__ import annotations

import json
import logging
import os
import random

import pytest
import torch
from conftest import assert_same_values, make_state, snapshot_values, train_one

import ftkit
from ftkit.config import Tier
from ftkit.errors import StateMismatchError
from ftkit.format.manifest import MANIFEST_NAME, step_dir_name
from ftkit.format.reader import committed_steps, load_manifest


def test_plain_loop_restores_exact_state_step_and_rng(tmp_path):
    state = make_state(seed=0)
    with ftkit.Checkpointer(state, [str(tmp_path)]) as ck:
        assert ck.restore() == 0  # nothing there yet
        for step in range(1, 4):
            train_one(state)
            ck.snapshot(step)
    saved = snapshot_values(state)
    expect_next = (random.random(), torch.rand(3))

    fresh = make_state(seed=99)
    with ftkit.Checkpointer(fresh, [str(tmp_path)]) as ck:
        assert ck.restore() == 3
    assert_same_values(saved, snapshot_values(fresh))
    assert fresh["epoch"] == state["epoch"] == 4
    assert fresh["sched"].state_dict() == state["sched"].state_dict()
    assert fresh["optim"].state_dict()["param_groups"] == state["optim"].state_dict()["param_groups"]
    got_next = (random.random(), torch.rand(3))
    assert expect_next[0] == got_next[0] and torch.equal(expect_next[1], got_next[1])


def test_snapshot_is_isolated_from_later_changes(tmp_path, gated_fs):
    """Tensors changed right after snapshot() returns are saved as they were at the call."""
    t = torch.full((1000,), 1.0)
    state = {"t": t}
    gated_fs.gate.clear()
    ck = ftkit.Checkpointer(state, ["gated://run"], rng=False)
    try:
        assert ck.snapshot(1)
        t.fill_(2.0)  # the background has not written anything yet
        gated_fs.gate.set()
        ck.wait()
        t.fill_(0.0)
        assert ck.restore() == 1
        assert torch.equal(t, torch.full((1000,), 1.0))
    finally:
        gated_fs.gate.set()
        ck.close()


def test_busy_background_skip_policy_counts_and_wait_policy_blocks(gated_fs):
    state = {"t": torch.zeros(256)}
    gated_fs.gate.clear()
    ck = ftkit.Checkpointer(state, ["gated://skip"], policy="skip", rng=False)
    try:
        assert ck.snapshot(1)  # slot A, background blocks on the gate
        assert gated_fs.entered.acquire(timeout=10)
        assert ck.snapshot(2)  # slot B: double buffering
        assert not ck.snapshot(3)  # both busy: skipped and counted, not queued
        assert ck.stats.skipped == 1 and ck.stats.snapshots == 2
    finally:
        gated_fs.gate.set()
        ck.close()
    assert ck.stats.persisted == 2


def test_memory_budget_of_one_slot_serializes_snapshots(gated_fs):
    state = {"t": torch.zeros(1024)}  # 4 KiB
    gated_fs.gate.clear()
    ck = ftkit.Checkpointer(state, ["gated://budget"], policy="skip", max_staging_bytes=6000, rng=False)
    try:
        assert ck.snapshot(1)
        assert not ck.snapshot(2)  # one slot fits in the budget, and it is busy
        assert ck._arena.nbytes <= 6000
    finally:
        gated_fs.gate.set()
        ck.close()


def test_budget_too_small_for_one_snapshot_is_a_clear_error(tmp_path):
    ck = ftkit.Checkpointer({"t": torch.zeros(1024)}, [str(tmp_path)], max_staging_bytes=100, rng=False)
    with pytest.raises(ftkit.FtkitError, match="staging budget of 100 bytes cannot hold one snapshot of 4,096 bytes"):
        ck.snapshot(1)
    ck.close()


def test_tier_interval_and_retention(tmp_path):
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    state = {"t": torch.zeros(8)}
    with ftkit.Checkpointer(
        state, [ftkit.Tier(str(fast), every=1, keep=2), ftkit.Tier(str(slow), every=3, keep=1, keep_every=6)], rng=False
    ) as ck:
        for step in range(1, 13):
            state["t"].fill_(step)
            ck.snapshot(step)
            ck.wait()
    assert committed_steps(ftkit.Tier(str(fast)).open()) == [11, 12]
    assert committed_steps(ftkit.Tier(str(slow)).open()) == [6, 12]


@pytest.mark.parametrize("spelling", ["file://{}", "{}/", "{}/../ckpt", "link"])
def test_two_tiers_in_one_directory_are_refused_before_either_deletes_the_others_steps(tmp_path, spelling):
    """One tier's retention (keep=2) would delete the steps the other keeps (every 5th,
    keep=None), whatever the spelling of the path: a ConfigError naming both, nothing written."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (tmp_path / "link").symlink_to(root)
    other = str(tmp_path / "link") if spelling == "link" else spelling.format(root)
    state = {"t": torch.zeros(8)}
    with pytest.raises(ftkit.ConfigError, match="same location") as got:
        ftkit.Checkpointer(state, [str(root), ftkit.Tier(other, every=5, keep=None)], rng=False)
    assert str(root) in str(got.value) and len(str(got.value).splitlines()) == 1
    assert list(root.iterdir()) == []
    # Tiers in different directories (one inside the other's root) are fine.
    with ftkit.Checkpointer(
        state, [str(root), ftkit.Tier(str(root / "milestones"), every=5, keep=None)], rng=False
    ) as ck:
        for step in range(1, 11):
            ck.snapshot(step)
    assert committed_steps(ftkit.Tier(str(root)).open()) == [9, 10]
    assert committed_steps(ftkit.Tier(str(root / "milestones")).open()) == [5, 10]


def test_zstd_compresses_where_it_pays_and_round_trips(tmp_path):
    state = {"zeros": torch.zeros(1 << 20), "noise": torch.randn(1 << 20)}
    ref = {k: v.clone() for k, v in state.items()}
    with ftkit.Checkpointer(state, [ftkit.Tier(str(tmp_path), compress="zstd")], rng=False) as ck:
        ck.snapshot(1)
    m = load_manifest(ftkit.Tier(str(tmp_path)).open(), 1)
    codecs = {t.name: {c.codec for s in t.shards for c in s.chunks} for t in m.tensors}
    assert codecs == {"zeros": {"zstd"}, "noise": {"raw"}}
    assert m.tensor("zeros").shards[0].chunks[0].length < 4096
    for v in state.values():
        v.fill_(7)
    with ftkit.Checkpointer(state, [str(tmp_path)], rng=False) as ck:
        assert ck.restore() == 1
    assert all(torch.equal(state[k], ref[k]) for k in ref)


def test_failed_background_save_is_counted_and_never_kills_training(tmp_path, caplog):
    state = {"t": torch.zeros(16)}
    root = tmp_path / "ckpt"
    ck = ftkit.Checkpointer(state, [str(root)], rng=False)
    ck.snapshot(1)
    ck.wait()
    os.chmod(root, 0o500)  # step 2 cannot create its directory
    try:
        if os.access(root, os.W_OK):  # root ignores permissions: use a file where the dir must go
            os.chmod(root, 0o700)
            (root / step_dir_name(2)).write_text("in the way")
        with caplog.at_level(logging.ERROR, logger="ftkit"):
            state["t"].fill_(2)
            assert ck.snapshot(2)  # returns normally: the failure is in the background
            with pytest.raises(ftkit.StorageError):
                ck.wait()
        assert ck.stats.failed == 1 and ck.stats.persisted == 1
        assert any("persisting step 2" in r.message for r in caplog.records)
        ck.wait()  # the error was reported once
    finally:
        os.chmod(root, 0o700)
        ck.close()
    assert committed_steps(ftkit.Tier(str(root)).open()) == [1]


def test_restore_falls_back_to_previous_step_when_newest_is_corrupt(tmp_path, caplog):
    state = {"t": torch.zeros(64)}
    with ftkit.Checkpointer(state, [ftkit.Tier(str(tmp_path), keep=3)], rng=False) as ck:
        for step in (1, 2):
            state["t"].fill_(step)
            ck.snapshot(step)
            ck.wait()
    data = next((tmp_path / step_dir_name(2)).glob("*.data"))
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0x01
    data.write_bytes(bytes(raw))
    state["t"].zero_()
    with caplog.at_level(logging.WARNING, logger="ftkit"):
        with ftkit.Checkpointer(state, [str(tmp_path)], rng=False) as ck:
            assert ck.restore() == 1
    assert torch.equal(state["t"], torch.full((64,), 1.0))
    assert any("step 2" in r.message and "checksum mismatch" in r.message for r in caplog.records)


def test_restore_prefers_fast_tier_and_uses_slow_one_when_fast_is_bad(tmp_path):
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    state = {"t": torch.zeros(64)}
    with ftkit.Checkpointer(state, [f"file://{slow}", str(fast)], rng=False) as ck:
        state["t"].fill_(5)
        ck.snapshot(5)
    (fast / step_dir_name(5) / MANIFEST_NAME).write_text("{garbage")
    state["t"].zero_()
    with ftkit.Checkpointer(state, [str(fast), f"file://{slow}"], rng=False) as ck:
        assert ck.restore() == 5
    assert torch.equal(state["t"], torch.full((64,), 5.0))


@pytest.mark.parametrize("fast_url", ["ram", "fast"])
def test_a_step_restore_found_bad_on_the_fast_tier_does_not_push_out_its_good_older_step(
    tmp_path, monkeypatch, fast_url
):
    """Step 2 on the fast tier (keep=2) is bad (a garbage manifest; on the RAM tier, a data file
    gone), so restore loads it from the slow tier. The next snapshot's retention does not count
    the bad step: the fast tier keeps good step 1, which the slow tier no longer has."""
    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "ram"))
    fast = ftkit.Tier(fast_url if fast_url == "ram" else str(tmp_path / fast_url), keep=2)
    tiers = [fast, ftkit.Tier(f"file://{tmp_path / 'slow'}")]
    state = {"t": torch.zeros(8)}
    with ftkit.Checkpointer(state, tiers, rng=False, run_id="job") as ck:
        for step in (1, 2):
            state["t"].fill_(step)
            ck.snapshot(step)
    if fast_url == "ram":
        next((tmp_path / "ram").rglob(f"{step_dir_name(2)}/*.data")).unlink()
    else:
        (tmp_path / fast_url / step_dir_name(2) / MANIFEST_NAME).write_text("{garbage")
    with ftkit.Checkpointer(state, tiers, rng=False, run_id="job") as ck:
        assert ck.restore() == 2
        ck.snapshot(3)
    state["t"].zero_()
    with ftkit.Checkpointer(state, [fast], rng=False, run_id="job") as ck:
        assert ck.restore(1) == 1
    assert torch.equal(state["t"], torch.full((8,), 1.0))


def test_a_partial_step_after_the_restored_one_is_not_held_as_bad_once_written_again(tmp_path, monkeypatch):
    """The crash left step 4 partial on the RAM tier (keep=2); the run restores 3 and writes 4 and
    5 again: those are good, and retention keeps 2 steps, not a third for a "bad" step 4."""
    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "ram"))
    tiers = [ftkit.Tier("ram", keep=2)]
    state = {"t": torch.zeros(8)}
    with ftkit.Checkpointer(state, tiers, rng=False, run_id="job") as ck:
        for step in (1, 2, 3, 4):
            ck.snapshot(step)
    next((tmp_path / "ram").rglob(f"{step_dir_name(4)}/{MANIFEST_NAME}")).unlink()  # (killed mid-commit)
    with ftkit.Checkpointer(state, tiers, rng=False, run_id="job") as ck:
        assert ck.restore() == 3
        ck.snapshot(4)
        ck.snapshot(5)
    held = sorted(p.parent.name for p in (tmp_path / "ram").rglob(f"step-*/{MANIFEST_NAME}"))
    assert held == [step_dir_name(4), step_dir_name(5)]


def test_restore_of_a_different_model_names_mismatched_keys(tmp_path):
    with ftkit.Checkpointer(make_state(width=16), [str(tmp_path)]) as ck:
        ck.snapshot(1)
    other = make_state(width=32)
    before = snapshot_values(other)
    with ftkit.Checkpointer(other, [str(tmp_path)]) as ck:
        with pytest.raises(
            StateMismatchError,
            match=r"model/0.weight: shape \(16, 8\) in checkpoint, "
            r"\(32, 8\) live",
        ):
            ck.restore()
    assert_same_values(before, snapshot_values(other))


def test_restore_when_every_checkpoint_is_corrupt_raises_rather_than_starting_over(tmp_path):
    state = {"t": torch.zeros(8)}
    with ftkit.Checkpointer(state, [str(tmp_path)], rng=False) as ck:
        ck.snapshot(1)
    (tmp_path / step_dir_name(1) / MANIFEST_NAME).write_text(json.dumps({"format": "nope"}))
    with ftkit.Checkpointer(state, [str(tmp_path)], rng=False) as ck:
        with pytest.raises(ftkit.CorruptCheckpointError, match="not an ftkit checkpoint manifest"):
            ck.restore()


def test_same_step_is_never_overwritten(tmp_path):
    state = {"t": torch.ones(8)}
    with ftkit.Checkpointer(state, [str(tmp_path)], rng=False) as ck:
        ck.snapshot(1)
        ck.wait()
        state["t"].fill_(9)
        ck.snapshot(1)  # e.g. a resumed run saving the step it restored
    with ftkit.Checkpointer(state, [str(tmp_path)], rng=False) as ck:
        ck.restore()
    assert torch.equal(state["t"], torch.ones(8))
    assert len(list((tmp_path / step_dir_name(1)).glob("*.data"))) == 1


def test_dtypes_and_odd_shapes_round_trip(tmp_path):
    state = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "f16": torch.randn(7).half(),
        "i64": torch.arange(10),
        "b": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(6, 4).t(),
        "u8": torch.arange(5, dtype=torch.uint8),
    }
    ref = {k: v.clone() for k, v in state.items()}
    with ftkit.Checkpointer(state, [str(tmp_path)], rng=False) as ck:
        ck.snapshot(1)
    for v in state.values():
        v.zero_()
    with ftkit.Checkpointer(state, [str(tmp_path)], rng=False) as ck:
        assert ck.restore() == 1
    for k in ref:
        assert state[k].dtype == ref[k].dtype and torch.equal(state[k], ref[k]), k


def test_a_state_whose_shapes_and_dtypes_change_between_snapshots_keeps_every_step_exact(tmp_path):
    # The staging layout is reused while names, shapes and dtypes stay (save/layout.py): a
    # growing buffer, a dtype change or a new entry must each get a layout of their own.
    state = {"w": torch.arange(4.0), "buf": torch.zeros(2, dtype=torch.int32)}
    saved = {}
    with ftkit.Checkpointer(state, [ftkit.Tier(str(tmp_path), keep=10)], rng=False) as ck:
        for step, change in enumerate(
            [
                lambda: None,
                lambda: state.__setitem__("buf", torch.arange(6, dtype=torch.int32)),  # grows
                lambda: state.__setitem__("w", state["w"].double() * 3),  # same shape, new dtype
                lambda: state.__setitem__("extra", torch.ones(3)),  # one more tensor
                lambda: state["w"].add_(1),  # nothing but values
            ],
            start=1,
        ):
            change()
            ck.snapshot(step)
            ck.wait()
            saved[step] = {k: v.clone() for k, v in state.items()}
    for step, expect in saved.items():
        live = {k: torch.zeros_like(v) for k, v in expect.items()}
        with ftkit.Checkpointer(live, [ftkit.Tier(str(tmp_path), keep=10)], rng=False) as ck:
            assert ck.restore(step) == step
        for k, v in expect.items():
            assert live[k].dtype == v.dtype and torch.equal(live[k], v), (step, k)


def test_uncompressed_data_file_is_the_staged_image_with_zeroed_gaps(tmp_path):
    state = {"a": torch.full((3,), 1.5), "b": torch.arange(5, dtype=torch.int16), "c": torch.ones(2, 3)}
    with ftkit.Checkpointer(state, [str(tmp_path)], rng=False) as ck:
        ck.snapshot(1)
    m = load_manifest(ftkit.Tier(str(tmp_path)).open(), 1)
    ((name, info),) = m.files.items()
    data = (tmp_path / step_dir_name(1) / name).read_bytes()
    assert len(data) == info["bytes"]
    used = bytearray(len(data))
    for t in m.tensors:
        for c in t.shards[0].chunks:
            assert c.offset % 64 == 0  # each tensor at its aligned staging offset
            used[c.offset : c.offset + c.length] = b"\x01" * c.length
    assert all(byte == 0 for byte, u in zip(data, used) if not u)  # the gaps hold no stale memory


def test_peer_replication_is_the_ram_tiers_replicas_and_the_older_spelling_still_works():
    from ftkit.config import resolve_tiers

    # ["ram", "peer"] (what --tiers takes) is the RAM tier with one replica; no "peer" tier remains.
    assert resolve_tiers(["ram", "peer", "/d"]) == [Tier("ram", replicas=1), Tier("/d")]
    assert resolve_tiers(["ram", {"url": "peer", "replicas": 2}]) == [Tier("ram", replicas=2)]
    assert resolve_tiers([Tier("ram", replicas=3), "/d"])[0].copies_elsewhere == 3
    assert resolve_tiers(["ram", "/d"])[0].copies_elsewhere == 0
    with pytest.raises(ValueError, match='add "ram"'):
        resolve_tiers(["peer", "/d"])
    with pytest.raises(ValueError, match="only the 'ram' tier"):
        Tier("/d", replicas=1)
    with pytest.raises(ValueError, match="at most one"):
        resolve_tiers(["ram", "ram"])


def test_a_configuration_that_cannot_work_is_an_ftkit_error_and_still_a_value_error(tmp_path):
    # `except ftkit.FtkitError` must catch every error ftkit raises on purpose (README).
    for make in (
        lambda: Tier(str(tmp_path), every=0),
        lambda: Tier(str(tmp_path), keep=0),
        lambda: Tier(str(tmp_path), compress="lz4"),
        lambda: ftkit.Checkpointer({}, []),
        lambda: ftkit.Checkpointer({}, [str(tmp_path)], policy="nope"),
    ):
        with pytest.raises(ftkit.ConfigError) as got:
            make()
        assert isinstance(got.value, ftkit.FtkitError) and isinstance(got.value, ValueError)


def test_rank_local_entries_come_back_to_their_rank_and_refuse_what_cannot_be_restored(tmp_path):
    """ftkit.RankLocal: a stateful object and a plain mapping, tensors inside, restored in place;
    the shared skeleton does not hold them; wrapping a value with no state protocol is refused."""

    class Position:
        def __init__(self):
            self.batches, self.order = 0, torch.zeros(4, dtype=torch.long)

        def state_dict(self):
            return {"batches": self.batches, "order": self.order}

        def load_state_dict(self, sd):
            self.batches = sd["batches"]
            self.order.copy_(sd["order"])

    pos, counters = Position(), {"seen": 0}
    state = {"w": torch.zeros(3), "pos": ftkit.RankLocal(pos), "counters": ftkit.RankLocal(counters)}
    with ftkit.Checkpointer(state, [str(tmp_path)], watchdog=False) as ck:
        pos.batches, pos.order, counters["seen"] = 7, torch.tensor([3, 1, 0, 2]), 28
        ck.snapshot(1)
        ck.wait()
        pos.batches, counters["seen"], counters["extra"] = 9, 36, 1
        pos.order.zero_()
        assert ck.restore() == 1
    assert pos.batches == 7 and pos.order.tolist() == [3, 1, 0, 2] and counters == {"seen": 28}
    manifest = load_manifest(Tier(str(tmp_path)).open(), 1)
    assert set(manifest.skeleton["entries"]) == {"w"} and set(manifest.rank_state["0"]["local"]) == {"pos", "counters"}
    with pytest.raises(TypeError, match="RankLocal wraps"):
        ftkit.RankLocal(3)


def test_a_slot_that_cannot_be_released_fails_wait_and_the_persist_thread_goes_on():
    """A device error when a job's slot is released (its copies' events raise) is kept for
    wait(), like a failed persist; the thread lives on, so wait() does not hang."""
    from types import SimpleNamespace

    from ftkit.coord.dist import DistContext
    from ftkit.save.pipeline import PersistJob, PersistPipeline, Stats

    released = []

    def release(slot):
        released.append(slot)
        if slot == "a":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    opened = SimpleNamespace(backends=[], keys={})
    pipeline = PersistPipeline(opened, DistContext(), Stats(), lambda *a, **k: None, release)
    for step, slot in ((1, "a"), (2, "b")):
        pipeline.submit(PersistJob(slot, step, {}, [], {}, {}, 0))  # type: ignore[arg-type]
    pipeline.drain(5)
    assert pipeline._jobs.unfinished_tasks == 0 and released == ["a", "b"]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        pipeline.wait()
    assert pipeline.close(5)


def test_a_checkpointer_that_fails_to_start_leaves_no_hook_or_thread_behind(tmp_path):
    """A bad argument found late in __init__ (here a signal number out of range, after the
    persist thread and the event log exist): nothing it started outlives the error."""
    import signal
    import threading

    from torch.optim import optimizer as torch_optimizer

    hooks = len(torch_optimizer._global_optimizer_pre_hooks)
    with pytest.raises(ValueError, match="signal number out of range"):
        ftkit.Checkpointer(
            {"w": torch.zeros(3)},
            [str(tmp_path / "tier")],
            rng=False,
            run_dir=str(tmp_path / "run"),
            preemption_signals=[signal.NSIG + 5],
        )
    assert len(torch_optimizer._global_optimizer_pre_hooks) == hooks
    persist = [t for t in threading.enumerate() if t.name == "ftkit-persist"]
    for t in persist:
        t.join(5)
    assert not any(t.is_alive() for t in persist)


def test_events_carry_the_generation_their_checkpointer_was_made_in(tmp_path):
    """A failed generation's persist may log after an in-process recovery began the next; its
    events must stay with their generation, or `ftkit report` and drills see a generation that
    never restored (an incident with every step lost)."""
    from ftkit.coord.events import read_events
    from ftkit.runtime import generation

    run_dir = str(tmp_path / "run")
    old = ftkit.Checkpointer({"w": torch.zeros(3)}, [str(tmp_path / "a")], rng=False, run_dir=run_dir)
    try:
        generation.join(1)  # the next generation begins while `old` still logs
        old.snapshot(1)
        old.close()
        with ftkit.Checkpointer({"w": torch.zeros(3)}, [str(tmp_path / "b")], rng=False, run_dir=run_dir) as new:
            new.snapshot(2)
    finally:
        generation.join(0)
    gens: dict[int, set[int]] = {}  # step -> the generations its events name
    for e in read_events(run_dir):
        if e["event"] in ("snapshot", "persist", "persist_job"):
            gens.setdefault(e["step"], set()).add(e.get("gen", 0))
    assert gens == {1: {0}, 2: {1}}


def test_continue_from_retires_an_earlier_runs_newer_steps_at_the_first_snapshot(tmp_path):
    """A loop that starts over on a tier holding an earlier run's steps 1-3: with
    continue_from(0) its own steps 1 and 2 are kept (they were refused as already committed)
    and a restart resumes them; the earlier run's step 3 is retired, not resumed."""
    tier = ftkit.Tier(str(tmp_path / "ckpt"), keep=None)
    state = {"w": torch.zeros(8)}
    with ftkit.Checkpointer(state, [tier], rng=False) as ck:
        for step in (1, 2, 3):
            state["w"].fill_(100 + step)
            ck.snapshot(step)
    with ftkit.Checkpointer(state, [tier], rng=False) as ck:
        ck.continue_from(0)
        assert committed_steps(tier.open()) == [1, 2, 3]  # nothing changes before the first snapshot
        for step in (1, 2):
            state["w"].fill_(step)
            ck.snapshot(step)
    assert committed_steps(tier.open()) == [1, 2]
    with ftkit.Checkpointer(state, [tier], rng=False) as ck:
        assert ck.restore() == 2
    assert torch.equal(state["w"], torch.full((8,), 2.0))


def test_a_step_that_is_not_a_whole_number_is_refused_at_the_call_and_an_integer_type_is_taken(tmp_path):
    """numpy's and torch's integers are steps like ints; a float, a string, a bool or a negative
    step is a one-line ConfigError from snapshot() itself, not a silent 'not due' (2.5) or a
    staged snapshot that fails in the background at every step."""
    import numpy as np

    state = {"t": torch.zeros(4)}
    with ftkit.Checkpointer(state, [str(tmp_path)], rng=False) as ck:
        for bad in (2.5, "3", True, -1, None, torch.arange(100)):
            with pytest.raises(ftkit.ConfigError, match=r"^snapshot\(step\): the step must be an int >= 0, not "):
                ck.snapshot(bad)
        assert ck.stats.snapshots == 0
        state["t"].fill_(1.0)
        assert ck.snapshot(np.int64(2))
        state["t"].fill_(2.0)
        assert ck.snapshot(torch.tensor(3))
        ck.wait()
        assert ck.stats.failed == 0
        assert committed_steps(Tier(str(tmp_path)).open()) == [2, 3]
        assert ck.restore(step=np.int64(2)) == 2
        assert torch.equal(state["t"], torch.ones(4))
        with pytest.raises(ftkit.ConfigError, match=r"^restore\(step\): the step must be an int >= 0, not "):
            ck.restore(step=2.0)
        with pytest.raises(ftkit.ConfigError, match=r"^continue_from\(step\): the step must be an int >= 0, not "):
            ck.continue_from("2")


def test_one_tier_given_alone_is_one_tier_not_one_per_character(tmp_path, monkeypatch):
    """tiers="/data/ckpt" is that one tier (as the trainer callbacks take it), not the tiers
    "/", "d", "a", ... written into the root and the working directory."""
    monkeypatch.chdir(tmp_path)
    state = {"t": torch.ones(4)}
    for spec in ("ck", Tier("ck2"), {"url": "ck3", "keep": 1}):
        with ftkit.Checkpointer(state, spec, rng=False) as ck:
            assert len(ck.tiers) == 1
            ck.snapshot(1)
    assert sorted(os.listdir(tmp_path)) == ["ck", "ck2", "ck3"]
    assert committed_steps(Tier(str(tmp_path / "ck3")).open()) == [1]


def test_tier_fields_of_the_wrong_type_are_a_config_error_naming_the_field():
    """A tier read from a config file or the environment ("10", 2.5) is refused when made, not
    by a TypeError at the first snapshot or a retention that fails in the background forever."""
    for fields, field in (
        (dict(every="10"), "every"),
        (dict(every=2.5), "every"),
        (dict(keep=1.5), "keep"),
        (dict(keep="3"), "keep"),
        (dict(keep_every=0), "keep_every"),
        (dict(keep_every="100"), "keep_every"),
        (dict(every=True), "every"),
    ):
        with pytest.raises(ftkit.ConfigError, match=rf"^tier '/ckpt': {field} must be an int"):
            Tier("/ckpt", **fields)
    for url in ("", 5, None):
        with pytest.raises(ftkit.ConfigError, match="tier url must be a non-empty string"):
            Tier(url)


def test_a_mutable_container_in_the_state_is_restored_in_place(tmp_path):
    """A dict or list the loop keeps a reference to (a defaultdict of counts, a history) is
    the object restored: its contents, not a plain copy put in its place. Otherwise the loop
    goes on updating an object the state no longer holds, every later snapshot saves the
    restored contents frozen, and a defaultdict comes back as a dict (KeyError)."""
    import collections

    def make():
        counts, history = collections.defaultdict(int), []
        return counts, history, {"counts": counts, "history": history, "epoch": 0}

    counts, history, state = make()
    with ftkit.Checkpointer(state, [str(tmp_path)], rng=False) as ck:
        counts["a"] += 2
        history.append(1.5)
        ck.snapshot(1)

    counts, history, state = make()
    with ftkit.Checkpointer(state, [str(tmp_path)], rng=False) as ck:
        assert ck.restore() == 1
        assert state["counts"] is counts and state["history"] is history
        assert dict(counts) == {"a": 2} and history == [1.5]
        counts["b"] += 1  # still a defaultdict
        history.append(2.5)
        ck.snapshot(2)

    counts, history, state = make()
    with ftkit.Checkpointer(state, [str(tmp_path)], rng=False) as ck:
        assert ck.restore() == 2
    assert dict(counts) == {"a": 2, "b": 1} and history == [1.5, 2.5]


class _RefusesOne:
    """Takes back any state but n == 1."""

    def __init__(self):
        self.n = 1

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        if state["n"] == 1:
            raise ValueError("n == 1 refused")
        self.n = state["n"]


def test_a_failed_restore_puts_a_container_restored_in_place_back(tmp_path):
    history = [1.0]
    state = {"history": history, "obj": _RefusesOne()}
    with ftkit.Checkpointer(state, [str(tmp_path)], rng=False) as ck:
        ck.snapshot(1)
        history.append(2.0)
        state["obj"].n = 2
        with pytest.raises(ftkit.FtkitError, match="load_state_dict refused"):
            ck.restore()
    assert state["history"] is history and history == [1.0, 2.0]


def test_a_staging_budget_that_is_not_a_positive_number_is_a_config_error_when_made(tmp_path):
    """max_staging_bytes="1GB" was a TypeError at the first snapshot, True a budget of one byte."""
    for bad in ("1GB", True, 0, -1, [1], float("nan"), float("inf")):
        with pytest.raises(ftkit.ConfigError, match=r"^max_staging_bytes must be a number of bytes > 0 or None, not "):
            ftkit.Checkpointer({"t": torch.zeros(4)}, [str(tmp_path)], rng=False, max_staging_bytes=bad)
    with ftkit.Checkpointer({"t": torch.zeros(4)}, [str(tmp_path)], rng=False, max_staging_bytes=2e6) as ck:
        assert ck.snapshot(1)
    ck = ftkit.Checkpointer({"t": torch.zeros(1024)}, [str(tmp_path)], rng=False, max_staging_bytes=100)
    with pytest.raises(ftkit.ConfigError, match="staging budget of 100 bytes cannot hold one snapshot"):
        ck.snapshot(2)  # (the snapshot's size is known only then)
    ck.close()


def test_a_pathlib_path_is_a_tier_url(tmp_path):
    """Checkpointer(state, [tmp_path]) was a TypeError ('PosixPath' object is not iterable)."""
    state = {"t": torch.ones(4)}
    for spec in ([tmp_path / "a"], tmp_path / "b", [Tier(tmp_path / "c", keep=1)], [{"url": tmp_path / "d"}]):
        with ftkit.Checkpointer(state, spec, rng=False) as ck:
            assert len(ck.tiers) == 1 and isinstance(ck.tiers[0].url, str)
            ck.snapshot(1)
    for name in "abcd":
        assert committed_steps(Tier(str(tmp_path / name)).open()) == [1]

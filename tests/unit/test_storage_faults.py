"""Storage faults (the drills' faulty:// filesystem): each one, and what restore gets back."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from conftest import REPO

import ftkit
from ftkit.drill.faults import register, set_faults
from ftkit.format.reader import committed_steps


def _run(url, steps_and_faults, root):
    """Snapshot steps in order, switching faults before each; return the checkpointer's stats."""
    state = {"w": torch.zeros(50_000), "step": 0}
    ck = ftkit.Checkpointer(state, [ftkit.Tier(url, keep=5)], rng=False)
    errors = []
    try:
        for step, faults in steps_and_faults:
            set_faults(root, **faults)
            state["w"].fill_(step)
            state["step"] = step
            ck.snapshot(step)
            try:
                ck.wait()
            except ftkit.FtkitError as e:
                errors.append((step, str(e)))
    finally:
        set_faults(root)
        ck.close()
    return ck.stats, errors


def _restore(url):
    state = {"w": torch.full((50_000,), -1.0), "step": -1}
    with ftkit.Checkpointer(state, [url], rng=False) as ck:
        got = ck.restore()
    assert state["step"] == got and torch.equal(state["w"], torch.full((50_000,), float(got)))
    return got


@pytest.fixture
def faulty(tmp_path):
    register()  # faulty:// exists only where a drill (or a test) registers it
    root = str(tmp_path / "ckpt")
    return f"faulty://{root}", root


def test_enospc_keeps_the_previous_step(faulty):
    url, root = faulty
    stats, errors = _run(url, [(1, {}), (2, {"enospc": True})], root)
    assert [s for s, _ in errors] == [2] and "no space left" in errors[0][1]
    assert stats.failed == 1 and committed_steps(ftkit.Tier(url).open()) == [1]
    assert _restore(url) == 1


def test_outage_fails_persists_then_recovers(faulty):
    url, root = faulty
    stats, errors = _run(url, [(1, {}), (2, {"unavailable": True}), (3, {})], root)
    assert [s for s, _ in errors] == [2] and "unavailable" in errors[0][1]
    assert committed_steps(ftkit.Tier(url).open()) == [1, 3]
    assert _restore(url) == 3


def test_latency_only_slows(faulty):
    url, root = faulty
    stats, errors = _run(url, [(1, {"latency_s": 0.05}), (2, {"latency_s": 0.05})], root)
    assert not errors and stats.persisted == 2
    assert _restore(url) == 2


def test_a_torn_write_is_caught_at_the_commit(faulty):
    # The commit re-checks every data file's size (issue 12, item 14): a file that landed
    # short never gets a manifest, so step 1 stays the newest.
    url, root = faulty
    stats, errors = _run(url, [(1, {}), (2, {"torn_write": True})], root)
    assert [s for s, _ in errors] == [2] and "bytes, not" in errors[0][1]
    assert committed_steps(ftkit.Tier(url).open()) == [1]
    assert _restore(url) == 1


@pytest.mark.parametrize("fault, needle", [("bitflip", "checksum mismatch")])
def test_silent_damage_is_caught_on_restore(faulty, caplog, fault, needle):
    url, root = faulty
    stats, errors = _run(url, [(1, {}), (2, {fault: True})], root)
    assert not errors  # the writer cannot tell: the damage is silent
    assert committed_steps(ftkit.Tier(url).open()) == [1, 2]
    with caplog.at_level(logging.WARNING, logger="ftkit"):
        assert _restore(url) == 1
    assert any("step 2" in r.message and needle in r.message for r in caplog.records)


def test_faulty_is_registered_only_where_a_drill_asks():
    # A fresh interpreter: ftkit, its checkpointer, tiers and CLI, and the drill package itself
    # leave fsspec without faulty://; the drills' reference trainer registers it (faults.register).
    code = (
        "import fsspec, ftkit, ftkit.checkpointer, ftkit.tiers.opened, ftkit.tools.cli, ftkit.drill\n"
        "try:\n"
        "    fsspec.get_filesystem_class('faulty')\n"
        "    print('registered')\n"
        "except ValueError:\n"
        "    from ftkit.drill.faults import register\n"
        "    register()\n"
        "    print(fsspec.get_filesystem_class('faulty').__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["FaultyFileSystem"], out.stdout + out.stderr


def test_a_persist_still_running_at_exit_is_finished_before_the_interpreter_ends(faulty):
    """A Checkpointer never closed (or a failed rank's, left running): its persist thread is
    joined at exit, so the step commits and no thread runs while the interpreter finalizes."""
    url, root = faulty
    code = (
        "import torch, ftkit\n"
        "from ftkit.drill.faults import register, set_faults\n"
        f"register(); set_faults({root!r}, latency_s=0.3)\n"
        f"ck = ftkit.Checkpointer({{'w': torch.arange(1000.0)}}, [{url!r}], rng=False, watchdog=False,\n"
        "                        preemption_signals=())\n"
        "ck.snapshot(1)\n"
        "print('exiting', flush=True)\n"  # no close(): its slow writes are still running
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["exiting"], out.stdout + out.stderr
    set_faults(root)
    assert committed_steps(ftkit.Tier(url).open()) == [1]
    state = {"w": torch.zeros(1000)}
    with ftkit.Checkpointer(state, [url], rng=False) as ck:
        assert ck.restore() == 1
    assert torch.equal(state["w"], torch.arange(1000.0))


def test_a_preemptions_final_save_waits_for_a_slot_even_under_policy_skip(faulty, tmp_path):
    """Slow storage keeps both staging slots busy when the notice comes: under policy "skip"
    an ordinary snapshot would be skipped, but the final save waits, commits, and says so."""
    import json
    import os
    import signal

    url, root = faulty
    set_faults(root, latency_s=0.2)
    state = {"w": torch.zeros(1000)}
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as ended:
        with ftkit.Checkpointer(
            state,
            [{"url": url, "keep": None}],
            policy="skip",
            rng=False,
            watchdog=False,
            preemption_signals=[signal.SIGTERM],
            run_dir=str(run_dir),
        ) as ck:
            for step in range(1, 10):
                state["w"].fill_(step)
                if step == 3:
                    os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice, mid-step
                ck.snapshot(step)
    assert ended.value.code == 128 + signal.SIGTERM
    set_faults(root)
    assert committed_steps(ftkit.Tier(url).open())[-1] == 3
    back = {"w": torch.zeros(1000)}
    with ftkit.Checkpointer(back, [url], rng=False, watchdog=False, preemption_signals=()) as ck:
        assert ck.restore() == 3
    assert torch.equal(back["w"], torch.full((1000,), 3.0))
    flushes = [json.loads(line) for p in run_dir.rglob("*.jsonl") for line in p.read_text().splitlines()]
    assert [(e["step"], e["ok"]) for e in flushes if e["event"] == "preempt_flush"] == [(3, True)]


def test_a_loop_that_raised_on_one_rank_leaves_no_staging_memory_or_open_log_behind(tmp_path):
    """One process, an exception inside the `with` block: close(failed=True) has waited for the
    persists, so it also frees the staging slots and closes the event log (a retry loop that
    raised each time held every attempt's slots)."""
    import psutil

    run_dir = tmp_path / "run"
    for attempt in range(2):
        with pytest.raises(RuntimeError, match="the loop failed"):
            with ftkit.Checkpointer(
                {"w": torch.ones(1 << 20)}, [str(tmp_path / "ckpt")], rng=False, run_dir=str(run_dir)
            ) as ck:
                ck.snapshot(attempt + 1)
                raise RuntimeError("the loop failed")
        assert ck._arena.nbytes == 0  # (private: no public figure of staging memory)
        assert not [f for f in psutil.Process().open_files() if f.path.startswith(str(run_dir))]
    assert committed_steps(ftkit.Tier(str(tmp_path / "ckpt")).open()) == [1, 2]


def test_a_retention_failure_after_a_commit_is_not_a_failed_persist(faulty, tmp_path):
    """The old step cannot be removed (its directory's storage fails): the new step is still
    committed and counted so, the failure is a warning and a "retention" event, and the next
    commit's retention removes what was left."""
    import json
    import os

    from ftkit.format.manifest import step_dir_name

    url, root = faulty
    old_dir = os.path.join(root, step_dir_name(1))
    run_dir = tmp_path / "run"
    state = {"w": torch.zeros(100)}
    with ftkit.Checkpointer(state, [{"url": url, "keep": 1}], rng=False, watchdog=False, run_dir=str(run_dir)) as ck:
        ck.snapshot(1)
        ck.wait()
        set_faults(old_dir, unavailable=True)  # step 1's directory cannot be read or removed
        ck.snapshot(2)
        ck.wait()  # (raised the retention failure as the persist's before)
        assert ck.stats.failed == 0 and ck.stats.persisted == 2
        set_faults(old_dir)
        ck.snapshot(3)
    assert committed_steps(ftkit.Tier(url).open()) == [3]
    events = [json.loads(line) for p in run_dir.rglob("*.jsonl") for line in p.read_text().splitlines()]
    assert [(e["step"], e["ok"]) for e in events if e["event"] == "persist"] == [(1, True), (2, True), (3, True)]
    assert [(e["step"], e["ok"]) for e in events if e["event"] == "retention"] == [(2, False)]

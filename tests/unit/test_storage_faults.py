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

"""Requeue on SLURM's warning signal: the job id, the scontrol call, the notice that carries a
peer's signal, and a Checkpointer that saves, requeues and exits. scontrol is a script on PATH
that records its arguments (there is no SLURM here); the multi-rank case under Lightning is in
test_integrations_multiprocess.py."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

import ftkit
from ftkit.coord.events import EventLog, read_events
from ftkit.coord.preemption import PreemptionHandler, parse_preemption_notice, preemption_notice
from ftkit.coord.requeue import requeue, slurm_job_id
from ftkit.format.reader import committed_steps


@pytest.fixture
def scontrol(tmp_path, monkeypatch):
    """A stand-in scontrol on PATH: records its arguments; exits with $FAKE_SCONTROL_RC."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$*" >> {calls}\necho "slurm says no" >&2\nexit ${{FAKE_SCONTROL_RC:-0}}\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for k in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(k, raising=False)
    return lambda: calls.read_text().splitlines() if calls.exists() else []


def test_the_job_id_is_slurms_and_only_an_id_reaches_the_command_line():
    assert slurm_job_id({"SLURM_JOB_ID": "4242"}) == "4242"
    assert slurm_job_id({"SLURM_JOB_ID": "4243", "SLURM_ARRAY_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "7"}) == "4242_7"
    assert slurm_job_id({}) is None
    assert slurm_job_id({"SLURM_JOB_ID": "1; rm -rf ~"}) is None
    assert slurm_job_id({"SLURM_JOB_ID": "--all"}) is None


def test_requeue_calls_scontrol_once_and_says_what_failed(scontrol, monkeypatch):
    assert requeue() == (False, "not requeued: no SLURM job id in the environment (SLURM_JOB_ID)")
    assert scontrol() == []
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert requeue() == (True, "job 4242 requeued")
    assert scontrol() == ["requeue 4242"]
    monkeypatch.setenv("FAKE_SCONTROL_RC", "1")
    assert requeue() == (False, "job 4242 not requeued: scontrol requeue exited 1: slurm says no")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert requeue() == (False, "job 4242 not requeued: scontrol is not on PATH")


def test_a_notice_carries_the_signal_and_a_forged_one_is_read_safely():
    assert parse_preemption_notice(preemption_notice(3, signal.SIGUSR1)) == (3, signal.SIGUSR1)
    assert parse_preemption_notice({"rank": 3}) == (3, signal.SIGTERM)  # a notice of an older ftkit
    assert parse_preemption_notice({"rank": 3, "signal": 99999}) == (3, signal.SIGTERM)
    assert parse_preemption_notice({"rank": 3, "signal": "SIGKILL"}) == (3, signal.SIGTERM)
    for bad in (None, [], "x", {"rank": "0"}, {"rank": True}, {"signal": 10}):
        assert parse_preemption_notice(bad) is None


def test_only_rank_0_requeues_and_only_on_a_requeue_signal():
    def handler(rank: int) -> PreemptionHandler:
        return PreemptionHandler([signal.SIGTERM], 60, lambda *a, **k: None, [signal.SIGUSR1], rank)

    assert handler(0).signals == (signal.SIGTERM, signal.SIGUSR1)
    for rank, due in ((0, True), (1, False)):
        h = handler(rank)
        h.request(signal.SIGUSR1, by_rank=5)  # heard from a peer: its signal counts
        try:
            assert h.requeue_wanted() and h.requeue_due() == due
        finally:
            h.done()
    h = handler(0)
    h.request(signal.SIGTERM)
    try:
        assert not h.requeue_due()  # torchrun's or the scheduler's ending: no requeue
    finally:
        h.done()


def test_a_signal_without_a_name_is_named_and_requested_once():
    rt = signal.SIGRTMIN + 6
    events = []
    h = PreemptionHandler([signal.SIGTERM], 60, lambda *a, **k: events.append((a, k)))
    h.request(rt, by_rank=3)
    h.request(signal.SIGTERM)  # the first notice stands
    try:
        assert h.requested == rt and len(events) == 1
        assert events[0][1]["signal"] == f"signal {int(rt)}"
    finally:
        h.done()


def test_the_requeue_signal_saves_the_step_requeues_and_exits(tmp_path, scontrol, monkeypatch):
    """One process, as a plain loop under SLURM would use it: SIGUSR1 arrives mid-step; the next
    snapshot saves that step to the tier (nothing was due), scontrol requeues the job, and the
    process exits 128 + SIGUSR1. A new run restores the step."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    model = torch.nn.Linear(4, 4)
    ckpt = tmp_path / "ckpt"
    events = tmp_path / "events"
    tier = ftkit.Tier(str(ckpt), every=1000)
    with pytest.raises(SystemExit) as ended:
        with ftkit.Checkpointer({"model": model}, [tier], requeue_signals=[signal.SIGUSR1], run_dir=str(events)) as ck:
            for step in range(1, 10):
                with torch.no_grad():
                    model.weight.add_(1.0)
                if step == 4:
                    os.kill(os.getpid(), signal.SIGUSR1)
                ck.snapshot(step)
    assert ended.value.code == 128 + signal.SIGUSR1
    assert scontrol() == ["requeue 4242"]
    assert committed_steps(tier.open()) == [4]
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # put back
    fresh = torch.nn.Linear(4, 4)
    with ftkit.Checkpointer({"model": fresh}, [str(ckpt)], preemption_signals=()) as ck:
        assert ck.restore() == 4
    assert torch.equal(fresh.weight, model.weight)
    logged = "".join(p.read_text() for p in events.rglob("*.jsonl"))
    assert '"requeue"' in logged and "job 4242 requeued" in logged


def test_no_step_within_the_deadline_still_requeues_before_exiting(tmp_path, scontrol, monkeypatch):
    """The signal arrives but no step ends (a long step, a hang): at the deadline the process
    exits without a final save, and rank 0 still asks for the requeue (the next run restores
    the newest step saved before)."""
    import subprocess
    import sys

    from conftest import REPO

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    script = (
        "import os, signal, time, torch, ftkit\n"
        f"ck = ftkit.Checkpointer({{'w': torch.zeros(2)}}, [{str(tmp_path / 'ckpt')!r}],\n"
        "                       requeue_signals=[signal.SIGUSR1], preemption_deadline_s=0.5)\n"
        "ck.snapshot(1)\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "time.sleep(30)  # a step that never ends\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 128 + signal.SIGUSR1, r.stderr[-2000:]
    assert scontrol() == ["requeue 4242"]
    assert "no step ended within the" in r.stderr and "job 4242 requeued" in r.stderr


def test_a_signal_landing_inside_an_event_write_does_not_deadlock(tmp_path):
    """The handler runs on the thread it interrupts, which may be inside EventLog.emit with its
    lock held (an event every step): the preemption's own event must not wait on it forever."""
    events = EventLog(str(tmp_path), 0)
    h = PreemptionHandler([signal.SIGTERM], 60, events.emit)

    def interrupted_mid_emit() -> None:
        with events._lock:  # where the signal landed
            h.request(signal.SIGTERM)

    t = threading.Thread(target=interrupted_mid_emit, daemon=True)  # (a deadlock stays in the thread)
    t.start()
    t.join(timeout=10)
    h.done()
    assert not t.is_alive(), "the preemption request deadlocked on the event log's lock"
    assert [e["event"] for e in read_events(str(tmp_path))] == ["preempt"]


def test_checkpointers_closed_in_the_order_they_were_made_leave_sigterm_to_its_default(tmp_path):
    """Two Checkpointers, the first closed first: the second's close put the first's (retired)
    handler back, which swallowed SIGTERM and ended the process at its deadline instead. Now a
    retired handler passes the signal on: the default action ends the process at once."""
    import subprocess
    import sys

    from conftest import REPO

    code = (
        "import os, signal, torch, ftkit\n"
        f"a = ftkit.Checkpointer({{'w': torch.zeros(2)}}, [{str(tmp_path / 'a')!r}], preemption_deadline_s=5)\n"
        f"b = ftkit.Checkpointer({{'w': torch.zeros(2)}}, [{str(tmp_path / 'b')!r}], preemption_deadline_s=5)\n"
        "a.snapshot(1); b.snapshot(1)\n"  # (the first snapshot installs the handlers)
        "a.close(); b.close()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "print('survived SIGTERM', flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == -signal.SIGTERM and "survived" not in out.stdout, (out.returncode, out.stderr[-2000:])

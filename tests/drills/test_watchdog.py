"""Failure detection and restart under real torchrun (4 ranks, gloo, CPU).

Each job is the reference trainer (DDP, RAM tier, snapshot every step). A
faulted run must finish by itself and end bit for bit where an unfaulted run of
the same length ends.
"""

from __future__ import annotations

import signal

import pytest
import torch
from torchrun_job import Job, stop_everything

from ftkit.tools.report import analyze, to_html

STEPS = 30


@pytest.fixture(scope="module")
def reference_final(tmp_path_factory, zygote):
    """The final state of the same job without any fault."""
    root = tmp_path_factory.mktemp("clean")
    job = Job(root, zygote=zygote, steps=STEPS, extra=("--ram",))
    try:
        assert job.wait() == 0, job.output()
    finally:
        stop_everything(job)
    assert not [e for e in job.events() if e["event"] in ("detect", "abort", "straggler")]
    return torch.load(job.final, weights_only=True)


def _assert_same_final(job: Job, reference) -> None:
    got = torch.load(job.final, weights_only=True)
    for k, v in reference["model"].items():
        assert torch.equal(got["model"][k], v), k
    for pid, st in reference["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(got["optim"]["state"][pid][k], v), (pid, k)


def test_sigkill_of_one_rank_restarts_and_finishes_exactly(tmp_path, reference_final, zygote):
    job = Job(tmp_path, zygote=zygote, steps=STEPS, extra=("--ram", "--step-time", "0.05"))
    try:
        job.wait_for_step(10, rank=2)
        killed_at = job.signal(2, signal.SIGKILL)
        assert job.wait() == 0, job.output()
    finally:
        stop_everything(job)
    events = job.events()
    restarts = [e for e in events if e["event"] == "start" and e["attempt"] == 1]
    assert len(restarts) == 4
    # Back long before the 120 s process-group timeout the survivors' collective had.
    assert min(e["t"] for e in restarts) - killed_at < 60
    restores = [e for e in events if e["event"] == "restore" and e["attempt"] == 1]
    assert {e["source"] for e in restores} == {"ram"} and len({e["step"] for e in restores}) == 1
    assert restores[0]["step"] >= 9
    _assert_same_final(job, reference_final)
    report = analyze(events)
    assert report.final_step == STEPS and len(report.incidents) == 1
    inc = report.incidents[0]
    assert inc.resumed_from == restores[0]["step"] and inc.steps_lost == inc.last_step - inc.resumed_from
    assert inc.restore_source == "ram" and 0 < report.goodput < 1
    assert "goodput" in to_html(report, events)


def test_sigstop_of_one_rank_is_detected_as_dead_and_restarted(tmp_path, reference_final, zygote):
    job = Job(tmp_path, zygote=zygote, steps=STEPS, extra=("--ram", "--step-time", "0.05"))
    try:
        job.wait_for_step(10, rank=1)
        job.signal(1, signal.SIGSTOP)  # alive to the OS, silent to everyone else
        assert job.wait() == 0, job.output()
    finally:
        stop_everything(job)
    events = job.events()
    detects = [e for e in events if e["event"] == "detect"]
    assert detects and {e["target"] for e in detects} == {1} and {e["what"] for e in detects} == {"dead"}
    assert all(e["latency_s"] < 10 for e in detects)
    assert {e["rank"] for e in events if e["event"] == "abort"} <= {0, 2, 3}
    assert any(e["event"] == "start" and e["attempt"] == 1 for e in events)
    _assert_same_final(job, reference_final)
    inc = analyze(events).incidents[0]
    assert inc.detected_by.startswith("ftkit watchdog") and inc.detect_s is not None


def test_slow_rank_is_reported_as_straggler_without_restart(tmp_path, zygote):
    job = Job(
        tmp_path,
        zygote=zygote,
        steps=40,
        extra=("--ram", "--step-time", "0.1", "--slow-rank", "3", "--slow-factor", "3"),
        max_restarts=0,
    )
    try:
        assert job.wait() == 0, job.output()
    finally:
        stop_everything(job)
    events = job.events()
    stragglers = [e for e in events if e["event"] == "straggler"]
    assert stragglers and {e["target"] for e in stragglers} == {3}
    assert not [e for e in events if e["event"] in ("detect", "abort")]
    assert analyze(events).stragglers[0]["rank"] == 3


def test_heartbeat_thread_death_and_store_outage_kill_nobody(tmp_path, zygote):
    job = Job(tmp_path, zygote=zygote, steps=40, extra=("--step-time", "0.1"), max_restarts=0, module="wd_worker")
    try:
        assert job.wait() == 0, job.output()
    finally:
        stop_everything(job)
    events = job.events()
    assert [e for e in events if e["event"] == "heartbeat_restarted" and e["rank"] == 1]
    assert not [e for e in events if e["event"] in ("detect", "abort")]
    assert max(e["step"] for e in events if e["event"] == "step") == 40

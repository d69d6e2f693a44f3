"""The drill's Injector (ftkit/drill/job.py): what its background threads fail to do reaches the drill."""

from __future__ import annotations

import subprocess

import pytest

from ftkit.drill.job import Injector
from ftkit.drill.schedule import Fault, parse_faults


class FrozenJob:
    """As much of a Job as the Injector uses: its rank "frozen" at the fault point is `pid`."""

    ranks_per_node = 2

    def __init__(self, pid: int):
        self.pid = pid

    def attempt(self) -> tuple[int, int]:
        return (0, 0)

    def freeze_at(self, phase: str, step: int, rank: int, action: str = "stop") -> dict:
        return {"pid": self.pid, "at_step": step}

    def note_fault(self, *args) -> None:
        pass


class S3ThatDoesNotComeBack:
    def stop_process(self, kill: bool = False) -> None:
        pass

    def start_process(self) -> None:
        raise RuntimeError("weed exited with code 1 during startup")


def test_an_s3_server_that_does_not_come_back_is_a_failure_of_the_drill():
    rank = subprocess.Popen(["sleep", "60"])
    try:
        (fault,) = parse_faults("s3-outage@5:seconds=0", 4, 2)
        injector = Injector(FrozenJob(rank.pid), None, S3ThatDoesNotComeBack())  # type: ignore[arg-type]
        injector.inject(fault)
        injector.join()
    finally:
        rank.kill()
        rank.wait()
    assert injector.failures == ["restarting the S3 server: weed exited with code 1 during startup"]


def test_fault_durations_and_factors_are_finite_numbers():
    for bad in ("enospc@5:seconds=nan", "unavailable@5:seconds=inf", "latency@5:factor=inf", "slow@5:factor=nan"):
        with pytest.raises(ValueError, match=f"'{bad}': factor must be a finite number > 0"):
            parse_faults(bad, 4, 2)
    for bad in ("agent@5:host=1:for=nan", "partition@5:host=1:for=-1"):
        with pytest.raises(ValueError, match=f"'{bad}': for= must be a finite number"):
            parse_faults(bad, 4, 2, hosts=3)
    with pytest.raises(ValueError, match="factor must be at least 1"):
        parse_faults("slow@5:factor=0.5", 4, 2)  # (1/0.5 speed: faster, which no throttle can do)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_background_fault_that_breaks_is_a_failure_of_the_drill_and_leaves_no_rank_stopped():
    # Faults built past parse_faults' checks: whatever a background thread trips on is reported.
    rank = subprocess.Popen(["sleep", "60"])
    try:
        injector = Injector(FrozenJob(rank.pid), None, S3ThatDoesNotComeBack())  # type: ignore[arg-type]
        injector.inject(Fault("s3-outage", 5, seconds=float("nan")))
        injector.inject(Fault("slow", 6, rank=0, factor=0.5, seconds=5))
        injector.join()
        assert _state(rank.pid) != "T"  # the slow fault's throttle let it run again
    finally:
        rank.kill()
        rank.wait()
    assert [m.split(":")[0] for m in injector.failures] == ["restarting the S3 server", "slowing slow@6 (rank 0)"]

"""The drill's Injector (ftkit/drill/job.py): what its background threads fail to do reaches the drill."""

from __future__ import annotations

import subprocess

from ftkit.drill.job import Injector
from ftkit.drill.schedule import parse_faults


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

"""Launch the reference trainer under real torchrun and poke its ranks, for watchdog tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from conftest import REPO, warm_target

from ftkit.runtime.warm.zygote import torchrun_command


class Job:
    """`torchrun -m ftkit.drill.reference` in the background, with its run dir and RAM dir under `root`;
    its workers forked from `zygote` when one is given (conftest.zygote)."""

    def __init__(
        self,
        root,
        nproc: int = 4,
        steps: int = 30,
        extra: tuple[str, ...] = (),
        max_restarts: int = 2,
        module: str = "ftkit.drill.reference",
        zygote=None,
    ):
        self.root = root
        self.run_dir = root / "run"
        self.final = root / "final.pt"
        env = {
            **os.environ,
            "FTKIT_RAM_DIR": str(root / "shm"),
            "FTKIT_JOB_ID": "job",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "tests", "support"), os.environ.get("PYTHONPATH", "")]),
            **(zygote.env() if zygote else {}),
        }
        target = ["-m", module]
        cmd = torchrun_command(
            zygote,
            [
                "--standalone",
                f"--nproc-per-node={nproc}",
                f"--max-restarts={max_restarts}",
                "--monitor-interval=0.1",
                *(warm_target(zygote, target) if zygote else target),
                "--ckpt",
                str(root / "ckpt"),
                "--steps",
                str(steps),
                "--run-dir",
                str(self.run_dir),
                "--final-out",
                str(self.final),
                "--pg-timeout",
                "120",
                *extra,
            ],
        )
        self.log = open(root / "torchrun.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def events(self, rank: int | None = None) -> list[dict]:
        out = []
        d = self.run_dir / "events"
        for f in sorted(d.glob("*.jsonl")) if d.exists() else []:
            for line in f.read_text().splitlines():
                try:
                    e = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rank is None or e["rank"] == rank:
                    out.append(e)
        return sorted(out, key=lambda e: e["t"])

    def wait_for_step(self, step: int, rank: int = 0, timeout: float = 120) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for e in self.events(rank):
                if e["event"] == "step" and e["step"] >= step:
                    return e
            if self.proc.poll() is not None:
                raise AssertionError(f"job ended before step {step}:\n{self.output()}")
            time.sleep(0.2)
        raise AssertionError(f"no step {step} within {timeout}s:\n{self.output()}")

    def pid(self, rank: int) -> int:
        starts = [e for e in self.events(rank) if e["event"] == "start"]
        return starts[-1]["pid"]

    def signal(self, rank: int, sig: int) -> float:
        os.kill(self.pid(rank), sig)
        return time.time()

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"job did not finish in {timeout}s:\n{self.output()}") from None
        finally:
            self.log.close()

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.root / "torchrun.log").read_text()[-4000:]


def stop_everything(job: Job) -> None:
    """Leave no process behind, whatever happened (SIGCONT first: a stopped one ignores TERM)."""
    if job.proc.poll() is None:
        for e in job.events():
            if e["event"] == "start":
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(e["pid"], sig)
                    except ProcessLookupError:
                        pass
        job.proc.kill()
        job.proc.wait()

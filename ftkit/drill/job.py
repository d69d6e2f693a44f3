"""A job under drill: torchrun running the trainer, what it logged, and the faults done to it.

For each fault, ``Injector.inject`` has a rank freeze at a fault point (ftkit/coord/faultpoints.py),
does the fault (kill it, wipe its node, stop the S3 server...) and lets it go on where the fault
allows; run.py then waits for the restart (``wait_restarted``), and always ``kill()``s the job.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ftkit.coord.events import read_events
from ftkit.coord.faultpoints import FAULT_POINTS_ENV
from ftkit.drill.faults import set_faults
from ftkit.drill.schedule import OBJECT_STORE_KINDS, STORAGE_KINDS, Fault
from ftkit.runtime.warm.client import process_start, process_stopped
from ftkit.runtime.warm.zygote import Zygote, client_path, torchrun_command
from ftkit.tools.report import epoch

# A storage fault's key in faults.py's switch.
_STORAGE_SWITCH = {k: k.replace("-", "_") for k in STORAGE_KINDS} | {"latency": "latency_s"}


def latest_attempt(events: list[dict[str, Any]]) -> tuple[int, int]:
    """The newest (torchrun attempt, in-process generation) that has started."""
    return max((epoch(e) for e in events if e["event"] == "start"), default=(0, 0))


def starts(events: list[dict[str, Any]], attempt: tuple[int, int]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "start" and epoch(e) == attempt]


class RunLog:
    """A job's event log (`run_dir`), the drill's notes in it, and the fault points it freezes ranks
    at (`fault_request`); a subclass gives `proc`, or its own :meth:`ended`."""

    run_dir: str
    fault_request: str
    ranks_per_node: int
    proc: Any

    def ended(self) -> int | None:
        """The job's exit code once it has ended, else None."""
        return self.proc.poll()

    def events(self) -> list[dict[str, Any]]:
        return read_events(self.run_dir)

    def attempt(self) -> tuple[int, int]:
        return latest_attempt(self.events())

    def note_fault(self, f: Fault, attempt: tuple[int, int], rec: dict[str, Any], target: Any) -> None:
        """Record on `f` when and where it struck (`rec`: its fault point's record), and note it in the
        job's event log beside the ranks' own (rank -1)."""
        (f.attempt, f.gen), f.injected_t, f.injected_step = attempt, time.time(), rec.get("at_step")
        event = {"t": time.time(), "rank": -1, "event": "fault", "kind": f.kind, "step": f.injected_step}
        event |= {"during": f.during, "attempt": attempt[0], **({"gen": attempt[1]} if attempt[1] else {})}
        # `restarts`: the report takes only these as a restart's cause (not a storage fault or slow rank).
        event |= {"target": target, "restarts": f.restarts}
        os.makedirs(os.path.join(self.run_dir, "events"), exist_ok=True)
        with open(os.path.join(self.run_dir, "events", "drill.jsonl"), "a") as log:
            log.write(json.dumps(event) + "\n")

    def freeze_at(self, phase: str, step: int, rank: int, action: str = "stop", timeout: float = 600) -> dict[str, Any]:
        """Ask `rank` to stop (or crash) at `phase` of `step` or later; once it has, the fault point's
        record (pid, at_step). RuntimeError when the job ends or the timeout passes first."""
        reached = self.fault_request + ".reached"
        for stale in (reached, self.fault_request):
            if os.path.exists(stale):
                os.remove(stale)
        tmp = self.fault_request + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"phase": phase, "step": step, "rank": rank, "action": action}, f)
        os.replace(tmp, self.fault_request)
        end = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError, ValueError), open(reached) as f:
                rec = json.load(f)
                if "pid" in rec:
                    break
            if (rc := self.ended()) is not None:
                raise RuntimeError(f"the job ended (exit {rc}) before rank {rank} reached {phase} of step {step}")
            if time.monotonic() > end:
                raise RuntimeError(f"rank {rank} did not reach {phase} of step {step} within {timeout:.0f}s")
            time.sleep(0.02)
        if action == "stop":
            _wait_stopped(rec["pid"])
        return rec


class Job(RunLog):
    """torchrun with `nproc` workers running `entry` (``-m module args`` or ``script args``); with a
    `zygote` (ftkit/runtime/warm) each worker is forked warm, and faults go to the forked workers."""

    def __init__(
        self,
        root: str,
        entry: Sequence[str],
        nproc: int,
        ranks_per_node: int,
        restarts: int,
        env: dict[str, str] | None = None,
        zygote: Zygote | None = None,
    ):
        self.ranks_per_node = ranks_per_node
        self.run_dir = os.path.join(root, "run")
        self.ram_dir = os.path.join(root, "shm")
        self.fault_request = os.path.join(root, "fault-request")
        full_env = {
            **os.environ,
            **(env or {}),
            "FTKIT_RAM_DIR": self.ram_dir,
            "FTKIT_JOB_ID": "drill",
            "FTKIT_RANKS_PER_NODE": str(ranks_per_node),
            "FTKIT_RUN_DIR": self.run_dir,
            FAULT_POINTS_ENV: self.fault_request,
            "OMP_NUM_THREADS": "1",
            **(zygote.env() if zygote else {}),
        }
        if zygote is not None:
            entry = [client_path(), "--module", *entry[1:]] if entry[0] == "-m" else [client_path(), *entry]
        # torchrun's agent too is forked warm from the zygote when there is one.
        args = ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={restarts}", "--monitor-interval=0.1"]
        cmd = torchrun_command(zygote, [*args, *entry])
        self.log = open(os.path.join(root, "torchrun.log"), "w")
        # Its own process group: cleaning up kills the workers too, not just torchrun.
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )

    def kill(self) -> None:
        for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped worker ignores everything but these
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
        self.proc.wait()
        self.log.close()

    def wait_restarted(self, attempt: tuple[int, int], timeout: float = 300) -> bool:
        """Until the next attempt (or in-process generation) has started; False if it never does."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.proc.poll() is None and self.attempt() <= attempt:
            time.sleep(0.1)
        return self.attempt() > attempt


def _wait_stopped(pid: int, timeout: float = 5.0) -> None:
    """Until the kernel reports `pid` stopped (it signals itself right after the record)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and os.path.exists(f"/proc/{pid}") and not process_stopped(pid):
        time.sleep(0.005)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


class Injector:
    """Does each kind of fault to a running Job."""

    def __init__(self, job: Job, durable_root: str | None = None, s3_server: Any = None):
        self.job = job
        self.durable_root = durable_root  # the local directory behind faulty:// (storage faults)
        self.s3 = s3_server  # ftkit.drill.s3server.S3Server the drill started (s3-outage)
        self.threads: list[threading.Thread] = []
        self.failures: list[str] = []  # what a background thread could not do, for the drill's errors
        self._storage_faults: dict[str, Any] = {}
        self._lock = threading.Lock()

    def inject(self, f: Fault) -> None:
        job = self.job
        attempt = job.attempt()
        rank = (f.node or 0) * job.ranks_per_node if f.kind == "node" else (f.rank or 0)
        rec = job.freeze_at(f.during, f.step, rank, action="crash" if f.kind == "crash" else "stop")
        pid = rec["pid"]
        target = (
            f"node{f.node}" if f.kind == "node" else f.kind if f.kind in STORAGE_KINDS + OBJECT_STORE_KINDS else rank
        )
        job.note_fault(f, attempt, rec, target)
        if f.kind == "kill":
            _signal(pid, signal.SIGKILL)
        elif f.kind in ("hang", "crash"):
            pass  # a hang stays stopped for the watchdog; a crash was raised at the fault point
        elif f.kind == "term":
            _signal(pid, signal.SIGTERM)  # delivered when it runs again
            _signal(pid, signal.SIGCONT)
        elif f.kind == "node":
            for e in starts(job.events(), attempt):
                if e["rank"] // job.ranks_per_node == f.node:
                    # A warm worker's client (its launcher) dies with its node too (else it would replace it).
                    _signal(e.get("launcher", e["pid"]), signal.SIGKILL)
                    _signal(e["pid"], signal.SIGKILL)
            shutil.rmtree(os.path.join(job.ram_dir, "drill", f"node{f.node}"), ignore_errors=True)
        elif f.kind == "slow":
            _signal(pid, signal.SIGCONT)
            self._background(self._later, 0, f"slowing {f.label()}", lambda: _throttle(pid, f.factor, f.seconds))
        elif f.kind in STORAGE_KINDS:
            key = _STORAGE_SWITCH[f.kind]
            self._switch_storage(key, f.factor if f.kind == "latency" else True)
            _signal(pid, signal.SIGCONT)
            self._background(self._later, f.seconds, f"ending {f.label()}", lambda: self._switch_storage(key, None))
        elif f.kind in OBJECT_STORE_KINDS:
            assert self.s3 is not None
            self.s3.stop_process(kill=True)  # instant: the rank must not stay frozen long
            _signal(pid, signal.SIGCONT)
            self._background(self._later, f.seconds, "restarting the S3 server", self.s3.start_process)

    def _switch_storage(self, key: str, value: Any) -> None:
        """Storage faults overlap: each switches its own key, the others stay as they are."""
        assert self.durable_root is not None
        with self._lock:
            if value:
                self._storage_faults[key] = value
            else:
                self._storage_faults.pop(key, None)
            set_faults(self.durable_root, **self._storage_faults)

    def _background(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        self.threads.append(t)

    def _later(self, seconds: float, what: str, fn: Callable[[], Any]) -> None:
        """`fn` after `seconds` (in a background thread); its failure is the drill's, not lost with the thread."""
        try:
            time.sleep(seconds)  # (inside: a bad `seconds` is a failure too)
            fn()
        except Exception as e:  # noqa: BLE001 (reported at the end of the drill)
            self.failures.append(f"{what}: {e}")

    def busy(self) -> bool:
        """Whether a background action (a host or agent to bring back, a fault to end) is still to come."""
        return any(t.is_alive() for t in self.threads)

    def join(self, timeout: float = 120) -> None:
        for t in self.threads:
            t.join(timeout)


def _throttle(pid: int, factor: float, seconds: float) -> None:
    """Run `pid` at 1/factor speed for `seconds`, or until its process ends (never a new one with its pid)."""
    end = time.monotonic() + seconds
    born = process_start(pid)
    try:
        while time.monotonic() < end and born is not None and process_start(pid) == born:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.1 * (1 - 1 / factor))
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.1 / factor)
    except ProcessLookupError:
        pass
    finally:  # whatever went wrong, the rank is not left stopped
        if born is not None and process_start(pid) == born:
            _signal(pid, signal.SIGCONT)

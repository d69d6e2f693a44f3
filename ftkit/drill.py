"""Failure-injection drills: prove that a setup recovers, with nothing lost.

    ftkit drill [--nproc 4] [--steps 60] [--faults SPEC | --seed N] [--run-dir DIR]
                [--json FILE] [--html FILE]

A drill runs the reference trainer (tiny GPT, data parallel under real torchrun,
RAM tier + peer replicas + a local durable tier, two simulated nodes) with a
fault schedule, runs the same job once without faults, and checks:

* every fault was followed by a detection and a restart that finished the run;
* the final model and optimizer state equal the fault-free run bit for bit;
* per fault: when injected, detected by what, recovery time by phase, the step
  resumed from, steps lost, and the source restored from.

The schedule is a comma-separated list of ``KIND@STEP[:key=value...]``:

    kill@12:rank=1        SIGKILL one rank (a crash the OS sees)
    hang@24:rank=2        SIGSTOP one rank (alive, silent: the watchdog's case)
    crash@30:rank=3       an exception in that rank's training loop
    node@36:node=1        kill every rank of a simulated node and wipe its RAM tier
    slow@40:rank=0:factor=3:seconds=6   the rank runs at 1/factor speed for a while
    enospc@20:seconds=3   the durable tier (behind faulty://) fails for a while:
                          also unavailable, latency (factor = seconds per write),
                          torn (data files cut in half), bitflip (one bit flipped)

It exits 0 only if every fault was survived with nothing lost.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .events import read_events
from .report import analyze, to_html

STORAGE_KINDS = ("enospc", "unavailable", "latency", "torn", "bitflip")
KINDS = ("kill", "hang", "crash", "node", "slow") + STORAGE_KINDS
_STORAGE_SWITCH = {"enospc": "enospc", "unavailable": "unavailable", "latency": "latency_s",
                   "torn": "torn_write", "bitflip": "bitflip"}
PROCESS_KINDS = ("kill", "hang", "crash", "node")
DEFAULT_FAULTS = "kill@12:rank=1,hang@24:rank=2,node@36:node=1,crash@48:rank=3"


@dataclass
class Fault:
    kind: str
    step: int
    rank: int | None = None
    node: int | None = None
    factor: float = 3.0
    seconds: float = 6.0
    injected_t: float | None = None
    attempt: int | None = None
    outcome: dict[str, Any] = field(default_factory=dict)

    def label(self) -> str:
        where = f"node {self.node}" if self.kind == "node" else \
            "durable tier" if self.kind in STORAGE_KINDS else f"rank {self.rank}"
        return f"{self.kind}@{self.step} ({where})"


def parse_faults(spec: str, nproc: int, ranks_per_node: int) -> list[Fault]:
    """Parse a schedule; a clear ValueError names the bad part."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        head, *opts = part.split(":")
        kind, _, step = head.partition("@")
        if kind not in KINDS or not step.isdigit():
            raise ValueError(f"bad fault {part!r}: expected KIND@STEP with KIND one of {', '.join(KINDS)}")
        f = Fault(kind, int(step))
        for o in opts:
            k, _, v = o.partition("=")
            if k not in ("rank", "node", "factor", "seconds") or not v:
                raise ValueError(f"bad option {o!r} in {part!r} (rank=, node=, factor=, seconds=)")
            setattr(f, k, float(v) if k in ("factor", "seconds") else int(v))
        if f.kind in STORAGE_KINDS:
            pass  # the durable tier, not a rank
        elif f.kind == "node":
            f.node = 0 if f.node is None else f.node
            if not 0 <= f.node < nproc // ranks_per_node:
                raise ValueError(f"{part!r}: node {f.node} does not exist ({nproc // ranks_per_node} nodes)")
        else:
            f.rank = 0 if f.rank is None else f.rank
            if not 0 <= f.rank < nproc:
                raise ValueError(f"{part!r}: rank {f.rank} does not exist ({nproc} ranks)")
        faults.append(f)
    steps = [f.step for f in faults]
    if steps != sorted(steps) or len(set(steps)) != len(steps):
        raise ValueError("faults must be at distinct, increasing steps")
    return faults


def random_faults(seed: int, steps: int, nproc: int, ranks_per_node: int, count: int = 3) -> list[Fault]:
    rng = random.Random(seed)
    at = sorted(rng.sample(range(6, steps - 4), count))
    out = []
    for s in at:
        kind = rng.choice(("kill", "hang", "crash", "node"))
        f = Fault(kind, s)
        if kind == "node":
            f.node = rng.randrange(nproc // ranks_per_node)
        else:
            f.rank = rng.randrange(nproc)
        out.append(f)
    return out


class Job:
    """The reference trainer under torchrun, and what it wrote so far."""

    def __init__(self, root: str, nproc: int, steps: int, ranks_per_node: int, restarts: int,
                 peer: bool = True):
        self.root = root
        self.events_dir = os.path.join(root, "run", "events")
        self.fault_file = os.path.join(root, "fault-request")
        env = {**os.environ, "FTKIT_RAM_DIR": os.path.join(root, "shm"), "FTKIT_JOB_ID": "drill",
               "FTKIT_RANKS_PER_NODE": str(ranks_per_node), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               f"--max-restarts={restarts}", "--monitor-interval=0.1", "-m", "ftkit.reference",
               "--ckpt", "faulty://" + os.path.join(root, "ckpt"), "--every", "10", "--ram", *(["--peer", "1"] if peer else []),
               "--steps", str(steps), "--step-time", "0.02", "--run-dir", os.path.join(root, "run"),
               "--final-out", os.path.join(root, "final.pt"), "--fault-file", self.fault_file]
        self.log = open(os.path.join(root, "torchrun.log"), "w")
        # Its own process group: cleaning up kills the workers too, not just torchrun.
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def kill(self) -> None:
        for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped worker ignores everything but these
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def events(self) -> list[dict[str, Any]]:
        return read_events(os.path.join(self.root, "run"))

    def attempt(self) -> int:
        return max((e["attempt"] for e in self.events() if e["event"] == "start"), default=0)

    def pids(self, attempt: int) -> dict[int, int]:
        return {e["rank"]: e["pid"] for e in self.events() if e["event"] == "start" and e["attempt"] == attempt}

    def wait_for(self, attempt: int, step: int, timeout: float = 300) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(e["event"] == "step" and e["attempt"] == attempt and e["step"] >= step and e["rank"] == 0
                   for e in self.events()):
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"the job ended (exit {self.proc.returncode}) before step {step}")
            time.sleep(0.1)
        raise RuntimeError(f"the job did not reach step {step} within {timeout:.0f}s")

    def note(self, **fields: Any) -> None:
        os.makedirs(self.events_dir, exist_ok=True)
        with open(os.path.join(self.events_dir, "drill.jsonl"), "a") as f:
            f.write(json.dumps({"t": time.time(), "rank": -1, "event": "fault", **fields}) + "\n")


def inject(job: Job, f: Fault, ranks_per_node: int) -> None:
    attempt = job.attempt()
    pids = job.pids(attempt)
    f.attempt, f.injected_t = attempt, time.time()
    job.note(kind=f.kind, step=f.step, target=f.rank if f.kind != "node" else f"node{f.node}", attempt=attempt)
    if f.kind == "kill":
        os.kill(pids[f.rank], signal.SIGKILL)
    elif f.kind == "hang":
        os.kill(pids[f.rank], signal.SIGSTOP)
    elif f.kind == "crash":
        with open(job.fault_file, "w") as fh:
            fh.write(f"crash {f.rank}\n")
    elif f.kind == "node":
        for r, pid in pids.items():
            if r // ranks_per_node == f.node:
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(os.path.join(job.root, "shm", "drill", f"node{f.node}"), ignore_errors=True)
    elif f.kind == "slow":
        threading.Thread(target=_throttle, args=(pids[f.rank], f.factor, f.seconds), daemon=True).start()
    elif f.kind in STORAGE_KINDS:
        threading.Thread(target=_storage_fault, args=(os.path.join(job.root, "ckpt"), f), daemon=True).start()


def _storage_fault(root: str, f: Fault) -> None:
    """Switch a fault on the durable tier for `seconds`, then off."""
    from .faults import set_faults

    set_faults(root, **{_STORAGE_SWITCH[f.kind]: f.factor if f.kind == "latency" else True})
    time.sleep(f.seconds)
    set_faults(root)


def _throttle(pid: int, factor: float, seconds: float) -> None:
    """Run `pid` at 1/factor speed: stopped for (1 - 1/factor) of every 100 ms."""
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.1 * (1 - 1 / factor))
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.1 / factor)
    except ProcessLookupError:
        pass


def run_drill(args) -> dict[str, Any]:
    ranks_per_node = args.ranks_per_node
    if args.seed is not None:
        faults = random_faults(args.seed, args.steps, args.nproc, ranks_per_node)
    else:
        faults = parse_faults(args.faults, args.nproc, ranks_per_node)
    if faults and faults[-1].step >= args.steps - 2:
        raise ValueError(f"the last fault must come before step {args.steps - 2}")
    root = args.run_dir or tempfile.mkdtemp(prefix="ftkit-drill-")
    faulted, clean = os.path.join(root, "faulted"), os.path.join(root, "fault-free")
    for d in (faulted, clean):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    say = print if not args.quiet else (lambda *a, **k: None)
    say(f"drill: {args.nproc} ranks on {args.nproc // ranks_per_node} simulated nodes, {args.steps} steps, "
        f"faults: {', '.join(f.label() for f in faults) or 'none'}")
    say(f"drill: run directory {root}")
    errors: list[str] = []
    # The fault-free run first, alone, so the faulted run's timings are not shared with it.
    ref = Job(clean, args.nproc, args.steps, ranks_per_node, restarts=0, peer=not args.no_peer)
    if ref.proc.wait(timeout=600) != 0:
        errors.append("the fault-free reference run failed")
    job = Job(faulted, args.nproc, args.steps, ranks_per_node, restarts=len(faults) + 1, peer=not args.no_peer)
    try:
        for f in faults:
            attempt = job.attempt()
            job.wait_for(attempt, f.step)
            inject(job, f, ranks_per_node)
            say(f"  injected {f.label()} in attempt {attempt}")
            if f.kind in PROCESS_KINDS:  # wait until the restarted group is training again
                end = time.monotonic() + 300
                while job.attempt() == attempt and time.monotonic() < end and job.proc.poll() is None:
                    time.sleep(0.1)
                if job.attempt() == attempt:
                    errors.append(f"{f.label()}: no restart followed")
                    break
        rc = job.proc.wait(timeout=600)
        if rc != 0:
            errors.append(f"the faulted run exited with {rc}")
    finally:
        for j in (job, ref):
            if j.proc.poll() is None:
                j.kill()
            j.log.close()
    result = _verify(faulted, clean, faults, errors, args.max_lost)
    result["run_dir"] = root
    events = read_events(os.path.join(faulted, "run"))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2, default=str)
    if args.html and events:
        with open(args.html, "w") as fh:
            fh.write(to_html(analyze(events), events, title=f"ftkit drill: {'PASS' if result['passed'] else 'FAIL'}"))
    return result


def _verify(faulted: str, clean: str, faults: list[Fault], errors: list[str], max_lost: int) -> dict[str, Any]:
    import torch

    events = read_events(os.path.join(faulted, "run"))
    report = analyze(events) if events else None
    same = False
    try:
        a = torch.load(os.path.join(faulted, "final.pt"), weights_only=True)
        b = torch.load(os.path.join(clean, "final.pt"), weights_only=True)
        same = all(torch.equal(a["model"][k], v) for k, v in b["model"].items()) and all(
            torch.equal(a["optim"]["state"][p][k], v) for p, st in b["optim"]["state"].items()
            for k, v in st.items())
        if not same:
            errors.append("final weights differ from the fault-free run")
    except (FileNotFoundError, KeyError) as e:
        errors.append(f"no final state to compare ({type(e).__name__}: {e})")
    incidents = report.incidents if report else []
    process_faults = [f for f in faults if f.kind in PROCESS_KINDS]
    for f, inc in zip(process_faults, incidents):
        f.outcome = {"detected_by": inc.detected_by, "detect_s": inc.detect_s, "restart_s": inc.restart_s,
                     "restore_s": inc.restore_s, "recompute_s": inc.recompute_s, "recovery_s": inc.total_s,
                     "resumed_from": inc.resumed_from, "reached": inc.last_step, "steps_lost": inc.steps_lost,
                     "restored_from": inc.restore_source}
        if inc.steps_lost > max_lost:
            errors.append(f"{f.label()}: {inc.steps_lost} steps lost (resumed at step {inc.resumed_from} of "
                          f"{inc.last_step}; at most {max_lost} allowed)")
    if len(incidents) < len(process_faults):
        errors.append(f"{len(process_faults)} faults but {len(incidents)} recoveries")
    stragglers = report.stragglers if report else []
    failed_persists = [e for e in events if e["event"] == "persist" and not e.get("ok", True)
                       and str(e.get("tier", "")).startswith("faulty://")]
    for f in faults:
        if f.kind == "slow":
            f.outcome = {"straggler_reported": any(s["rank"] == f.rank for s in stragglers)}
        elif f.kind in STORAGE_KINDS:
            f.outcome = {"failed_persists": len([e for e in failed_persists if e["t"] >= (f.injected_t or 0)]),
                         "training_continued": report is not None and report.final_step > f.step}
    return {"passed": not errors, "errors": errors, "bitwise_equal": same,
            "goodput": report.goodput if report else 0.0, "wall_s": report.wall_s if report else 0.0,
            "final_step": report.final_step if report else 0, "faults": [asdict(f) for f in faults]}


def print_summary(result: dict[str, Any]) -> None:
    print()
    for f in result["faults"]:
        o = f["outcome"]
        label = f"{f['kind']}@{f['step']} " + (f"node {f['node']}" if f["kind"] == "node" else f"rank {f['rank']}")
        if f["kind"] == "slow":
            print(f"  {label:<22} straggler reported: {o.get('straggler_reported')}")
        elif f["kind"] in STORAGE_KINDS:
            print(f"  {f['kind']}@{f['step']} durable tier: {o.get('failed_persists')} persist(s) failed, "
                  f"training went on: {o.get('training_continued')}")
        elif o:
            det = f"{o['detect_s']:.1f}s" if o["detect_s"] is not None else "-"
            print(f"  {label:<22} detected by {o['detected_by']} ({det}); recovered in {o['recovery_s']:.1f}s "
                  f"(restart {o['restart_s']:.1f}s, restore {o['restore_s']:.2f}s from {o['restored_from']}, "
                  f"recompute {o['recompute_s']:.1f}s); resumed at step {o['resumed_from']} of "
                  f"{o['reached']}, {o['steps_lost']} step(s) recomputed")
        else:
            print(f"  {label:<22} NOT RECOVERED")
    print(f"\n  final step {result['final_step']}, goodput {result['goodput']:.1%} over {result['wall_s']:.1f}s; "
          f"final weights {'EQUAL' if result['bitwise_equal'] else 'DIFFERENT'} to the fault-free run bit for bit")
    for e in result["errors"]:
        print(f"  problem: {e}")
    print(f"\ndrill {'PASSED' if result['passed'] else 'FAILED'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ftkit drill", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks per simulated node (default 2)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--faults", default=DEFAULT_FAULTS, help=f"schedule (default {DEFAULT_FAULTS!r})")
    p.add_argument("--seed", type=int, help="a random schedule of 3 faults from this seed (instead of --faults)")
    p.add_argument("--run-dir", help="where to keep everything (default: a new temporary directory)")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--html", help="write a page with the timeline here")
    p.add_argument("--max-lost", type=int, default=3, help="steps a fault may cost (default 3)")
    p.add_argument("--no-peer", action="store_true", help="run without peer replicas (to see what they save)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.nproc < 2 or args.nproc % args.ranks_per_node:
        p.error("--nproc must be at least 2 and a multiple of --ranks-per-node")
    try:
        result = run_drill(args)
    except (ValueError, RuntimeError) as e:
        print(f"ftkit: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1
    if not args.quiet:
        print_summary(result)
    return 0 if result["passed"] else 1

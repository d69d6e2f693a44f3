"""`ftkit drill --hosts N`: the drill over emulated hosts, one torchrun agent per host.

Order of a host drill (run_host_drill):
  1. check that hosts can be emulated here (root, namespaces: hosts.hosts_unavailable) and,
     for the default rendezvous, that etcd is installed; parse the schedule;
  2. the faulted run: a Cluster (cluster.py) of N hosts and K spares running the reference
     trainer (RAM tier with replicas, a durable tier every few steps, all hosts' view of it
     shared); each fault is injected at its fault point on a rank of the target host, and
     the drill waits for the agents' next round before the next fault;
  3. the fault-free reference with the same world-size history: the faulted run's events
     say which world size trained from which restored step; the reference trainer runs
     those segments one after another on one host (torchrun, no faults), each resuming
     from the previous one's checkpoint;
  4. verify as the single-host drill does (run.py): faults matched to detections and
     recoveries, steps lost, the final state bit for bit, the consumed sample stream.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any

from ftkit.coord.events import read_events
from ftkit.drill.cluster import Cluster
from ftkit.drill.etcd import etcd_unavailable
from ftkit.drill.hosts import hosts_unavailable
from ftkit.drill.job import Injector, Job, RunLog, _signal
from ftkit.drill.run import DEFAULT_TIERS, TierPlan, _check_schedule, _entry, _finish
from ftkit.drill.schedule import HOST_KINDS, Fault, parse_faults
from ftkit.drill.verify import check_faults, compare_states, compare_streams, consumed_stream
from ftkit.errors import UsageError
from ftkit.runtime.warm.client import REPLACE_ENV
from ftkit.runtime.warm.zygote import Zygote
from ftkit.runtime.warm.zygote import start as start_zygote
from ftkit.tools.report import analyze, epoch

DEFAULT_HOST_FAULTS = "host@20:host=rank0,partition@45:host=2:for=15"


def unavailable(rdzv: str) -> str | None:
    """Why a host drill cannot run here (one line), or None."""
    return hosts_unavailable() or (etcd_unavailable() if rdzv == "etcd" else None)


class HostJob(RunLog):
    """The faulted run as the Injector sees a job (its event log, fault points and notes; job.py),
    over a Cluster: process and storage faults work across hosts as they do on one."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.run_dir = cluster.run_dir
        self.fault_request = cluster.fault_request
        self.ranks_per_node = cluster.ranks_per_host
        self.proc = _AllAgents(cluster)


class _AllAgents:
    """The cluster's agents as one process for RunLog.freeze_at: ended once all have, with the
    first nonzero exit code (or 0)."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    def poll(self) -> int | None:
        codes = [p.poll() for p in self.cluster.agents.values()]
        if any(c is None for c in codes):
            return None
        return next((c for c in codes if c), 0)

    @property
    def returncode(self) -> int | None:
        return self.poll()


class HostInjector(Injector):
    """The single-host Injector, plus the faults of hosts: a host lost, partitioned, its agent killed."""

    def __init__(self, job: HostJob, durable_root: str | None = None):
        super().__init__(job, durable_root)  # type: ignore[arg-type]
        self.cluster = job.cluster
        self.failures: list[str] = []
        self.hosts: dict[int, str] = {}  # id(fault) -> the host it struck

    def target_host(self, f: Fault, attempt: tuple[int, int]) -> str:
        if f.host in ("rank0", "rendezvous"):
            if f.host == "rendezvous" and self.cluster.rdzv == "c10d":
                return self.cluster.training[0]
            return self.cluster.rank_hosts(attempt)[0]
        return self.cluster.names[int(f.host or 1) - 1]

    def inject(self, f: Fault) -> None:
        if f.kind not in HOST_KINDS:
            super().inject(f)
            return
        job, cluster = self.job, self.cluster
        attempt = job.attempt()
        name = self.target_host(f, attempt)
        ranks = sorted(r for r, h in cluster.rank_hosts(attempt).items() if h == name)
        if not ranks:
            raise RuntimeError(f"{f.label()}: {name} holds no rank of attempt {attempt[0]}")
        rank = 0 if f.during == "commit" else ranks[0]
        rec = job.freeze_at(f.during, f.step, rank)
        # The attempt the frozen rank belongs to (a host coming back may have started a new one
        # between the look above and the freeze): the fault is that attempt's.
        attempt = max(
            (epoch(e) for e in job.events() if e["event"] == "start" and e.get("pid") == rec.get("pid")),
            default=attempt,
        )
        (f.attempt, f.gen), f.injected_t, f.injected_step = attempt, time.time(), rec.get("at_step")
        f.outcome = {"host": name}
        self.hosts[id(f)] = name
        job.note(
            kind=f.kind,
            step=f.injected_step,
            during=f.during,
            attempt=attempt[0],
            **({"gen": attempt[1]} if attempt[1] else {}),
            target=name,
            restarts=True,
        )
        if f.kind == "host":
            cluster.lose(name)
            if f.back_s is not None:
                self._background(self._host_back, name, f.back_s)
        elif f.kind == "partition":
            cluster.partition(name, f.back_s)
            _signal(rec["pid"], signal.SIGCONT)  # alive on its side of the cut
        elif f.kind == "agent":
            cluster.kill_agent(name)  # its workers end with it (the frozen one too: SIGKILL)
            if f.back_s is not None:
                self._background(self._agent_back, name, f.back_s)

    def _host_back(self, name: str, seconds: float) -> None:
        """A new machine of the same name and address (empty RAM) takes the lost one's place."""
        time.sleep(seconds)
        self._later(f"bringing {name} back", lambda: self.cluster.bring_back(name))

    def _agent_back(self, name: str, seconds: float) -> None:
        time.sleep(seconds)
        self._later(f"restarting {name}'s agent", lambda: self.cluster.start_agent(name))

    def _later(self, what: str, fn) -> None:
        """A background step of a fault; its failure is the drill's, not lost with its thread."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (reported at the end of the drill)
            self.failures.append(f"{what}: {e}")


def fencing_violations(events: list[dict[str, Any]]) -> list[str]:
    """Commits by a generation that another had already replaced: a step committed by attempt A
    after a newer attempt started (two groups at once: the split brain a partition could cause).
    A group that lost its place commits nothing."""
    starts: dict[tuple[int, int], float] = {}
    for e in events:
        if e["event"] == "start":
            a = epoch(e)
            starts[a] = min(starts.get(a, e["t"]), e["t"])
    out = []
    for e in events:
        if e["event"] == "persist" and e.get("ok") and e.get("committed_by_me"):
            a = epoch(e)
            newer = [(b, t) for b, t in starts.items() if b > a and t < e["t"]]
            if newer:
                b, t = min(newer, key=lambda x: x[1])
                out.append(
                    f"step {e['step']} was committed to {e.get('tier')} by attempt {a[0]} {e['t'] - t:.2f}s "
                    f"after attempt {b[0]} had started (two groups at once)"
                )
    return out


def world_history(events: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(world size, step it trained from) of each stretch of the run, in order: the world size
    of an attempt trains from the step that attempt restored. Stretches of one world size are
    merged (a restore of the same world continues the same computation)."""
    starts: dict[tuple[int, int], int] = {}
    for e in events:
        if e["event"] == "start":
            starts.setdefault(epoch(e), e["world_size"])
    restored = {a: 0 for a in starts}
    for e in events:
        if e["event"] == "restore" and epoch(e) in restored:
            restored[epoch(e)] = max(restored[epoch(e)], e.get("step") or 0)
    history: list[tuple[int, int]] = []
    for a in sorted(starts):
        world, frm = starts[a], restored[a]
        # A stretch that a later one restarted from before it began never counts (its steps were lost).
        while len(history) > 1 and history[-1][1] >= frm:
            history.pop()
        if history and history[-1][0] == world:
            continue
        history.append((world, frm))
    return history


def reference_run(
    args, tiers: TierPlan, root: str, history: list[tuple[int, int]], zygote: Zygote | None, say
) -> tuple[str | None, list | None, str | None]:
    """The fault-free run with `history`'s world sizes: each stretch a torchrun of its world
    size on one host, resuming from the previous stretch's checkpoint. Returns (final state,
    consumed stream, error)."""
    clean = os.path.join(root, "fault-free")
    shutil.rmtree(clean, ignore_errors=True)
    os.makedirs(clean)
    ckpt = os.path.join(clean, "ckpt")
    final = os.path.join(clean, "final.pt")
    plain = TierPlan(False, 0, "disk", tiers.spec)
    stream: list = []
    bounds = [frm for _, frm in history[1:]] + [args.steps]
    say(f"drill: fault-free reference, world sizes {' -> '.join(f'{w} (from step {s})' for w, s in history)}")
    for n, ((world, frm), until) in enumerate(zip(history, bounds)):
        seg = os.path.join(clean, f"stretch-{n}")
        os.makedirs(seg)
        seg_args = _Args(args, steps=until, every=1)
        job = Job(seg, _entry(seg_args, plain, ckpt, final, 0.0), world, world, restarts=0, zygote=zygote)
        try:
            rc: int | str = job.proc.wait(timeout=300 + until)
        except subprocess.TimeoutExpired:
            rc = "a timeout"
        finally:
            job.kill()
        if rc != 0:
            return None, None, f"the fault-free reference run failed (exit {rc}; see {job.log.name})"
        stream += [s for s in consumed_stream(read_events(job.run_dir)) if frm < s[0] <= until]
    return final, sorted(stream), None


class _Args:
    """`args` with some fields replaced (the reference's stretches)."""

    def __init__(self, args: Any, **changes: Any):
        self.__dict__.update(vars(args))
        self.__dict__.update(changes)


def run_host_drill(args) -> dict[str, Any]:
    reason = unavailable(args.rdzv)
    if reason:
        raise UsageError(f"cannot emulate hosts here: {reason}")
    hosts, spares, rph = args.hosts, args.spare_hosts, args.ranks_per_host
    nproc = hosts * rph
    tiers = TierPlan.parse(args.tiers or DEFAULT_TIERS)
    faults = parse_faults(args.faults, nproc, rph, hosts=hosts)
    _check_schedule(faults, tiers, args.steps)
    if tiers.durable == "s3":
        raise ValueError("--hosts: the durable tier is a directory every host sees (disk) or a URL")
    root = os.path.abspath(args.run_dir or tempfile.mkdtemp(prefix="ftkit-drill-"))
    faulted = os.path.join(root, "faulted")
    shutil.rmtree(faulted, ignore_errors=True)
    os.makedirs(faulted)
    say = (lambda *a, **k: None) if args.quiet else print
    say(
        f"drill: the reference trainer (tiers {tiers.spec}) on {hosts} emulated hosts of {rph} ranks"
        f"{f' and {spares} spare(s)' if spares else ''}, {args.rdzv} rendezvous, {args.steps} steps"
    )
    say(f"drill: faults: {', '.join(f.label() for f in faults) or 'none'}")
    say(f"drill: run directory {root}")
    errors: list[str] = []
    final_pt = os.path.join(faulted, "final.pt")
    url, durable_root = tiers.durable_url(faulted, None)
    entry = _entry(args, tiers, url, final_pt, args.step_time)
    env = {REPLACE_ENV: "0"}  # a host's workers are not replaced one by one: its agent restarts them
    events: list[dict[str, Any]] = []
    injected_hosts: dict[int, str] = {}  # id(fault) -> the host it struck
    try:
        with Cluster(
            faulted, entry, hosts=hosts, spares=spares, ranks_per_host=rph, rdzv=args.rdzv, env=env, warm=not args.cold
        ) as cluster:
            job = HostJob(cluster)
            injector = HostInjector(job, durable_root)
            injected_hosts = injector.hosts
            try:
                for f in faults:
                    attempt = job.attempt()
                    injector.inject(f)
                    say(f"  injected {f.label()} at step {f.injected_step} ({f.outcome.get('host', '')})")
                    if f.restarts and not cluster.wait_started(after=attempt, timeout=240):
                        errors.append(f"{f.label()}: no restart followed")
                        break
                limit = 300 + args.steps * (args.step_time + 0.5) + 60 * len(faults)
                if not _wait_final(cluster, final_pt, limit):
                    errors.append(f"the faulted run did not finish within {limit:.0f}s (see {faulted}/host*.log)")
                injector.join()
                errors += injector.failures
            except RuntimeError as e:
                errors.append(str(e))
            events = cluster.events()
    except Exception as e:  # a host that could not be made, an etcd that did not start
        errors.append(f"the emulated hosts failed: {e}")
    report = analyze(events) if events else None
    check_faults(faults, report, events, args.max_lost, errors)
    errors += fencing_violations(events)
    for f in faults:  # (check_faults rewrote the outcomes: say again which host each one struck)
        if id(f) in injected_hosts:
            f.outcome["host"] = injected_hosts[id(f)]
    history = world_history(events) if events else []
    zygote = None if args.cold else start_zygote(preload=("torch.distributed.run", "ftkit.drill.reference"))
    try:
        clean_pt, clean_stream, err = (
            reference_run(args, tiers, root, history, zygote, say) if history else (None, None, "no run")
        )
    finally:
        if zygote is not None:
            zygote.stop()
    if err:
        errors.append(err)
    result: dict[str, Any] = {
        "run_dir": root,
        "target": "ftkit.drill.reference",
        "tiers": tiers.spec,
        "hosts": hosts,
        "spare_hosts": spares,
        "rendezvous": args.rdzv,
        "world_history": history,
        "bitwise_equal": clean_pt is not None and compare_states(final_pt, clean_pt, errors),
        "same_sample_stream": clean_stream is not None
        and compare_streams(consumed_stream(events), clean_stream, errors),
    }
    return _finish(args, result, faults, report, events, errors, "ftkit drill --hosts")


def _wait_final(cluster: Cluster, final_pt: str, timeout: float) -> bool:
    """Until the run wrote its final state and every agent still in the job has ended (spares
    never admitted wait in the rendezvous for a place: they are stopped)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and not os.path.exists(final_pt):
        if all(p.poll() is not None for p in cluster.agents.values()):
            return False
        time.sleep(0.2)
    if not os.path.exists(final_pt):
        return False
    last = set(cluster.rank_hosts().values())
    while time.monotonic() < end and any(cluster.agents[h].poll() is None for h in last if h in cluster.agents):
        time.sleep(0.2)
    return True

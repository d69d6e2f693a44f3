"""`ftkit drill --hosts N`: the drill over emulated hosts, one torchrun agent per host.

As run.py's drill, but the faulted run is a Cluster (cluster.py) and host faults (lost,
partitioned, agent killed) join the process and storage ones. The fault-free reference follows
the faulted run's world sizes: each stretch a torchrun on one host, resuming from the previous
stretch's checkpoint.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from ftkit.drill.cluster import Cluster
from ftkit.drill.etcd import etcd_unavailable
from ftkit.drill.hosts import hosts_unavailable
from ftkit.drill.job import Injector, RunLog, _signal
from ftkit.drill.run import DEFAULT_TIERS, TierPlan, _begin, _check_schedule, _entry, _finish, fault_free
from ftkit.drill.schedule import HOST_KINDS, Fault, parse_faults
from ftkit.drill.verify import check_faults, compare_states, compare_streams, consumed_stream
from ftkit.errors import UsageError
from ftkit.runtime.warm.client import REPLACE_ENV
from ftkit.runtime.warm.zygote import start as start_zygote
from ftkit.tools.report import analyze, epoch

DEFAULT_HOST_FAULTS = "host@20:host=rank0,partition@45:host=2:for=15"


def unavailable(rdzv: str) -> str | None:
    """Why a host drill cannot run here (one line), or None."""
    return hosts_unavailable() or (etcd_unavailable() if rdzv == "etcd" else None)


class HostJob(RunLog):
    """A Cluster as the Injector sees a job (job.py): process and storage faults work as on one host."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.run_dir = cluster.run_dir
        self.fault_request = cluster.fault_request
        self.ranks_per_node = cluster.ranks_per_host

    def ended(self) -> int | None:
        """Once every agent has ended: the first nonzero exit code (or 0)."""
        codes = [p.poll() for p in self.cluster.agents.values()]
        return None if None in codes else next((c for c in codes if c), 0)


class HostInjector(Injector):
    """The single-host Injector, plus the faults of hosts: a host lost, partitioned, its agent killed."""

    def __init__(self, job: HostJob, durable_root: str | None = None):
        super().__init__(job, durable_root)  # type: ignore[arg-type]
        self.cluster = job.cluster

    def inject(self, f: Fault) -> None:
        if f.kind not in HOST_KINDS:
            super().inject(f)
            return
        job, cluster = self.job, self.cluster
        attempt = job.attempt()
        if f.host == "rendezvous" and cluster.rdzv == "c10d":
            name = cluster.training[0]
        elif f.host in ("rank0", "rendezvous"):  # (etcd's store moves with rank 0)
            name = cluster.rank_hosts(attempt)[0]
        else:
            name = cluster.names[int(f.host or 1) - 1]
        ranks = sorted(r for r, h in cluster.rank_hosts(attempt).items() if h == name)
        if not ranks:
            raise RuntimeError(f"{f.label()}: {name} holds no rank of attempt {attempt[0]}")
        rank = 0 if f.during == "commit" else ranks[0]
        rec = job.freeze_at(f.during, f.step, rank)
        # The frozen rank's own attempt: a host coming back may have started a new one meanwhile.
        attempt = max(
            (epoch(e) for e in job.events() if e["event"] == "start" and e.get("pid") == rec.get("pid")),
            default=attempt,
        )
        job.note_fault(f, attempt, rec, name)
        f.outcome = {"host": name}
        if f.kind == "host":
            cluster.lose(name)
            if f.back_s is not None:  # a new machine of that name and address (empty RAM) comes back
                self._background(self._later, f.back_s, f"bringing {name} back", lambda: cluster.bring_back(name))
        elif f.kind == "partition":
            cluster.host(name).partition(f.back_s)
            _signal(rec["pid"], signal.SIGCONT)  # alive on its side of the cut
        elif f.kind == "agent":
            cluster.kill_agent(name)  # its workers end with it (the frozen one too: SIGKILL)
            if f.back_s is not None:
                self._background(self._later, f.back_s, f"restarting {name}'s agent", lambda: cluster.start_agent(name))


def fencing_violations(events: list[dict[str, Any]]) -> list[str]:
    """Steps committed by an attempt after a newer one had started: two groups at once, the split
    brain a partition could cause."""
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
    """(world size, step it trained from) of each stretch of the run, in order; stretches of one
    world size are merged (a restore of the same world continues the same computation)."""
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


def run_host_drill(args) -> dict[str, Any]:
    reason = unavailable(args.rdzv)
    if reason:
        raise UsageError(f"cannot emulate hosts here: {reason}")
    hosts, spares, rph = args.hosts, args.spare_hosts, args.ranks_per_host
    tiers = TierPlan.parse(args.tiers or DEFAULT_TIERS)
    faults = parse_faults(args.faults, hosts * rph, rph, hosts=hosts)
    _check_schedule(faults, tiers, args.steps, args.every)
    if tiers.durable == "s3":
        raise ValueError("--hosts: the durable tier is a directory every host sees (disk) or a URL")
    headline = (
        f"drill: the reference trainer (tiers {tiers.spec}) on {hosts} emulated hosts of {rph} ranks"
        f"{f' and {spares} spare(s)' if spares else ''}, {args.rdzv} rendezvous, {args.steps} steps"
    )
    root, faulted, say = _begin(args, headline, faults)
    errors: list[str] = []
    final_pt = os.path.join(faulted, "final.pt")
    url, durable_root = tiers.durable_url(faulted, None)
    entry = _entry(args, tiers, url, final_pt, args.step_time)
    env = {REPLACE_ENV: "0"}  # a host's workers are not replaced one by one: its agent restarts them
    events: list[dict[str, Any]] = []
    try:
        with Cluster(
            faulted, entry, hosts=hosts, spares=spares, ranks_per_host=rph, rdzv=args.rdzv, env=env, warm=not args.cold
        ) as cluster:
            job = HostJob(cluster)
            injector = HostInjector(job, durable_root)
            try:
                for f in faults:
                    attempt = job.attempt()
                    injector.inject(f)
                    say(f"  injected {f.label()} at step {f.injected_step} ({f.outcome.get('host', '')})")
                    if f.restarts and not cluster.wait_started(after=attempt, timeout=240, restarting=injector.busy):
                        errors.append(f"{f.label()}: no restart followed")
                        break
                limit = 300 + args.steps * (args.step_time + 0.5) + 60 * len(faults)
                if problem := _wait_final(cluster, final_pt, limit):
                    errors.append(f"{problem} (see {faulted}/host*.log)")
                injector.join()
                errors += injector.failures
            except RuntimeError as e:
                errors.append(str(e))
            events = cluster.events()
    except Exception as e:  # a host that could not be made, an etcd that did not start
        errors.append(f"the emulated hosts failed: {e}")
    report = analyze(events) if events else None
    struck = [f.outcome.get("host") for f in faults]  # (check_faults rewrites the outcomes)
    check_faults(faults, report, events, args.max_lost, errors)
    errors += fencing_violations(events)
    for f, host in zip(faults, struck):
        if host:
            f.outcome["host"] = host
    history = world_history(events) if events else []
    clean_pt, clean_stream, err = None, None, "no run"
    if history:
        say(f"drill: fault-free reference, world sizes {' -> '.join(f'{w} (from step {s})' for w, s in history)}")
        zygote = None if args.cold else start_zygote(preload=("torch.distributed.run", "ftkit.drill.reference"))
        try:  # each stretch on one host, persisting every step: the next one resumes from its end
            clean_pt, clean_stream, err = fault_free(args, root, zygote, [(w, w, frm) for w, frm in history], 1)
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
        # None: not compared (the fault-free run failed)
        "bitwise_equal": None if clean_pt is None else compare_states(final_pt, clean_pt, errors),
        "same_sample_stream": None
        if clean_stream is None
        else compare_streams(consumed_stream(events), clean_stream, errors),
    }
    return _finish(args, result, faults, report, events, errors, "ftkit drill --hosts")


def _wait_final(cluster: Cluster, final_pt: str, timeout: float) -> str | None:
    """Until the run wrote its final state and every agent still in the job has ended (spares never
    admitted may still wait in the rendezvous): None, else why not."""
    end = time.monotonic() + timeout
    while True:
        ended = all(p.poll() is not None for p in cluster.agents.values())  # (before looking for the file)
        if os.path.exists(final_pt):
            break
        if ended:
            return "every agent ended before the faulted run wrote its final state"
        if time.monotonic() > end:
            return f"the faulted run did not finish within {timeout:.0f}s"
        time.sleep(0.2)
    last = set(cluster.rank_hosts().values())
    while time.monotonic() < end and any(cluster.agents[h].poll() is None for h in last if h in cluster.agents):
        time.sleep(0.2)
    return None

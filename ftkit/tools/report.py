"""Goodput and incidents from a run's event log, as text, JSON or an HTML timeline.

    ftkit report RUN_DIR [--json] [--html FILE]

An incident is one restart of the worker group: torchrun attempt n -> n+1, or an
in-process recovery, generation g -> g+1 of the same attempt. Its phases:

    detect     fault (a drill's "fault" event, else the last step before it) -> the first
               sign: a watchdog "detect", or a "preempt" (a notice, or torchrun's SIGTERM)
    restart    -> the first "start" of the new attempt
    restore    -> the last rank's "restore" event
    recompute  -> the new attempt reaches the step the old one had reached

``phases`` splits the time from the first sign to the resumed step by the boot milestones
in the new attempt's ``start`` events (PHASES; docs/drills.md): each boundary is when the
last rank passed it, and a phase whose milestone some rank lacks counts in the next one.
Goodput is the wall time not spent in incidents, over the wall time.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from typing import Any


def epoch(e: dict[str, Any]) -> tuple[int, int]:
    """(torchrun attempt, in-process generation) of an event: they order the job's lifetimes."""
    return e.get("attempt", 0), e.get("gen", 0)


def launches(events: list[dict[str, Any]]) -> list[int]:
    """Which launch of the job each event (in time order) belongs to: 0, then one more each time
    a rank starts again in an (attempt, generation) it already started in. A run directory used by
    several launches (a requeued SLURM job, `ftkit run` started again) holds each one's attempt 0."""
    out: list[int] = []
    launch, started = 0, set[tuple[int, int, int]]()
    for e in events:
        if e["event"] == "start":
            key = (e["rank"], *epoch(e))
            if key in started:
                launch, started = launch + 1, set()
            started.add(key)
        out.append(launch)
    return out


@dataclass
class Incident:
    attempt: int  # the attempt that failed
    fault_t: float
    cause: str
    detected_by: str | None
    detect_s: float | None
    restart_s: float
    restore_s: float
    recompute_s: float
    total_s: float
    last_step: int
    resumed_from: int
    steps_lost: int
    restore_source: str | None
    phases: dict[str, float] = field(default_factory=dict)  # the breakdown above, seconds
    gen: int = 0  # the generation of `attempt` that failed
    in_process: bool = False  # recovered without a torchrun restart (same attempt, next generation)
    launch: int = 0  # the launch of the job that failed (launches(): a run directory used again)


@dataclass
class Report:
    wall_s: float
    productive_s: float
    goodput: float
    final_step: int
    attempts: int
    incidents: list[Incident] = field(default_factory=list)
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    snapshots: int = 0
    mean_stall_s: float = 0.0
    persist_failures: int = 0
    skipped_lines: int = 0  # unreadable lines of the event log, left out (coord/events.py read_event_log)


def _a_survivors_own(detect: dict[str, Any], faults: list[dict[str, Any]]) -> bool:
    """A "failed" verdict about another rank than the drilled fault's target: a survivor's loop
    raised because of the fault, not the fault itself."""
    target = faults[0].get("target") if faults else None
    theirs = detect.get("target")
    return detect.get("what") == "failed" and isinstance(target, int) and isinstance(theirs, int) and theirs != target


def analyze(events: list[dict[str, Any]]) -> Report:
    if not events:
        raise ValueError("no events")
    t0, t1 = events[0]["t"], events[-1]["t"]
    # (launch, torchrun attempt, generation) of each event: the job's lifetimes in order
    lifetime = {id(e): (launch, *epoch(e)) for e, launch in zip(events, launches(events))}
    by_attempt: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    for e in events:
        by_attempt.setdefault(lifetime[id(e)], []).append(e)
    attempts = sorted(by_attempt)
    incidents = []
    for prev, nxt in zip(attempts, attempts[1:]):
        old, new = by_attempt[prev], by_attempt[nxt]
        steps_old = [e for e in old if e["event"] == "step"]
        last_step = max((e["step"] for e in steps_old), default=0)
        faults = [e for e in events if e["event"] == "fault" and lifetime[id(e)] == prev and e.get("restarts", True)]
        relaunched = nxt[0] != prev[0]  # the job was started again (no torchrun restart)
        fault_t = min((e["t"] for e in faults), default=max((e["t"] for e in steps_old), default=old[0]["t"]))
        cause = faults[0].get("kind", "fault") if faults else "worker failure"
        detects = [e for e in old if e["event"] == "detect" and e["t"] >= fault_t - 1]
        preempts = [e for e in old if e["event"] == "preempt" and e["t"] >= fault_t - 1]
        flushed = any(e["event"] == "preempt_flush" and e.get("ok") for e in old)
        if preempts and (cause == "term" or (not faults and flushed)):
            # A preemption notice: the ranks saved an agreed step and stopped on purpose.
            detected_by, detects = f"preemption ({preempts[0].get('signal', 'signal')})", preempts
        elif preempts and (not detects or preempts[0]["t"] < detects[0]["t"]):
            # torchrun saw a worker exit first and sent SIGTERM to the rest of the group.
            detected_by, detects = "torchrun agent (process exit)", preempts
        elif detects and _a_survivors_own(detects[0], faults):
            # A rank whose collective with the lost one raised said so first (in process, replaced).
            detected_by = f"a collective with the lost rank (rank {detects[0]['target']} raised)"
        elif detects:
            detected_by = f"ftkit watchdog ({detects[0]['what']})"
        elif relaunched:
            detected_by = "a new launch of the job"
        elif nxt[1] == prev[1]:  # in process, before any verdict: a collective with the dead rank failed
            detected_by = "a collective with the lost rank (its connections closed)"
        else:
            detected_by = "torchrun agent (process exit)"
        if relaunched and not faults:
            cause = "preemption" if detected_by.startswith("preemption") else "the job ended"
        detect_t = min((e["t"] for e in detects), default=None)
        start_t = min((e["t"] for e in new if e["event"] == "start"), default=new[0]["t"])
        restores = [e for e in new if e["event"] == "restore"]
        restore_t = max((e["t"] for e in restores), default=start_t)
        resumed = max((e.get("step") or 0 for e in restores), default=0)
        redone = [e["t"] for e in new if e["event"] == "step" and e["step"] >= last_step]
        recompute_end = min(redone, default=restore_t)
        base = detect_t if detect_t is not None else fault_t
        phases = _phases(base, new, restore_t, max(recompute_end, restore_t))
        incidents.append(
            Incident(
                attempt=prev[1],
                gen=prev[2],
                launch=prev[0],
                in_process=nxt[:2] == prev[:2],
                fault_t=fault_t,
                cause=cause,
                detected_by=detected_by,
                detect_s=(detect_t - fault_t) if detect_t is not None else None,
                restart_s=max(0.0, start_t - base),
                restore_s=max(0.0, restore_t - start_t),
                recompute_s=max(0.0, recompute_end - restore_t),
                total_s=max(0.0, recompute_end - fault_t),
                last_step=last_step,
                resumed_from=resumed,
                steps_lost=max(0, last_step - resumed),
                restore_source=", ".join(sorted({str(e.get("source")) for e in restores})) if restores else None,
                phases=phases,
            )
        )
    wall = max(t1 - t0, 1e-9)
    lost = sum(i.total_s for i in incidents)
    snaps = [e for e in events if e["event"] == "snapshot"]
    stragglers, seen = [], set()
    for e in events:
        if e["event"] == "straggler" and e["target"] not in seen:
            seen.add(e["target"])
            stragglers.append({"rank": e["target"], "factor": round(e["factor"], 2), "t": e["t"] - t0})
    return Report(
        wall_s=wall,
        productive_s=max(0.0, wall - lost),
        goodput=max(0.0, wall - lost) / wall,
        final_step=max((e["step"] for e in events if e["event"] == "step"), default=0),
        attempts=len(attempts),
        incidents=incidents,
        stragglers=stragglers,
        snapshots=len(snaps),
        mean_stall_s=sum(e["stall_s"] for e in snaps) / len(snaps) if snaps else 0.0,
        persist_failures=sum(1 for e in events if e["event"] == "persist" and not e.get("ok", True)),
    )


# The events marked on the timeline, and their colours.
MARKS = dict(
    detect="#c0392b", abort="#7f0000", restore="#2c3e50", straggler="#f1c40f", fault="#ff0000", preempt="#8e44ad"
)

# The boot milestone (or event) that ends each phase, in order.
PHASES = (
    ("teardown", "process"),  # torchrun stops the group, its agents meet, new processes begin
    ("process start", "forked"),  # a warm worker's client starts and the zygote forks it
    ("imports", "launch"),  # ftkit's launcher runs the script (a cold worker imports torch)
    ("set-up", "rendezvous"),  # the script's own set-up, up to init_process_group
    ("rendezvous", "store"),
    ("unwind", "failed"),  # in process: the failure reached every rank's recovery wrapper
    ("group teardown", "torn_down"),  # every rank destroyed the failed generation's group
    ("regroup", "regrouped"),  # every rank arrived and the new group is built
    ("group and model", "start"),  # the Checkpointer starts
    ("restore", "restore"),
    ("first step", "resumed"),  # the step the old attempt had reached
)


def _phases(base: float, new: list[dict[str, Any]], restore_t: float, resumed_t: float) -> dict[str, float]:
    """Seconds per phase of one restart, from its new attempt's start events (empty without them)."""
    starts = [e for e in new if e["event"] == "start"]
    if not starts:
        return {}
    boots = [e.get("boot") or {} for e in starts]
    ends: dict[str, float] = {"start": max(e["t"] for e in starts), "restore": restore_t, "resumed": resumed_t}
    for milestone in [m for _, m in PHASES if m not in ends]:  # the boot milestones
        stamps = [float(t) for b in boots if isinstance(t := b.get(milestone), int | float)]
        if len(stamps) == len(boots):  # every rank saw it
            ends[milestone] = max(stamps)
    out, at = {}, base
    for name, milestone in PHASES:
        if milestone in ends:
            end = max(at, ends[milestone])
            out[name] = end - at
            at = end
    return out


def phases_text(phases: dict[str, float]) -> str:
    return ", ".join(f"{name} {s:.2f}" for name, s in phases.items())


def to_text(report: Report) -> str:
    lines = [
        f"goodput {report.goodput:.1%}: {report.productive_s:.1f}s productive of {report.wall_s:.1f}s wall; "
        f"final step {report.final_step}; {report.attempts} attempt(s)",
        f"snapshots {report.snapshots}, mean stall {report.mean_stall_s * 1e3:.1f} ms, "
        f"failed persists {report.persist_failures}",
    ]
    for n, i in enumerate(report.incidents, 1):
        det = f"detect {i.detect_s:.1f}s, " if i.detect_s is not None else ""
        where = (
            (f"launch {i.launch} " if i.launch else "")
            + f"attempt {i.attempt}"
            + (f" generation {i.gen}" if i.gen else "")
        )
        how = "recovered in process" if i.in_process else "restarted"
        lines.append(
            f"incident {n}: {i.cause} in {where}, detected by {i.detected_by}, {how}: "
            f"{det}restart {i.restart_s:.1f}s, restore {i.restore_s:.1f}s from {i.restore_source}, "
            f"recompute {i.recompute_s:.1f}s; total {i.total_s:.1f}s; resumed from step "
            f"{i.resumed_from} of {i.last_step} ({i.steps_lost} step(s) lost)"
        )
        if i.phases:
            lines.append(f"  from {'detection' if i.detect_s is not None else 'the fault'}: {phases_text(i.phases)} s")
    for s in report.stragglers:
        lines.append(f"straggler: rank {s['rank']} at {s['t']:.1f}s, {s['factor']}x the median busy time")
    if report.skipped_lines:
        lines.append(f"skipped {report.skipped_lines} unreadable event line(s) (torn, or a field missing or mistyped)")
    return "\n".join(lines)


def to_html(report: Report, events: list[dict[str, Any]], title: str = "ftkit run") -> str:
    """A self-contained page: summary, incident table, and an SVG timeline (ranks x time)."""
    t0 = events[0]["t"]
    ranks = sorted({e["rank"] for e in events})
    width, row, left = 1000, 26, 70
    scale = (width - left - 10) / max(report.wall_s, 1e-9)
    x = lambda t: left + (t - t0) * scale  # noqa: E731
    colors = ["#4c9f70", "#3b7dd8", "#9b59b6", "#e67e22", "#16a085"]
    parts = []
    launch = {id(e): n for e, n in zip(events, launches(events))}
    for i, r in enumerate(ranks):
        y = 20 + i * row
        parts.append(f'<text x="4" y="{y + 14}" font-size="12">{"drill" if r < 0 else f"rank {r}"}</text>')
        steps = [e for e in events if e["rank"] == r and e["event"] == "step"]
        for a, b in zip(steps, steps[1:]):
            if (launch[id(a)], a.get("attempt")) == (launch[id(b)], b.get("attempt")):
                c = colors[(launch[id(a)] + a.get("attempt", 0)) % len(colors)]
                parts.append(
                    f'<rect x="{x(a["t"]):.1f}" y="{y}" width="{max(0.5, (b["t"] - a["t"]) * scale):.1f}" '
                    f'height="{row - 8}" fill="{c}"><title>step {b["step"]}</title></rect>'
                )
        for e in (e for e in events if e["rank"] == r and e["event"] in MARKS):
            tip = html.escape(json.dumps({k: v for k, v in e.items() if k != "t"})[:300])
            parts.append(
                f'<rect x="{x(e["t"]) - 2:.1f}" y="{y - 3}" width="4" height="{row - 2}" '
                f'fill="{MARKS[e["event"]]}"><title>{e["event"]}: {tip}</title></rect>'
            )
    for inc in report.incidents:
        parts.append(
            f'<rect x="{x(inc.fault_t):.1f}" y="10" width="{max(1, inc.total_s * scale):.1f}" '
            f'height="{len(ranks) * row + 14}" fill="#c0392b" opacity="0.12"/>'
        )
    height = 40 + len(ranks) * row
    for k in range(0, int(report.wall_s) + 1, max(1, int(report.wall_s / 10) or 1)):
        parts.append(f'<text x="{left + k * scale:.1f}" y="{height - 4}" font-size="10">{k}s</text>')
    svg = f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">{"".join(parts)}</svg>'
    rows = "".join(
        f"<tr><td>{n}</td><td>{html.escape(i.cause)}</td><td>{html.escape(i.detected_by or '')}</td>"
        f"<td>{'' if i.detect_s is None else f'{i.detect_s:.1f}'}</td><td>{i.restart_s:.1f}</td>"
        f"<td>{i.restore_s:.1f}</td><td>{i.recompute_s:.1f}</td><td>{i.total_s:.1f}</td>"
        f"<td>{i.resumed_from} / {i.last_step}</td><td>{html.escape(str(i.restore_source))}</td></tr>"
        for n, i in enumerate(report.incidents, 1)
    )
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:24px}} td,th{{padding:3px 10px;text-align:left}}
th{{background:#eee}} .big{{font-size:28px}}</style></head><body>
<h1>{html.escape(title)}</h1>
<p class="big">goodput {report.goodput:.1%}</p>
<p>{report.productive_s:.1f}s productive of {report.wall_s:.1f}s wall, final step {report.final_step},
{report.attempts} attempt(s), {report.snapshots} snapshots (mean stall {report.mean_stall_s * 1e3:.1f} ms),
{report.persist_failures} failed persist(s).</p>
<h2>Timeline</h2><p>Bars are training steps per rank (colour = attempt); red marks are faults and
detections, purple marks preemption notices, dark marks restores, yellow marks stragglers; shaded spans
are incidents (fault to the step it had reached, recomputed).</p>{svg}
<h2>Incidents</h2><table><tr><th>#</th><th>cause</th><th>detected by</th><th>detect s</th><th>restart s</th>
<th>restore s</th><th>recompute s</th><th>total s</th><th>resumed / reached</th><th>restored from</th></tr>
{rows}</table></body></html>"""

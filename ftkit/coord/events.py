"""The event log: one JSONL file per rank in the run directory ($FTKIT_RUN_DIR unless given;
none: no log), a line ``{"t", "rank", "attempt", "event", ...}`` per event, for `ftkit report`.

A failure to write never disturbs training (it is logged once). Text fields are redacted:
URLs and error messages carry no credentials into the file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from typing import Any

from ftkit.runtime import generation
from ftkit.tiers.redact import redact_url

log = logging.getLogger("ftkit")


class EventLog:
    def __init__(self, run_dir: str | None, rank: int):
        self.rank = rank
        try:  # torchrun's attempt: 0 for the first attempt of the worker group
            self.attempt = int(generation.torchrun_attempt() or 0)
        except ValueError:
            self.attempt = 0
        # Its Checkpointer's generation: a persist of a failed generation may log after the next began.
        self.gen = generation.current()
        # Reentrant: a signal handler (coord/preemption.py) can emit on the thread already inside emit.
        self._lock = threading.RLock()
        self._file = None
        self._failed = False
        if run_dir:
            path = os.path.join(run_dir, "events")
            self.path = os.path.join(path, f"rank-{rank:05d}.jsonl")
            try:
                os.makedirs(path, exist_ok=True)
                self._file = open(self.path, "a", buffering=1)
            except OSError as e:  # (a log that cannot be written never stops training)
                log.error("ftkit: cannot write the event log in %s (%s); events are not recorded", path, e)

    def emit(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        line = json.dumps(
            {
                "t": time.time(),
                "rank": self.rank,
                "attempt": self.attempt,
                **({"gen": self.gen} if self.gen else {}),  # an in-process recovery's, omitted while 0
                "event": event,
                **_redacted(fields),
            },
            default=lambda v: redact_url(str(v)),
        )
        with self._lock:
            try:
                self._file.write(line + "\n")
            except (OSError, ValueError) as e:
                if not self._failed:
                    self._failed = True
                    log.error("ftkit: cannot write the event log (%s); events are no longer recorded", e)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _redacted(value: Any) -> Any:
    """`value` with every string in it (keys too) passed through redact_url."""
    if isinstance(value, str):
        return redact_url(value) if "://" in value else value
    if isinstance(value, dict):
        return {_redacted(k): _redacted(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redacted(v) for v in value]
    return value


def read_events(run_dir: str) -> list[dict[str, Any]]:
    """Every event of a run, in time order; unreadable lines are skipped."""
    return read_event_log(run_dir)[0]


def read_event_log(run_dir: str) -> tuple[list[dict[str, Any]], int]:
    """(every event of a run in time order, the number of unreadable lines skipped): torn by a
    kill, not an object, or a field `ftkit report` reads missing or of the wrong type."""
    out, skipped = [], 0
    d = os.path.join(run_dir, "events")
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        path = os.path.join(d, name)
        if not name.endswith(".jsonl") or not os.path.isfile(path):
            continue
        with open(path, errors="replace") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    event = json.loads(line)
                except (ValueError, RecursionError):  # a line torn by a kill; too deep, a number too long
                    event = None
                if _well_formed(event):
                    out.append(event)
                else:
                    skipped += 1
    return sorted(out, key=lambda e: e["t"]), skipped


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# The fields an event of each kind needs, by the test of their type (see _well_formed).
_NEEDS = {
    "step": {"step": _integer},
    "straggler": {"target": _integer, "factor": _number},
    "snapshot": {"stall_s": _number},
    "detect": {"what": lambda v: isinstance(v, str), "target": lambda v: v is None or _integer(v)},
}


def _well_formed(event: Any) -> bool:
    """Whether `event` has every field `ftkit report` reads, each of its type: a time, a kind, a
    rank, whole attempt, generation and step numbers where present, and what its kind needs."""
    if not isinstance(event, dict) or not _number(event.get("t")) or not isinstance(event.get("event"), str):
        return False
    if not _integer(event.get("rank")) or not all(_integer(event.get(k, 0)) for k in ("attempt", "gen")):
        return False
    if event.get("step") is not None and not _integer(event["step"]):
        return False
    if not isinstance(event.get("boot") or {}, dict):  # (start events' milestones)
        return False
    return all(ok(event.get(k)) for k, ok in _NEEDS.get(event["event"], {}).items())

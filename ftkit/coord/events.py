"""The event log: one JSONL file per rank in the run directory ($FTKIT_RUN_DIR unless given;
none: no log), a line ``{"t", "rank", "attempt", "event", ...}`` per event, for `ftkit report`.

A failure to write never disturbs training (it is logged once). Text fields are redacted:
URLs and error messages carry no credentials into the file.
"""

from __future__ import annotations

import json
import logging
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
    out = []
    d = os.path.join(run_dir, "events")
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        path = os.path.join(d, name)
        if not name.endswith(".jsonl") or not os.path.isfile(path):
            continue
        with open(path, errors="replace") as f:
            for line in f:
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line torn by a kill
                if isinstance(event, dict) and isinstance(event.get("t"), (int, float)) and "event" in event:
                    out.append(event)
    return sorted(out, key=lambda e: e["t"])

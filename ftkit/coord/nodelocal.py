"""A node's board: the ranks of one node talk with their leader through the node's private
shared memory (under the RAM root, tiers/ram.py), never the global store::

    hb/<job>/<attempt>-<scope>/<node>/
        beats.bin         each rank's latest heartbeat, in its own slot (coord/beatslots.py)
        verdict.json      the verdict the group ends on (relayed by the leader from the store)
        preempt.json      a rank was preempted: every rank saves and stops at an agreed step
        all-done.json     every rank of every node has finished
    commit/<job>/<attempt>-<scope>/<node>/    (one per tier, commit/node.py NodeGroup)
        box-r<rank>       each rank's mailbox (coord/mailbox.py)

`<job>` names the running job, so two jobs on one host never share a board. A leader
removes its node's board when it stops (and the directories above it that this empties),
and the job's earlier attempts' when it starts.
Reads are untrusted: size-capped, no link followed, malformed is silence.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
import weakref
from collections.abc import Iterable
from typing import Any

from ftkit.coord.beatslots import BeatSlots
from ftkit.coord.mailbox import PATIENCE_S, Addresses, Link, Mailbox, box_name, frame
from ftkit.errors import FtkitError, UnsafeRamDirError
from ftkit.format.validate import parse_message
from ftkit.runtime import generation
from ftkit.tiers.localfs import open_regular
from ftkit.tiers.ram import private_subdir

MAX_BYTES = 64 * 1024  # a verdict or a preemption notice is a few hundred bytes
MAX_INBOX = 4096  # messages kept for later takers (a node's ranks send a few per step)

log = logging.getLogger("ftkit")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:64] or "_"


def job_names(scope: str, instance: str) -> tuple[str, str]:
    """(job, attempt directory) for this process, from torchrun's environment, `scope` (the
    Checkpointer's store namespace) and `instance` (a nonce the ranks agreed on: a rerun at
    the same address never reads the board of the run before it)."""
    env = os.environ
    job = "|".join(env.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"))
    attempt = (generation.torchrun_attempt() or "0") + generation.suffix()
    scope_hash = hashlib.sha256(scope.encode()).hexdigest()[:12]
    return hashlib.sha256(job.encode()).hexdigest()[:16], f"{_safe(attempt)}-{scope_hash}-{_safe(instance)}"


class NodeBoard:
    """One node's board. `kind`: "hb" for the watchdog's, "commit" for the reports the
    node's ranks send their leader when committing a step to a shared tier (commit/shared.py)."""

    def __init__(self, scope: str, node: str, leader: bool, instance: str = "0", kind: str = "hb"):
        job, attempt = job_names(scope, instance)
        if leader:
            _prune_earlier_attempts(private_subdir(kind, job), attempt)
        for tries_left in (2, 1, 0):
            try:
                self.path = private_subdir(kind, job, attempt, _safe(node))
                break
            except UnsafeRamDirError:
                if not tries_left:
                    raise
                # (another node's leader on this host removed a parent as it emptied: made again)
        self._addresses = Addresses(self.path)  # of the ranks' mailboxes here (coord/mailbox.py)
        self._boxes: dict[int, Mailbox | None] = {}  # this process's mailboxes here, by rank
        # This process's connections to the ranks' mailboxes, by rank and whether its sends wait
        # for room: a send that never waits (the training thread's) never queues behind one that does.
        self._links: dict[tuple[int, bool], Link] = {}
        self._inbox: dict[str, bytes] = {}  # drained from this process's mailboxes, not taken yet, by name
        weakref.finalize(self, _close_links, self._links)

    # ------------------------------------------------------------- files
    def write(self, name: str, doc: Any) -> None:
        """`name` holds the JSON `doc`, whole: written to a temporary name, then renamed."""
        tmp = os.path.join(self.path, f".{name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps(doc, separators=(",", ":")).encode())
            os.replace(tmp, os.path.join(self.path, name))
        except BaseException:  # (a full /dev/shm): no temporary file left behind
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise

    def read(self, name: str) -> Any:
        """The JSON document `name`, or None (missing, a link, not a regular file, too big, not JSON)."""
        try:
            with open_regular(os.path.join(self.path, name), name) as f:
                data = f.read(MAX_BYTES + 1)
        except (OSError, FtkitError):
            return None
        return parse_message(data) if len(data) <= MAX_BYTES else None

    # ------------------------------------------------- a step's messages (commits)
    def send(self, name: str, data: bytes, to: Iterable[int], patience_s: float = PATIENCE_S) -> None:
        """Hand the message `name` to the node's ranks `to`, waiting for room up to `patience_s`
        (a commit's: its timeout, as long as its receiver may take to collect; 0: never wait).
        A message not handed over is lost: its receiver times out."""
        message = frame(name, data)
        for r in to:
            if not self._link(r, patience_s > 0).send(message, patience_s):
                log.info("ftkit: %s not handed to rank %d: its mailbox is gone, or took nothing", name, r)

    def send_once(self, name: str, data: bytes, to: Iterable[int], patience_s: float = PATIENCE_S) -> None:
        """`send`, but once per connection: what never changes (a layout, named by its hash)."""
        for r in to:
            link = self._link(r, patience_s > 0)
            if name not in link.once and link.send(frame(name, data), patience_s):
                link.once.add(name)

    def collect(
        self,
        names: dict[int, str],
        timeout_s: float,
        max_bytes: int,
        me: int,
        give_up: str | None = None,
        serves: int | None = None,
    ) -> dict[int, bytes | None]:
        """Wait up to `timeout_s` for the messages `names` ({rank: name}) sent to `me` and take
        them: bytes by rank, None for one that never came or is over `max_bytes`. `give_up`: a
        message whose arrival ends the wait (it stays for `has`). `serves`: the in-process
        generation waited for; under run_in_process it raises RecoveryRequested as the
        store's waits do (DistContext._wait_or_recover)."""
        box = self.mailbox(me)
        got: dict[int, bytes | None] = {}
        deadline = time.monotonic() + timeout_s
        sliced = serves is not None and generation.active()
        self._sort(box)
        while True:
            for r, name in names.items():
                if r not in got and name in self._inbox:
                    payload = self._inbox.pop(name)
                    got[r] = payload if len(payload) <= max_bytes else None
            left = deadline - time.monotonic()
            if len(got) == len(names) or left < 0 or (give_up is not None and give_up in self._inbox):
                break
            if sliced:
                generation.raise_if_requested(serves)
                left = min(left, 1.0)
            if box is None:  # (no mailbox to listen at: nothing can come)
                time.sleep(left)
                continue
            box.wait(left)
            self._sort(box)  # all that came (a burst, from the node's ranks)
        return {r: got.get(r) for r in names}

    def take(self, name: str, me: int, max_bytes: int) -> bytes | None:
        """The message `name`, if it came to `me` (a layout, sent ahead of the report naming it)."""
        self._sort(self.mailbox(me))
        payload = self._inbox.pop(name, None)
        return payload if payload is not None and len(payload) <= max_bytes else None

    def has(self, name: str, me: int) -> bool:
        """Whether the message `name` came to `me`, without taking it."""
        self._sort(self.mailbox(me))
        return name in self._inbox

    def mailbox(self, rank: int) -> Mailbox | None:
        """`rank`'s mailbox on this board (this process's rank: listening from its first use)."""
        if rank not in self._boxes:
            address = self._addresses.of(rank)
            path = os.path.join(self.path, box_name(rank))
            self._boxes[rank] = Mailbox.open(address, path) if address is not None else None
        return self._boxes[rank]

    def _link(self, rank: int, patient: bool) -> Link:
        key = (rank, patient)
        return self._links.get(key) or self._links.setdefault(key, Link(self._addresses.of(rank)))

    def _sort(self, box: Mailbox | None) -> None:
        """Move what waits in `box` to the inbox, by name."""
        for name, payload in box.drain() if box is not None else ():
            self._inbox[name] = payload
            if len(self._inbox) > MAX_INBOX:  # a flood (nothing of ftkit's sends that many): the oldest go
                self._inbox.pop(next(iter(self._inbox)))

    def prune_before(self, at: tuple[int, int]) -> None:
        """Drop the messages of steps before `at` ((restore epoch, step)) that nobody took:
        what a skipped step left."""
        for n in [n for n in self._inbox if (m := _STEP_MSG_RE.match(n)) and (int(m[1]), int(m[2])) < at]:
            del self._inbox[n]

    def beats(self, ranks: list[int]) -> BeatSlots:
        """The heartbeat slots of the node's `ranks` (all of them, ascending)."""
        return BeatSlots(self.path, ranks)

    def remove_when_all_stopped(self, ranks: list[int]) -> None:
        """Remove the board once every rank of the node has written its last ("stopped") beat."""
        beats = self.beats(ranks).read(ranks).values()
        if all(b is not None and b.stopped for b in beats):
            self.remove()

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            if not os.path.islink(self.path):
                shutil.rmtree(self.path)
        # The attempt's and the job's directories too, once empty (rmdir removes nothing else:
        # another node's board on this host, a later attempt's, stay); they would pile up.
        attempt = os.path.dirname(self.path)
        for parent in (attempt, os.path.dirname(attempt)):
            try:
                os.rmdir(parent)
            except OSError:
                break


def _close_links(links: dict[tuple[int, bool], Link]) -> None:
    for link in links.values():
        link.close()


def _prune_earlier_attempts(job_dir: str, attempt: str) -> None:
    """Remove the boards of this job's earlier attempts, and of earlier runs of this attempt
    and scope at the same address."""
    mine, scope, _ = (attempt.split("-") + ["", ""])[:3]
    ours = _attempt_order(mine)
    with contextlib.suppress(OSError):
        for name in os.listdir(job_dir):
            n, s, _ = (name.split("-") + ["", ""])[:3]
            path = os.path.join(job_dir, name)
            theirs = _attempt_order(n)
            older = theirs is not None and ours is not None and theirs < ours
            rerun = n == mine and s == scope and name != attempt
            if (older or rerun) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)


def _attempt_order(name: str) -> tuple[int, int] | None:
    """(torchrun attempt, in-process generation) from "3" or "3.g2" (runtime/generation.py)."""
    m = re.fullmatch(r"(\d+)(?:\.g(\d+))?", name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def step_message(at: tuple[int, int], what: str) -> str:
    """The file name of one message of the step at `at` ((restore epoch, step))."""
    return f"{at[0]}-{at[1]}-{what}.json"


_STEP_MSG_RE = re.compile(r"^([0-9]+)-([0-9]+)-")

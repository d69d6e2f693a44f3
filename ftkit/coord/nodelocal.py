"""A node's board: the ranks of one node tell their leader (and hear from it) through the
node's private shared memory, never through the global store: small files (heartbeats,
verdicts), and for a commit's messages each rank's mailbox, a datagram socket there
(coord/mailbox.py).

Layout, under the RAM root (tiers/ram.py: per user, 0700, checked, no link followed)::

    hb/<job>/<attempt>-<scope>/<node>/
        beats.bin         each rank's latest heartbeat, in its own slot (coord/beatslots.py)
        verdict.json      the verdict the group ends on (relayed by the leader from the store)
        preempt.json      a rank was preempted: every rank saves and stops at an agreed step
        all-done.json     every rank of every node has finished

    commit/<job>/<attempt>-<scope>/<node>/    (kind "commit": one per tier, commit/node.py NodeGroup)
        box-r<rank>       each rank's mailbox, a socket: a step's messages to it (coord/mailbox.py)
        <epoch>-<step>-<what>.json    a message too big for a mailbox, or one it could not take
        layout-<digest>.json          a rank's chunk layout, posted once (commit/layouts.py)

`<job>` names the running job (the store's address and torchrun's run id), so two jobs
on one host never share a board. A leader removes its node's board when it stops and
the boards of the job's earlier attempts when it starts (a crashed attempt leaves one).
What is read here is untrusted: reads are size-capped, never follow a link, and decode
through judge.py, where anything malformed is silence.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import time
from collections.abc import Iterable
from typing import Any

from ftkit.coord.beatslots import BeatSlots
from ftkit.coord.mailbox import Addresses, Mailbox, box_name, message_frame, notice_frame, post
from ftkit.format.validate import parse_message
from ftkit.runtime import generation
from ftkit.tiers.ram import private_subdir

MAX_BYTES = 64 * 1024  # a verdict or a preemption notice is a few hundred bytes
MAX_INBOX = 4096  # messages kept for later takers (a node's ranks send a few per step)
PRUNE_EVERY = 16  # steps between two looks for the messages a skipped step left (NodeBoard.prune_before)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:64] or "_"


def job_names(scope: str, instance: str) -> tuple[str, str]:
    """(job, attempt directory) for this process, from torchrun's environment, `scope`
    (the store namespace of the Checkpointer, which every rank shares) and `instance`
    (a nonce the ranks agreed on through the store: a rerun of the same job at the same
    address never reads the board, and a stale verdict, of the run before it)."""
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
        self.path = private_subdir(kind, job, attempt, _safe(node))
        self._addresses = Addresses(self.path)  # of the ranks' mailboxes here (coord/mailbox.py)
        self._boxes: dict[int, Mailbox | None] = {}  # this process's mailboxes here, by rank
        self._to: dict[int, str | None] = {}  # the addresses of the ranks' mailboxes, by rank
        self._inbox: dict[str, bytes | None] = {}  # drained from them, not taken yet, by name (None: a notice)
        self._posted: set[str] = set()  # what post_once wrote
        self._pruned: tuple[int, int] | None = None  # the step prune_before last ran for

    # ------------------------------------------------------------- files
    def write(self, name: str, doc: Any) -> None:
        self.write_text(name, json.dumps(doc, separators=(",", ":")))

    def write_text(self, name: str, text: str) -> None:
        self.write_bytes(name, text.encode())

    def write_bytes(self, name: str, data: bytes) -> None:
        """`name` holds `data`, whole: written to a temporary name, then renamed."""
        tmp = os.path.join(self.path, f".{name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(self.path, name))

    def post_once(self, name: str, text: str) -> None:
        """`name` holds `text`, which never changes (it is named by its hash): written the first
        time, and again only if it is gone."""
        if name in self._posted and os.path.exists(os.path.join(self.path, name)):
            return
        self.write_text(name, text)
        self._posted.add(name)

    def read(self, name: str) -> Any:
        """The JSON document `name`, or None (missing, a link, too big, not JSON)."""
        data = self.read_bytes(name, MAX_BYTES)
        if data is None:
            return None
        return parse_message(data)

    def read_bytes(self, name: str, max_bytes: int) -> bytes | None:
        """The bytes of `name`, or None (missing, a link, not a regular file, over `max_bytes`)."""
        try:
            fd = os.open(os.path.join(self.path, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
                return None
            data = os.read(fd, st.st_size + 1)  # (a byte more than fstat saw: a file that grew shows)
            while len(data) < st.st_size and (more := os.read(fd, st.st_size + 1 - len(data))):
                data += more
        except OSError:
            return None
        finally:
            os.close(fd)
        return data if len(data) <= max_bytes else None

    def names(self) -> list[str]:
        try:
            return os.listdir(self.path)
        except OSError:
            return []

    # ------------------------------------------------- a step's messages (commits)
    def send(self, name: str, data: bytes, to: Iterable[int], patient: bool = True) -> None:
        """Hand the message `name` to the ranks `to` of the node, into their mailboxes
        (coord/mailbox.py); where one cannot take it (too big, not bound yet, still full after
        mailbox.PATIENCE_S; `patient` False: full at all), it is a file on the board instead,
        named to them by a notice where that gets through."""
        frame = message_frame(name, data)
        missed = [r for r in to if not post(self._address(r), frame, patient)]
        if missed:
            self.write_bytes(name, data)
            notice = notice_frame(name)
            for r in missed:
                post(self._address(r), notice, patient=False)

    def collect(
        self,
        names: dict[int, str],
        timeout_s: float,
        max_bytes: int,
        give_up: str | None = None,
        me: int = -1,
        only_reader: bool = False,
    ) -> dict[int, bytes | None]:
        """Wait for the messages `names` ({rank: name}) sent to `me`, for at most `timeout_s`;
        their bytes by rank, None for one that never came, is unreadable or is over
        `max_bytes`. `give_up`: a message whose arrival ends the wait at once (a skip; it stays
        for `has`). Messages come through `me`'s mailbox; the board's files are looked at the
        first time and whenever nothing came for mailbox.FALLBACK_S (a message posted as a
        file). Without a mailbox (`me` < 0, or none can be made) the board is polled, every
        0.2 ms backing off to 2 ms. `only_reader`: the messages were sent to `me` alone, so
        those that came as files are removed once read (else the leader's prune_before does)."""
        box = self.mailbox(me) if me >= 0 else None
        got: dict[int, bytes | None] = {}
        deadline, pause = time.monotonic() + timeout_s, 0.0002
        look = box is None or box.fresh  # at the board's files
        if box is not None and box.fresh:
            box.fresh = False
            self._sort(box)
        while True:
            for r, name in names.items():
                if r in got:
                    continue
                if name in self._inbox and (data := self._take(name, max_bytes, only_reader)) is not None:
                    got[r] = data
                elif look and (data := self._take_file(name, max_bytes, only_reader)) is not None:
                    got[r] = data
            left = deadline - time.monotonic()
            if len(got) == len(names) or left < 0:
                break
            if give_up is not None and self._has(give_up, look):
                break
            if box is not None:
                look = not box.wait(left)
                self._sort(box)  # all that came (a burst, from the node's ranks); after a timeout, a no-op recv
            else:
                time.sleep(pause)
                pause = min(pause * 1.5, 0.002)
        return {r: got.get(r) for r in names}

    def has(self, name: str, me: int) -> bool:
        """Whether the message `name` came to `me` (in its mailbox or as a file), without taking it."""
        box = self.mailbox(me) if me >= 0 else None
        if box is not None:
            self._sort(box)
        return self._has(name, True)

    def mailbox(self, rank: int) -> Mailbox | None:
        """`rank`'s mailbox on this board (this process's rank: bound on first use)."""
        if rank not in self._boxes:
            address = self._addresses.of(rank)
            path = os.path.join(self.path, box_name(rank))
            self._boxes[rank] = Mailbox.open(address, path) if address is not None else None
        return self._boxes[rank]

    def _address(self, rank: int) -> str | None:
        if rank not in self._to:
            self._to[rank] = self._addresses.of(rank)
        return self._to[rank]

    def _sort(self, box: Mailbox) -> None:
        """Move what waits in `box` to the inbox (by name; a notice as None)."""
        for name, payload in box.drain():
            self._keep(name, payload)

    def _keep(self, name: str, payload: bytes | None) -> None:
        if payload is not None or name not in self._inbox:
            self._inbox[name] = payload
        if len(self._inbox) > MAX_INBOX:  # a flood (nothing of ftkit's sends that many): the oldest go
            self._inbox.pop(next(iter(self._inbox)))

    def _take(self, name: str, max_bytes: int, remove: bool) -> bytes | None:
        payload = self._inbox.pop(name)
        if payload is None:  # a notice: the message is a file
            return self._take_file(name, max_bytes, remove)
        return payload if len(payload) <= max_bytes else None

    def _take_file(self, name: str, max_bytes: int, remove: bool) -> bytes | None:
        data = self.read_bytes(name, max_bytes)
        if data is not None and remove:
            self.discard(name)
        return data

    def _has(self, name: str, look: bool) -> bool:
        return name in self._inbox or (look and os.path.lexists(os.path.join(self.path, name)))

    def discard(self, *names: str) -> None:
        for name in names:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.path, name))

    def prune_before(self, at: tuple[int, int]) -> None:
        """Remove the messages of steps before `at` ((restore epoch, step)): what a skipped
        step left, which nobody collected. At most once every PRUNE_EVERY steps of an epoch (a
        collector collects twice a step, and a listing of the board at every step found
        nothing but when a step was skipped; what one leaves is a few small files)."""
        last = self._pruned
        if last is not None and last[0] == at[0] and last[1] <= at[1] < last[1] + PRUNE_EVERY:
            return
        self._pruned = at
        stale = [n for n in self.names() if (m := _STEP_MSG_RE.match(n)) and (int(m[1]), int(m[2])) < at]
        self.discard(*stale)
        for n in [n for n in self._inbox if (m := _STEP_MSG_RE.match(n)) and (int(m[1]), int(m[2])) < at]:
            del self._inbox[n]

    def beats(self, ranks: list[int]) -> BeatSlots:
        """The heartbeat slots of the node's `ranks` (all of them, ascending, as every rank of
        the node lists them)."""
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


def _prune_earlier_attempts(job_dir: str, attempt: str) -> None:
    """Remove the boards of this job's earlier attempts, and of earlier runs of this attempt
    and scope at the same address (a crashed attempt, an ended run, leave their files)."""
    mine, scope, _ = (attempt.split("-") + ["", ""])[:3]
    with contextlib.suppress(OSError):
        for name in os.listdir(job_dir):
            n, s, _ = (name.split("-") + ["", ""])[:3]
            path = os.path.join(job_dir, name)
            theirs, ours = _attempt_order(n), _attempt_order(mine)
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


_STEP_MSG_RE = re.compile(r"^(\d+)-(\d+)-")

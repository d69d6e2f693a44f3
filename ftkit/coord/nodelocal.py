"""A node's heartbeat board: the ranks of one node tell their leader (and hear from it)
through small files in the node's private shared memory, never through the global store.

Layout, under the RAM root (tiers/ram.py: per user, 0700, checked, no link followed)::

    hb/<job>/<attempt>-<scope>/<node>/
        beats.bin         each rank's latest heartbeat, in its own slot (coord/beatslots.py)
        verdict.json      the verdict the group ends on (relayed by the leader from the store)
        preempt.json      a rank was preempted: every rank saves and stops at an agreed step
        all-done.json     every rank of every node has finished

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

from ftkit.coord import generation
from ftkit.coord.beatslots import BeatSlots
from ftkit.coord.bell import Bell, bell_name, ring
from ftkit.tiers.ram import private_subdir

MAX_BYTES = 64 * 1024  # a verdict or a preemption notice is a few hundred bytes
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
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0") + generation.suffix()
    scope_hash = hashlib.sha256(scope.encode()).hexdigest()[:12]
    return hashlib.sha256(job.encode()).hexdigest()[:16], f"{_safe(attempt)}-{scope_hash}-{_safe(instance)}"


class NodeBoard:
    """One node's board. `kind`: "hb" for the watchdog's, "commit" for the reports the
    node's ranks send their leader when committing a step to a shared tier (save/commit.py)."""

    def __init__(self, scope: str, node: str, leader: bool, instance: str = "0", kind: str = "hb"):
        job, attempt = job_names(scope, instance)
        if leader:
            _prune_earlier_attempts(private_subdir(kind, job), attempt)
        self.path = private_subdir(kind, job, attempt, _safe(node))
        self._bells: dict[int, Bell | None] = {}  # this process's doorbells here, by rank (coord/bell.py)
        self._posted: set[str] = set()  # what post_once wrote
        self._pruned: tuple[int, int] | None = None  # the step prune_before last ran for

    # ------------------------------------------------------------- files
    def write(self, name: str, doc: Any, wake: Iterable[int] = ()) -> None:
        self.write_text(name, json.dumps(doc, separators=(",", ":")), wake)

    def write_text(self, name: str, text: str, wake: Iterable[int] = ()) -> None:
        """`name` holds `text`, whole: written to a temporary name, then renamed; then the
        doorbells of the ranks `wake` (those that wait for it) ring."""
        data = text.encode()
        tmp = os.path.join(self.path, f".{name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(self.path, name))
        for r in wake:
            ring(os.path.join(self.path, bell_name(r)))

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
        try:
            return json.loads(data)
        except ValueError:
            return None

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
    def collect(
        self, names: dict[int, str], timeout_s: float, max_bytes: int, give_up: str | None = None, me: int = -1
    ) -> dict[int, bytes | None]:
        """Wait for the files `names` ({rank: name}) to appear, for at most `timeout_s`;
        their bytes by rank, None for one that never came or is unreadable. `give_up`: a
        file whose appearance ends the wait at once (a skip). `me`: the waiting rank, whose
        doorbell the writers ring (coord/bell.py); without one (or where no pipe can be
        made) the board is polled, every 0.2 ms backing off to 2 ms."""
        bell = self._bell(me) if me >= 0 else None
        got: dict[int, bytes | None] = {}
        deadline, pause = time.monotonic() + timeout_s, 0.0002
        while True:
            for r, name in names.items():
                if r not in got and (data := self.read_bytes(name, max_bytes)) is not None:
                    got[r] = data
            left = deadline - time.monotonic()
            if len(got) == len(names) or left < 0:
                break
            if give_up is not None and os.path.exists(os.path.join(self.path, give_up)):
                break
            if bell is not None:
                bell.wait(left)
            else:
                time.sleep(pause)
                pause = min(pause * 1.5, 0.002)
        return {r: got.get(r) for r in names}

    def _bell(self, rank: int) -> Bell | None:
        if rank not in self._bells:
            self._bells[rank] = Bell.listen(os.path.join(self.path, bell_name(rank)))
        return self._bells[rank]

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
    """(torchrun attempt, in-process generation) from "3" or "3.g2" (coord/generation.py)."""
    m = re.fullmatch(r"(\d+)(?:\.g(\d+))?", name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def step_message(at: tuple[int, int], what: str) -> str:
    """The file name of one message of the step at `at` ((restore epoch, step))."""
    return f"{at[0]}-{at[1]}-{what}.json"


_STEP_MSG_RE = re.compile(r"^(\d+)-(\d+)-")

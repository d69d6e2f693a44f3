"""A verdict kills the process its heartbeat came from, never another that got its pid since:
each heartbeat records when its process started (ftkit/coord/beatslots.py), and the verdict
(ftkit/runtime/verdict_actions.py) kills only a live process that started then.

Real processes: a real watchdog (rank 0 of 2, its node's leader) reads rank 1's heartbeat slot,
which names a live ``sleep`` process, finds rank 1 silent, and acts on its verdict.
A pid cannot be made to be reused on demand; a heartbeat whose recorded start differs from the
live process's is what a reused pid looks like to the verdict.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys

import pytest

from ftkit.coord.beatslots import MAX_HOST, BeatSlots, pack_beat, unpack_beat
from ftkit.coord.judge import Beat
from ftkit.runtime.warm.client import process_start

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WATCHDOG = """
import logging, os, sys, time
from datetime import timedelta
import torch.distributed as dist
from ftkit.coord.dist import DistContext, host_identity
from ftkit.coord.events import EventLog
from ftkit.coord.judge import Beat
from ftkit.coord.nodelocal import NodeBoard
from ftkit.coord.watchdog import Watchdog, WatchdogConfig
from ftkit.runtime.warm.client import process_start

logging.basicConfig(level=logging.INFO)
pid, start = int(sys.argv[1]), (None if sys.argv[2] == "none" else int(sys.argv[2]))
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
ctx = DistContext(rank=0, world_size=2, store=store)
# Rank 1 (on this node) wrote one heartbeat naming `pid`, started at `start`; then silence.
store.set("wd/board", str(os.getpid()))  # this run's board instance, as the ranks agree on one
board = NodeBoard(ctx.scope + "wd", ctx.node, False, str(os.getpid()))
board.beats([0, 1]).write(1, Beat(1, pid=pid, host_id=host_identity(), start=start))
wd = Watchdog(ctx, EventLog(sys.argv[3], 0), WatchdogConfig(interval_s=0.1, dead_after_s=1.0))
wd.start()
mine = board.beats([0, 1]).read_one(0)  # what this rank's own heartbeat says of it
print("own beat:", mine.pid == os.getpid() and mine.start == process_start(os.getpid()), flush=True)
time.sleep(30)
sys.exit(3)  # the watchdog never ended this process
"""


def _watchdog(pid: int, start: int | str | None, tmp_path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTKIT_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO, FTKIT_RAM_DIR=str(tmp_path / "shm"), FTKIT_NODE_ID="n0")
    args = [str(pid), "none" if start is None else str(start), str(tmp_path / "events")]
    r = subprocess.run(
        [sys.executable, "-c", WATCHDOG, *args], capture_output=True, text=True, env=env, timeout=120, cwd=REPO
    )
    assert r.returncode == 75, r.stderr  # the watchdog judged rank 1 dead and ended this worker
    assert "own beat: True" in r.stdout, r.stdout  # its own heartbeat records its pid and start
    assert "rank 1 is dead" in r.stderr, r.stderr
    return r


@pytest.mark.parametrize("recorded", ["its own", "another", "not recorded"])
def test_a_verdict_kills_the_heartbeats_process_and_never_another_with_its_pid(tmp_path, recorded):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        start = process_start(sleeper.pid)
        assert start is not None
        # "another": the pid's process started at another time than the one that beat (a reused pid)
        given = {"its own": start, "another": start + 1, "not recorded": None}[recorded]
        r = _watchdog(sleeper.pid, given, tmp_path)
        if recorded == "another":
            assert sleeper.poll() is None  # spared: not the process that beat
            assert f"not killing pid {sleeper.pid} of rank 1: the pid is another process's now" in r.stderr
        else:  # its own process; or a beat of an older ftkit, without a start: by its pid, as before
            assert sleeper.wait(timeout=10) == -signal.SIGKILL
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_verdict_on_a_process_gone_kills_nothing_and_says_so(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()  # exited and reaped: its pid names no process
    start = 12345  # (whatever it was: there is no process left to compare)
    r = _watchdog(gone.pid, start, tmp_path)
    assert f"not killing pid {gone.pid} of rank 1: its process is gone" in r.stderr


def test_a_heartbeat_carries_its_start_and_one_written_without_it_still_reads():
    beat = Beat(7, 3, 0.1, 0.2, 4242, "h" * MAX_HOST, start=2**40)
    assert unpack_beat(pack_beat(beat)) == beat  # the longest host id still leaves room for it
    # A payload as ftkit wrote it before starts were recorded: the same fields, no start.
    old = struct.pack("<qqddIBH", 7, 3, 0.1, 0.2, 4242, 16, 1) + b"h"
    assert unpack_beat(old) == Beat(7, 3, 0.1, 0.2, 4242, "h")
    assert unpack_beat(old + b"\0" * 8) is None  # bytes the flags do not account for: no beat
    assert unpack_beat(pack_beat(beat)[:-1]) is None  # a start cut short: no beat


def test_a_slot_holds_a_beat_with_its_start(tmp_path):
    slots = BeatSlots(str(tmp_path), [0, 1])
    me = Beat(1, pid=os.getpid(), host_id="h", start=process_start(os.getpid()))
    slots.write(1, me)
    assert slots.read_one(1) == me and me.start is not None


HUNG_TARGET = """
import logging, os, sys, time
from datetime import timedelta
import torch.distributed as dist
from ftkit.coord.dist import DistContext
from ftkit.coord.events import EventLog
from ftkit.coord.judge import Verdict
from ftkit.coord.watchdog import Watchdog, WatchdogConfig
from ftkit.runtime import generation

logging.basicConfig(level=logging.INFO)
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
ctx = DistContext(rank=1, world_size=2, store=store)  # rank 1 of 2, its leader rank 0 on this host
generation.set_active(True)  # its training loop runs under ftkit.run_in_process
open(os.environ["FTKIT_REPLACEABLE"], "w").close()  # (as run_in_process marks it)
wd = Watchdog(ctx, EventLog(sys.argv[1], 1), WatchdogConfig(interval_s=0.1))
wd.start()
# Its training thread hangs; its leader judged it so on this host and wrote the verdict to the node's
# board, where this rank's watchdog reads it before the judge's SIGKILL lands.
wd.board.write("verdict.json", Verdict(1, "hung", 31.0, "no step progress for 31.0s", 0, local=True).to_json())
time.sleep(30)
sys.exit(3)  # nothing ended this process
"""


def test_a_hung_rank_that_hears_its_own_verdict_first_is_still_replaced(tmp_path):
    """ftkit run --replace-dead: a hung rank's judge on its host posts the verdict, relays it on the
    node's board, then SIGKILLs it, and its warm client replaces a worker killed so. The hung rank's
    own watchdog reads the board every 50 ms; when it read the verdict first it ended its worker with
    exit code 75, which the client passes on: torchrun restarted the group instead. It now ends by
    SIGKILL too, as its judge would have ended it."""
    from ftkit.runtime.warm.client import REPLACE_ENV, REPLACEABLE_ENV, _replaceable

    mark = tmp_path / "replaceable"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTKIT_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO, FTKIT_RAM_DIR=str(tmp_path / "shm"), FTKIT_NODE_ID="n0")
    env.update({REPLACE_ENV: "1", REPLACEABLE_ENV: str(mark)})
    r = subprocess.run(
        [sys.executable, "-c", HUNG_TARGET, str(tmp_path / "events")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=REPO,
    )
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-2000:])
    assert "rank 1 is hung" in r.stderr
    assert _replaceable({"signal": -r.returncode}, False, 0, 1, str(mark))  # what its warm client decides

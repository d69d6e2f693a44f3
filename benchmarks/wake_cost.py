"""What one wait costs a thread in CPU, besides the message it waited for (no ftkit code).

A rank in a commit waits for its peers many times a snapshot (a doorbell for a board file,
a blocking store request). Waiting itself is free, but on this VM the thread that wakes pays
in its next system calls: the same small file read costs several times more right after the
wake than right after another read (cold caches and TLB). The coordination floor that finds
everything in place (coord_floor.Floor) never pays it; coord_floor.HandshakeFloor does.

    python benchmarks/wake_cost.py [--rounds 300] [--busy 2]

A listener sleeps in `select` on a named pipe; a child process writes a byte to it every
10 ms; after each wake the listener reads a 1.4 KB file (open, fstat, read, close) twice and
times each read with its thread's CPU clock. `--busy N` runs N spinning processes meanwhile,
as training would.
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time

RINGER = """
import os, sys, time
path = sys.argv[1]
fd = os.open(path, os.O_WRONLY)
while True:
    time.sleep(0.01)
    os.write(fd, b"\\0")
"""


def read_file(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        return os.read(fd, os.fstat(fd).st_size + 1)
    finally:
        os.close(fd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--busy", type=int, default=0, help="spinning processes meanwhile")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        msg, bell = os.path.join(d, "msg"), os.path.join(d, "bell")
        with open(msg, "wb") as f:
            f.write(b"x" * 1400)
        os.mkfifo(bell)
        rfd = os.open(bell, os.O_RDONLY | os.O_NONBLOCK)
        keep = os.open(bell, os.O_WRONLY | os.O_NONBLOCK)
        kids = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
        kids.append(subprocess.Popen([sys.executable, "-c", RINGER, bell]))
        after, again = [], []
        try:
            for _ in range(a.rounds):
                select.select([rfd], [], [], 1.0)
                os.read(rfd, 4096)
                t0 = time.thread_time()
                read_file(msg)
                t1 = time.thread_time()
                read_file(msg)
                t2 = time.thread_time()
                after.append(t1 - t0)
                again.append(t2 - t1)
        finally:
            for k in kids:
                k.kill()
            os.close(rfd)
            os.close(keep)
    first, second = statistics.median(after) * 1e6, statistics.median(again) * 1e6
    print(
        f"a 1.4 KB file read (open, fstat, read, close), median of {a.rounds}, {a.busy} busy processes: "
        f"{first:.1f} us of CPU right after a wake, {second:.1f} us right after that: a wake costs "
        f"about {first - second:.0f} us more"
    )


if __name__ == "__main__":
    main()

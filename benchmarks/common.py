"""What the benchmark scripts share: clocks, medians, progress lines, the page cache.

Imported as `common` (each script runs with benchmarks/ first on sys.path).
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

DROP_CACHES = "/proc/sys/vm/drop_caches"


def now() -> float:
    """Seconds on the monotonic clock (comparable between processes on one machine)."""
    return time.perf_counter()


def timed(fn: Callable[[], Any]) -> float:
    t0 = now()
    fn()
    return now() - t0


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def progress(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def disk_bytes_of(path: str) -> int:
    """Bytes in the files under `path` (as stored: a benchmark's 'bytes on disk')."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass  # removed while we walked
    return total


def can_drop_caches() -> bool:
    return os.access(DROP_CACHES, os.W_OK)


def drop_caches() -> None:
    """Write dirty pages out, then drop the page cache (needs root): a cold read."""
    os.sync()
    with open(DROP_CACHES, "w") as f:
        f.write("3\n")


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux

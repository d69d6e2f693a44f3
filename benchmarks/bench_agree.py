"""A restore's agreement (ftkit.coord.agree) at growing world sizes: what one rank asks of
the store and reads from it, and the wall time of the whole agreement.

Every rank is a thread with its own client of one real TCPStore (served by a child
process), so the store's work is real and the ranks' Python is shared by 2 cores. Beside
ftkit's figure, from the same run:

- the floor: the same answer with no ftkit code (each rank sets its ballot, rank 0 reads
  them all in one multi_get and sets one answer, each rank waits for it and gets it);
- all-to-all: every rank reads every rank's ballot (what an agreement cost before), the
  store's reads growing with the square of the world.

    .venv/bin/python benchmarks/bench_agree.py [--ranks 64 256 1024] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_scale import StoreServer  # noqa: E402


class Counted:
    """A store client that counts its requests and the bytes its reads return."""

    def __init__(self, store: Any):
        self.store, self.requests, self.read = store, 0, 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)

        def call(*a: Any, **k: Any) -> Any:
            self.requests += 1
            out = attr(*a, **k)
            if name == "multi_get":
                self.read += sum(map(len, out))
            elif name == "get":
                self.read += len(out)
            return out

        return call


def ballot(r: int) -> dict[str, Any]:
    return {"error": "disk full" if r == 5 else None, "value": None}


def ftkit_agree(r: int, world: int, store: Any, key: str) -> None:
    from ftkit.coord.agree import agree
    from ftkit.coord.dist import DistContext

    nodes = [f"n{i // 8}" for i in range(world)]
    ctx = DistContext(r, world, store, nodes[r], 300.0, nodes)
    outcome = agree(ctx, key, error=ballot(r)["error"])
    assert outcome.failures == [(5, "disk full")]


def floor_agree(r: int, world: int, store: Any, key: str) -> None:
    store.set(f"{key}/{r}", json.dumps(ballot(r)))
    if r == 0:
        keys = [f"{key}/{i}" for i in range(world)]
        store.wait(keys, timedelta(seconds=300))
        got = [json.loads(v) for v in store.multi_get(keys)]
        failures = [(i, b["error"]) for i, b in enumerate(got) if b["error"] is not None]
        store.set(f"{key}/answer", json.dumps({"failures": failures, "values": []}))
    store.wait([f"{key}/answer"], timedelta(seconds=300))
    assert json.loads(store.get(f"{key}/answer"))["failures"] == [[5, "disk full"]]


def all_to_all(r: int, world: int, store: Any, key: str) -> None:
    store.set(f"{key}/{r}", json.dumps(ballot(r)))
    keys = [f"{key}/{i}" for i in range(world)]
    store.wait(keys, timedelta(seconds=300))
    got = [json.loads(v) for v in store.multi_get(keys)]
    assert [(i, b["error"]) for i, b in enumerate(got) if b["error"] is not None] == [(5, "disk full")]


def clients(world: int, port: int) -> list[Counted]:
    """One store client a rank (made once per world size: connecting is the slow part)."""
    import torch.distributed as dist

    return [
        Counted(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))) for _ in range(world)
    ]


def run(fn: Any, world: int, stores: list[Counted], key: str) -> dict[str, float]:
    for s in stores:
        s.requests = s.read = 0
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            fn(r, world, stores[r], key)
        except BaseException as e:  # (reported below: a thread's error is not lost)
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{fn.__name__} at {world} ranks: {errors[0]!r}")
    others = stores[1:]
    return {
        "wall_s": wall,
        "requests_per_rank": max(s.requests for s in others),
        "bytes_read_per_rank": max(s.read for s in others),
        "store_requests": sum(s.requests for s in stores),
        "store_bytes_read": sum(s.read for s in stores),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--json", metavar="F", help="write the figures to F as JSON")
    args = p.parse_args()
    import ftkit.coord.agree  # noqa: F401  (imported before the clock starts)

    rows = []
    with StoreServer(300.0) as server:
        for world in args.ranks:
            stores = clients(world, server.port)
            for fn in (ftkit_agree, floor_agree, all_to_all):
                rows.append({"ranks": world, "design": fn.__name__, **run(fn, world, stores, f"{fn.__name__}/{world}")})
    print(f"{'ranks':>6} {'design':<12} {'wall s':>8} {'req/rank':>9} {'bytes/rank':>11} {'store reads (bytes)':>20}")
    for r in rows:
        print(
            f"{r['ranks']:>6} {r['design']:<12} {r['wall_s']:>8.3f} {r['requests_per_rank']:>9} "
            f"{r['bytes_read_per_rank']:>11,} {r['store_bytes_read']:>20,}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Distributed benchmark: ftkit's RAM, peer and disk tiers beside DCP, from one 4-rank job.

Run (from the repo root)::

    .venv/bin/python benchmarks/bench_dist.py                      # 256 MiB state, 4 ranks
    .venv/bin/python benchmarks/bench_dist.py --mib 32 --repeats 2 --rounds 2 --steps 5   # quick
    .venv/bin/python benchmarks/bench_dist.py --json out.json --dir /mnt/nvme

The script launches itself under torchrun (``python -m torch.distributed.run
--standalone --nproc-per-node 4``): real separate interpreters, torchrun's
rendezvous store (the one ftkit's DistContext uses in production), and
TORCHELASTIC_* variables, as a user's job has them. Ranks are split into two
simulated nodes (``FTKIT_RANKS_PER_NODE=2``); each node's RAM tier is its own
directory under a temporary ``FTKIT_RAM_DIR`` in /dev/shm; peer traffic is gloo
over loopback. All ranks run with one torch thread (4 ranks on 2 cores).

The state (phases 1 and 2) is `--tensors` fp32 randn tensors totalling `--mib`
MiB, identical on every rank (replicated, as under DDP), of varied sizes (a few
small ones, the rest 1-4 units of rows x 1024).

1. Restore of that state, in place into zeroed tensors, every value checked
   after: ftkit from the RAM tier (same nodes), from peer replicas (node1's RAM
   dir moved away, so its ranks fetch over the peer group), from a local disk
   tier (cold: page cache dropped before, when permitted; and warm), and DCP
   ``load`` of the same state saved by ``dcp.save`` from the same 4 ranks (cold,
   warm, and, as an extra, from /dev/shm). A "floor" row reads the RAM tier's
   files straight into the live tensors and verifies them there (no ftkit):
   what memory speed allows. Figure: wall time of the restore call, max over
   ranks, median over `--repeats` rounds (each round runs every contender once,
   back to back; ratios are medians of per-round ratios). Before each restore
   every rank calls malloc_trim(0), so each loader finds an empty heap as in a
   restarted process; otherwise a loader that runs after another reuses its
   already-faulted free memory and the order decides the figures (--no-trim).
2. Peer replication: snapshot()->wait() wall time (max over ranks) with tiers
   ["ram"] and ["ram", Tier("peer", replicas=1)]; the difference is what
   replication costs, and bytes replicated / difference its throughput. Also
   measured from the event log (each persist event's replicate record: PeerGroup.run's window).
   Baseline: raw gloo isend/irecv of the same byte counts between the same rank
   pairs, all pairs concurrently, preallocated buffers; and, to separate the
   effect of ftkit's transfer order, the same raw transfers in ftkit's plan order.
3. Training-step slowdown under DDP (4 ranks), on the reference TinyGPT and on
   a bigger MLP: median step time of a plain DDP model (no ftkit), of a twin
   model under a Checkpointer that takes no snapshot (its DDP comm hook,
   optimizer pre-hook and watchdog installed), and of that twin with
   ``ck.snapshot(step)`` after every step to ["ram", peer] (policy "wait", all
   other options default), and of that twin with one snapshot per block (what
   ``every=--steps`` costs; compared by mean step time); blocks of `--steps`
   steps alternate, `--rounds` times. The stall (ck.stats.last_stall_s) is reported apart from the rest of
   the slowdown (background contention); the persist thread's wall and CPU time
   per snapshot too.

The Checkpointers of phases 1-2 run without the heartbeat watchdog: it takes a
Checkpointer that has made no step for 30 s since it was created for a hung
rank and ends the job.

Everything written (temp dirs under --dir and /dev/shm) is removed at the end.
Exit status 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from common import DROP_CACHES, median, now

REPO = Path(__file__).resolve().parent.parent
TARGET_RAM_VS_DCP = 5.0
TARGET_REPL_VS_RAW = 0.8
TARGET_SLOWDOWN = 0.05
TARGET_COORD_CPU_S = 0.0015  # the RAM tier's commit coordination per snapshot, every rank (issue 15)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=float, default=256.0, help="state size for restore/replication (MiB)")
    p.add_argument("--tensors", type=int, default=32, help="number of tensors in that state")
    p.add_argument("--ranks", type=int, default=4, help="ranks (even; half per simulated node)")
    p.add_argument("--repeats", type=int, default=5, help="restore rounds")
    p.add_argument("--rounds", type=int, default=5, help="replication rounds; training block pairs")
    p.add_argument("--steps", type=int, default=10, help="training steps per block")
    p.add_argument("--mlp-dim", type=int, default=2048, help="hidden width of the bigger MLP (0: skip it)")
    p.add_argument("--mlp-batch", type=int, default=64)
    p.add_argument("--phases", default="restore,replication,train", help="comma-separated subset")
    p.add_argument("--dir", default=None, help="where the disk tier and DCP checkpoint go (default: /tmp)")
    p.add_argument("--no-drop-caches", action="store_true", help="never drop the page cache")
    p.add_argument(
        "--no-trim",
        action="store_true",
        help="do not malloc_trim() before each restore (figures then depend on the order)",
    )
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--timeout", type=float, default=3600.0, help="kill the job after this many seconds")
    # Internal: set by the launcher for the ranks.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--base", help=argparse.SUPPRESS)
    p.add_argument("--shm", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ranks < 2 or args.ranks % 2:
        p.error("--ranks must be even and >= 2 (two simulated nodes)")
    return args


# ======================================================================= launcher
def launch(args: argparse.Namespace) -> int:
    base = tempfile.mkdtemp(prefix="ftkit-bench-dist-", dir=args.dir)
    shm = tempfile.mkdtemp(prefix="ftkit-bench-dist-", dir="/dev/shm")
    out = os.path.join(base, "results.json")
    env = {
        **os.environ,
        "FTKIT_RAM_DIR": shm,
        "FTKIT_RANKS_PER_NODE": str(args.ranks // 2),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    env.pop("FTKIT_NODE_ID", None)
    passthrough = [
        "--mib",
        str(args.mib),
        "--tensors",
        str(args.tensors),
        "--ranks",
        str(args.ranks),
        "--repeats",
        str(args.repeats),
        "--rounds",
        str(args.rounds),
        "--steps",
        str(args.steps),
        "--mlp-dim",
        str(args.mlp_dim),
        "--mlp-batch",
        str(args.mlp_batch),
        "--phases",
        args.phases,
    ]
    if args.no_drop_caches:
        passthrough.append("--no-drop-caches")
    if args.no_trim:
        passthrough.append("--no-trim")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.ranks),
        __file__,
        "--worker",
        "--base",
        base,
        "--shm",
        shm,
        "--out",
        out,
        *passthrough,
    ]
    t0 = now()
    proc = subprocess.Popen(cmd, env=env, cwd=str(REPO), start_new_session=True)
    try:
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"bench_dist: the job ran past {args.timeout:.0f}s; stopping it", file=sys.stderr)
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return 2
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
        if rc != 0 or not os.path.exists(out):
            print(f"bench_dist: the torchrun job failed (exit {rc})", file=sys.stderr)
            return 2
        with open(out) as f:
            res = json.load(f)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    res["config"]["wall_s"] = now() - t0
    res["config"]["command"] = " ".join(
        [
            os.path.relpath(sys.executable, REPO) if sys.executable.startswith(str(REPO)) else sys.executable,
            *map(str, sys.argv),
        ]
    )
    targets = report(res)
    res["targets"] = targets
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
        print(f"\nfigures written to {args.json}")
    return 0 if all(t["pass"] for t in targets) else 1


# ========================================================================= report
def fmt_s(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def fmt_rate(b: float) -> str:
    return f"{b / 1e9:.2f} GB/s" if b >= 1e9 else f"{b / 1e6:.0f} MB/s"


def table(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]], widths: tuple[int, ...]) -> None:
    rule = "-" * (sum(widths) + 3 * (len(widths) - 1))
    print(f"\n{title}\n{rule}")
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    print(rule)
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def report(res: dict[str, Any]) -> list[dict[str, Any]]:
    c = res["config"]
    targets: list[dict[str, Any]] = []

    def target(what: str, ok: bool, detail: str) -> None:
        targets.append({"what": what, "pass": bool(ok), "detail": detail})

    print(f"\nftkit distributed benchmark  ({c['command']})")
    print(
        f"  {c['world']} ranks under torchrun --standalone, 2 simulated nodes x {c['world'] // 2} ranks "
        f"(FTKIT_RANKS_PER_NODE), gloo over loopback; {c['cpus']} CPUs, 1 torch thread per rank; "
        f"torch {c['torch']}"
    )
    print(f"  disk: {c['disk_fs']}; RAM tier: tmpfs /dev/shm; whole run {c['wall_s']:.0f} s")

    r = res.get("restore")
    if r:
        nb = r["state_bytes"]
        cache = (
            "cold = page cache dropped before"
            if r["drop_caches"]
            else "page cache could NOT be dropped: 'cold' rows are warm"
        )
        print(
            f"\n  state: {nb / 2**20:.0f} MiB fp32, {r['tensors']} tensors, replicated on every rank; "
            f"median of {len(r['rounds'])} rounds; {cache}; "
            + (
                "malloc_trim(0) before each restore (a restarted process's empty heap)"
                if r.get("trim")
                else "heap NOT trimmed between restores"
            )
        )
        m = r["median"]
        ratio = r["ratio"]
        sp = r["spread"]

        def cell(k: str) -> str:
            return f"{fmt_s(m[k])} [{fmt_s(sp[k][0])}-{fmt_s(sp[k][1])}]"

        rows = [
            (
                "RAM tier, same nodes",
                cell("ram"),
                "DCP load, disk, cold",
                cell("dcp_cold"),
                f"{ratio['dcp_cold/ram']:.2f}x",
            ),
            ("", "", "DCP load, disk, warm", cell("dcp_warm"), f"{ratio['dcp_warm/ram']:.2f}x"),
            ("", "", "DCP load, /dev/shm", cell("dcp_shm"), f"{ratio['dcp_shm/ram']:.2f}x"),
            (
                "peer replicas (node1's RAM lost)",
                cell("peer"),
                "DCP load, disk, cold",
                cell("dcp_cold"),
                f"{ratio['dcp_cold/peer']:.2f}x",
            ),
            ("", "", "DCP load, disk, warm", cell("dcp_warm"), f"{ratio['dcp_warm/peer']:.2f}x"),
            (
                "local disk tier, cold",
                cell("disk_cold"),
                "DCP load, disk, cold",
                cell("dcp_cold"),
                f"{ratio['dcp_cold/disk_cold']:.2f}x",
            ),
            (
                "local disk tier, warm",
                cell("disk_warm"),
                "DCP load, disk, warm",
                cell("dcp_warm"),
                f"{ratio['dcp_warm/disk_warm']:.2f}x",
            ),
            (
                "floor: RAM files read into live",
                cell("floor"),
                "DCP load, disk, warm",
                cell("dcp_warm"),
                f"{ratio['dcp_warm/floor']:.2f}x",
            ),
        ]
        table(
            "1. restore: wall time of the restore call, max over ranks, median [min-max] (lower is better)",
            ("ours", "time", "competitor", "time", "DCP/ours"),
            rows,
            (32, 29, 20, 29, 8),
        )
        f1 = r["first"]
        print(
            "  first round (first restore of each kind in the process): "
            + ", ".join(f"{k} {fmt_s(v)}" for k, v in f1.items())
        )
        dr = r.get("disk_read_cold")
        if dr:
            print(
                f"  this disk read cold (page cache dropped, one reader, sequential): "
                f"{fmt_rate(dr['bytes'] / dr['s'])} ({dr['bytes'] / 2**20:.0f} MiB in {fmt_s(dr['s'])})"
            )
        b = r["breakdown"]
        print(
            "  ftkit restore() phases, max over ranks (median of rounds): "
            + "; ".join(
                f"{k}: plan {fmt_s(v['plan_s'])}, read+verify {fmt_s(v['read_s'])}"
                + (f" (of which fetch from peers {fmt_s(v['fetch_s'])})" if v["fetch_s"] else "")
                + f", load {fmt_s(v['load_s'])}"
                for k, v in b.items()
            )
        )
        print(
            f"  per-rank read rate of the RAM restore: {fmt_rate(nb / m['ram'])} "
            f"(every rank restores all {nb / 2**20:.0f} MiB); peer sources by rank: {r['peer_sources']}"
        )
        target(
            f"restore from RAM >= {TARGET_RAM_VS_DCP:.0f}x faster than DCP load from disk (cold)",
            ratio["dcp_cold/ram"] >= TARGET_RAM_VS_DCP,
            f"{ratio['dcp_cold/ram']:.1f}x ({fmt_s(m['ram'])} vs {fmt_s(m['dcp_cold'])})"
            + ("" if r["drop_caches"] else " [caches not dropped: this is warm]"),
        )
        target(
            f"restore from RAM >= {TARGET_RAM_VS_DCP:.0f}x faster than DCP load from disk (warm page cache)",
            ratio["dcp_warm/ram"] >= TARGET_RAM_VS_DCP,
            f"{ratio['dcp_warm/ram']:.1f}x ({fmt_s(m['ram'])} vs {fmt_s(m['dcp_warm'])})",
        )

    p = res.get("replication")
    if p:
        nb = p["replicated_bytes"]
        m = p["median"]
        rows = [
            (
                "replication cost: snapshot->wait with peer minus without",
                fmt_s(m["peer_delta_s"]),
                fmt_rate(nb / m["peer_delta_s"]),
                f"{p['ratio']['delta']:.2f}x",
            ),
            (
                "  PeerGroup.run window (first start -> last end)",
                fmt_s(m["run_window_s"]),
                fmt_rate(nb / m["run_window_s"]),
                f"{p['ratio']['run']:.2f}x",
            ),
            (
                "  of it, read own file back + verify/write received (max rank)",
                f"{fmt_s(m['run_read_s'])} + {fmt_s(m['run_write_s'])}",
                "",
                "",
            ),
            (
                "raw gloo isend/irecv, all pairs concurrently (baseline)",
                fmt_s(m["raw_concurrent_s"]),
                fmt_rate(nb / m["raw_concurrent_s"]),
                "1.00x",
            ),
            (
                "raw gloo send/recv in ftkit's plan order (blocking)",
                fmt_s(m["raw_plan_order_s"]),
                fmt_rate(nb / m["raw_plan_order_s"]),
                f"{p['ratio']['raw_plan_order']:.2f}x",
            ),
            (
                "floor: raw + store over tmpfs pages + hash (no ftkit)",
                fmt_s(m["floor_s"]),
                fmt_rate(nb / m["floor_s"]),
                f"{p['ratio']['floor']:.2f}x",
            ),
            ("context: snapshot->wait, tiers [ram]", fmt_s(m["ram_only_s"]), "", ""),
            ("context: snapshot->wait, tiers [ram, peer]", fmt_s(m["ram_peer_s"]), "", ""),
        ]
        table(
            f"2. peer replication of one snapshot: {nb / 2**20:.0f} MiB sent in total, "
            f"pairs {p['pairs']} (median of {len(p['rounds'])} rounds)",
            ("what", "time", "throughput", "vs raw"),
            rows,
            (62, 17, 10, 7),
        )
        target(
            f"ftkit replication >= {TARGET_REPL_VS_RAW}x raw gloo throughput",
            p["ratio"]["delta"] >= TARGET_REPL_VS_RAW,
            f"{p['ratio']['delta']:.2f}x ({fmt_rate(nb / m['peer_delta_s'])} vs "
            f"{fmt_rate(nb / m['raw_concurrent_s'])}; measured as the snapshot->wait difference; "
            f"PeerGroup.run alone: {p['ratio']['run']:.2f}x; the floor of storing and checking "
            f"the replica here: {p['ratio']['floor']:.2f}x)",
        )

    t = res.get("train")
    if t:
        rows = []
        for name, v in t.items():
            rows.append(
                (
                    f"{name} ({v['state_bytes'] / 2**20:.1f} MiB state, {v['params'] / 1e6:.2f} M params)",
                    fmt_s(v["base_s"]),
                    f"{fmt_s(v['attached_s'])} ({v['attached_slowdown'] * 100:+.1f}%)",
                    fmt_s(v["ftkit_s"]),
                    f"{v['slowdown'] * 100:+.1f}%",
                    fmt_s(v["stall_s"]),
                    f"{v['contention'] * 100:+.1f}%",
                )
            )
        table(
            f"3. DDP training step, median of per-step max over ranks ({t[next(iter(t))]['steps']} steps per "
            "column, alternating blocks); snapshot every step to [ram, peer], policy wait",
            ("model", "no ftkit", "attached, no snapshot", "snapshot", "slowdown", "stall", "rest"),
            rows,
            (42, 9, 21, 9, 8, 8, 6),
        )
        print(
            "  attached = a Checkpointer on the model (its DDP comm hook, optimizer pre-hook, watchdog thread)\n"
            "  stall = ck.stats.last_stall_s (capture + wait for a slot + copy, on the training thread)\n"
            "  rest = (snapshot - attached - stall) / no ftkit: the background persist and replication "
            "competing for the 2 cores"
        )
        for name, v in t.items():
            if "every_slowdown" in v:
                print(
                    f"  {name}: one snapshot every {v['every_n']} steps instead (same tiers; mean step time "
                    f"over its blocks vs no ftkit): {v['every_slowdown'] * 100:+.1f}%"
                )
        for name, v in t.items():
            c = v.get("cpu_per_step_s")
            if c:
                extra = [sn - at for sn, at in zip(c["snapshot"], c["attached"])]
                print(
                    f"  {name}: CPU per step of each rank process (all threads), mean over ranks: no ftkit "
                    f"{fmt_s(statistics.fmean(c['base']))}, attached {fmt_s(statistics.fmean(c['attached']))}, "
                    f"snapshot every step {fmt_s(statistics.fmean(c['snapshot']))}: a snapshot costs "
                    f"{fmt_s(statistics.fmean(extra))} of CPU per rank ({'/'.join(fmt_s(x) for x in extra)})"
                )
        for name, v in t.items():
            print(
                f"  {name}: background persist per snapshot, by rank: wall "
                + "/".join(fmt_s(x) for x in v["persist_wall_s"])
                + "; CPU of the persist thread "
                + "/".join(fmt_s(x) for x in v["persist_cpu_s"])
                + (
                    "; of which the RAM tier's commit coordination (not writing or replicating bytes) "
                    + "/".join(fmt_s(x) for x in v["coord_cpu_s"])
                    if all(x is not None for x in v.get("coord_cpu_s", [None]))
                    else ""
                )
            )
            if v.get("coord_floor_cpu_s"):
                print(
                    f"  {name}: floor of that coordination (the same files, store requests and JSON documents "
                    "per snapshot, no ftkit code, under the same training; benchmarks/coord_floor.py): "
                    + "/".join(fmt_s(x) for x in v["coord_floor_cpu_s"])
                    + " with nothing waited for; "
                    + "/".join(fmt_s(x) for x in v["coord_floor_waits_cpu_s"])
                    + " with the commit's waits (each message waited for, as ranks wait for each other)"
                )
        for name, v in t.items():
            target(
                f"training-step slowdown < {TARGET_SLOWDOWN * 100:.0f}% ({name})",
                v["slowdown"] < TARGET_SLOWDOWN,
                f"{v['slowdown'] * 100:+.1f}% ({fmt_s(v['base_s'])} -> {fmt_s(v['ftkit_s'])}; "
                f"stall {fmt_s(v['stall_s'])}, p90 step {fmt_s(v['ftkit_p90_s'])} vs {fmt_s(v['base_p90_s'])})",
            )
            coord = v.get("coord_cpu_s") or []
            if coord and all(x is not None for x in coord):
                target(
                    f"RAM-tier commit coordination <= {TARGET_COORD_CPU_S * 1e3:.1f} ms of CPU per snapshot "
                    f"on every rank ({name}; issue 15)",
                    max(coord) <= TARGET_COORD_CPU_S,
                    "/".join(fmt_s(x) for x in coord)
                    + "; floor with the commit's waits "
                    + "/".join(fmt_s(x) for x in v.get("coord_floor_waits_cpu_s") or []),
                )

    rule = "-" * 100
    print(f"\ntargets\n{rule}")
    for tg in targets:
        print(f"  {'PASS' if tg['pass'] else 'MISS'}  {tg['what']}: {tg['detail']}")
    print(f"  peak RSS per rank (max): {res['config'].get('peak_rss_mib', 0):.0f} MiB")
    return targets


# ========================================================================= worker
class Ranks:
    """The running job, as a worker sees it."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.per_node = self.world // 2

    def barrier(self) -> None:
        self.dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"  .. {msg}", file=sys.stderr, flush=True)

    def drop_caches(self, allowed: bool) -> bool:
        """Rank 0 drops the page cache (tmpfs is not affected) while the others wait."""
        self.barrier()
        ok = False
        if self.rank == 0 and allowed:
            try:
                os.sync()
                with open(DROP_CACHES, "w") as f:
                    f.write("3\n")
                ok = True
            except OSError:
                ok = False
        ok = self.gather(ok)[0]
        self.barrier()
        return ok


def tensor_shapes(total_bytes: int, n: int, cols: int = 1024) -> list[tuple[int, ...]]:
    """A few small 1-D tensors (< 1 MiB: kept whole by one rank), the rest rows x cols of 1-4 units."""
    small = min(4, max(0, n // 4))
    shapes: list[tuple[int, ...]] = [(1024 * 4**i,) for i in range(small)]  # 4 KiB .. 256 KiB
    rest = max(total_bytes - sum(s[0] * 4 for s in shapes), 0)
    weights = [1 + (i % 4) for i in range(n - small)]
    row_bytes = cols * 4
    for w in weights:
        rows = max(1, int(rest * w / sum(weights) / row_bytes))
        shapes.append((rows, cols))
    return shapes


def make_state(mib: float, n: int):
    import torch

    state = {}
    for i, shape in enumerate(tensor_shapes(int(mib * 2**20), n)):
        g = torch.Generator().manual_seed(1000 + i)  # identical on every rank: replicated state
        state[f"t{i:03d}"] = torch.randn(shape, generator=g)
    return state


def digest(state) -> list[float]:
    import torch

    return [float(t.sum(dtype=torch.float64)) for t in state.values()]


def nbytes_of(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


_TRIM = True


def fresh_heap() -> None:
    """Give free heap memory back to the OS, as a restarted process starts without any.

    Without this, whichever loader runs after another finds already-faulted free
    memory in the heap and the order of the contenders decides the figures.
    """
    if not _TRIM:
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def floor_restore(state, node_path: str, step: int) -> None:
    """What memory speed allows: each chunk of the node's tmpfs files read (one kernel copy)
    straight into the live tensor's bytes, then its checksum verified there. No planning,
    no vote, no temporaries: the floor under any restore of this state from node RAM."""
    import torch

    from ftkit.format import codec
    from ftkit.format.reader import load_manifest
    from ftkit.tiers.storage import Storage

    manifest = load_manifest(Storage(node_path), step)
    step_dir = os.path.join(node_path, f"step-{step:012d}")
    files = {name: open(os.path.join(step_dir, name), "rb", buffering=0) for name in manifest.files}
    try:
        for t in manifest.tensors:
            live = state[t.name]
            dst = memoryview(live.view(-1).view(torch.uint8).numpy())
            row = live.element_size() * (live.numel() // live.shape[0] if live.dim() else 1)
            for sh in t.shards:
                base = sh.offsets[0] * row if sh.offsets else 0
                for c in sh.chunks:
                    part = dst[base + c.raw_offset : base + c.raw_offset + c.raw_length]
                    f = files[c.file]
                    f.seek(c.offset)
                    if f.readinto(part) != c.length:
                        raise AssertionError(f"{c.file}: short read")
                    codec.check(part, c.checksum, c.file)
    finally:
        for f in files.values():
            f.close()


def timed_restore(R: Ranks, state, want: list[float], fn: Callable[[], Any], ck=None) -> dict[str, Any]:
    """Zero the state, restore it with fn() on every rank at once, check every value."""
    import torch

    with torch.no_grad():
        for t in state.values():
            t.zero_()
    fresh_heap()
    R.barrier()
    t0 = now()
    fn()
    dt = now() - t0
    if digest(state) != want:
        raise AssertionError(f"rank {R.rank}: restored state differs from the saved one")
    info = dict(ck.last_restore) if ck is not None else {}
    per_rank = R.gather(
        {
            "s": dt,
            "source": info.get("source"),
            "plan_s": info.get("plan_s"),
            "read_s": info.get("read_s"),
            "load_s": info.get("load_s"),
            "fetch_s": info.get("fetch_s", 0.0),
        }
    )
    out = {
        "s": max(p["s"] for p in per_rank),
        "per_rank_s": [p["s"] for p in per_rank],
        "sources": [p["source"] for p in per_rank],
    }
    if ck is not None:
        for k in ("plan_s", "read_s", "load_s", "fetch_s"):
            out[k] = max(p[k] for p in per_rank)
    return out


def quiet_checkpointer(state, tiers, **kw):
    """A Checkpointer for phases 1-2, without the heartbeat watchdog.

    These Checkpointers take no training steps (the restore ones none at all), and
    the watchdog judges a rank "hung" when its step has not moved for 30 s since
    the Checkpointer was created, ending the job (see the report's bug list).
    """
    import inspect

    import ftkit

    if "watchdog" in inspect.signature(ftkit.Checkpointer).parameters:
        kw["watchdog"] = False
    return ftkit.Checkpointer(state, tiers, **kw)


def phase_restore(a: argparse.Namespace, R: Ranks, state) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    import ftkit

    os.environ["FTKIT_JOB_ID"] = "restore"
    want = digest(state)
    disk = os.path.join(a.base, "ftkit-disk")
    dcp_disk = os.path.join(a.base, "dcp")
    dcp_shm = os.path.join(a.shm, "dcp")
    ram_tiers = [ftkit.Tier("ram", keep=1), ftkit.Tier("peer", replicas=1)]

    R.log("restore: saving with ftkit (ram + peer + disk) and dcp.save (disk, /dev/shm)")
    with quiet_checkpointer(state, ram_tiers + [ftkit.Tier(disk, keep=1)], rng=False) as ck:
        R.barrier()
        t0 = now()
        ck.snapshot(1)
        ck.wait()
        save_ftkit = now() - t0
    R.barrier()
    t0 = now()
    dcp.save(state, checkpoint_id=dcp_disk)
    save_dcp = now() - t0
    dcp.save(state, checkpoint_id=dcp_shm)
    R.barrier()

    allowed = not a.no_drop_caches and os.access(DROP_CACHES, os.W_OK)
    disk_read = None
    if R.drop_caches(allowed):  # context: how fast is this "disk" when its pages are not cached?
        if R.rank == 0:
            files = [os.path.join(dcp_disk, f) for f in sorted(os.listdir(dcp_disk))]
            buf = bytearray(8 * 2**20)
            view = memoryview(buf)
            t0 = now()
            total = 0
            for path in files:
                with open(path, "rb", buffering=0) as f:
                    while n := f.readinto(view):
                        total += n
            disk_read = {"bytes": total, "s": now() - t0}
        disk_read = R.gather(disk_read)[0]
        R.barrier()

    node1 = os.path.join(a.shm, "restore", "node1")
    backup = os.path.join(a.shm, "node1-backup")  # outside the job dir: invisible to ftkit
    node1_leader = R.per_node
    dropped = True
    rounds = []
    ck_ram = quiet_checkpointer(state, ram_tiers, rng=False)
    ck_disk = quiet_checkpointer(state, [ftkit.Tier(disk, keep=1)], rng=False)
    try:
        for i in range(a.repeats):
            R.log(f"restore round {i + 1}/{a.repeats}")
            row: dict[str, Any] = {}
            row["ram"] = timed_restore(R, state, want, ck_ram.restore, ck_ram)
            # node1 is lost: its RAM dir disappears (kept aside to put back after).
            R.barrier()
            if R.rank == node1_leader:
                os.rename(node1, backup)
            R.barrier()
            row["peer"] = timed_restore(R, state, want, ck_ram.restore, ck_ram)
            R.barrier()
            if R.rank == node1_leader:
                shutil.rmtree(node1)
                os.rename(backup, node1)
            dropped &= R.drop_caches(allowed)
            row["disk_cold"] = timed_restore(R, state, want, ck_disk.restore, ck_disk)
            row["disk_warm"] = timed_restore(R, state, want, ck_disk.restore, ck_disk)
            dropped &= R.drop_caches(allowed)
            row["dcp_cold"] = timed_restore(R, state, want, lambda: dcp.load(state, checkpoint_id=dcp_disk))
            row["dcp_warm"] = timed_restore(R, state, want, lambda: dcp.load(state, checkpoint_id=dcp_disk))
            row["dcp_shm"] = timed_restore(R, state, want, lambda: dcp.load(state, checkpoint_id=dcp_shm))
            my_node = os.path.join(a.shm, "restore", f"node{R.rank // R.per_node}")
            row["floor"] = timed_restore(R, state, want, lambda my_node=my_node: floor_restore(state, my_node, 1))
            if set(row["ram"]["sources"]) != {"ram"}:
                raise AssertionError(f"RAM restore came from {row['ram']['sources']}")
            if "ram+peer" not in row["peer"]["sources"]:
                raise AssertionError(f"peer restore came from {row['peer']['sources']}")
            rounds.append(row)
    finally:
        ck_ram.close()
        ck_disk.close()
    R.barrier()
    if R.rank == 0:
        shutil.rmtree(os.path.join(a.shm, "restore"), ignore_errors=True)
        shutil.rmtree(dcp_shm, ignore_errors=True)
    keys = list(rounds[0])
    med = {k: median([rw[k]["s"] for rw in rounds]) for k in keys}
    ratio = {}
    for comp, ours in (
        ("dcp_cold", "ram"),
        ("dcp_warm", "ram"),
        ("dcp_shm", "ram"),
        ("dcp_cold", "peer"),
        ("dcp_warm", "peer"),
        ("dcp_cold", "disk_cold"),
        ("dcp_warm", "disk_warm"),
        ("dcp_warm", "floor"),
        ("dcp_cold", "floor"),
    ):
        ratio[f"{comp}/{ours}"] = median([rw[comp]["s"] / rw[ours]["s"] for rw in rounds])
    breakdown = {
        k: {p: median([rw[k][p] for rw in rounds]) for p in ("plan_s", "read_s", "load_s", "fetch_s")}
        for k in ("ram", "peer", "disk_cold", "disk_warm")
    }
    spread = {k: (min(rw[k]["s"] for rw in rounds), max(rw[k]["s"] for rw in rounds)) for k in keys}
    return {
        "state_bytes": nbytes_of(state),
        "tensors": len(state),
        "drop_caches": allowed and dropped,
        "disk_read_cold": disk_read,
        "trim": _TRIM,
        "spread": spread,
        "first": {k: rounds[0][k]["s"] for k in keys},
        "save_s": {"ftkit_ram_peer_disk": save_ftkit, "dcp_disk": save_dcp},
        "rounds": rounds,
        "median": med,
        "ratio": ratio,
        "breakdown": breakdown,
        "peer_sources": rounds[0]["peer"]["sources"],
    }


# ------------------------------------------------------------- phase 2
def rank_events(ck, event: str, step: int | None = None) -> list[dict[str, Any]]:
    """This rank's events of one kind (and step) from a Checkpointer's event log (its run_dir)."""
    with open(ck.events.path) as f:
        docs = [json.loads(line) for line in f if line.strip()]
    return [d for d in docs if d["event"] == event and (step is None or d.get("step") == step)]


def phase_replication(a: argparse.Namespace, R: Ranks, state) -> dict[str, Any]:
    import torch

    import ftkit
    from ftkit.save.sharding import plan_pieces
    from ftkit.tiers.peers import replica_targets, replication_plan

    dist = R.dist
    named = list(state.items())
    share = [
        sum(src.numel() * src.element_size() for _, src in plan_pieces(named, r, R.world)) for r in range(R.world)
    ]  # each rank's data file is exactly its share (raw codec)
    nodes = [f"node{r // R.per_node}" for r in range(R.world)]
    target = {r: replica_targets(r, nodes, 1)[0] for r in range(R.world)}
    source = {t: r for r, t in target.items()}
    plan = replication_plan([f"f{r}" for r in range(R.world)], nodes, 1)

    os.environ["FTKIT_JOB_ID"] = "repl-ram"
    ck_a = quiet_checkpointer(state, [ftkit.Tier("ram", keep=1)], rng=False)
    os.environ["FTKIT_JOB_ID"] = "repl-peer"
    # Its event log says when each rank's replication ran and how long it spent reading and storing.
    events_dir = os.path.join(a.base, f"repl-events-{R.rank}")
    ck_b = quiet_checkpointer(state, [ftkit.Tier("ram", keep=1, replicas=1)], rng=False, run_dir=events_dir)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=600))
    out_buf = torch.ones(share[R.rank], dtype=torch.uint8)
    in_buf = torch.zeros(share[source[R.rank]], dtype=torch.uint8)
    in_seq = {t.src: torch.zeros(share[t.src], dtype=torch.uint8) for t in plan if t.dst == R.rank}

    def snap(ck, step: int) -> float:
        R.barrier()
        t0 = now()
        ck.snapshot(step)
        ck.wait()
        return now() - t0

    def raw_plan_order() -> tuple[float, float]:
        R.barrier()
        t0 = now()
        for t in plan:
            if t.src == R.rank:
                dist.send(out_buf, t.dst, group=group)
            elif t.dst == R.rank:
                dist.recv(in_seq[t.src], t.src, group=group)
        return t0, now()

    # The floor of any replication that keeps the replica in node RAM, checksummed: the raw
    # transfer, then the receiver writes it over an existing tmpfs file's pages (the cheapest
    # store there is, see the RAM tier's spare files) and hashes it. No ftkit code.
    floor_path = os.path.join(a.shm, f"floor-replica-{R.rank}")
    floor_fd = os.open(floor_path, os.O_RDWR | os.O_CREAT, 0o600)
    in_mv = memoryview(in_buf.numpy())

    def raw_concurrent(store_and_check: bool = False) -> tuple[float, float]:
        import xxhash

        R.barrier()
        t0 = now()
        reqs = [dist.isend(out_buf, target[R.rank], group=group), dist.irecv(in_buf, source[R.rank], group=group)]
        for q in reqs:
            q.wait()
        if store_and_check:
            os.pwrite(floor_fd, in_mv, 0)
            xxhash.xxh3_64_hexdigest(in_mv)
        return t0, now()

    def window(pairs: list[tuple[float, float]]) -> float:
        return max(e for _, e in pairs) - min(s for s, _ in pairs)

    R.log("replication: warm-up (staging slots, peer group, sockets)")
    snap(ck_a, 1)
    snap(ck_b, 1)
    raw_concurrent()
    raw_plan_order()
    raw_concurrent(store_and_check=True)  # also gives the floor file its pages
    rounds = []
    try:
        for i in range(a.rounds):
            R.log(f"replication round {i + 1}/{a.rounds}")
            step = i + 2
            ta = snap(ck_a, step)
            tb = snap(ck_b, step)
            run = next((e["replicate"] for e in rank_events(ck_b, "persist", step) if "replicate" in e), None)
            rc = raw_concurrent()
            rp = raw_plan_order()
            rf = raw_concurrent(store_and_check=True)
            per = R.gather({"ta": ta, "tb": tb, "run": run, "rc": rc, "rp": rp, "rf": rf})
            if any(p["run"] is None for p in per):
                raise AssertionError("a rank did not replicate (no replicate record in its persist event)")
            rounds.append(
                {
                    "ram_only_s": max(p["ta"] for p in per),
                    "ram_peer_s": max(p["tb"] for p in per),
                    "run_window_s": window([(p["run"]["start"], p["run"]["end"]) for p in per]),
                    "run_read_s": max(p["run"]["read_s"] for p in per),
                    "run_write_s": max(p["run"]["write_s"] for p in per),
                    "raw_concurrent_s": window([p["rc"] for p in per]),
                    "raw_plan_order_s": window([p["rp"] for p in per]),
                    "floor_s": window([p["rf"] for p in per]),
                }
            )
            rounds[-1]["peer_delta_s"] = max(rounds[-1]["ram_peer_s"] - rounds[-1]["ram_only_s"], 1e-9)
        if ck_b.stats.failed or ck_a.stats.failed:
            raise AssertionError("a persist failed during the replication phase")
    finally:
        ck_a.close()
        ck_b.close()
        dist.destroy_process_group(group)
        os.close(floor_fd)
        os.remove(floor_path)
        shutil.rmtree(events_dir, ignore_errors=True)
    R.barrier()
    if R.rank == 0:
        for job in ("repl-ram", "repl-peer"):
            shutil.rmtree(os.path.join(a.shm, job), ignore_errors=True)
    med = {k: median([rw[k] for rw in rounds]) for k in rounds[0]}
    ratio = {
        "delta": median([rw["raw_concurrent_s"] / rw["peer_delta_s"] for rw in rounds]),
        "run": median([rw["raw_concurrent_s"] / rw["run_window_s"] for rw in rounds]),
        "raw_plan_order": median([rw["raw_concurrent_s"] / rw["raw_plan_order_s"] for rw in rounds]),
        "floor": median([rw["raw_concurrent_s"] / rw["floor_s"] for rw in rounds]),
    }
    return {
        "replicated_bytes": sum(share),
        "share_bytes": share,
        "pairs": ", ".join(f"{r}->{target[r]}" for r in range(R.world)),
        "rounds": rounds,
        "median": med,
        "ratio": ratio,
    }


# ------------------------------------------------------------- phase 3
def build_model(kind: str, a: argparse.Namespace, rank: int):
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    if kind == "TinyGPT":
        from ftkit.drill.reference import build, train_step

        model, opt, sched = build(1234)
        ddp = DDP(model)
        state = {"model": ddp, "optim": opt, "sched": sched}
        return ddp, opt, state, (lambda step: train_step(ddp, opt, sched, step, seed=1234 + rank))
    d = a.mlp_dim
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(d // 2, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d // 2))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = {"model": ddp, "optim": opt}

    def step_fn(step: int) -> float:
        g = torch.Generator().manual_seed(step * 97 + rank)
        x = torch.randn(a.mlp_batch, d // 2, generator=g)
        y = torch.randn(a.mlp_batch, d // 2, generator=g)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    return ddp, opt, state, step_fn


def phase_train(a: argparse.Namespace, R: Ranks, kind: str) -> dict[str, Any]:
    """Three identical DDP models' worth of steps, in alternating blocks of `--steps`:

    base:     a plain DDP model and optimizer that ftkit never saw;
    attached: a twin DDP model under a Checkpointer (ftkit's DDP comm hook, optimizer
              pre-hook and watchdog thread are installed), no snapshot taken;
    snapshot: the twin, with ck.snapshot(step) after every optimizer step.

    The Checkpointer cannot be detached from a model, hence the twin for the baseline.
    """
    import ftkit
    from ftkit.save import capture as cap

    base_model, _, _, base_fn = build_model(kind, a, R.rank)
    model, opt, state, step_fn = build_model(kind, a, R.rank)
    params = sum(p.numel() for p in model.parameters())
    os.environ["FTKIT_JOB_ID"] = f"train-{kind}"
    # Defaults, plus an event log: each background persist's wall and CPU time come from it.
    events_dir = os.path.join(a.base, f"train-events-{kind}-{R.rank}")
    ck = ftkit.Checkpointer(state, [ftkit.Tier("ram", replicas=1)], policy="wait", run_dir=events_dir)
    step = 0
    times: dict[str, list[float]] = {"base": [], "attached": [], "snapshot": [], "every": []}
    stalls: list[float] = []
    cpu = {"base": 0.0, "attached": 0.0, "snapshot": 0.0, "every": 0.0}
    try:
        R.log(f"train {kind}: warm-up")
        for _ in range(3):
            step += 1
            base_fn(step)
            step_fn(step)
        for _ in range(3):
            step += 1
            step_fn(step)
            ck.snapshot(step)
        ck.wait()
        state_bytes = nbytes_of(dict(cap.capture(state, rng=False).tensors))
        warm_step = step  # the persists timed are those of later steps
        for i in range(a.rounds):
            R.log(f"train {kind}: round {i + 1}/{a.rounds}")
            for block in ("base", "attached", "snapshot", "every"):
                R.barrier()
                c0 = time.process_time()  # every thread of this rank: the training loop's and ftkit's
                for j in range(a.steps):
                    step += 1
                    t0 = now()
                    if block == "base":
                        base_fn(step)
                    else:
                        step_fn(step)
                    if block == "snapshot" or (block == "every" and j == 0):
                        ck.snapshot(step)  # "every": one snapshot per block, persisted during its other steps
                    if block == "snapshot":
                        stalls.append(ck.stats.last_stall_s)
                    times[block].append(now() - t0)
                ck.wait()  # a block's tail persist does not spill into the next block
                cpu[block] += time.process_time() - c0
        failed = ck.stats.failed
        R.barrier()
        floor_cpu = coord_floor_cpu(a, R, kind, base_fn, step + 1)
        R.barrier()
        floor_waits_cpu = coord_floor_cpu(a, R, kind, base_fn, step + 1 + 2 * a.steps, waits=True)
        step += 4 * a.steps
    finally:
        ck.close()
    R.barrier()
    if R.rank == 0:
        shutil.rmtree(os.path.join(a.shm, f"train-{kind}"), ignore_errors=True)
    jobs = [(e["seconds"], e["cpu_s"]) for e in rank_events(ck, "persist_job") if e["step"] > warm_step]
    # The RAM tier's commit coordination: its persist's CPU but writing the file and moving replicas.
    coord = [
        e["cpu_s"] - e["write_cpu_s"] - e.get("replicate_cpu_s", 0.0)
        for e in rank_events(ck, "persist")
        if e["step"] > warm_step and "write_cpu_s" in e and "cpu_s" in e
    ]
    shutil.rmtree(events_dir, ignore_errors=True)
    n_steps = a.rounds * a.steps
    per = R.gather(
        {
            **times,
            "stall": stalls,
            "failed": failed,
            "cpu": {k: v / n_steps for k, v in cpu.items()},
            "job_wall": median([j[0] for j in jobs]),
            "job_cpu": median([j[1] for j in jobs]),
            "coord_cpu": median(coord) if coord else None,
            "floor_cpu": floor_cpu,
            "floor_waits_cpu": floor_waits_cpu,
        }
    )
    if any(p["failed"] for p in per):
        raise AssertionError(f"{kind}: background persists failed")

    def per_step_max(key: str) -> list[float]:
        return [max(vals) for vals in zip(*(p[key] for p in per))]

    def p90(xs: list[float]) -> float:
        return sorted(xs)[int(0.9 * (len(xs) - 1))]

    b, at, f, s, ev = (per_step_max(k) for k in ("base", "attached", "snapshot", "stall", "every"))
    bm, am, fm, sm = median(b), median(at), median(f), median(s)
    # One snapshot per block: a median would hide it, so this one compares means.
    every_slowdown = statistics.fmean(ev) / statistics.fmean(b) - 1
    return {
        "params": params,
        "state_bytes": state_bytes,
        "steps": len(b),
        "base_s": bm,
        "attached_s": am,
        "ftkit_s": fm,
        "stall_s": sm,
        "slowdown": fm / bm - 1,
        "attached_slowdown": am / bm - 1,
        "every_n": a.steps,
        "every_slowdown": every_slowdown,
        "cpu_per_step_s": {k: [p["cpu"][k] for p in per] for k in cpu},
        "contention": (fm - sm - am) / bm,
        "base_p90_s": p90(b),
        "ftkit_p90_s": p90(f),
        "persist_wall_s": [p["job_wall"] for p in per],
        "persist_cpu_s": [p["job_cpu"] for p in per],
        "coord_cpu_s": [p["coord_cpu"] for p in per],
        "coord_floor_cpu_s": [p["floor_cpu"] for p in per],
        "coord_floor_waits_cpu_s": [p["floor_waits_cpu"] for p in per],
        "base_all_s": b,
        "attached_all_s": at,
        "ftkit_all_s": f,
        "stall_all_s": s,
    }


def coord_floor_cpu(
    a: argparse.Namespace, R: Ranks, kind: str, train_step, first_step: int, waits: bool = False
) -> float:
    """The floor under this rank's RAM-tier commit coordination (coord_floor.py): its share of
    the files, store requests and messages of one snapshot, on the payloads of the newest step;
    `waits`: with the commit's handshakes, each message waited for (coord_floor.HandshakeFloor)."""
    import glob

    from coord_floor import Floor, HandshakeFloor, measure
    from torch.distributed import distributed_c10d

    from ftkit.commit.messages import CODECS, Exchange, Outcome, PartEntry, Record, Report
    from ftkit.format.part import decode_part

    node = R.rank // R.per_node
    ranks = range(node * R.per_node, (node + 1) * R.per_node)
    indexes = sorted(glob.glob(os.path.join(a.shm, f"train-{kind}", "*", "step-*", "manifest.json")))
    index = open(indexes[-1], "rb").read()  # noqa: SIM115 (read whole)
    step_dir = os.path.dirname(indexes[-1])
    mine = [p for p in json.loads(index)["parts"] if p["ranks"][0][0] == node * R.per_node][0]
    part = open(os.path.join(step_dir, mine["file"]), "rb").read()  # noqa: SIM115
    doc = decode_part(part, mine["file"])
    reports = {}
    for r in ranks:
        (file,) = [f for f, info in doc["files"].items() if info["rank"] == r]
        chunks = [c for t in doc["tensors"] for s in t["shards"] if s["rank"] == r for c in s["chunks"]]
        values = [tuple(c[k] for c in chunks) for k in ("offset", "length")]
        codecs = tuple(CODECS.index(c["codec"]) for c in chunks)
        state = json.dumps(doc["rank_state"].get(str(r), {}), separators=(",", ":"))
        sums = tuple(c["checksum"] for c in chunks)
        reports[r] = Report(file, doc["files"][file]["bytes"], "0" * 40, *values, codecs, sums, state).encode()
    files = {f: i["bytes"] for f, i in doc["files"].items()}
    payloads = {  # the messages as the commit encodes them (commit/messages.py)
        "report": reports[ranks[-1]],
        "outcome": Outcome().encode(),
        "part": part,
        "record": Exchange(reports, (mine["file"], mine["checksum"])).encode(),
        "node_record": Record(PartEntry.of(mine), files, sum(files.values())).encode(),
        "index": index,
    }
    kind_of_floor = HandshakeFloor if waits else Floor
    floor = kind_of_floor(R.rank, R.world, R.per_node, a.shm, distributed_c10d._get_default_store(), payloads)
    floor.prepare()
    R.barrier()
    return measure(floor, train_step, 2 * a.steps, first_step)


def fs_description(path: str) -> str:
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True, check=True).stdout
        dev, kind = out.strip().splitlines()[-1].split()[:2]
        return f"{kind} on {dev} ({path})"
    except (OSError, subprocess.CalledProcessError, ValueError):
        return path


def worker(a: argparse.Namespace) -> int:
    import resource

    import torch
    import torch.distributed as dist

    logging.basicConfig(
        level=logging.WARNING, format=f"%(levelname)s rank {os.environ.get('RANK')} %(name)s: %(message)s"
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    R = Ranks()
    global _TRIM
    _TRIM = not a.no_trim
    phases = set(a.phases.split(","))
    res: dict[str, Any] = {
        "config": {
            "world": R.world,
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "mib": a.mib,
            "tensors": a.tensors,
            "repeats": a.repeats,
            "rounds": a.rounds,
            "steps": a.steps,
            "disk_fs": fs_description(a.base),
            "launcher": "torchrun --standalone",
        }
    }
    if phases & {"restore", "replication"}:
        R.log(f"making the state: {a.mib:g} MiB in {a.tensors} tensors on every rank")
        state = make_state(a.mib, a.tensors)
        if "restore" in phases:
            res["restore"] = phase_restore(a, R, state)
        if "replication" in phases:
            res["replication"] = phase_replication(a, R, state)
        del state
    if "train" in phases:
        res["train"] = {}
        kinds = ["TinyGPT"] + ([f"MLP-{a.mlp_dim}"] if a.mlp_dim else [])
        for kind in kinds:
            res["train"][kind] = phase_train(a, R, kind)
    rss = R.gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    res["config"]["peak_rss_mib"] = max(rss)
    if R.rank == 0:
        with open(a.out, "w") as f:
            json.dump(res, f)
    R.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())

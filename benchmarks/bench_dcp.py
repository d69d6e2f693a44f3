"""DCP through ftkit's storage beside DCP's own writers, from one run on one state.

The same state (float32 tensors) saved by `dcp.async_save` and read by `dcp.load` through
three storages on the same directory's disk (and, for the RAM-speed column, /dev/shm):

* ftkit: `FtkitStorageWriter` / `FtkitStorageReader` (checksummed chunks, manifest last,
  every chunk verified on load);
* DCP's `FileSystemWriter` / `FileSystemReader` (its default, fsync on);
* DCP's `FsspecWriter` / `FsspecReader` on a ``file://`` URL.

Per save: the stall (until `async_save` returns: DCP's staging copy into new CPU tensors
and its planning, the same code for all three), the time to durable (until its future is done: the files written and
synced and the metadata / manifest committed) and the bytes on disk. Per load: `dcp.load`
into the live state dict, warm page cache. Floors of the same bytes with no DCP or ftkit
code: the copy (`copy_` into a reused buffer: the least a stall can be) and the write (one
file, written and fsynced: the least a durable save can be). Rounds are paired, each
contender once per round in rotating order; medians of per-round ratios to DCP's
FileSystemWriter.

Targets: ftkit's stall, time to durable and load within 1.25x / 1.5x / 1.5x of
FileSystemWriter's (what ftkit adds: checksums, a manifest, a verified read).

    .venv/bin/python benchmarks/bench_dcp.py [--mib 512] [--rounds 5] [--dir PATH] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from common import median, now, progress, rmtree
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from ftkit.dcp import FtkitStorageReader, FtkitStorageWriter

TARGETS = {"stall": 1.25, "durable": 1.5, "load": 1.5}
State = dict[str, Any]


def make_state(mib: float, n: int) -> State:
    per = int(mib * 2**20 / 4 / n)
    g = torch.Generator().manual_seed(0)
    return {"model": {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n)}, "step": 1}


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def floor_write(state: State, path: str) -> float:
    """The same bytes in one file, written and fsynced: no format, no planning."""
    t0 = now()
    with open(path, "wb") as f:
        for t in state["model"].values():
            f.write(memoryview(t.numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(os.path.dirname(path))
    return now() - t0


def floor_copy(state: State, into: list[torch.Tensor]) -> float:
    t0 = now()
    for dst, src in zip(into, state["model"].values(), strict=True):
        dst.copy_(src)
    return now() - t0


class Contender:
    """One storage: how to make its writer and reader for save number `i` under `root`."""

    def __init__(self, name: str, writer: Callable[[str, int], Any], reader: Callable[[str, int], Any], ckid):
        self.name, self.writer, self.reader, self.ckid = name, writer, reader, ckid

    def save(self, state: State, root: str, i: int) -> tuple[float, float]:
        writer = self.writer(root, i)  # (made once and reused by a trainer: not timed)
        t0 = now()
        fut = dcp.async_save(state, storage_writer=writer, checkpoint_id=self.ckid(root, i), no_dist=True)
        t1 = now()
        fut.result()
        return t1 - t0, now() - t0

    def load(self, state: State, root: str, i: int) -> float:
        reader = self.reader(root, i)
        t0 = now()
        dcp.load(state, storage_reader=reader, checkpoint_id=self.ckid(root, i), no_dist=True)
        return now() - t0


def contenders() -> list[Contender]:
    def path(root: str, i: int) -> str:
        return os.path.join(root, f"step-{i}")

    return [
        Contender(
            "ftkit",
            lambda root, i: FtkitStorageWriter([{"url": root, "keep": 1}]),
            lambda root, i: FtkitStorageReader([root]),
            lambda root, i: i,
        ),
        Contender(
            "FileSystemWriter",
            lambda root, i: dcp.FileSystemWriter(path(root, i)),
            lambda root, i: dcp.FileSystemReader(path(root, i)),
            path,
        ),
        Contender(
            "FsspecWriter",
            lambda root, i: FsspecWriter("file://" + path(root, i)),
            lambda root, i: FsspecReader("file://" + path(root, i)),
            lambda root, i: "file://" + path(root, i),
        ),
    ]


def run(base: str, state: State, rounds: int, label: str) -> dict[str, Any]:
    nbytes = sum(t.numel() * 4 for t in state["model"].values())
    into = [torch.empty_like(t) for t in state["model"].values()]
    floor_copy(state, into)  # (first touch of the buffer out of the floor)
    people = contenders()
    got: dict[str, dict[str, list[float]]] = {c.name: {"stall": [], "durable": [], "load": []} for c in people}
    floors: dict[str, list[float]] = {"copy": [], "write": []}
    disk: dict[str, int] = {}
    for r in range(1, rounds + 1):
        progress(f"{label}: round {r}/{rounds}")
        floors["copy"].append(floor_copy(state, into))
        raw = os.path.join(base, "raw.bin")
        floors["write"].append(floor_write(state, raw))
        os.unlink(raw)
        order = people[r % len(people) :] + people[: r % len(people)]
        for c in order:
            root = os.path.join(base, c.name)
            os.makedirs(root, exist_ok=True)
            stall, durable = c.save(state, root, r)
            got[c.name]["stall"].append(stall)
            got[c.name]["durable"].append(durable)
            disk[c.name] = du(root)
            target = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}, "step": 0}
            got[c.name]["load"].append(c.load(target, root, r))
            if not all(torch.equal(target["model"][k], v) for k, v in state["model"].items()) or target["step"] != 1:
                raise SystemExit(f"{c.name}: dcp.load did not give back the state saved")
            rmtree(root)
    base_name = "FileSystemWriter"
    out: dict[str, Any] = {"label": label, "bytes": nbytes, "floor_copy_s": median(floors["copy"])}
    out["floor_write_s"] = median(floors["write"])
    for c in people:
        row = {k: median(v) for k, v in got[c.name].items()}
        row["disk_bytes"] = disk[c.name]
        for k in ("stall", "durable", "load"):
            row[f"{k}_over_fs"] = median([a / b for a, b in zip(got[c.name][k], got[base_name][k], strict=True)])
        out[c.name] = row
    return out


def report(res: dict[str, Any]) -> list[tuple[str, bool]]:
    nb = res["bytes"]
    gbs = nb / 2**30
    print(f"\n{res['label']}: {nb / 2**20:.0f} MiB of float32, dcp.async_save then dcp.load (medians)")
    copy, write = res["floor_copy_s"], res["floor_write_s"]
    print(f"  floors (no DCP, no ftkit): copy {copy * 1e3:.1f} ms ({gbs / copy:.2f} GiB/s), ", end="")
    print(f"write + fsync {write * 1e3:.1f} ms ({gbs / write:.2f} GiB/s)")
    head = f"{'stall ms':>10}{'x FS':>7}{'durable ms':>12}{'x FS':>7}{'load ms':>10}{'x FS':>7}{'on disk':>12}"
    print(f"  {'storage':<18}{head}")
    for name in ("ftkit", "FileSystemWriter", "FsspecWriter"):
        r = res[name]
        print(
            f"  {name:<18}{r['stall'] * 1e3:>10.1f}{r['stall_over_fs']:>7.2f}{r['durable'] * 1e3:>12.1f}"
            f"{r['durable_over_fs']:>7.2f}{r['load'] * 1e3:>10.1f}{r['load_over_fs']:>7.2f}{r['disk_bytes']:>12,}"
        )
    verdicts = []
    for k, limit in TARGETS.items():
        ratio = res["ftkit"][f"{k}_over_fs"]
        ok = ratio <= limit
        verdicts.append((f"{res['label']} {k}", ok))
        print(f"  {'PASS' if ok else 'MISS'}: ftkit {k} {ratio:.2f}x FileSystemWriter's (target <= {limit}x)")
    return verdicts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=float, default=512.0)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", help="the disk to write to (default: a temporary directory under the working directory)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)
    state = make_state(args.mib, args.tensors)
    print(f"load average {os.getloadavg()[0]:.2f}; torch {torch.__version__}", flush=True)
    results, verdicts = [], []
    places = [("disk", args.dir or os.getcwd()), ("/dev/shm", "/dev/shm")]
    for label, where in places:
        if not os.path.isdir(where):
            continue
        base = tempfile.mkdtemp(prefix="ftkit-bench-dcp-", dir=where)
        try:
            res = run(base, state, args.rounds, label)
        finally:
            rmtree(base)
        results.append(res)
        verdicts += report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "targets": TARGETS}, f, indent=1)
    return 0 if all(ok for _, ok in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())

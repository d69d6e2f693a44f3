#!/usr/bin/env python3
"""Core benchmark: ftkit beside torch.save, DCP and raw I/O, from one run on one state.

Run (from the repo root)::

    .venv/bin/python benchmarks/bench_core.py                  # 2 GiB fp32 state, temp dir in /tmp
    .venv/bin/python benchmarks/bench_core.py --gib 0.25       # quick
    .venv/bin/python benchmarks/bench_core.py --dir /mnt/nvme --json out.json
    .venv/bin/python benchmarks/bench_core.py --s3 --s3-gib 0.5   # adds a local SeaweedFS S3 server

The state is `--tensors` fp32 randn tensors on CPU totalling `--gib` GiB. It
measures, on that state and in one directory:

1. copy into reused, pre-touched buffers (the stall's floor, best of 3) and `clone()`;
2. ftkit `snapshot()` stall: first call, steady (background idle), and with the
   background still persisting (a slot free; no slot free under policy wait / skip);
3. `torch.save` + fsync;  4. DCP `save`, DCP `async_save` (first, steady);
5. raw sequential write + fsync of the same bytes;
6. ftkit persist throughput (snapshot() return -> wait() return), raw and zstd;
7. restore: ftkit `restore()` vs DCP `load` vs `torch.load`, cold (page cache
   dropped, when /proc/sys/vm/drop_caches is writable) and warm;
8. with --s3: ftkit persist to s3:// vs raw s3fs puts vs DCP FsspecWriter.

Small VMs are noisy (copy and disk speed vary 2-5x from one second to the next),
so figures that are compared are measured in *rounds*: each round runs every
contender once, back to back, and a target's ratio is the median of the per-round
ratios ("paired"). Figures are medians over the steady rounds, except the floor
(best of 3 copies in each round), clone (best of 3), torch.save and DCP save
(best of 2); "first" figures are each contender's first call. Our persist time
includes retention (the tier keeps 1 step, so the previous one is deleted, as
the raw writer deletes its previous file outside its timing); "until commit"
shows it without. Throughputs are decimal GB/s (1e9 bytes). The load average is
printed: figures taken while other work runs are not worth much. Everything
written goes under one temp dir, removed at the end. Exit status 1 if a target
is missed.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from common import can_drop_caches, drop_caches, median, now, peak_rss_gib, progress, rmtree, timed

import ftkit
from ftkit.config import Tier
from ftkit.format.reader import newest_manifest

REPO = Path(__file__).resolve().parent.parent
State = dict[str, torch.Tensor]


# ------------------------------------------------------------------ helpers


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else math.inf


def make_state(gib: float, n: int, seed: int = 0) -> State:
    g = torch.Generator().manual_seed(seed)
    per = max(1, int(gib * 2**30 / n / 4))
    return {f"p{i:03d}": torch.randn(per, generator=g) for i in range(n)}


def state_bytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def same(a: State, b: State) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def raw_views(state: State) -> list[memoryview]:
    return [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in state.values()]


def free() -> None:
    gc.collect()


def settle(seconds: float = 1.0) -> None:
    """Flush dirty pages and let the kernel's deferred I/O work (journal, discards) run out."""
    os.sync()
    time.sleep(seconds)


def fs_description(path: str) -> str:
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True, check=True).stdout
        dev, kind = out.strip().splitlines()[-1].split()[:2]
        return f"{kind} on {dev}"
    except (OSError, subprocess.CalledProcessError, ValueError):
        return "unknown filesystem"


# ------------------------------------------------------------ the results
@dataclass
class Row:
    what: str
    ours: str = ""
    peer: str = ""
    ratio: str = ""


@dataclass
class Results:
    figures: dict[str, Any] = field(default_factory=dict)
    sections: list[tuple[str, list[Row]]] = field(default_factory=list)
    targets: list[tuple[str, bool, str]] = field(default_factory=list)

    def section(self, title: str) -> list[Row]:
        rows: list[Row] = []
        self.sections.append((title, rows))
        return rows

    def target(self, what: str, ok: bool, detail: str) -> None:
        self.targets.append((what, ok, detail))

    def print(self) -> None:
        widths = (46, 24, 30, 30)
        rule = "-" * (sum(widths) + 3 * (len(widths) - 1))
        for title, rows in self.sections:
            print(f"\n{title}\n{rule}")
            print(" | ".join(h.ljust(w) for h, w in zip(("what", "ours", "competitor", "ratio"), widths)))
            print(rule)
            for r in rows:
                print(" | ".join(c.ljust(w) for c, w in zip((r.what, r.ours, r.peer, r.ratio), widths)).rstrip())
        print(f"\ntargets\n{rule}")
        for what, ok, detail in self.targets:
            print(f"  {'PASS' if ok else 'MISS'}  {what}: {detail}")

    def to_json(self) -> dict[str, Any]:
        return {"figures": self.figures, "targets": [{"what": w, "pass": ok, "detail": d} for w, ok, d in self.targets]}


def fmt_t(seconds: float, nbytes: int | None = None) -> str:
    s = f"{seconds * 1e3:.1f} ms" if seconds < 0.1 else f"{seconds:.3f} s"
    return f"{s} ({gbps(nbytes, seconds):.2f} GB/s)" if nbytes else s


def rate(nbytes: int, seconds: float) -> str:
    r = gbps(nbytes, seconds)
    return f"{r * 1e3:.0f} MB/s" if r < 1 else f"{r:.2f} GB/s"


def fmt_rate(nbytes: int, seconds: float) -> str:
    return f"{rate(nbytes, seconds)} ({seconds:.2f} s)"


# ------------------------------------------------------- the contenders
def copy_floor(src: State, dst: State, reps: int = 3) -> list[float]:
    """`reps` copies into reused, pre-touched buffers: the best is what a stall cannot beat."""

    def copy() -> None:
        with torch.no_grad():
            for k, v in src.items():
                dst[k].copy_(v)

    return [timed(copy) for _ in range(reps)]


def clone_fresh(src: State, reps: int = 3) -> float:
    """Best-of-`reps` copy into fresh memory (first-touch page faults included)."""
    best = math.inf
    for _ in range(reps):
        t0 = now()
        c = {k: v.clone() for k, v in src.items()}
        best = min(best, now() - t0)
        del c
        free()
    return best


def ours_snapshot(ck: ftkit.Checkpointer, step: int) -> tuple[float, float, float]:
    """(stall, commit, persist) of one snapshot.

    stall: snapshot() time; persist: snapshot() return -> wait() return (all
    background work, retention included); commit: snapshot() return -> the step
    is durable (stats.persisted counts it, before retention runs), by polling.
    """
    persisted = ck.stats.persisted
    t0 = now()
    ck.snapshot(step)
    t1 = now()
    while ck.stats.persisted == persisted and ck.stats.failed == 0:
        time.sleep(0.002)
    t2 = now()
    ck.wait()
    return t1 - t0, t2 - t1, now() - t1


def raw_write(views: list[memoryview], path: str) -> float:
    """Plain sequential writes of the bytes into one new file, then fsync."""
    t0 = now()
    with open(path, "wb", buffering=0) as f:
        for v in views:
            f.write(v)
        os.fsync(f.fileno())
    return now() - t0


def dcp_async(state: State, path: str) -> tuple[float, float]:
    """(blocking, background) of one DCP async_save, waiting on its future."""
    t0 = now()
    fut = dcp.async_save(state, checkpoint_id=path)
    t1 = now()
    getattr(fut, "upload_completion", fut).result()
    return t1 - t0, now() - t1


def torch_save(state: State, path: str) -> float:
    t0 = now()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return now() - t0


# ------------------------------------------------------------ the phases
def phase_rounds(state: State, work: str, rounds: int) -> tuple[dict[str, Any], ftkit.Checkpointer]:
    """Floor copy, our snapshot + persist, raw write, DCP async_save: once per round.

    Round 0 holds every contender's first call; rounds 1.. are steady state. The
    Checkpointer (keep=1, like the raw file, so both write while one older copy
    exists) is returned for the busy-background phase.
    """
    dst = {k: torch.zeros_like(v) for k, v in state.items()}  # zeros: pre-touched
    views = raw_views(state)
    ck = ftkit.Checkpointer(state, tiers=[Tier(os.path.join(work, "ours"), keep=1)], rng=False, policy="wait")
    r: dict[str, list[float]] = {
        k: [] for k in ("floor", "copy", "stall", "commit", "persist", "raw", "dcp_block", "dcp_bg")
    }
    for i in range(rounds + 1):
        progress(f"round {i}/{rounds}")
        settle()  # the previous round's writes and deletes must not slow this round's copies
        copies = copy_floor(state, dst)
        r["floor"].append(min(copies))  # best of 3: the floor
        r["copy"].append(median(copies))  # a typical single copy at this moment
        for k, v in zip(("stall", "commit", "persist"), ours_snapshot(ck, i + 1)):
            r[k].append(v)
        r["raw"].append(raw_write(views, os.path.join(work, f"raw-{i}.bin")))
        if i:
            os.remove(os.path.join(work, f"raw-{i - 1}.bin"))
        block, bg = dcp_async(state, os.path.join(work, f"dcp-async-{i}"))
        rmtree(os.path.join(work, f"dcp-async-{i}"))
        r["dcp_block"].append(block)
        r["dcp_bg"].append(bg)
        free()
    os.remove(os.path.join(work, f"raw-{rounds}.bin"))
    del dst, views
    free()

    steady = {k: v[1:] for k, v in r.items()}
    out: dict[str, Any] = {f"rounds_{k}_s": v for k, v in r.items()}
    out.update(
        {
            "ours_stall_first_s": r["stall"][0],
            "ours_persist_first_s": r["persist"][0],
            "dcp_async_first_s": r["dcp_block"][0],
            "dcp_async_bg_first_s": r["dcp_bg"][0],
            "raw_write_first_s": r["raw"][0],
            **{f"{k}_steady_s": median(v) for k, v in steady.items()},
            "stall_over_floor": median([s / f for s, f in zip(steady["stall"], steady["floor"])]),
            "stall_over_copy": median([s / c for s, c in zip(steady["stall"], steady["copy"])]),
            "dcp_async_over_stall": median([d / s for d, s in zip(steady["dcp_block"], steady["stall"])]),
            "persist_speed_over_raw": median([w / p for w, p in zip(steady["raw"], steady["persist"])]),
            "commit_speed_over_raw": median([w / c for w, c in zip(steady["raw"], steady["commit"])]),
            "persist_speed_over_dcp_bg": median([d / p for d, p in zip(steady["dcp_bg"], steady["persist"])]),
        }
    )
    return out, ck


def phase_busy(ck: ftkit.Checkpointer, first_step: int, reps: int = 3) -> dict[str, Any]:
    """Stalls while the background is still persisting earlier snapshots.

    Each rep, from an idle background: snapshot A, then B at once (the background
    is persisting A; the second slot is free), then C at once (both slots busy:
    policy "wait" blocks until A is persisted, "skip" returns without staging).
    Policy "wait" runs first, so its first B also allocates the second slot;
    that one is reported on its own. The policy is switched on the same
    Checkpointer (a public attribute) so "skip" sees both slots allocated.
    """
    out: dict[str, Any] = {}
    step = first_step
    for policy in ("wait", "skip"):
        ck.policy = policy
        skipped0 = ck.stats.skipped
        with_slot, no_slot = [], []
        for _ in range(reps):
            ck.wait()
            for t in (None, with_slot, no_slot):  # A (idle), B (a slot free), C (none free)
                step += 1
                t0 = now()
                ck.snapshot(step)
                if t is not None:
                    t.append(now() - t0)
        ck.wait()
        if policy == "wait":
            out["busy_second_slot_first_use_s"] = with_slot.pop(0)
        out[f"busy_{policy}_slot_free_s"] = median(with_slot)
        out[f"busy_{policy}_no_slot_s"] = median(no_slot)
        out[f"busy_{policy}_skipped"] = ck.stats.skipped - skipped0
        out[f"busy_{policy}_reps"] = reps
    return out


def phase_blocking_savers(state: State, work: str, reps: int = 2) -> dict[str, Any]:
    """clone(), torch.save + fsync and DCP save; the last files stay for the restore phase."""
    out: dict[str, Any] = {"clone_fresh_s": clone_fresh(state)}
    ts, ds = [], []
    for _ in range(reps):
        ts.append(torch_save(state, os.path.join(work, "state.pt")))
        path = os.path.join(work, "dcp-save")
        rmtree(path)
        ds.append(timed(lambda path=path: dcp.save(state, checkpoint_id=path)))
        free()
    out.update(torch_save_all_s=ts, torch_save_s=min(ts), dcp_save_all_s=ds, dcp_save_s=min(ds))
    return out


def phase_zstd(state: State, work: str, rounds: int = 2) -> dict[str, Any]:
    """Persist with compress="zstd": the fp32 state, then a bf16 copy of it (compressible)."""
    out: dict[str, Any] = {}
    for label in ("fp32", "bf16"):
        s = state if label == "fp32" else {k: v.to(torch.bfloat16) for k, v in state.items()}
        url = os.path.join(work, f"zstd-{label}")
        tier = Tier(url, keep=1, compress="zstd")
        ck = ftkit.Checkpointer(s, tiers=[tier], rng=False)
        views = raw_views(s)
        persist, raw = [], []
        try:
            ours_snapshot(ck, 1)  # warm-up: allocates the slot
            for i in range(rounds):
                persist.append(ours_snapshot(ck, i + 2)[2])
                raw.append(raw_write(views, os.path.join(work, "raw-zstd.bin")))
                os.remove(os.path.join(work, "raw-zstd.bin"))
            m = newest_manifest(tier.open())
        finally:
            ck.close()
        out.update(
            {
                f"zstd_{label}_bytes": state_bytes(s),
                f"zstd_{label}_persist_s": median(persist),
                f"zstd_{label}_raw_write_s": median(raw),
                f"zstd_{label}_ratio": m.total_stored_bytes / m.total_raw_bytes,
                f"zstd_{label}_speed_over_raw": median([w / p for w, p in zip(raw, persist)]),
            }
        )
        rmtree(url)
        del s, views, ck
        free()
    return out


def phase_restore(
    state: State, loaders: dict[str, Callable[[State], None]], reps: int = 2, prefix: str = "restore"
) -> dict[str, Any]:
    """Each loader fills zeroed tensors of the state's shapes; cold (caches dropped) then warm.

    Rounds interleave the loaders, in reverse order every other round (the first load
    after a cache drop also pays for the S3 server's own metadata and the Python files
    it faults back in); figures are medians. Every load is checked against the state.
    """
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    cold = can_drop_caches()
    out: dict[str, Any] = {f"{prefix}_cold_cache": cold}
    for cache in ("cold", "warm") if cold else ("warm",):
        times: dict[str, list[float]] = {name: [] for name in loaders}
        for rep in range(reps):
            for name, load in list(loaders.items())[:: 1 if rep % 2 == 0 else -1]:
                if cache == "warm":
                    load(dest)  # this loader's files are the ones in the cache
                for t in dest.values():
                    t.zero_()
                if cache == "cold":
                    drop_caches()
                times[name].append(timed(lambda load=load: load(dest)))
                if not same(dest, state):
                    raise AssertionError(f"{name} did not restore the state")
                free()
        for name, ts in times.items():
            out[f"{prefix}_{name}_{cache}_s"] = median(ts)
            out[f"{prefix}_{name}_{cache}_all_s"] = ts
    return out


def ours_loader(url: str, storage_options: dict | None = None) -> Callable[[State], None]:
    def load(dest: State) -> None:
        ck = ftkit.Checkpointer(dest, tiers=[Tier(url, storage_options=storage_options or {})], rng=False)
        try:
            if not ck.restore():
                raise AssertionError(f"nothing to restore in {url}")
        finally:
            ck.close()

    return load


def torch_loader(path: str) -> Callable[[State], None]:
    def load(dest: State) -> None:  # what model.load_state_dict(torch.load(path)) costs
        loaded = torch.load(path)
        with torch.no_grad():
            for k, v in loaded.items():
                dest[k].copy_(v)

    return load


# ------------------------------------------------------------------- S3
def phase_s3(args: argparse.Namespace, work: str) -> dict[str, Any]:
    """Ours to s3:// vs raw s3fs puts (sequential, and concurrent fs.pipe) vs DCP FsspecWriter."""
    import s3fs
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from ftkit.drill.s3server import S3Server

    state = make_state(args.s3_gib, args.tensors, seed=1)
    views = raw_views(state)
    out: dict[str, Any] = {"s3_state_bytes": state_bytes(state)}
    with S3Server(data_dir=os.path.join(work, "seaweedfs")) as srv:
        opts = srv.storage_options()
        out["s3_server_start_s"] = srv.startup_seconds
        fs = s3fs.S3FileSystem(**opts)
        ours_url, dcp_url = srv.url("bench/ours"), srv.url("bench/dcp")
        raw_prefix = f"{srv.bucket}/bench/raw"

        def raw_puts() -> None:
            for k, v in zip(state, views):
                fs.pipe_file(f"{raw_prefix}/{k}", bytes(v))

        def dcp_save() -> None:
            dcp.save(state, storage_writer=FsspecWriter(dcp_url, **opts))

        ck = ftkit.Checkpointer(state, tiers=[Tier(ours_url, keep=1, storage_options=opts)], rng=False)
        r: dict[str, list[float]] = {"stall": [], "commit": [], "persist": [], "raw_seq": [], "dcp_save": []}
        try:
            for i in range(args.s3_rounds + 1):
                progress(f"S3 round {i}/{args.s3_rounds}")
                for k, v in zip(("stall", "commit", "persist"), ours_snapshot(ck, i + 1)):
                    r[k].append(v)
                r["raw_seq"].append(timed(raw_puts))
                fs.rm(raw_prefix, recursive=True)
                if fs.exists(dcp_url):  # the last one stays for the restore
                    fs.rm(dcp_url, recursive=True)
                r["dcp_save"].append(timed(dcp_save))
        finally:
            ck.close()
        t0 = now()
        fs.pipe({f"{raw_prefix}c/{k}": bytes(v) for k, v in zip(state, views)})
        out["s3_raw_concurrent_s"] = now() - t0
        fs.rm(f"{raw_prefix}c", recursive=True)
        out.update({f"s3_rounds_{k}_s": v for k, v in r.items()})
        out.update(
            {
                "s3_ours_persist_first_s": r["persist"][0],
                **{f"s3_{k}_steady_s": median(v[1:]) for k, v in r.items()},
                "s3_persist_speed_over_raw_seq": median([w / p for w, p in zip(r["raw_seq"][1:], r["persist"][1:])]),
                "s3_persist_speed_over_dcp": median([d / p for d, p in zip(r["dcp_save"][1:], r["persist"][1:])]),
            }
        )
        progress("S3 restore")

        def dcp_load(dest: State) -> None:
            dcp.load(dest, storage_reader=FsspecReader(dcp_url, **opts))

        out.update(
            phase_restore(
                state, {"ours": ours_loader(ours_url, opts), "dcp_load": dcp_load}, reps=2, prefix="s3_restore"
            )
        )
    return out


# -------------------------------------------------------------- the run
def run(args: argparse.Namespace, work: str) -> dict[str, Any]:
    state = make_state(args.gib, args.tensors)
    f: dict[str, Any] = {
        "state_bytes": state_bytes(state),
        "tensors": len(state),
        "dtype": "float32",
        "dir": work,
        "filesystem": fs_description(work),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "loadavg_start": os.getloadavg(),
    }

    progress("rounds: copy floor, ours snapshot + persist, raw write, DCP async_save")
    rounds, ck = phase_rounds(state, work, args.rounds)
    f.update(rounds)
    progress("ours with a busy background, policy wait then skip")
    try:
        f.update(phase_busy(ck, first_step=args.rounds + 1))
    finally:
        ck.close()
    del ck
    free()
    progress("clone, torch.save, DCP save")
    f.update(phase_blocking_savers(state, work))
    progress("ours zstd")
    f.update(phase_zstd(state, work))
    progress("restore")
    f.update(
        phase_restore(
            state,
            {
                "ours": ours_loader(os.path.join(work, "ours")),
                "dcp_load": lambda dest: dcp.load(dest, checkpoint_id=os.path.join(work, "dcp-save")),
                "torch_load": torch_loader(os.path.join(work, "state.pt")),
            },
        )
    )
    del state
    free()
    if args.s3:
        progress("S3")
        f.update(phase_s3(args, work))
        free()
    f["peak_rss_gib"] = peak_rss_gib()
    f["loadavg_end"] = os.getloadavg()
    return f


def tabulate(f: dict[str, Any]) -> Results:
    res = Results(figures=f)
    n, k = f["state_bytes"], f["rounds"]
    floor, stall, dcp_a = f["floor_steady_s"], f["stall_steady_s"], f["dcp_block_steady_s"]
    raw, persist = f["raw_steady_s"], f["persist_steady_s"]

    rows = res.section(
        f"snapshot stall: {n / 2**30:.2f} GiB in {f['tensors']} fp32 tensors on CPU "
        f"({f['cpu_count']} cores); steady = median of {k} rounds"
    )
    rows += [
        Row(
            "copy into reused buffers (floor, best of 3)",
            fmt_t(floor, n),
            f"range {min(f['rounds_floor_s']):.3f}-{max(f['rounds_floor_s']):.3f} s",
        ),
        Row(
            "copy into fresh buffers (clone, best of 3)",
            "",
            fmt_t(f["clone_fresh_s"], n),
            f"{f['clone_fresh_s'] / floor:.1f}x the floor",
        ),
        Row(
            "snapshot(), first call",
            fmt_t(f["ours_stall_first_s"]),
            "",
            f"{f['ours_stall_first_s'] / floor:.1f}x floor",
        ),
        Row(
            "snapshot(), steady, background idle",
            fmt_t(stall, n),
            f"floor {fmt_t(floor)}",
            f"{f['stall_over_floor']:.2f}x floor (paired)",
        ),
        Row(
            "  vs a single copy (median of the 3)",
            fmt_t(stall),
            fmt_t(f["copy_steady_s"]),
            f"{f['stall_over_copy']:.2f}x (paired)",
        ),
        Row(
            "  bg busy: 2nd slot's first use",
            fmt_t(f["busy_second_slot_first_use_s"]),
            "",
            f"{f['busy_second_slot_first_use_s'] / floor:.1f}x floor",
        ),
        Row(
            "  bg busy: a slot free, policy=wait",
            fmt_t(f["busy_wait_slot_free_s"]),
            "",
            f"{f['busy_wait_slot_free_s'] / floor:.1f}x floor",
        ),
        Row(
            "  bg busy: a slot free, policy=skip",
            fmt_t(f["busy_skip_slot_free_s"]),
            "",
            f"{f['busy_skip_slot_free_s'] / floor:.1f}x floor",
        ),
        Row("  bg busy: no slot free, policy=wait", fmt_t(f["busy_wait_no_slot_s"]), "", "blocks until a persist ends"),
        Row(
            "  bg busy: no slot free, policy=skip",
            fmt_t(f["busy_skip_no_slot_s"]),
            "",
            f"skipped {f['busy_skip_skipped']} of {f['busy_skip_reps']}",
        ),
        Row(
            "torch.save + fsync (blocking)",
            fmt_t(stall),
            fmt_t(f["torch_save_s"], n),
            f"{f['torch_save_s'] / stall:.1f}x ours",
        ),
        Row("DCP save (blocking)", fmt_t(stall), fmt_t(f["dcp_save_s"], n), f"{f['dcp_save_s'] / stall:.1f}x ours"),
        Row(
            "DCP async_save blocking, 1st call",
            fmt_t(f["ours_stall_first_s"]),
            fmt_t(f["dcp_async_first_s"]),
            f"{f['dcp_async_first_s'] / f['ours_stall_first_s']:.2f}x ours 1st",
        ),
        Row(
            "DCP async_save blocking, steady",
            fmt_t(stall),
            fmt_t(dcp_a),
            f"{f['dcp_async_over_stall']:.2f}x ours (paired)",
        ),
    ]

    rows = res.section("persist to the local directory (same bytes; steady = median of rounds)")
    rows += [
        Row(
            "raw write + fsync",
            "",
            fmt_rate(n, raw),
            f"range {rate(n, max(f['rounds_raw_s']))} - {rate(n, min(f['rounds_raw_s']))}",
        ),
        Row(
            "ours persist, first",
            fmt_rate(n, f["ours_persist_first_s"]),
            fmt_rate(n, f["raw_write_first_s"]),
            f"{f['raw_write_first_s'] / f['ours_persist_first_s']:.2f}x raw's speed",
        ),
        Row(
            "ours persist, steady vs raw write",
            fmt_rate(n, persist),
            fmt_rate(n, raw),
            f"{f['persist_speed_over_raw']:.2f}x raw's speed (paired)",
        ),
        Row(
            "  ours until commit (before retention)",
            fmt_rate(n, f["commit_steady_s"]),
            fmt_rate(n, raw),
            f"{f['commit_speed_over_raw']:.2f}x raw's speed (paired)",
        ),
        Row(
            "ours persist vs DCP async_save background",
            fmt_rate(n, persist),
            fmt_rate(n, f["dcp_bg_steady_s"]),
            f"{f['persist_speed_over_dcp_bg']:.2f}x DCP's speed (paired)",
        ),
        Row(
            "ours persist vs torch.save + fsync",
            fmt_rate(n, persist),
            fmt_rate(n, f["torch_save_s"]),
            f"{f['torch_save_s'] / persist:.2f}x torch's speed",
        ),
    ]
    for label in ("fp32", "bf16"):
        m = f[f"zstd_{label}_bytes"]
        rows.append(
            Row(
                f"ours zstd, {label} (stored/raw {f[f'zstd_{label}_ratio']:.3f}) vs raw",
                fmt_rate(m, f[f"zstd_{label}_persist_s"]),
                fmt_rate(m, f[f"zstd_{label}_raw_write_s"]),
                f"{f[f'zstd_{label}_speed_over_raw']:.2f}x raw's speed (paired)",
            )
        )

    caches = ("cold", "warm") if f["restore_cold_cache"] else ("warm",)
    rows = res.section(
        "restore into existing tensors ("
        + (
            "page cache dropped before each cold load)"
            if f["restore_cold_cache"]
            else "warm page cache only: cannot drop caches)"
        )
    )
    for cache in caches:
        o = f[f"restore_ours_{cache}_s"]
        for peer, label in (("dcp_load", "DCP load"), ("torch_load", "torch.load + copy_")):
            p = f[f"restore_{peer}_{cache}_s"]
            rows.append(
                Row(f"restore() vs {label}, {cache}", fmt_rate(n, o), fmt_rate(n, p), f"{p / o:.2f}x their speed")
            )

    if "s3_state_bytes" in f:
        m = f["s3_state_bytes"]
        p = f["s3_persist_steady_s"]
        rows = res.section(f"S3 on a local SeaweedFS: {m / 2**30:.2f} GiB; steady = median of rounds")
        rows += [
            Row("ours persist, first", fmt_rate(m, f["s3_ours_persist_first_s"])),
            Row(
                "ours persist vs s3fs put per tensor (seq)",
                fmt_rate(m, p),
                fmt_rate(m, f["s3_raw_seq_steady_s"]),
                f"{f['s3_persist_speed_over_raw_seq']:.2f}x their speed (paired)",
            ),
            Row(
                "ours persist vs s3fs pipe (concurrent)",
                fmt_rate(m, p),
                fmt_rate(m, f["s3_raw_concurrent_s"]),
                f"{f['s3_raw_concurrent_s'] / p:.2f}x their speed",
            ),
            Row(
                "ours persist vs DCP save, FsspecWriter",
                fmt_rate(m, p),
                fmt_rate(m, f["s3_dcp_save_steady_s"]),
                f"{f['s3_persist_speed_over_dcp']:.2f}x their speed (paired)",
            ),
            Row("ours snapshot() stall, steady (server shares the CPUs)", fmt_t(f["s3_stall_steady_s"])),
        ]
        for cache in ("cold", "warm") if f["s3_restore_cold_cache"] else ("warm",):
            o, d = f[f"s3_restore_ours_{cache}_s"], f[f"s3_restore_dcp_load_{cache}_s"]
            rows.append(
                Row(
                    f"restore() vs DCP FsspecReader load, {cache}",
                    fmt_rate(m, o),
                    fmt_rate(m, d),
                    f"{d / o:.2f}x their speed",
                )
            )

    res.target(
        "steady stall <= 1.25x the copy floor",
        f["stall_over_floor"] <= 1.25,
        f"{f['stall_over_floor']:.2f}x ({fmt_t(stall)} vs {fmt_t(floor)})",
    )
    res.target(
        "steady stall >= 4x lower than DCP async_save blocking (steady)",
        f["dcp_async_over_stall"] >= 4,
        f"{f['dcp_async_over_stall']:.2f}x lower ({fmt_t(stall)} vs {fmt_t(dcp_a)}; "
        f"the floor itself is {dcp_a / floor:.2f}x lower)",
    )
    res.target(
        "persist throughput >= 0.9x raw write + fsync",
        f["persist_speed_over_raw"] >= 0.9,
        f"{f['persist_speed_over_raw']:.2f}x ({fmt_rate(n, persist)} vs {fmt_rate(n, raw)})",
    )
    cache = caches[0]
    o, d = f[f"restore_ours_{cache}_s"], f[f"restore_dcp_load_{cache}_s"]
    res.target(
        f"restore at least as fast as DCP load ({cache} cache)",
        o <= d,
        f"{d / o:.2f}x DCP's speed ({fmt_rate(n, o)} vs {fmt_rate(n, d)})",
    )
    if "s3_state_bytes" in f:
        ratio = f["s3_persist_speed_over_raw_seq"]
        res.target(
            "S3 persist >= raw s3fs puts",
            ratio >= 1,
            f"{ratio:.2f}x ({fmt_rate(f['s3_state_bytes'], f['s3_persist_steady_s'])} vs "
            f"{fmt_rate(f['s3_state_bytes'], f['s3_raw_seq_steady_s'])})",
        )
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gib", type=float, default=2.0, help="state size in GiB (default 2)")
    p.add_argument("--tensors", type=int, default=64, help="number of tensors (default 64)")
    p.add_argument("--rounds", type=int, default=6, help="steady rounds after the first (default 6)")
    p.add_argument("--dir", default=None, help="parent of the temp work dir (default: the system temp dir)")
    p.add_argument("--s3", action="store_true", help="also benchmark a local SeaweedFS S3 server")
    p.add_argument("--s3-gib", type=float, default=0.5, help="state size for the S3 part (default 0.5)")
    p.add_argument("--s3-rounds", type=int, default=4, help="steady S3 rounds after the first (default 4)")
    p.add_argument("--json", default=None, help="write every figure as JSON to this file")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.s3_rounds < 1:
        p.error("--rounds and --s3-rounds must be >= 1")

    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("ftkit").setLevel(logging.ERROR)  # the "skipped" warnings are expected here
    warnings.filterwarnings("ignore", module=r"torch\.distributed.*")

    if os.getloadavg()[0] > 1.0:
        print(
            f"warning: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: "
            "other work will skew the figures",
            flush=True,
        )
    work = tempfile.mkdtemp(prefix="ftkit-bench-", dir=args.dir)
    print(
        f"work dir {work} ({fs_description(work)}); page cache drop "
        f"{'possible: cold restores' if can_drop_caches() else 'NOT possible: warm restores only'}",
        flush=True,
    )
    try:
        figures = run(args, work)
    finally:
        rmtree(work)
    res = tabulate(figures)
    res.print()
    busy = max(figures["loadavg_start"][0], figures["loadavg_end"][0]) > 1.5
    noisy = " (other work was running: figures are noisy)" if busy else ""
    print(
        f"\n{figures['state_bytes'] / 2**30:.2f} GiB state; {figures['dir']} on {figures['filesystem']}; "
        f"torch {figures['torch']}, {figures['torch_threads']} threads; peak RSS {figures['peak_rss_gib']:.1f} GiB; "
        f"load average {figures['loadavg_start'][0]:.1f} at start, {figures['loadavg_end'][0]:.1f} at end"
        f"{noisy}"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res.to_json(), fh, indent=1, default=str)
    return 0 if all(ok for _, ok, _ in res.targets) else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Core benchmark: ftkit beside torch.save, DCP and raw I/O, from one run on one state.

Run::

    .venv/bin/python benchmarks/bench_core.py                 # 2 GiB fp32 state, temp dir in /tmp
    .venv/bin/python benchmarks/bench_core.py --gib 0.25      # quick
    .venv/bin/python benchmarks/bench_core.py --dir /mnt/nvme --json out.json
    .venv/bin/python benchmarks/bench_core.py --s3 --s3-gib 0.5   # also a local SeaweedFS S3 server

The state is `--tensors` fp32 randn tensors on CPU totalling `--gib` GiB. Every
figure below is measured in this run, on this state, in the same directory:

1. copy into reused, pre-touched buffers (the stall's floor, best of 3) and `clone()`;
2. ftkit `snapshot()` stall: first call, steady (background idle), and with the
   background still persisting (a free slot; no free slot under policy wait / skip);
3. `torch.save` + fsync; 4. DCP `save`, DCP `async_save` (first, steady);
5. raw sequential write + fsync of the same bytes;
6. ftkit persist throughput (snapshot() return -> wait() return), raw and zstd;
7. restore: ftkit `restore()` vs DCP `load` vs `torch.load`, cold (page cache
   dropped, when /proc/sys/vm/drop_caches is writable) and warm;
8. with --s3: ftkit persist to s3:// vs raw s3fs puts vs DCP FsspecWriter.

Timing statistics: ours are medians of the steady calls; competitors' are their
best steady figure (so the ratios are conservative). Throughputs are decimal
GB/s (1e9 bytes). Everything written goes under one temp dir, removed at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

import ftkit
from ftkit.reader import newest_manifest
from ftkit.tiers import Tier

REPO = Path(__file__).resolve().parent.parent
DROP_CACHES = "/proc/sys/vm/drop_caches"


# ------------------------------------------------------------------ helpers
def now() -> float:
    return time.perf_counter()


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else math.inf


def make_state(gib: float, n: int, dtype=torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per = max(1, int(gib * 2**30 / n / 4))
    return {f"p{i:03d}": torch.randn(per, generator=g).to(dtype) for i in range(n)}


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def zeros_like_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def raw_views(state: dict[str, torch.Tensor]) -> list[memoryview]:
    return [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in state.values()]


def free() -> None:
    gc.collect()


def drop_caches() -> bool:
    """Drop the page cache (needs root); False when not possible."""
    try:
        os.sync()
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fs_description(path: str) -> str:
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True, check=True).stdout
        dev, kind = out.strip().splitlines()[-1].split()[:2]
        return f"{kind} ({dev})"
    except (OSError, subprocess.CalledProcessError, ValueError):
        return "unknown"


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def progress(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def ours_tier(url: str, **kw: Any) -> Tier:
    return Tier(url=url, keep=kw.pop("keep", 2), **kw)


# ------------------------------------------------------------- the results
@dataclass
class Row:
    what: str
    ours: str = ""
    peer: str = ""
    ratio: str = ""


@dataclass
class Target:
    what: str
    ok: bool
    detail: str


@dataclass
class Results:
    figures: dict[str, Any] = field(default_factory=dict)
    sections: list[tuple[str, list[Row]]] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)

    def section(self, title: str) -> list[Row]:
        rows: list[Row] = []
        self.sections.append((title, rows))
        return rows

    def target(self, what: str, ok: bool, detail: str) -> None:
        self.targets.append(Target(what, ok, detail))

    def print(self) -> None:
        w = [46, 26, 40, 22]
        line = "-" * (sum(w) + 3 * 3)
        for title, rows in self.sections:
            print(f"\n{title}\n{line}")
            print(" | ".join(h.ljust(n) for h, n in zip(("what", "ours", "competitor", "ratio"), w)))
            print(line)
            for r in rows:
                print(" | ".join(c.ljust(n) for c, n in zip((r.what, r.ours, r.peer, r.ratio), w)).rstrip())
        print(f"\ntargets\n{line}")
        for t in self.targets:
            print(f"  {'PASS' if t.ok else 'MISS'}  {t.what}: {t.detail}")

    def to_json(self) -> dict[str, Any]:
        return {"figures": self.figures,
                "targets": [{"what": t.what, "pass": t.ok, "detail": t.detail} for t in self.targets]}


def fmt_t(seconds: float, nbytes: int | None = None) -> str:
    s = f"{seconds * 1e3:.1f} ms" if seconds < 0.1 else f"{seconds:.3f} s"
    return f"{s} ({gbps(nbytes, seconds):.2f} GB/s)" if nbytes else s


def fmt_rate(rate_gbps: float) -> str:
    return f"{rate_gbps * 1e3:.0f} MB/s" if rate_gbps < 1 else f"{rate_gbps:.2f} GB/s"


# ----------------------------------------------------------- 1. copy floor
def measure_copy(state: dict[str, torch.Tensor], reps: int = 3) -> dict[str, float]:
    """Best-of-`reps` copy into reused pre-touched buffers, and into fresh ones (clone)."""
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    for d in dst.values():
        d.zero_()  # pre-touch: no page faults in the timed copies
    reused = []
    with torch.no_grad():
        for _ in range(reps):
            t0 = now()
            for k, v in state.items():
                dst[k].copy_(v)
            reused.append(now() - t0)
    del dst
    free()
    fresh = []
    for _ in range(reps):
        t0 = now()
        c = {k: v.clone() for k, v in state.items()}
        fresh.append(now() - t0)
        del c
        free()
    return {"copy_reused_s": min(reused), "clone_fresh_s": min(fresh)}


# ------------------------------------------- 2 + 6. our stall and persist
def snapshot_timed(ck: ftkit.Checkpointer, step: int) -> tuple[float, bool]:
    t0 = now()
    staged = ck.snapshot(step)
    return now() - t0, staged


def measure_ours_idle(state, url: str, steady_calls: int, **tier_kw) -> dict[str, Any]:
    """snapshot() stall with the background idle, and persist time (snapshot return -> wait return)."""
    tier = ours_tier(url, **tier_kw)
    ck = ftkit.Checkpointer(state, tiers=[tier], rng=False, policy="wait")
    stalls, persists = [], []
    try:
        for step in range(1, steady_calls + 2):
            stall, _ = snapshot_timed(ck, step)
            t0 = now()
            ck.wait()
            persists.append(now() - t0)
            stalls.append(stall)
        manifest = newest_manifest(tier.open())
    finally:
        ck.close()
    return {
        "stall_first_s": stalls[0], "stall_steady_s": statistics.median(stalls[1:]),
        "stall_steady_all_s": stalls[1:],
        "persist_first_s": persists[0], "persist_steady_s": statistics.median(persists[1:]),
        "persist_steady_all_s": persists[1:],
        "stored_bytes": manifest.total_stored_bytes, "raw_bytes": manifest.total_raw_bytes,
    }


def measure_ours_busy(state, url: str, policy: str, reps: int = 3) -> dict[str, Any]:
    """Stalls while the background still persists earlier snapshots.

    Each rep: wait() for an idle background, then three snapshots back to back:
    A (background idle), B (background persisting A, second slot free) and C
    (both slots busy: policy "wait" blocks until A is persisted, "skip" returns).
    The first rep's B allocates the second slot, so it is reported on its own.
    """
    ck = ftkit.Checkpointer(state, tiers=[ours_tier(url)], rng=False, policy=policy)
    step = 1
    free_slot, full, staged_full = [], [], []
    try:
        snapshot_timed(ck, step)  # allocates and pre-faults the first slot
        ck.wait()
        for _ in range(reps):
            snapshot_timed(ck, step := step + 1)
            s_free, _ = snapshot_timed(ck, step := step + 1)
            s_full, ok = snapshot_timed(ck, step := step + 1)
            ck.wait()
            free_slot.append(s_free)
            full.append(s_full)
            staged_full.append(ok)
        skipped = ck.stats.skipped
    finally:
        ck.close()
    return {"stall_busy_second_slot_first_use_s": free_slot[0],
            "stall_busy_free_slot_s": statistics.median(free_slot[1:]),
            "stall_busy_no_slot_s": statistics.median(full),
            "busy_no_slot_staged": staged_full, "skipped": skipped}


# --------------------------------------------------- 3. torch.save + fsync
def measure_torch_save(state, path: str, reps: int = 2) -> dict[str, float]:
    """torch.save + fsync, best of `reps`; the last file is kept for the restore phase."""
    times = []
    for _ in range(reps):
        t0 = now()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        times.append(now() - t0)
    return {"torch_save_s": min(times), "torch_save_all_s": times}


# ------------------------------------------------------------------ 4. DCP
def measure_dcp_save(state, root: str, reps: int = 2) -> dict[str, Any]:
    """dcp.save blocking time, best of `reps`; the last checkpoint is kept for the restore phase."""
    import torch.distributed.checkpoint as dcp

    times, path = [], ""
    for i in range(reps):
        if path:
            shutil.rmtree(path)
        path = os.path.join(root, f"dcp-save-{i}")
        t0 = now()
        dcp.save(state, checkpoint_id=path)
        times.append(now() - t0)
    return {"dcp_save_s": min(times), "dcp_save_all_s": times, "dcp_save_path": path}


def measure_dcp_async(state, root: str, reps: int = 3) -> dict[str, Any]:
    """dcp.async_save blocking time and background time, waiting on its future between calls."""
    import torch.distributed.checkpoint as dcp

    blocking, background = [], []
    for i in range(reps):
        path = os.path.join(root, f"dcp-async-{i}")
        t0 = now()
        fut = dcp.async_save(state, checkpoint_id=path)
        t1 = now()
        getattr(fut, "upload_completion", fut).result()
        background.append(now() - t1)
        blocking.append(t1 - t0)
        shutil.rmtree(path)
        del fut
        free()
    return {"dcp_async_first_s": blocking[0], "dcp_async_steady_s": min(blocking[1:]),
            "dcp_async_blocking_all_s": blocking, "dcp_async_background_all_s": background,
            "dcp_async_background_steady_s": min(background[1:])}


# ------------------------------------------------------ 5. raw write floor
def measure_raw_write(state, path: str, reps: int = 3) -> dict[str, Any]:
    """Plain sequential writes of every tensor's bytes into one file, then fsync."""
    views = raw_views(state)
    times = []
    for _ in range(reps):
        t0 = now()
        with open(path, "wb", buffering=0) as f:
            for v in views:
                f.write(v)
            os.fsync(f.fileno())
        times.append(now() - t0)
        os.remove(path)
    return {"raw_write_s": statistics.median(times), "raw_write_best_s": min(times),
            "raw_write_all_s": times}


# --------------------------------------------------------------- 7. restore
def timed_restore(name: str, dest: dict[str, torch.Tensor], expect: dict[str, torch.Tensor],
                  load: Callable[[], None], cold: bool) -> float:
    for t in dest.values():
        t.zero_()
    if cold:
        drop_caches()
    t0 = now()
    load()
    dt = now() - t0
    if not same(dest, expect):
        raise AssertionError(f"restore by {name} did not reproduce the state")
    return dt


def measure_restore(state, ours_url: str, dcp_path: str, torch_path: str | None,
                    storage_options: dict | None = None,
                    dcp_reader: Callable[[], Any] | None = None) -> dict[str, Any]:
    """ftkit restore() vs dcp.load vs torch.load (+ copy into the state), cold then warm."""
    import torch.distributed.checkpoint as dcp

    dest = zeros_like_state(state)
    tier = ours_tier(ours_url, storage_options=storage_options or {})

    def ours() -> None:
        ck = ftkit.Checkpointer(dest, tiers=[tier], rng=False)
        try:
            ck.restore()
        finally:
            ck.close()

    def dcp_load() -> None:
        if dcp_reader is not None:
            dcp.load(dest, storage_reader=dcp_reader())
        else:
            dcp.load(dest, checkpoint_id=dcp_path)

    def torch_load() -> None:
        loaded = torch.load(torch_path)
        with torch.no_grad():
            for k, v in loaded.items():
                dest[k].copy_(v)

    can_drop = os.access(DROP_CACHES, os.W_OK)
    out: dict[str, Any] = {"cold_cache": can_drop}
    loaders = [("ours", ours), ("dcp_load", dcp_load)] + ([("torch_load", torch_load)] if torch_path else [])
    for cache in (("cold", True), ("warm", False)) if can_drop else (("warm", False),):
        for name, fn in loaders:
            if cache[0] == "warm":
                fn()  # make sure this file is the one in the cache
            out[f"restore_{name}_{cache[0]}_s"] = timed_restore(name, dest, state, fn, cold=cache[1])
            free()
    del dest
    free()
    return out


# -------------------------------------------------------------------- 8. S3
def import_s3_server(wait_s: float) -> type:
    """scripts/s3_server.py's S3Server, polling for it while it is being written."""
    sys.path.insert(0, str(REPO))
    deadline = now() + wait_s
    while True:
        try:
            from scripts.s3_server import S3Server
            return S3Server
        except ImportError as e:
            if now() > deadline:
                raise SystemExit(f"scripts/s3_server.py (S3Server) is not usable: {e}") from None
            progress(f"waiting for scripts/s3_server.py ({e})")
            time.sleep(30)
            for mod in [m for m in sys.modules if m.startswith("scripts")]:
                del sys.modules[mod]


def measure_s3(gib: float, n: int, root: str, wait_s: float, steady_calls: int = 2) -> dict[str, Any]:
    import s3fs
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    S3Server = import_s3_server(wait_s)
    state = make_state(gib, n, seed=1)
    nbytes = state_bytes(state)
    out: dict[str, Any] = {"s3_state_bytes": nbytes}
    with S3Server(data_dir=os.path.join(root, "seaweedfs")) as srv:
        opts = srv.storage_options()
        out["s3_server_start_s"] = srv.startup_seconds
        progress(f"S3 server up at {srv.endpoint_url}; ours")
        ours_url = srv.url("bench/ours")
        r = measure_ours_idle(state, ours_url, steady_calls, storage_options=opts)
        out.update({f"s3_ours_{k}": v for k, v in r.items()})

        progress("S3 raw s3fs puts")
        fs = s3fs.S3FileSystem(**opts)
        views = raw_views(state)
        seq = []
        for _ in range(2):
            t0 = now()
            for k, v in zip(state, views):
                fs.pipe_file(f"{srv.bucket}/bench/raw/{k}", bytes(v))
            seq.append(now() - t0)
            fs.rm(f"{srv.bucket}/bench/raw", recursive=True)
        out["s3_raw_puts_seq_s"] = min(seq)
        t0 = now()
        fs.pipe({f"{srv.bucket}/bench/rawc/{k}": bytes(v) for k, v in zip(state, views)})
        out["s3_raw_puts_concurrent_s"] = now() - t0
        fs.rm(f"{srv.bucket}/bench/rawc", recursive=True)
        del views
        free()

        progress("S3 DCP FsspecWriter")
        dcp_url = srv.url("bench/dcp")
        t0 = now()
        dcp.save(state, storage_writer=FsspecWriter(dcp_url, **opts))
        out["s3_dcp_save_s"] = now() - t0

        progress("S3 restore")
        r = measure_restore(state, ours_url, dcp_url, None, storage_options=opts,
                            dcp_reader=lambda: FsspecReader(dcp_url, **opts))
        out.update({f"s3_{k}": v for k, v in r.items()})
    del state
    free()
    return out


# ---------------------------------------------------------------- the run
def run(args: argparse.Namespace, res: Results, work: str) -> None:
    fig = res.figures
    state = make_state(args.gib, args.tensors)
    nbytes = state_bytes(state)
    fig.update({"state_bytes": nbytes, "tensors": len(state), "dtype": "float32",
                "dir": work, "filesystem": fs_description(work), "torch": torch.__version__,
                "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()})

    progress("1. copy floor / clone")
    fig.update(measure_copy(state))
    progress("2. ours, background idle")
    ours_url = os.path.join(work, "ours")
    r = measure_ours_idle(state, ours_url, args.steady)
    fig.update({f"ours_{k}": v for k, v in r.items() if k not in ("stored_bytes", "raw_bytes")})
    free()
    progress("2. ours, background busy, policy wait")
    fig.update({f"ours_wait_{k}": v for k, v in measure_ours_busy(state, os.path.join(work, "busy-wait"), "wait").items()})
    shutil.rmtree(os.path.join(work, "busy-wait"), ignore_errors=True)
    free()
    progress("2. ours, background busy, policy skip")
    fig.update({f"ours_skip_{k}": v for k, v in measure_ours_busy(state, os.path.join(work, "busy-skip"), "skip").items()})
    shutil.rmtree(os.path.join(work, "busy-skip"), ignore_errors=True)
    free()

    progress("6. ours zstd: fp32 state, then a bf16 copy of it")
    z = measure_ours_idle(state, os.path.join(work, "zstd-fp32"), 2, compress="zstd", keep=1)
    fig.update({"zstd_fp32_persist_s": z["persist_steady_s"], "zstd_fp32_ratio": z["stored_bytes"] / z["raw_bytes"]})
    shutil.rmtree(os.path.join(work, "zstd-fp32"))
    bf16 = {k: v.to(torch.bfloat16) for k, v in state.items()}
    fig["bf16_bytes"] = state_bytes(bf16)
    z = measure_ours_idle(bf16, os.path.join(work, "zstd-bf16"), 2, compress="zstd", keep=1)
    fig.update({"zstd_bf16_persist_s": z["persist_steady_s"], "zstd_bf16_ratio": z["stored_bytes"] / z["raw_bytes"]})
    shutil.rmtree(os.path.join(work, "zstd-bf16"))
    raw_bf16 = measure_raw_write(bf16, os.path.join(work, "raw-bf16.bin"), reps=1)
    fig["raw_write_bf16_s"] = raw_bf16["raw_write_s"]
    del bf16, z
    free()

    progress("3. torch.save + fsync")
    torch_path = os.path.join(work, "state.pt")
    fig.update(measure_torch_save(state, torch_path))
    progress("4. DCP save")
    r = measure_dcp_save(state, work)
    dcp_path = r.pop("dcp_save_path")
    fig.update(r)
    free()
    progress("4. DCP async_save")
    fig.update(measure_dcp_async(state, work))
    free()
    progress("5. raw write + fsync")
    fig.update(measure_raw_write(state, os.path.join(work, "raw.bin")))

    progress("7. restore")
    fig.update(measure_restore(state, ours_url, dcp_path, torch_path))
    del state
    free()

    if args.s3:
        progress("8. S3")
        fig.update(measure_s3(args.s3_gib, args.tensors, work, args.s3_wait))
    fig["peak_rss_gib"] = peak_rss_gib()
    tabulate(res)


def tabulate(res: Results) -> None:
    f = res.figures
    n = f["state_bytes"]
    floor, steady = f["copy_reused_s"], f["ours_stall_steady_s"]
    dcp_async = f["dcp_async_steady_s"]

    rows = res.section(f"snapshot stall ({n / 2**30:.2f} GiB, {f['tensors']} fp32 tensors, CPU, "
                       f"{f['cpu_count']} cores)")
    rows += [
        Row("copy into reused buffers (floor, best of 3)", fmt_t(floor, n)),
        Row("copy into fresh buffers (clone, best of 3)", "", fmt_t(f["clone_fresh_s"], n),
            f"{f['clone_fresh_s'] / floor:.1f}x the floor"),
        Row("ours snapshot(), first call", fmt_t(f["ours_stall_first_s"], n), "",
            f"{f['ours_stall_first_s'] / floor:.2f}x floor"),
        Row("ours snapshot(), steady, background idle", fmt_t(steady, n), f"floor {fmt_t(floor)}",
            f"{steady / floor:.2f}x floor"),
        Row("ours, bg busy, 2nd slot's first use", fmt_t(f["ours_wait_stall_busy_second_slot_first_use_s"]), "",
            f"{f['ours_wait_stall_busy_second_slot_first_use_s'] / floor:.2f}x floor"),
        Row("ours, bg busy, a slot free", fmt_t(f["ours_wait_stall_busy_free_slot_s"]), "",
            f"{f['ours_wait_stall_busy_free_slot_s'] / floor:.2f}x floor"),
        Row("ours, bg busy, no slot free, policy=wait", fmt_t(f["ours_wait_stall_busy_no_slot_s"]), "",
            "blocks until a persist ends"),
        Row("ours, bg busy, no slot free, policy=skip", fmt_t(f["ours_skip_stall_busy_no_slot_s"]), "",
            f"skipped {f['ours_skip_skipped']} of {len(f['ours_skip_busy_no_slot_staged'])}"),
        Row("torch.save + fsync (blocking)", "", fmt_t(f["torch_save_s"], n),
            f"{f['torch_save_s'] / steady:.0f}x ours"),
        Row("DCP save (blocking)", "", fmt_t(f["dcp_save_s"], n), f"{f['dcp_save_s'] / steady:.0f}x ours"),
        Row("DCP async_save blocking, 1st call", fmt_t(f["ours_stall_first_s"]), fmt_t(f["dcp_async_first_s"]),
            f"{f['dcp_async_first_s'] / f['ours_stall_first_s']:.1f}x ours 1st"),
        Row("DCP async_save blocking, steady (2nd/3rd)", fmt_t(steady), fmt_t(dcp_async),
            f"{dcp_async / steady:.1f}x ours"),
    ]

    raw = f["raw_write_s"]
    persist = f["ours_persist_steady_s"]
    rows = res.section("persist to the local directory (throughput of the same bytes)")
    dcp_bg = f["dcp_async_background_steady_s"]
    rows += [
        Row("raw write + fsync (median of 3)", gbps_row(n, raw), f"best {gbps_row(n, f['raw_write_best_s'])}"),
        Row("ours persist, first", gbps_row(n, f["ours_persist_first_s"]), "",
            f"{raw / f['ours_persist_first_s']:.2f}x raw"),
        Row("ours persist, steady (median)", gbps_row(n, persist), f"raw {gbps_row(n, raw)}",
            f"{raw / persist:.2f}x raw"),
        Row("DCP async_save background (best steady)", gbps_row(n, persist), gbps_row(n, dcp_bg),
            f"ours {dcp_bg / persist:.2f}x DCP"),
        Row("torch.save + fsync", gbps_row(n, persist), gbps_row(n, f["torch_save_s"]),
            f"ours {f['torch_save_s'] / persist:.2f}x"),
        Row(f"ours zstd, fp32 randn (stored/raw {f['zstd_fp32_ratio']:.3f})",
            gbps_row(n, f["zstd_fp32_persist_s"]), f"raw {gbps_row(n, raw)}",
            f"{raw / f['zstd_fp32_persist_s']:.2f}x raw"),
        Row(f"ours zstd, bf16 copy (stored/raw {f['zstd_bf16_ratio']:.3f})",
            gbps_row(f["bf16_bytes"], f["zstd_bf16_persist_s"]),
            f"raw {gbps_row(f['bf16_bytes'], f['raw_write_bf16_s'])} (1 rep)",
            f"{f['raw_write_bf16_s'] / f['zstd_bf16_persist_s']:.2f}x raw"),
    ]

    cold = "cold" if f["cold_cache"] else "warm"
    rows = res.section(f"restore into existing tensors ({'page cache dropped before each cold run' if f['cold_cache'] else 'warm page cache only: cannot drop caches'})")
    for cache in ("cold", "warm") if f["cold_cache"] else ("warm",):
        o = f[f"restore_ours_{cache}_s"]
        d = f[f"restore_dcp_load_{cache}_s"]
        t = f[f"restore_torch_load_{cache}_s"]
        rows += [Row(f"ours restore() vs DCP load, {cache}", gbps_row(n, o), gbps_row(n, d), f"{d / o:.2f}x ours speed"),
                 Row(f"ours restore() vs torch.load+copy_, {cache}", gbps_row(n, o), gbps_row(n, t),
                     f"{t / o:.2f}x ours speed")]

    if "s3_state_bytes" in f:
        m = f["s3_state_bytes"]
        p = f["s3_ours_persist_steady_s"]
        rows = res.section(f"S3 (local SeaweedFS, {m / 2**30:.2f} GiB)")
        rows += [
            Row("ours persist, first", gbps_row(m, f["s3_ours_persist_first_s"])),
            Row("ours persist, steady vs s3fs puts (seq)", gbps_row(m, p), gbps_row(m, f["s3_raw_puts_seq_s"]),
                f"{f['s3_raw_puts_seq_s'] / p:.2f}x"),
            Row("ours persist vs s3fs pipe (concurrent)", gbps_row(m, p), gbps_row(m, f["s3_raw_puts_concurrent_s"]),
                f"{f['s3_raw_puts_concurrent_s'] / p:.2f}x"),
            Row("ours persist vs DCP save FsspecWriter", gbps_row(m, p), gbps_row(m, f["s3_dcp_save_s"]),
                f"{f['s3_dcp_save_s'] / p:.2f}x"),
            Row("ours snapshot() stall, steady", fmt_t(f["s3_ours_stall_steady_s"])),
        ]
        for cache in ("cold", "warm") if f["s3_cold_cache"] else ("warm",):
            o, d = f[f"s3_restore_ours_{cache}_s"], f[f"s3_restore_dcp_load_{cache}_s"]
            rows.append(Row(f"restore vs DCP FsspecReader load, {cache}", gbps_row(m, o), gbps_row(m, d),
                            f"{d / o:.2f}x ours speed"))

    res.target("steady stall <= 1.25x copy floor", steady <= 1.25 * floor,
               f"{steady / floor:.2f}x ({fmt_t(steady)} vs {fmt_t(floor)})")
    res.target("steady stall >= 4x lower than DCP async_save blocking (its best steady call)",
               dcp_async >= 4 * steady, f"{dcp_async / steady:.1f}x lower ({fmt_t(steady)} vs {fmt_t(dcp_async)})")
    res.target("persist throughput >= 0.9x raw write + fsync", raw / persist >= 0.9,
               f"{raw / persist:.2f}x ({gbps_row(n, persist)} vs {gbps_row(n, raw)})")
    o, d = f[f"restore_ours_{cold}_s"], f[f"restore_dcp_load_{cold}_s"]
    res.target(f"restore at least as fast as DCP load ({cold} cache)", o <= d,
               f"{d / o:.2f}x DCP's speed ({gbps_row(n, o)} vs {gbps_row(n, d)})")
    if "s3_state_bytes" in f:
        p, s = f["s3_ours_persist_steady_s"], f["s3_raw_puts_seq_s"]
        res.target("S3 persist >= raw s3fs puts (sequential)", p <= s,
                   f"{s / p:.2f}x ({gbps_row(m, p)} vs {gbps_row(m, s)})")
    print(f"\nstate {n / 2**30:.2f} GiB in {f['dir']} on {f['filesystem']}; torch {f['torch']}, "
          f"{f['torch_threads']} threads; peak RSS {f['peak_rss_gib']:.1f} GiB")


def gbps_row(nbytes: int, seconds: float) -> str:
    return f"{fmt_rate(gbps(nbytes, seconds))} ({seconds:.2f} s)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0, help="state size in GiB (default 2)")
    p.add_argument("--tensors", type=int, default=64, help="number of tensors (default 64)")
    p.add_argument("--steady", type=int, default=5, help="steady snapshot calls after the first (default 5)")
    p.add_argument("--dir", default=None, help="parent of the temp work dir (default: the system temp dir)")
    p.add_argument("--s3", action="store_true", help="also benchmark a local SeaweedFS S3 server")
    p.add_argument("--s3-gib", type=float, default=0.5, help="state size for the S3 part (default 0.5)")
    p.add_argument("--s3-wait", type=float, default=900, help="seconds to wait for scripts/s3_server.py")
    p.add_argument("--json", default=None, help="write every figure as JSON to this file")
    args = p.parse_args(argv)

    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("ftkit").setLevel(logging.ERROR)  # "skipped" warnings are expected here
    warnings.filterwarnings("ignore", module="torch.distributed")

    work = tempfile.mkdtemp(prefix="ftkit-bench-", dir=args.dir)
    print(f"work dir {work}: {fs_description(work)}; page cache drop "
          f"{'possible' if os.access(DROP_CACHES, os.W_OK) else 'NOT possible (warm figures only)'}", flush=True)
    res = Results()
    try:
        run(args, res, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res.print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res.to_json(), f, indent=1, default=str)
    return 0 if all(t.ok for t in res.targets) else 1


if __name__ == "__main__":
    sys.exit(main())

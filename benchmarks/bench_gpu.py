#!/usr/bin/env python3
"""GPU benchmark: ftkit's CUDA path beside DCP and torch.save, from one run on one model.

Run (from the repo root)::

    python3 benchmarks/bench_gpu.py --gib 8            # on a GPU machine
    python3 benchmarks/bench_gpu.py --gib 1 --json out.json
    .venv/bin/python benchmarks/bench_gpu.py --device cpu --gib 0.05   # the code paths, on a CPU

The model is a stack of Linear(width, width) + ReLU layers trained with Adam in
fp32, sized so that parameters plus Adam's two moments come to about `--gib`
GiB (the state a snapshot copies). A training step is a real forward, backward
and optimizer step on a batch of `--rows` rows. In one run it measures:

1. the copy floor: device-to-host into one reused pinned buffer (best of 3), and
   host-to-device from it (the restore floor);
2. ftkit `snapshot()` as the training loop calls it, once per step (each step
   ends with `loss.item()`, as a loop that logs its loss does): the
   training thread's stall (first call, which allocates the pinned slot, and
   steady), when the copy finishes after `snapshot()` returned (it overlaps the
   next forward and backward), and the step-time slowdown against the same steps
   without snapshots (paired rounds). Persistence is left out of this phase (the
   persist thread only waits for the copy and frees the slot): no tier can write
   the state every step, and its own speed is `bench_core.py`'s subject;
3. DCP `async_save` time to return, default and with DCP's pinned-memory stager
   (and, for the latter, when its staging was done: until then the next
   optimizer step may not run); `torch.save` + fsync;
4. restore into the live CUDA tensors: ftkit from the RAM tier and from a local
   directory, DCP `load` from a local directory; each verified bitwise.

Every figure is printed as a JSON line as soon as it is measured (so a run cut
short still reports), then a table with the competitor beside ours and the
targets. Each competitor runs in its own try/except: one failing prints its
error and the run goes on. Exit status 1 if a target is missed; 0 with a message
when there is no CUDA device (and no --device cpu).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import can_drop_caches, drop_caches, median, now, progress, rmtree

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from anywhere, with or without ftkit installed
    sys.path.insert(0, str(REPO))

GB = 1e9
FIG: dict[str, Any] = {}


# ------------------------------------------------------------------ helpers


def emit(figure: str, **kw: Any) -> None:
    """Print one figure as a JSON line now, and keep it for the table."""
    FIG[figure] = kw
    print(json.dumps({"figure": figure, **kw}, default=str), flush=True)


def guarded(figure: str, fn: Callable[[], Any]) -> Any:
    """Run one contender; on failure print its error as that figure's line and go on."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 (a competitor's failure is a result, not the end of the run)
        emit(figure, error=f"{type(e).__name__}: {e}"[:400])
        traceback.print_exc(limit=3, file=sys.stderr)
        return None


def fmt_t(s: float | None) -> str:
    if s is None or s != s:
        return "-"
    return f"{s * 1e3:.2f} ms" if s < 0.1 else f"{s:.3f} s"


def fmt_rate(nbytes: int, s: float | None) -> str:
    if not s or s != s:
        return "-"
    return f"{fmt_t(s)} ({nbytes / s / GB:.1f} GB/s)"


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ the model
class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.dev = torch.device(args.device)
        self.cuda = self.dev.type == "cuda"
        w = args.width
        per_layer = (w * w + w) * 4 * 3  # fp32 weight + bias, and Adam's two moments
        self.layers = max(1, round(args.gib * 2**30 / per_layer))
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(self.layers):
            layers += [torch.nn.Linear(w, w), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*layers).to(self.dev)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-5)
        self.batch = torch.randn(args.rows, w, device=self.dev)
        self.step()  # Adam's state exists from here on
        self.sync()
        self.state = {"model": self.model, "optim": self.opt}
        self.nbytes = sum(t.numel() * t.element_size() for _, t in self.named)

    @property
    def named(self) -> list[tuple[str, torch.Tensor]]:
        """The state's tensors now (a restore gives the optimizer new state tensors: look again each time)."""
        from ftkit.save import capture as cap

        return cap.capture(self.state, rng=False).tensors

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def step(self) -> float:
        """One training step, ending as a loop that logs its loss does: the host waits for the step."""
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(self.batch).square().mean()
        loss.backward()
        self.opt.step()
        return loss.item()

    def flat(self) -> dict[str, torch.Tensor]:
        """The state as DCP and torch.save take it: the same tensors, by ftkit's names."""
        return dict(self.named)

    def reference(self) -> dict[str, torch.Tensor]:
        """A copy of every tensor, on the device (to verify restores bitwise)."""
        return {n: t.detach().clone() for n, t in self.named}

    def scramble(self) -> None:
        """Overwrite the live state, so a restore has to bring every byte back."""
        with torch.no_grad():
            for _, t in self.named:
                t.fill_(7) if t.is_floating_point() else t.zero_()
        self.sync()

    def matches(self, ref: dict[str, torch.Tensor]) -> bool:
        self.sync()
        return all(torch.equal(t, ref[n]) for n, t in self.named)


# ------------------------------------------------------------------ phases
def host_buffer(b: Bench, named: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, Any, list[torch.Tensor]]:
    """One host buffer for `named`'s tensors (page-locked on CUDA), how it was pinned, and a view of
    it per tensor, in order: what the floors copy into."""
    from ftkit.save.layout import Layout
    from ftkit.save.staging import DEVICE

    layout = Layout.of(named)
    buf, how = DEVICE.alloc_host(layout.total_bytes, pin=b.cuda)
    return buf, how, [buf[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in layout.entries]


def phase_floor(b: Bench) -> None:
    """Device-to-host into one reused pinned buffer, best of 3; host-to-device from it."""
    from ftkit.save.staging import DEVICE

    named = b.named
    buf, how, views = host_buffer(b, named)
    try:
        d2h = []
        for _ in range(3):
            b.sync()
            t0 = now()
            for dst, (_, src) in zip(views, named):
                dst.copy_(src, non_blocking=b.cuda)
            b.sync()
            d2h.append(now() - t0)
        b.sync()
        t0 = now()
        with torch.no_grad():
            for dst, (_, src) in zip(views, named):
                src.copy_(dst, non_blocking=b.cuda)
        b.sync()
        h2d = now() - t0
        emit(
            "copy_floor",
            d2h_s=min(d2h),
            d2h_all_s=d2h,
            h2d_s=h2d,
            pinned_by=how,
            d2h_gbps=b.nbytes / min(d2h) / GB,
            h2d_gbps=b.nbytes / h2d / GB,
        )
    finally:
        DEVICE.free_host(buf, how)
        del buf, views
        free_memory()


def staging_only_checkpointer(b: Bench, work: str):
    """ftkit's Checkpointer, whose persist thread only waits for the copy and frees the slot."""
    import ftkit
    from ftkit.save.pipeline import PersistJob, PersistPipeline

    copy_done: list[float] = []  # when the persist thread saw each snapshot's copy finish

    class StagingOnlyPipeline(PersistPipeline):
        def persist_job(self, job: PersistJob) -> None:
            job.slot.ready()
            copy_done.append(now())

    class StagingOnly(ftkit.Checkpointer):
        pipeline_class = StagingOnlyPipeline

    ck = StagingOnly(b.state, [os.path.join(work, "never-written")], rng=False, watchdog=False, preemption_signals=())
    ck.copy_done = copy_done  # type: ignore[attr-defined]
    return ck


class RawCopies:
    """The floor of one snapshot per step: the same device-to-host copies on a side stream into one
    reused pinned buffer, which the next optimizer step waits for (a plain step pre-hook), no ftkit code."""

    def __init__(self, b: Bench):
        self.b, self.named = b, b.named
        self.buf, self.how, self.views = host_buffer(b, self.named)
        self.side = torch.cuda.Stream(b.dev) if b.cuda else None
        self.pending: list[Any] = []
        self.hook = b.opt.register_step_pre_hook(self.fence)

    def fence(self, *_: Any) -> None:
        if self.pending:
            torch.cuda.current_stream(self.b.dev).wait_event(self.pending.pop())

    def __call__(self) -> None:
        if self.side is None:
            for dst, (_, src) in zip(self.views, self.named):
                dst.copy_(src)
            return
        self.side.wait_stream(torch.cuda.current_stream(self.b.dev))
        with torch.cuda.stream(self.side):
            for dst, (_, src) in zip(self.views, self.named):
                dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.side)
        self.pending[:] = [ev]

    def close(self) -> None:
        from ftkit.save.staging import DEVICE

        self.hook.remove()
        self.b.sync()
        self.views = []
        DEVICE.free_host(self.buf, self.how)
        del self.buf


def phase_steps(b: Bench, work: str) -> None:
    """Stall per snapshot (first, steady) and step time with one snapshot per step, paired rounds."""
    args = b.args
    for _ in range(args.warmup):
        b.step()
    b.sync()
    ck = staging_only_checkpointer(b, work)
    try:
        returns: list[float] = []  # when each snapshot() returned, in order (the copies finish in order)
        t0 = now()
        ck.snapshot(1)
        returns.append(now())
        first = returns[-1] - t0
        ck.wait()
        slot = next(s for s in ck._arena._slots if s.capacity)
        # Two at once: the second finds the first slot busy and allocates the other (once per run).
        ck.snapshot(2)
        returns.append(now())
        t0 = now()
        ck.snapshot(3)
        returns.append(now())
        second = returns[-1] - t0
        ck.wait()
        emit(
            "ours_first_snapshot",
            stall_s=first,
            second_slot_stall_s=second,
            pinned_by=slot.pinned_by,
            slot_bytes=slot.capacity,
            slots=sum(1 for s in ck._arena._slots if s.capacity),
        )
        step = 3
        base, snap, stalls = [], [], []
        raw, raw_stalls = [], []  # the floor: the same copies with no ftkit code (RawCopies)
        raw_snapshot = RawCopies(b)
        for r in range(args.rounds):
            progress(f"steps: round {r + 1}/{args.rounds}")
            b.sync()
            t0 = now()
            for _ in range(args.steps):
                b.step()
            b.sync()
            base.append((now() - t0) / args.steps)
            b.sync()
            t0 = now()
            for _ in range(args.steps):
                b.step()
                step += 1
                t1 = now()
                ck.snapshot(step)
                returns.append(now())
                stalls.append(returns[-1] - t1)
            b.sync()
            snap.append((now() - t0) / args.steps)
            ck.wait()
            t0 = now()
            for _ in range(args.steps):
                b.step()
                t1 = now()
                raw_snapshot()
                raw_stalls.append(now() - t1)
            b.sync()
            raw.append((now() - t0) / args.steps)
        raw_snapshot.close()
        copy_after = [d - r for d, r in zip(ck.copy_done[3:], returns[3:])]
        slow = [s / x - 1 for s, x in zip(snap, base)]
        emit(
            "ours_steps",
            step_s=median(base),
            step_with_snapshot_s=median(snap),
            slowdown=median(slow),
            slowdown_all=slow,
            step_all_s=base,
            step_with_snapshot_all_s=snap,
            stall_steady_s=median(stalls),
            stall_max_s=max(stalls),
            stall_all_s=stalls,
            copy_done_after_return_s=median(copy_after),
            copy_done_after_return_max_s=max(copy_after),
            steps_per_round=args.steps,
            rounds=args.rounds,
            snapshots=ck.stats.snapshots,
            floor_step_with_copy_s=median(raw),
            floor_slowdown=median([s / x - 1 for s, x in zip(raw, base)]),
            floor_stall_s=median(raw_stalls),
        )
    finally:
        ck.close()
        del ck
        free_memory()


def dcp_async_default(b: Bench, work: str, i: int) -> None:
    import torch.distributed.checkpoint as dcp

    path = os.path.join(work, f"dcp-async-{i}")
    sd = b.flat()
    b.sync()
    t0 = now()
    fut = dcp.async_save(sd, checkpoint_id=path)
    t1 = now()
    getattr(fut, "upload_completion", fut).result()
    emit(f"dcp_async_default_{i}", return_s=t1 - t0, upload_after_return_s=now() - t1)
    rmtree(path)


def dcp_pinned_stager(b: Bench, work: str) -> None:
    """DCP async_save with its own stager: pinned memory, async staging, non-blocking copies."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    opts = StagingOptions(
        use_pinned_memory=b.cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=b.cuda
    )
    stager = DefaultStager(opts)
    try:
        for i in range(2):
            path = os.path.join(work, f"dcp-pinned-{i}")
            label = f"dcp_async_pinned_stager_{i}"

            def one(path=path, label=label, stager=stager, opts=opts) -> None:
                sd = b.flat()
                b.sync()
                t0 = now()
                resp = dcp.async_save(sd, checkpoint_id=path, async_stager=stager)
                t1 = now()
                staging = getattr(resp, "staging_completion", None)
                if staging is not None:
                    staging.result()
                t2 = now()
                getattr(resp, "upload_completion", resp).result()
                emit(
                    label,
                    return_s=t1 - t0,
                    staged_after_return_s=t2 - t1,
                    upload_after_return_s=now() - t1,
                    options=str(opts),
                )

            guarded(label, one)
            rmtree(path)
    finally:
        stager.close()
        free_memory()


def torch_save(b: Bench, work: str) -> None:
    path = os.path.join(work, "state.pt")
    sd = b.flat()
    b.sync()
    t0 = now()
    with open(path, "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())
    emit("torch_save_fsync", s=now() - t0)
    os.remove(path)


def ram_dir_for(nbytes: int, work: str) -> tuple[str, str]:
    """Where the RAM tier goes: /dev/shm when it has room for a step and its spare, else the work dir."""
    try:
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize >= 2.2 * nbytes:
            return os.path.join("/dev/shm", f"ftkit-bench-{os.getpid()}"), "/dev/shm"
        where = f"the work dir (/dev/shm has {st.f_bavail * st.f_frsize / 2**30:.1f} GiB free)"
    except OSError:
        where = "the work dir (no /dev/shm)"
    return os.path.join(work, "ram"), where


def restore_floor(b: Bench, ram_root: str, threads: int = 8) -> None:
    """The floor of a restore from the RAM tier: read the tier's files (the same bytes) into one
    pinned buffer, with 1 and with `threads` threads, and copy that buffer to the device."""
    from concurrent.futures import ThreadPoolExecutor

    from ftkit.save.staging import DEVICE

    files = [(str(p), p.stat().st_size) for p in Path(ram_root).rglob("*") if p.is_file()]
    total = sum(size for _, size in files)
    t0 = now()
    buf, how = DEVICE.alloc_host(max(total, 1), pin=b.cuda)
    alloc = now() - t0
    try:
        spans, off = [], 0  # (path, file offset, buffer offset, length), 64 MiB each
        for path, size in files:
            for start in range(0, size, 64 << 20):
                spans.append((path, start, off + start, min(64 << 20, size - start)))
            off += size
        mem = memoryview(buf.numpy())

        def read(span: tuple[str, int, int, int]) -> None:
            path, start, at, n = span
            fd = os.open(path, os.O_RDONLY)
            try:
                got = 0
                while got < n:
                    k = os.preadv(fd, [mem[at + got : at + n]], start + got)
                    if k <= 0:
                        raise OSError(f"{path}: short read")
                    got += k
            finally:
                os.close(fd)

        t0 = now()
        for span in spans:
            read(span)
        one = now() - t0
        t0 = now()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, spans))
        many = now() - t0
        dev = torch.empty(max(total, 1), dtype=torch.uint8, device=b.dev)
        b.sync()
        t0 = now()
        dev.copy_(buf, non_blocking=b.cuda)
        b.sync()
        h2d = now() - t0
        del dev
    finally:
        DEVICE.free_host(buf, how)
        del buf
    emit(
        "restore_floor",
        files=len(files),
        bytes=total,
        pin_s=alloc,
        read_1_thread_s=one,
        read_threads_s=many,
        threads=threads,
        h2d_s=h2d,
        floor_s=min(one, many) + h2d,
    )


def phase_restore(b: Bench, work: str) -> None:
    import ftkit

    ram_root, ram_where = ram_dir_for(b.nbytes, work)
    os.environ["FTKIT_RAM_DIR"] = ram_root
    os.environ["FTKIT_JOB_ID"] = "bench"
    disk = os.path.join(work, "ours")
    ref = b.reference()
    try:

        def persist() -> None:
            with ftkit.Checkpointer(b.state, ["ram", disk], rng=False, watchdog=False, preemption_signals=()) as ck:
                t0 = now()
                ck.snapshot(1)
                t1 = now()
                ck.wait()
                emit("ours_persist_ram_and_dir", stall_s=t1 - t0, persist_after_return_s=now() - t1, ram_tier=ram_where)

        guarded("ours_persist_ram_and_dir", persist)
        guarded("restore_floor", lambda: restore_floor(b, ram_root))

        cold = can_drop_caches()

        def ours(tier: str, label: str, drop: bool) -> None:
            b.scramble()
            if drop:
                drop_caches()
            with ftkit.Checkpointer(b.state, [tier], rng=False, watchdog=False, preemption_signals=()) as ck:
                b.sync()
                t0 = now()
                step = ck.restore()
                b.sync()
                dt = now() - t0
                info = {k: v for k, v in ck.last_restore.items() if k.endswith("_s") or k == "source"}
            emit(label, s=dt, step=step, verified=b.matches(ref), cache="cold" if drop else "warm", **info)

        guarded("ours_restore_ram", lambda: ours("ram", "ours_restore_ram", False))
        guarded("ours_restore_dir", lambda: ours(disk, "ours_restore_dir", cold))

        import torch.distributed.checkpoint as dcp

        path = os.path.join(work, "dcp-save")

        def dcp_save() -> None:
            b.sync()
            t0 = now()
            dcp.save(b.flat(), checkpoint_id=path)
            emit("dcp_save_blocking", s=now() - t0)

        def dcp_load() -> None:
            b.scramble()
            if cold:
                drop_caches()
            b.sync()
            t0 = now()
            dcp.load(b.flat(), checkpoint_id=path)
            b.sync()
            emit("dcp_load_dir", s=now() - t0, verified=b.matches(ref), cache="cold" if cold else "warm")

        guarded("dcp_save_blocking", dcp_save)
        guarded("dcp_load_dir", dcp_load)
        rmtree(path)
    finally:
        rmtree(disk)
        rmtree(ram_root)
        ref = None  # free the reference copy before the next phase
        free_memory()


# ------------------------------------------------------------------ the table
def table(b: Bench) -> list[tuple[str, bool, str]]:
    n, f = b.nbytes, FIG
    get = lambda fig, key: (f.get(fig) or {}).get(key)  # noqa: E731
    floor, h2d = get("copy_floor", "d2h_s"), get("copy_floor", "h2d_s")
    steady, first = get("ours_steps", "stall_steady_s"), get("ours_first_snapshot", "stall_s")
    rows: list[tuple[str, str, str, str]] = []

    def ratio(a: float | None, c: float | None, unit: str = "x") -> str:
        return f"{a / c:.0f}{unit}" if a and c else "-"

    dcp_def = [get(f"dcp_async_default_{i}", "return_s") for i in range(2)]
    dcp_pin = [get(f"dcp_async_pinned_stager_{i}", "return_s") for i in range(2)]
    dcp_pin_staged = [get(f"dcp_async_pinned_stager_{i}", "staged_after_return_s") for i in range(2)]
    rows += [
        ("copy floor: D2H into a reused pinned buffer", "", fmt_rate(n, floor), "best of 3"),
        ("H2D from it (the restore floor)", "", fmt_rate(n, h2d), ""),
        (
            "snapshot() stall, first (allocates the slot)",
            fmt_t(first),
            "",
            f"pinned: {get('ours_first_snapshot', 'pinned_by')}",
        ),
        (
            "  the second slot's first use",
            fmt_t(get("ours_first_snapshot", "second_slot_stall_s")),
            "",
            f"slots: {get('ours_first_snapshot', 'slots')}",
        ),
        (
            "snapshot() stall, steady (median)",
            fmt_t(steady),
            f"floor {fmt_t(floor)}",
            f"max {fmt_t(get('ours_steps', 'stall_max_s'))}",
        ),
        (
            "  copy done after snapshot() returned",
            fmt_t(get("ours_steps", "copy_done_after_return_s")),
            "",
            "overlapped with forward/backward",
        ),
        (
            "step time, no snapshots / one per step",
            fmt_t(get("ours_steps", "step_s")),
            fmt_t(get("ours_steps", "step_with_snapshot_s")),
            f"{(get('ours_steps', 'slowdown') or float('nan')) * 100:+.2f}% (paired rounds)",
        ),
        (
            "  floor: the same copies, no ftkit code",
            "",
            fmt_t(get("ours_steps", "floor_step_with_copy_s")),
            f"{(get('ours_steps', 'floor_slowdown') or float('nan')) * 100:+.2f}%; "
            f"host {fmt_t(get('ours_steps', 'floor_stall_s'))} per copy",
        ),
        (
            "DCP async_save (default), 1st / 2nd return",
            fmt_t(steady),
            f"{fmt_t(dcp_def[0])} / {fmt_t(dcp_def[1])}",
            f"{ratio(dcp_def[1] or dcp_def[0], steady)} ours",
        ),
        (
            "DCP async_save, pinned stager, return",
            fmt_t(steady),
            f"{fmt_t(dcp_pin[0])} / {fmt_t(dcp_pin[1])}",
            f"{ratio(dcp_pin[1] or dcp_pin[0], steady)} ours",
        ),
        (
            "  its staging done after return (1st / 2nd)",
            fmt_t(get("ours_steps", "copy_done_after_return_s")),
            f"{fmt_t(dcp_pin_staged[0])} / {fmt_t(dcp_pin_staged[1])}",
            "ours: copy done after return",
        ),
        (
            "torch.save + fsync (blocking)",
            fmt_t(steady),
            fmt_t(get("torch_save_fsync", "s")),
            f"{ratio(get('torch_save_fsync', 's'), steady)} ours",
        ),
        (
            "persist to RAM tier + dir (after return)",
            fmt_t(get("ours_persist_ram_and_dir", "persist_after_return_s")),
            "",
            f"RAM tier in {get('ours_persist_ram_and_dir', 'ram_tier')}",
        ),
        (
            f"restore into {b.dev.type} tensors from the RAM tier",
            fmt_rate(n, get("ours_restore_ram", "s")),
            "",
            f"verified {get('ours_restore_ram', 'verified')}",
        ),
        (
            "  floor: read its files into pinned, H2D",
            "",
            fmt_rate(n, get("restore_floor", "floor_s")),
            f"read 1 / {get('restore_floor', 'threads')} threads {fmt_t(get('restore_floor', 'read_1_thread_s'))} / "
            f"{fmt_t(get('restore_floor', 'read_threads_s'))}; pin {fmt_t(get('restore_floor', 'pin_s'))}",
        ),
        (
            f"restore into {b.dev.type} tensors from a dir vs DCP load ({get('ours_restore_dir', 'cache')})",
            fmt_rate(n, get("ours_restore_dir", "s")),
            fmt_rate(n, get("dcp_load_dir", "s")),
            f"{ratio(get('dcp_load_dir', 's'), get('ours_restore_dir', 's'))} their speed; verified "
            f"{get('ours_restore_dir', 'verified')}/{get('dcp_load_dir', 'verified')}",
        ),
        ("DCP save (blocking)", "", fmt_t(get("dcp_save_blocking", "s")), ""),
    ]
    errors = [(k, v["error"]) for k, v in f.items() if "error" in v]
    widths = (46, 22, 30, 34)
    rule = "-" * (sum(widths) + 9)
    print(
        f"\n{n / 2**30:.2f} GiB of fp32 state ({b.layers} x Linear({b.args.width}) + Adam) on "
        f"{get('env', 'device_name')}; step: {b.args.rows} rows\n{rule}"
    )
    print(" | ".join(h.ljust(w) for h, w in zip(("what", "ours", "competitor", "ratio / note"), widths)))
    print(rule)
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    for k, e in errors:
        print(f"  ERROR {k}: {e}")

    targets: list[tuple[str, bool, str]] = []
    if steady is not None:
        targets.append(("steady stall <= 20 ms", steady <= 0.020, fmt_t(steady)))
    slow = get("ours_steps", "slowdown")
    if slow is not None:
        floor_slow = get("ours_steps", "floor_slowdown")
        detail = f"{slow * 100:+.2f}%" + ("" if floor_slow is None else f" (floor {floor_slow * 100:+.2f}%)")
        targets.append(("step slowdown <= 2% at one snapshot per step", slow <= 0.02, detail))
    ram = get("ours_restore_ram", "s")
    if ram is not None:
        limit = 0.5 * n / 2**33  # 0.5 s for 8 GiB
        targets.append(
            (
                f"restore from the RAM tier <= {fmt_t(limit)} (0.5 s per 8 GiB)",
                ram <= limit,
                fmt_rate(n, ram) + (f" (floor {fmt_t(rf)})" if (rf := get("restore_floor", "floor_s")) else ""),
            )
        )
    dcp_steady = dcp_def[1] or dcp_def[0]
    if dcp_steady and steady:
        targets.append(
            (
                "DCP async_save >= 100x slower to return",
                dcp_steady / steady >= 100,
                f"{dcp_steady / steady:.0f}x ({fmt_t(dcp_steady)} vs {fmt_t(steady)})",
            )
        )
    for what in ("ours_restore_ram", "ours_restore_dir", "dcp_load_dir"):
        if get(what, "verified") is False:
            targets.append((f"{what} restored every byte", False, "NOT bitwise equal"))
    print(f"\ntargets\n{rule}")
    for what, ok, detail in targets:
        print(f"  {'PASS' if ok else 'MISS'}  {what}: {detail}")
    return targets


def environment(b: Bench, work: str) -> None:
    env: dict[str, Any] = {
        "device": str(b.dev),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "state_bytes": b.nbytes,
        "tensors": len(b.named),
        "layers": b.layers,
        "width": b.args.width,
        "rows": b.args.rows,
        "cpu_count": os.cpu_count(),
        "work_dir": work,
        "tf32": torch.backends.cuda.matmul.allow_tf32,
    }
    if b.cuda:
        env["device_name"] = torch.cuda.get_device_name(b.dev)
        env["gpu_memory_gib"] = torch.cuda.get_device_properties(b.dev).total_memory / 2**30
    else:
        env["device_name"] = "CPU"
    try:
        out = subprocess.run(["df", "-T", work], capture_output=True, text=True, check=True).stdout
        env["filesystem"] = " on ".join(out.strip().splitlines()[-1].split()[1::-1])
    except (OSError, subprocess.CalledProcessError):
        pass
    emit("env", **env)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gib", type=float, default=8.0, help="state size: parameters + Adam moments (default 8)")
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu (to check the code paths)")
    p.add_argument("--width", type=int, default=None, help="layer width (default 4096 on CUDA, 512 on CPU)")
    p.add_argument("--rows", type=int, default=None, help="batch rows per step (default 8192 on CUDA, 64 on CPU)")
    p.add_argument("--steps", type=int, default=5, help="steps per half-round (default 5)")
    p.add_argument("--rounds", type=int, default=3, help="paired rounds: steps without, then with (default 3)")
    p.add_argument("--warmup", type=int, default=3, help="steps before timing (default 3)")
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls (default: full fp32)")
    p.add_argument("--skip", default="", help="comma list of phases to skip: floor,steps,dcp,save,restore")
    p.add_argument("--dir", default=None, help="parent of the temp work dir (default: the system temp dir)")
    p.add_argument("--json", default=None, help="also write every figure to this file")
    args = p.parse_args(argv)
    if args.device is None:
        if not torch.cuda.is_available():
            print("bench_gpu: no CUDA device here: nothing to measure (--device cpu exercises the code paths)")
            return 0
        args.device = "cuda"
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("bench_gpu: --device cuda asked, but no CUDA device is present")
        return 0
    args.width = args.width or (4096 if cuda else 512)
    args.rows = args.rows or (8192 if cuda else 64)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}

    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    work = tempfile.mkdtemp(prefix="ftkit-bench-gpu-", dir=args.dir)
    t_start = now()
    targets: list = []
    try:
        progress(f"building a {args.gib} GiB state on {args.device}")
        b = Bench(args)
        environment(b, work)
        if "floor" not in skip:
            progress("copy floor")
            guarded("copy_floor", lambda: phase_floor(b))
        if "steps" not in skip:
            progress("ftkit snapshot() once per step")
            guarded("ours_steps", lambda: phase_steps(b, work))
        if "dcp" not in skip:
            for i in range(2):
                progress(f"DCP async_save default, call {i + 1}")
                guarded(f"dcp_async_default_{i}", lambda i=i: dcp_async_default(b, work, i))
                free_memory()
            progress("DCP async_save with the pinned stager")
            guarded("dcp_async_pinned_stager", lambda: dcp_pinned_stager(b, work))
        if "save" not in skip:
            progress("torch.save")
            guarded("torch_save_fsync", lambda: torch_save(b, work))
        if "restore" not in skip:
            progress("restore: ours from the RAM tier and a dir, DCP load")
            guarded("restore", lambda: phase_restore(b, work))
        emit("run", seconds=now() - t_start)
        targets = table(b)
    finally:
        rmtree(work)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {"figures": FIG, "targets": [{"what": w, "pass": ok, "detail": d} for w, ok, d in targets]},
                fh,
                indent=1,
                default=str,
            )
    return 0 if all(ok for _, ok, _ in targets) else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""ftkit beside the tools a team would pick instead: torchsnapshot, torchft, NVIDIA's resiliency extension.

Run (from the repo root; the anchors are an optional extra)::

    scripts/setup.sh && .venv/bin/pip install -e '.[anchors]' && .venv/bin/python benchmarks/bench_anchors.py
    .venv/bin/python benchmarks/bench_anchors.py --gib 0.25 --small 1000 --rounds 2   # quick
    .venv/bin/python benchmarks/bench_anchors.py --only snapshot --json out.json

Four parts, each a table with ftkit's figure, every anchor's and the floor, from one run:

1. **snapshot**: the stall (until training may go on) and the time to durable (until
   the bytes are on disk and fsynced, or the tool says it is done where it does not
   fsync: then the fsync we add is shown beside it) of ftkit's `Checkpointer.snapshot`,
   torchsnapshot's `Snapshot.async_take` and NVRx's asynchronous `torch.save`
   (`TorchAsyncCheckpoint`), on the same state in the same directory, at `--gib` GiB in
   16 tensors and at `--small` small tensors; floors: a copy into reused buffers and a
   write + fsync of the same bytes. Rounds alternate the tools; medians after a
   warm-up round.
2. **restore**: each tool's own restore of what it saved, in process (into the live
   tensors) and in a fresh process (the restore call, and the whole process with its
   imports); floor: reading the bytes into reused buffers. Every restore is checked
   against the saved state's digest.
3. **recovery**: one of 2 data-parallel workers (ftkit's reference model) SIGKILLed
   mid-run. ftkit: under torchrun with warm restarts, and with the dead rank replaced
   in process (`ftkit run --replace-dead`); torchft: 2 replica groups over gloo, its
   lighthouse started here, the killed replica relaunched at once and healed from
   the survivor. Seconds from the kill to the survivors' next committed step and to
   the replacement's first step, steps lost, and whether the final state equals a
   fault-free run's bit for bit. NVRx's in-process restart: the line says why it
   cannot run here.
4. **schedule**: `ftkit drill`'s default fault schedule (a kill, a hang, a node of two
   workers lost, a crash; 4 workers, 400 steps) on ftkit's reference trainer, and the same
   faults on torchft's 4 replica groups (a hung replica killed and relaunched once its
   lighthouse's heartbeat timeout has passed, as a health check would): per fault, the
   seconds until the faulted workers train again and the steps lost; whether the final
   state is bit-exact against the tool's own fault-free run.

An anchor that is not installed, or cannot run on CPU, gets one line saying why
(the import error or the missing device) and the rest still runs. Exit status 0
(nothing here is a pass/fail target: the figures are the finding).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

# nvidia-resiliency-ext installs pynvml, which torch's CUDA module warns about on import (here
# and in the processes started from here)
PYNVML_WARNING = "ignore:The pynvml package is deprecated:FutureWarning"
os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), PYNVML_WARNING]))
warnings.filterwarnings("ignore", "The pynvml package is deprecated", FutureWarning)

import torch  # noqa: E402
import xxhash  # noqa: E402
from common import disk_bytes_of, median, now, progress, rmtree, timed  # noqa: E402

import ftkit  # noqa: E402

State = dict[str, torch.Tensor]
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ANCHORS = {"torchsnapshot": "torchsnapshot", "torchft": "torchft", "NVRx": "nvidia_resiliency_ext"}
INSTALL_HINT = "pip install -e '.[anchors]'"


# ------------------------------------------------------------ the state
def make_state(n: int, numel: int, seed: int = 0) -> State:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i:05d}.weight": torch.randn(numel, generator=g) for i in range(n)}


def digest(state: State) -> str:
    h = xxhash.xxh3_64()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


def nbytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def fsync_tree(path: str) -> None:
    """fsync every file under `path`, then the directories: what a durable save owes."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def anchor_missing(name: str) -> str | None:
    """Why the anchor cannot be imported (one line), or None."""
    try:
        importlib.import_module(ANCHORS[name])
    except Exception as e:  # ImportError, or a broken install raising anything else
        return f"not installed ({type(e).__name__}: {str(e).splitlines()[0][:160]}); {INSTALL_HINT}"
    return None


# ---------------------------------------------------------- the savers
class Saver:
    """One tool's save and restore of a state of tensors in one directory.

    Order of calls: per save, `begin(step)` -> the stall (training may go on and change
    the tensors once it returns), then `end()` -> (seconds from begin's return until the
    tool says the save is done, seconds of the fsync we add where the tool does not
    fsync); `restore(dest)` -> the newest save's state (in `dest`'s tensors where the tool
    loads in place); `stored()`; `close()`. A fresh process restores through
    `RESTORERS[name](root, dest)`."""

    name = ""
    fsyncs = True  # False: the tool says done before its bytes are fsynced

    def __init__(self, state: State, root: str):
        self.state, self.root = state, root
        os.makedirs(root, exist_ok=True)

    def begin(self, step: int) -> float:
        raise NotImplementedError

    def end(self) -> tuple[float, float]:
        raise NotImplementedError

    def restore(self, dest: State) -> State:
        return RESTORERS[self.name](self.root, dest)

    def stored(self) -> int:
        return disk_bytes_of(self.root)

    def close(self) -> None:
        pass


class FtkitSaver(Saver):
    name = "ftkit"

    def __init__(self, state: State, root: str):
        super().__init__(state, root)
        self.ck = ftkit.Checkpointer(state, tiers=[ftkit.Tier(root, keep=1)], rng=False, watchdog=False)

    def begin(self, step: int) -> float:
        self.persisted = self.ck.stats.persisted
        t0 = now()
        self.ck.snapshot(step)
        self.returned = now()
        return self.returned - t0

    def end(self) -> tuple[float, float]:
        while self.ck.stats.persisted == self.persisted and self.ck.stats.failed == 0:
            time.sleep(0.001)
        durable = now() - self.returned  # committed: data and manifest fsynced
        self.ck.wait()  # retention of the previous step, outside the figure
        return durable, 0.0

    def close(self) -> None:
        self.ck.close()


def ftkit_restore(root: str, dest: State) -> State:
    ck = ftkit.Checkpointer(dest, tiers=[ftkit.Tier(root)], rng=False, watchdog=False)
    try:
        if not ck.restore():
            raise RuntimeError(f"ftkit: nothing to restore in {root}")
    finally:
        ck.close()
    return dest


class TorchsnapshotSaver(Saver):
    """torchsnapshot 0.1.0: a new snapshot directory per take (its model); the previous one
    deleted after the next is taken, outside the figures. It writes no fsync."""

    name = "torchsnapshot"
    fsyncs = False

    def begin(self, step: int) -> float:
        from torchsnapshot import Snapshot, StateDict

        self.path = os.path.join(self.root, f"step-{step}")
        t0 = now()
        self.pending = Snapshot.async_take(self.path, {"s": StateDict(**self.state)})
        self.returned = now()
        return self.returned - t0

    def end(self) -> tuple[float, float]:
        self.pending.wait()
        done = now()
        fsync_tree(self.path)
        fsync = now() - done
        for old in os.listdir(self.root):
            if os.path.join(self.root, old) != self.path:
                rmtree(os.path.join(self.root, old))
        return done - self.returned, fsync


def torchsnapshot_restore(root: str, dest: State) -> State:
    from torchsnapshot import Snapshot, StateDict

    (newest,) = os.listdir(root)
    app = {"s": StateDict(**dest)}
    Snapshot(os.path.join(root, newest)).restore(app)
    return dict(app["s"].items())


SAVERS: dict[str, Callable[[State, str], Saver]] = {"ftkit": FtkitSaver, "torchsnapshot": TorchsnapshotSaver}
RESTORERS: dict[str, Callable[[str, State], State]] = {"ftkit": ftkit_restore, "torchsnapshot": torchsnapshot_restore}


def add_nvrx() -> str | None:
    """NVRx's asynchronous save (as it comes, and after a clone), when it runs here; else why not."""
    why = anchor_missing("NVRx")
    if why:
        return why
    try:
        import anchor_nvrx
    except Exception as e:
        return f"cannot run: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    for name, clone in (("NVRx", False), ("NVRx + clone", True)):
        SAVERS[name] = lambda state, root, name=name, clone=clone: anchor_nvrx.NvrxSaver(state, root, name, clone)
        RESTORERS[name] = anchor_nvrx.nvrx_restore
    return None


def consistent(saver: Saver, step: int) -> bool:
    """What a save holds when training changes the tensors as soon as the stall ends: the
    values at the save (a snapshot), or whatever the tensors held when written."""
    at_save = digest(saver.state)
    saver.begin(step)
    with torch.no_grad():
        for t in saver.state.values():
            t.add_(1.0)
    saver.end()
    return digest(saver.restore({k: torch.zeros_like(v) for k, v in saver.state.items()})) == at_save


# ----------------------------------------------------------- the floors
def copy_floor(src: State, dst: State) -> float:
    def copy() -> None:
        for k, v in src.items():
            dst[k].copy_(v)

    return min(timed(copy) for _ in range(3))


def write_floor(state: State, path: str) -> float:
    t0 = now()
    with open(path, "wb", buffering=0) as f:
        for t in state.values():
            f.write(t.numpy().data)
        os.fsync(f.fileno())
    return now() - t0


def write_floor_parallel(state: State, path: str, streams: int = 2) -> float:
    """The same bytes in `streams` files written at once, each fsynced: the disk here is faster
    with more than one stream in flight (torchsnapshot and NVRx write several files)."""
    views = [t.numpy().data.cast("B") for t in state.values()]
    total = sum(len(v) for v in views)

    def write(i: int) -> None:
        at, lo, hi = 0, i * total // streams, (i + 1) * total // streams
        with open(f"{path}.{i}", "wb", buffering=0) as f:
            for v in views:
                a, b = max(lo, at), min(hi, at + len(v))
                if a < b:
                    f.write(v[a - at : b - at])
                at += len(v)
            os.fsync(f.fileno())

    t0 = now()
    threads = [threading.Thread(target=write, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return now() - t0


def read_floor(dest: State, path: str) -> float:
    t0 = now()
    with open(path, "rb", buffering=0) as f:
        for t in dest.values():
            f.readinto(t.numpy().data)
    return now() - t0


# ------------------------------------------------------ part 1 and 2
def restore_in_child(tool: str, root: str, n: int, numel: int) -> dict[str, Any]:
    """A fresh interpreter restores `tool`'s newest save into zeroed tensors of the shapes."""
    t0 = time.time()
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child-restore", tool, root, str(n), str(numel)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    wall = time.time() - t0
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["?"])[-1]
        raise RuntimeError(f"{tool} restore in a fresh process failed: {tail[:200]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["process_s"] = wall
    return res


def child_restore(tool: str, root: str, n: int, numel: int) -> int:
    dest = {f"layer{i:05d}.weight": torch.zeros(numel) for i in range(n)}
    if tool.startswith("NVRx"):
        add_nvrx()
    t0 = now()
    loaded = RESTORERS[tool](root, dest)
    t = now() - t0
    print(json.dumps({"restore_s": t, "digest": digest(loaded)}))
    return 0


def measure_shape(label: str, n: int, numel: int, work: str, rounds: int, tools: list[str]) -> dict[str, Any]:
    state = make_state(n, numel)
    size = nbytes(state)
    want = digest(state)
    out: dict[str, Any] = {"label": label, "tensors": n, "bytes": size, "tools": {}, "floors": {}}
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    for t in dst.values():
        t.zero_()  # touched: the floor copies into resident memory, as a steady snapshot does
    savers = {name: SAVERS[name](state, os.path.join(work, label, name)) for name in tools}
    samples: dict[str, dict[str, list[float]]] = {name: {"stall": [], "durable": [], "fsync": []} for name in tools}
    floors: dict[str, list[float]] = {"copy": [], "write_fsync": [], "write_fsync_2": [], "read": []}
    floor_file = os.path.join(work, label, "floor.bin")
    try:
        for r in range(rounds + 1):  # round 0: every tool's first call (allocations), left out
            progress(f"{label}: round {r}/{rounds}")
            order = tools if r % 2 == 0 else tools[::-1]
            with torch.no_grad():
                for t in state.values():
                    t.add_(1.0)  # a new step's values, the same for every tool in the round
            for name in order:
                stall = savers[name].begin(r + 1)
                durable, fsync = savers[name].end()
                if r:
                    samples[name]["stall"].append(stall)
                    samples[name]["durable"].append(durable)
                    samples[name]["fsync"].append(fsync)
            if r:
                floors["copy"].append(copy_floor(state, dst))
                floors["write_fsync"].append(write_floor(state, floor_file))
                floors["write_fsync_2"].append(write_floor_parallel(state, floor_file))
                floors["read"].append(read_floor(dst, floor_file))
            gc.collect()
        final = digest(state)
        for name in tools:
            saver = savers[name]
            rec: dict[str, Any] = {
                "stall_s": median(samples[name]["stall"]),
                "durable_s": median(samples[name]["durable"]),
                "fsync_added_s": median(samples[name]["fsync"]),
                "rounds": samples[name],
                "fsyncs": saver.fsyncs,
                "stored_bytes": saver.stored(),
            }
            dest = {k: torch.zeros_like(v) for k, v in state.items()}
            t0 = now()
            loaded = saver.restore(dest)
            rec["restore_in_process_s"] = now() - t0
            if digest(loaded) != final:
                raise AssertionError(f"{name} restored other values than it saved")
            del dest, loaded
            progress(f"{label}: {name} restore in a fresh process")
            child = restore_in_child(name, saver.root, n, numel)
            if child["digest"] != final:
                raise AssertionError(f"{name} restored other values than it saved (fresh process)")
            rec["restore_fresh_s"] = child["restore_s"]
            rec["restore_fresh_process_s"] = child["process_s"]
            out["tools"][name] = rec
            gc.collect()
        for name in tools:  # last: it changes the state
            progress(f"{label}: {name} with the tensors changed as soon as the stall ends")
            out["tools"][name]["snapshot_consistent"] = consistent(savers[name], rounds + 2)
    finally:
        for saver in savers.values():
            try:
                saver.close()
            except Exception:
                pass
    out["floors"] = {k + "_s": median(v) for k, v in floors.items()}
    out["floor_rounds"] = floors
    assert want != final  # the rounds changed the state: each save had new values
    return out


def print_shape(res: dict[str, Any], why_not: dict[str, str]) -> None:
    size = res["bytes"]
    fl = res["floors"]
    print(f"\n{res['label']}: {res['tensors']:,} fp32 tensors, {size / 2**20:,.1f} MiB (medians)")
    print(
        f"  floors (no tool): copy {fl['copy_s'] * 1e3:.1f} ms, write + fsync {fl['write_fsync_s'] * 1e3:.1f} ms "
        f"(one file; two at once {fl['write_fsync_2_s'] * 1e3:.1f} ms), read {fl['read_s'] * 1e3:.1f} ms"
    )
    print(
        f"  {'tool':<15}{'stall ms':>10}{'x copy':>8}{'durable ms':>12}{'x write':>8}{'snapshot':>9}"
        f"{'restore ms':>12}{'x read':>8}{'fresh ms':>10}{'process s':>11}{'stored':>15}"
    )
    for name, r in res["tools"].items():
        durable = r["durable_s"] + r["fsync_added_s"]
        note = "" if r["fsyncs"] else f"  (no fsync of its own: {r['durable_s'] * 1e3:.0f} ms + ours)"
        print(
            f"  {name:<15}{r['stall_s'] * 1e3:>10.1f}{r['stall_s'] / fl['copy_s']:>8.2f}"
            f"{durable * 1e3:>12.1f}{durable / fl['write_fsync_s']:>8.2f}"
            f"{'yes' if r['snapshot_consistent'] else 'NO':>9}"
            f"{r['restore_in_process_s'] * 1e3:>12.1f}{r['restore_in_process_s'] / fl['read_s']:>8.2f}"
            f"{r['restore_fresh_s'] * 1e3:>10.1f}{r['restore_fresh_process_s']:>11.2f}{r['stored_bytes']:>15,}{note}"
        )
    for name, why in why_not.items():
        print(f"  {name:<15}{why}")
    print(
        "  snapshot: a save made while training changes the tensors right after the stall holds the values "
        "at the save (NO: it holds what was in memory when written)"
    )


# -------------------------------------------------------------- part 3
def recovery(args: argparse.Namespace, why_not: dict[str, str]) -> dict[str, Any]:
    import anchor_recovery

    out: dict[str, Any] = {}
    progress("recovery: ftkit")
    out["ftkit"] = anchor_recovery.ftkit_recovery(args.steps, args.kill_at, args.step_time)
    if "torchft" in why_not:
        out["torchft"] = {"skipped": why_not["torchft"]}
    else:
        progress("recovery: torchft")
        try:
            out["torchft"] = anchor_recovery.torchft_recovery(args.steps, args.kill_at, args.step_time)
        except Exception as e:
            out["torchft"] = {"skipped": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    if "NVRx" in why_not:
        out["NVRx in-process restart"] = {"skipped": why_not["NVRx"]}
    else:
        import anchor_nvrx

        out["NVRx in-process restart"] = {"skipped": anchor_nvrx.INPROCESS_WHY}
    return out


def print_recovery(res: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\nrecovery: 2 data-parallel workers, the reference model, {args.steps} steps of "
        f"+{args.step_time * 1e3:.0f} ms, worker 1 SIGKILLed at step {args.kill_at}"
    )
    print(f"  {'tool, mode':<40}{'survivors on s':>15}{'replacement s':>15}{'steps lost':>11}{'bit-exact':>11}")
    for tool, runs in res.items():
        if "skipped" in runs:
            print(f"  {tool:<40}{runs['skipped']}")
            continue
        for mode, r in runs.items():
            if "skipped" in r:
                print(f"  {tool + ', ' + mode:<40}{r['skipped']}")
                continue
            surv = "-" if r.get("survivors_next_step_s") is None else f"{r['survivors_next_step_s']:.2f}"
            print(
                f"  {tool + ', ' + mode:<40}{surv:>15}{r['replacement_step_s']:>15.2f}"
                f"{r['steps_lost']:>11}{'yes' if r['bit_exact'] else 'no':>11}"
            )
            if r.get("note"):
                print(f"      {r['note']}")


# -------------------------------------------------------------- part 4
DRILL_SCHEDULE = "kill@70:rank=1,hang@160:rank=2,node@250:node=1,crash@340:rank=3"  # ftkit drill's default
# The same faults for torchft's 4 replica groups of one process (a node: two groups at once).
TORCHFT_SCHEDULE = "kill@70:replica=1,hang@160:replica=2,node@250:replicas=0+1,crash@340:replica=3"


def schedule(args: argparse.Namespace, why_not: dict[str, str]) -> dict[str, Any]:
    """ftkit drill's default schedule on 4 workers, through ftkit and through torchft."""
    out: dict[str, Any] = {}
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        progress("schedule: ftkit drill")
        cmd = [sys.executable, "-m", "ftkit", "drill", "--steps", "400", "--step-time", str(args.drill_step_time)]
        done = subprocess.run([*cmd, "--json", path, "--quiet"], capture_output=True, text=True, timeout=1800)
        res = json.load(open(path)) if os.path.getsize(path) else {}
        if not res:
            out["ftkit"] = {"skipped": f"failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:200]}"}
        else:
            out["ftkit"] = {
                "bit_exact": bool(res.get("bitwise_equal")),
                "passed": res.get("passed"),
                "faults": [
                    {
                        "fault": f"{f['kind']}@{f['step']}",
                        "back_s": f["outcome"].get("recovery_s"),
                        "steps_lost": f["outcome"].get("steps_lost"),
                    }
                    for f in res.get("faults", [])
                ],
            }
    finally:
        os.unlink(path)
    if "torchft" in why_not:
        out["torchft"] = {"skipped": why_not["torchft"]}
        return out
    for mode, extra in (("torchft", []), ("torchft, sync quorum + RNG", ["--sync-quorum", "--transfer-rng"])):
        progress(f"schedule: {mode}")
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            cmd = [sys.executable, os.path.join(HERE, "anchor_torchft.py"), "--replicas", "4", "--steps", "400"]
            cmd += ["--step-time", str(args.drill_step_time), "--schedule", TORCHFT_SCHEDULE, *extra, "--json", path]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=REPO)
            res = (json.load(open(path)) if os.path.getsize(path) else {}).get("schedule") or {}
        finally:
            os.unlink(path)
        if not res or res.get("error"):
            why = res.get("error") or (done.stderr.strip().splitlines() or ["?"])[-1]
            out[mode] = {"skipped": f"failed: {str(why)[:200]}"}
            continue
        out[mode] = {
            "bit_exact": bool(res.get("bit_exact")),
            "max_abs_param_diff": res.get("max_abs_param_diff"),
            "faults": [
                {
                    "fault": f"{f['kind']}@{f['step']}",
                    "back_s": f.get("replacement_caught_up_s"),
                    "survivors_s": f.get("survivors_next_commit_s"),
                    "steps_lost": f.get("steps_lost"),
                    "short_handed_steps": len(f.get("survivors_steps_with_fewer_than_all") or []),
                }
                for f in res.get("faults", [])
            ],
        }
    return out


def print_schedule(res: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\nftkit drill's default schedule ({DRILL_SCHEDULE}), 4 workers, 400 steps of "
        f"+{args.drill_step_time * 1e3:.0f} ms; per fault: seconds until the faulted worker(s) train again, steps lost"
    )
    for tool, r in res.items():
        if "skipped" in r:
            print(f"  {tool:<30}{r['skipped']}")
            continue
        exact = "bit-exact" if r["bit_exact"] else f"NOT bit-exact (max diff {r.get('max_abs_param_diff') or 0:.2g})"
        print(f"  {tool}: {exact}")
        for f in r["faults"]:
            back = "-" if f["back_s"] is None else f"{f['back_s']:.2f} s"
            line = f"    {f['fault']:<10} back {back}, {f['steps_lost']} step(s) lost"
            if "short_handed_steps" in f:
                line += (
                    f"; the others went on after {f['survivors_s']} s and trained {f['short_handed_steps']} "
                    "step(s) without the faulted worker(s)"
                )
            print(line)
    print(
        "  back: ftkit, until the job is back at the step it had reached (the lost step recomputed); torchft,"
        " until the relaunched worker commits a step"
    )


# ---------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="the large state, in 16 fp32 tensors")
    p.add_argument("--small", type=int, default=4000, help="the many-tensor state: this many 16 KiB tensors")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60, help="recovery: steps of the run")
    p.add_argument("--kill-at", type=int, default=20, help="recovery: the step worker 1 is killed at")
    p.add_argument("--step-time", type=float, default=0.1, help="recovery: extra seconds per step")
    p.add_argument("--drill-step-time", type=float, default=0.05, help="schedule: extra seconds per step")
    p.add_argument("--only", choices=("snapshot", "recovery", "schedule"), help="one part (snapshot includes restore)")
    p.add_argument("--dir", help="the disk to write to (default: a temporary directory under the repo)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--child-restore", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_restore:
        tool, root, n, numel = args.child_restore
        return child_restore(tool, root, int(n), int(numel))

    torch.set_num_threads(1)
    why_not = {name: why for name in ("torchsnapshot", "torchft") if (why := anchor_missing(name))}
    if why := add_nvrx():
        why_not["NVRx"] = why
    versions = {"torch": torch.__version__, "ftkit": ftkit.__version__}
    for name, mod in ANCHORS.items():
        try:
            from importlib.metadata import version

            versions[name] = version({"NVRx": "nvidia-resiliency-ext"}.get(name, mod))
        except Exception:
            pass  # not installed: said below
    print(f"load average {os.getloadavg()[0]:.2f}; " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    for name, why in why_not.items():
        print(f"{name}: {why}")
    result: dict[str, Any] = {"versions": versions, "unavailable": why_not, "shapes": [], "recovery": None}
    result["schedule"] = None
    work = tempfile.mkdtemp(prefix="ftkit-bench-anchors-", dir=args.dir or REPO)
    try:
        if args.only in (None, "snapshot"):
            tools = [t for t in SAVERS if t not in why_not]
            big = max(1, int(args.gib * 2**30 / 4 / 16))
            for label, n, numel in (("large", 16, big), ("many", args.small, 4096)):
                res = measure_shape(label, n, numel, work, args.rounds, tools)
                result["shapes"].append(res)
                print_shape(res, {k: v for k, v in why_not.items() if k != "torchft"})
                rmtree(os.path.join(work, label))
        if args.only in (None, "recovery"):
            result["recovery"] = recovery(args, why_not)
            print_recovery(result["recovery"], args)
        if args.only in (None, "schedule"):
            result["schedule"] = schedule(args, why_not)
            print_schedule(result["schedule"], args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Recovery from a killed worker: ftkit and torchft on the same model, world size and fault.

Used by bench_anchors.py (part 3). Both run ftkit's reference model (ftkit/drill/reference.py:
the same seed, batches and AdamW) on 2 data-parallel workers over gloo with a fixed extra
sleep per step, and SIGKILL worker 1 once it has finished step `kill_at`:

* ftkit: the reference trainer under torchrun with a RAM tier every step, warm restarts
  (forked from a zygote), and with the dead rank replaced in process (`ftkit run
  --replace-dead`, the survivors keep their process);
* torchft: 2 replica groups of one worker each, its lighthouse on loopback; the killed
  replica relaunched at once, as its launcher would, healing from the survivor
  (anchor_torchft_worker.py).

Each returns, per mode: seconds from the kill to the survivors' next committed step and to
the replacement's first committed step, the steps lost (committed work redone or
discarded) and whether the final model and optimizer state equal a fault-free run's bit
for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

import bench_recovery  # noqa: E402  (benchmarks/ is first on sys.path)

from ftkit.drill.verify import compare_states  # noqa: E402
from ftkit.runtime.warm import zygote as warm  # noqa: E402
from ftkit.runtime.warm.client import REPLACE_ENV  # noqa: E402
from ftkit.tools.report import analyze, epoch  # noqa: E402


def _ftkit_run(zygote: warm.Zygote, steps: int, kill_at: int | None, step_time: float, replaced: bool) -> dict:
    root = tempfile.mkdtemp(prefix="ftkit-bench-anchors-rec-")
    final = os.path.join(root, "final.pt")
    extra = ["--final-out", final, "--step-time", str(step_time)]
    try:
        if replaced:
            proc = bench_recovery.launch(root, 2, steps, ["--in-process", *extra], zygote, {REPLACE_ENV: "1"})
        else:
            proc = bench_recovery.launch(root, 2, steps, extra, zygote)
        out: dict[str, Any] = {"final": None}
        if kill_at is not None:
            bench_recovery.wait_step(root, 1, kill_at, proc)
            evs = bench_recovery.events(root)
            pid = [e for e in evs if e["event"] == "start" and e["rank"] == 1][-1]["pid"]
            t_fault = time.time()
            os.kill(pid, signal.SIGKILL)
        if proc.wait(timeout=600) != 0:
            raise RuntimeError("the ftkit run did not finish")
        keep = os.path.join(tempfile.gettempdir(), f"ftkit-anchors-final-{os.getpid()}-{time.monotonic_ns()}.pt")
        shutil.move(final, keep)
        out["final"] = keep
        if kill_at is not None:
            evs = bench_recovery.events(root) + [
                {"t": t_fault, "rank": 1, "attempt": 0, "event": "fault", "kind": "SIGKILL"}
            ]
            inc = analyze(sorted(evs, key=lambda e: e["t"])).incidents[0]
            after = [e for e in evs if e["event"] == "step" and e["t"] > t_fault and epoch(e) > (0, 0)]
            out.update(
                survivors_next_step_s=min(e["t"] for e in after if e["rank"] == 0) - t_fault,
                replacement_step_s=min(e["t"] for e in after if e["rank"] == 1) - t_fault,
                steps_lost=inc.steps_lost,
                restore_source=inc.restore_source,
            )
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def ftkit_recovery(steps: int, kill_at: int, step_time: float) -> dict[str, Any]:
    zygote = warm.start(preload=("ftkit.drill.reference",))
    finals: list[str] = []
    try:
        clean = _ftkit_run(zygote, steps, None, step_time, replaced=False)
        finals.append(clean["final"])
        out: dict[str, Any] = {}
        for mode, replaced in (("warm restart (torchrun)", False), ("dead rank replaced in process", True)):
            r = _ftkit_run(zygote, steps, kill_at, step_time, replaced)
            finals.append(r["final"])
            errors: list[str] = []
            r["bit_exact"] = compare_states(r.pop("final"), clean["final"], errors)
            r["note"] = f"restored from {r.pop('restore_source')}" + (f"; {errors[0]}" if errors else "")
            out[mode] = r
        return out
    finally:
        zygote.stop()
        for f in finals:
            if f and os.path.exists(f):
                os.unlink(f)


def torchft_recovery(steps: int, kill_at: int, step_time: float) -> dict[str, Any]:
    """torchft as it comes (async quorum), and set up for exactness (sync quorum, the RNG
    state registered with the manager): each a fault-free and a faulted run
    (anchor_torchft.py, in a process of its own)."""
    out: dict[str, Any] = {}
    modes = (("as it comes (async quorum)", []), ("sync quorum + RNG transferred", ["--sync-quorum", "--transfer-rng"]))
    for mode, extra in modes:
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            cmd = [sys.executable, os.path.join(HERE, "anchor_torchft.py"), "--steps", str(steps)]
            cmd += ["--kill-at", str(kill_at), "--step-time", str(step_time), *extra, "--json", path]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
            res = json.load(open(path)) if os.path.getsize(path) else {}
        finally:
            os.unlink(path)
        fault, final = res.get("fault", {}), res.get("final_state", {})
        if done.returncode != 0 or "error" in fault or not isinstance(final.get("fault_r0_vs_fault_free_r0"), dict):
            why = res.get("error") or fault.get("error") or (done.stderr.strip().splitlines() or ["?"])[-1]
            out[mode] = {"skipped": f"failed: {str(why)[:200]}"}
            continue
        exact = [final[k] for k in ("fault_r0_vs_fault_free_r0", "fault_r1_vs_fault_free_r0")]
        alone = fault.get("survivor_steps_trained_alone") or []
        skipped = fault.get("replica1_batches_skipped_steps") or []
        out[mode] = {
            "survivors_next_step_s": fault.get("survivor_next_commit_s"),
            "replacement_step_s": fault.get("replacement_caught_up_s"),
            "steps_lost": fault.get("steps_lost"),
            "bit_exact": all(e["model_equal"] and e["optim_equal"] for e in exact),
            "survivor_alone_steps": alone,
            "batches_never_trained": len(skipped),
            "max_param_diff": max(e["max_abs_param_diff"] for e in exact),
            "relaunch_startup_s": fault.get("relaunch", {}).get("startup_to_first_quorum_s"),
            "note": (
                f"survivor trained {len(alone)} step(s) alone; worker 1's batches of {len(skipped)} step(s) "
                f"never trained; final weights off by up to {max(e['max_abs_param_diff'] for e in exact):.2g}"
                if skipped or alone
                else "every batch trained"
            ),
        }
    return out

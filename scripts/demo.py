#!/usr/bin/env python3
"""The README's demo: train, get killed, inspect and restore from the CLI, resume.

    python scripts/demo.py [--run-dir DIR] [--steps 40] [--kill-at 23]   (scripts/demo.sh sets up .venv first)

1. starts the reference trainer with snapshots to a local directory;
2. SIGKILLs it mid-run (as an OOM killer or a lost node would);
3. runs `ftkit ls`, `ftkit verify` and `ftkit restore` on what it left;
4. restarts the trainer, which resumes from the newest snapshot and finishes;
5. trains the same steps without interruption and compares the final weights
   bit for bit.

Exits 0 only if the resumed run equals the uninterrupted one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import torch


def _trainer(ckpt: str, steps: int, final_out: str, step_time: float = 0.0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ftkit.drill.reference",
        "--ckpt",
        ckpt,
        "--steps",
        str(steps),
        "--final-out",
        final_out,
        "--step-time",
        str(step_time),
    ]


def _cli(*args: str) -> int:
    cmd = [sys.executable, "-m", "ftkit", *args]
    print(f"\n$ ftkit {' '.join(args)}", flush=True)
    return subprocess.run(cmd).returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="ftkit demo: kill a training run and bring it back")
    p.add_argument("--run-dir", help="where to put checkpoints (default: a temporary directory)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=23)
    args = p.parse_args(argv)
    if not 0 < args.kill_at < args.steps:
        p.error("--kill-at must be between 0 and --steps")
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="ftkit-demo-")
    os.makedirs(run_dir, exist_ok=True)
    ckpt = os.path.join(run_dir, "ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)
    resumed_out = os.path.join(run_dir, "final-resumed.pt")
    reference_out = os.path.join(run_dir, "final-reference.pt")

    print(f"== 1. training {args.steps} steps with snapshots to {ckpt}; SIGKILL at step {args.kill_at}")
    proc = subprocess.Popen(_trainer(ckpt, args.steps, resumed_out, step_time=0.05), stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        print("   " + line.rstrip(), flush=True)
        if line.startswith(f"step {args.kill_at} "):
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    print(f"   -> trainer killed (exit code {proc.returncode})")

    print("\n== 2. what the killed run left behind")
    if _cli("ls", ckpt) != 0 or _cli("verify", ckpt, "--all") != 0:
        print("demo: the checkpoint directory is not usable", file=sys.stderr)
        return 1
    export = os.path.join(run_dir, "exported.pt")
    if os.path.exists(export):
        os.remove(export)
    if _cli("restore", ckpt, "--out", export) != 0:
        return 1
    exported = torch.load(export, weights_only=True)
    print(
        f"   exported file holds step {exported['_ftkit']['step']}: "
        f"{len(exported['model'])} model tensors, optimizer, scheduler, RNG state"
    )

    print("\n== 3. restarting the trainer: it resumes from the newest snapshot")
    rc = subprocess.run(_trainer(ckpt, args.steps, resumed_out)).returncode
    if rc != 0:
        print(f"demo: resumed trainer failed with exit code {rc}", file=sys.stderr)
        return 1

    print("\n== 4. the same run without any failure, for comparison")
    ref_ckpt = os.path.join(run_dir, "ckpt-reference")
    shutil.rmtree(ref_ckpt, ignore_errors=True)
    rc = subprocess.run(_trainer(ref_ckpt, args.steps, reference_out), stdout=subprocess.DEVNULL).returncode
    if rc != 0:
        return 1
    a = torch.load(resumed_out, weights_only=True)
    b = torch.load(reference_out, weights_only=True)
    same = all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])
    same = same and all(
        torch.equal(x, y)
        for sa, sb in zip(a["optim"]["state"].values(), b["optim"]["state"].values())
        for x, y in zip(sa.values(), sb.values())
        if isinstance(x, torch.Tensor)
    )
    print(
        f"\n== result: killed-and-resumed run {'EQUALS' if same else 'DIFFERS FROM'} the uninterrupted run "
        f"bit for bit ({len(b['model'])} model tensors and the optimizer state compared)"
    )
    print(f"   files are in {run_dir}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

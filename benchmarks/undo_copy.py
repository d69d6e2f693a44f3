"""What a restore's undo copy costs: the live state copied aside before the first write.

A restore reads straight into the live tensors and must leave them as they were when it
fails (ftkit/restore/undo.py), so it first copies every live tensor into a staging slot.
This times `UndoCopy.take` (the state's walk, the slot, the copy) and `put_back_bytes`
beside the floor of the same bytes moved with no ftkit code: `copy_` into one new buffer of the
state's size (first-touch page faults, as into a new slot) and into the same buffer again.

    python benchmarks/undo_copy.py [--mib 64] [--tensors 32] [--rounds 5] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ftkit.restore.undo import UndoCopy
from ftkit.save.staging import StagingArena


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=float, default=64.0)
    p.add_argument("--tensors", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    n = int(args.mib * 2**20 / 4 / args.tensors)
    state = {f"t{i}": torch.randn(n) for i in range(args.tensors)}
    nbytes = n * 4 * args.tensors
    got: dict[str, list[float]] = {k: [] for k in ("take_new", "take_reused", "put_back", "floor_new", "floor_reused")}
    for _ in range(args.rounds):
        arena = StagingArena(slots=2, pin=False)
        t0 = time.perf_counter()
        with UndoCopy.take(state, rng=True, rank=0, arena=arena) as undo:
            t1 = time.perf_counter()
            undo.put_back_bytes()
            t2 = time.perf_counter()
            undo.keep()
        t3 = time.perf_counter()
        with UndoCopy.take(state, rng=True, rank=0, arena=arena) as undo:
            t4 = time.perf_counter()
            undo.keep()
        arena.close()
        got["take_new"].append(t1 - t0)
        got["put_back"].append(t2 - t1)
        got["take_reused"].append(t4 - t3)
        # The floor: one new buffer of the state's size (as a new slot is), each tensor copied into its place.
        t5 = time.perf_counter()
        flat = torch.empty(nbytes, dtype=torch.uint8)
        fresh = [flat[i * n * 4 : (i + 1) * n * 4].view(torch.float32) for i in range(args.tensors)]
        for dst, src in zip(fresh, state.values()):
            dst.copy_(src)
        t6 = time.perf_counter()
        for dst, src in zip(fresh, state.values()):
            dst.copy_(src)
        t7 = time.perf_counter()
        got["floor_new"].append(t6 - t5)
        got["floor_reused"].append(t7 - t6)
        del fresh, flat
    med = {k: statistics.median(v) for k, v in got.items()}
    print(f"state: {nbytes / 2**20:.0f} MiB fp32 in {args.tensors} tensors; median of {args.rounds} rounds")
    print(f"{'ftkit':<44} {'ms':>7} | {'floor (no ftkit code)':<34} {'ms':>7} | ratio")
    rows = [
        ("UndoCopy.take, a new staging slot", "take_new", "copy_ into fresh memory", "floor_new"),
        ("UndoCopy.take, the arena's slot reused", "take_reused", "copy_ into reused memory", "floor_reused"),
        ("put_back_bytes (a failed candidate)", "put_back", "copy_ into reused memory", "floor_reused"),
    ]
    for name, ours, floor_name, floor in rows:
        print(
            f"{name:<44} {med[ours] * 1e3:7.1f} | {floor_name:<34} {med[floor] * 1e3:7.1f} | "
            f"{med[ours] / med[floor]:.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": nbytes, **{k: v * 1e3 for k, v in med.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

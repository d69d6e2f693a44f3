"""A training job for the distributed tests, run under torchrun (gloo, CPU).

    python -m torch.distributed.run --standalone --nproc-per-node N tests/support/dist_worker.py \
        --mode save|restore --parallel ddp|fsdp --ckpt URL --ref FILE [--steps 3]

save:    train a small model for --steps steps with a snapshot each step, then
         rank 0 writes the full (unsharded) model and optimizer tensors to --ref.
restore: build the model with another seed, ck.restore(), and compare every
         tensor, gathered to full size, with --ref; prints "RESTORED step=S"
         and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import ftkit


def build(parallel: str, seed: int, device: str = "cpu"):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 300), nn.ReLU(), nn.Linear(300, 1024), nn.ReLU(), nn.Linear(1024, 7))
    model = model.to(device)
    if parallel == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def own(rank: int) -> dict:
    """A rank's own state (ftkit.RankLocal): different on every rank, tensors and plain values."""
    return {"rank": rank, "seen": torch.arange(3) + 10 * rank, "note": f"rank {rank}"}


def check_own(mine: dict, rank: int, saved_world: int) -> None:
    """Rank r restored its own entry; a rank the checkpoint had none for kept its live one."""
    want = own(rank) if rank < saved_world else {"rank": -1, "seen": torch.zeros(3, dtype=torch.long), "note": ""}
    if mine["rank"] != want["rank"] or not torch.equal(mine["seen"], want["seen"]) or mine["note"] != want["note"]:
        raise AssertionError(f"rank {rank}: rank-local state {mine} is not {want}")


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_state(model, opt) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": full(v).detach().clone() for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"optim/{pid}/{k}"] = full(v).detach().clone()
    return out


def save(
    rank: int,
    world: int,
    parallel: str,
    ckpt: str,
    ref: str,
    steps: int = 3,
    die: tuple[int, int] = (-1, -1),
    commit_timeout: float = 300.0,
    sync: bool = False,
) -> str:
    """Train and snapshot; `sync` waits for each step's commit on every rank."""
    model, opt = build(parallel, seed=1)
    state = {"model": model, "optim": opt, "meta": {"parallel": parallel}, "own": ftkit.RankLocal(own(rank))}
    with ftkit.Checkpointer(state, [ftkit.Tier(ckpt, keep=5)], commit_timeout_s=commit_timeout) as ck:
        for step in range(1, steps + 1):
            g = torch.Generator().manual_seed(step * 100 + rank)
            x = torch.randn(8, 16, generator=g)
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if (rank, step) == die:
                print(f"DYING rank={rank} step={step}", flush=True)
                os._exit(17)  # no flush, no goodbye: a crashed process
            ck.snapshot(step)
            if sync:
                ck.wait()
                dist.barrier()  # rank 0 has committed this step before anyone goes on
        ck.wait()
        full_ref = full_state(model, opt)
    if rank == 0:
        torch.save(full_ref, ref)
    return f"SAVED rank={rank} world={world}"


def restore(rank: int, world: int, parallel: str, ckpt: str, ref: str, saved_world: int = 4) -> str:
    model, opt = build(parallel, seed=1000 + rank)
    mine = {"rank": -1, "seen": torch.zeros(3, dtype=torch.long), "note": ""}
    state = {"model": model, "optim": opt, "meta": {}, "own": ftkit.RankLocal(mine)}
    with ftkit.Checkpointer(state, [ftkit.Tier(ckpt, keep=5)]) as ck:
        step = ck.restore()
    check_own(mine, rank, saved_world)
    got = full_state(model, opt)
    expect = torch.load(ref, weights_only=True)
    bad = [k for k in expect if k not in got or not torch.equal(expect[k], got[k])]
    if bad or set(got) != set(expect) or state["meta"] != {"parallel": parallel}:
        raise AssertionError(f"rank {rank}: differs: {bad[:5]}, extra {sorted(set(got) - set(expect))[:5]}")
    return f"RESTORED rank={rank} world={world} step={step}"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("save", "restore"), required=True)
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--ref", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--die", help="RANK:STEP: that rank exits abruptly before snapshotting STEP")
    p.add_argument("--commit-timeout", type=float, default=300.0)
    p.add_argument("--sync", action="store_true", help="wait for every step's commit")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.mode == "save":
        die = tuple(map(int, args.die.split(":"))) if args.die else (-1, -1)
        print(
            save(rank, world, args.parallel, args.ckpt, args.ref, args.steps, die, args.commit_timeout, args.sync),
            flush=True,
        )
    else:
        print(restore(rank, world, args.parallel, args.ckpt, args.ref), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())


# ------------------------------------------------------- RAM and peer tiers
def ram_tiers(disk: str, disk_every: int):
    compress = os.environ.get("FTKIT_TEST_RAM_COMPRESS") or None  # zstd: reports go inline, not by layout
    return [ftkit.Tier("ram", replicas=1, compress=compress), ftkit.Tier(disk, every=disk_every, keep=5)]


def ram_save(rank: int, world: int, parallel: str, disk: str, refs: str, steps: int = 3, disk_every: int = 100) -> str:
    """Snapshot every step to RAM (+ a peer replica) and disk every `disk_every`; refs per step."""
    model, opt = build(parallel, seed=1)
    state = {"model": model, "optim": opt, "meta": {"parallel": parallel}, "own": ftkit.RankLocal(own(rank))}
    with ftkit.Checkpointer(state, ram_tiers(disk, disk_every)) as ck:
        for step in range(1, steps + 1):
            g = torch.Generator().manual_seed(step * 100 + rank)
            loss = model(torch.randn(8, 16, generator=g)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ck.snapshot(step)
            ck.wait()
            ref = full_state(model, opt)
            if rank == 0:
                torch.save(ref, f"{refs}/ref-{step}.pt")
            dist.barrier()  # every rank's RAM tier holds this step now
        assert ck.stats.failed == 0
    return f"SAVED rank={rank}"


def ram_store_growth(rank: int, world: int, disk: str, steps: tuple[int, int]) -> dict:
    """Snapshot every step to RAM + peer, a dict of the state growing by a tensor at every step
    after steps[0] (a new layout each time); the store's key count after steps[0] and after
    steps[1]. Then node 1 loses its RAM, every tensor is zeroed and the last step restored."""
    import shutil

    from torch.distributed.distributed_c10d import _get_default_store

    from ftkit.tiers.ram import job_dir

    model, opt = build("ddp", seed=1)
    grown: dict[str, torch.Tensor] = {}
    counts = []
    with ftkit.Checkpointer({"model": model, "optim": opt, "grown": grown}, ram_tiers(disk, 10**6)) as ck:
        for step in range(1, steps[1] + 1):
            loss = model(torch.randn(8, 16)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step > steps[0]:
                grown[f"t{step}"] = torch.full((step,), float(step))
            ck.snapshot(step)
            if step in steps:
                ck.wait()
                dist.barrier()
                counts.append(_get_default_store().num_keys())
                dist.barrier()
        assert ck.stats.failed == 0
        saved = {**full_state(model, opt), **{f"grown/{k}": v.clone() for k, v in grown.items()}}
        if rank == 2:
            shutil.rmtree(os.path.join(job_dir(), "node1"))  # node 1's RAM is lost
        dist.barrier()
        for t in [*model.parameters(), *grown.values(), *(v for s in opt.state.values() for v in s.values())]:
            t.detach().zero_()
        restored, source = ck.restore(), ck.last_restore["source"]
    got = {**full_state(model, opt), **{f"grown/{k}": v for k, v in grown.items()}}
    bad = [k for k in saved if not torch.equal(saved[k], got[k])]
    if bad:
        raise AssertionError(f"rank {rank}: step {restored} differs: {bad[:5]}")
    return {"keys": (counts[0], counts[1]), "step": restored, "source": source}


def ram_committed_steps(rank: int) -> list[int]:
    """The steps with an index (manifest.json) in the RAM tier of `rank`'s simulated node (2 ranks a node)."""
    from ftkit.tiers.ram import job_dir

    node = os.path.join(job_dir(), f"node{rank // 2}")
    return sorted(
        int(d.name[5:])
        for d in os.scandir(node)
        if d.name.startswith("step-") and os.path.exists(os.path.join(d.path, "manifest.json"))
    )


def ram_skip_on_rank0(rank: int, world: int) -> dict:
    """policy "skip" where only rank 0 runs out of staging slots at step 2."""
    import time

    state = {"w": torch.zeros(1 << 20)}  # 4 MiB, split in 1 MiB shares
    budget = 3 << 19 if rank == 0 else None  # rank 0: room for one 1 MiB staging slot only
    with ftkit.Checkpointer(
        state, [ftkit.Tier("ram", replicas=1)], policy="skip", rng=False, max_staging_bytes=budget
    ) as ck:
        if rank == 1:
            time.sleep(2)  # rank 0's persist of step 1 waits for this rank's report meanwhile
        ck.snapshot(1)
        ck.snapshot(2)  # rank 0's only slot is still busy with step 1: it skips step 2
        try:
            ck.wait()
        except ftkit.FtkitError:  # step 2 was not committed: the node leaders say so
            pass
        ck.snapshot(3)
        ck.wait()
        skipped = ck.stats.skipped
    dist.barrier()
    committed = ram_committed_steps(rank)
    return {"skipped": skipped, "committed": committed}


def ram_rank0_replication_fails(rank: int, world: int) -> dict:
    """Snapshot steps 1-3 to RAM + peer; rank 0's replication of step 2 fails after its bytes
    moved (a replica that fails its check, say). Rank 0 keeps its own outcome (its node's
    collector never hears it): the step must still not be committed anywhere."""
    import ftkit.commit.ram as node_commit
    from ftkit.errors import StorageError

    real = node_commit.replicate

    def failing(storage, step, *args, **kwargs):
        real(storage, step, *args, **kwargs)
        if step == 2:
            raise StorageError("injected: a replica failed its check")

    if rank == 0:
        node_commit.replicate = failing
    state = {"w": torch.zeros(1 << 16)}
    errors = []
    try:
        with ftkit.Checkpointer(state, [ftkit.Tier("ram", replicas=1)], rng=False) as ck:
            for step in (1, 2, 3):
                state["w"].fill_(step)
                ck.snapshot(step)
                try:
                    ck.wait()
                except ftkit.FtkitError as e:
                    errors.append(str(e))
                dist.barrier()
    finally:
        node_commit.replicate = real
    committed = ram_committed_steps(rank)
    return {"committed": committed, "errors": errors}


def ram_replica_store_fails(rank: int, world: int) -> dict:
    """Snapshot steps 1-4 to RAM + peer; rank 3 cannot store rank 1's replica of step 2 (a
    file size limit: EFBIG on the write, as a full /dev/shm gives ENOSPC). The transfers went
    through: only step 2 fails, and the peer group carries the steps after it."""
    import resource
    import signal

    pad = torch.zeros((1 << 18) if rank == 1 else 16)  # rank 1's file: 1 MiB; the others' a few kB
    state = {"w": torch.zeros(1 << 12), "own": ftkit.RankLocal({"pad": pad})}
    errors = []
    with ftkit.Checkpointer(state, [ftkit.Tier("ram", replicas=1, keep=5)], rng=False, peer_timeout_s=10) as ck:
        for step in (1, 2, 3, 4):
            state["w"].fill_(step)
            limited = rank == 3 and step == 2
            if limited:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (a write past the limit fails, no signal)
                soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
                resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, hard))
            ck.snapshot(step)
            try:
                ck.wait()
            except ftkit.FtkitError as e:
                errors.append(str(e))
            if limited:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            dist.barrier()
    return {"committed": ram_committed_steps(rank), "errors": errors}


def durable_skip_on_rank0(rank: int, world: int, disk: str) -> dict:
    """policy "skip" on a disk tier where only rank 0 skips step 3: the store's key
    count after step 1 and after step 4, and the steps committed."""
    import time

    from torch.distributed.distributed_c10d import _get_default_store

    from ftkit.format.reader import committed_steps

    state = {"w": torch.zeros(1 << 20)}  # 4 MiB, split in 1 MiB shares
    budget = 3 << 19 if rank == 0 else None  # rank 0: room for one 1 MiB staging slot only
    counts = []
    with ftkit.Checkpointer(
        state, [ftkit.Tier(disk, keep=5)], policy="skip", rng=False, max_staging_bytes=budget
    ) as ck:
        ck.snapshot(1)
        ck.wait()
        dist.barrier()
        counts.append(_get_default_store().num_keys())
        dist.barrier()
        if rank == 1:
            time.sleep(2)  # rank 0's persist of step 2 waits for this rank's report meanwhile
        ck.snapshot(2)
        ck.snapshot(3)  # rank 0's only slot is still busy with step 2: it skips step 3
        ck.wait()
        ck.snapshot(4)  # rank 0's commit of step 4 deletes the reports of step 3
        ck.wait()
        skipped = ck.stats.skipped
    dist.barrier()
    counts.append(_get_default_store().num_keys())
    return {
        "skipped": skipped,
        "new_keys": counts[1] - counts[0],
        "committed": committed_steps(ftkit.Tier(disk).open()),
    }


def ram_rewind_and_redo(rank: int, world: int) -> dict:
    """Snapshot steps 1-3, restore step 1 in the same process, snapshot 2-3 again with
    other values; then a new Checkpointer restores the newest step."""
    state = {"w": torch.zeros(1 << 18)}
    tiers = [ftkit.Tier("ram", keep=5, replicas=1)]
    with ftkit.Checkpointer(state, tiers, rng=False) as ck:
        for step in (1, 2, 3):
            state["w"].fill_(step)
            ck.snapshot(step)
            ck.wait()
        assert ck.restore(1) == 1 and float(state["w"][0]) == 1.0
        for step in (2, 3):  # the same step numbers, new values: a new timeline
            state["w"].fill_(10 * step)
            ck.snapshot(step)
            ck.wait()
    state["w"].zero_()
    with ftkit.Checkpointer(state, tiers, rng=False) as ck:
        step = ck.restore()
    return {"step": step, "value": float(state["w"][0]), "all_equal": bool((state["w"] == state["w"][0]).all())}


def fall_back_and_redo(rank: int, world: int, url: str, opts: dict, phase: str) -> dict:
    """phase "save": steps 1 and 2 (w filled with the step). phase "redo": restore (the caller
    damaged step 2: every rank reads it, then falls back to step 1), then snapshot step 2
    again with w = 20; the step restored and what wait() raised, if anything."""
    state = {"w": torch.zeros(1 << 20)}  # 4 MiB: split in shares, every rank writes one
    tier = ftkit.Tier(url, keep=5, storage_options=opts)
    with ftkit.Checkpointer(state, [tier], rng=False, commit_timeout_s=10) as ck:
        restored, error = (ck.restore() if phase == "redo" else 0), None
        for step in (2,) if phase == "redo" else (1, 2):
            state["w"].fill_(20 if phase == "redo" else step)
            ck.snapshot(step)
            try:
                ck.wait()
            except ftkit.FtkitError as e:
                error = str(e)
            dist.barrier()
    return {"restored": restored, "error": error}


def ram_restore(rank: int, world: int, parallel: str, disk: str, refs: str, disk_every: int = 100):
    """Restore; compare with the reference of the restored step; report the source."""
    model, opt = build(parallel, seed=1000 + rank)
    mine = {"rank": -1, "seen": torch.zeros(3, dtype=torch.long), "note": ""}
    state = {"model": model, "optim": opt, "meta": {}, "own": ftkit.RankLocal(mine)}
    with ftkit.Checkpointer(state, ram_tiers(disk, disk_every)) as ck:
        step = ck.restore()
        info = dict(ck.last_restore)
    check_own(mine, rank, 4)
    got = full_state(model, opt)
    expect = torch.load(f"{refs}/ref-{step}.pt", weights_only=True)
    bad = [k for k in expect if not torch.equal(expect[k], got[k])]
    if bad:
        raise AssertionError(f"rank {rank}: step {step} differs: {bad[:5]}")
    return {
        "step": step,
        "source": info["source"],
        "from_peers": info.get("files_from_peers", 0),
        "received": sorted(info.get("received", [])),
    }


# ------------------------------------------------------------ data position
def sampler_run(rank: int, world: int, ckpt: str, steps: int, n: int = 50, batch: int = 4):
    """Train-loop shape with a prefetching DataLoader; return the batches consumed, by step."""
    from torch.utils.data import DataLoader

    sampler = ftkit.ResumableDistributedSampler(n, seed=7)
    loader = DataLoader(list(range(n)), batch_size=batch, sampler=sampler, num_workers=2)
    consumed = []
    with ftkit.Checkpointer({"sampler": sampler}, [ftkit.Tier(ckpt, keep=3)], rng=False) as ck:
        step = ck.restore()
        while step < steps:
            sampler.set_epoch(sampler.epoch)
            for b in loader:
                sampler.advance(len(b))
                step += 1
                consumed.append((step, b.tolist()))
                ck.snapshot(step)
                if step == steps:
                    break
    return consumed


def agreement(rank: int, world: int) -> dict:
    """coord/agree.py on real ranks: every rank gets the values and every failure."""
    from ftkit.coord.agree import agree
    from ftkit.coord.dist import DistContext
    from ftkit.errors import AgreementError

    ctx = DistContext.detect(timeout_s=30).scoped("agree-test/")
    every = agree(ctx, "all", error="disk full" if rank == 1 else None, value=rank * 10)
    two = agree(ctx, "two", error=f"bad {rank}" if rank else None)
    try:
        two.raise_if_failed("step 3 not committed")
        raised = None
    except AgreementError as e:
        raised = [str(e), e.failures]
    return {
        "values": every.values,
        "failures": every.failures,
        "first": every.first_failure(rank),
        "nodes": ctx.nodes,
        "raised": raised,
    }


def skip_one_step(rank: int, world: int, tier: str, skipper: int) -> dict:
    """policy "skip" where rank `skipper` finds no free staging slot at step 2 (forced), on
    two simulated nodes of two ranks: the store's key count after step 1 and at the end,
    and the steps each node committed."""
    from torch.distributed.distributed_c10d import _get_default_store

    from ftkit.format.reader import committed_steps

    state = {"w": torch.zeros(1 << 18)}
    tiers = [ftkit.Tier(tier, keep=5, **({"replicas": 1} if tier == "ram" else {}))]
    counts = []
    with ftkit.Checkpointer(state, tiers, policy="skip", rng=False) as ck:
        ck.snapshot(1)
        ck.wait()
        dist.barrier()
        counts.append(_get_default_store().num_keys())
        dist.barrier()
        if rank == skipper:
            acquire = ck._arena.acquire
            ck._arena.acquire = lambda *a, **k: None  # every staging slot busy, for this step
            ck.snapshot(2)
            ck._arena.acquire = acquire
        else:
            ck.snapshot(2)
        try:
            ck.wait()
        except ftkit.FtkitError:  # step 2 was not committed: the ranks that commit say so
            pass
        for step in (3, 4):
            ck.snapshot(step)
            ck.wait()
        skipped = ck.stats.skipped
    dist.barrier()
    counts.append(_get_default_store().num_keys())
    if tier == "ram":
        committed = ram_committed_steps(rank)
    else:
        committed = committed_steps(ftkit.Tier(tier).open())
    return {"skipped": skipped, "new_keys": counts[1] - counts[0], "committed": committed}


def busy_collector(rank: int, world: int, url: str, points: str) -> list[int]:
    """Two ranks of one node on a shared tier: rank 0, the node's collector, is busy for 8 s
    after writing step 1 (frozen at the persist fault point, as by a slow write or the last
    step's retention) while rank 1, with 5000 tensors of its own (a layout of a few hundred kB,
    more than a connection's buffer), reports to it. Returns the committed steps."""
    import json
    import signal
    import time

    from ftkit.format.reader import committed_steps

    if rank == 0:
        with open(points, "w") as f:
            json.dump({"phase": "persist", "step": 1, "rank": 0, "action": "stop"}, f)
    dist.barrier()
    mine = {f"t{i}": torch.full((2,), float(rank)) for i in range(5000)}
    state = {"w": torch.zeros(64), "own": ftkit.RankLocal(mine)}
    with ftkit.Checkpointer(state, [url], rng=False, watchdog=False) as ck:
        ck.snapshot(1)
        if rank == 1:
            while True:  # rank 0 froze: the pid it wrote
                try:
                    with open(points + ".reached") as f:
                        pid = json.load(f)["pid"]
                    break
                except (OSError, ValueError, KeyError):
                    time.sleep(0.05)
            time.sleep(8)  # longer than the 5 s a sender used to wait for room
            os.kill(pid, signal.SIGCONT)
        try:
            ck.wait()
        except ftkit.FtkitError:
            pass
        ck.snapshot(2)
        ck.wait()
    dist.barrier()
    return committed_steps(ftkit.Tier(url).open())


def late_record(rank: int, world: int, disk: str, points: str) -> dict:
    """Two nodes of one rank on a shared tier; rank 1 freezes after writing step 2, longer
    than rank 0's commit timeout, and sends its record once rank 0 has given up on the step.
    Returns the store's new keys after steps 3 and 4, and the committed steps."""
    import json
    import signal
    import time

    from torch.distributed.distributed_c10d import _get_default_store

    from ftkit.format.reader import committed_steps

    if rank == 0:
        with open(points, "w") as f:
            json.dump({"phase": "persist", "step": 2, "rank": 1, "action": "stop"}, f)
    counts = []
    tier = {"url": disk, "keep": None}
    with ftkit.Checkpointer({"w": torch.zeros(64)}, [tier], rng=False, watchdog=False, commit_timeout_s=3) as ck:
        ck.snapshot(1)
        ck.wait()
        dist.barrier()
        counts.append(_get_default_store().num_keys())
        dist.barrier()
        ck.snapshot(2)
        try:
            ck.wait()
        except ftkit.FtkitError:
            pass
        if rank == 0:  # rank 0 gave up on step 2: rank 1 goes on, and sends its record late
            with open(points + ".reached") as f:
                os.kill(json.load(f)["pid"], signal.SIGCONT)
            time.sleep(1)
        for step in (3, 4):
            ck.snapshot(step)
            ck.wait()
    dist.barrier()
    counts.append(_get_default_store().num_keys())
    return {"new_keys": counts[1] - counts[0], "committed": committed_steps(ftkit.Tier(disk).open())}


def close_failed_mid_persist(rank: int, world: int, url: str, root: str, run_dir: str) -> list[dict]:
    """A failed rank's close while its persist of step 1 still runs (slow writes): the
    persist's events after it, as this rank's event log holds them once the thread ends."""
    from ftkit.coord.events import read_events
    from ftkit.drill.faults import register, set_faults

    register()
    if rank == 0:
        set_faults(root, latency_s=0.5)
    torch.distributed.barrier()
    ck = ftkit.Checkpointer(
        {"w": torch.full((64,), float(rank))}, [url], rng=False, watchdog=False, preemption_signals=(), run_dir=run_dir
    )
    ck.snapshot(1)
    ck.close(failed=True)  # (several ranks: the persist is not waited for)
    try:
        ck.wait()  # its thread ends; what it logged is in the file
    except Exception:
        pass  # (a persist that failed: its event says so)
    return [e for e in read_events(run_dir) if e["rank"] == rank and e["event"] in ("close", "persist", "persist_job")]


def slow_slot_wait(rank: int, world: int, url: str, root: str) -> list[int]:
    """Every write is slow (2.5 s, an upload) and every step snapshots: from the third step
    on, snapshot() waits for a staging slot longer than the hang bound, and the other rank
    waits for it in the step's collective. Returns the committed steps."""
    from ftkit.coord.judge import WatchdogConfig
    from ftkit.drill.faults import register, set_faults
    from ftkit.format.reader import committed_steps

    register()
    cfg = WatchdogConfig(interval_s=0.1, hang_floor_s=3.0)
    with ftkit.Checkpointer({"w": torch.zeros(64)}, [{"url": url, "keep": None}], rng=False, watchdog=cfg) as ck:
        dist.barrier()
        if rank == 0:
            set_faults(root, latency_s=2.5)
        dist.barrier()
        for step in range(1, 5):
            ck.snapshot(step)
            dist.barrier()  # (the step's collective)
        if rank == 0:
            set_faults(root)
    dist.barrier()
    return committed_steps(ftkit.Tier(url).open())


def slow_preemption_save(rank: int, world: int, url: str, root: str) -> tuple[object, int, list[int]]:
    """Rank 1 is preempted after step 5, and from then on every write is slow (1 s, an
    upload): the final save takes longer than the hang bound (about 20 s against 3 s here). Returns (the exit status
    SystemExit asked for, the last step snapshotted, the committed steps)."""
    import signal
    import time

    from ftkit.coord.judge import WatchdogConfig
    from ftkit.drill.faults import register, set_faults
    from ftkit.format.reader import committed_steps

    register()
    cfg = WatchdogConfig(interval_s=0.1, hang_floor_s=3.0)
    code, step = None, 0
    try:
        with ftkit.Checkpointer({"w": torch.zeros(64)}, [{"url": url, "keep": None}], rng=False, watchdog=cfg) as ck:
            for step in range(1, 100):
                ck.snapshot(step)
                if step == 5:
                    ck.wait()
                    dist.barrier()
                    if rank == 0:
                        set_faults(root, latency_s=1.0)
                    dist.barrier()
                    if rank == 1:
                        os.kill(os.getpid(), signal.SIGTERM)
                dist.barrier()  # (the step's collective)
                time.sleep(0.05)
    except SystemExit as e:
        code = e.code
    if rank == 0:
        set_faults(root)
    return code, step, committed_steps(ftkit.Tier(url).open())


def slow_final_flush(rank: int, world: int, url: str, root: str) -> list[int]:
    """Ten quick steps, then the last snapshot's writes are slow (an upload): close() waits
    for them longer than the hang bound. Returns the committed steps."""
    from ftkit.coord.judge import WatchdogConfig
    from ftkit.drill.faults import register, set_faults
    from ftkit.format.reader import committed_steps

    register()
    cfg = WatchdogConfig(interval_s=0.1, hang_floor_s=3.0)  # (room for a loaded machine's barriers below)
    with ftkit.Checkpointer({"w": torch.zeros(64)}, [{"url": url, "keep": None}], rng=False, watchdog=cfg) as ck:
        for step in range(1, 11):
            if step == 10:
                ck.wait()
                dist.barrier()
                if rank == 0:
                    set_faults(root, latency_s=2.5)  # every write of step 10 waits 2.5 s: 5 s or more in all
                dist.barrier()
            ck.snapshot(step)
    dist.barrier()  # (rank 0 commits after the others' parts are in)
    if rank == 0:
        set_faults(root)
    return committed_steps(ftkit.Tier(url).open())


def recipe_weight() -> torch.Tensor:
    """A compressible 2 MiB weight whose rows differ (FORMAT.md's recipe reads it back)."""
    return (torch.arange(1024 * 512, dtype=torch.float32) % 7919).reshape(1024, 512)


def save_for_format_recipe(rank: int, world: int, tier: str) -> None:
    """Every rank saves recipe_weight() (split in row blocks over the ranks, so over every
    node's part) to a zstd tier, as step 120."""
    with ftkit.Checkpointer(
        {"model": {"fc.weight": recipe_weight()}}, [ftkit.Tier(tier, compress="zstd")], rng=False
    ) as ck:
        ck.snapshot(120)
        ck.wait()


def dcp_load_missing_on_one_rank(rank: int, world: int, tiers: list[str]) -> str:
    """dcp.load of step 1 through a tier of this rank's own (tiers[rank]), which only some hold:
    what this rank raised, by type and message."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ftkit.dcp import FtkitStorageReader

    try:
        dcp.load({"w": torch.zeros(2)}, storage_reader=FtkitStorageReader([tiers[rank]]), checkpoint_id=1)
    except (Exception, CheckpointException) as e:  # (DCP's is a BaseException)
        return f"{type(e).__name__}: {e}"
    return "loaded"

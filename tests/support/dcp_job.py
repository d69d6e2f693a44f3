"""A trainer written against DCP, as torchtitan and accelerate's FSDP checkpoints are: FSDP2
over gloo, `dcp.async_save` every step and `dcp.load` at start, with ftkit's writer and reader
as the only change. Run under torchrun:

    python -m torch.distributed.run --nproc-per-node 2 tests/support/dcp_job.py TIERS_JSON STEPS OUT [DIE_AT]

TIERS_JSON: the tiers (as a Checkpointer takes them); OUT: rank 0 writes the final full model
and optimizer state there, and the step it resumed from (torch.save); DIE_AT: rank 1 SIGKILLs itself after that step, on
the first attempt only (torchrun restarts the group, which resumes from the newest step).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ftkit.dcp import FtkitStorageReader, FtkitStorageWriter


def build():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def main() -> None:
    tiers, steps, out = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    die_at = int(sys.argv[4]) if len(sys.argv) > 4 else -1
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = build()
    start = 0
    reader = FtkitStorageReader(tiers)
    if reader.latest_step() is not None:  # (as a trainer checks that its DCP folder exists)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": 0}
        dcp.load(state, storage_reader=reader)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = state["step"]
    writer = FtkitStorageWriter(tiers)
    # DCP's async save runs its collectives on a background thread: on a group of their own, as
    # torchtitan does (gloo aborts when two threads use one group at once).
    ckpt_group = dist.new_group(backend="gloo")
    pending = None
    for step in range(start + 1, steps + 1):
        g = torch.Generator().manual_seed(step * 100 + rank)
        loss = model(torch.randn(8, 16, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if pending is not None:
            pending.result()  # one save in flight at a time
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": step}
        pending = dcp.async_save(state, storage_writer=writer, checkpoint_id=step, process_group=ckpt_group)
        if step == die_at and rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            pending.result()  # (DCP's coordinator committed the step before this returns)
            os.kill(os.getpid(), signal.SIGKILL)
    if pending is not None:
        pending.result()
    msd, osd = get_state_dict(model, opt)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in msd.items()}
    optim_full = {
        f"{k}/{s}": (v.full_tensor() if hasattr(v, "full_tensor") else v)
        for k, st in osd["state"].items()
        for s, v in st.items()
    }
    if rank == 0:
        torch.save({"model": full, "optim": optim_full, "start": start}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""DCP checkpoints into a sharded job of another world size (issue 38). Under torchrun:

    python -m torch.distributed.run --nproc-per-node 3 tests/support/dcp_load_into_job.py CKPT OUT SRC EXPORTED

FSDP2 over gloo (dcp_job's model). A Checkpointer run on CKPT starts from SRC, a DCP
checkpoint written elsewhere by `dcp.save` in one process: `ftkit.dcp.load_into` loads it
into the live state, resharded by DCP; rank 0 writes the whole model and optimizer state as
loaded to OUT/loaded.pt. The run then trains two steps with snapshots (its first ftkit steps).
EXPORTED, a step that `ftkit export --format dcp` wrote, is read as a DCP user reads any
checkpoint (`dcp.load` into the sharded model's state dict): OUT/exported.pt.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dcp_job import build
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)

import ftkit
from ftkit.dcp import load_into


def whole(model, opt) -> dict[str, torch.Tensor]:
    """Every rank calls it (gathers); the full tensors, by FQN."""
    full = StateDictOptions(full_state_dict=True)
    msd = get_model_state_dict(model, options=full)
    osd = get_optimizer_state_dict(model, opt, options=full)
    out = {f"model.{k}": v for k, v in msd.items()}
    out |= {f"optim.state.{n}.{s}": torch.as_tensor(v) for n, st in osd["state"].items() for s, v in st.items()}
    return out


def main() -> None:
    ckpt, out, src, exported = sys.argv[1:5]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = build()
    state = {"model": model, "optim": opt, "step": 0}
    with ftkit.Checkpointer(state, tiers=[ckpt]) as ck:
        if ck.restore() == 0:
            load_into(state, src)
        loaded = whole(model, opt)
        if rank == 0:
            torch.save({"tensors": loaded, "step": state["step"]}, os.path.join(out, "loaded.pt"))
        for step in range(state["step"] + 1, state["step"] + 3):
            g = torch.Generator().manual_seed(step * 100 + rank)
            loss = model(torch.randn(8, 16, generator=g)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            state["step"] = step
            ck.snapshot(step)

    other, other_opt = build()
    msd, osd = get_state_dict(other, other_opt)
    sd = {"model": msd, "optim": osd, "step": 0}
    dcp.load(sd, checkpoint_id=exported)
    set_state_dict(other, other_opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    got = whole(other, other_opt)
    if rank == 0:
        torch.save({"tensors": got, "step": sd["step"]}, os.path.join(out, "exported.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The directory ``FtkitCallback.resume_from_checkpoint()`` hands ``Trainer.train()``: what the
Trainer reads itself when it resumes (its state and the weights), written from the step ftkit
just restored and removed once training has begun. Without FSDP each rank gets its own; under
FSDP2 it is one directory all ranks must see, in the layout the plugin's ``state_dict_type``
says (`write_handoff`), and the optimizer goes into the live sharded one (huggingface.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ftkit.errors import FtkitError

FSDP_MODEL_NAME = "pytorch_model_fsdp"  # accelerate.utils.constants.FSDP_MODEL_NAME
TRAINER_STATE_NAME = "trainer_state.json"
MARKER = ".ftkit-resume"  # in every resume directory ftkit writes: only such a directory is ever removed


def check_resume_dir(path: str) -> None:
    """Refuse a `path` ftkit may not empty: anything but an empty directory or one it wrote (a
    `resume_dir` naming the run's folder, or a tier, would be deleted with everything in it)."""
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path) or (os.listdir(path) and not is_own(path)):
        raise FtkitError(
            f"FtkitCallback: resume_dir {path} exists and is not a resume directory ftkit wrote "
            "(it is emptied before use and removed after); name a new directory"
        )


def is_own(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def _make_fresh(path: str, trainer_state: str) -> None:
    """`path` as a new resume directory of ftkit's holding the Trainer state (check_resume_dir passed)."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.makedirs(path)
    Path(path, MARKER).write_text("written by ftkit's FtkitCallback for Trainer.train(); removed once it began\n")
    Path(path, TRAINER_STATE_NAME).write_text(trainer_state, encoding="utf-8")


def fsdp_plugin() -> Any:
    """The accelerate FSDP plugin the Trainer trains with, or None (also where accelerate runs
    an FSDP job as DDP: it turns FSDP on only for accelerator devices)."""
    from accelerate.state import AcceleratorState

    # Read, not constructed: AcceleratorState() would set accelerate up if nothing has yet.
    return AcceleratorState._shared_state.get("fsdp_plugin")


def check_fsdp_args(args: Any) -> None:
    """Refuse what the callback cannot restore: DeepSpeed, FSDP1, XLA's FSDP."""
    if getattr(args, "deepspeed", None):
        raise FtkitError("FtkitCallback does not support DeepSpeed (its engine keeps its own sharded state)")
    if not getattr(args, "fsdp", None):
        return
    plugin_args = getattr(args, "fsdp_plugin_args", None) or {}
    if plugin_args.get("fsdp_version") != 2:
        raise FtkitError(
            "FtkitCallback supports FSDP2 only (fsdp_config={'version': 2}); "
            "FSDP1 and XLA's FSDP keep their state in their own flat shards"
        )


def write_resume_dir(model: torch.nn.Module, path: str, trainer_state: str, world: int, rank: int, plugin: Any) -> str:
    """Every rank: write the directory for ``train()`` and return where it is (`path` under FSDP,
    else this rank's own)."""
    if plugin is not None:
        write_handoff(model, path, plugin, trainer_state)
        return path
    if world > 1:  # every rank writes and reads its own
        path = f"{path}-r{rank}"
    check_resume_dir(path)
    _make_fresh(path, trainer_state)
    # Not save_pretrained: under torch.distributed it writes on rank 0 only.
    from safetensors.torch import save_model

    save_model(model, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def write_handoff(model: torch.nn.Module, path: str, plugin: Any, trainer_state: str) -> None:
    """Every rank: the FSDP resume directory. Rank 0 empties `path` and writes the Trainer state;
    then the weights are written; then every rank checks it sees them."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import StateDictType

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    barrier = dist.barrier if distributed else (lambda: None)
    check_resume_dir(path)  # (every rank: one directory all see, so all refuse alike)
    if rank == 0:
        _make_fresh(path, trainer_state)
    barrier()
    weights = get_model_state_dict(model)  # the names accelerate's load asks for (the model is not sharded yet)
    if plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT:
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": weights}, checkpoint_id=os.path.join(path, f"{FSDP_MODEL_NAME}_0"))
        marker = os.path.join(path, f"{FSDP_MODEL_NAME}_0", ".metadata")
    elif plugin.state_dict_type == StateDictType.FULL_STATE_DICT:
        marker = os.path.join(path, f"{FSDP_MODEL_NAME}.bin")
        if rank == 0:
            torch.save(weights, marker)
    else:
        raise FtkitError(f"FtkitCallback: FSDP state_dict_type {plugin.state_dict_type.name} is not supported")
    barrier()
    nccl = distributed and "nccl" in str(dist.get_backend())  # its collectives take CUDA tensors only
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    seen = torch.tensor([1 if os.path.exists(marker) else 0], device=device)
    if distributed:
        dist.all_reduce(seen, op=dist.ReduceOp.MIN)
    if not seen.item():
        raise FtkitError(
            f"FtkitCallback: the FSDP resume directory {path} is not seen by every rank; under FSDP "
            "the Trainer reads its weights from one directory: pass FtkitCallback(resume_dir=...) "
            "on a filesystem all nodes share"
        )

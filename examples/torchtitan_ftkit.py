"""torchtitan's CheckpointManager with ftkit as DCP's storage.

Run by hand with torchtitan 0.3.0 (llama3 debugmodel, 2 ranks on CPU); not in CI,
because torchtitan runs on CPU only with patches of its own (docs/integrations.md,
"torchtitan"). torchtitan takes no storage writer from its config: its CheckpointManager
calls `dcp.save(state_dict, checkpoint_id=...)` itself, so this subclass overrides the
three methods that touch storage. Steps live in ftkit tiers beside torchtitan's
checkpoint folder (`<folder>-ftkit`, two kept); edit `ftkit_tiers` for RAM, S3 or more.

Use it in a config function:

    from torchtitan_ftkit import FtkitCheckpointManager
    cfg = llama3_debugmodel()
    cfg.checkpoint = FtkitCheckpointManager.Config(interval=cfg.checkpoint.interval,
                                                   last_save_model_only=False)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.checkpointer.dcp import AsyncMode

from ftkit import FtkitError
from ftkit.dcp import FtkitStorageReader, FtkitStorageWriter


def ftkit_tiers(folder: str) -> list[dict[str, Any]]:
    """Where a torchtitan checkpoint folder's steps are kept."""
    return [{"url": folder.rstrip("/") + "-ftkit", "keep": 2}]


class FtkitCheckpointManager(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        if to_hf or async_mode != AsyncMode.DISABLED:
            raise FtkitError("FtkitCheckpointManager: only synchronous DCP saves (async_mode disabled, not to_hf)")
        writer = FtkitStorageWriter(ftkit_tiers(os.path.dirname(checkpoint_id)))
        dcp.save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id)
        # torchtitan checks that a step's folder exists before it loads the step
        os.makedirs(checkpoint_id, exist_ok=True)

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized):
        if from_hf:
            raise FtkitError("FtkitCheckpointManager: loading Hugging Face weights goes through torchtitan's own path")
        reader = FtkitStorageReader(ftkit_tiers(os.path.dirname(checkpoint_id)))
        dcp.load(state_dict, storage_reader=reader, checkpoint_id=checkpoint_id)

    def _find_load_step(self, folder=""):
        # the newest step ftkit holds committed and whole, not the newest folder name
        step = FtkitStorageReader(ftkit_tiers(folder or self.folder)).latest_step()
        return -1 if step is None else step

"""ftkit and PyTorch Distributed Checkpoint (DCP): ftkit's tiers as DCP's storage.

import torch.distributed.checkpoint as dcp
from ftkit.dcp import FtkitStorageReader, FtkitStorageWriter

writer = FtkitStorageWriter(["/local/ckpt", ftkit.Tier("s3://bucket/run", every=100)])
dcp.save(state_dict, storage_writer=writer, checkpoint_id=step)      # or dcp.async_save
dcp.load(state_dict, storage_reader=FtkitStorageReader(tiers))       # the newest usable step

ftkit.dcp.load_into(state, "/checkpoints/step-100")   # a DCP checkpoint into a Checkpointer's state
"""

from ftkit.dcp.foreign import load_into
from ftkit.dcp.storage import FtkitStorageReader, FtkitStorageWriter, step_of

__all__ = ["FtkitStorageReader", "FtkitStorageWriter", "load_into", "step_of"]

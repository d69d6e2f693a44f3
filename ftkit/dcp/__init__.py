"""ftkit and PyTorch Distributed Checkpoint (DCP): ftkit's tiers as DCP's storage.

    import torch.distributed.checkpoint as dcp
    from ftkit.dcp import FtkitStorageReader, FtkitStorageWriter

    writer = FtkitStorageWriter(["/local/ckpt", ftkit.Tier("s3://bucket/run", every=100)])
    dcp.save(state_dict, storage_writer=writer, checkpoint_id=step)      # or dcp.async_save
    dcp.load(state_dict, storage_reader=FtkitStorageReader(tiers))       # the newest usable step

storage.py  the writer and the reader (DCP's StorageWriter / StorageReader)
convert.py  DCP's metadata and values as ftkit's manifest and skeleton, and back (no pickle)
"""

from ftkit.dcp.storage import FtkitStorageReader, FtkitStorageWriter, step_of

__all__ = ["FtkitStorageReader", "FtkitStorageWriter", "step_of"]

"""ftkit: fault tolerance and fast checkpointing for PyTorch training."""

__version__ = "0.1.0"

from .checkpointer import Checkpointer, Stats  # noqa: E402
from .errors import (CaptureError, CheckpointNotFoundError, CorruptCheckpointError,  # noqa: E402
                     FormatError, FtkitError, StateMismatchError, StorageError)
from .sampler import ResumableDistributedSampler  # noqa: E402
from .tiers import Tier  # noqa: E402

__all__ = [
    "Checkpointer", "Stats", "Tier", "ResumableDistributedSampler", "FtkitError", "CaptureError", "CheckpointNotFoundError",
    "CorruptCheckpointError", "FormatError", "StateMismatchError", "StorageError", "__version__",
]

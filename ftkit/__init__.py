"""ftkit: fault tolerance and fast checkpointing for PyTorch training."""

__version__ = "0.1.0"

from ftkit.checkpointer import Checkpointer, Stats  # noqa: E402
from ftkit.config import Tier  # noqa: E402
from ftkit.coord import boot as _boot  # noqa: E402
from ftkit.coord.rendezvous import install as _install_rendezvous  # noqa: E402
from ftkit.coord.watchdog import WatchdogConfig  # noqa: E402
from ftkit.errors import (  # noqa: E402
    AlreadyCommitted,
    CaptureError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatError,
    FtkitError,
    InvalidJobIdError,
    PeerTimeout,
    PeerTransferError,
    RecoveryRequested,
    RunIdentityError,
    StateMismatchError,
    StorageError,
    UnknownProtocolError,
    UnsafeRamDirError,
    UsageError,
)
from ftkit.integrations.sampler import ResumableDistributedSampler  # noqa: E402
from ftkit.runtime.inprocess import Generation, RecoveryFailed, run_in_process  # noqa: E402
from ftkit.save.capture import RankLocal  # noqa: E402

# torchrun restarts of a plain init_process_group("gloo"/"nccl") read no stale
# rendezvous keys once ftkit is imported (see ftkit/coord/rendezvous.py).
_install_rendezvous()

# The imports are done (torch's among them): in a worker started without ftkit's launcher,
# the closest thing to its "launch" milestone (ftkit/coord/boot.py; the first stamp stands).
_boot.mark("launch")

__all__ = [
    "Checkpointer",
    "Stats",
    "Tier",
    "WatchdogConfig",
    "run_in_process",
    "Generation",
    "RecoveryFailed",
    "RecoveryRequested",
    "ResumableDistributedSampler",
    "RankLocal",
    "FtkitError",
    "CaptureError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "FormatError",
    "StateMismatchError",
    "StorageError",
    "AlreadyCommitted",
    "UnknownProtocolError",
    "UsageError",
    "PeerTimeout",
    "PeerTransferError",
    "RunIdentityError",
    "InvalidJobIdError",
    "UnsafeRamDirError",
    "__version__",
]

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
    ConfigError,
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

_install_rendezvous()  # a plain init_process_group is restart-safe once ftkit is imported
_boot.mark("launch")  # imports done: a worker not started by ftkit's launcher gets its milestone here

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
    "ConfigError",
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

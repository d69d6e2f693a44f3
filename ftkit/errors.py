"""ftkit's exceptions: everything raised on purpose derives from FtkitError (an Exception),
so callers catch them in one place. Messages name what went wrong and where, never credentials.
"""

from __future__ import annotations


class FtkitError(Exception):
    """Base class of every error ftkit raises on purpose."""


def one_line(e: BaseException, limit: int = 240) -> str:
    """An exception as one line for a message: its type and the first line of its text."""
    text = str(e).strip().splitlines()
    first = text[0][:limit] if text else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


class CaptureError(FtkitError):
    """A value in the training state cannot be stored without pickle."""


class StateMismatchError(FtkitError):
    """The checkpoint does not fit the live state (shape, dtype or key names)."""


class CheckpointNotFoundError(FtkitError):
    """No (valid) checkpoint exists where one was asked for."""


class CorruptCheckpointError(FtkitError):
    """A checkpoint exists but its bytes or manifest fail verification."""


class FormatError(CorruptCheckpointError):
    """A manifest is unreadable, foreign, unsafe, or from a newer format version."""


class AlreadyCommitted(FtkitError):
    """The tier already holds a committed manifest for this step (never written twice)."""


class StorageError(FtkitError):
    """A storage backend failed: unknown protocol, unreachable endpoint, full disk."""


class UnknownProtocolError(StorageError):
    """A URL names a protocol fsspec does not know, or whose backend is not installed."""


class UsageError(FtkitError):
    """A command or option used wrongly (the CLI's exit code 2)."""


class PeerTimeout(FtkitError):
    """Another rank did not answer through the store within the bound."""


class PeerTransferError(FtkitError):
    """A transfer over the peer group failed, or the group is unusable after an earlier failure."""


class ConfigError(FtkitError, ValueError):
    """A Checkpointer's or a tier's configuration that cannot work: an option out of its range,
    tiers that do not go together."""


class RunIdentityError(FtkitError, ValueError):
    """The RAM tier cannot tell which run it belongs to, or its directory records another run."""


class InvalidJobIdError(FtkitError, ValueError):
    """A job (run) id that is not a plain directory name under the RAM root."""


class UnsafeRamDirError(FtkitError):
    """A RAM-tier directory is a symlink, not ours, or writable by others."""


class RamTierInUseError(FtkitError):
    """A RAM tier to remove is in use by a live process on this node (tiers/ram.py hold_run)."""


class AgreementError(FtkitError):
    """Some ranks reported a failure where all had to succeed (coord/agree.py).
    `failures`: (rank, error) pairs, in rank order."""

    def __init__(self, message: str, failures: list[tuple[int, str]]):
        super().__init__(message)
        self.failures = failures


class RecoveryRequested(FtkitError):
    """Under ftkit.run_in_process: another rank failed; this generation ends and the group re-forms."""

"""ftkit's exceptions.

Every error ftkit raises on purpose derives from :class:`FtkitError` (itself an
``Exception``, never a ``BaseException``), so callers can catch them in one place
and the CLI can turn them into a one-line message and an exit code. Messages
name *what* went wrong and *where* (a key, a URL, a step), and never contain
credentials.
"""

from __future__ import annotations


class FtkitError(Exception):
    """Base class of every error ftkit raises on purpose."""


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


class StorageError(FtkitError):
    """A storage backend failed: unknown protocol, unreachable endpoint, full disk."""


class StagingBusyError(FtkitError):
    """A snapshot was due but every staging buffer is still in use (policy 'error')."""

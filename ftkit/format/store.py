"""What reading a step needs of where its bytes live: the part of tiers/storage.py's
Storage that format/ uses, as a protocol, so the format depends on no tier."""

from __future__ import annotations

import contextlib
from typing import Any, Protocol


class StepStore(Protocol):
    is_local: bool  # a local filesystem: files are read by offset, sparse files can be told
    display_url: str  # the root, for messages (no credentials)

    def where(self, rel: str = "") -> str:
        """`rel` below the root as a user would name it (for messages)."""

    def list_dir(self, rel: str = "") -> list[tuple[str, str]]:
        """(name, kind) of each entry of directory `rel`: kind "file", "directory", "link" or "other"."""

    def list_sizes(self, rel: str = "", names: list[str] | None = None) -> dict[str, int]:
        """{name: size} of the regular files in directory `rel`."""

    def is_link(self, rel: str) -> bool: ...

    def open_read(self, rel: str) -> contextlib.AbstractContextManager[Any]:
        """A binary reader of file `rel` (regular files only, no link followed)."""

    def read_ranges(self, rel: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """The bytes of each (start, end) range of file `rel`, in order."""

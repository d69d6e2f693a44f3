"""Tier configuration: where snapshots go, how often, and how many are kept."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .storage import Storage


@dataclass(frozen=True)
class Tier:
    """One storage tier.

    url: a local path, ``file://...``, ``s3://bucket/prefix`` or any fsspec URL.
    every: persist every N-th step that is snapshotted.
    keep: how many of the newest committed steps to keep (None: keep all).
    keep_every: additionally keep every step divisible by this, forever.
    compress: "zstd" or None.
    storage_options: passed to fsspec (e.g. s3fs credentials and endpoint).
    """

    url: str
    every: int = 1
    keep: int | None = 2
    keep_every: int | None = None
    compress: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"tier {self.url!r}: every must be >= 1")
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"tier {self.url!r}: keep must be >= 1 or None")
        if self.compress not in (None, "zstd"):
            raise ValueError(f"tier {self.url!r}: compress must be 'zstd' or None, not {self.compress!r}")

    @staticmethod
    def coerce(spec: "Tier | str | Mapping[str, Any]") -> "Tier":
        if isinstance(spec, Tier):
            return spec
        if isinstance(spec, str):
            return Tier(spec)
        return Tier(**dict(spec))

    def open(self) -> Storage:
        return Storage(self.url, dict(self.storage_options))

    @property
    def speed_rank(self) -> int:
        """Lower is faster: local filesystems before remote ones."""
        return 0 if "://" not in self.url or self.url.startswith("file://") else 1

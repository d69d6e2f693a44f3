"""Tier configuration: where snapshots go, how often, and how many are kept."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ftkit.tiers.redact import redact_url
from ftkit.tiers.storage import Storage


@dataclass(frozen=True)
class Tier:
    """One storage tier.

    url: a local path, ``file://...``, ``s3://bucket/prefix`` or any fsspec URL.
    every: persist every N-th step that is snapshotted.
    keep: how many of the newest committed steps to keep (None: keep all).
    keep_every: additionally keep every step divisible by this, forever.
    compress: "zstd" or None.
    storage_options: passed to fsspec (e.g. s3fs credentials and endpoint).
    replicas: for the "peer" tier, how many other nodes keep a copy of each
        rank's RAM-tier data.

    Two URLs are special: "ram", the node's shared memory (see ramtier.py),
    and "peer", which replicates the RAM tier to `replicas` other nodes.

    repr() and str() show the URL without credentials (redact.py); `url`
    itself keeps them, to open the storage.
    """

    url: str
    every: int = 1
    keep: int | None = 2
    keep_every: int | None = None
    compress: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    replicas: int = 1

    def __post_init__(self) -> None:
        shown = redact_url(self.url)
        if self.every < 1:
            raise ValueError(f"tier {shown!r}: every must be >= 1")
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"tier {shown!r}: keep must be >= 1 or None")
        if self.compress not in (None, "zstd"):
            raise ValueError(f"tier {shown!r}: compress must be 'zstd' or None, not {self.compress!r}")

    def __repr__(self) -> str:  # the generated one would print credentials in the URL
        return (
            f"Tier(url={redact_url(self.url)!r}, every={self.every!r}, keep={self.keep!r}, "
            f"keep_every={self.keep_every!r}, compress={self.compress!r}, replicas={self.replicas!r})"
        )

    __str__ = __repr__

    @staticmethod
    def coerce(spec: Tier | str | Mapping[str, Any]) -> Tier:
        if isinstance(spec, Tier):
            return spec
        if isinstance(spec, str):
            return Tier(spec)
        return Tier(**dict(spec))

    def open(self) -> Storage:
        return Storage(self.url, dict(self.storage_options))

    @property
    def is_ram(self) -> bool:
        return self.url == "ram"

    @property
    def is_peer(self) -> bool:
        return self.url == "peer"

    @property
    def speed_rank(self) -> int:
        """Lower is faster: node RAM, then local filesystems, then remote ones."""
        if self.is_ram:
            return -1
        return 0 if "://" not in self.url or self.url.startswith("file://") else 1

"""Tier configuration: where snapshots go, how often, and how many are kept."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ftkit.errors import ConfigError
from ftkit.tiers.redact import redact_url
from ftkit.tiers.storage import Storage


@dataclass(frozen=True)
class Tier:
    """One storage tier.

    url: a local path (a string or a ``pathlib.Path``), ``file://...``, ``s3://bucket/prefix``, any fsspec URL, or "ram"
        (the node's shared memory, tiers/ram.py).
    every: persist every N-th step that is snapshotted.
    keep: how many of the newest committed steps to keep (None: keep all).
    keep_every: additionally keep every step divisible by this, forever.
    compress: "zstd" or None.
    storage_options: passed to fsspec (e.g. s3fs credentials and endpoint).
    replicas: for the "ram" tier, how many other nodes keep a copy of each rank's
        data (default 0). A "peer" tier is the older spelling (`resolve_tiers`).

    repr() and str() hide the URL's credentials; `url` keeps them, to open the storage.
    """

    url: str
    every: int = 1
    keep: int | None = 2
    keep_every: int | None = None
    compress: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    replicas: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.url, os.PathLike):  # a pathlib.Path: the local path it names
            object.__setattr__(self, "url", os.fspath(self.url))
        if not isinstance(self.url, str) or not self.url:
            raise ConfigError(f"tier url must be a non-empty string, not {self.url!r}")
        shown = redact_url(self.url)
        for name, least, optional in (
            ("every", 1, False),
            ("keep", 1, True),
            ("keep_every", 1, True),
            ("replicas", 0, True),
        ):
            value = getattr(self, name)
            if (value is not None or not optional) and (
                type(value) is bool or not isinstance(value, int) or value < least
            ):
                also = " or None" if optional else ""
                raise ConfigError(f"tier {shown!r}: {name} must be an int >= {least}{also}, not {value!r}")
        if self.replicas and self.url not in ("ram", "peer"):
            raise ConfigError(f"tier {shown!r}: only the 'ram' tier has replicas")
        if self.compress not in (None, "zstd"):
            raise ConfigError(f"tier {shown!r}: compress must be 'zstd' or None, not {self.compress!r}")

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
        return Tier(spec) if isinstance(spec, (str, os.PathLike)) else Tier(**dict(spec))

    def open(self) -> Storage:
        return Storage(self.url, dict(self.storage_options))

    @property
    def is_ram(self) -> bool:
        return self.url == "ram"

    @property
    def copies_elsewhere(self) -> int:
        """The RAM tier's replicas on other nodes (0 unless set)."""
        return self.replicas or 0

    @property
    def speed_rank(self) -> int:
        """Lower is faster: node RAM, then local filesystems, then remote ones."""
        if self.is_ram:
            return -1
        return 0 if "://" not in self.url or self.url.startswith("file://") else 1


def resolve_tiers(specs: Sequence[Tier | str | Mapping[str, Any]] | Tier | str | Mapping[str, Any]) -> list[Tier]:
    """The tiers of a Checkpointer, with a "peer" entry folded into the "ram" tier's replicas:
    ``["ram", "peer", "disk"]`` (what ``--tiers`` takes) is ``[Tier("ram", replicas=1), Tier("disk")]``."""
    if isinstance(specs, (str, os.PathLike, Tier, Mapping)):  # one tier given alone (a string is no list of tiers)
        specs = [specs]
    tiers = [Tier.coerce(t) for t in specs]
    peers = [t for t in tiers if t.url == "peer"]
    rams = [i for i, t in enumerate(tiers) if t.is_ram]
    if len(peers) > 1 or len(rams) > 1:
        raise ConfigError('at most one "ram" tier (and one "peer" entry for its replicas)')
    if peers:
        if not rams:
            raise ConfigError('the "peer" tier replicates the "ram" tier: add "ram" to the tiers')
        ram = tiers[rams[0]]
        replicas = next((r for r in (ram.replicas, peers[0].replicas) if r is not None), 1)
        tiers[rams[0]] = replace(ram, replicas=replicas)
    return [t for t in tiers if t.url != "peer"]

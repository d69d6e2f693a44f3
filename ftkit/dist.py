"""Deprecated: ``ftkit.dist``, the old home of the restart-safe process group.

``import ftkit`` now makes a plain ``torch.distributed.init_process_group`` restart-safe
(ftkit/coord/rendezvous.py). These aliases keep trainers written against the old README
working, with a DeprecationWarning that says what to use instead.
"""

from __future__ import annotations

import warnings
from typing import Any

_INSTEAD = (
    "call torch.distributed.init_process_group after `import ftkit` (which makes it restart-safe "
    "under torchrun), or launch with `ftkit run`"
)

# The old module's other public names, now in ftkit.coord.dist (ftkit's internals: no promise).
_MOVED = ("DistContext", "node_id", "host_identity", "rendezvous_id")


def init_process_group(backend: str | None = "gloo", timeout_s: float = 1800.0, **kwargs: Any) -> None:
    """Deprecated: ftkit.coord.dist.init_process_group (the old signature: `timeout_s` in seconds)."""
    warnings.warn(f"ftkit.dist.init_process_group is deprecated: {_INSTEAD}", DeprecationWarning, stacklevel=2)
    from ftkit.coord.dist import init_process_group as init

    init(backend, timeout_s, **kwargs)


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(
            f"ftkit.dist.{name} is deprecated: it is ftkit.coord.dist.{name} now (ftkit's internals)",
            DeprecationWarning,
            stacklevel=2,
        )
        from ftkit.coord import dist

        return getattr(dist, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["init_process_group"]

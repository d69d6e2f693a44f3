"""Restart-safe ``env://`` rendezvous for plain ``init_process_group`` under torchrun.

torchrun's agent keeps one TCPStore for the whole job and torch's ``env://`` handler gives it
no per-attempt namespace (it assumes "a new TCPStore for every retry"): a restarted worker can
read a dead attempt's rank addresses (``Gloo connectFullMesh failed ... Connection refused``,
or a hang). So the ``env://`` handler is swapped in torch's handler table (it refuses a second
registration) for one whose store is a ``PrefixStore`` named after the run id and attempt.
``import ftkit`` installs it, and ``ftkit run`` does in every worker (ftkit.runtime.launch).

Limits: only under torchrun and for ``env://`` (``FTKIT_ENV_RENDEZVOUS=0`` turns it off);
every rank must use it or none (else they wait in different namespaces); after a membership
change plain torchrun may keep the attempt number (``ftkit run``'s agent exports the
rendezvous round instead: runtime/generation.py ``torchrun_attempt``).
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from ftkit.runtime.generation import torchrun_attempt

log = logging.getLogger("ftkit")

DISABLE_ENV = "FTKIT_ENV_RENDEZVOUS"  # "0": leave torch's env:// handler alone


def _wrap(original: Any) -> Any:
    """torch's env:// handler, with the store it yields namespaced per torchrun attempt."""

    def handler(url: str, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
        from torch.distributed import PrefixStore

        from ftkit.coord import boot

        boot.mark("rendezvous")
        attempt = torchrun_attempt()  # (the store namespace of this attempt; none outside torchrun)
        prefix = None if attempt is None else f"ftkit-rdzv/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{attempt}"
        for store, rank, world_size in original(url, **kwargs):
            boot.mark("store")
            yield (PrefixStore(prefix, store) if prefix else store), rank, world_size

    handler.ftkit_original = original  # type: ignore[attr-defined]
    return handler


def installed() -> bool:
    """Whether the env:// handler in use is ftkit's."""
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    return hasattr(rdzv._rendezvous_handlers.get("env"), "ftkit_original")


def install() -> bool:
    """Wrap torch's env:// handler (idempotent). True if ftkit's handler is now in use; warns
    where a group formed without the namespace already exists under torchrun with restarts."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return False
        # (the module: `torch.distributed.rendezvous` the attribute is the function of that name)
        rdzv = importlib.import_module("torch.distributed.rendezvous")
        handlers = rdzv._rendezvous_handlers  # private: register_rendezvous_handler refuses a 2nd "env"
    except (ImportError, AttributeError):  # a torch without distributed, or a changed layout
        return False
    current = handlers.get("env")
    if current is None:
        return False
    if hasattr(current, "ftkit_original"):
        return True
    handlers["env"] = _wrap(current)
    if (
        "TORCHELASTIC_RESTART_COUNT" in os.environ
        and dist.is_initialized()
        and os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0"
    ):
        log.warning(
            "ftkit: the process group was created before ftkit was imported, so torchrun restarts may "
            "read the previous attempt's rendezvous keys (Gloo 'connectFullMesh failed ... Connection "
            "refused', or a hang in init_process_group). Import ftkit before init_process_group, or "
            "launch with `ftkit run`."
        )
    return True

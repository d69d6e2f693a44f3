"""Restart-safe ``env://`` rendezvous for plain ``init_process_group`` under torchrun.

The problem (torch 2.13, and every release since torchrun shares its store):
torchrun's agent hosts one TCPStore for the workers and keeps it for the whole
job (``TORCHELASTIC_USE_AGENT_STORE=True``, the same MASTER_ADDR/MASTER_PORT
at every attempt). torch's ``env://`` handler connects to it with no per-attempt
namespace (its comment assumes "a new TCPStore for every retry"), so the keys
``init_process_group`` writes (gloo's ``default_pg/0//cpu//0/<rank>`` address of
every rank, NCCL's unique id) are the same at every attempt. A worker of a
restarted attempt that asks for a peer's address before that peer has written
its new one reads the dead previous attempt's address: ``Gloo connectFullMesh
failed ... Connection refused`` (the attempt fails and eats a restart) or, if
the port has been reused meanwhile, a connection to the wrong process that
waits out the collective timeout. Whether it happens depends only on which
worker of the new attempt reaches the store first.

The fix: the ``env://`` handler is wrapped so the store it yields is a
``PrefixStore`` named after the torchrun run id and attempt
(``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``): every attempt starts
from an empty namespace and can only ever read its own keys. torch offers
``register_rendezvous_handler`` but refuses a second handler for a scheme, and
``init_process_group()``'s default ``init_method`` is ``env://``, so the existing
handler is swapped in torch's handler table (keeping the original, which still
builds the store: nothing else changes). This happens when ftkit is imported
(``install()`` from ``ftkit/__init__``): importing ftkit before
``init_process_group`` is enough, with plain torchrun. ``ftkit run`` also
installs it in every worker before the script starts (``ftkit.runtime.launch``), so a
trainer that imports ftkit late, or not at all, is covered too.

Measured (torch 2.13, 3 gloo ranks on 2 cores, tests/support/unmodified_trainer.py): 5
runs, each with up to 5 SIGKILLs of a random worker at random times (startup,
group formation, training) and one restart allowed per kill: without this,
0 of 5 finished (4 used up their restarts on "Connection refused", 1 hung in
init_process_group until killed); with ``import ftkit`` before the group under
plain torchrun, 5 of 5 finished with the exact final values, and 5 of 5 under
``ftkit run`` with ftkit imported only after the group. The provoked scenario
of tests/drills/test_unmodified_trainer.py (a kill during formation, a late rank):
0 of 8 without (4 refused, 4 hung), every run with. The handler costs one PrefixStore per group
(each store call prepends a short string) and ~1 ms of import time.

Why a handler and not a launcher flag: torchrun gives workers no way to ask
for a namespace (TORCHELASTIC_USE_AGENT_STORE only says who hosts the store),
and ``init_process_group`` looks up the ``env://`` handler when it is called,
so replacing it is the one place that changes the store of every unmodified
call, NCCL's and gloo's alike, without touching the trainer.

Scope and limits:

* Only under torchrun (``TORCHELASTIC_RESTART_COUNT`` set) and only for
  ``env://``; ``store=...``, ``tcp://`` and ``file://`` are left alone
  (``ftkit.coord.dist.init_process_group`` passes its own per-attempt store and is
  unaffected). ``FTKIT_ENV_RENDEZVOUS=0`` turns the wrapping off.
* Every rank must use it or none: a job where some workers import ftkit before
  ``init_process_group`` and some after would look for each other's keys in
  different namespaces (and time out). Same script on every rank, or
  ``ftkit run``, gives that.
* A torchrun restart after a membership change (a node joins a c10d
  rendezvous) keeps ``TORCHELASTIC_RESTART_COUNT``, which may also differ
  between agents; torchrun gives the workers nothing that tells those groups
  apart. ftkit's own agent (``ftkit run``, ftkit/runtime/warm/agent.py) exports the
  rendezvous round, the same on every node and new at every round, and the
  namespace is named after it (runtime/generation.py ``torchrun_attempt``); under
  plain torchrun such a re-formed group shares its attempt's namespace (as it
  shares torch's keys without this).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

from ftkit.runtime.generation import torchrun_attempt

log = logging.getLogger("ftkit")

DISABLE_ENV = "FTKIT_ENV_RENDEZVOUS"  # "0": leave torch's env:// handler alone


def attempt_prefix(environ: Any = os.environ) -> str | None:
    """The store namespace of this torchrun attempt, or None outside torchrun."""
    attempt = torchrun_attempt(environ)
    if attempt is None:
        return None
    return f"ftkit-rdzv/{environ.get('TORCHELASTIC_RUN_ID', 'run')}/{attempt}"  # PrefixStore adds the '/'


def _wrap(original: Any) -> Any:
    """torch's env:// handler, with the store it yields namespaced per torchrun attempt."""

    def handler(url: str, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
        from torch.distributed import PrefixStore

        from ftkit.coord import boot

        boot.mark("rendezvous")
        prefix = attempt_prefix()
        for store, rank, world_size in original(url, **kwargs):
            boot.mark("store")
            yield (PrefixStore(prefix, store) if prefix else store), rank, world_size

    handler.ftkit_original = original  # type: ignore[attr-defined]
    return handler


def installed() -> bool:
    """Whether the env:// handler in use is ftkit's."""
    import importlib

    rdzv = importlib.import_module("torch.distributed.rendezvous")
    return hasattr(rdzv._rendezvous_handlers.get("env"), "ftkit_original")


def install() -> bool:
    """Wrap torch's env:// handler (idempotent). True if ftkit's handler is now in use.

    Cheap: torch.distributed.rendezvous is imported by ``import torch`` already.
    Under torchrun with restarts, a process group that already exists here was
    formed without the namespace: a warning says so (import ftkit first, or
    launch with ``ftkit run``).
    """
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False
    try:
        import importlib

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

"""In-process recovery: a rank's exception costs a re-formed group, not a torchrun restart.

    def train(gen: ftkit.Generation) -> None:
        model = DDP(build_model())                  # everything that holds the process group
        optimizer = torch.optim.AdamW(model.parameters())
        with ftkit.Checkpointer({"model": model, "optimizer": optimizer}, tiers) as ck:
            for step in range(ck.restore() + 1, steps + 1):
                ...
                ck.snapshot(step)

    ftkit.run_in_process(train)                     # under torchrun / ftkit run

:func:`run_in_process` creates the default group if there is none, marks the process as
recovering in process (generation.py) and calls ``fn``. When ``fn`` raises on any rank:

1. that rank's watchdog posts the verdict; the others record it as a request, and their
   next ``snapshot()`` raises :class:`~ftkit.errors.RecoveryRequested`;
2. each rank, once ``fn`` has unwound, destroys its group and shuts down the sockets the
   group's creation opened. On gloo this is what unblocks the others: ``abort()``,
   ``shutdown()`` and ``_abort_process_group`` do not interrupt a collective waiting on a
   live peer (torch 2.13), but it fails at once when that peer's connections close. A
   DDP built on the group keeps it alive in C++ for good, so destroying it is not enough:
   the wrapper creates each generation's group itself and notes its sockets;
3. the generation advances; the ranks meet on the first group's store (``ftkit-gen/<n>``,
   bounded by ``recovery_timeout_s``) and build a new default group there;
4. ``fn`` runs again, rebuilds its model and Checkpointer, and restores from node RAM.

A dead or hung rank cannot take part. Under ``ftkit run --replace-dead N`` its warm client
(warm/client.py) has the zygote fork a replacement (``$FTKIT_REJOIN``) that joins the
survivors' next generation (``ftkit-gen/latest``). Otherwise, and for a lost node, a
recovery that misses ``recovery_timeout_s``, more than ``max_recoveries`` recoveries, and
``KeyboardInterrupt``/``SystemExit`` (never caught), the workers end and torchrun restarts
the group.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

from ftkit.coord import boot
from ftkit.coord.faultpoints import fault_point
from ftkit.errors import FtkitError, one_line
from ftkit.runtime import generation
from ftkit.runtime.verdict_actions import EXIT_CODE  # (torchrun restarts the group)
from ftkit.runtime.warm.client import REJOIN_ENV, REPLACEABLE_ENV, die_like

LATEST_KEY = "ftkit-gen/latest"  # the generation the ranks advanced to last (a replacement joins it)

log = logging.getLogger("ftkit")

T = TypeVar("T")


@dataclass(frozen=True)
class Generation:
    """What ``fn`` is told at each call: which generation this is, and why the last one ended."""

    number: int  # 0 on the first call, then one more per in-process recovery
    reason: str | None = None  # the failure that ended the previous generation (one line)


class RecoveryFailed(FtkitError):
    """The ranks did not come together for the next generation in time."""


def run_in_process(
    fn: Callable[[Generation], T],
    *,
    backend: str = "gloo",
    max_recoveries: int = 8,
    recovery_timeout_s: float = 30.0,
    group_timeout_s: float = 1800.0,
) -> T:
    """Run ``fn`` and recover in process from its exceptions on any rank; return what it returns.

    `group_timeout_s` is the collectives' timeout; past `recovery_timeout_s` without the
    others re-forming the group, a rank ends so torchrun restarts the job.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    timeout = timedelta(seconds=group_timeout_s)
    sockets: set[tuple[int, int]] = set()  # (fd, inode) of this generation's group's connections
    reason: str | None = None
    rejoining = bool(os.environ.get(REJOIN_ENV)) and not dist.is_initialized()
    if rejoining:  # a replacement for a killed worker: the survivors' next generation is ours
        try:
            base, sockets = _rejoin(backend, timeout, recovery_timeout_s)
        except Exception as e:  # nobody to join (the survivors gave up): torchrun restarts the group
            _give_up(int(os.environ.get("RANK", "-1")), generation.current(), e)
        reason = f"replaced rank {dist.get_rank()}'s killed process"
    elif not dist.is_initialized():
        sockets = _init_group(backend, timeout=timeout)
    else:
        # Its connections are closed only by destroying it: a DDP built on it would hold it open.
        log.info("ftkit: run_in_process uses the existing process group; let it create the group instead")
    if dist.get_world_size() == 1:  # nothing to re-form: a failure is the failure
        return fn(Generation(0))
    if not rejoining:  # each generation's group is built under the store the first group was made on
        base = _namespace(_get_default_store())
    gc.freeze()  # the imports are never garbage: keep each teardown's collection cheap
    rank, world = dist.get_rank(), dist.get_world_size()
    recoveries = 0
    terms = _Terminations()
    terms.install()
    generation.set_active(True)
    mark = _mark_replaceable()
    try:
        while True:
            try:
                result = fn(Generation(generation.current(), reason))
            except Exception as e:
                if terms.signum is not None:  # torchrun is ending the group (a peer died), or a preemption
                    log.warning("ftkit: rank %d failed after a termination signal; not recovering", rank)
                    terms.die()
                    raise  # (the script's own handler chose not to end the process)
                if recoveries >= max_recoveries:
                    log.error("ftkit: %d in-process recoveries already; giving up on this one", recoveries)
                    raise
                reason = one_line(e)
                failed_t = time.time()
                log.warning(
                    "ftkit: rank %d, generation %d ended: %s; recovering in process", rank, generation.current(), reason
                )
            else:
                if terms.signum is not None:  # it came after the last step: no final save answered it
                    log.warning("ftkit: SIGTERM came after the last step; the process ends as it asks")
                    terms.die()
                return result
            # (out of the except clause: the traceback, and the frames holding the group, are gone)
            recoveries += 1
            _tear_down(sockets)
            torn_t = time.time()
            number = generation.join(generation.current() + 1)
            fault_point("recover", number, rank)  # a drill's second fault, while the group re-forms
            try:
                base.set(LATEST_KEY, str(number))  # (a replacement of a killed rank looks for it)
                sockets = _regroup(base, number, rank, world, backend, timeout, recovery_timeout_s, terms)
            except Exception as e:
                _give_up(rank, number, e)
            boot.reset()
            boot.mark("failed", failed_t)
            boot.mark("torn_down", torn_t)
            boot.mark("regrouped")
    finally:
        if mark:
            with contextlib.suppress(OSError):
                os.unlink(mark)
        generation.set_active(False)
        terms.uninstall()


def _mark_replaceable() -> str | None:
    """Create the file (``$FTKIT_REPLACEABLE``) that tells the warm client to replace this worker
    if killed; its path, or None."""
    path = os.environ.get(REPLACEABLE_ENV)
    try:
        if path:
            open(path, "w").close()
        return path
    except OSError as e:
        log.warning("ftkit: cannot mark this worker replaceable (%s): a kill restarts the group", e)
        return None


def _rejoin(backend: str, timeout: timedelta, wait_s: float) -> tuple[Any, set[tuple[int, int]]]:
    """A replacement worker joins the survivors' next generation; (the base store, its group's sockets).

    The first generation's group is not created again: its keys in the store are stale."""
    import torch.distributed as dist

    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    base = _namespace(store)
    number = _next_generation(base, world, wait_s)
    generation.join(number)
    sockets = _regroup(base, number, rank, world, backend, timeout, wait_s, _Terminations())
    boot.mark("regrouped")
    log.warning("ftkit: rank %d's replacement joined generation %d", rank, number)
    return base, sockets


def _namespace(store: Any) -> Any:
    """The wrapper's namespace, one per torchrun attempt, on the job's store below any prefixes
    torch or the launcher added, so a replacement finds the same keys through its own connection."""
    import torch.distributed as dist

    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return dist.PrefixStore(f"ftkit-inprocess/{generation.torchrun_attempt() or '0'}", store)


def _next_generation(store: Any, world: int, wait_s: float) -> int:
    """The generation the survivors are forming: the newest one fewer than `world` ranks arrived at."""
    end = time.monotonic() + wait_s
    delay = 0.005
    while True:
        if store.check([LATEST_KEY]):
            number = int(store.get(LATEST_KEY))
            if int(store.add(f"ftkit-gen/{number}/arrived", 0)) < world:
                return number
        if time.monotonic() > end:
            raise RecoveryFailed(f"no generation of the survivors to join within {wait_s:g}s")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


class _Terminations:
    """SIGTERM while the wrapper runs (torchrun ending the group, or a preemption): no recovery after one.

    Under a Checkpointer, whose preemption handler chains to this one, it is only recorded, and
    acted on once ``fn`` ends (a final save ends the process first); with no handler above it the
    process ends now."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: Any = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self.on_signal)

    def uninstall(self) -> None:
        if signal.getsignal(signal.SIGTERM) == self.on_signal:  # (so installed, on the main thread)
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)

    def on_signal(self, signum: int, frame: Any) -> None:
        self.signum = signum
        if signal.getsignal(signum) == self.on_signal:  # nobody above: the signal's own meaning
            self.die()

    def die(self) -> None:
        signum = self.signum or signal.SIGTERM
        previous = self._previous
        self.uninstall()
        if callable(previous):  # the handler the script had: its choice
            previous(signum, None)
            return
        logging.shutdown()
        die_like({"signal": signum})


def _init_group(backend: str, **kwargs: Any) -> set[tuple[int, int]]:
    """init_process_group; returns the connections its creation opened (see _group_sockets)."""
    import torch.distributed as dist

    before = _sockets()
    dist.init_process_group(backend, **kwargs)
    return _group_sockets(before)


def _tear_down(sockets: set[tuple[int, int]]) -> None:
    """Destroy this generation's process groups and cut their connections, so blocked peers fail now."""
    import torch.distributed as dist

    _cut(sockets)
    if dist.is_initialized():
        try:
            if dist.get_backend() != "gloo":
                # NCCL's abort does end a collective in flight; it aborts every group. Untested in CI.
                dist.distributed_c10d._abort_process_group()  # (and forgets them all)
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as e:  # already broken: what matters is that its connections close
            log.warning("ftkit: destroying the failed generation's process group: %s", one_line(e))
    gc.collect()  # what the failure left unreachable


def _sockets() -> set[tuple[int, int]]:
    """This process's open sockets as (fd, inode); empty where /proc is not there."""
    out: set[tuple[int, int]] = set()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add((int(name), int(target[8:-1])))
    return out


def _group_sockets(before: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """The connections a group's creation opened, less any to the rendezvous store.

    Not its listening socket: gloo's listener thread aborts the process if accept() fails.
    """
    store_port = int(os.environ.get("MASTER_PORT", "0") or 0)
    out: set[tuple[int, int]] = set()
    for fd, inode in _sockets() - before:
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                peer = s.getpeername() if s.type == socket.SOCK_STREAM else None
        except OSError:  # not connected (a listener), or gone
            continue
        if isinstance(peer, tuple) and len(peer) >= 2 and peer[1] != store_port:
            out.add((fd, inode))
    return out


def _cut(sockets: set[tuple[int, int]]) -> None:
    """Shut down each socket still open as the same socket (the fd may have been reused)."""
    for fd, inode in sockets:
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != f"socket:[{inode}]":
                continue
            with socket.socket(fileno=os.dup(fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            continue


def _regroup(
    base: Any, number: int, rank: int, world: int, backend: str, timeout: timedelta, wait_s: float, terms: _Terminations
) -> set[tuple[int, int]]:
    """Wait until every rank has arrived at generation `number` (or raise RecoveryFailed), then
    build its default group under ``ftkit-gen/<number>/pg``; the group's sockets (_init_group)."""
    import torch.distributed as dist

    key = f"ftkit-gen/{number}/arrived"
    base.add(key, 1)
    end = time.monotonic() + wait_s
    delay = 0.001
    while True:
        if terms.signum is not None:  # (the handler ends the process; this is for a script's own handler)
            raise RecoveryFailed(f"signal {terms.signum} while waiting for generation {number}")
        arrived = int(base.add(key, 0))
        if arrived >= world:
            break
        if time.monotonic() > end:
            raise RecoveryFailed(f"{arrived} of {world} ranks arrived for generation {number} within {wait_s:g}s")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    group_store = dist.PrefixStore(f"ftkit-gen/{number}/pg", base)
    return _init_group(backend, store=group_store, rank=rank, world_size=world, timeout=timeout)


def _give_up(rank: int, number: int, e: BaseException) -> NoReturn:
    log.error(
        "ftkit: rank %d could not re-form the group for generation %d (%s); ending this worker so torchrun "
        "restarts the group",
        rank,
        number,
        one_line(e),
    )
    logging.shutdown()
    os._exit(EXIT_CODE)

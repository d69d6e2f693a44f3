"""Who we are in the job, and agreement between ranks through the c10d store.

Ranks coordinate only through the store, never through collectives on the training
group: a background thread can take part safely and a dead rank costs a bounded wait,
not a hang. A single process is a world of one with no store, where every call is a no-op.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ftkit.errors import FormatError, FtkitError, PeerTimeout, RecoveryRequested
from ftkit.format.validate import parse_json, parse_message
from ftkit.runtime import generation


def node_id(rank: int) -> str:
    """The failure domain: $FTKIT_NODE_ID, else node<rank // $FTKIT_RANKS_PER_NODE> (tests
    simulate nodes so), else the host name."""
    if os.environ.get("FTKIT_NODE_ID"):
        return os.environ["FTKIT_NODE_ID"]
    if per_node := os.environ.get("FTKIT_RANKS_PER_NODE"):
        if not (per_node.isascii() and per_node.isdigit() and int(per_node) > 0):
            raise FtkitError(f"FTKIT_RANKS_PER_NODE={per_node[:40]!r}: not a whole number of ranks above 0")
        return f"node{rank // int(per_node)}"
    return socket.gethostname()


def host_identity() -> str | None:
    """What makes a pid meaningful: host name, boot id and pid namespace (host names alone are
    shared by containers), or None (no /proc): two processes share a host only when all match."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    if not boot or not pidns:
        return None
    return f"{socket.gethostname()}/{boot}/{pidns}"


WAIT_POLL_MAX_S = 0.05  # under run_in_process: the training thread's store waits poll at most this far apart
_FRAME = struct.Struct("<II")  # (sender, length) ahead of each value sent to rank 0 (DistContext.send_to_root)


def to_root_keys(key: str) -> list[str]:
    """The store keys of one `send_to_root` exchange: the values appended, the senders' count, the done mark."""
    return [f"{key}/all", f"{key}/count", f"{key}/done"]


EXIT_SETTLE_S = 0.2


@functools.cache  # (registered once)
def _settle_collectives_at_exit() -> None:
    """At exit, give gloo's worker threads a moment to let go of finished collectives.

    A gloo worker thread that frees a collective's tensors once the interpreter is
    finalizing is ended mid-C++ and the process aborts ("terminate called without an
    active exception", exit -6; torch's AsyncAllgatherWork). atexit runs before that."""
    atexit.register(time.sleep, EXIT_SETTLE_S)


def rendezvous_id() -> str | None:
    """The rendezvous (run) id torchrun was given, or None if it is torchrun's default ("none",
    the same for every job) or absent. --standalone gives a uuid per invocation: a real id."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    return None if run is None or run.strip().lower() in ("", "none") else run


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    store: Any = None  # a c10d Store (prefixed for ftkit) or None
    node: str = field(default_factory=lambda: node_id(0))
    timeout_s: float = 300.0
    nodes: list[str] = field(default_factory=list)  # node of every rank, by rank
    scope: str = ""  # the store namespace of this context (its keys' prefix below the job's store)
    generation: int = field(default_factory=generation.current)  # the in-process generation it serves
    # Whether `store` is a connection of this context's own, whose calls wait at most
    # `timeout_s` (own_connection): a get then needs no wait request of ours before it.
    waits_itself: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if not self.nodes:
            self.nodes = [self.node] * self.world_size

    @staticmethod
    def detect(timeout_s: float = 300.0) -> DistContext:
        """The running job's context (torch.distributed if initialized), else a world of one."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return DistContext(timeout_s=timeout_s)
        from torch.distributed.distributed_c10d import _get_default_store

        # Namespaced per torchrun attempt and in-process generation: a restarted group never
        # reads what the previous one left in a store that outlives it.
        attempt = (generation.torchrun_attempt() or "0") + generation.suffix()
        run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
        scope = f"ftkit/{run}/{attempt}/"
        store = dist.PrefixStore(scope, _get_default_store())
        rank = dist.get_rank()
        ctx = DistContext(rank, dist.get_world_size(), store, node_id(rank), timeout_s, scope=scope)
        ctx.nodes = _expand_runs(ctx.share("nodes", ctx.node, _node_runs), ctx.world_size)
        _settle_collectives_at_exit()
        return ctx

    def own_connection(self) -> DistContext:
        """The same context over a new connection to the store: a store client serializes its
        calls, so each thread that talks to the store needs its own (a long wait would stall
        the watchdog's heartbeats)."""
        store = self.store.clone() if self.store is not None else None
        if store is not None:  # (a clone's timeout is its own: the original's callers keep theirs)
            store.set_timeout(timedelta(seconds=self.timeout_s))
        return dataclasses.replace(self, store=store, nodes=list(self.nodes), waits_itself=store is not None)

    def scoped(self, prefix: str) -> DistContext:
        """The same context with its keys below `prefix` (one Checkpointer's namespace)."""
        import torch.distributed as dist

        store = dist.PrefixStore(prefix, self.store) if self.store is not None else None
        return dataclasses.replace(self, store=store, nodes=list(self.nodes), scope=self.scope + prefix)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def node_leader(self, rank: int) -> bool:
        """Whether `rank` is the lowest rank of its node (it keeps the node's RAM tier)."""
        return rank == min(r for r, n in enumerate(self.nodes) if n == self.nodes[rank])

    # ---------------------------------------------------------------- store
    def put(self, key: str, value: Any) -> None:
        self.store.set(key, json.dumps(value))

    def get(self, key: str, timeout_s: float | None = None) -> Any:
        """The JSON value at `key`, waiting at most `timeout_s` for it (FormatError if malformed)."""
        return parse_json(self.get_raw(key, timeout_s), f"store key {key[:120]!r}", "message")

    def get_raw(self, key: str, timeout_s: float | None = None) -> bytes:
        """The bytes at `key` as set, waiting at most `timeout_s` for them to appear."""
        return self.wait_get([key], timeout_s)[0]

    def wait_get(self, keys: list[str], timeout_s: float | None = None) -> list[bytes]:
        """The bytes at every one of `keys`, once all are set."""
        if self.waits_itself and timeout_s in (None, self.timeout_s) and not generation.active():  # (one round trip)
            try:
                return self.store.multi_get(keys)
            except Exception as e:  # c10d raises DistStoreError on timeout
                raise self._timed_out(keys, self.timeout_s, e) from None
        self._wait(keys, timeout_s)
        return self.store.multi_get(keys)

    def barrier(self, key: str, timeout_s: float | None = None) -> None:
        """Return once every rank has called it with `key`."""
        self.share(key, None, lambda _: None, timeout_s)

    def share(
        self, key: str, value: Any, decide: Callable[[dict[int, Any]], Any], timeout_s: float | None = None
    ) -> Any:
        """What rank 0 makes, with `decide`, of every rank's `value` ({rank: value}, malformed ones
        None), on every rank; all ranks call it with a `key` of their own. Rank 0 collects the
        values (gather_to_root: three keys) and sets its result, as JSON, in one key every rank
        reads: the store serves two requests a rank, not every rank's key to every rank. A rank
        that sends nothing in time is a PeerTimeout on every rank."""
        if not self.distributed:
            return decide({0: value})
        result = f"{key}/result"
        try:
            got = self.gather_to_root(key, value, range(self.world_size), timeout_s)
        except PeerTimeout as e:  # every rank hears it now, not when its own wait ends
            self.put(result, {"timeout": str(e)})
            raise
        if self.rank == 0:  # (read back as the others read it: the same JSON values on every rank)
            text = json.dumps({"result": decide(got)})
            self.store.set(result, text)
            return json.loads(text)["result"]
        doc = self.get(result, timeout_s)
        if not isinstance(doc, dict) or not ({"result"} == set(doc) or {"timeout"} == set(doc)):
            raise FormatError(f"store key {result!r} holds no result of rank 0's")
        if "timeout" in doc:
            raise PeerTimeout(str(doc["timeout"]))
        return doc["result"]

    def send_to_root(self, key: str, sender: int, value: bytes, senders: int) -> None:
        """`value` from `sender` (one of `senders` in all) for rank 0's `collect_at_root(key)`.

        All senders append to one key and the one that makes the count whole marks it done,
        so rank 0 handles three keys whatever the number of senders."""
        all_, count, done = to_root_keys(key)
        self.store.append(all_, _FRAME.pack(sender, len(value)) + value)
        if self.store.add(count, 1) == senders:  # (its append is in: the store serves requests in order)
            self.store.set(done, b"")

    def collect_at_root(
        self, key: str, senders: Sequence[int], timeout_s: float | None = None
    ) -> dict[int, bytes | None]:
        """Rank 0: the value each of `senders` sent with `send_to_root(key)`, None where none came
        within `timeout_s`; a sender's later value replaces its earlier one. The exchange's keys
        are deleted. FormatError where the values do not unpack."""
        if not senders:
            return {}
        all_, _, done = names = to_root_keys(key)
        try:
            try:
                data = self.wait_get([done, all_], timeout_s)[1]
            except PeerTimeout:  # whatever came, and None for the rest
                data = self.store.get(all_) if self._has(all_) else b""
            got: dict[int, bytes | None] = dict.fromkeys(senders)
            at = 0
            while at + _FRAME.size <= len(data):
                sender, length = _FRAME.unpack_from(data, at)
                at += _FRAME.size + length
                if sender in got and at <= len(data):  # (another's: ignored)
                    got[sender] = data[at - length : at]
            if at != len(data):
                raise FormatError(f"store key {all_!r} is cut short")
            return got
        finally:
            self.delete(*names)

    def gather_to_root(
        self, key: str, value: Any, ranks: Sequence[int], timeout_s: float | None = None, raw: bool = False
    ) -> Any:
        """`value` of each of `ranks` ({rank: value}) on rank 0 only; None elsewhere. Every rank
        calls it. `raw`: the values are bytes (commit/messages.py), else JSON. PeerTimeout
        names the ranks that sent nothing; malformed values come as empty bytes (raw) or None."""
        others = [r for r in ranks if r != 0]
        if self.rank != 0:
            if self.rank in ranks:
                self.send_to_root(key, self.rank, value if raw else json.dumps(value).encode(), len(others))
            return None
        try:
            values = self.collect_at_root(key, others, timeout_s)
        except FormatError:  # (the store is untrusted input: what does not unpack reads as malformed)
            values = dict.fromkeys(others, b"")
        missing = [r for r, v in values.items() if v is None]
        if missing:
            within = f"{timeout_s or self.timeout_s:.0f}s"
            raise PeerTimeout(f"rank 0: nothing from rank(s) {_ranks_text(missing)} for {key!r} within {within}")
        got = {r: v if raw else parse_message(v) for r, v in values.items()}
        return {**got, **({0: value} if 0 in ranks else {})}

    def leaders(self) -> list[int]:
        """The lowest rank of each node, in node order of first appearance."""
        first: dict[str, int] = {}
        for r, n in enumerate(self.nodes):
            first.setdefault(n, r)
        return list(first.values())

    def _wait(self, keys: list[str], timeout_s: float | None) -> None:
        timeout_s = timeout_s or self.timeout_s
        try:
            if generation.active():
                self._wait_or_recover(keys, timeout_s)
            else:
                self.store.wait(keys, timedelta(seconds=timeout_s))
        except RecoveryRequested:
            raise
        except Exception as e:  # c10d raises DistStoreError / RuntimeError on timeout
            raise self._timed_out(keys, timeout_s, e) from None

    def _timed_out(self, keys: list[str], timeout_s: float, error: Exception) -> PeerTimeout:
        missing = [k for k in keys if not self._has(k)] or keys
        return PeerTimeout(
            f"rank {self.rank}: no answer for {', '.join(map(repr, missing))} within "
            f"{timeout_s:.0f}s ({type(error).__name__})"
        )

    def _wait_or_recover(self, keys: list[str], timeout_s: float) -> None:
        """Under run_in_process a wait ends early when a recovery is requested or its generation
        is over (a failed rank never sets its key). The training thread polls, to reach the
        recovery at once; a background thread waits in slices of a second (c10d logs every
        wait that times out, so no short slices)."""
        main = threading.current_thread() is threading.main_thread()
        end = time.monotonic() + timeout_s
        delay = 0.001
        while True:
            if main and self.store.check(keys):
                return
            if not main:
                with contextlib.suppress(Exception):  # (not yet: look at the generation, then wait again)
                    self.store.wait(keys, timedelta(seconds=max(0.001, min(1.0, end - time.monotonic()))))
                    return
            generation.raise_if_requested(self.generation)
            if time.monotonic() >= end:
                raise TimeoutError(f"{len(keys)} key(s) not set within {timeout_s:.0f}s")
            if main:
                time.sleep(delay)
                delay = min(delay * 2, WAIT_POLL_MAX_S)

    def _has(self, key: str) -> bool:
        with contextlib.suppress(Exception):  # (the store itself is gone: the key is missing)
            return bool(self.store.check([key]))
        return False

    def broadcast(self, key: str, value: Any = None, timeout_s: float | None = None) -> Any:
        """Rank 0's `value`, on every rank."""
        if not self.distributed:
            return value
        if self.rank == 0:
            self.put(key, value)
            return value
        return self.get(key, timeout_s)

    def delete(self, *keys: str) -> None:
        if self.store is None:
            return
        for k in keys:
            with contextlib.suppress(Exception):  # best effort: stale keys only cost store memory
                self.store.delete_key(k)


def init_process_group(backend: str | None = "gloo", timeout_s: float = 1800.0, **kwargs: Any) -> None:
    """torch.distributed.init_process_group through ftkit's restart-safe env:// rendezvous
    (coord/rendezvous.py): a restart never reads the previous attempt's rendezvous keys.
    `timeout_s` in seconds (torch's `timeout=` wins when given)."""
    import torch.distributed as dist

    from ftkit.coord.rendezvous import install

    install()  # (done by `import ftkit` already, unless FTKIT_ENV_RENDEZVOUS=0 turned it off)
    kwargs.setdefault("timeout", timedelta(seconds=timeout_s))
    dist.init_process_group(backend, **kwargs)


def _node_runs(nodes: dict[int, Any]) -> list[tuple[str, int]]:
    """Every rank's node as runs of (node, ranks in a row): one run a node under torchrun."""
    runs: list[tuple[str, int]] = []
    for r in range(len(nodes)):
        node = str(nodes[r])
        if runs and runs[-1][0] == node:
            runs[-1] = (node, runs[-1][1] + 1)
        else:
            runs.append((node, 1))
    return runs


def _expand_runs(runs: Any, world: int) -> list[str]:
    """_node_runs' runs (from the store: checked) as the node of each rank."""
    try:
        nodes = [str(node) for node, count in runs for _ in range(int(count))]
    except (TypeError, ValueError):
        nodes = []
    if len(nodes) != world:
        raise FormatError(f"rank 0's list of the ranks' nodes is malformed ({str(runs)[:80]})")
    return nodes


def _ranks_text(ranks: Sequence[int]) -> str:
    """Ranks for an error message: the first eight, and how many in all."""
    shown = ", ".join(map(str, ranks[:8]))
    return shown if len(ranks) <= 8 else f"{shown}, ... ({len(ranks)} in all)"

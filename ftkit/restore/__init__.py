"""Restore: choose the newest step that is complete somewhere, read it, vote, load.

Order of calls (every rank runs `restore` together; planning is plan.py, what the tiers
hold inventory.py, reading a candidate read.py)::

    inventory   each node's leader sends rank 0 what its node's RAM tier holds
    candidates  rank 0 merges them with the shared tiers' listings and publishes
                (step, source) pairs: newest step first; RAM first, then shared tiers
                fastest first
    undo        the live state copied aside before the first write (undo.py)
    per candidate, until one is usable:
        fit     each rank checks the manifest against the live state: a mismatch raises
        read    files (and manifest parts) its node lacks come from peers; every needed
                chunk is read once, verified where it lands, straight into live tensors
        vote    on an error anywhere every rank puts the live bytes back and moves on
        load    into the live objects, then a second vote: a refusal on any rank rolls
                every rank back and on to the next candidate

When no candidate loads, restore raises CorruptCheckpointError with the live state as it
was. The newer steps a restore supersedes are retired only at the run's next snapshot
(`retire_superseded`), so a failed or read-only restore changes nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ftkit.commit.messages import Inventory
from ftkit.coord.agree import agree
from ftkit.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatError,
    StateMismatchError,
    StorageError,
    one_line,
)
from ftkit.format import codec
from ftkit.format.reader import scan
from ftkit.restore.context import RestoreContext
from ftkit.restore.inventory import ram_inventory, shared_listings
from ftkit.restore.plan import Candidate, order_candidates, ram_candidates
from ftkit.restore.read import init_sharded_optimizers, read_ram_candidate, read_shared_candidate
from ftkit.restore.undo import UndoCopy
from ftkit.save import capture as cap

__all__ = ["RestoreContext", "Superseded", "restore", "retire_superseded"]

log = logging.getLogger("ftkit")


@dataclass(frozen=True)
class Superseded:
    """The newer steps a restore of `step` left behind (`retire_superseded`). `listed`: per
    shared tier (index), the committed steps rank 0 listed while planning (empty elsewhere).
    `unusable`: per tier, the steps the restore found unusable there (their retention counts
    them toward no `keep`: tiers/retention.py)."""

    step: int
    listed: dict[int, list[int]] = field(default_factory=dict)
    unusable: dict[int, list[int]] = field(default_factory=dict)


def _inventory(leader: int, raw: bytes) -> Inventory | None:
    """A node's inventory from the store (untrusted): None, the node holding nothing, when it
    does not decode."""
    try:
        return Inventory.decode(raw, f"the RAM tier inventory of the node of rank {leader}")
    except FormatError as e:
        log.warning("%s", e)
        return None


def _unusable(inventories: list[Inventory | None], nodes: list[str], step: int | None) -> list[str]:
    """The RAM-tier steps (`step` only, when asked for) whose committed manifest a node could not
    read, newest first, each as a line naming the node and why."""
    found = {
        (held.step, node): held.problem
        for inv, node in zip(inventories, nodes, strict=True)
        if inv is not None
        for held in inv.steps
        if held.problem is not None and step in (None, held.step)
    }
    return [f"RAM tier step {s} on node {node}: {why}" for (s, node), why in sorted(found.items(), reverse=True)]


def restore(rc: RestoreContext, step: int | None, key: str) -> tuple[int, dict[str, Any], Superseded | None]:
    """Restore `step` (None: the newest usable) into rc.state; every rank calls it with
    the same `key` (the store namespace of this call). Returns (step restored or 0,
    what this rank's last_restore reports, what the restore superseded)."""
    ctx = rc.dist
    t_start = time.perf_counter()
    inventory, manifests = ram_inventory(rc)
    # A node's leader speaks for its node; only rank 0 sends the file lists, the others a digest.
    sent = (inventory if ctx.rank == 0 else inventory.without_lists()).encode()
    by_leader = ctx.gather_to_root(f"{key}/inv", sent, ctx.leaders(), raw=True) if rc.ram is not None else None
    listing = None
    listings: list[tuple[int, list[int]]] = []
    planned: list[Candidate] = []
    if ctx.rank == 0:
        ram, unusable, incomplete = {}, [], set()
        if rc.ram is not None and by_leader is not None:
            leader_of = {ctx.nodes[r]: r for r in by_leader}
            inventories = [_inventory(leader_of[n], by_leader[leader_of[n]]) for n in ctx.nodes]
            ram = ram_candidates(inventories, ctx.nodes, rc.ram, rc.backends[rc.ram].can_fetch)
            unusable = _unusable(inventories, ctx.nodes, step)
            incomplete = {h.step for inv in inventories if inv is not None for h in inv.steps} - set(ram)
        listings, unreachable = shared_listings(rc)
        planned = order_candidates(step, ram, listings)
        # Without holders: only rank 0 plans the fetches (read.py).
        listing = {
            "candidates": [c.to_json(holders=False) for c in planned],
            "unreachable": unreachable,
            "unusable": unusable,
            "incomplete": sorted(incomplete),  # RAM-tier steps held but not readable as a whole
        }
    listing = ctx.broadcast(f"{key}/candidates", listing)
    try:  # (rank 0's word, through the store: checked like any message)
        candidates = planned or [Candidate.from_json(c) for c in listing["candidates"]]
        unreachable = [str(u) for u in listing["unreachable"]]
        unusable = [str(u) for u in listing["unusable"]]
        found_bad = {rc.ram: [int(s) for s in listing["incomplete"]]} if rc.ram is not None else {}
    except (TypeError, KeyError, ValueError):
        raise FormatError("a malformed list of restore candidates from rank 0") from None
    t_plan = time.perf_counter() - t_start
    if step is not None and not candidates:
        raise CheckpointNotFoundError(
            f"step {step} is not committed on any tier ({', '.join(b.display_url for b in rc.backends)})"
            + (f"; {unusable[0]}" if unusable else "")
        )
    if not candidates:
        if unreachable:
            raise StorageError(f"no checkpoint found and a tier could not be read: {unreachable[0]}")
        if unusable:  # as a shared tier's unreadable step: an error, not a fresh start that drops it
            raise CorruptCheckpointError(f"no usable checkpoint, nothing was loaded or removed: {unusable[0]}")
        rc.emit("restore", step=0, source=None, total_s=time.perf_counter() - t_start)
        return 0, {}, Superseded(0)  # RAM steps without a manifest anywhere go before the first snapshot
    with UndoCopy.take(rc.state, rng=rc.rng, rank=ctx.rank, arena=rc.arena) as undo:
        init_sharded_optimizers(rc.state)  # (a change to the live state too: undone with the rest)
        problems: list[str] = []
        for n, cand in enumerate(candidates):
            s, i = cand.step, cand.tier
            backend = rc.backends[i]
            t0 = time.perf_counter()
            if backend.node_local:
                loaded, vote, origin = read_ram_candidate(rc, cand, f"{key}/{n}", manifests.get(s))
            else:
                loaded, vote = read_shared_candidate(rc, s, backend.storage)
                origin = {"source": backend.display_url}
            t_read = time.perf_counter() - t0
            votes = agree(ctx, f"{key}/vote/{n}", error=vote["error"], value=vote["mismatch"])
            mismatched = [(r, found) for r, found in enumerate(votes.values) if found]
            if mismatched:  # the live state does not fit: no other candidate will either (the exit undoes)
                r, found = mismatched[0]
                raise StateMismatchError(cap.describe(found) + ("" if r == ctx.rank else f" (on rank {r})"))
            failed = votes.first_failure(ctx.rank)
            if failed is None:
                manifest, tensors, (rng_value, local_value) = loaded
                t1 = time.perf_counter()
                failed = _load(rc, manifest, tensors, rng_value, local_value, agree_key=f"{key}/loaded/{n}")
                t_load = time.perf_counter() - t1
                if failed is not None:
                    undo.roll_back()  # some rank's load refused the step: every rank goes back
            else:
                undo.put_back_bytes()  # nothing was loaded: only bytes were read into live tensors
            if failed is not None:
                problems.append(failed)
                found_bad.setdefault(i, []).append(s)
                log.warning("step %d from %s is unusable, trying the next source: %s", s, origin["source"], failed)
                continue
            undo.keep()
            report, superseded = _report(
                rc, s, i, manifest, tensors, origin, listings, found_bad, t_start, t_plan, t_read, t_load
            )
            return s, report, superseded
        raise CorruptCheckpointError(
            f"no usable checkpoint: {len(problems)} candidate(s) failed and the live state is as it was; "
            f"newest problem: {problems[0]}"
        )


def _load(rc: RestoreContext, manifest, tensors, rng_value, local_value, agree_key: str) -> str | None:
    """Load a step every rank read intact, and agree that every rank did (a refusal on one rank
    sends every rank on to the next candidate). Returns the first failure, if any."""
    error = None
    try:
        cap.load(rc.state, manifest.skeleton, tensors, rng_value, local_value)
    except Exception as e:  # a user object's own validation: keep its words
        error = f"step {manifest.step}: {one_line(e, 300)}"
    outcome = agree(rc.dist, agree_key, error=error)
    return outcome.first_failure(rc.dist.rank)


def _report(rc, s, i, manifest, tensors, origin, listings, found_bad, t_start, t_plan, t_read, t_load):
    """Step `s` loaded: this rank's last_restore (also its event and log line), and what it superseded."""
    ctx = rc.dist
    # (Newer steps are retired or dropped now, and their numbers written again by this run: not bad.)
    bad = {t: [x for x in steps if x <= s] for t, steps in found_bad.items()}
    superseded = Superseded(s, {t: [x for x in steps if x > s] for t, steps in listings}, bad)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    report = {
        "step": s,
        **origin,
        "bytes": nbytes,
        "saved_world_size": manifest.world_size,
        "plan_s": t_plan,
        "read_s": t_read,
        "load_s": t_load,
        "total_s": time.perf_counter() - t_start,
        "superseded": {rc.backends[t].display_url: v for t, v in superseded.listed.items() if v},
    }
    if codec.skip_active():  # (a drill's FTKIT_UNSAFE_SKIP_CHECKSUMS: say so wherever it shows)
        report["checksums_skipped"] = True
    rc.emit("restore", **{k: v for k, v in report.items() if k != "received"})
    log.info(
        "rank %d restored step %d from %s: %.1f MB (plan %.2fs, read %.2fs%s, load %.2fs)%s%s",
        ctx.rank,
        s,
        origin["source"],
        nbytes / 1e6,
        t_plan,
        t_read,
        f" of which fetching from peers {origin['fetch_s']:.2f}s" if "fetch_s" in origin else "",
        t_load,
        f"; {origin['files_from_peers']} file(s) from peers" if origin.get("files_from_peers") else "",
        f"; saved by {manifest.world_size} ranks, resharded to {ctx.world_size}"
        if manifest.world_size != ctx.world_size
        else "",
    )
    return report, superseded


def retire_superseded(rc: RestoreContext, superseded: Superseded, key: str) -> dict[str, list[int]]:
    """Before the first snapshot after a restore, take the steps it superseded out of the timeline.

    Left in place, they would refuse the run's next snapshots and a later restart would resume
    them. The RAM tier drops every newer step; shared tiers retire only those listed when the
    restore planned. Every rank calls it; it ends with a barrier. Returns {tier URL: steps
    retired by this rank}."""
    ctx = rc.dist
    step = superseded.step
    out: dict[str, list[int]] = {}
    for i, backend in enumerate(rc.backends):
        backend.unusable = frozenset(superseded.unusable.get(i, ()))  # for its retention from now on
        if not backend.owns(ctx):  # a node's leader for the RAM tier, rank 0 for a shared one
            continue
        try:
            listed = set(superseded.listed.get(i, []))
            dirs = [
                d
                for d in scan(backend.storage)
                if d.step > step and (backend.node_local or (d.committed and d.step in listed))
            ]
        except StorageError as e:
            log.warning(
                "rank %d: cannot list %s to retire steps newer than %d: %s", ctx.rank, backend.display_url, step, e
            )
            continue
        for d in dirs:
            try:
                backend.supersede(d.step)
                out.setdefault(backend.display_url, []).append(d.step)
            except StorageError as e:
                log.warning("rank %d: could not retire step %d of %s: %s", ctx.rank, d.step, backend.display_url, e)
        committed = [d.step for d in dirs if d.committed]
        if committed and step > 0:
            log.warning(
                "ftkit: restored step %d, so newer step(s) %s of %s are %s: this run continues from step %d",
                step,
                committed,
                backend.display_url,
                backend.superseded_verb,
                step,
            )
    if ctx.distributed:
        ctx.barrier(key)  # nobody writes before every node's newer steps are gone
    if out:
        rc.emit("retire", step=step, retired=out)
    return out

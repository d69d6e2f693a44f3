"""The restore planner: which candidates to try, in order, and which files move between
nodes; pure functions over what the ranks and tiers reported (tests/unit/test_planners.py).

Order of calls (restore/__init__.py)::

    ram = ram_candidates(inventories, nodes, ram_tier, can_fetch)   # rank 0
    candidates = order_candidates(step, ram, listings)              # rank 0, broadcast
    per candidate: missing = sorted(files_for(manifest, regions) - present)   # every rank
                   transfers = fetch_plan(requests, candidate.holders, nodes)  # every rank alike
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ftkit.commit.messages import Held, Inventory
from ftkit.errors import FormatError, one_line
from ftkit.format.index import is_part_file
from ftkit.format.manifest import Manifest
from ftkit.format.tiling import overlap
from ftkit.format.validate import MAX_STEP, MAX_WORLD, _int, check_file_name
from ftkit.tiers.peers import Transfer


@dataclass(frozen=True)
class Candidate:
    """One (step, source) to try. For the RAM tier: which ranks hold each data file, which rank
    sends its manifest to the nodes that lack it (None: all have it), and which rank sends
    each manifest part to the nodes that lack it."""

    step: int
    tier: int
    holders: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    manifest_rank: int | None = None
    part_holders: Mapping[str, int] = field(default_factory=dict)

    def to_json(self, holders: bool = True) -> dict[str, Any]:
        return {
            "step": self.step,
            "tier": self.tier,
            "holders": {f: list(r) for f, r in self.holders.items()} if holders else {},
            "manifest_rank": self.manifest_rank,
            "part_holders": dict(self.part_holders),  # O(nodes): one per part
        }

    @staticmethod
    def from_json(doc: Any) -> Candidate:
        """A candidate as rank 0 broadcast it (FormatError when malformed)."""
        rank = lambda r: _int(r, "rank", 0, MAX_WORLD)
        try:
            return Candidate(
                _int(doc["step"], "step", 0, MAX_STEP),
                _int(doc["tier"], "tier", 0, 1 << 16),
                {check_file_name(f): tuple(rank(r) for r in rs) for f, rs in doc["holders"].items()},
                None if doc["manifest_rank"] is None else rank(doc["manifest_rank"]),
                {check_file_name(f): rank(r) for f, r in doc["part_holders"].items()},
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise FormatError(f"a malformed restore candidate from rank 0 ({one_line(e, 80)})") from None


def ram_candidates(
    inventories: Sequence[Inventory | None], nodes: Sequence[str], ram_tier: int, can_fetch: bool
) -> dict[int, Candidate]:
    """RAM-tier steps whose every file is on some node (with `can_fetch`), or on every node.
    `inventories[r]`: rank r's view of its node (None: nothing usable came); a step no file
    list came with is tried unchecked, and its read proves it."""
    by_step: dict[int, list[tuple[int, Held]]] = {}  # step -> (rank, what its node holds of it), by rank
    for rank, inv in enumerate(inventories):
        for held in ({h.step: h for h in inv.steps} if inv is not None else {}).values():
            by_step.setdefault(held.step, []).append((rank, held))
    out = {}
    for s, helds in by_step.items():
        holders: dict[str, list[int]] = {}  # file -> the ranks whose node holds it
        on_node: dict[str, set[str]] = {}
        for rank, held in helds:
            for f in held.have:
                holders.setdefault(f, []).append(rank)
            on_node.setdefault(nodes[rank], set()).update(held.have)
        # The first rank with the whole manifest, else with only its index; the lists one inventory sent.
        index_rank = next((r for r, h in helds if h.index is not None), None)
        manifest_rank = next((r for r, h in helds if h.whole), index_rank)
        need = next((set(h.need) for _, h in helds if h.need is not None), set())
        parts = next((h.parts for _, h in helds if h.parts is not None), ())
        if manifest_rank is None or not set(parts) <= set(holders):  # (or a part of its manifest is on no node)
            continue
        if can_fetch:
            complete = need <= set(holders)
        else:  # no transport between nodes: every node must hold everything
            complete = all(need <= on_node.get(n, set()) for n in set(nodes))
        # A node lacks the manifest when it listed the step without it, or did not list the step.
        lacking = len(helds) < len(inventories) or not all(h.whole for _, h in helds)
        if complete:  # the manifest goes through the store only when a node lacks it
            part_holders = {f: rs[0] for f, rs in holders.items() if is_part_file(f)} if lacking else {}
            out[s] = Candidate(
                s,
                ram_tier,
                {f: tuple(r) for f, r in holders.items() if not is_part_file(f)},
                manifest_rank if lacking else None,
                part_holders,
            )
    return out


def order_candidates(
    step: int | None, ram: Mapping[int, Candidate], listings: Sequence[tuple[int, Sequence[int]]]
) -> list[Candidate]:
    """Every (step, source) to try: newest step first (only `step` when one is asked for); for
    a step, the RAM tier first, then the shared tiers in `listings`' order (fastest first)."""
    options: dict[int, list[Candidate]] = {}
    for s, cand in ram.items():
        options.setdefault(s, []).append(cand)
    for tier, steps in listings:
        for s in steps:
            options.setdefault(s, []).append(Candidate(s, tier))
    wanted = [step] if step is not None else sorted(options, reverse=True)
    return [c for s in wanted for c in options.get(s, [])]


def files_for(manifest: Manifest, regions: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> set[str]:
    """The data files holding any byte of the `regions` (name -> (offsets, lengths)) this rank needs."""
    files: set[str] = set()
    for t in manifest.tensors:
        if t.name not in regions:
            continue
        offs, lens = regions[t.name]
        for s in t.shards:
            if overlap(offs, lens, s.offsets, s.lengths) is not None or not lens:
                files.update(c.file for c in s.chunks)
    return files


def fetch_plan(
    requests: Sequence[Mapping[str, Any]], holders: Mapping[str, Sequence[int]], nodes: Sequence[str]
) -> list[Transfer]:
    """One transfer per (node, file) that node lacks (`requests[r]["missing"]`), receiving spread
    over the node's ranks that need it, sending over the holders on other nodes."""
    wanted: dict[tuple[str, str], list[int]] = {}
    for rank, req in enumerate(requests):
        for f in req.get("missing") or []:
            wanted.setdefault((nodes[rank], f), []).append(rank)
    plan: list[Transfer] = []
    received_by: dict[int, int] = {}
    for (node, f), ranks in wanted.items():
        sources = [h for h in holders.get(f, []) if nodes[h] != node]
        if not sources:
            continue
        dst = min(ranks, key=lambda r: (received_by.get(r, 0), r))  # the least loaded so far
        received_by[dst] = received_by.get(dst, 0) + 1
        plan.append(Transfer(sources[len(plan) % len(sources)], dst, f))
    return plan

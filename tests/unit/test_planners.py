"""The pure planners, without processes or storage: restore candidates and fetch plans
(for 4, 64 and 1,024 ranks), the save plan, replica placement, retention, overlaps."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ftkit.commit.messages import Held, Inventory
from ftkit.errors import FormatError
from ftkit.format.manifest import Chunk, Manifest, Shard, TensorEntry
from ftkit.restore.plan import Candidate, fetch_plan, files_for, order_candidates, ram_candidates
from ftkit.save.layout import Layout
from ftkit.save.sharding import (
    RANK_LOCAL,
    REPLICATED,
    SPLIT_BYTES,
    byte_span,
    overlap,
    plan_pieces,
    planned,
    whole_owners,
)
from ftkit.tiers.peers import replica_targets, replication_plan
from ftkit.tiers.retention import RetentionPlan, StepInfo, plan_collection, plan_retention


def _nodes(world: int, per_node: int) -> list[str]:
    return [f"node{r // per_node}" for r in range(world)]


def _files(world: int) -> list[str]:
    return [f"rank-{r:05d}-00000000.data" for r in range(world)]


def _inventories(
    world: int, per_node: int, steps: dict[int, set[str]], replicas: int = 1, lost: set[str] = frozenset()
) -> list[Inventory]:
    """What each rank reports: its node holds its ranks' files of every step, plus the
    replicas it received (placement as peers.replica_targets), and the manifest; a
    lost node holds nothing."""
    nodes = _nodes(world, per_node)
    files = _files(world)
    held: dict[str, set[str]] = {n: set() for n in nodes}
    for r in range(world):
        held[nodes[r]].add(files[r])
        for t in replica_targets(r, nodes, replicas):
            held[nodes[t]].add(files[r])
    out = []
    for r in range(world):
        node = nodes[r]
        inv = []
        if node not in lost:
            for s, need in steps.items():
                inv.append(Held(s, tuple(sorted(held[node] & need)), tuple(sorted(need))))
        out.append(Inventory(tuple(inv)))
    return out


def _with(inv: Inventory, step: int, **change) -> Inventory:
    """`inv` with the entry of `step` changed (dataclasses.replace of each field in `change`)."""
    return Inventory(tuple(replace(h, **change) if h.step == step else h for h in inv.steps))


def _held(inv: Inventory, step: int) -> Held:
    return next(h for h in inv.steps if h.step == step)


@pytest.mark.parametrize("world, per_node", [(4, 2), (64, 8), (1024, 8)])
def test_every_step_complete_somewhere_is_a_ram_candidate(world, per_node):
    nodes = _nodes(world, per_node)
    need = set(_files(world))
    inv = _inventories(world, per_node, {10: need, 11: need})
    got = ram_candidates(inv, nodes, ram_tier=0, can_fetch=True)
    assert sorted(got) == [10, 11]
    c = got[11]
    assert c.tier == 0 and c.manifest_rank is None  # every node has the manifest: nothing goes through the store
    assert set(c.holders) == need
    for f in need:  # each file is held by the ranks of its own node and of its replica's node
        assert len({nodes[r] for r in c.holders[f]}) == 2


@pytest.mark.parametrize("world, per_node", [(4, 2), (64, 8), (1024, 8)])
def test_a_lost_node_is_restored_from_replicas_only_with_peers(world, per_node):
    nodes = _nodes(world, per_node)
    need = set(_files(world))
    inv = _inventories(world, per_node, {7: need}, lost={"node1"})
    with_peers = ram_candidates(inv, nodes, 0, can_fetch=True)
    assert list(with_peers) == [7]
    assert with_peers[7].manifest_rank is not None and nodes[with_peers[7].manifest_rank] != "node1"
    assert ram_candidates(inv, nodes, 0, can_fetch=False) == {}  # no transport: node1 cannot get its files


def test_a_step_missing_a_file_everywhere_is_no_candidate():
    world, per_node = 64, 8
    need = set(_files(world))
    inv = _inventories(world, per_node, {5: need}, replicas=0)
    victim = _files(world)[9]
    inv = [_with(i, 5, have=tuple(f for f in _held(i, 5).have if f != victim)) for i in inv]
    assert ram_candidates(inv, _nodes(world, per_node), 0, can_fetch=True) == {}


@pytest.mark.parametrize("world, per_node", [(4, 2), (1024, 8)])
def test_nodes_lacking_manifest_parts_are_sent_each_part_by_one_holder(world, per_node):
    # As the RAM tier commits: each node holds the part of its own ranks and of the node
    # before it (whose replicas it holds), and the index; with more than two nodes no node
    # holds every part, so every part goes through the store from one of its holders.
    nodes = _nodes(world, per_node)
    count = world // per_node
    parts = [f"part-{n * per_node:05d}-0000000{n % 10}.json" for n in range(count)]
    inv = _inventories(world, per_node, {4: set(_files(world))})
    for r, i in enumerate(inv):
        n = r // per_node
        held = {parts[n], parts[(n - 1) % count]}
        whole = len(held) == count  # two nodes: each holds both parts and reads the step alone
        inv[r] = _with(
            i,
            4,
            have=_held(i, 4).have + tuple(sorted(held)),
            need=_held(i, 4).need if whole and r == 0 else None,
            digest="xxh3_64:fedcba9876543210" if whole else None,
            index=None if whole else "xxh3_64:0123456789abcdef",
            parts=None if whole or r else tuple(parts),  # only rank 0 sends the index's list
        )
    c = ram_candidates(inv, nodes, 0, can_fetch=True)[4]
    if count == 2:
        assert c.manifest_rank is None and c.part_holders == {}  # nothing through the store
        return
    assert c.manifest_rank == 0 and sorted(c.part_holders) == parts
    for name, rank in c.part_holders.items():  # a rank of the part's own node or of the one after it
        assert parts.index(name) in (rank // per_node, (rank // per_node - 1) % count)
    assert not any(f.startswith("part-") for f in c.holders)  # data files only: no part is fetched as data
    assert Candidate.from_json(c.to_json(holders=False)).part_holders == c.part_holders
    # Both nodes that held node 1's part lost it: the step cannot be read from RAM.
    inv = [_with(i, 4, have=tuple(f for f in _held(i, 4).have if f != parts[1])) for i in inv]
    assert ram_candidates(inv, nodes, 0, can_fetch=True) == {}


def test_inventories_cross_the_store_as_typed_messages_and_forged_ones_are_refused_whole():
    """A node's inventory goes to rank 0 as a typed message (commit/messages.py Inventory):
    what decodes is what was sent; a forged one (a name leaving its step directory, a part
    that is no part, a malformed checksum, bytes cut short) is refused whole, and rank 0
    plans without that node, as if it held nothing."""
    world, per_node = 4, 2
    nodes = _nodes(world, per_node)
    need = set(_files(world))
    inv = _inventories(world, per_node, {3: need})
    sent = [Inventory.decode(i.encode(), f"rank {r}") for r, i in enumerate(inv)]
    assert sent == inv
    assert Inventory.decode(inv[1].without_lists().encode(), "x") == _with(inv[1], 3, need=None)
    for forged in (
        _with(inv[1], 3, have=("../../etc/passwd",)),
        _with(inv[1], 3, parts=("rank-00000-00000000.data",)),
        _with(inv[1], 3, parts=("part-/../x.json",)),
        _with(inv[1], 3, digest="d"),
    ):
        with pytest.raises(FormatError):
            Inventory.decode(forged.encode(), "a forged inventory")
    for cut in (inv[1].encode()[:-3], inv[1].encode() + b"x", b"{}"):
        with pytest.raises(FormatError):
            Inventory.decode(cut, "a cut inventory")
    got = ram_candidates([inv[0], None, inv[2], None], nodes, 0, can_fetch=True)
    assert list(got) == [3] and got[3].manifest_rank == 0  # ranks 1 and 3 said nothing usable


def test_candidates_are_newest_first_ram_first_then_fastest_tier():
    ram = {9: Candidate(9, 0), 7: Candidate(7, 0)}
    listings = [(1, [5, 7, 8]), (2, [6, 8])]  # tier 1 (local) before tier 2 (remote)
    got = [(c.step, c.tier) for c in order_candidates(None, ram, listings)]
    assert got == [(9, 0), (8, 1), (8, 2), (7, 0), (7, 1), (6, 2), (5, 1)]
    assert [(c.step, c.tier) for c in order_candidates(7, ram, listings)] == [(7, 0), (7, 1)]
    assert order_candidates(4, ram, listings) == []
    c = Candidate(3, 0, {"f": (1, 2)}, 2)
    assert Candidate.from_json(c.to_json()) == c


@pytest.mark.parametrize("world, per_node", [(4, 2), (64, 8), (1024, 8)])
def test_a_lost_nodes_files_are_fetched_once_each_and_spread_over_its_ranks(world, per_node):
    nodes = _nodes(world, per_node)
    files = _files(world)
    inv = _inventories(world, per_node, {1: set(files)}, lost={"node1"})
    cand = ram_candidates(inv, nodes, 0, can_fetch=True)[1]
    lost_ranks = [r for r in range(world) if nodes[r] == "node1"]
    # every rank of node1 needs every file (a replicated state), and holds none
    requests = [{"missing": sorted(files) if r in lost_ranks else []} for r in range(world)]
    plan = fetch_plan(requests, cand.holders, nodes)
    assert sorted(t.file for t in plan) == sorted(files)  # once per file for the node
    assert all(nodes[t.src] != "node1" and nodes[t.dst] == "node1" for t in plan)
    per_dst = [sum(t.dst == r for t in plan) for r in lost_ranks]
    assert max(per_dst) - min(per_dst) <= 1  # receiving spread evenly
    assert all(t.src in cand.holders[t.file] for t in plan)
    assert fetch_plan(requests, cand.holders, nodes) == plan  # every rank computes the same plan


def test_files_for_reads_only_the_overlapping_shards():
    def chunk(f):
        return (Chunk(f, 0, 16, 0, 16, "raw", "xxh3_64:" + "0" * 16),)

    t = TensorEntry("w", "float32", (8,), (Shard((0,), (4,), chunk("a.data")), Shard((4,), (4,), chunk("b.data"))))
    m = Manifest(1, 2, (t,), {"entries": {}}, {"a.data": {"bytes": 16}, "b.data": {"bytes": 16}})
    assert files_for(m, {"w": ((0,), (8,))}) == {"a.data", "b.data"}
    assert files_for(m, {"w": ((5,), (2,))}) == {"b.data"}
    assert files_for(m, {}) == set()


# ------------------------------------------------------------------ saving
def test_plan_pieces_saves_replicated_state_once_split_and_balanced():
    big = torch.zeros(1024, 512)  # 2 MiB: split into row blocks
    small = [torch.zeros(100) for _ in range(6)]
    named = [("big", big)] + [(f"s{i}", t) for i, t in enumerate(small)] + [("_rng/r0/torch", torch.zeros(10))]
    world = 4
    plans = [plan_pieces(named, r, world) for r in range(world)]
    rows = sorted((p.offsets[0], p.lengths[0]) for pl in plans for p, _ in pl if p.name == "big")
    assert rows == [(0, 256), (256, 256), (512, 256), (768, 256)]  # tiles the tensor once
    owners = {p.name: r for r, pl in enumerate(plans) for p, _ in pl if p.name.startswith("s")}
    assert sorted(owners) == [f"s{i}" for i in range(6)] and len(set(owners.values())) >= 2  # spread
    rng = [(r, p) for r, pl in enumerate(plans) for p, _ in pl if p.name.startswith("_rng")]
    assert all(p.kind == RANK_LOCAL for _, p in rng) and len(rng) == world  # every rank its own
    for pl in plans:
        for p, src in pl:
            assert tuple(src.shape) == p.lengths and (p.kind in (REPLICATED, RANK_LOCAL))


def test_whole_tensors_go_to_the_least_loaded_rank_lowest_first_in_one_pass():
    """The heap (whole_owners) picks as the plain rule does: each whole replicated tensor to
    the rank with the fewest bytes so far, the lowest on a tie; split tensors load all alike."""
    import random

    rng = random.Random(3)
    for world in (1, 2, 3, 8, 37):
        named = []
        for i in range(60):
            rows = rng.choice([1, 7, 64, 300, 2048])
            named.append((f"t{i}", torch.zeros(rows, rng.choice([1, 16, 512]))))
        load, expected = [0] * world, {}
        for name, t in named:  # the rule, O(tensors x world)
            nbytes = t.numel() * t.element_size()
            if world > 1 and nbytes >= SPLIT_BYTES and t.shape[0] >= world:
                load = [x + nbytes // world for x in load]
                continue
            owner = min(range(world), key=lambda r: (load[r], r))
            load[owner] += nbytes
            expected[name] = owner
        assert whole_owners(named, world) == expected
        got = {p.name: r for r in range(world) for p, _ in plan_pieces(named, r, world) if p.lengths == p.global_shape}
        assert {n: r for n, r in got.items() if n in expected} == expected


def test_plan_pieces_on_one_rank_saves_everything_whole():
    named = [("a", torch.zeros(3000, 100)), ("b", torch.zeros(5))]
    got = plan_pieces(named, 0, 1)
    assert [(p.name, p.lengths) for p, _ in got] == [("a", (3000, 100)), ("b", (5,))]


def test_the_staging_layout_comes_with_the_plan_and_changes_when_a_shape_does():
    named = [("big", torch.zeros(1024, 512)), ("s", torch.zeros(100, dtype=torch.float16))]
    plans: dict = {}  # a Checkpointer's
    pieces, layout = planned(named, 1, 4, plans=plans)  # rank 1: its row block of "big", maybe "s"
    assert layout == Layout.of([(p.name, src) for p, src in pieces])  # where the sliced sources go
    again, same = planned([(n, t.clone()) for n, t in named], 1, 4, plans=plans)  # new tensors, same shapes
    assert same is layout and [p for p, _ in again] == [p for p, _ in pieces]
    grown, other = planned([("big", torch.zeros(2048, 512)), named[1]], 1, 4, plans=plans)
    assert other == Layout.of([(p.name, src) for p, src in grown]) and other.total_bytes > layout.total_bytes
    half = planned(named, 0, 1)[1]
    single = planned([named[0], ("s", torch.zeros(100, dtype=torch.float32))], 0, 1)[1]
    assert (
        [e.dtype for e in single.entries if e.name == "s"]
        == [torch.float32]
        != [e.dtype for e in half.entries if e.name == "s"]
    )


@pytest.mark.parametrize("nodes, k", [(_nodes(4, 2), 1), (_nodes(64, 8), 2), (_nodes(1024, 8), 1), (["a"] * 3, 1)])
def test_replicas_go_to_other_nodes_and_never_all_on_one(nodes, k):
    node_count = len(set(nodes))
    for r in range(0, len(nodes), max(1, len(nodes) // 16)):
        targets = replica_targets(r, nodes, k)
        assert len(targets) == min(k, node_count - 1)
        assert all(nodes[t] != nodes[r] for t in targets)
        assert len({nodes[t] for t in targets}) == len(targets)  # distinct nodes
    files = _files(len(nodes))
    plan = replication_plan(files, nodes, k)
    assert len(plan) == len(nodes) * min(k, node_count - 1)
    assert replication_plan(files, nodes, k) == plan  # the same order on every rank


# ------------------------------------------------------------------ retention
def test_plan_retention_keeps_the_newest_every_mth_and_the_protected():
    p = plan_retention([1, 2, 3, 4, 5, 6], keep=2, keep_every=3, protect=1)
    assert p.keep == (1, 3, 5, 6) and p.delete == (2, 4)
    assert plan_retention([1, 2], keep=None).delete == ()
    with pytest.raises(ValueError):
        plan_retention([1], keep=0)


def test_plan_collection_never_deletes_past_the_newest_verified_step():
    steps = [
        StepInfo(1, "committed", None),
        StepInfo(2, "committed", True),
        StepInfo(3, "committed", False),
        StepInfo(4, "partial", None, age_s=10.0),
        StepInfo(0, "partial", None, age_s=7200.0),
        StepInfo(9, "link"),
        StepInfo(5, "retired", None, age_s=7200.0),
    ]
    p = plan_collection(steps, keep=1, keep_every=None, grace_s=3600)
    assert p.protected == 2 and p.delete == (1,) and p.keep == (2, 3)
    assert p.remove_partial == (0, 5) and p.held == () and p.refused == (9,)
    none_ok = plan_collection([StepInfo(1, "committed", False), StepInfo(2, "committed", False)], 1, None, 0)
    assert none_ok.delete == () and none_ok.protected is None


def test_a_step_that_failed_verification_is_kept_but_counts_toward_no_keep():
    """`ftkit gc --keep 2` over good steps 1-3 and torn 4-5: the two newest good steps stay
    (before, the torn ones filled `keep` and only step 3 was left to restore)."""
    steps = [StepInfo(s, "committed", None) for s in (1, 2)]
    steps += [StepInfo(3, "committed", True), StepInfo(4, "committed", False), StepInfo(5, "committed", False)]
    p = plan_collection(steps, keep=2, keep_every=None, grace_s=0)
    assert p.protected == 3 and p.delete == (1,) and p.keep == (2, 3, 4, 5)
    assert plan_retention([1, 2, 3, 4], keep=1, failed=[4]) == RetentionPlan((3, 4), (1, 2))
    # A running job's (its restore found step 2 bad): it goes once `keep` good steps are newer.
    assert plan_retention([1, 2, 3], keep=2, failed=[2]) == RetentionPlan((1, 2, 3), ())
    assert plan_retention([1, 2, 3, 4], keep=2, failed=[2]) == RetentionPlan((3, 4), (1, 2))
    assert plan_retention([1, 2], keep=2, failed=[1]) == RetentionPlan((1, 2), ())


# ------------------------------------------------------------------ overlaps
def test_overlap_and_byte_span():
    assert overlap((0, 0), (4, 4), (2, 2), (4, 4)) == ((2, 2), (2, 2))
    assert overlap((0,), (4,), (4,), (4,)) is None
    # rows 1-2 of a 4x3 shard of 4-byte items: bytes 12..36
    assert byte_span((1, 0), (2, 3), (0, 0), (4, 3), 4) == (12, 36)
    assert byte_span((), (), (), (), 8) == (0, 8)

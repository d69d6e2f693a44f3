"""The commit plan (ftkit/commit/plan.py) checked without processes, like DCP's planner
tests: every rank is covered once, every message sent is awaited exactly once by the rank
it is sent to, nobody waits on itself, the plan runs to its end, replicas land on other
nodes, and the roles are what the executors have relied on."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from ftkit.commit.plan import RAM, SHARED, Act, CommitPlan, Msg, Step, Stuck, Via


def worlds():
    """Node layouts: one rank, one node, even and uneven nodes, nodes of one rank, interleaved ranks."""
    yield ["a"]
    yield ["a", "a", "a"]
    for nodes, per in itertools.product((2, 3, 5), (1, 2, 3)):
        yield [f"n{i}" for i in range(nodes) for _ in range(per)]
    yield ["a", "a", "b", "c", "c", "c"]
    yield ["a", "b", "a", "b"]  # ranks of a node need not be contiguous
    yield ["a", "b", "b", "b"]  # rank 0 alone on its node


def plans():
    for nodes in worlds():
        yield CommitPlan.of(nodes, SHARED)
        for k in (0, 1, 2, 3):
            yield CommitPlan.of(nodes, RAM, k)


PLANS = list(plans())


def ids(plan: CommitPlan) -> str:
    return f"{plan.tier}-{'.'.join(plan.nodes)}-k{plan.replicas}"


@pytest.mark.parametrize("plan", PLANS, ids=ids)
def test_every_message_sent_is_awaited_exactly_once_by_its_receiver(plan):
    sends: Counter = Counter()
    awaits: Counter = Counter()
    for r in range(plan.world):
        for s in plan.steps(r):
            assert r not in s.peers, f"rank {r} {s}: nobody sends to or waits on itself"
            assert len(set(s.peers)) == len(s.peers)
            if s.act is Act.SEND:
                sends.update((r, s.msg, p, s.via) for p in s.peers)
            elif s.act is Act.AWAIT:
                awaits.update((p, s.msg, r, s.via) for p in s.peers)
    assert sends == awaits
    assert all(n == 1 for n in sends.values())


@pytest.mark.parametrize("plan", PLANS, ids=ids)
def test_every_rank_writes_once_each_node_has_one_part_and_rank_0_alone_commits(plan):
    writes, parts, commits = Counter(), Counter(), []
    for r in range(plan.world):
        acts = [s.act for s in plan.steps(r)]
        writes[r] = acts.count(Act.WRITE)
        assert acts[0] is Act.WRITE  # its data is durable before it says anything
        if Act.PART in acts:
            parts[plan.nodes[r]] += 1
        if Act.COMMIT in acts:
            commits.append(r)
            assert acts[-1] is Act.COMMIT or plan.steps(r)[-1].msg is Msg.INDEX  # the index is the last write
    assert set(writes.values()) == {1} and len(writes) == plan.world
    assert parts == Counter(plan.order)
    assert commits == [0]


@pytest.mark.parametrize("plan", PLANS, ids=ids)
def test_the_plan_runs_to_its_end(plan):
    messages = plan.sequence()
    # Rank 0 commits after every node's record came in.
    records = [i for i, (_, m, dst, _) in enumerate(messages) if m is Msg.RECORD and dst == 0]
    index = [i for i, (src, m, _, _) in enumerate(messages) if m is Msg.INDEX]
    assert all(i < j for i in records for j in index)
    assert len(records) == len(plan.record_senders) == len(plan.order) - (plan.roles(plan.nodes[0]).collector == 0)


def test_a_plan_that_cannot_finish_says_who_waits():
    plan = CommitPlan.of(["a", "b"], SHARED)

    class Broken(CommitPlan):
        def steps(self, rank):
            return (Step(Act.AWAIT, Msg.RECORD, (1 - rank,), Via.STORE),)

    with pytest.raises(Stuck, match="waiting"):
        Broken(plan.nodes).sequence()


@pytest.mark.parametrize("plan", [p for p in PLANS if p.replicas], ids=ids)
def test_replicas_go_to_other_nodes_one_per_node_and_every_transfer_is_agreed(plan):
    copies = min(plan.replicas, len(plan.order) - 1) if plan.distributed else 0
    for r in range(plan.world):
        targets = plan.replica_targets(r)
        nodes = [plan.nodes[t] for t in targets]
        assert plan.nodes[r] not in nodes and len(set(nodes)) == len(nodes) == copies
        # Both ends list a transfer, in the same relative order (peers.py posts them in it).
        for t in targets:
            assert (r, t) in plan.transfers(r) and (r, t) in plan.transfers(t)
    for a, b in itertools.combinations(range(plan.world), 2):
        shared = [t for t in plan.transfers(a) if b in t]
        assert shared == [t for t in plan.transfers(b) if a in t]


@pytest.mark.parametrize("plan", [p for p in PLANS if p.exchanges], ids=ids)
def test_the_index_lives_where_rank_0s_data_lives(plan):
    holders = {plan.nodes[0], *(plan.nodes[t] for t in plan.replica_targets(0))}
    assert {n for n in plan.order if plan.holds_index(n)} == holders
    copiers = plan.index_copiers()
    assert sorted(plan.nodes[c] for c in copiers) == sorted(holders - {plan.nodes[0]})
    for c in copiers:
        assert [s.act for s in plan.steps(c)][-1] is Act.INDEX_COPY


@pytest.mark.parametrize("nodes", list(worlds()), ids=lambda n: ".".join(n))
def test_roles_spread_over_rank_0s_node_on_the_ram_tier_only(nodes):
    ram, shared = CommitPlan.of(nodes, RAM, 1), CommitPlan.of(nodes, SHARED)
    for node in ram.order:
        ranks = ram.roles(node).ranks
        assert shared.roles(node).collector == ranks[0]
        several = node == nodes[0] and len(ranks) > 1 and len(ram.order) > 1
        assert ram.roles(node).collector == (ranks[1] if several else ranks[0])
        exchanger = ram.roles(node).exchanger
        assert exchanger in ranks and (exchanger not in (0, ram.roles(node).collector) or len(ranks) <= 2)


def test_a_rank_of_a_large_world_computes_only_its_own_steps():
    nodes = [f"n{i // 8}" for i in range(16384)]
    plan = CommitPlan.of(nodes, RAM, 2)
    steps = plan.steps(12345)
    assert [s.act for s in steps][0] is Act.WRITE
    assert plan.replica_targets(12345) == [12353, 12361]
    assert len(plan._roles) <= 8  # (its node and its partners', not 2,048 nodes)


def test_describe_and_mermaid_name_every_rank_and_message():
    plan = CommitPlan.of(["a", "a", "b", "b"], RAM, 1)
    text = plan.describe()
    assert "rank 0 (node a: leader, committer, ...)" not in text
    assert "rank 1 (node a: collector, exchanger)" in text
    assert "rank 3 (node b: exchanger, index holder)" in text
    diagram = plan.mermaid()
    assert diagram.count("->>") == len(plan.sequence())
    assert "r1->>r0: record (store)" in diagram and "r0->>r3: index (store)" in diagram


@pytest.mark.parametrize("plan", PLANS, ids=ids)
def test_the_executor_of_the_tier_has_a_handler_for_every_step(plan):
    from ftkit.commit.ram import RamCommit
    from ftkit.commit.shared import SharedCommit

    handlers = RamCommit.HANDLERS if plan.tier == RAM else SharedCommit.HANDLERS
    for r in range(plan.world):
        assert all((s.act, s.msg) in handlers for s in plan.steps(r)), r


def test_docs_protocol_md_is_generated_from_the_plan():
    from pathlib import Path

    from ftkit.tools.protocol import protocol_markdown

    doc = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
    assert doc.read_text() == protocol_markdown(), "regenerate it: ftkit commit-plan --markdown > docs/protocol.md"


def test_the_commit_plan_command_prints_a_world_as_json(capsys):
    import json

    from ftkit.tools.cli import main

    assert main(["commit-plan", "--nodes", "3", "--ranks-per-node", "2", "--replicas", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in doc["ranks"]] == list(range(6))
    assert doc["ranks"][0]["roles"] == ["leader", "committer"] and doc["ranks"][0]["steps"][-2] == "commit"
    assert main(["commit-plan", "--nodes", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err


def test_the_commit_plan_command_keeps_no_more_replicas_than_other_nodes(capsys):
    import json

    from ftkit.tools.cli import main

    assert main(["commit-plan", "--nodes", "1", "--replicas", "3"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == "commit plan: ram tier, 2 ranks on 1 nodes"  # no replica(s)
    assert "relay" not in out and "replicate" not in out, out
    assert err.strip() == "ftkit commit-plan: 1 node(s) hold 0 replica(s), not 3"
    assert main(["commit-plan", "--nodes", "2", "--replicas", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["replicas"] == 1


@pytest.mark.parametrize("nodes", [["a"], ["a", "a"], ["a", "a", "a"]], ids=lambda n: ".".join(n))
def test_a_world_of_one_node_runs_no_replica_steps_whatever_replicas_asks(nodes):
    plain = CommitPlan.of(nodes, RAM, 0)
    for k in (1, 2):
        plan = CommitPlan.of(nodes, RAM, k)
        assert not plan.exchanges
        assert [plan.steps(r) for r in range(plan.world)] == [plain.steps(r) for r in range(plain.world)]

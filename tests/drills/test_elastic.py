"""Elastic recovery: a node is lost and torchrun's elastic agent brings the job back
on the nodes left, with fewer ranks, from node RAM, resharded; nothing lost.

Two torchrun agents on this machine, one per simulated node (FTKIT_NODE_ID), meet
through c10d rendezvous with --nnodes=1:2. Killing node b (its agent, its workers
and its RAM directory) makes node a's workers fail; its agent re-rendezvouses
alone and restarts them as a 2-rank job, which restores the newest step from
node a's RAM: its own shares plus its replicas of node b's.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch
from conftest import REPO, warm_target

STEPS = 100


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(tmp_path, zygote, node: str, is_host: bool, port: int) -> subprocess.Popen:
    env = {
        **os.environ,
        "FTKIT_RAM_DIR": str(tmp_path / "shm"),
        "FTKIT_JOB_ID": "job",
        "FTKIT_NODE_ID": node,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "tests", "support"), os.environ.get("PYTHONPATH", "")]),
        **zygote.env(),
    }
    # Short rendezvous timeouts: a dead agent is dropped after ~5 s of missed keep-alives (with 2
    # attempts a live but busy agent was dropped too; see the README), and a round closes 3 s
    # after its first member arrived (both agents start within that at launch).
    conf = (
        f"is_host={int(is_host)},last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=5,"
        "join_timeout=120,close_timeout=10"
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=elastic",
        f"--rdzv-conf={conf}",
        "--max-restarts=2",
        "--monitor-interval=0.1",
        *warm_target(
            zygote,
            [
                os.path.join(REPO, "tests", "support", "elastic_job.py"),
                "--ckpt",
                str(tmp_path / "ckpt"),
                "--steps",
                str(STEPS),
                "--run-dir",
                str(tmp_path / "run"),
                "--step-time",
                "0.05",
                "--final-out",
                str(tmp_path / "final.pt"),
            ],
        ),
    ]
    log = open(tmp_path / f"agent-{node}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)


def _events(tmp_path) -> list[dict]:
    out = []
    for f in sorted((tmp_path / "run" / "events").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by the kill
                pass
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)


def _replay(lineage: list[tuple[int, list[list[int]]]]) -> dict[str, torch.Tensor]:
    """The job's training, in this process: each step averages its ranks' gradients."""
    torch.manual_seed(0)
    data = torch.randn(64, 16)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for _, batches in lineage:
        grads = []
        for b in batches:
            model.zero_grad()
            model(data[b]).square().mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) / len(grads)
        opt.step()
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lost_node_shrinks_the_job_and_it_goes_on_from_ram_with_nothing_lost(tmp_path, zygote):
    port = _free_port()
    a = _agent(tmp_path, zygote, "a", True, port)  # hosts the rendezvous store: it must outlive node b
    b = _agent(tmp_path, zygote, "b", False, port)
    try:
        deadline = time.monotonic() + 120
        while not any(
            e["event"] == "persist" and e.get("tier") == "ram" and e["step"] >= 20 and e["rank"] == 0
            for e in _events(tmp_path)
        ):
            assert time.monotonic() < deadline and a.poll() is None and b.poll() is None, (
                tmp_path / "agent-a.log"
            ).read_text()[-3000:]
            time.sleep(0.2)
        _kill_tree(b)  # node b is gone: agent, workers and its RAM
        shutil.rmtree(tmp_path / "shm" / "job" / "b")
        assert a.wait(timeout=200) == 0, (tmp_path / "agent-a.log").read_text()[-3000:]
    finally:
        _kill_tree(a)
        _kill_tree(b)
    events = _events(tmp_path)
    last = max(e["attempt"] for e in events)
    assert last >= 1
    starts = {(e["attempt"], e["rank"]): e for e in events if e["event"] == "start"}
    assert {r for (at, r) in starts if at == 0} == {0, 1, 2, 3}
    assert {r for (at, r) in starts if at == last} == {0, 1}
    assert all(starts[(last, r)]["world_size"] == 2 and starts[(last, r)]["node"] == "a" for r in (0, 1))
    restores = [e for e in events if e["event"] == "restore" and e["attempt"] == last]
    assert len(restores) == 2 and len({e["step"] for e in restores}) == 1
    resumed = restores[0]["step"]
    assert resumed >= 20  # a step committed before the loss: from node a's RAM, not the (empty) disk tier
    assert {e["source"] for e in restores} == {"ram"}
    assert {e["saved_world_size"] for e in restores} == {4}  # saved by 4 ranks, resharded to 2

    # The lineage: steps up to the restored one from the 4-rank attempt, the rest from the 2-rank one.
    batches: dict[tuple[int, int], dict[int, list[int]]] = {}
    for e in events:
        if e["event"] == "batch":
            batches.setdefault((e["attempt"], e["step"]), {})[e["rank"]] = e["samples"]
    lineage = []
    for step in range(1, STEPS + 1):
        at = 0 if step <= resumed else last
        ranks = batches[(at, step)]
        assert sorted(ranks) == list(range(4 if at == 0 else 2)), (step, sorted(ranks))
        lineage.append((step, [ranks[r] for r in sorted(ranks)]))
    # The global sample stream, round k of every rank in rank order, is the uninterrupted one.
    stream = [b[k] for _, bs in lineage for k in range(len(bs[0])) for b in bs]
    epochs = [torch.randperm(64, generator=torch.Generator().manual_seed(7 + e)).tolist() for e in range(12)]
    assert stream == [i for e in epochs for i in e][: len(stream)]
    # And the weights are those of that training, momentum and all, across the reshard.
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert final["world_size"] == 2
    for k, v in _replay(lineage).items():
        torch.testing.assert_close(final["model"][k], v, rtol=1e-5, atol=1e-6)

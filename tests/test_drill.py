"""ftkit drill end to end: real torchrun, real faults, bitwise comparison.

Each drill test checks what a user would: the step every fault resumed from,
where the bytes came from, the final weights against a fault-free run. The
fault-free runs are cached for the session (--reference-cache), one per
configuration.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

from ftkit.drill import parse_faults, random_faults

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ref_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("drill-reference"))


def drill(tmp_path, *args: str, env: dict | None = None, cache: str | None = None) -> tuple[int, dict, str]:
    out = tmp_path / "drill.json"
    cmd = ["drill", "--run-dir", str(tmp_path / "d"), "--json", str(out), *args]
    if cache:
        cmd[1:1] = ["--reference-cache", cache]
    r = run_cli(*cmd, env=env, timeout=900)  # in this process unless env is given (the workers inherit it)
    assert out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    return r.returncode, json.loads(out.read_text()), r.stdout + r.stderr


def by_kind(res: dict) -> dict[str, dict]:
    return {f["kind"]: f for f in res["faults"]}


def test_schedule_language_rejects_bad_faults():
    faults = parse_faults("kill@3:rank=1,node@5:node=1:during=replicate,torn@7", 4, 2)
    assert [(f.kind, f.during) for f in faults] == [("kill", "step"), ("node", "replicate"), ("torn-write", "step")]
    for bad, why in [
        ("boom@3", "KIND@STEP"),
        ("kill@3:rank=9", "rank 9 does not exist"),
        ("node@3:node=5", "node 5 does not exist"),
        ("kill@5,hang@3", "increasing"),
        ("kill@3:colour=red", "bad option"),
        ("kill@3:during=lunch", "during=lunch"),
        ("kill@3:rank=2:during=commit", "only rank 0 commits"),
        ("crash@3:during=persist", "training loop"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_faults(bad, 4, 2)
    assert [(f.kind, f.step, f.rank, f.node, f.during) for f in random_faults(7, 40, 4, 2)] == [
        (f.kind, f.step, f.rank, f.node, f.during) for f in random_faults(7, 40, 4, 2)
    ]
    schedules = [[f.kind for f in random_faults(seed, 40, 4, 2, count=3)] for seed in range(50)]
    assert any("term" in kinds for kinds in schedules)
    assert all("term" not in kinds[:-1] for kinds in schedules)  # its agreed stop may outrun a later fault
    r = run_cli("drill", "--faults", "boom@3", in_process=False)
    assert r.returncode == 2 and r.stderr.startswith("ftkit: error: bad fault")
    r = run_cli("drill", "--faults", "s3-outage@5", in_process=False)
    assert r.returncode == 2 and "needs the drill's own S3 server" in r.stderr
    r = run_cli("drill", "--script", "no/such/train.py", in_process=False)
    assert r.returncode == 2 and "no such script" in r.stderr


def test_sample_stream_follows_the_restored_lineage():
    from ftkit.drill.verify import compare_streams, consumed_stream

    def batches(attempt, steps):
        return [
            {"event": "batch", "attempt": attempt, "step": s, "rank": r, "digest": f"d{s}.{r}"}
            for s in steps
            for r in (0, 1)
        ]

    clean = consumed_stream(batches(0, range(1, 7)))
    # attempt 0 trained 1-4, the restart restored step 3: step 4 is redone, once, by attempt 1
    ok = batches(0, range(1, 5)) + [{"event": "restore", "attempt": 1, "step": 3}] + batches(1, range(4, 7))
    errors: list[str] = []
    assert compare_streams(consumed_stream(ok), clean, errors) and not errors
    # a restore that claims step 4 when only 1-3 were trained skips step 4's batches
    skipped = batches(0, range(1, 4)) + [{"event": "restore", "attempt": 1, "step": 4}] + batches(1, range(5, 7))
    assert not compare_streams(consumed_stream(skipped), clean, errors)
    assert "2 batch(es) skipped [(4, 0), (4, 1)]" in errors[0]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_default_drill_passes(tmp_path, ref_cache):
    # The default schedule, tiers and 400 steps, at 0.15 s a step instead of 0.25 s: the faults
    # land on the same steps and are detected the same way (the hang, a SIGSTOP, after 3 s of
    # heartbeat silence either way), in a minute less of CI. scripts/demo.sh runs the true default.
    rc, res, out = drill(tmp_path, "--step-time", "0.15", "--html", str(tmp_path / "d.html"), cache=ref_cache)
    assert rc == 0 and res["passed"], out[-4000:]
    assert res["bitwise_equal"] and res["same_sample_stream"] and res["final_step"] == 400
    f = by_kind(res)
    assert set(f) == {"kill", "hang", "node", "crash"}
    for kind, fault in f.items():  # one step recomputed at most: the RAM tier had the step before
        o = fault["outcome"]
        assert o["reached"] - 1 <= o["resumed_from"] <= o["reached"], (kind, o)
        assert o["resumed_from"] >= fault["injected_step"] - 1, (kind, o)
    assert f["kill"]["outcome"]["restored_from"] == "ram"
    assert f["hang"]["outcome"]["detected_by"] == "ftkit watchdog (dead)"
    # A crash is seen by whoever is first: a peer's watchdog (the failed rank says so) or torchrun.
    assert f["crash"]["outcome"]["detected_by"] in ("ftkit watchdog (failed)", "torchrun agent (process exit)")
    assert "peer" in f["node"]["outcome"]["restored_from"]  # node 1's RAM was wiped: replicas on node 0
    page = (tmp_path / "d.html").read_text()
    assert "goodput" in page and "<svg" in page and page.count("<tr>") == 1 + 4


@pytest.mark.slow
def test_faults_inside_the_persist_pipeline_and_preemption(tmp_path, ref_cache):
    rc, res, out = drill(
        tmp_path,
        "--steps",
        "150",
        "--step-time",
        "0.05",
        "--faults",
        "kill@40:rank=1:during=snapshot,hang@46:rank=3:during=persist,"
        "kill@52:rank=0:during=commit,node@64:node=1:during=replicate,term@70:rank=2,"
        # Last, with no fault to cut it short: a straggler is flagged after ~5 s of
        # slow steps (the median of its last 10 steps, then 6 checks); its 10 s
        # span about 50 steps at this slowdown.
        "slow@85:rank=2:factor=10:seconds=10",
        cache=ref_cache,
    )
    assert rc == 0 and res["passed"], out[-4000:]
    assert res["bitwise_equal"]
    f = {(x["kind"], x["during"]): x for x in res["faults"]}
    assert f["slow", "step"]["outcome"]["straggler_reported"]
    # The durable tier is written every 10 steps: persist and commit faults land on those steps.
    assert f["hang", "persist"]["injected_step"] == 50 and f["kill", "commit"]["injected_step"] == 60
    assert f["hang", "persist"]["outcome"]["detected_by"] == "ftkit watchdog (dead)"
    for key in (("kill", "snapshot"), ("hang", "persist"), ("kill", "commit"), ("node", "replicate")):
        o = f[key]["outcome"]
        assert o["steps_lost"] <= 2 and o["resumed_from"] >= f[key]["injected_step"] - 2, (key, o)
    assert "peer" in f["node", "replicate"]["outcome"]["restored_from"]
    term = f["term", "step"]["outcome"]
    assert term["detected_by"] == "preemption (SIGTERM)" and term["steps_lost"] == 0  # saved where it stopped
    assert term["resumed_from"] > f["term", "step"]["injected_step"]  # the agreed step, after the notice


@pytest.mark.slow
def test_storage_faults_on_the_durable_tier(tmp_path, ref_cache):
    # Windows of a few steps each (a step is ~0.06 s), so a durable persist follows every one.
    rc, res, out = drill(
        tmp_path,
        "--steps",
        "60",
        "--step-time",
        "0.05",
        "--every",
        "5",
        "--faults",
        "enospc@5:seconds=0.6,torn-write@14:seconds=0.3,kill@19:rank=1,bitflip@26:seconds=0.3,"
        "unavailable@34:seconds=0.6,latency@44:factor=0.2:seconds=0.5",
        cache=ref_cache,
    )
    assert rc == 0 and res["passed"], out[-4000:]
    f = by_kind(res)
    assert f["enospc"]["outcome"]["failed_persists"] > 0 and f["unavailable"]["outcome"]["failed_persists"] > 0
    for kind in ("enospc", "torn-write", "bitflip", "unavailable", "latency"):
        o = f[kind]["outcome"]
        assert o["training_continued"] and o["committed_after"] is not None, (kind, o)
    assert f["kill"]["outcome"]["restored_from"] == "ram" and res["bitwise_equal"]


@pytest.mark.slow
def test_a_bitflip_is_caught_by_checksums_and_without_them_by_the_bitwise_comparison(tmp_path, ref_cache):
    # Only a durable tier, written every 5 steps: the bit flipped in step 10's files is what
    # restore finds after the kill at step 13.
    common = [
        "--tiers",
        "disk",
        "--steps",
        "24",
        "--step-time",
        "0.05",
        "--every",
        "5",
        "--max-lost",
        "10",
        "--faults",
        "bitflip@10:seconds=0.3,kill@13:rank=1",
    ]
    rc, res, out = drill(tmp_path / "checked", *common, cache=ref_cache)
    assert rc == 0 and res["passed"] and res["bitwise_equal"], out[-4000:]
    assert by_kind(res)["kill"]["outcome"]["resumed_from"] == 5  # step 10 failed verification: one back
    rc, res, out = drill(tmp_path / "unchecked", *common, env={"FTKIT_UNSAFE_SKIP_CHECKSUMS": "1"}, cache=ref_cache)
    assert rc == 1 and not res["passed"] and not res["bitwise_equal"], out[-4000:]
    assert by_kind(res)["kill"]["outcome"]["resumed_from"] == 10  # the corrupt step was loaded...
    assert any("final state differs from the fault-free run" in e for e in res["errors"])  # ...and caught


@pytest.mark.slow
def test_s3_outage_during_a_persist(tmp_path, ref_cache):
    rc, res, out = drill(
        tmp_path,
        "--tiers",
        "ram,peer,s3",
        "--steps",
        "60",
        "--step-time",
        "0.05",
        "--every",
        "5",
        "--faults",
        "s3-outage@10:seconds=3:during=persist,kill@26:rank=1",
        cache=ref_cache,
    )
    assert rc == 0 and res["passed"], out[-4000:]
    o = by_kind(res)["s3-outage"]["outcome"]
    # The persist in flight either failed or waited the outage out (s3fs retries); either way a
    # later commit landed on the restarted server and training never stopped.
    assert o["failed_persists"] > 0 or o["slowest_persist_s"] >= 1.5, o
    assert o["committed_after"] is not None and o["training_continued"]
    assert res["bitwise_equal"]


@pytest.mark.slow
def test_drill_of_a_user_script(tmp_path):
    ckpt = tmp_path / "ckpt"
    rc, res, out = drill(
        tmp_path,
        "--script",
        str(REPO / "tests" / "drill_script.py"),
        "--steps",
        "40",
        "--faults",
        "kill@6:rank=1,term@12:rank=3,crash@30:rank=2",
        "--",
        "--ckpt",
        str(ckpt),
        "--steps",
        "40",
    )
    assert rc == 0 and res["passed"], out[-4000:]
    assert list(res["checkpoints"].values()) == [40]  # the final step, verified
    f = by_kind(res)
    assert f["kill"]["outcome"]["steps_lost"] <= 1 and f["crash"]["outcome"]["steps_lost"] <= 1
    assert f["term"]["outcome"]["steps_lost"] == 0 and f["kill"]["outcome"]["restored_from"] == "ram"


@pytest.mark.slow
def test_drill_without_peers_reports_the_loss_and_fails(tmp_path, ref_cache):
    rc, res, out = drill(
        tmp_path, "--no-peer", "--faults", "node@5:node=1", "--steps", "20", "--step-time", "0.05", cache=ref_cache
    )
    assert rc == 1 and "drill FAILED" in out
    node = res["faults"][0]["outcome"]
    assert node["resumed_from"] == 0 and node["steps_lost"] >= 5  # nothing durable yet, RAM gone, no replica
    # One restart, and the run then finished: node 0's RAM steps from the abandoned timeline were
    # dropped on restore (they used to make its re-snapshots of steps 1-5 hang the job).
    assert res["attempts"] == 2 and res["final_step"] == 20
    assert any("step(s) lost" in e for e in res["errors"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_random_schedules_all_pass(tmp_path, ref_cache):
    failures = []
    # Three seeds whose draws cover every fault kind (kill, crash, hang, node, term) and every
    # phase they are drawn in (step, snapshot, persist, replicate, commit): 2 draws kill/replicate
    # and hang/commit, 3 node/step and node/persist, 10 crash/snapshot and term/persist. (Seeds
    # 1, 4, 5 and 7 add only combinations of those; they passed too and cost a minute of CI.)
    for seed in (2, 3, 10):
        # Two ranks on two simulated nodes: every fault kind and phase, at half the restart cost.
        rc, res, out = drill(
            tmp_path / f"seed{seed}",
            "--seed",
            str(seed),
            "--count",
            "2",
            "--steps",
            "20",
            "--step-time",
            "0.05",
            "--nproc",
            "2",
            "--ranks-per-node",
            "1",
            cache=ref_cache,
        )
        if rc != 0:
            failures.append((seed, [f"{f['kind']}@{f['step']}:{f['during']}" for f in res["faults"]], res["errors"]))
    assert not failures, failures

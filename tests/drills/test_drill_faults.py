"""ftkit drill end to end, inside the data path: faults during a snapshot, a persist,
a replication and a commit, storage faults, an S3 outage, and a user's script
(tests/drills/test_drill.py has the default drill, random schedules and must-fail drills;
the two files run on different pytest workers, so neither holds up the suite).
"""

from __future__ import annotations

import pytest
from drillkit import REPO, by_kind, drill


@pytest.fixture(scope="module")
def ref_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("drill-reference"))


@pytest.mark.slow
def test_faults_inside_the_persist_pipeline(tmp_path, ref_cache):
    rc, res, out = drill(
        tmp_path,
        "--steps",
        "150",
        "--step-time",
        "0.05",
        "--faults",
        # (A SIGTERM is drilled in test_drill_of_a_user_script and the random schedules.)
        "kill@40:rank=1:during=snapshot,hang@46:rank=3:during=persist,"
        "kill@52:rank=0:during=commit,node@64:node=1:during=replicate",
        # (No slow@ fault: a rank throttled to a tenth of the CPU now completes a step every
        # 2-18 s here, far slower than its factor, so the 6 slow steps a straggler verdict
        # needs rarely fit; straggler detection is tested with an in-loop slowdown in
        # test_watchdog.py. Left open: docs/drills.md, "The slow fault".)
        cache=ref_cache,
    )
    assert rc == 0 and res["passed"], out[-4000:]
    assert res["bitwise_equal"]
    f = {(x["kind"], x["during"]): x for x in res["faults"]}
    # The durable tier is written every 10 steps: persist and commit faults land on those steps.
    assert f["hang", "persist"]["injected_step"] == 50 and f["kill", "commit"]["injected_step"] == 60
    assert f["hang", "persist"]["outcome"]["detected_by"] == "ftkit watchdog (dead)"
    for key in (("kill", "snapshot"), ("hang", "persist"), ("kill", "commit"), ("node", "replicate")):
        o = f[key]["outcome"]
        assert o["steps_lost"] <= 2 and o["resumed_from"] >= f[key]["injected_step"] - 2, (key, o)
    assert "peer" in f["node", "replicate"]["outcome"]["restored_from"]


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
        str(REPO / "tests" / "support" / "drill_script.py"),
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
    for kind in ("kill", "crash"):  # one step recomputed, plus the snapshot in flight if the pipeline lagged
        o = f[kind]["outcome"]
        assert o["steps_lost"] <= 1 + (1 if o["snapshot_in_flight"] else 0), (kind, o)
    assert f["term"]["outcome"]["steps_lost"] == 0 and f["kill"]["outcome"]["restored_from"] == "ram"
    term = f["term"]["outcome"]  # saved where it stopped: the agreed step, after the notice
    assert term["detected_by"] == "preemption (SIGTERM)" and term["resumed_from"] > f["term"]["injected_step"]

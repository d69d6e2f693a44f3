"""ftkit drill end to end: real torchrun, real faults, bitwise comparison."""

from __future__ import annotations

import json

import pytest

from ftkit.drill import parse_faults
from conftest import run_cli


def test_schedule_language_rejects_bad_faults():
    assert [f.kind for f in parse_faults("kill@3:rank=1,node@5:node=1", 4, 2)] == ["kill", "node"]
    for bad, why in [("boom@3", "KIND@STEP"), ("kill@3:rank=9", "rank 9 does not exist"),
                     ("node@3:node=5", "node 5 does not exist"), ("kill@5,hang@3", "increasing"),
                     ("kill@3:colour=red", "bad option")]:
        with pytest.raises(ValueError, match=why):
            parse_faults(bad, 4, 2)
    r = run_cli("drill", "--faults", "boom@3", in_process=False)
    assert r.returncode == 2 and r.stderr.startswith("ftkit: error: bad fault")


@pytest.mark.slow
def test_default_drill_passes(tmp_path):
    out = tmp_path / "drill.json"
    r = run_cli("drill", "--run-dir", str(tmp_path / "d"), "--json", str(out), "--html", str(tmp_path / "d.html"),
                in_process=False, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["passed"] and res["bitwise_equal"] and res["final_step"] == 60
    kinds = {f["kind"]: f["outcome"] for f in res["faults"]}
    assert set(kinds) == {"kill", "hang", "node", "crash"}
    assert kinds["hang"]["detected_by"] == "ftkit watchdog (dead)"
    assert kinds["node"]["restored_from"] in ("ram", "ram+peer")  # node 1's RAM was wiped: peers had it
    assert all(o["steps_lost"] <= 3 for o in kinds.values())
    assert "goodput" in (tmp_path / "d.html").read_text()


@pytest.mark.slow
def test_drill_without_peers_reports_the_loss_and_fails(tmp_path):
    out = tmp_path / "drill.json"
    r = run_cli("drill", "--no-peer", "--faults", "node@5:node=1", "--steps", "20", "--run-dir",
                str(tmp_path / "d"), "--json", str(out), in_process=False, timeout=600)
    assert r.returncode == 1, r.stdout[-3000:]
    res = json.loads(out.read_text())
    node = res["faults"][0]["outcome"]
    assert node["resumed_from"] == 0 and node["steps_lost"] >= 5  # nothing durable yet, RAM gone, no replica
    assert any("steps lost" in e for e in res["errors"])
    assert "drill FAILED" in r.stdout

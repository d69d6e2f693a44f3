"""benchmarks/bench_anchors.py without its optional extra: each anchor skipped in one line,
ftkit's own figures still measured and its restores checked (the benchmark itself is
not part of the suite)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The anchors made unimportable, as on a machine without `pip install -e '.[anchors]'`
# (they may be installed in this venv).
RUN_WITHOUT_ANCHORS = """
import runpy, sys
sys.modules.update(torchsnapshot=None, torchft=None, nvidia_resiliency_ext=None)
sys.path.insert(0, {bench!r})
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.mark.timeout(180)
def test_bench_anchors_without_the_extra_skips_every_anchor_in_one_line_and_still_measures_ftkit(tmp_path):
    script = str(REPO / "benchmarks" / "bench_anchors.py")
    code = RUN_WITHOUT_ANCHORS.format(bench=str(REPO / "benchmarks"), script=script)
    out = tmp_path / "anchors.json"
    args = ["--only", "snapshot", "--gib", "0.004", "--small", "20", "--rounds", "1"]
    proc = subprocess.run(
        [sys.executable, "-c", code, *args, "--dir", str(tmp_path), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    for name in ("torchsnapshot", "torchft", "NVRx"):
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"{name}: ")]
        assert len(lines) == 1 and "not installed" in lines[0] and ".[anchors]" in lines[0], proc.stdout
    res = json.loads(out.read_text())
    assert set(res["unavailable"]) == {"torchsnapshot", "torchft", "NVRx"}
    assert [s["label"] for s in res["shapes"]] == ["large", "many"]
    for shape in res["shapes"]:
        assert list(shape["tools"]) == ["ftkit"]
        ftk = shape["tools"]["ftkit"]
        # every byte of the state stored, restored in process and in a fresh one (digests checked there)
        assert ftk["stored_bytes"] >= shape["bytes"]
        assert ftk["restore_in_process_s"] > 0 and ftk["restore_fresh_s"] > 0
        assert ftk["snapshot_consistent"] is True  # changed right after the stall: the save kept the old values
        assert all(v > 0 for v in shape["floors"].values())
    assert list(tmp_path.iterdir()) == [out]  # its working directory removed

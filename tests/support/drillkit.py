"""What the drill tests share: running `ftkit drill` and reading its JSON result."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli

REPO = Path(__file__).resolve().parents[2]


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

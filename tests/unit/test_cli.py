"""The operator CLI on healthy checkpoints: ls, inspect, verify, restore, gc."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_state, run_cli, snapshot_values, train_one

import ftkit
from ftkit.format.reader import committed_steps


@pytest.fixture
def ckpt(tmp_path):
    """Steps 1..3 of a small training run, and the values at step 3."""
    root = tmp_path / "ckpt"
    state = make_state()
    with ftkit.Checkpointer(state, [ftkit.Tier(str(root), keep=5)]) as ck:
        for step in (1, 2, 3):
            train_one(state)
            ck.snapshot(step)
    return root, snapshot_values(state), state


def test_ls_lists_committed_and_partial_steps(ckpt):
    root, _, _ = ckpt
    (root / "step-000000000004").mkdir()
    (root / "step-000000000004" / "rank-00000-deadbeef.data").write_bytes(b"x" * 10)
    r = run_cli("ls", str(root), "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["steps"]
    assert [(x["step"], x["status"]) for x in rows] == [
        (1, "committed"),
        (2, "committed"),
        (3, "committed"),
        (4, "partial"),
    ]
    assert rows[2]["entries"] == ["epoch", "model", "optim", "sched"]
    text = run_cli("ls", str(root))
    assert "partial" in text.stdout and text.stdout.count("committed") == 3


def test_inspect_shows_tensors(ckpt):
    root, values, _ = ckpt
    r = run_cli("inspect", str(root), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["step"] == 3
    shapes = {t["name"]: tuple(t["shape"]) for t in doc["tensor_list"]}
    assert shapes["model/0.weight"] == tuple(values["model/0.weight"].shape)
    r = run_cli("inspect", str(root / "step-000000000002"))
    assert r.returncode == 0 and r.stdout.startswith("step 2 at")


def test_verify_all_ok(ckpt):
    r = run_cli("verify", str(ckpt[0]), "--all", "--json")
    assert r.returncode == 0, r.stderr
    assert [s["ok"] for s in json.loads(r.stdout)["steps"]] == [True, True, True]


def test_restore_to_torch_loads_with_weights_only(ckpt, tmp_path):
    root, values, state = ckpt
    out = tmp_path / "out.pt"
    r = run_cli("restore", str(root), "--out", str(out))
    assert r.returncode == 0, r.stderr
    obj = torch.load(out, weights_only=True)
    assert obj["_ftkit"]["step"] == 3 and obj["epoch"] == state["epoch"]
    fresh = make_state(seed=5)
    fresh["model"].load_state_dict(obj["model"])
    fresh["optim"].load_state_dict(obj["optim"])
    assert all(torch.equal(fresh["model"].state_dict()[k[6:]], v) for k, v in values.items() if k.startswith("model/"))
    # An existing output is not overwritten without --force.
    r = run_cli("restore", str(root), "--out", str(out), "--step", "1")
    assert r.returncode == 2 and "already exists" in r.stderr
    assert torch.load(out, weights_only=True)["_ftkit"]["step"] == 3


def test_restore_to_safetensors(ckpt, tmp_path):
    from safetensors.torch import load_file

    root, values, _ = ckpt
    out = tmp_path / "out.safetensors"
    r = run_cli("restore", str(root), "--out", str(out), "--format", "safetensors", "--step", "3")
    assert r.returncode == 0, r.stderr
    tensors = load_file(str(out))
    for k, v in values.items():
        if k.startswith("model/"):
            assert torch.equal(tensors[k], v)


def test_gc_keeps_newest_and_dry_run_changes_nothing(ckpt):
    root, _, _ = ckpt
    (root / "step-000000000000").mkdir()  # an abandoned partial step
    r = run_cli("gc", str(root), "--keep", "1", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["removed"] == [1, 2]
    storage = ftkit.Tier(str(root)).open()
    assert committed_steps(storage) == [1, 2, 3]
    r = run_cli("gc", str(root), "--keep", "1")
    assert r.returncode == 0, r.stderr
    assert committed_steps(storage) == [3]
    assert (root / "step-000000000000").exists()  # changed just now: a writer may be live (--grace)
    r = run_cli("gc", str(root), "--keep", "1", "--grace", "0")
    assert r.returncode == 0, r.stderr
    assert not (root / "step-000000000000").exists()


def test_gc_never_deletes_the_newest_valid_step(ckpt):
    root, _, _ = ckpt
    (root / "step-000000000003" / "manifest.json").write_text("garbage")
    r = run_cli("gc", str(root), "--keep", "1", "--json")
    assert r.returncode == 0, r.stderr
    assert committed_steps(ftkit.Tier(str(root)).open()) == [2, 3]


def test_usage_errors_exit_2(tmp_path):
    assert run_cli("ls").returncode == 2
    assert run_cli("gc", str(tmp_path), "--keep", "0").returncode == 2
    r = run_cli("ls", str(tmp_path), "--storage-options", "{not json")
    assert r.returncode == 2 and "--storage-options is not valid JSON" in r.stderr


def test_an_empty_url_or_out_is_refused_never_the_current_directory(ckpt, tmp_path, monkeypatch):
    # `ftkit gc "$CKPT/"` with CKPT unset collected the directory the shell was in.
    root = ckpt[0]
    monkeypatch.chdir(root)
    for args in (("gc", "", "--keep", "1"), ("gc", "/", "--keep", "1"), ("ls", " ")):
        r = run_cli(*args)
        assert r.returncode != 0 and "Traceback" not in r.stderr, (args, r.stderr)
    assert committed_steps(ftkit.Tier(str(root)).open()) == [1, 2, 3]
    r = run_cli("restore", str(root), "--out", "", "--world-size", "2")
    assert r.returncode == 2 and "argument --out: empty" in r.stderr
    assert run_cli("report", "").returncode == 2
    assert committed_steps(ftkit.Tier(str(root)).open()) == [1, 2, 3]


def test_gc_refuses_retention_numbers_that_mean_nothing(ckpt):
    root = ckpt[0]
    for args, says in (
        (("--keep", "1", "--keep-every", "0"), "--keep-every must be at least 1"),
        (("--grace", "nan"), "not a number of seconds"),
        (("--grace", "-10"), "not a number of seconds"),
    ):
        r = run_cli("gc", str(root), *args)
        assert r.returncode == 2 and says in r.stderr, (args, r.stderr)
    assert committed_steps(ftkit.Tier(str(root)).open()) == [1, 2, 3]

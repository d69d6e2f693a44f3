"""DCP checkpoints in and out (issue 38): checkpoints that DCP itself wrote are listed,
inspected, verified (as far as DCP allows: it keeps no checksums) and restored by the ftkit
command line, and start a Checkpointer run on another world size; a committed ftkit step is
written out as a DCP checkpoint that `dcp.load` and `dcp_to_torch_save` read."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, run_cli
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import ftkit
from ftkit.dcp import FtkitStorageReader, FtkitStorageWriter
from ftkit.format.reader import committed_steps, load_manifest
from ftkit.tiers.storage import Storage

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _trained(seed: int):
    """dcp_job's model, unsharded, one AdamW step in (so its optimizer has state)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    return model, opt


def _dcp_state(model, opt, step: int) -> dict:
    """The state as a DCP trainer (torchtitan, accelerate) saves it: FQN-keyed."""
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt), "step": step}


def _whole(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in state["model"].items()}
    optim = state["optim"]["state"]
    out |= {f"optim.state.{n}.{s}": torch.as_tensor(v) for n, st in optim.items() for s, v in st.items()}
    return out


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"differ: {differ}"


@pytest.fixture
def titan(tmp_path):
    """A torchtitan-style checkpoint folder, ``checkpoint/step-N/``, two steps written by dcp.save."""
    root = tmp_path / "checkpoint"
    states = {}
    for step in (100, 200):
        model, opt = _trained(step)
        states[step] = _dcp_state(model, opt, step)
        dcp.save(states[step], checkpoint_id=str(root / f"step-{step}"), no_dist=True)
    return root, states


def test_dcp_checkpoints_are_listed_inspected_and_verified(titan):
    root, states = titan
    r = run_cli("ls", str(root), "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["checkpoints"]
    tensors = len(_whole(states[100]))  # the model's 4, the optimizer's 3 a parameter
    assert tensors == 16
    assert [(row["step"], row["status"], row["tensors"]) for row in rows] == [(100, "dcp", 16), (200, "dcp", 16)]
    # The newest by default; --step picks another. Names, shapes and dtypes as DCP planned them.
    r = run_cli("inspect", str(root), "--step", "100", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["checkpoint"].endswith("step-100") and doc["format"] == "dcp"
    listed = {t["name"]: (t["dtype"], t["shape"]) for t in doc["tensor_list"]}
    want = {k: ("float32", list(v.shape)) for k, v in _whole(states[100]).items()}
    assert listed == want and "step" in doc["values"]
    r = run_cli("verify", str(root), "--all", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] and [c["ok"] for c in doc["checkpoints"]] == [True, True]
    assert "no checksums" in doc["checked"]  # said, not hidden


def test_a_torn_dcp_checkpoint_fails_in_one_line_and_nothing_is_written(titan, tmp_path):
    root, _ = titan
    data = next((root / "step-200").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])  # torn: a writer killed mid-file
    r = run_cli("verify", str(root), "--all")
    assert r.returncode == 1
    assert "step-100: OK" in r.stdout and "step-200: FAILED" in r.stdout
    out = tmp_path / "out.pt"
    r = run_cli("restore", str(root), "--out", str(out))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "step-200" in r.stderr, r.stderr
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith("out.pt.tmp")]
    # No metadata at all: not a DCP checkpoint, and not an ftkit one either.
    (root / "step-200" / ".metadata").unlink()
    r = run_cli("inspect", str(root / "step-200"))
    assert r.returncode != 0 and "Traceback" not in r.stderr


def test_a_dcp_checkpoint_restores_to_one_file_or_to_ftkit_for_another_world_size(titan, tmp_path):
    root, states = titan
    want = _whole(states[200])
    r = run_cli("restore", str(root), "--out", str(tmp_path / "full.pt"))
    assert r.returncode == 0, r.stderr
    full = torch.load(tmp_path / "full.pt")
    assert full["step"] == 200
    _assert_equal(_whole(full), want)
    r = run_cli("restore", str(root), "--format", "safetensors", "--out", str(tmp_path / "full.safetensors"))
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file

    _assert_equal(load_file(tmp_path / "full.safetensors"), want)
    # To an ftkit checkpoint laid out for 3 ranks: an ordinary step, verified, whose values are DCP's.
    out = str(tmp_path / "ftkit")
    r = run_cli("restore", str(root), "--world-size", "3", "--out", out, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["world_size"] == 3
    assert committed_steps(Storage(out)) == [200] and load_manifest(Storage(out), 200).world_size == 3
    assert run_cli("verify", out).returncode == 0
    # Again to the same place: refused as from an ftkit checkpoint, the step there left as it was.
    before = load_manifest(Storage(out), 200)
    r = run_cli("restore", str(root), "--world-size", "2", "--out", out)
    assert r.returncode == 2 and "already holds step 200; choose another --out" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and load_manifest(Storage(out), 200) == before
    r = run_cli("restore", out, "--out", str(tmp_path / "via-ftkit.pt"))
    assert r.returncode == 0, r.stderr
    via = torch.load(tmp_path / "via-ftkit.pt")
    assert via["step"] == 200
    _assert_equal(_whole(via), want)


def test_a_dcp_checkpoint_with_tensors_in_a_list_verifies_and_restores_them_all(tmp_path):
    """DCP names a tensor in a list by its index ("buffers.1"): verify finds it, and the
    safetensors file holds it (a walk over dicts alone missed it and failed the check)."""
    state = {"model": {"w": torch.ones(2), "buffers": [torch.zeros(3), torch.arange(4.0)]}, "step": 7}
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    r = run_cli("verify", str(tmp_path / "ckpt"))
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "out.safetensors"
    r = run_cli("restore", str(tmp_path / "ckpt"), "--format", "safetensors", "--out", str(out))
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file

    want = {"model.w": state["model"]["w"]} | {f"model.buffers.{i}": t for i, t in enumerate(state["model"]["buffers"])}
    _assert_equal(load_file(out), want)


def test_a_dcp_checkpoint_restores_to_an_ftkit_step_on_s3_with_its_storage_options(titan, s3_server, s3_url):
    root, states = titan
    opts = s3_server.storage_options()
    r = run_cli("restore", str(root), "--world-size", "2", "--out", s3_url, "--storage-options", json.dumps(opts))
    assert r.returncode == 0, r.stderr
    out = Storage(s3_url, opts)
    assert committed_steps(out) == [200] and load_manifest(out, 200).world_size == 2
    r = run_cli("restore", s3_url, "--out", str(root.parent / "via-s3.pt"), "--storage-options", json.dumps(opts))
    assert r.returncode == 0, r.stderr
    _assert_equal(_whole(torch.load(root.parent / "via-s3.pt")), _whole(states[200]))


def test_a_dcp_checkpoint_is_refused_a_bad_world_size_or_format_as_an_ftkit_step_is(titan, tmp_path):
    root, _ = titan
    out = tmp_path / "ftkit"
    for args, said in (
        (("--world-size", "0"), "--world-size must be from 1 to"),
        (("--world-size", str(2**24 + 1)), "--world-size must be from 1 to"),
        (("--world-size", "2", "--format", "safetensors"), "--format does not apply"),
    ):
        r = run_cli("restore", str(root), "--out", str(out), *args)
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not out.exists()
    # `ftkit export` (no --world-size) of a DCP checkpoint: one torch file, as `ftkit restore` writes.
    r = run_cli("export", str(root), "--out", str(tmp_path / "full.pt"))
    assert r.returncode == 0 and (tmp_path / "full.pt").exists(), r.stderr


def test_a_checkpointer_step_exported_to_dcp_is_read_by_dcp_load_and_dcp_to_torch_save(tmp_path):
    model, opt = _trained(3)
    state = {"model": model, "optim": opt, "epoch": 4}
    ckpt = str(tmp_path / "ckpt")
    with ftkit.Checkpointer(state, tiers=[ckpt]) as ck:
        ck.snapshot(12)
    out = str(tmp_path / "dcp")
    r = run_cli("export", ckpt, "--format", "dcp", "--out", out, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["step"] == 12
    # As a DCP user loads it: into a fresh model's and optimizer's own state dicts.
    fresh, fresh_opt = _trained(99)
    sd = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict(), "epoch": 0}
    dcp.load(sd, checkpoint_id=out, no_dist=True)
    fresh.load_state_dict(sd["model"])
    fresh_opt.load_state_dict(sd["optim"])
    assert sd["epoch"] == 4
    _assert_equal(fresh.state_dict(), model.state_dict())
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        _assert_equal(fresh_opt.state[q], opt.state[p])
    # DCP's own converter reads it to one torch.save file.
    dcp_to_torch_save(out, str(tmp_path / "converted.pt"))
    converted = torch.load(tmp_path / "converted.pt", weights_only=False)
    _assert_equal(converted["model"], model.state_dict())
    # Never over a directory that holds something, nor over a file, unless --force: then the
    # step replaces it whole (a newer step's export, read back by DCP), and nothing is left beside.
    r = run_cli("export", ckpt, "--format", "dcp", "--out", out)
    assert r.returncode == 2 and "already exists" in r.stderr and "--force" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "a-file").write_text("precious")
    r = run_cli("export", ckpt, "--format", "dcp", "--out", str(tmp_path / "a-file"))
    assert r.returncode == 2 and "already exists" in r.stderr and "Traceback" not in r.stderr
    assert (tmp_path / "a-file").read_text() == "precious"
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with ftkit.Checkpointer(state, tiers=[ckpt]) as ck:
        ck.snapshot(13)
    (tmp_path / "dcp" / "stale-leftover").write_text("x")
    r = run_cli("export", ckpt, "--format", "dcp", "--out", out, "--force", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["step"] == 13
    assert not (tmp_path / "dcp" / "stale-leftover").exists()
    again = {"model": _trained(7)[0].state_dict()}
    dcp.load(again, checkpoint_id=out, no_dist=True)
    _assert_equal(again["model"], model.state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["a-file", "ckpt", "converted.pt", "dcp"])
    assert (tmp_path / "dcp").stat().st_mode & 0o777 == (tmp_path / "ckpt").stat().st_mode & 0o777  # the umask's
    # --force never replaces the tier it reads, what holds it, a link or a mount point.
    steps = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    for out in (ckpt, str(tmp_path)):
        r = run_cli("export", ckpt, "--format", "dcp", "--out", out, "--force")
        assert r.returncode == 2 and "checkpoint tier" in r.stderr and "Traceback" not in r.stderr, r.stderr
    (tmp_path / "link").symlink_to(tmp_path / "dcp")
    r = run_cli("export", ckpt, "--format", "dcp", "--out", str(tmp_path / "link"), "--force")
    assert r.returncode == 2 and "symbolic link" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == steps
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_a_dcp_written_ftkit_step_exports_with_its_nesting_across_a_reshard(tmp_path):
    """A step DCP wrote through ftkit is flat in ftkit's manifest (DCP's FQNs); the export nests
    it again from DCP's planner data, also after `ftkit reshard` moved it to another world size."""
    model, opt = _trained(5)
    state = _dcp_state(model, opt, 8)
    root = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=FtkitStorageWriter([root]), checkpoint_id=8, no_dist=True)
    resharded = str(tmp_path / "resharded")
    assert run_cli("restore", root, "--world-size", "2", "--out", resharded).returncode == 0
    out = str(tmp_path / "dcp")
    assert run_cli("export", resharded, "--format", "dcp", "--out", out).returncode == 0
    fresh, fresh_opt = _trained(0)
    sd = _dcp_state(fresh, fresh_opt, 0)
    dcp.load(sd, checkpoint_id=out, no_dist=True)
    assert sd["step"] == 8
    _assert_equal(_whole(sd), _whole(state))


@pytest.mark.slow
def test_dcp_checkpoints_load_into_a_sharded_job_of_another_world_size(tmp_path):
    """A DCP checkpoint from one process starts a 3-rank FSDP2 Checkpointer run (ftkit.dcp.load_into,
    resharded by DCP), which then snapshots its own steps; and an exported ftkit step is read by
    `dcp.load` into the same 3-rank sharding, as a DCP user reads any checkpoint."""
    src = str(tmp_path / "src")
    model, opt = _trained(1)
    source = _dcp_state(model, opt, 5)
    dcp.save(source, checkpoint_id=src, no_dist=True)
    origin = str(tmp_path / "origin")
    model2, opt2 = _trained(2)
    exported_state = _dcp_state(model2, opt2, 11)
    dcp.save(exported_state, storage_writer=FtkitStorageWriter([origin]), checkpoint_id=11, no_dist=True)
    exported = str(tmp_path / "exported")
    assert run_cli("export", origin, "--format", "dcp", "--out", exported).returncode == 0

    ckpt, out = str(tmp_path / "ckpt"), tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(REPO, "tests", "support")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
    cmd += [os.path.join(REPO, "tests", "support", "dcp_load_into_job.py"), ckpt, str(out), src, exported]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]

    loaded = torch.load(out / "loaded.pt")
    assert loaded["step"] == 5
    _assert_equal(loaded["tensors"], _whole(source))
    assert committed_steps(Storage(ckpt)) == [6, 7] and load_manifest(Storage(ckpt), 7).world_size == 3
    assert run_cli("verify", ckpt).returncode == 0
    got = torch.load(out / "exported.pt")
    assert got["step"] == 11
    _assert_equal(got["tensors"], _whole(exported_state))


def test_bytes_values_round_trip_and_malformed_ones_are_refused(tmp_path):
    """A data loader that keeps its own state as bytes (torchtitan's does) round-trips through
    DCP on ftkit's storage and through a Checkpointer, stored as base64 JSON (no pickle); a
    `$bytes` that is not base64 makes the step unreadable, named, rather than misread."""
    from conftest import edit_manifest

    from ftkit.format.manifest import MANIFEST_NAME, step_dir_name

    blob = bytes(range(256)) * 3
    root = str(tmp_path / "dcp")
    dcp.save({"loader": {"dp_rank_0": blob}, "step": 2}, storage_writer=FtkitStorageWriter([root]), checkpoint_id=2)
    sd = {"loader": {"dp_rank_0": b""}, "step": 0}
    dcp.load(sd, storage_reader=FtkitStorageReader([root]))
    assert sd == {"loader": {"dp_rank_0": blob}, "step": 2}

    ckpt = str(tmp_path / "ckpt")
    state = {"model": torch.nn.Linear(2, 2), "loader": blob}
    with ftkit.Checkpointer(state, tiers=[ckpt]) as ck:
        ck.snapshot(1)
    state["loader"] = b"other"
    with ftkit.Checkpointer(state, tiers=[ckpt]) as ck:
        assert ck.restore() == 1
    assert state["loader"] == blob

    def spoil(doc):
        doc["skeleton"]["entries"]["loader"]["value"] = {"$bytes": "not base64!"}

    edit_manifest(os.path.join(ckpt, step_dir_name(1), MANIFEST_NAME), spoil)
    r = run_cli("verify", ckpt)
    assert r.returncode == 1 and "$bytes" in r.stdout + r.stderr and "Traceback" not in r.stderr


def test_an_unreadable_or_missing_dcp_metadata_fails_in_one_line_with_no_traceback(titan, tmp_path, caplog):
    """A torn .metadata (a copy cut short) is named in one line by `ftkit restore` and by
    `load_into`, before DCP's load tries it, logs its traceback and falls back to per-rank
    metadata that DCP's own writer never makes; a folder without one says so."""
    import logging

    root, _ = titan
    meta = root / "step-200" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:40])
    out = tmp_path / "out.pt"
    r = run_cli("restore", str(root), "--out", str(out), in_process=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    (said,) = [line for line in r.stderr.splitlines() if "error" in line.lower()]
    assert "step-200: DCP metadata unreadable" in said, r.stderr
    assert not out.exists()
    model, opt = _trained(0)
    state = {"model": model, "optim": opt, "step": 0}
    with caplog.at_level(logging.WARNING):
        with pytest.raises(ftkit.FtkitError) as e:
            ftkit.dcp.load_into(state, str(root / "step-200"))
        assert "step-200: DCP metadata unreadable" in str(e.value) and "\n" not in str(e.value)
        with pytest.raises(ftkit.FtkitError) as e:
            ftkit.dcp.load_into(state, str(root))  # the folder of checkpoints, not one of them
        assert str(e.value) == f"{root}: no DCP metadata (.metadata)"
    assert not [rec for rec in caplog.records if rec.exc_info], "DCP logged a traceback"
    assert state["step"] == 0


def test_a_dcp_checkpoint_with_a_value_only_pickle_holds_is_refused_in_one_line(tmp_path):
    """`ftkit restore --world-size` of a DCP checkpoint holding an object (here a torch.dtype)
    that ftkit's format cannot hold without pickle: one line naming it, exit 1, nothing written."""
    src = str(tmp_path / "src")
    dcp.save({"model": {"w": torch.arange(4.0)}, "dtype": torch.float16}, checkpoint_id=src, no_dist=True)
    out = tmp_path / "out"
    r = run_cli("restore", src, "--world-size", "2", "--out", str(out), in_process=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    (said,) = [line for line in r.stderr.splitlines() if "error" in line.lower()]
    assert "cannot store 'dtype'" in said and src in said, r.stderr
    assert not out.exists() or committed_steps(Storage(str(out))) == []


def test_one_dcp_checkpoint_named_by_its_own_folder_keeps_its_step(titan, tmp_path):
    """`checkpoint/step-200` given itself, not the folder of checkpoints: it is step 200 as the
    folder's listing says, and `restore --world-size` writes ftkit step 200 (not step 0, from
    which a Checkpointer run would start its step count over)."""
    root, states = titan
    one = str(root / "step-200")
    r = run_cli("ls", one, "--json")
    assert r.returncode == 0, r.stderr
    assert [row["step"] for row in json.loads(r.stdout)["checkpoints"]] == [200]
    assert run_cli("inspect", one, "--step", "200").returncode == 0
    out = str(tmp_path / "ftkit")
    r = run_cli("restore", one, "--world-size", "2", "--out", out)
    assert r.returncode == 0, r.stderr
    assert committed_steps(Storage(out)) == [200]
    r = run_cli("restore", out, "--out", str(tmp_path / "via-ftkit.pt"))
    assert r.returncode == 0, r.stderr
    _assert_equal(_whole(torch.load(tmp_path / "via-ftkit.pt")), _whole(states[200]))

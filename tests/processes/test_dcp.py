"""ftkit under PyTorch Distributed Checkpoint (issue 38): `dcp.save`, `dcp.async_save` and
`dcp.load`, called as a DCP trainer calls them, write and read ftkit steps through
`FtkitStorageWriter` / `FtkitStorageReader`: checksummed, committed last, retained, no pickle."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import dist_worker
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, run_cli
from ranks import run_ranks
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ftkit.dcp import FtkitStorageReader, FtkitStorageWriter, step_of
from ftkit.errors import CheckpointNotFoundError
from ftkit.format.manifest import MANIFEST_NAME, step_dir_name
from ftkit.format.reader import committed_steps, load_manifest
from ftkit.tiers.storage import Storage

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model(seed: int):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    m(torch.randn(3, 8)).square().mean().backward()
    opt.step()
    return m, opt


def _state(m, opt, step):
    msd, osd = get_state_dict(m, opt)
    return {"model": msd, "optim": osd, "step": step, "note": {"lr": [0.1, 0.2], "name": "run"}}


def test_a_dcp_save_is_an_ftkit_step_and_loads_back_exactly(tmp_path):
    root = str(tmp_path / "ckpt")
    m, opt = _model(0)
    dcp.save(_state(m, opt, 7), storage_writer=FtkitStorageWriter([root]), checkpoint_id=7)
    # An ordinary ftkit step: the CLI lists and verifies it; its files hold no pickle.
    assert committed_steps(Storage(root)) == [7]
    assert run_cli("verify", root).returncode == 0
    step_dir = tmp_path / "ckpt" / step_dir_name(7)
    for f in step_dir.iterdir():
        assert not f.read_bytes().startswith(b"\x80"), f"{f.name} looks pickled"  # (pickle protocol 2+)
    manifest = load_manifest(Storage(root), 7)
    assert {t.name for t in manifest.tensors} >= {"model.0.weight", "optim.state.0.weight.exp_avg"}
    m2, opt2 = _model(1)
    state = _state(m2, opt2, 0)
    state["note"] = {"lr": [0.0, 0.0], "name": ""}
    reader = FtkitStorageReader([root])
    assert reader.latest_step() == 7
    dcp.load(state, storage_reader=reader)
    set_state_dict(m2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert state["step"] == 7 and state["note"] == {"lr": [0.1, 0.2], "name": "run"}
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg"], opt2.state[b]["exp_avg"])


def test_steps_tiers_and_retention(tmp_path, caplog):
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    writer = FtkitStorageWriter([{"url": fast, "keep": 2}, {"url": slow, "every": 2, "keep": None}])
    m, opt = _model(0)
    for step in range(1, 6):
        dcp.save(_state(m, opt, step), storage_writer=writer, checkpoint_id=f"{tmp_path}/run/step-{step}")
    assert committed_steps(Storage(fast)) == [4, 5] and committed_steps(Storage(slow)) == [2, 4]
    state = _state(*_model(1), 0)
    dcp.load(state, storage_reader=FtkitStorageReader([slow, fast]), checkpoint_id=2)
    assert state["step"] == 2
    # A step on no tier, in a process alone: ftkit's one-line error naming it and the tiers, no traceback.
    with pytest.raises(CheckpointNotFoundError) as e:
        dcp.load(state, storage_reader=FtkitStorageReader([slow, fast]), checkpoint_id=f"{tmp_path}/run/step-3")
    assert str(e.value) == f"no usable step 3 in {slow}, {fast}"
    assert "Traceback" not in caplog.text and state["step"] == 2
    assert step_of("s3://bucket/run/step-000120/") == 120 and step_of(9) == 9


def test_a_step_missing_on_one_rank_fails_the_load_on_every_rank(tmp_path):
    """Rank 1's tier lacks the step: both ranks fail in DCP's gathered read_metadata, with ftkit's
    message, instead of rank 1 alone raising and rank 0 waiting in DCP's next collective."""
    held, empty = str(tmp_path / "held"), str(tmp_path / "empty")
    dcp.save({"w": torch.ones(2)}, storage_writer=FtkitStorageWriter([held]), checkpoint_id=1)
    for got in run_ranks(2, dist_worker.dcp_load_missing_on_one_rank, [held, empty], timeout=60):
        assert got.startswith("CheckpointException") and f"no usable step 1 in {empty}" in got, got


def test_a_save_removes_older_abandoned_saves_and_leaves_newer_ones(tmp_path):
    """A save that never committed (a job killed mid-save) is removed by the next commit past
    it, as a Checkpointer's persist does; a partial step newer than the commit may be a save
    in flight and stays. Committed steps stay (keep None)."""
    root = tmp_path / "ckpt"
    writer = FtkitStorageWriter([{"url": str(root), "keep": None}])
    m, opt = _model(0)
    for step in (1, 2, 3):
        dcp.save(_state(m, opt, step), storage_writer=writer, checkpoint_id=step)
    (root / step_dir_name(2) / MANIFEST_NAME).unlink()  # step 2's save never committed
    (root / step_dir_name(9)).mkdir()
    (root / step_dir_name(9) / "r00000-x.data").write_bytes(b"in flight")
    dcp.save(_state(m, opt, 4), storage_writer=writer, checkpoint_id=4)
    assert committed_steps(Storage(str(root))) == [1, 3, 4]
    assert not (root / step_dir_name(2)).exists()
    assert (root / step_dir_name(9) / "r00000-x.data").read_bytes() == b"in flight"
    # A save of a step whose earlier save was abandoned: that save's data goes with the commit.
    (root / step_dir_name(5)).mkdir()
    (root / step_dir_name(5) / "rank-00000-0badf00d.data").write_bytes(b"abandoned")
    dcp.save(_state(m, opt, 5), storage_writer=writer, checkpoint_id=5)
    assert committed_steps(Storage(str(root))) == [1, 3, 4, 5]
    left = {f.name for f in (root / step_dir_name(5)).iterdir()}
    assert "rank-00000-0badf00d.data" not in left
    assert {n for n in left if n.endswith(".data")} == set(load_manifest(Storage(str(root)), 5).files)


def test_a_corrupt_or_partial_newest_step_is_not_read(tmp_path):
    root = str(tmp_path / "ckpt")
    writer = FtkitStorageWriter([{"url": root, "keep": None}])
    m, opt = _model(0)
    for step in (1, 2, 3):
        dcp.save(_state(m, opt, step), storage_writer=writer, checkpoint_id=step)
    (tmp_path / "ckpt" / step_dir_name(3) / MANIFEST_NAME).unlink()  # a save that never committed
    data = next((tmp_path / "ckpt" / step_dir_name(2)).glob("*.data"))
    data.write_bytes(data.read_bytes()[:-8])  # a torn file: its size no longer what the manifest says
    reader = FtkitStorageReader([root])
    assert reader.latest_step() == 1
    state = _state(*_model(1), 0)
    dcp.load(state, storage_reader=reader)
    assert state["step"] == 1
    # A flipped byte is caught where it is read: the load fails naming the file, never loads it.
    one = next((tmp_path / "ckpt" / step_dir_name(1)).glob("*.data"))
    raw = bytearray(one.read_bytes())
    raw[0] ^= 1
    one.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException, match="checksum mismatch"):  # (DCP's: a BaseException)
        dcp.load(_state(*_model(1), 0), storage_reader=FtkitStorageReader([root]))


def test_a_committed_step_with_torn_data_is_saved_again_by_the_run_that_resumed_before_it(tmp_path):
    """The newest step's data file is torn (a copy cut short): the load resumes from the step
    before it, and the run's save of that step number retires the torn one and commits (refused,
    every restart would fail at that step again). A save over a usable step stays refused, its
    bytes as they were."""
    root = tmp_path / "ckpt"
    writer = FtkitStorageWriter([{"url": str(root), "keep": None}])
    m, opt = _model(0)
    for step in (1, 2, 3):
        dcp.save(_state(m, opt, step), storage_writer=writer, checkpoint_id=step)
    data = next((root / step_dir_name(3)).glob("*.data"))
    data.write_bytes(data.read_bytes()[:-8])
    state = _state(*_model(1), 0)
    dcp.load(state, storage_reader=FtkitStorageReader([str(root)]))
    assert state["step"] == 2
    m2, opt2 = _model(2)  # (the resumed run's step 3)
    dcp.save(_state(m2, opt2, 3), storage_writer=writer, checkpoint_id=3)
    assert committed_steps(Storage(str(root))) == [1, 2, 3]
    state = _state(*_model(1), 0)
    dcp.load(state, storage_reader=FtkitStorageReader([str(root)]))
    assert state["step"] == 3
    assert all(torch.equal(a, b) for a, b in zip(state["model"].values(), get_state_dict(m2, opt2)[0].values()))
    assert run_cli("verify", str(root), "--all").returncode == 0
    manifest = (root / step_dir_name(3) / MANIFEST_NAME).read_bytes()
    with pytest.raises(CheckpointException, match="already committed"):
        dcp.save(_state(m, opt, 3), storage_writer=writer, checkpoint_id=3)
    assert (root / step_dir_name(3) / MANIFEST_NAME).read_bytes() == manifest
    assert run_cli("verify", str(root), "--step", "3").returncode == 0


def test_a_value_only_pickle_could_hold_is_refused_naming_it(tmp_path):
    class Opaque:
        pass

    m, opt = _model(0)
    state = {**_state(m, opt, 1), "hook": Opaque()}
    with pytest.raises(CheckpointException, match="cannot store 'hook'"):
        dcp.save(state, storage_writer=FtkitStorageWriter([str(tmp_path / "ckpt")]), checkpoint_id=1)
    assert committed_steps(Storage(str(tmp_path / "ckpt"))) == []


def test_gc_ram_refuses_the_ram_tier_of_a_live_dcp_writer_or_reader(tmp_path, monkeypatch):
    """As for a Checkpointer (test_gc_safety.py): `ftkit gc ram` keeps a RAM tier that a live
    FtkitStorageWriter or FtkitStorageReader holds, and removes it once neither lives."""
    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("FTKIT_RUN_ID", "dcp-live")
    writer = FtkitStorageWriter(["ram"])
    dcp.save({"w": torch.arange(4.0)}, storage_writer=writer, checkpoint_id=1)
    (step,) = (tmp_path / "shm" / "dcp-live").glob(f"*/{step_dir_name(1)}")
    for holder in ("writer", "reader"):
        r = run_cli("gc", "ram", "--job", "dcp-live")
        assert r.returncode == 1 and "in use" in r.stderr, (holder, r.returncode, r.stderr)
        assert step.is_dir() and any(step.iterdir())
        if holder == "writer":
            reader = FtkitStorageReader(["ram"])
            del writer
    state = {"w": torch.zeros(4)}
    dcp.load(state, storage_reader=reader)
    assert torch.equal(state["w"], torch.arange(4.0))
    del reader
    assert run_cli("gc", "ram", "--job", "dcp-live").returncode == 0 and not step.exists()


def test_a_run_started_over_after_its_durable_tier_was_deleted_does_not_load_its_ram_steps(tmp_path, monkeypatch):
    """rm -rf of the durable tier, then the same tiers again: the earlier life's steps in node RAM
    are not this run's (the durable tier's new token names a new run), so nothing is loaded from
    them, and the earlier life's RAM tier is removed. A restart with the tier in place resumes from RAM."""
    for k in ("FTKIT_RUN_ID", "FTKIT_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    shm = tmp_path / "shm"
    monkeypatch.setenv("FTKIT_RAM_DIR", str(shm))
    tiers = ["ram", {"url": str(tmp_path / "ckpt"), "every": 5}]
    m, opt = _model(0)
    writer = FtkitStorageWriter(tiers)
    for step in range(1, 8):  # step 5 on disk, 6 and 7 in RAM
        dcp.save(_state(m, opt, step), storage_writer=writer, checkpoint_id=step)
    del writer  # (its process ends: its hold on the RAM tier with it)
    assert FtkitStorageReader(tiers).latest_step() == 7  # (a restart: from RAM)
    (earlier,) = [p.name for p in shm.iterdir()]
    shutil.rmtree(tmp_path / "ckpt")
    assert FtkitStorageReader(tiers).latest_step() is None
    assert not (shm / earlier).exists()  # the earlier life's RAM tier: removed
    m2, opt2 = _model(1)
    writer = FtkitStorageWriter(tiers)
    for step in (1, 2):
        dcp.save(_state(m2, opt2, step), storage_writer=writer, checkpoint_id=step)
    state = _state(*_model(2), 0)
    dcp.load(state, storage_reader=FtkitStorageReader(tiers))
    assert state["step"] == 2
    assert all(torch.equal(a, b) for a, b in zip(state["model"].values(), get_state_dict(m2, opt2)[0].values()))
    (now,) = [p.name for p in shm.iterdir()]
    assert now != earlier


@pytest.mark.slow
def test_two_ranks_started_over_after_the_durable_tier_was_deleted_start_from_scratch(tmp_path):
    """The same through torchrun: two ranks (one node) agree on the new life's run, whose token
    only rank 0 makes; the restart before the deletion resumes from RAM as before."""
    shm, disk = str(tmp_path / "shm"), tmp_path / "disk"
    tiers = ["ram", {"url": str(disk), "every": 4}]
    first = torch.load(_torchrun(tmp_path, "first", tiers, 6, None, shm))
    again = torch.load(_torchrun(tmp_path, "again", tiers, 6, None, shm))
    assert (first["start"], again["start"]) == (0, 6)  # (steps 5 and 6 from RAM)
    (earlier,) = os.listdir(shm)
    shutil.rmtree(disk)
    over = torch.load(_torchrun(tmp_path, "over", tiers, 3, None, shm))
    assert over["start"] == 0  # not step 6 of the deleted run
    assert committed_steps(Storage(str(disk))) == []  # (every 4)
    (run,) = os.listdir(shm)  # the earlier life's RAM tier: removed
    assert run != earlier
    assert sorted(p.name for p in (tmp_path / "shm" / run).glob("*/step-*")) == [step_dir_name(2), step_dir_name(3)]


def _torchrun(tmp_path, name: str, tiers: list, steps: int, die_at: int | None, shm: str | None = None) -> str:
    out = str(tmp_path / f"{name}.pt")
    env = {k: v for k, v in os.environ.items() if k not in ("FTKIT_RUN_ID", "FTKIT_JOB_ID")}
    env.update({"FTKIT_RAM_DIR": shm or str(tmp_path / f"{name}-shm"), "OMP_NUM_THREADS": "1"})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", "1" if die_at else "0", os.path.join(REPO, "tests", "support", "dcp_job.py")]
    cmd += [json.dumps(tiers), str(steps), out] + ([str(die_at)] if die_at else [])
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.slow
def test_an_fsdp2_job_on_dcp_async_save_killed_and_restarted_ends_bit_exact(tmp_path):
    """Two FSDP2 ranks call dcp.async_save every step and dcp.load at start, with ftkit's writer
    and reader on node RAM and a disk tier; rank 1 is SIGKILLed after step 4 and torchrun
    restarts the group: the final model and optimizer equal an uninterrupted run's bit for bit."""
    clean = torch.load(_torchrun(tmp_path, "clean", [str(tmp_path / "clean-disk")], 8, None))
    disk = str(tmp_path / "disk")
    faulted = torch.load(_torchrun(tmp_path, "faulted", ["ram", {"url": disk, "keep": 3}], 8, die_at=4))
    assert clean["model"].keys() == faulted["model"].keys() and clean["optim"].keys() == faulted["optim"].keys()
    assert all(torch.equal(clean["model"][k], faulted["model"][k]) for k in clean["model"])
    assert all(torch.equal(clean["optim"][k], faulted["optim"][k]) for k in clean["optim"])
    assert committed_steps(Storage(disk)) == [6, 7, 8]  # retention on the disk tier: keep 3

"""Isolation and identity (issue 12, items 8, 9, 17, 18, 19), with real processes and real files.

* 8: a RAM-tier snapshot is restored only by the run it belongs to;
* 9: the RAM root and the directories below it are this user's and private;
* 17: no tier URL credential leaves the process (events, stats, repr, logs);
* 18: the watchdog kills a pid only on the same host, boot and pid namespace;
* 19: only a training (or distributed, or opted-in) Checkpointer takes SIGTERM, and chains.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch
from conftest import REPO, warm_target

import ftkit
from ftkit.config import Tier
from ftkit.errors import InvalidJobIdError, RunIdentityError, UnsafeRamDirError
from ftkit.format.reader import committed_steps
from ftkit.runtime.warm.zygote import torchrun_command
from ftkit.tiers.ram import (
    IDENTITY_FILE,
    existing_job_dir,
    job_dir,
    open_node_dir,
    remove_job,
    run_identity,
    run_tokens,
    validate_job_id,
)

IDENTITY_VARS = (
    "FTKIT_JOB_ID",
    "FTKIT_RUN_ID",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "FTKIT_RAM_DIR",
    "FTKIT_NODE_ID",
    "FTKIT_RANKS_PER_NODE",
    "FTKIT_RUN_DIR",
)
OTHER_UID = 12345


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without any run identity, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in IDENTITY_VARS}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, **extra})
    return env


def _python(code: str, *args: str, env: dict[str, str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO, **kw
    )


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """In this process: no run identity from the environment, and a RAM root under tmp_path."""
    for k in IDENTITY_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("FTKIT_NODE_ID", "n0")
    return tmp_path / "shm"


# ============================================================ 8: run identity
# A training run in its own process: restores what it can, reports it, then snapshots up to `steps`.
RUN = """
import json, sys, torch, ftkit
value, steps, tiers = float(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
state = {"w": torch.full((1000,), value)}
with ftkit.Checkpointer(state, tiers, rng=False) as ck:
    start = ck.restore()
    print(json.dumps({"restored": start, "w": state["w"][0].item(), "source": ck.last_restore.get("source"),
                      "ram_run": ck.ram_identity.name if ck.ram_identity else None}), flush=True)
    for step in range(start + 1, steps + 1):
        ck.snapshot(step)
"""


def _run(value: float, steps: int, tiers: list, env: dict[str, str]) -> dict:
    r = _python(RUN, str(value), str(steps), json.dumps(tiers), env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def _ram_steps(run_dir) -> list[str]:
    return sorted(p.name for p in run_dir.glob("*/step-*"))


def test_an_unrelated_run_does_not_restore_or_delete_another_runs_ram_snapshots(tmp_path):
    """The issue's reproduction: run A at 111.0 to step 7, then run B at 222.0 on the same host.
    Their durable tiers differ (and persist rarely: every=1000), so each has its own RAM tier."""
    env = _env(FTKIT_RAM_DIR=str(tmp_path / "shm"))
    tiers_a = ["ram", {"url": str(tmp_path / "a"), "every": 1000}]
    tiers_b = ["ram", {"url": str(tmp_path / "b"), "every": 1000}]
    a = _run(111.0, 7, tiers_a, env)
    assert a["restored"] == 0 and a["ram_run"].startswith("run-")
    b = _run(222.0, 9, tiers_b, env)
    assert b == {"restored": 0, "w": 222.0, "source": None, "ram_run": b["ram_run"]}  # A's step 7 not taken
    assert b["ram_run"] != a["ram_run"]
    shm = tmp_path / "shm"
    assert _ram_steps(shm / a["ram_run"]) == ["step-000000000006", "step-000000000007"]  # B deleted none
    assert _ram_steps(shm / b["ram_run"]) == ["step-000000000008", "step-000000000009"]
    # A, restarted (from another value), gets its own step 7 back from RAM.
    again = _run(333.0, 8, tiers_a, env)
    assert again == {"restored": 7, "w": 111.0, "source": "ram", "ram_run": a["ram_run"]}


def test_a_run_started_over_after_its_durable_tier_was_deleted_does_not_resume_from_ram(tmp_path):
    """rm -rf of the checkpoint directory, then the same script: it starts over (it resumed the
    deleted run's weights from node RAM), and the old run's RAM tier is removed, not left to
    fill the node. A restart with the directory in place still resumes from RAM."""
    env = _env(FTKIT_RAM_DIR=str(tmp_path / "shm"))
    tiers = ["ram", {"url": str(tmp_path / "ckpt"), "every": 5}]
    a = _run(111.0, 7, tiers, env)  # step 5 on disk, 6 and 7 in RAM
    shutil.rmtree(tmp_path / "ckpt")
    b = _run(222.0, 5, tiers, env)
    assert (b["restored"], b["w"], b["source"]) == (0, 222.0, None)
    assert b["ram_run"] != a["ram_run"] and not (tmp_path / "shm" / a["ram_run"]).exists()
    again = _run(333.0, 6, tiers, env)  # (a requeue: the directory is still there)
    assert again == {"restored": 5, "w": 222.0, "source": "ram", "ram_run": b["ram_run"]}
    # A restart while the durable tier cannot be read (an outage): the node's RAM tier still
    # says which run it is, and the run resumes from it.
    os.rename(tmp_path / "ckpt", tmp_path / "away")
    (tmp_path / "ckpt").write_text("not a directory")
    outage = _run(444.0, 6, tiers, env)
    assert (outage["restored"], outage["w"], outage["source"]) == (6, 222.0, "ram")  # (restored values carry on)


def test_named_runs_restore_only_their_own_ram_snapshots(tmp_path):
    shm = tmp_path / "shm"
    a = _run(111.0, 7, ["ram"], _env(FTKIT_RAM_DIR=str(shm), FTKIT_RUN_ID="exp-a"))
    b = _run(222.0, 3, ["ram"], _env(FTKIT_RAM_DIR=str(shm), FTKIT_RUN_ID="exp-b"))
    assert (a["ram_run"], b["ram_run"]) == ("exp-a", "exp-b")
    assert (b["restored"], b["w"]) == (0, 222.0)
    again = _run(333.0, 7, ["ram"], _env(FTKIT_RAM_DIR=str(shm), FTKIT_JOB_ID="exp-a"))  # the older variable
    assert (again["restored"], again["w"], again["source"]) == (7, 111.0, "ram")
    record = shm / "exp-a" / IDENTITY_FILE
    assert json.loads(record.read_text()) == {"version": 1, "run": {"named": "exp-a"}}
    assert record.stat().st_mode & 0o777 == 0o600


def test_a_ram_tier_without_any_identity_is_refused_with_how_to_name_the_run(tmp_path):
    shm = tmp_path / "shm"
    for extra in ({}, {"TORCHELASTIC_RUN_ID": "none"}):  # torchrun without --rdzv-id: every job's id
        r = _python(RUN, "111", "3", json.dumps(["ram", {"url": "peer"}]), env=_env(FTKIT_RAM_DIR=str(shm), **extra))
        assert r.returncode == 1
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith('ftkit.errors.RunIdentityError: the "ram" tier cannot tell which run'), last
        assert 'run_id="my-run"' in last and "FTKIT_RUN_ID=my-run" in last
        assert not shm.exists()  # nothing created, nothing read


def test_identity_sources_and_their_order(clean_env, monkeypatch, tmp_path):
    durable = run_identity([str(tmp_path / "d"), f"file://{tmp_path}/d/", "s3://key:secret@bucket/run"])
    assert durable.record == {"durable_tiers": sorted([str(tmp_path / "d"), "s3://***@bucket/run"])}
    assert durable.name.startswith("run-")
    assert durable == run_identity(["s3://key:secret@bucket/run", str(tmp_path / "d")])  # any order
    with pytest.raises(RunIdentityError):
        run_identity([])
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    with pytest.raises(RunIdentityError):
        run_identity([])
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "9b1c7a1e-standalone-uuid")  # kept across torchrun's restarts
    rdzv = run_identity([])
    assert rdzv.record == {"rendezvous_id": "9b1c7a1e-standalone-uuid"} and rdzv == run_identity([])
    assert run_identity([str(tmp_path)]).record == {"durable_tiers": [str(tmp_path)]}  # durable tiers first
    monkeypatch.setenv("FTKIT_JOB_ID", "older")
    assert run_identity([str(tmp_path)]).name == "older"
    monkeypatch.setenv("FTKIT_RUN_ID", "newer")
    assert run_identity([str(tmp_path)]).name == "newer"
    assert run_identity([], run_id="explicit").name == "explicit"
    for bad in ("..", ".hidden", "x" * 129):
        with pytest.raises(RunIdentityError, match="cannot name a RAM-tier directory"):
            run_identity([], run_id=bad)


def test_a_directory_recording_another_identity_is_refused(clean_env, tmp_path):
    state = {"w": torch.full((10,), 1.0)}
    with ftkit.Checkpointer(state, ["ram", str(tmp_path / "disk")], rng=False) as ck:
        name = ck.ram_identity.name
        ck.snapshot(1)
    record = json.loads((clean_env / name / IDENTITY_FILE).read_text())
    token = (tmp_path / "disk" / ".ftkit-run-token").read_text()  # (this life of the durable tier)
    assert record == {"version": 1, "run": {"durable_tiers": [str(tmp_path / "disk")], "tokens": [token]}}
    # A run that names itself like that directory is not that run.
    with pytest.raises(RunIdentityError, match=f"{name} belongs to another run"):
        ftkit.Checkpointer(state, ["ram"], rng=False, run_id=name)
    assert _ram_steps(clean_env / name) == ["step-000000000001"]


def test_one_process_makes_a_missing_run_token_and_the_others_wait_for_it(clean_env, monkeypatch, tmp_path):
    """How the ranks of a DCP job agree on the durable tiers' tokens, with no store of ftkit's
    (dcp/storage.py _open): rank 0 makes a missing one, the others read it once it is there. One
    that is not there within the wait falls back as an unreadable tier does: to the tokens this
    node's RAM tier of the run recorded, else none."""
    disk = Tier(str(tmp_path / "disk"))
    maker = threading.Timer(0.5, run_tokens, ([disk],))  # (rank 0, a little later)
    maker.start()
    try:
        waited = run_tokens([disk], make=False, wait_s=60)
    finally:
        maker.join()
    token = (tmp_path / "disk" / ".ftkit-run-token").read_text()
    assert waited == [token] == run_tokens([disk]) == run_tokens([disk], make=False, wait_s=0)  # (made once)
    other = Tier(str(tmp_path / "other"))
    assert run_tokens([other], make=False, wait_s=0.2) == [] and not (tmp_path / "other").exists()
    recorded = "0123456789abcdef" * 2
    open_node_dir(run_identity([other.url], tokens=[recorded]), "n0")
    assert run_tokens([other], make=False, wait_s=0.2) == [recorded]
    # A named run uses none, and makes none.
    assert run_tokens([other], run_id="mine") == []
    monkeypatch.setenv("FTKIT_RUN_ID", "mine")
    assert run_tokens([other]) == [] and not (tmp_path / "other").exists()


def test_torchrun_restarts_find_their_ram_snapshots_without_a_job_id(tmp_path, zygote):
    """No FTKIT_JOB_ID: a restarted worker derives the same identity as the first attempt."""
    run_dir = tmp_path / "run"
    cmd = torchrun_command(
        zygote,
        ["--standalone", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1"]
        + warm_target(
            zygote,
            ["-m", "ftkit.drill.reference", "--ckpt", str(tmp_path / "ckpt"), "--every", "1000", "--steps", "16"]
            + ["--ram", "--step-time", "0.1", "--run-dir", str(run_dir), "--pg-timeout", "60"],
        ),
    )
    with open(tmp_path / "torchrun.log", "w") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_env(FTKIT_RAM_DIR=str(tmp_path / "shm"), **zygote.env()),
            cwd=REPO,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                events = ftkit.coord.events.read_events(str(run_dir))
                if any(e["event"] == "step" and e["step"] >= 6 and e["rank"] == 1 for e in events):
                    break
                assert proc.poll() is None, (tmp_path / "torchrun.log").read_text()[-3000:]
                time.sleep(0.2)
            pid = [e["pid"] for e in events if e["event"] == "start" and e["rank"] == 1][-1]
            os.kill(pid, signal.SIGKILL)
            assert proc.wait(timeout=180) == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    events = ftkit.coord.events.read_events(str(run_dir))
    starts = [e for e in events if e["event"] == "start"]
    assert len({e["ram_run"] for e in starts}) == 1 and len({e["attempt"] for e in starts}) == 2
    restores = [e for e in events if e["event"] == "restore" and e["attempt"] == 1]
    assert {e["source"] for e in restores} == {"ram"} and restores[0]["step"] >= 5


# ===================================================== 9: a private RAM root
def _check_refused(state, match: str) -> None:
    with pytest.raises(UnsafeRamDirError, match=match):
        ftkit.Checkpointer(state, ["ram"], rng=False, run_id="mine")


def test_a_root_owned_by_another_user_with_a_planted_step_is_refused(clean_env, monkeypatch, tmp_path):
    """The issue's reproduction: another user pre-creates the root with a forged step 999999."""
    forged = {"w": torch.full((10,), 666.0)}
    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "attacker"))
    with ftkit.Checkpointer(forged, ["ram"], rng=False, run_id="mine") as ck:
        ck.snapshot(999999)
    subprocess.run(["chown", "-R", f"{OTHER_UID}:{OTHER_UID}", str(tmp_path / "attacker")], check=True)
    state = {"w": torch.full((10,), 1.0)}
    _check_refused(state, rf"root {tmp_path}/attacker is owned by uid {OTHER_UID}, not by this process")
    assert torch.equal(state["w"], torch.full((10,), 1.0))
    # Ours at the root but theirs below it: refused as well.
    os.chown(tmp_path / "attacker", os.geteuid(), os.getegid())
    _check_refused(state, f"job directory {tmp_path}/attacker/mine is owned by uid {OTHER_UID}")


def test_a_symlinked_root_or_job_directory_is_refused_not_followed(clean_env, monkeypatch, tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "link"))
    state = {"w": torch.zeros(10)}
    _check_refused(state, f"root {tmp_path}/link is a symlink")
    assert list(real.iterdir()) == []
    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "root"))
    (tmp_path / "root").mkdir(mode=0o700)
    (tmp_path / "root" / "mine").symlink_to(real)
    _check_refused(state, "job directory .*/root/mine is a symlink")
    assert list(real.iterdir()) == []


def test_a_root_others_can_write_is_refused_and_one_they_can_read_is_made_private(clean_env):
    state = {"w": torch.zeros(10)}
    clean_env.mkdir()
    os.chmod(clean_env, 0o777)
    _check_refused(state, f"root {clean_env} has mode 0777: others can write into it")
    assert list(clean_env.iterdir()) == [] and clean_env.stat().st_mode & 0o777 == 0o777
    os.chmod(clean_env, 0o755)
    with ftkit.Checkpointer(state, ["ram"], rng=False, run_id="mine") as ck:
        ck.snapshot(1)
    for d in (clean_env, clean_env / "mine", clean_env / "mine" / "n0"):
        assert d.stat().st_mode & 0o777 == 0o700 and d.stat().st_uid == os.geteuid()


def test_ram_directories_removed_under_a_live_job_come_back_private(clean_env):
    # (`ftkit gc ram --job` run by mistake while the job runs, a tmpfs cleaner): the next
    # snapshot makes them again, 0700 as at the start, not with the umask (0755).
    old = os.umask(0o022)
    try:
        with ftkit.Checkpointer({"w": torch.zeros(10)}, ["ram"], rng=False, run_id="mine") as ck:
            ck.snapshot(1)
            ck.wait()
            shutil.rmtree(clean_env / "mine")
            ck.snapshot(2)
            ck.wait()
    finally:
        os.umask(old)
    made = [clean_env / "mine", clean_env / "mine" / "n0", clean_env / "mine" / "n0" / "step-000000000002"]
    assert [d.stat().st_mode & 0o777 for d in made] == [0o700] * 3


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_an_identity_record_that_is_not_a_regular_file_is_refused(clean_env, tmp_path, kind):
    job = clean_env / "mine"
    job.mkdir(parents=True, mode=0o700)
    os.chmod(clean_env, 0o700)
    if kind == "symlink":
        target = tmp_path / "elsewhere.json"
        target.write_text(json.dumps({"version": 1, "run": {"named": "mine"}}))
        (job / IDENTITY_FILE).symlink_to(target)
    else:
        os.mkfifo(job / IDENTITY_FILE)  # opened without O_NONBLOCK this would hang
    with pytest.raises(UnsafeRamDirError, match="identity.json"):
        ftkit.Checkpointer({"w": torch.zeros(3)}, ["ram"], rng=False, run_id="mine")


def test_job_ids_are_validated_names_and_gc_never_follows_links(clean_env, tmp_path):
    for bad in ("", "..", ".", "/etc", "a/b", "../x", ".spare", "-rf", "x" * 129, "a\nb"):
        with pytest.raises(ValueError, match="invalid job id"):
            validate_job_id(bad)
        with pytest.raises(InvalidJobIdError):
            job_dir(bad)
    assert [validate_job_id(j) for j in ("job", "run-0a1b", "a.b_c-1", "_x")] == ["job", "run-0a1b", "a.b_c-1", "_x"]
    clean_env.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("x")
    (clean_env / "linked").symlink_to(victim)
    with pytest.raises(UnsafeRamDirError, match="is a symlink"):
        existing_job_dir("linked")
    with pytest.raises(UnsafeRamDirError, match="is a symlink"):
        remove_job("linked")
    assert (victim / "keep.txt").exists()
    theirs = clean_env / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeRamDirError, match=f"owned by uid {OTHER_UID}"):
        remove_job("theirs")
    assert theirs.exists()
    assert existing_job_dir("absent") is None
    (clean_env / "mine").mkdir(mode=0o700)
    assert existing_job_dir("mine") == str(clean_env / "mine")
    assert remove_job("mine") == str(clean_env / "mine") and not (clean_env / "mine").exists()


# User B, in one process: Python's stdlib lives under /root here, which uid 12345 cannot
# read, so the process starts as root, runs once to load every module ftkit and torch
# import lazily (in a scratch RAM root), then becomes uid 12345 for good and runs twice:
# a first run and its restart.
SECOND_USER = """
import json, os, sys, torch, ftkit
uid, tiers, scratch = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]

def run(value, steps):
    state = {"w": torch.full((1000,), value)}
    with ftkit.Checkpointer(state, tiers, rng=False) as ck:
        start = ck.restore()
        for step in range(start + 1, steps + 1):
            ck.snapshot(step)
        return {"restored": start, "w": state["w"][0].item(), "ram_run": ck.ram_identity.name,
                "ram_dir": ck._backends[0].storage.root}

os.environ["FTKIT_RAM_DIR"] = scratch
run(0.0, 1)
del os.environ["FTKIT_RAM_DIR"]
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
print(json.dumps([run(222.0, 3), run(333.0, 4)]), flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to become another user")
def test_a_second_user_on_the_node_gets_a_root_of_its_own(tmp_path):
    """Default roots are per uid: user A's (and an old shared /dev/shm/ftkit) never get in user B's way."""
    theirs, ours = f"/dev/shm/ftkit-{OTHER_UID}", f"/dev/shm/ftkit-{os.geteuid()}"
    existed = {p: os.path.lexists(p) for p in (theirs, ours, "/dev/shm/ftkit")}
    created_runs = []
    work = tempfile.mkdtemp(prefix="ftkit-isolation-")  # pytest's tmp_path is private to root
    os.chmod(work, 0o755)
    os.mkdir(os.path.join(work, "ckpt"))
    os.chown(os.path.join(work, "ckpt"), OTHER_UID, OTHER_UID)
    tiers = ["ram", {"url": os.path.join(work, "ckpt"), "every": 1000}]  # the same run identity for both users
    try:
        os.makedirs("/dev/shm/ftkit", mode=0o755, exist_ok=True)  # the old shared default, root's
        a = _run(111.0, 3, tiers, _env())  # user A (root) first
        created_runs.append(os.path.join(ours, a["ram_run"]))
        r = _python(SECOND_USER, str(OTHER_UID), json.dumps(tiers), str(tmp_path / "scratch"), env=_env())
        assert r.returncode == 0, r.stderr
        first, restart = json.loads(r.stdout.splitlines()[-1])
        assert (first["restored"], first["w"]) == (0, 222.0)  # never user A's step 3 at 111.0
        assert (restart["restored"], restart["w"]) == (3, 222.0)  # its own
        assert first["ram_run"] == a["ram_run"] and first["ram_dir"].startswith(theirs + "/")
        st = os.lstat(theirs)
        assert (st.st_uid, st.st_mode & 0o777) == (OTHER_UID, 0o700)
        steps = lambda d: sorted(n for n in os.listdir(d) if n.startswith("step-"))  # noqa: E731
        assert steps(restart["ram_dir"]) == ["step-000000000003", "step-000000000004"]
        assert steps(os.path.join(ours, a["ram_run"], socket.gethostname())) == [
            "step-000000000002",
            "step-000000000003",
        ]  # A's, untouched
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for run in created_runs:
            shutil.rmtree(run, ignore_errors=True)
        for p, was in existed.items():
            if not was:
                shutil.rmtree(p, ignore_errors=True)


# ======================================================== 17: no credentials out
def test_a_credential_in_a_tier_url_never_leaves_the_process(clean_env, tmp_path, caplog):
    url = "memory://user:hunter2@bucket/isolation-run"
    run_dir = tmp_path / "run"
    state = {"w": torch.full((100,), 5.0)}
    caplog.set_level(logging.DEBUG, logger="ftkit")
    with ftkit.Checkpointer(state, ["ram", url], rng=False, run_dir=str(run_dir)) as ck:
        for step in (1, 2):
            ck.snapshot(step)
        ck.wait()
        assert ck.stats.last_committed == {"ram": 2, "memory://***@bucket/isolation-run": 2}
        shown = [repr(ck.tiers[1]), str(ck.tiers[1]), repr(ck.tiers), repr(ck.stats)]
        ramrun = ck.ram_identity.name
        state["w"].zero_()
        assert ck.restore() == 2
    events = (run_dir / "events" / "rank-00000.jsonl").read_text()
    start = json.loads(events.splitlines()[0])
    assert start["tiers"] == ["ram", "memory://***@bucket/isolation-run"]
    assert {json.loads(line)["tier"] for line in events.splitlines() if '"persist"' in line} == {
        "ram",
        "memory://***@bucket/isolation-run",
    }
    record = (clean_env / ramrun / IDENTITY_FILE).read_text()
    for text in [events, record, caplog.text, *shown]:
        assert "hunter2" not in text
    assert "***@bucket" in shown[0] and torch.equal(state["w"], torch.full((100,), 5.0))
    # The tier still opens with its credentials: only what is shown is redacted.
    assert committed_steps(ftkit.Tier(url).open()) == [1, 2]


@pytest.mark.parametrize(
    "url, shown",
    [
        ("s3://AKIAX:abc/def+ghi@bucket/p", "s3://***@bucket/p"),  # "/" in an AWS secret key
        ("https://u:p@ss@host/x", "https://***@host/x"),  # an unescaped "@" in a password
        (
            "https://h/o?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=f00&a=1",
            "https://h/o?X-Amz-Credential=***&X-Amz-Signature=***&a=1",
        ),
        ("cannot open s3://k:s@b/x: timeout", "cannot open s3://***@b/x: timeout"),
        ("/ckpt/run", "/ckpt/run"),
        ("ram", "ram"),
        ("s3://bucket/dir/file@v2", "s3://bucket/dir/file@v2"),
    ],
)
def test_redact_url(url, shown):
    from ftkit.tiers.redact import redact_url
    from ftkit.tiers.storage import redact_url as storage_redact

    assert redact_url(url) == shown
    assert storage_redact(redact_url(url)) == redact_url(url)  # leaves nothing the older rule would hide


# ==================================================== 18: same host, by more than its name
WATCHDOG = """
import os, sys, time
from datetime import timedelta
import torch.distributed as dist
from ftkit.coord.dist import DistContext, host_identity
from ftkit.coord.events import EventLog
from ftkit.coord.judge import Beat
from ftkit.coord.nodelocal import NodeBoard
from ftkit.coord.watchdog import Watchdog, WatchdogConfig

pid, which = int(sys.argv[1]), sys.argv[2]
host, boot, ns = host_identity().split("/", 2)
host_id = {"same": host_identity(), "other-boot": f"{host}/{boot[::-1]}/{ns}",
           "other-pidns": f"{host}/{boot}/pid:[1]", "none": None}[which]
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
ctx = DistContext(rank=0, world_size=2, store=store)
# Rank 1 (on this node) wrote one heartbeat: its pid the sleeper's, its host as given; then silence.
store.set("wd/board", str(os.getpid()))  # this run's board instance, as the ranks agree on one
board = NodeBoard(ctx.scope + "wd", ctx.node, False, str(os.getpid()))
board.beats([0, 1]).write(1, Beat(1, pid=pid, host_id=host_id))
wd = Watchdog(ctx, EventLog(sys.argv[3], 0), WatchdogConfig(interval_s=0.1, dead_after_s=1.0))
wd.start()
time.sleep(30)
sys.exit(3)  # the watchdog never ended this process
"""


@pytest.mark.parametrize(
    "which, killed", [("other-boot", False), ("other-pidns", False), ("none", False), ("same", True)]
)
def test_the_watchdog_kills_a_dead_peers_pid_only_on_the_same_host_boot_and_pid_namespace(tmp_path, which, killed):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        r = _python(WATCHDOG, str(sleeper.pid), which, str(tmp_path), env=_env(), timeout=60)
        assert r.returncode == 75, r.stderr  # the watchdog found rank 1 dead and ended this worker
        detect = [e for e in ftkit.coord.events.read_events(str(tmp_path)) if e["event"] == "detect"]
        assert [(e["target"], e["what"]) for e in detect] == [(1, "dead")]
        time.sleep(0.2)
        assert (sleeper.poll() == -signal.SIGKILL) if killed else (sleeper.poll() is None)
    finally:
        sleeper.kill()
        sleeper.wait()


# ===================================================== 19: SIGTERM only where wanted
RESTORE_ONLY = """
import signal, sys, torch, ftkit
def mine(signum, frame):
    raise SystemExit(3)
signal.signal(signal.SIGTERM, mine)
state = {"w": torch.zeros(10)}
try:
    with ftkit.Checkpointer(state, [sys.argv[1]], rng=False) as ck:
        print("restored", ck.restore(), signal.getsignal(signal.SIGTERM) is mine, flush=True)
        signal.raise_signal(signal.SIGTERM)
        print("still running", flush=True)
finally:
    print("finally ran", flush=True)
"""


def test_a_restore_only_checkpointer_leaves_sigterm_alone(tmp_path):
    state = {"w": torch.full((10,), 4.0)}
    with ftkit.Checkpointer(state, [str(tmp_path / "ckpt")], rng=False, preemption_signals=()) as ck:
        ck.snapshot(5)
    r = _python(RESTORE_ONLY, str(tmp_path / "ckpt"), env=_env())
    assert r.returncode == 3, r.stderr  # the program's own handler ran, at once
    assert r.stdout.splitlines() == ["restored 5 True", "finally ran"]


TRAINING = """
import os, signal, sys, torch, ftkit
calls = []
def mine(signum, frame):
    calls.append(signum)
signal.signal(signal.SIGTERM, mine)
state = {"w": torch.zeros(10)}
opt_in = sys.argv[2] == "explicit"
kw = {"preemption_signals": (signal.SIGTERM,)} if opt_in else {}
try:
    with ftkit.Checkpointer(state, [{"url": sys.argv[1], "every": 1000}], rng=False, **kw) as ck:
        print("at start, ftkit's:", signal.getsignal(signal.SIGTERM) is not mine, flush=True)
        for step in range(1, 10):
            state["w"].fill_(step)
            ck.snapshot(step)
            if step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
except SystemExit as e:
    print("exit", e.code, "previous handler called", calls, "restored", signal.getsignal(signal.SIGTERM) is mine,
          flush=True)
    raise
"""


@pytest.mark.parametrize("how", ["default", "explicit"])
def test_a_training_checkpointer_saves_on_sigterm_and_chains_the_previous_handler(tmp_path, how):
    r = _python(TRAINING, str(tmp_path / "ckpt"), how, env=_env())
    assert r.returncode == 128 + signal.SIGTERM, r.stderr
    assert r.stdout.splitlines() == [
        f"at start, ftkit's: {how == 'explicit'}",
        f"exit {128 + signal.SIGTERM} previous handler called [15] restored True",
    ]
    assert committed_steps(ftkit.Tier(str(tmp_path / "ckpt")).open()) == [4]  # nothing was due: the final save


LATE_SIGTERM = """
import os, signal, sys, torch, ftkit
state = {"w": torch.zeros(10)}
with ftkit.Checkpointer(state, [{"url": sys.argv[1], "every": 3}], rng=False) as ck:
    for step in range(1, 4):
        state["w"].fill_(step)
        ck.snapshot(step)
    os.kill(os.getpid(), signal.SIGTERM)  # after the last step: no step end follows for a final save
    print("held for close()", flush=True)
print("went on as if never signalled", flush=True)
"""


def test_a_sigterm_after_the_last_step_ends_the_process_once_close_has_flushed(tmp_path):
    """The signal was dropped with ftkit's handler: the script went on and exited 0."""
    r = _python(LATE_SIGTERM, str(tmp_path / "ckpt"), env=_env())
    assert r.returncode == -signal.SIGTERM, (r.returncode, r.stdout, r.stderr)  # as SIGTERM's default action
    assert r.stdout.splitlines() == ["held for close()"]
    assert "SIGTERM came after the last step" in r.stderr
    assert committed_steps(ftkit.Tier(str(tmp_path / "ckpt")).open()) == [3]  # close() flushed the last step first


LATE_SIGTERM_IN_PROCESS = """
import os, signal, sys, torch, ftkit
sys.stdout = open(1, "w", closefd=False)  # block-buffered, as a worker's pipe is without PYTHONUNBUFFERED

def train(gen):
    state = {"w": torch.zeros(10)}
    with ftkit.Checkpointer(state, [{"url": sys.argv[1], "every": 3}], rng=False, watchdog=False) as ck:
        for step in range(1, 4):
            state["w"].fill_(step)
            ck.snapshot(step)
        os.kill(os.getpid(), signal.SIGTERM)  # after the last step: no step end follows for a final save
        print("held for close()")
    return "trained"

print(ftkit.run_in_process(train), "and went on as if never signalled", flush=True)
"""


def test_a_sigterm_after_the_last_step_ends_a_run_in_process_rank_too(tmp_path, zygote):
    """Two ranks under ftkit.run_in_process (whose handler the Checkpointer's chains to): the
    wrapper recorded the signal but acted on it only if train raised, so each rank exited 0.
    What the rank printed is not lost with it."""
    script = tmp_path / "late.py"
    script.write_text(LATE_SIGTERM_IN_PROCESS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = _env(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **zygote.env())
    ranks = [
        subprocess.Popen(
            [sys.executable, "-u", *warm_target(zygote, [str(script), str(tmp_path / "ckpt")])],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in ranks]
    assert [p.returncode for p in ranks] == [-signal.SIGTERM] * 2, outs  # as SIGTERM's default action
    assert [out.splitlines() for out, _ in outs] == [["held for close()"]] * 2, outs
    assert committed_steps(ftkit.Tier(str(tmp_path / "ckpt")).open()) == [3]

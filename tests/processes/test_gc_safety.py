"""Operator safety (issue 12, items 11-16c): `ftkit gc`, `ls` and in-job retention
never delete what they must keep, never follow links, never hang, never leave
debris behind. Real directories, links, FIFOs and a real S3 server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, run_cli

import ftkit
from ftkit.commit.manifests import commit
from ftkit.format.manifest import MANIFEST_NAME, step_dir_name
from ftkit.format.reader import committed_steps, scan
from ftkit.save.layout import Layout
from ftkit.save.staging import StagingArena
from ftkit.save.write import write_data
from ftkit.tiers.storage import Storage

N = 1024


def _steps(root, steps=(1, 2, 3), keep=10):
    state = {"w": torch.zeros(N)}
    with ftkit.Checkpointer(state, [ftkit.Tier(str(root), keep=keep)], rng=False) as ck:
        for s in steps:
            state["w"].fill_(s)
            ck.snapshot(s)
            ck.wait()
    return root


def _usage_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stderr.startswith("ftkit: error: "), r.stderr
    for n in needles:
        assert n in r.stderr, r.stderr


# ----------------------------------------------- 11. gc ram --job stays inside the root
@pytest.mark.parametrize("job", ["/abs/path", "..", "../x", "a/b", ".hidden", ""])
def test_gc_ram_job_must_be_a_plain_name(tmp_path, monkeypatch, job):
    root = tmp_path / "shm"
    monkeypatch.setenv("FTKIT_RAM_DIR", str(root))
    victim = tmp_path / "abs"  # what an absolute --job would have named
    (victim / "path").mkdir(parents=True)
    (victim / "path" / "precious").write_text("x")
    (tmp_path / "sibling").mkdir()
    job = str(tmp_path / "abs" / "path") if job == "/abs/path" else job
    _usage_error(run_cli("gc", "ram", "--job", job), "job id")
    assert (victim / "path" / "precious").exists() and (tmp_path / "sibling").exists()


def test_gc_ram_removes_a_named_job_only(tmp_path, monkeypatch):
    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "shm"))
    for run in ("a", "b"):
        state = {"w": torch.ones(N)}
        with ftkit.Checkpointer(state, ["ram"], rng=False, run_id=run) as ck:
            ck.snapshot(1)
    r = run_cli("gc", "ram", "--job", "a", "--json")
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "shm" / "a").exists() and (tmp_path / "shm" / "b").exists()


# A job that holds its RAM tier: snapshots step 1, then waits for a line on stdin to close
# the Checkpointer, and for another to exit.
LIVE_RAM_JOB = """
import sys, torch, ftkit
ck = ftkit.Checkpointer({"w": torch.ones(1024)}, ["ram"], rng=False, run_id="live")
ck.snapshot(1)
ck.wait()
print("READY", flush=True)
sys.stdin.readline()
ck.close()
print("CLOSED", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("end", ["close", "sigkill", "force"])
def test_gc_ram_refuses_a_live_jobs_tier_until_it_ends(tmp_path, monkeypatch, end):
    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "shm"))
    proc = subprocess.Popen(
        [sys.executable, "-c", LIVE_RAM_JOB], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert proc.stdout.readline().strip() == "READY"
        (step,) = (tmp_path / "shm" / "live").glob(f"*/{step_dir_name(1)}")  # <run>/<node>/step-.../
        for extra in ((), ("--dry-run",)):
            r = run_cli("gc", "ram", "--job", "live", *extra)
            assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
            assert r.stderr.startswith("ftkit: error: ") and r.stderr.count("\n") == 1, r.stderr
            assert "in use" in r.stderr and "--force" in r.stderr, r.stderr
            assert step.is_dir() and any(step.iterdir())
        if end == "force":
            r = run_cli("gc", "ram", "--job", "live", "--force")
            assert r.returncode == 0 and not step.exists(), (r.returncode, r.stdout, r.stderr)
            return
        if end == "close":  # the process lives on without its Checkpointer
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "CLOSED"
        else:  # as an OOM killer would: no Checkpointer.close, no atexit
            proc.kill()
            proc.wait(timeout=60)
        r = run_cli("gc", "ram", "--job", "live")
        assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
        assert not (tmp_path / "shm" / "live").exists()
    finally:
        proc.kill()
        proc.wait(timeout=60)


# ----------------------------------------------- 12. the newest *verified* step is kept
def test_gc_keeps_the_newest_step_that_verifies(tmp_path):
    """Step 4 fails verification: kept, but not one of the --keep 2 (before, only 3 was left to restore)."""
    root = _steps(tmp_path / "ckpt", steps=(1, 2, 3, 4))
    f = next((root / step_dir_name(4)).glob("*.data"))  # step 4's manifest parses; its data is bad
    raw = bytearray(f.read_bytes())
    raw[5] ^= 0x10
    f.write_bytes(bytes(raw))
    r = run_cli("gc", str(root), "--keep", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["protected"] == 3 and out["removed"] == [1] and "4" in out["failed_verification"]
    assert committed_steps(ftkit.Tier(str(root)).open()) == [2, 3, 4]
    for step in (None, 2):  # both good steps restore
        state = {"w": torch.zeros(N)}
        with ftkit.Checkpointer(state, [str(root)], rng=False) as ck:
            assert ck.restore(step) == (step or 3)
        assert torch.equal(state["w"], torch.full((N,), float(step or 3)))


def test_gc_deletes_no_committed_step_when_none_verifies(tmp_path):
    root = _steps(tmp_path / "ckpt")
    for s in (1, 2, 3):
        f = next((root / step_dir_name(s)).glob("*.data"))
        f.write_bytes(f.read_bytes()[:-8])
    r = run_cli("gc", str(root), "--keep", "1")
    assert r.returncode == 0 and "no step verified" in r.stdout, r.stdout
    assert committed_steps(ftkit.Tier(str(root)).open()) == [1, 2, 3]


# ----------------------------------------------- 13. symbolic links are never followed
def test_symlinked_step_directories_are_refused_not_followed(tmp_path):
    other = _steps(tmp_path / "other-run", steps=(1,))
    root = _steps(tmp_path / "ckpt", steps=(5, 6, 7))
    (root / step_dir_name(2)).symlink_to(other / step_dir_name(1), target_is_directory=True)
    rows = json.loads(run_cli("ls", str(root), "--json").stdout)["steps"]
    assert (2, "link") in [(r["step"], r["status"]) for r in rows]
    r = run_cli("gc", str(root), "--keep", "1", "--grace", "0", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["refused"] == [2]
    assert (other / step_dir_name(1) / MANIFEST_NAME).exists()  # the other run's step is still committed
    assert committed_steps(ftkit.Tier(str(other)).open()) == [1]
    # In-job retention too: a job that commits past the link leaves the other run alone.
    state = {"w": torch.zeros(N)}
    with ftkit.Checkpointer(state, [ftkit.Tier(str(root), keep=1)], rng=False) as ck:
        ck.snapshot(8)
        ck.wait()
        assert ck.stats.failed == 0
    assert (other / step_dir_name(1) / MANIFEST_NAME).exists()
    # A restore never reads through it either.
    with pytest.raises(ftkit.CorruptCheckpointError, match="symbolic link"):
        ftkit.format.reader.load_manifest(ftkit.Tier(str(root)).open(), 2)


def test_a_symlinked_manifest_is_not_read(tmp_path):
    other = _steps(tmp_path / "other-run", steps=(1,))
    root = _steps(tmp_path / "ckpt", steps=(1,))
    d = root / step_dir_name(9)
    d.mkdir()
    (d / MANIFEST_NAME).symlink_to(other / step_dir_name(1) / MANIFEST_NAME)
    state = {"w": torch.zeros(N)}
    with ftkit.Checkpointer(state, [str(root)], rng=False) as ck:
        assert ck.restore() == 1


# ----------------------------------------------- 14. in-progress steps
def test_gc_leaves_a_young_partial_step_alone_and_commit_rechecks_its_data(tmp_path):
    root = _steps(tmp_path / "ckpt", steps=(1, 2))
    storage = ftkit.Tier(str(root)).open()
    arena = StagingArena(slots=1, pin=False)
    t = torch.full((N,), 3.0)
    slot = arena.acquire(Layout.of([("w", t)]), wait=True)
    slot.fill([("w", t)])
    (root / step_dir_name(1) / MANIFEST_NAME).rename(root / "aside.json")  # step 1: partial, older than 2
    write = write_data(storage, 1, slot, compress=None)  # a live writer's share of it, not committed yet
    r = run_cli("gc", str(root), "--keep", "1", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["held_partial"] == [1], r.stdout
    assert (root / step_dir_name(1) / write.file).exists()
    # An operator forces it (grace 0): the data goes, and the writer's commit then fails loudly.
    assert run_cli("gc", str(root), "--keep", "1", "--grace", "0").returncode == 0
    assert not (root / step_dir_name(1)).exists()
    with pytest.raises(ftkit.StorageError, match="is gone"):
        commit(storage, 1, [write], {"entries": {"w": {"kind": "tensor", "value": {"$tensor": "w"}}}})
    assert committed_steps(storage) == [2]
    arena.release(slot)
    arena.close()


# ----------------------------------------------- 15. paths gc must refuse
def test_gc_on_a_step_directory_or_a_wrong_path_is_a_usage_error(tmp_path):
    root = _steps(tmp_path / "ckpt", steps=(1, 2))
    _usage_error(run_cli("gc", str(root / step_dir_name(2)), "--keep", "1"), "one step's directory")
    _usage_error(run_cli("gc", str(tmp_path / "ckpt-typo"), "--keep", "1"), "no checkpoint steps here")
    assert committed_steps(ftkit.Tier(str(root)).open()) == [1, 2]


# ----------------------------------------------- 16. a FIFO never hangs a reader
def test_a_fifo_named_manifest_hangs_nothing(tmp_path):
    root = _steps(tmp_path / "ckpt", steps=(1,))
    d = root / step_dir_name(2)
    d.mkdir()
    os.mkfifo(d / MANIFEST_NAME)
    code = (
        "import sys, ftkit, torch; from ftkit.tools.cli import main;"
        f"r = [main(['ls', {str(root)!r}]), main(['gc', {str(root)!r}, '--keep', '1']),"
        f" main(['verify', {str(root)!r}]), main(['inspect', {str(root)!r}, '--step', '2'])];"
        f"s = {{'w': torch.zeros({N})}}; ck = ftkit.Checkpointer(s, [{str(root)!r}], rng=False);"
        "print('RESULT', r, ck.restore()); ck.close()"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "RESULT [0, 0, 0, 1] 1" in r.stdout, r.stdout + r.stderr
    assert "bad" in r.stdout and "not a regular file" in r.stderr
    assert "Traceback" not in r.stderr


# ----------------------------------------------- 16b. no empty prefix is a step, none is left
def test_s3_retention_leaves_no_empty_step_prefix(s3_server, s3_url):
    opts = s3_server.storage_options()
    state = {"w": torch.zeros(N)}
    with ftkit.Checkpointer(state, [ftkit.Tier(s3_url, keep=2, storage_options=opts)], rng=False) as ck:
        for s in range(1, 6):
            ck.snapshot(s)
        ck.wait()
    r = run_cli("ls", s3_url, "--storage-options", json.dumps(opts), "--json")
    assert r.returncode == 0, r.stderr
    assert [(x["step"], x["status"]) for x in json.loads(r.stdout)["steps"]] == [(4, "committed"), (5, "committed")]
    storage = Storage(s3_url, opts)
    assert sorted(n for n, _ in storage.list_dir()) == [step_dir_name(4), step_dir_name(5)]
    # An empty prefix left by another tool is not a step either, and gc clears it.
    storage.fs.pipe_file(storage.path(step_dir_name(9)) + "/", b"")
    assert [d.step for d in scan(storage)] == [4, 5]
    r = run_cli("gc", s3_url, "--keep", "2", "--grace", "0", "--storage-options", json.dumps(opts))
    assert r.returncode == 0, r.stderr
    assert sorted(n for n, _ in storage.list_dir()) == [step_dir_name(4), step_dir_name(5)]


# ----------------------------------------------- 16c. incomplete multipart uploads
WRITER = """
import sys, torch, ftkit, json
url, opts = sys.argv[1], json.loads(sys.argv[2])
state = {"w": torch.randn(20 * 2**20)}  # 80 MiB: more than one 64 MiB part, so a multipart upload
ck = ftkit.Checkpointer(state, [ftkit.Tier(url, storage_options=opts)], rng=False)
ck.snapshot(1); ck.wait()
print("COMMITTED", flush=True)
ck.snapshot(2); ck.wait()
"""


def test_a_writer_killed_mid_upload_leaves_an_upload_gc_aborts(s3_server, s3_url):
    opts = s3_server.storage_options()
    storage = Storage(s3_url, opts)
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, s3_url, json.dumps(opts)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert proc.stdout.readline().strip() == "COMMITTED"
        deadline = time.monotonic() + 60
        while not storage.incomplete_uploads() and time.monotonic() < deadline:
            time.sleep(0.05)  # step 2's first part is on its way
        proc.kill()  # SIGKILL mid-upload, as an OOM killer would
    finally:
        proc.kill()
        proc.wait()
    uploads = storage.incomplete_uploads()
    assert uploads and all(step_dir_name(2) in u["key"] for u in uploads), uploads
    r = run_cli("ls", s3_url, "--storage-options", json.dumps(opts), "--json")
    assert [u["key"] for u in json.loads(r.stdout)["incomplete_uploads"]] == [u["key"] for u in uploads]
    r = run_cli("gc", s3_url, "--keep", "1", "--storage-options", json.dumps(opts), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["held_uploads"] == len(uploads)  # too young: maybe live
    r = run_cli("gc", s3_url, "--keep", "1", "--grace", "0", "--storage-options", json.dumps(opts), "--json")
    assert r.returncode == 0 and sorted(json.loads(r.stdout)["aborted_uploads"]) == sorted(u["key"] for u in uploads)
    assert storage.incomplete_uploads() == []
    assert committed_steps(storage) == [1]


def test_a_running_jobs_retention_aborts_stale_uploads(s3_server, s3_url):
    from ftkit.tiers import retention as gc

    opts = s3_server.storage_options()
    state = {"w": torch.zeros(N)}
    with ftkit.Checkpointer(state, [ftkit.Tier(s3_url, storage_options=opts)], rng=False) as ck:
        ck.snapshot(1)
    storage = Storage(s3_url, opts)
    bucket, _, key = storage.path(f"{step_dir_name(2)}/rank-00000-0badf00d.data").partition("/")
    storage.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    gc._uploads_checked.pop(storage.url, None)
    gc.apply_job_retention(storage, keep=2, keep_every=None, protect=1)  # default grace: too young
    assert len(storage.incomplete_uploads()) == 1
    gc._uploads_checked.pop(storage.url, None)
    gc.apply_job_retention(storage, keep=2, keep_every=None, protect=1, upload_grace_s=0)
    assert storage.incomplete_uploads() == [] and committed_steps(storage) == [1]


@pytest.mark.parametrize("lookalike", ["step-00000000000\u0663", "step-000000000003\n"])
def test_a_directory_that_only_looks_like_the_newest_step_never_gets_it_deleted(tmp_path, lookalike):
    """An old empty directory named like step 3 with a non-ASCII digit, or with a trailing
    newline, is no step: gc removed the real step 3 (verified, the newest) in its place."""
    root = _steps(tmp_path / "ckpt", steps=(2, 3))
    (root / lookalike).mkdir()
    old = time.time() - 7200
    for p in [*root.rglob("*"), root / lookalike]:
        os.utime(p, (old, old))
    r = run_cli("gc", str(root), "--keep", "2")
    assert r.returncode == 0, r.stderr
    assert committed_steps(Storage(str(root))) == [2, 3]
    assert run_cli("verify", str(root), "--all").returncode == 0
    assert (root / lookalike).is_dir()  # not ftkit's: left alone

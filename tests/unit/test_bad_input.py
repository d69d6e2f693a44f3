"""Bad input: a clear one-line error, the right exit code, nothing good lost."""

from __future__ import annotations

import contextlib
import json
import subprocess
import uuid

import pytest
import torch
from conftest import edit_manifest, run_cli

import ftkit
from ftkit.format.manifest import MANIFEST_NAME, step_dir_name
from ftkit.format.reader import committed_steps


def _one_line_error(r, code: int, *needles: str) -> None:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ftkit: error: "), r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture
def two_steps(tmp_path):
    """Steps 1 and 2 with distinguishable values; step 2 is the one we damage."""
    root = tmp_path / "ckpt"
    state = {"w": torch.zeros(4096)}
    with ftkit.Checkpointer(state, [ftkit.Tier(str(root), keep=5)], rng=False) as ck:
        for step in (1, 2):
            state["w"].fill_(step)
            ck.snapshot(step)
            ck.wait()
    return root


def _data_file(root, step=2):
    return next((root / step_dir_name(step)).glob("*.data"))


def _manifest(root, step=2):
    return root / step_dir_name(step) / MANIFEST_NAME


def _edit_manifest(root, fn):
    edit_manifest(_manifest(root), fn)


def _restored_step_and_value(root, numel: int = 4096) -> tuple[int, float]:
    state = {"w": torch.full((numel,), -1.0)}
    with ftkit.Checkpointer(state, [str(root)], rng=False) as ck:
        step = ck.restore()
    return step, float(state["w"][0])


def _damage_truncate(root):
    f = _data_file(root)
    f.write_bytes(f.read_bytes()[:-100])


def _damage_bitflip(root):
    f = _data_file(root)
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x20
    f.write_bytes(bytes(raw))


def _damage_missing_data(root):
    _data_file(root).unlink()


def _damage_newer_version(root):
    _edit_manifest(root, lambda d: d.update(format_version=99))


def _damage_escape(root):
    def fn(d):
        name = next(iter(d["files"]))
        d["files"] = {"../../etc/passwd": d["files"][name]}
        for t in d["tensors"]:
            for s in t["shards"]:
                for c in s["chunks"]:
                    c["file"] = "../../etc/passwd"

    _edit_manifest(root, fn)


def _damage_garbage(root):
    _manifest(root).write_bytes(b"\x00\xffnot json{")


def _damage_foreign(root):
    _manifest(root).write_text(json.dumps({"metadata": "a DCP checkpoint, say"}))


@pytest.mark.parametrize(
    "damage, needle",
    [
        (_damage_truncate, "truncated"),
        (_damage_bitflip, "checksum mismatch"),
        (_damage_missing_data, "data file is missing"),
        (_damage_newer_version, "format version 99 is newer"),
        (_damage_escape, "outside its step directory"),
        (_damage_garbage, "not valid JSON"),
        (_damage_foreign, "not an ftkit checkpoint"),
    ],
)
def test_damaged_step_fails_verify_and_restore_falls_back(two_steps, damage, needle):
    damage(two_steps)
    r = run_cli("verify", str(two_steps), "--step", "2")
    assert r.returncode == 1
    assert "FAILED" in r.stdout and needle in r.stdout, r.stdout
    assert "Traceback" not in r.stderr
    # Export of the damaged step: one line, exit 1, nothing written.
    out = two_steps.parent / "out.pt"
    r = run_cli("restore", str(two_steps), "--step", "2", "--out", str(out))
    _one_line_error(r, 1, needle)
    assert not out.exists()
    # The good step is untouched and the library falls back to it.
    assert run_cli("verify", str(two_steps), "--step", "1").returncode == 0
    assert _restored_step_and_value(two_steps) == (1, 1.0)


def test_missing_manifest_means_the_step_does_not_exist(two_steps):
    _manifest(two_steps).unlink()
    r = run_cli("verify", str(two_steps), "--step", "2")
    assert r.returncode == 1 and "not committed" in r.stdout
    r = run_cli("inspect", str(two_steps), "--step", "2")
    _one_line_error(r, 1, "no manifest")
    assert json.loads(run_cli("ls", str(two_steps), "--json").stdout)["steps"][1]["status"] == "partial"
    assert _restored_step_and_value(two_steps) == (1, 1.0)


def test_empty_directory_and_wrong_path(tmp_path):
    _one_line_error(run_cli("ls", str(tmp_path)), 1, "no checkpoint found", str(tmp_path))
    _one_line_error(run_cli("verify", str(tmp_path / "nope")), 1, "no checkpoint found")
    with ftkit.Checkpointer({"w": torch.zeros(2)}, [str(tmp_path / "nope")], rng=False) as ck:
        assert ck.restore() == 0


def test_unknown_protocol():
    _one_line_error(run_cli("ls", "nosuchproto://bucket/x"), 2, "unknown storage protocol 'nosuchproto'")
    with pytest.raises(ftkit.StorageError, match="unknown storage protocol"):
        ftkit.Checkpointer({"w": torch.zeros(2)}, ["nosuchproto://bucket/x"])


def test_unreachable_s3_endpoint_is_a_clear_error_without_credentials():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    secret = "SuperSecret" + uuid.uuid4().hex
    opts = json.dumps(
        {"key": "AKIDEXAMPLE", "secret": secret, "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
    )
    r = run_cli("ls", "s3://bucket/prefix", "--storage-options", opts)
    _one_line_error(r, 1, "s3://bucket/prefix", "Could not connect")
    assert secret not in r.stderr + r.stdout
    env = {
        "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE",
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    r = run_cli("verify", "s3://bucket/prefix", env=env, timeout=120)
    _one_line_error(r, 1, "s3://bucket/prefix", "Could not connect")
    assert secret not in r.stderr + r.stdout


def test_an_s3_endpoint_that_never_answers_is_a_clear_error_at_the_deadline():
    """A server that accepts connections and never answers (a stopped one): a listing took half an
    hour (3 x 5 attempts x read_timeout), a write forever (botocore waits for "100 Continue"), and
    `ftkit ls` listed three times before it said so."""
    import socket

    from ftkit.tiers.storage import Storage

    def connections(server: socket.socket) -> int:  # made and waiting in the backlog, never answered
        server.setblocking(False)
        n = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                server.accept()[0].close()
                n += 1
        return n

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the connections; nobody reads or answers
        secret = "SuperSecret" + uuid.uuid4().hex
        endpoint = {"endpoint_url": f"http://127.0.0.1:{silent.getsockname()[1]}"}
        opts = {"key": "AKIDEXAMPLE", "secret": secret, "client_kwargs": endpoint, "deadline": 1}
        r = run_cli("ls", "s3://bucket/prefix", "--storage-options", json.dumps(opts))
        _one_line_error(r, 1, "listing s3://bucket/prefix", "no answer within 1 s (storage_options 'deadline')")
        assert secret not in r.stderr + r.stdout
        assert connections(silent) == 1  # one request, one deadline: the first failed listing ends it
        first = Storage("s3://bucket/prefix", opts)
        Storage("s3://bucket/other", {**opts, "deadline": 2})  # another tier of the same options: its own deadline
        with pytest.raises(ftkit.StorageError, match=r"^writing s3://bucket/prefix/step/x failed: .*within 1 s"):
            with first.open_write("step/x") as f:
                f.write(b"a data file under 64 MiB: one PUT")
    with pytest.raises(ftkit.StorageError, match="bad storage URL or options: could not convert"):
        Storage("s3://bucket/prefix", {**opts, "deadline": "soon"})


def test_state_with_a_lambda_is_refused_at_capture(tmp_path):
    ck = ftkit.Checkpointer({"model": torch.nn.Linear(2, 2), "cfg": {"schedule": lambda s: s}}, [str(tmp_path)])
    with pytest.raises(ftkit.CaptureError, match="'cfg/schedule'"):
        ck.snapshot(1)
    ck.close()
    assert committed_steps(ftkit.Tier(str(tmp_path)).open()) == []


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 1 MiB tmpfs, so ENOSPC comes from the kernel, not from a mock."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def test_full_disk_during_persist_keeps_previous_step(tiny_disk):
    state = {"w": torch.zeros(150_000)}  # 600 KB: one step fits in 1 MiB, two do not
    ck = ftkit.Checkpointer(state, [ftkit.Tier(str(tiny_disk), keep=2)], rng=False)
    try:
        state["w"].fill_(1)
        ck.snapshot(1)
        ck.wait()
        state["w"].fill_(2)
        ck.snapshot(2)
        with pytest.raises(ftkit.StorageError, match="no space left on device"):
            ck.wait()
        assert ck.stats.failed == 1
    finally:
        ck.close()
    assert committed_steps(ftkit.Tier(str(tiny_disk)).open()) == [1]
    leftovers = [p for p in tiny_disk.rglob("*") if p.is_file() and "step-000000000002" in str(p)]
    assert leftovers == []  # the partial write was cleaned up
    assert run_cli("verify", str(tiny_disk)).returncode == 0
    assert _restored_step_and_value(tiny_disk, numel=150_000) == (1, 1.0)


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "dcp"])
def test_restore_onto_a_full_disk_is_one_line_and_leaves_nothing(two_steps, tiny_disk, fmt):
    """The state (16 KB) does not fit in what is left of the disk: one line naming the file and
    the full disk, exit 1, and no partial file or directory left at --out."""
    (tiny_disk / "filler").write_bytes(b"\0" * (1024 * 1024 - 8 * 1024))
    out = tiny_disk / "out"
    r = run_cli("export" if fmt == "dcp" else "restore", str(two_steps), "--out", str(out), "--format", fmt)
    _one_line_error(r, 1, str(out))
    assert fmt == "dcp" or "the disk is full" in r.stderr
    assert sorted(p.name for p in tiny_disk.iterdir()) == ["filler"]


@pytest.mark.parametrize("link", ["manifest", "step directory"])
def test_verify_all_fails_on_a_step_that_ls_shows_as_a_link(two_steps, tmp_path, link):
    if link == "manifest":  # (ls: bad; the bytes are a good manifest's, elsewhere)
        manifest = _manifest(two_steps)
        manifest.rename(tmp_path / "elsewhere.json")
        manifest.symlink_to(tmp_path / "elsewhere.json")
    else:  # (ls: link)
        (two_steps / step_dir_name(3)).symlink_to(two_steps / step_dir_name(1))
    r = run_cli("verify", str(two_steps), "--all", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and doc["ok"] is False, r.stdout
    expected = [(1, True), (2, False)] if link == "manifest" else [(1, True), (2, True), (3, False)]
    assert [(s["step"], s["ok"]) for s in doc["steps"]] == expected
    assert [s for s in doc["steps"] if not s["ok"]][0]["error"].endswith(
        ("symbolic link; not following it", "links in a tier")
    )


def test_verify_all_reports_a_step_whose_read_fails_and_goes_on_to_the_others(two_steps, monkeypatch):
    """A storage error reading one step (EIO, a dropped connection) is that step's FAILED line:
    verify --all went no further, printed no --json document, and hid the other steps' verdicts."""
    from ftkit.errors import StorageError
    from ftkit.tiers.storage import Storage

    real = Storage.open_read

    def open_read(self, rel):
        if rel.startswith(step_dir_name(1)) and rel.endswith(".data"):
            raise StorageError(f"reading {self.where(rel)} failed: OSError: [Errno 5] Input/output error")
        return real(self, rel)

    monkeypatch.setattr(Storage, "open_read", open_read)
    r = run_cli("verify", str(two_steps), "--all", "--json")
    assert r.returncode == 1 and r.stderr == "", r.stderr
    steps = json.loads(r.stdout)["steps"]
    assert [s["ok"] for s in steps] == [False, True] and "Input/output error" in steps[0]["error"], steps


def test_verify_refuses_a_step_together_with_all(two_steps):
    r = run_cli("verify", str(two_steps), "--step", "1", "--all")
    _one_line_error(r, 2, "--all", "not both")
    _one_line_error(run_cli("verify", str(two_steps / step_dir_name(1)), "--all"), 2, "--all", "not both")


def test_restore_force_never_writes_over_a_file_of_the_tier_it_reads(two_steps, tmp_path):
    manifest = _manifest(two_steps)
    before = manifest.read_bytes()
    r = run_cli("restore", str(two_steps), "--step", "1", "--out", str(manifest), "--force")
    _one_line_error(r, 2, "inside the checkpoint tier")  # (a usage error, as other --out problems)
    assert manifest.read_bytes() == before and run_cli("verify", str(two_steps), "--all").returncode == 0
    (tmp_path / "adir").mkdir()
    _one_line_error(run_cli("restore", str(two_steps), "--out", str(tmp_path / "adir"), "--force"), 2, "is a directory")


def test_a_data_file_gone_between_its_size_check_and_its_read_is_that_steps_corruption(two_steps, monkeypatch):
    """A gc or another job's retention removes step 2 while a restore reads it: the restore
    goes on to step 1 (a FileNotFoundError escaped it before)."""
    import ftkit.format.data as data

    checked = data.check_file_sizes

    def check_then_lose(storage, manifest, *args, **kwargs):
        checked(storage, manifest, *args, **kwargs)
        if manifest.step == 2:
            _data_file(two_steps).unlink()

    monkeypatch.setattr(data, "check_file_sizes", check_then_lose)
    assert _restored_step_and_value(two_steps) == (1, 1.0)


def test_report_html_to_a_path_that_cannot_be_written_is_one_line(tmp_path):
    events = tmp_path / "run" / "events"
    events.mkdir(parents=True)
    (events / "rank-00000.jsonl").write_text('{"t": 1.0, "rank": 0, "event": "step", "step": 1}\n[1, 2]\n{"t": "x"}\n')
    (events / "odd.jsonl").mkdir()  # not a file: skipped, as are the lines that are not events
    r = run_cli("report", str(tmp_path / "run"), "--html", str(tmp_path / "missing" / "x.html"))
    _one_line_error(r, 1, "x.html: cannot write the timeline")
    assert run_cli("report", str(tmp_path / "run")).returncode == 0


@pytest.mark.parametrize(
    "bad",
    [
        '{"t": 2, "rank": 0, "event": "step"}',
        '{"t": 2, "rank": 0, "event": "step", "step": "5"}',
        '{"t": 2, "rank": "0", "event": "detect"}',
        '{"t": 2, "rank": 0, "attempt": "1", "event": "start"}',
        '{"t": 2, "rank": 0, "event": "snapshot", "stall_s": null}',
        '{"t": 2, "rank": 0, "event": "straggler", "target": 1}',
        '{"t": 2, "rank": 0, "event": "start", "boot": [1]}',
        '{"t": 2, "rank": 0, "event": 7}',
        '{"t": 2, "rank": 0, "event": "detect", "target": 1}',
        "[" * 100000,  # (json: RecursionError)
        '{"t": 2, "rank": 0, "event": "step", "step": ' + "9" * 5000 + "}",  # (int(): ValueError)
    ],
)
def test_report_skips_an_event_with_a_field_missing_or_mistyped_and_counts_it(tmp_path, bad):
    events = tmp_path / "run" / "events"
    events.mkdir(parents=True)
    good = ['{"t": 1.0, "rank": 0, "event": "step", "step": 1}', '{"t": 3.0, "rank": 0, "event": "step", "step": 2}']
    (events / "rank-00000.jsonl").write_text("\n".join([good[0], bad, good[1]]) + "\n")
    r = run_cli("report", str(tmp_path / "run"), "--html", str(tmp_path / "timeline.html"))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "final step 2" in r.stdout and "skipped 1 unreadable event line(s)" in r.stdout, r.stdout
    assert json.loads(run_cli("report", str(tmp_path / "run"), "--json").stdout)["skipped_lines"] == 1
    (events / "rank-00000.jsonl").write_text(bad + "\n")
    _one_line_error(
        run_cli("report", str(tmp_path / "run")), 1, "the event log is empty (1 unreadable line(s) skipped)"
    )


def test_report_of_a_restart_skips_a_detect_event_without_its_verdict(tmp_path):
    events = tmp_path / "run" / "events"
    events.mkdir(parents=True)
    lines = [
        '{"t": 1.0, "rank": 0, "event": "step", "step": 1}',
        '{"t": 2.0, "rank": 0, "event": "detect", "target": 0}',  # (KeyError: 'what')
        '{"t": 3.0, "rank": 0, "attempt": 1, "event": "start"}',
        '{"t": 4.0, "rank": 0, "attempt": 1, "event": "step", "step": 2}',
    ]
    (events / "rank-00000.jsonl").write_text("\n".join(lines) + "\n")
    r = run_cli("report", str(tmp_path / "run"))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "skipped 1 unreadable event line(s)" in r.stdout and "torchrun agent" in r.stdout, r.stdout


@pytest.mark.parametrize("key", [[{"a": 1}], {"$tuple": [[1]]}, {"$tuple": [{"b": 2}]}, {"x": 1}])
def test_a_crafted_dict_key_that_cannot_be_a_key_is_a_corrupt_step_and_restore_falls_back(tmp_path, key):
    """A skeleton `$items` key that decodes to something unhashable (a dict in a list, a list in a
    tuple): validation refuses the step (restore raised TypeError from the decode before)."""
    root = tmp_path / "ckpt"
    state = {"w": torch.zeros(8), "seen": {1: "one"}}
    with ftkit.Checkpointer(state, [ftkit.Tier(str(root), keep=5)], rng=False) as ck:
        for step in (1, 2):
            state["w"].fill_(step)
            ck.snapshot(step)

    def craft(doc):
        doc["skeleton"]["entries"]["seen"]["value"] = {"$items": [[key, "one"]]}

    _edit_manifest(root, craft)
    back = {"w": torch.zeros(8), "seen": {}}
    with ftkit.Checkpointer(back, [str(root)], rng=False) as ck:
        assert ck.restore() == 1
    assert back["seen"] == {1: "one"} and float(back["w"][0]) == 1.0
    assert run_cli("verify", str(root)).returncode == 1


@pytest.mark.parametrize("value", ["0", "two", "-4"])
def test_a_bad_ranks_per_node_is_one_line_naming_the_variable(tmp_path, monkeypatch, value):
    monkeypatch.setenv("FTKIT_RANKS_PER_NODE", value)
    with pytest.raises(ftkit.FtkitError, match=rf"FTKIT_RANKS_PER_NODE='{value}': not a whole number"):
        ftkit.Checkpointer({"w": torch.zeros(3)}, [str(tmp_path / "ckpt")], rng=False)


def test_a_run_directory_that_is_a_file_never_stops_training_and_is_a_usage_error_for_ftkit_run(tmp_path, caplog):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    with caplog.at_level("ERROR", logger="ftkit"):
        with ftkit.Checkpointer({"w": torch.ones(3)}, [str(tmp_path / "ckpt")], rng=False, run_dir=str(afile)) as ck:
            ck.snapshot(1)
    assert committed_steps(ftkit.Tier(str(tmp_path / "ckpt")).open()) == [1]
    assert any("cannot write the event log" in r.getMessage() for r in caplog.records)
    script = tmp_path / "train.py"
    script.write_text("")
    _one_line_error(run_cli("run", "--run-dir", str(afile), str(script)), 2, f"--run-dir {afile}")


def test_ftkit_run_of_a_script_that_does_not_exist_is_a_usage_error(tmp_path):
    # (torchrun would start it, and restart it with a traceback each time)
    missing = str(tmp_path / "missing.py")
    _one_line_error(run_cli("run", "--run-dir", str(tmp_path / "run"), missing), 2, f"no such script: {missing}")
    assert not (tmp_path / "run").exists()


def test_a_malformed_preemption_step_in_the_store_is_a_format_error_naming_the_key():
    import torch.distributed as dist

    from ftkit.coord.preemption import _raise_to

    store = dist.HashStore()
    store.set("preempt/stop", "banana")
    with pytest.raises(ftkit.FormatError, match=r"store key 'preempt/stop' holds 'banana', not a step number"):
        _raise_to(store, "preempt/stop", 5)
    store.set("preempt/stop", "3")
    _raise_to(store, "preempt/stop", 5)
    assert store.get("preempt/stop") == b"5"

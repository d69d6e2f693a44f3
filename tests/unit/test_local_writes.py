"""Local atomic writes (tiers/storage.py, tiers/localfs.py): fsynced where that makes them
durable, not in memory (the RAM tier's tmpfs), where an fsync only costs; whole either way."""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest

from ftkit.errors import StorageError
from ftkit.tiers.localfs import on_volatile_fs
from ftkit.tiers.storage import Storage


def _fs_type(path: str) -> str:
    """The filesystem type as coreutils' stat tells it (an oracle independent of ours)."""
    return subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def fsyncs(monkeypatch):
    calls: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    return calls


def _write_both_ways(storage: Storage) -> None:
    storage.write_bytes_atomic("step/small.json", b'{"a":1}')
    with storage.open_write("step/big.data") as f:
        f.write(b"x" * 3_000_000)
    assert storage.fs.cat_file(storage.path("step/small.json")) == b'{"a":1}'
    assert storage.fs.cat_file(storage.path("step/big.data")) == b"x" * 3_000_000
    assert not [n for n in os.listdir(storage.path("step")) if ".tmp-" in n]


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or _fs_type("/dev/shm") != "tmpfs", reason="no tmpfs at /dev/shm")
def test_in_memory_nothing_is_fsynced_and_writes_stay_whole(fsyncs):
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        assert on_volatile_fs(d) and on_volatile_fs(os.path.join(d, "not", "made", "yet"))
        storage = Storage(d)
        assert not storage.sync
        _write_both_ways(storage)
    assert fsyncs == []


def test_on_a_disk_every_write_and_its_directory_are_fsynced(tmp_path, fsyncs):
    if _fs_type(str(tmp_path)) in ("tmpfs", "ramfs"):
        pytest.skip("the test's directory is in memory here")
    assert not on_volatile_fs(str(tmp_path))
    storage = Storage(str(tmp_path))
    assert storage.sync
    _write_both_ways(storage)
    assert len(fsyncs) >= 4  # each file and its directory


def test_a_write_whose_rename_fails_leaves_no_temporary_file_and_the_target_untouched(tmp_path):
    storage = Storage(str(tmp_path))
    (tmp_path / "step" / "part.json").mkdir(parents=True)  # a directory in the way: rename fails
    (tmp_path / "step" / "part.json" / "keep").write_bytes(b"good")
    with pytest.raises(StorageError, match="part.json"), storage.open_write("step/part.json") as f:
        f.write(b"new")
    assert sorted(os.listdir(tmp_path / "step")) == ["part.json"]
    assert (tmp_path / "step" / "part.json" / "keep").read_bytes() == b"good"


def test_a_file_removed_while_its_directory_is_listed_is_not_listed(tmp_path, monkeypatch):
    storage = Storage(str(tmp_path))
    for name in ("a.data", "b.data"):
        storage.write_bytes_atomic(f"step/{name}", b"12345")
    listed = Storage._scandir

    def then_retention_removes_b(self, rel):  # the race: listed, then deleted before its size is read
        entries = listed(self, rel)
        os.remove(tmp_path / "step" / "b.data")
        return entries

    monkeypatch.setattr(Storage, "_scandir", then_retention_removes_b)
    assert storage.list_sizes("step") == {"a.data": 5}

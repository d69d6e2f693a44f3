"""Local reads: a step's chunks read as spans on several threads (format/data.py _read_local)."""

from __future__ import annotations

import threading

import pytest
import torch

import ftkit
import ftkit.save.write as write_mod
from ftkit.errors import CorruptCheckpointError
from ftkit.format import data
from ftkit.format.data import read_regions, read_tensors
from ftkit.format.manifest import step_dir_name
from ftkit.format.reader import load_manifest


@pytest.fixture
def many_spans(tmp_path, monkeypatch):
    """A step of 4 KiB chunks on a local tier, read as 12 KiB spans by 4 threads."""
    monkeypatch.setattr(write_mod, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(data, "LOCAL_SPAN_BYTES", 3 * 4096)
    monkeypatch.setattr(data, "LOCAL_THREADS", 4)
    torch.manual_seed(0)
    state = {"w": torch.randn(256, 256), "b": torch.randn(3000), "i": torch.arange(5000), "e": torch.zeros(0)}
    with ftkit.Checkpointer(state, [str(tmp_path)], rng=False) as ck:
        ck.snapshot(1)
    storage = ftkit.Tier(str(tmp_path)).open()
    return state, storage, load_manifest(storage, 1)


def test_a_step_read_in_spans_on_several_threads_is_exact(many_spans, monkeypatch):
    state, storage, manifest = many_spans
    readers: set[str] = set()
    real = data._read_chunk

    def noting(*args, **kwargs):
        readers.add(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(data, "_read_chunk", noting)
    progress: list[int] = []
    got = read_tensors(storage, manifest, progress=progress.append)
    assert {n.rsplit("/", 1)[-1] for n in got} == set(state)
    for name, t in got.items():
        assert torch.equal(t, state[name.rsplit("/", 1)[-1]]), name
    assert readers and all(r.startswith("ftkit-read") for r in readers)  # the pool read them, not this thread
    assert sum(progress) == sum(c.raw_length for e in manifest.tensors for s in e.shards for c in s.chunks)
    # A region of one tensor touches only its chunks, on the same path.
    (w,) = [e.name for e in manifest.tensors if e.name.endswith("w")]
    part = read_regions(storage, manifest, {w: ((100, 0), (60, 256))})
    assert torch.equal(part[w], state["w"][100:160])


def test_a_corrupt_chunk_read_on_a_pool_thread_is_reported_with_its_file(many_spans):
    _, storage, manifest = many_spans
    (fname,) = [f for f in manifest.files if manifest.files[f]["bytes"] > 100_000]
    path = storage.path(f"{step_dir_name(1)}/{fname}")
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0x01
    open(path, "wb").write(raw)
    with pytest.raises(CorruptCheckpointError, match=rf"{fname}.*checksum mismatch"):
        read_tensors(storage, manifest)

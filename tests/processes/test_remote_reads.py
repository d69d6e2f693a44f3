"""Reads from object stores: a file's chunks fetched as spans of neighbouring chunks,
several spans at once (format/data.py chunk_bytes), so a state of many small tensors
costs a few requests, not one round trip per tensor."""

from __future__ import annotations

import uuid

import pytest
import torch

import ftkit
import ftkit.save.write as write_mod
from ftkit.errors import CorruptCheckpointError
from ftkit.format import data
from ftkit.format.data import chunk_bytes, read_regions, verify
from ftkit.format.manifest import Chunk, step_dir_name
from ftkit.format.reader import load_manifest
from ftkit.tiers.storage import Storage


def _chunk(offset: int, length: int) -> Chunk:
    return Chunk("f.data", offset, length, 0, length, "raw", "xxh3_64:" + "0" * 16)


def test_neighbouring_chunks_share_a_span_within_its_limits(monkeypatch):
    monkeypatch.setattr(data, "SPAN_BYTES", 100)
    monkeypatch.setattr(data, "SPAN_GAP", 10)
    chunks = [
        _chunk(0, 30),
        _chunk(30, 30),  # adjacent: same span
        _chunk(65, 30),  # a gap of 5: same span (0..95)
        _chunk(95, 10),  # would make the span 105 bytes: a new one
        _chunk(200, 10),  # a gap of 95: a new one
        _chunk(210, 500),  # bigger than a span by itself: its own
        _chunk(710, 5),
    ]
    assert data._spans(chunks) == [
        (0, 95, [0, 1, 2]),
        (95, 105, [3]),
        (200, 210, [4]),
        (210, 710, [5]),
        (710, 715, [6]),
    ]


def _memory_storage(payload: bytes) -> tuple[Storage, str]:
    storage = Storage(f"memory://ftkit-test-{uuid.uuid4().hex}")
    storage.write_bytes_atomic("s/f.data", payload)
    return storage, "s/f.data"


def test_chunk_bytes_gives_each_chunks_own_bytes_across_spans_and_batches(monkeypatch):
    monkeypatch.setattr(data, "SPAN_BYTES", 64)
    monkeypatch.setattr(data, "BATCH_BYTES", 128)  # a few spans per batch: several batches
    payload = bytes(range(256)) * 8
    storage, rel = _memory_storage(payload)
    assert not storage.is_local
    chunks = [_chunk(off, n) for off, n in [(0, 16), (16, 40), (100, 7), (107, 60), (400, 300), (1500, 1)]]
    requested: list[list[tuple[int, int]]] = []
    real = Storage.read_ranges

    def counting(self, rel, ranges):
        requested.append(list(ranges))
        return real(self, rel, ranges)

    monkeypatch.setattr(Storage, "read_ranges", counting)
    got = {i: bytes(b) for i, b in chunk_bytes(storage, rel, chunks)}
    assert got == {i: payload[c.offset : c.offset + c.length] for i, c in enumerate(chunks)}
    spans = [r for batch in requested for r in batch]
    assert len(spans) < len(chunks) and len(requested) > 1
    assert all(sum(b - a for a, b in batch) <= 128 or len(batch) == 1 for batch in requested)


def test_a_file_cut_short_under_a_span_is_truncation():
    storage, rel = _memory_storage(b"x" * 100)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        list(chunk_bytes(storage, rel, [_chunk(0, 50), _chunk(50, 60)]))


def test_a_region_of_a_many_chunk_tensor_reads_exactly_from_an_object_store(monkeypatch):
    monkeypatch.setattr(write_mod, "CHUNK_BYTES", 4096)  # a 256 KiB tensor in 64 chunks
    monkeypatch.setattr(data, "SPAN_BYTES", 20000)
    monkeypatch.setattr(data, "BATCH_BYTES", 50000)
    w = torch.randn(256, 256)
    url = f"memory://ftkit-test-{uuid.uuid4().hex}"
    with ftkit.Checkpointer({"w": w, "b": torch.arange(10)}, [ftkit.Tier(url)], rng=False) as ck:
        ck.snapshot(3)
    storage = Storage(url)
    manifest = load_manifest(storage, 3)
    (entry,) = [t for t in manifest.tensors if t.name.endswith("w")]
    assert sum(len(s.chunks) for s in entry.shards) == 64
    got = read_regions(storage, manifest, {entry.name: ((100, 0), (60, 256))})
    assert torch.equal(got[entry.name], w[100:160])
    verify(storage, manifest)


def test_a_state_of_many_small_tensors_round_trips_through_s3_in_few_requests(s3_server, s3_url, monkeypatch):
    monkeypatch.setattr(data, "SPAN_BYTES", 64 * 1024)  # several spans and batches even for a small state
    monkeypatch.setattr(data, "BATCH_BYTES", 128 * 1024)
    state = {f"t{i:02d}": torch.randn(97 * (i + 1)) for i in range(40)}
    state["empty"] = torch.zeros(0)
    state["ints"] = torch.arange(1000, dtype=torch.int64)
    tier = ftkit.Tier(s3_url, storage_options=s3_server.storage_options())
    with ftkit.Checkpointer(state, [tier], rng=False) as ck:
        ck.snapshot(1)
    requests = []
    real = Storage.read_ranges

    def counting(self, rel, ranges):
        requests.extend(ranges)
        return real(self, rel, ranges)

    monkeypatch.setattr(Storage, "read_ranges", counting)
    fresh = {k: torch.zeros_like(v) for k, v in state.items()}
    with ftkit.Checkpointer(fresh, [tier], rng=False) as ck:
        assert ck.restore() == 1
    assert all(torch.equal(fresh[k], state[k]) for k in state)
    assert 1 < len(requests) < len(state) // 4  # ~330 kB in spans of neighbours, not a request a tensor
    # A flipped byte in the middle of a span is still the chunk's checksum mismatch.
    storage = tier.open()
    manifest = load_manifest(storage, 1)
    rel = f"{step_dir_name(1)}/{next(iter(manifest.files))}"
    raw = bytearray(storage.fs.cat_file(storage.path(rel)))
    raw[len(raw) // 2] ^= 0x01
    storage.write_bytes_atomic(rel, bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        verify(storage, manifest)

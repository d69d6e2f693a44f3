"""Chunk encoding: checksums and optional zstd, decided per chunk.

Checksums are xxh3_64 over the *stored* bytes (after compression), so `verify`
needs no decompression and catches any flipped byte on storage. Compression is
zstd, multi-threaded, skipped per chunk where it does not pay: a cheap probe of
the chunk's head decides, so incompressible fp32 noise costs a probe, not a full
compression pass at a third of disk speed.
"""

from __future__ import annotations

import logging
import os
import threading

import xxhash
import zstandard

from ftkit.errors import CorruptCheckpointError

CHECKSUM_ALGO = "xxh3_64"
_PROBE_BYTES = 256 * 1024
_WORTH_IT = 0.90  # compress only if the probe shrinks to at most this fraction
_local = threading.local()
log = logging.getLogger("ftkit")


def checksum(data) -> str:
    return f"{CHECKSUM_ALGO}:{xxhash.xxh3_64_hexdigest(data)}"


# Test hook, never for production: drills set it to prove that their bitwise
# comparison catches what checksums would have caught. Read once, at import;
# honoured only by restores (never by `ftkit verify`), with a warning every time.
UNSAFE_SKIP_CHECKSUMS = os.environ.get("FTKIT_UNSAFE_SKIP_CHECKSUMS") == "1"


def skipping_checksums(where: str) -> bool:
    """Whether this read may skip checksums (FTKIT_UNSAFE_SKIP_CHECKSUMS=1); warns when so."""
    if UNSAFE_SKIP_CHECKSUMS:
        log.warning(
            "ftkit: FTKIT_UNSAFE_SKIP_CHECKSUMS=1: reading %s WITHOUT verifying checksums (a test hook; unset it)",
            where,
        )
    return UNSAFE_SKIP_CHECKSUMS


def check(data, expected: str, where: str, skip: bool = False) -> None:
    """Raise CorruptCheckpointError unless `data` hashes to `expected`; `skip` (from
    skipping_checksums) checks only the algorithm name."""
    algo, _, _ = expected.partition(":")
    if algo != CHECKSUM_ALGO:
        raise CorruptCheckpointError(f"{where}: unknown checksum algorithm {algo!r}")
    if skip:
        return
    got = checksum(data)
    if got != expected:
        raise CorruptCheckpointError(f"{where}: checksum mismatch (stored bytes are corrupt)")


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # One compressor per thread: zstandard objects are not thread-safe.
    key = f"c{level}"
    c = getattr(_local, key, None)
    if c is None:
        threads = max(1, min(4, (os.cpu_count() or 1)))
        c = zstandard.ZstdCompressor(level=level, threads=threads if threads > 1 else 0)
        setattr(_local, key, c)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


def encode(raw: memoryview, compress: str | None, level: int = 1) -> tuple[str, memoryview | bytes]:
    """Return (codec, stored bytes) for one chunk of raw bytes."""
    if compress != "zstd" or len(raw) < 4096:
        return "raw", raw
    comp = _compressor(level)
    probe = raw[:_PROBE_BYTES]
    if len(probe) < len(raw) and len(comp.compress(probe)) > _WORTH_IT * len(probe):
        return "raw", raw
    out = comp.compress(raw)
    if len(out) > _WORTH_IT * len(raw):
        return "raw", raw
    return "zstd", out


def decode_into(codec: str, stored, dest: memoryview, where: str) -> None:
    """Decode one chunk's stored bytes into `dest` (exactly its raw length)."""
    if codec == "raw":
        if len(stored) != len(dest):
            raise CorruptCheckpointError(f"{where}: chunk holds {len(stored)} bytes, expected {len(dest)}")
        dest[:] = stored
        return
    if codec == "zstd":
        try:
            out = _decompressor().decompress(stored, max_output_size=len(dest))
        except zstandard.ZstdError as e:
            raise CorruptCheckpointError(f"{where}: zstd frame does not decode ({e})") from None
        if len(out) != len(dest):
            raise CorruptCheckpointError(f"{where}: chunk decodes to {len(out)} bytes, expected {len(dest)}")
        dest[:] = out
        return
    raise CorruptCheckpointError(f"{where}: unknown codec {codec!r}")

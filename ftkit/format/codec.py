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


# Test hook, never for production: drills set FTKIT_UNSAFE_SKIP_CHECKSUMS=1 to prove that
# their bitwise comparison catches what checksums would have caught. It takes two keys: the
# variable (read once, at import) and a call to allow_skipping_checksums() in the process's
# own code (the drills' reference trainer makes it), so a variable left in an ordinary
# training job's environment skips nothing. `ftkit verify` never skips.
_SKIP_REQUESTED = os.environ.get("FTKIT_UNSAFE_SKIP_CHECKSUMS") == "1"
_skip_allowed = False
_skip_ignored_said = False


def allow_skipping_checksums() -> None:
    """Let FTKIT_UNSAFE_SKIP_CHECKSUMS=1 take effect in this process (the drills' own trainer only)."""
    global _skip_allowed
    _skip_allowed = True


def skip_active() -> bool:
    """Whether reads in this process skip checksums (requested and allowed)."""
    return _SKIP_REQUESTED and _skip_allowed


def skipping_checksums(where: str) -> bool:
    """Whether this read skips checksums: FTKIT_UNSAFE_SKIP_CHECKSUMS=1 in a process that
    allowed it (warns every time); the variable alone is ignored, with a warning once."""
    global _skip_ignored_said
    if not _SKIP_REQUESTED:
        return False
    if not _skip_allowed:
        if not _skip_ignored_said:
            _skip_ignored_said = True
            log.warning(
                "ftkit: FTKIT_UNSAFE_SKIP_CHECKSUMS=1 is ignored: only the drills' own trainer may skip checksums"
            )
        return False
    log.warning(
        "ftkit: FTKIT_UNSAFE_SKIP_CHECKSUMS=1: reading %s WITHOUT verifying checksums (a drill hook; unset it)",
        where,
    )
    return True


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


DECODE_STEP = 1 << 20  # a zstd chunk is decoded (or checked) this many bytes at a time


def decode_into(codec: str, stored, dest: memoryview, where: str) -> None:
    """Decode one chunk's stored bytes into `dest` (exactly its raw length).

    A zstd frame is decoded straight into `dest`, in steps, and must end exactly
    there: nothing is allocated on the frame's or the manifest's word."""
    if codec == "raw":
        if len(stored) != len(dest):
            raise CorruptCheckpointError(f"{where}: chunk holds {len(stored)} bytes, expected {len(dest)}")
        dest[:] = stored
        return
    if codec == "zstd":
        _zstd_stream(stored, len(dest), where, dest)
        return
    raise CorruptCheckpointError(f"{where}: unknown codec {codec!r}")


def check_decodes(codec: str, stored, raw_length: int, where: str) -> None:
    """That one chunk's stored bytes decode to exactly `raw_length` bytes, holding at most
    DECODE_STEP of them at a time (`ftkit verify`, gc: they keep nothing)."""
    if codec == "raw":
        if len(stored) != raw_length:
            raise CorruptCheckpointError(f"{where}: chunk holds {len(stored)} bytes, expected {raw_length}")
        return
    if codec == "zstd":
        _zstd_stream(stored, raw_length, where, None)
        return
    raise CorruptCheckpointError(f"{where}: unknown codec {codec!r}")


def _zstd_stream(stored, raw_length: int, where: str, dest: memoryview | None) -> None:
    """Decode one zstd frame in steps of DECODE_STEP: into `dest`, or into a scratch buffer
    that is thrown away; the frame must yield exactly `raw_length` bytes."""
    scratch = None if dest is not None else memoryview(bytearray(min(DECODE_STEP, max(raw_length, 1))))
    got = 0
    try:
        with _decompressor().stream_reader(stored, read_across_frames=False) as reader:
            while got < raw_length:
                want = min(DECODE_STEP, raw_length - got)
                target = dest[got : got + want] if dest is not None else scratch[:want]  # type: ignore[index]
                n = reader.readinto(target)
                if not n:
                    break
                got += n
            extra = reader.read(1) if got == raw_length else b""
    except zstandard.ZstdError as e:
        raise CorruptCheckpointError(f"{where}: zstd frame does not decode ({e})") from None
    if got != raw_length or extra:
        shown = f"more than {raw_length}" if extra else str(got)
        raise CorruptCheckpointError(f"{where}: chunk decodes to {shown} bytes, expected {raw_length}")

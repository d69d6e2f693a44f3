"""Chunk encoding: checksums and optional zstd, decided per chunk.

Checksums are xxh3_64 over the stored (compressed) bytes, so verifying needs no
decompression. zstd is skipped where a probe of the chunk's head shows it does not pay.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import xxhash
import zstandard

from ftkit.errors import CorruptCheckpointError

CHECKSUM_ALGO = "xxh3_64"
_PROBE_BYTES = 256 * 1024
_WORTH_IT = 0.90  # compress only if the probe shrinks to at most this fraction
_local = threading.local()
_ZSTD_THREADS = min(4, os.cpu_count() or 1) if (os.cpu_count() or 1) > 1 else 0  # 0: no worker threads
log = logging.getLogger("ftkit")


def checksum(data) -> str:
    return f"{CHECKSUM_ALGO}:{xxhash.xxh3_64_hexdigest(data)}"


# A drill hook, never for production: FTKIT_UNSAFE_SKIP_CHECKSUMS=1 (read at import) takes
# effect only once the process's own code calls allow_skipping_checksums(), so a variable left
# in a training job's environment skips nothing. `ftkit verify` never skips.
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
    if checksum(data) != expected:
        raise CorruptCheckpointError(f"{where}: checksum mismatch (stored bytes are corrupt)")


def _per_thread(key: str, make: Callable[[], Any]) -> Any:
    # One zstandard object per thread and kind: they are not thread-safe.
    obj = getattr(_local, key, None)
    if obj is None:
        obj = make()
        setattr(_local, key, obj)
    return obj


def encode(raw: memoryview, compress: str | None) -> tuple[str, memoryview | bytes]:
    """Return (codec, stored bytes) for one chunk of raw bytes (zstd at level 1: fast)."""
    if compress != "zstd" or len(raw) < 4096:
        return "raw", raw
    comp = _per_thread("c", lambda: zstandard.ZstdCompressor(level=1, threads=_ZSTD_THREADS))
    probe = raw[:_PROBE_BYTES]
    if len(probe) < len(raw) and len(comp.compress(probe)) > _WORTH_IT * len(probe):
        return "raw", raw
    out = comp.compress(raw)
    if len(out) > _WORTH_IT * len(raw):
        return "raw", raw
    return "zstd", out


DECODE_STEP = 1 << 20  # a zstd chunk is decoded (or checked) this many bytes at a time


def decode(codec: str, stored, raw_length: int, where: str, dest: memoryview | None = None) -> None:
    """Decode one chunk's stored bytes into `dest` (None: only check), which must yield exactly
    `raw_length` bytes; nothing is allocated on the frame's or the manifest's word."""
    if codec == "raw":
        if len(stored) != raw_length:
            raise CorruptCheckpointError(f"{where}: chunk holds {len(stored)} bytes, expected {raw_length}")
        if dest is not None:
            dest[:] = stored
        return
    if codec != "zstd":
        raise CorruptCheckpointError(f"{where}: unknown codec {codec!r}")
    # One zstd frame, DECODE_STEP bytes at a time, into `dest` or a scratch buffer.
    scratch = None if dest is not None else memoryview(bytearray(min(DECODE_STEP, max(raw_length, 1))))
    got = 0
    try:
        with _per_thread("d", zstandard.ZstdDecompressor).stream_reader(stored, read_across_frames=False) as reader:
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

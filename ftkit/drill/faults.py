"""Storage faults for drills: ``faulty:///abs/path`` behaves like /abs/path, plus the faults
switched on in /abs/path/.ftkit-faults.json (re-read on every call, so a drill can flip them):

    "enospc": true         every write fails with ENOSPC (a full disk)
    "unavailable": true    every operation fails with ConnectionError (an outage)
    "latency_s": 0.2       every write call sleeps this long first
    "torn_write": true     data files keep only their first half, silently
    "bitflip": true        one bit of every data file written is flipped, silently

Torn writes and bit flips happen after the writer thinks it succeeded: checksums and size
checks must catch them on the way back. fsspec knows ``faulty://`` only where :func:`register`
ran (the drills' reference trainer, the tests); ftkit's storage code knows nothing of it.
"""

from __future__ import annotations

import errno
import io
import json
import os
import time
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

CONTROL = ".ftkit-faults.json"


def set_faults(root: str, **faults: Any) -> None:
    """Switch faults on (or off with {}) for the faulty:// filesystem rooted at `root`."""
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, CONTROL + ".tmp")
    with open(tmp, "w") as f:
        json.dump({k: v for k, v in faults.items() if v}, f)
    os.replace(tmp, os.path.join(root, CONTROL))


class FaultyFileSystem(fsspec.AbstractFileSystem):
    protocol = ("faulty",)
    root_marker = "/"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.local = LocalFileSystem()

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        path = path.removeprefix("faulty://")
        return "/" + path.lstrip("/") if path else "/"

    def _faults(self, path: str) -> dict[str, Any]:
        d = Path(path if os.path.isdir(path) else os.path.dirname(path))
        for ctl in (p / CONTROL for p in (d, *d.parents)):
            if ctl.exists():
                try:
                    return json.loads(ctl.read_text())
                except (OSError, json.JSONDecodeError):
                    return {}
        return {}

    def _gate(self, path: str, writing: bool) -> dict[str, Any]:
        faults = self._faults(path)
        if faults.get("unavailable"):
            raise ConnectionError(f"storage unavailable (injected) at {path}")
        if writing:
            if faults.get("latency_s"):
                time.sleep(float(faults["latency_s"]))
            if faults.get("enospc"):
                raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
        return faults

    def ls(self, path, detail=True, **kwargs):
        self._gate(path, False)
        out = self.local.ls(path, detail=detail, **kwargs)
        return [e for e in out if not (e["name"] if detail else e).endswith(CONTROL)]

    def info(self, path, **kwargs):
        self._gate(path, False)
        return self.local.info(path, **kwargs)

    def exists(self, path, **kwargs):
        self._gate(path, False)
        return self.local.exists(path)

    def cat_file(self, path, start=None, end=None, **kwargs):
        self._gate(path, False)
        return self.local.cat_file(path, start=start, end=end)

    def pipe_file(self, path, value, **kwargs):
        self._gate(path, True)
        self.local.makedirs(os.path.dirname(path), exist_ok=True)
        self.local.pipe_file(path, value)

    def makedirs(self, path, exist_ok=False):
        self._gate(path, True)
        self.local.makedirs(path, exist_ok=exist_ok)

    def rm(self, path, recursive=False, maxdepth=None):
        self._gate(path, True)
        self.local.rm(path, recursive=recursive, maxdepth=maxdepth)

    def _open(self, path, mode="rb", **kwargs):
        if "r" in mode:
            self._gate(path, False)
            return open(path, mode)
        faults = self._gate(path, True)
        self.local.makedirs(os.path.dirname(path), exist_ok=True)
        return _FaultyWriter(path, faults, self)


class _FaultyWriter(io.RawIOBase):
    """Buffers a file's bytes, then writes them, damaged as the faults say, on close."""

    def __init__(self, path: str, faults: dict[str, Any], fs: FaultyFileSystem):
        self.path, self.faults, self.fs = path, faults, fs
        self.buf = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.fs._gate(self.path, True)
        self.buf += bytes(data)
        return len(data)

    def close(self) -> None:
        if self.closed:
            return
        data = self.buf
        if self.path.endswith(".data"):
            if self.faults.get("torn_write"):
                data = data[: len(data) // 2]
            if self.faults.get("bitflip") and data:
                data = bytearray(data)
                data[len(data) // 2] ^= 0x10
        with open(self.path, "wb") as f:
            f.write(data)
        super().close()


def register() -> None:
    """Make ``faulty://`` URLs open a FaultyFileSystem in this process (idempotent)."""
    fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)

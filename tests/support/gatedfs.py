"""A test filesystem: fsspec's memory filesystem whose writes wait on a gate.

Lets a test hold the background persist at a known point (both staging slots
busy) without sleeping and hoping.
"""

from __future__ import annotations

import threading

import fsspec
from fsspec.implementations.memory import MemoryFileSystem


class GatedFileSystem(MemoryFileSystem):
    protocol = ("gated",)
    root_marker = "/"
    store: dict = {}
    pseudo_dirs = [""]
    gate = threading.Event()
    entered = threading.Semaphore(0)

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode:
            self.entered.release()
            if not self.gate.wait(timeout=60):
                raise TimeoutError("gate never opened")
        return super()._open(path, mode, **kwargs)

    def pipe_file(self, path, value, **kwargs):
        if not self.gate.wait(timeout=60):
            raise TimeoutError("gate never opened")
        return super().pipe_file(path, value, **kwargs)


fsspec.register_implementation("gated", GatedFileSystem, clobber=True)

"""Ending a step's life on a tier: delete it (retention, ``ftkit gc``), or retire it (restore).

A step newer than the one a run restored belongs to a future the run has left: retiring
renames its manifest to ``manifest.retired.json``, so no reader sees the step and the run
can write that number afresh, while its bytes stay until retention or ``ftkit gc`` (an
operator can rename the manifest back). Nothing is deleted or retired through a link.
"""

from __future__ import annotations

from ftkit.errors import StorageError
from ftkit.format.manifest import MANIFEST_NAME, RETIRED_MANIFEST, step_dir_name
from ftkit.tiers.storage import Storage


def delete_step(storage: Storage, step: int) -> None:
    """Remove a step: manifest first, so it stops existing before its data goes."""
    d = step_dir_name(step)
    if storage.is_link(d):
        raise StorageError(f"{storage.where(d)} is a symbolic link; not deleting through it")
    storage.remove(f"{d}/{MANIFEST_NAME}")
    if storage.spares is not None:  # the RAM tier writes its next files over these (ram.SparePool)
        names = [n for n, kind in storage.list_dir(d) if kind == "file" and n.endswith(".data")]
        storage.spares.give([storage.path(f"{d}/{n}") for n in names])
    storage.remove(d, recursive=True)


def retire_step(storage: Storage, step: int) -> None:
    """Take a committed step out of the timeline, keeping its bytes (module docstring)."""
    d = step_dir_name(step)
    if storage.is_link(d):
        raise StorageError(f"{storage.where(d)} is a symbolic link; not retiring through it")
    storage.rename(f"{d}/{MANIFEST_NAME}", f"{d}/{RETIRED_MANIFEST}")

"""Local-filesystem safety for tiers on a local path (the RAM tier among them).

A checkpoint directory may have been written by someone else: readers open regular files
only (a FIFO named manifest.json would block every reader), and nothing follows a symbolic
link below a tier's root (a linked step directory could point at another run's files).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable

import psutil

from ftkit.errors import CorruptCheckpointError, StorageError

_NOT_REGULAR = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFDIR: "a directory",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def local_kind(entry: os.DirEntry) -> str:
    """ "file", "directory", "link" (never followed) or "other" (FIFO, socket, device)."""
    if entry.is_symlink():
        return "link"
    if entry.is_dir(follow_symlinks=False):
        return "directory"
    return "file" if entry.is_file(follow_symlinks=False) else "other"


def no_links_within(root: str, rel: str, where: Callable[[str], str]) -> None:
    """Refuse a path below `root` whose directories include a symbolic link (the root's own may: the user's choice)."""
    parts = [p for p in rel.split("/")[:-1] if p]
    at = root
    for p in parts:
        at = os.path.join(at, p)
        try:
            if stat.S_ISLNK(os.lstat(at).st_mode):
                raise StorageError(
                    f"{where(rel)}: {where(at[len(root) + 1 :])} is a symbolic "
                    "link; ftkit does not follow links inside a tier"
                )
        except FileNotFoundError:
            return


def open_regular(path: str, shown: str):
    """An unbuffered reader of `path`, a regular file (opened O_NONBLOCK: a FIFO would wait forever)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CorruptCheckpointError(f"{shown} is a symbolic link; not following it") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = _NOT_REGULAR.get(stat.S_IFMT(mode), "not a regular file")
            raise CorruptCheckpointError(f"{shown} is not a regular file ({kind})")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def fsync_dir(path: str) -> None:
    """fsync a directory (a rename in it is durable after this); best effort."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


VOLATILE_FS = frozenset({"tmpfs", "ramfs"})  # memory with no backing store: fsync has nothing to do


def on_volatile_fs(path: str) -> bool:
    """Whether `path` is on a filesystem in memory (VOLATILE_FS), where an fsync makes nothing
    more durable; False where it cannot be told, so fsyncs stay."""
    try:
        mounts = psutil.disk_partitions(all=True)
    except (OSError, RuntimeError):
        return False
    real = os.path.realpath(path)
    kind, best = "", ""
    for m in mounts:  # the deepest mount point holding `path`; the last mounted there wins
        inside = real == m.mountpoint or real.startswith(m.mountpoint.rstrip("/") + "/")
        if inside and len(m.mountpoint) >= len(best):
            best, kind = m.mountpoint, m.fstype
    return kind in VOLATILE_FS


def make_dirs(path: str, mode: int = 0o777) -> None:
    """os.makedirs, with `mode` (less the umask) for every directory it creates: os.makedirs
    gives it to the last one only, and a private tier's would come back readable by others."""
    parent = os.path.dirname(path)
    if parent and parent != path and not os.path.isdir(parent):
        make_dirs(parent, mode)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, mode)


def write_whole(full: str, data: bytes, sync: bool = True, dir_mode: int = 0o777) -> None:
    """Storage.open_write for bytes already whole, without a buffered file object: temporary
    name, fsync, rename, fsync of the directory (no fsync when not `sync`); a missing
    directory is made with `dir_mode`."""
    tmp = f"{full}.tmp-{os.urandom(4).hex()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(tmp, flags, 0o666)
    except FileNotFoundError:
        make_dirs(os.path.dirname(full), dir_mode)
        fd = os.open(tmp, flags, 0o666)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, full)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    if sync:
        fsync_dir(os.path.dirname(full))

"""Byte movement below one fsspec URL: list, read, write, remove.

Writes are atomic: locally a temporary name, fsync, rename, fsync of the directory (no fsync
on tmpfs); on object stores one PUT or a completed multipart upload, a failed one discarded.
Backend exceptions become one-line StorageErrors, credentials scrubbed (tiers/backends.py).
Locally only regular files are read and no link below the root is followed (tiers/localfs.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from ftkit.errors import FtkitError, StorageError, one_line
from ftkit.tiers.backends import open_fs, scrub
from ftkit.tiers.localfs import (
    fsync_dir,
    local_kind,
    make_dirs,
    no_links_within,
    on_volatile_fs,
    open_regular,
    write_whole,
)
from ftkit.tiers.redact import redact_url  # noqa: F401  (re-exported: one redaction function, see redact.py)
from ftkit.tiers.uploads import abort_upload, list_incomplete_uploads


class Storage:
    """Byte-level access below one root URL. Paths given to methods are relative."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *, private: bool = False):
        """`private`: the directories it makes are 0700 (the RAM tier's, should its own go)."""
        self.dir_mode = 0o700 if private else 0o777  # (less the umask)
        self.url = url.rstrip("/") or url
        self.display_url = redact_url(self.url)
        self.fs, self.root, self._secrets = open_fs(self.url, storage_options)
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.sync = not (self.is_local and on_volatile_fs(self.root))
        self.spares: Any = None  # local files to write over instead of new ones (ram.SparePool)

    def path(self, rel: str = "") -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def where(self, rel: str = "") -> str:
        return f"{self.display_url}/{rel}" if rel else self.display_url

    @contextlib.contextmanager
    def _errors(self, action: str, rel: str) -> Iterator[None]:
        """Translate backend exceptions into StorageError (FileNotFoundError passes)."""
        try:
            yield
        except (FileNotFoundError, FtkitError):
            raise  # not-found is the caller's to interpret; ours are already clear
        except Exception as e:
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                raise StorageError(f"no space left on device while {action} {self.where(rel)}") from None
            if isinstance(e, PermissionError):
                raise StorageError(f"permission denied while {action} {self.where(rel)}") from None
            raise StorageError(scrub(f"{action} {self.where(rel)} failed: {one_line(e)}", self._secrets)) from None

    def list_dir(self, rel: str = "") -> list[tuple[str, str]]:
        """(name, kind) of the entries below `rel`, [] when it does not exist; kind: "file",
        "directory", and locally "link" (never followed) or "other" (FIFO, socket, device)."""
        if self.is_local:  # the RAM tier lists at every commit: skip fsspec's per-entry info()
            with self._errors("listing", rel):
                return [(e.name, local_kind(e)) for e in self._scandir(rel)]
        return [
            (e["name"].rstrip("/").rsplit("/", 1)[-1], "directory" if e.get("type") == "directory" else "file")
            for e in self._ls(rel)
        ]

    def list_sizes(self, rel: str = "", names: list[str] | None = None) -> dict[str, int]:
        """{name: bytes} of the regular files directly below `rel`, or of `names` only (an lstat each)."""
        if self.is_local:
            with self._errors("listing", rel):
                if names is None:  # a file removed after the listing (retention) is not listed
                    names = [e.name for e in self._scandir(rel) if e.is_file(follow_symlinks=False)]
                else:
                    self._no_links_within(rel)
                stats = ((n, _lstat(os.path.join(self.path(rel), n))) for n in names)
                return {n: st.st_size for n, st in stats if st is not None and stat.S_ISREG(st.st_mode)}
        listed = {
            e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
            for e in self._ls(rel)
            if e.get("type") != "directory"
        }
        return listed if names is None else {n: listed[n] for n in names if n in listed}

    def _scandir(self, rel: str) -> list[os.DirEntry]:
        """The local entries directly below `rel` ([] when missing), refusing a link on the way."""
        self._no_links_within(rel)
        try:
            with os.scandir(self.path(rel)) as it:
                return list(it)
        except FileNotFoundError:
            return []

    def _uncached(self, rel: str) -> str:
        """The path of `rel`, fsspec's cached listings of it and of its parents dropped: other ranks
        and jobs write the tier, so a listing this process made earlier (a restore's reads) must
        not answer whether a file exists or how long it is (on an object store: one request)."""
        path = self.path(rel)
        self.fs.invalidate_cache(path)
        return path

    def _ls(self, rel: str, itself: bool = False) -> list[dict[str, Any]]:
        """fsspec's fresh listing below `rel` ([] when missing), less the prefix's own marker unless `itself`."""
        with self._errors("listing", rel):
            try:
                entries = self.fs.ls(self._uncached(rel), detail=True)
            except FileNotFoundError:
                return []
        base = self.path(rel).rstrip("/")
        return [e for e in entries if itself or e["name"].rstrip("/") != base]

    def modified(self, rel: str) -> float | None:
        """The newest modification time (Unix seconds) of `rel` or of the files directly in it."""
        times = []
        with self._errors("listing", rel):
            if self.is_local:
                st = _lstat(self.path(rel))
                if st is None:
                    return None
                times.append(st.st_mtime)
                if stat.S_ISDIR(st.st_mode):
                    times += [e.stat(follow_symlinks=False).st_mtime for e in self._scandir(rel)]
            else:
                for e in self._ls(rel, itself=True):
                    t: Any = e.get("LastModified") or e.get("mtime") or e.get("created")
                    if hasattr(t, "timestamp"):
                        times.append(t.timestamp())
                    elif isinstance(t, (int, float)):
                        times.append(float(t))
        return max(times) if times else None

    def exists(self, rel: str) -> bool:
        with self._errors("checking", rel):
            if self.is_local:
                return os.path.exists(self.path(rel))
            return bool(self.fs.exists(self._uncached(rel)))

    def size(self, rel: str) -> int:
        with self._errors("reading size of", rel):
            if self.is_local:
                self._no_links_within(rel)
                return os.lstat(self.path(rel)).st_size
            return int(self.fs.size(self._uncached(rel)))

    def read_ranges(self, rel: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """The bytes of each ``(start, end)`` range of `rel`, in order (short past the end), the GETs
        run concurrently (fsspec's ``cat_ranges``): for object stores (local reads use open_read)."""
        with self._errors("reading", rel):
            path = self.path(rel)
            got = self.fs.cat_ranges(
                [path] * len(ranges), [a for a, _ in ranges], [b for _, b in ranges], on_error="raise"
            )
            return [bytes(b) for b in got]

    @contextlib.contextmanager
    def open_read(self, rel: str) -> Iterator[Any]:
        with self._errors("reading", rel):
            if self.is_local:
                self._no_links_within(rel)
                f = open_regular(self.path(rel), self.where(rel))
            else:
                f = self.fs.open(self.path(rel), "rb", block_size=8 * 2**20, cache_type="none")
            try:
                yield f
            finally:
                f.close()

    @contextlib.contextmanager
    def open_write(self, rel: str, *, recycle: bool = False) -> Iterator[Any]:
        """A file that appears at `rel` only if the block completes without error.
        recycle: a big data file, written over one of `spares` when there is one."""
        full = self.path(rel)
        with self._errors("writing", rel):
            if self.is_local:
                self._no_links_within(rel)
                make_dirs(os.path.dirname(full), self.dir_mode)
                tmp = f"{full}.tmp-{uuid.uuid4().hex[:8]}"
                reused = recycle and self.spares is not None and self.spares.take(tmp)
                f = None
                try:  # buffered so that many small tensors become few syscalls; big writes pass through
                    f = open(tmp, "r+b" if reused else "wb", buffering=8 * 2**20)
                    yield f
                    f.flush()
                    if reused:
                        f.truncate()  # a spare may be longer than what was written
                    if self.sync:
                        os.fsync(f.fileno())
                    f.close()
                    os.replace(tmp, full)
                except BaseException:
                    # close() may fail again flushing its buffer (ENOSPC): still remove tmp (or the
                    # spare already renamed to it when open() failed).
                    with contextlib.suppress(OSError):
                        if f is not None:
                            f.close()
                    with contextlib.suppress(OSError):
                        os.remove(tmp)
                    raise
                if self.sync:
                    fsync_dir(os.path.dirname(full))
            else:
                f = self.fs.open(full, "wb", block_size=64 * 2**20)
                try:
                    yield f
                except BaseException:
                    with contextlib.suppress(Exception):
                        (getattr(f, "discard", None) or f.close)()
                    raise
                f.close()  # completes the (multipart) upload: the object appears now

    def write_bytes_atomic(self, rel: str, data: bytes) -> None:
        with self._errors("writing", rel):
            if self.is_local:
                self._no_links_within(rel)
                write_whole(self.path(rel), data, self.sync, self.dir_mode)
            else:
                self.fs.pipe_file(self.path(rel), data)

    def remove(self, rel: str, recursive: bool = False) -> None:
        """Delete a file (or, `recursive`, a tree); gone already is fine. Never through a link: one
        on the way to `rel` is refused, one at `rel` is removed itself (refused if `recursive`)."""
        with self._errors("removing", rel), contextlib.suppress(FileNotFoundError):  # gone already: fine
            if not self.is_local:
                self.fs.rm(self.path(rel), recursive=recursive)
                if recursive:  # some stores (SeaweedFS) keep an empty prefix as a directory entry
                    with contextlib.suppress(Exception):
                        self.fs.rm_file(self.path(rel).rstrip("/") + "/")
                return
            self._no_links_within(rel)
            st = os.lstat(self.path(rel))
            if stat.S_ISLNK(st.st_mode) and recursive:
                raise StorageError(f"{self.where(rel)} is a symbolic link; not following it to delete")
            if recursive and stat.S_ISDIR(st.st_mode):
                shutil.rmtree(self.path(rel))  # fd-based on Linux: does not follow links inside
            else:
                os.remove(self.path(rel))

    def rename(self, rel: str, new_rel: str) -> None:
        """Rename a file (atomically on POSIX; a copy then a delete on object stores)."""
        with self._errors("renaming", rel):
            if self.is_local:
                self._no_links_within(rel)
                self._no_links_within(new_rel)
                os.replace(self.path(rel), self.path(new_rel))
                if self.sync:
                    fsync_dir(os.path.dirname(self.path(new_rel)))
            else:
                self.fs.mv(self.path(rel), self.path(new_rel))

    def is_link(self, rel: str) -> bool:
        """Whether `rel` itself is a symbolic link (local only; object stores have none)."""
        return self.is_local and os.path.islink(self.path(rel))

    def incomplete_uploads(self, rel: str = "") -> list[dict[str, Any]]:
        """Multipart uploads started below `rel` and never completed, `own` or not (tiers/uploads.py)."""
        with self._errors("listing incomplete uploads of", rel):
            try:
                return list_incomplete_uploads(self.fs, self.path(), rel)
            except FileNotFoundError as e:  # (NoSuchBucket: the object listing before it found nothing)
                text = f"listing incomplete uploads of {self.where(rel)} failed: {e}"
                raise StorageError(scrub(text, self._secrets)) from None

    def abort_upload(self, upload: dict[str, Any]) -> None:
        """Abort one of ftkit's own incomplete uploads (gone already: fine); a foreign one is refused (StorageError)."""
        with self._errors("aborting the upload of", upload["key"]), contextlib.suppress(FileNotFoundError):
            abort_upload(self.fs, self.path(), upload)  # (NoSuchUpload: aborted or completed meanwhile)

    def _no_links_within(self, rel: str) -> None:
        no_links_within(self.root, rel, self.where)


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None

"""Byte movement to and from any fsspec URL.

A :class:`Storage` is rooted at one URL (a local path, ``file://``, ``s3://``,
anything fsspec knows) and only moves bytes: list, read, write, remove. It owns
two things the rest of ftkit relies on:

* **Atomic writes.** On a local filesystem a file is written to a temporary name,
  fsynced, renamed into place and its directory fsynced; on object stores a
  single PUT (or a completed multipart upload) is atomic by nature, and a failed
  upload is discarded rather than completed.
* **One-line errors.** Backend exceptions (botocore, aiohttp, OSError...) become
  :class:`~ftkit.errors.StorageError` naming the operation and the URL, with any
  credential from ``storage_options`` scrubbed from the text.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import uuid
from typing import Any, Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .errors import FtkitError, StorageError

log = logging.getLogger(__name__)

# Protocols whose fsspec backend lives in another package: the install hint.
INSTALL_HINTS = {
    "s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs",
    "abfs": "adlfs", "abfss": "adlfs", "hf": "huggingface_hub", "sftp": "paramiko", "ssh": "paramiko",
}
# Bounded timeouts so an unreachable endpoint is an error in seconds, not minutes.
S3_DEFAULTS: dict[str, Any] = {
    "config_kwargs": {"connect_timeout": 5, "read_timeout": 120,
                      "retries": {"max_attempts": 3, "mode": "standard"}},
}
_SECRET_KEYS = ("key", "secret", "token", "password", "aws_secret_access_key",
                "aws_access_key_id", "aws_session_token", "access_key", "secret_key")
_USERINFO_RE = re.compile(r"(?<=://)[^/@\s]*@")


def redact_url(url: str) -> str:
    """`url` without any user:password@ part."""
    return _USERINFO_RE.sub("***@", url)


def _merge(defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    out = dict(defaults)
    for k, v in given.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _secrets_in(options: Any) -> list[str]:
    found: list[str] = []
    if isinstance(options, dict):
        for k, v in options.items():
            if isinstance(v, str) and k.lower() in _SECRET_KEYS and len(v) >= 4:
                found.append(v)
            else:
                found += _secrets_in(v)
    return found


class Storage:
    """Byte-level access below one root URL. Paths given to methods are relative."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self.url = url.rstrip("/") or url
        self.display_url = redact_url(self.url)
        options = dict(storage_options or {})
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        if protocol in ("s3", "s3a"):
            options = _merge(S3_DEFAULTS, options)
        if protocol == "faulty":  # the drills' fault-injecting filesystem registers itself
            from . import faults  # noqa: F401
        self._secrets = _secrets_in(options) + _secrets_in({"key": os.environ.get("AWS_SECRET_ACCESS_KEY", "")})
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        except ImportError:
            pkg = INSTALL_HINTS.get(protocol, "the fsspec backend for it")
            raise StorageError(f"{self.display_url}: protocol {protocol!r} needs {pkg}: pip install {pkg}") from None
        except ValueError as e:
            if "Protocol not known" in str(e) or "not known" in str(e):
                raise StorageError(f"{self.display_url}: unknown storage protocol {protocol!r} "
                                   "(not a protocol fsspec knows)") from None
            raise StorageError(self._scrub(f"{self.display_url}: bad storage URL or options: {e}")) from None
        except Exception as e:
            raise StorageError(self._scrub(f"{self.display_url}: cannot open storage: {_one_line(e)}")) from None
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.protocol = protocol
        # Local files to write over instead of creating new ones (the RAM tier's, see ramtier.py).
        self.spares: Any = None

    # ----------------------------------------------------------------- helpers
    def path(self, rel: str = "") -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def where(self, rel: str = "") -> str:
        return f"{self.display_url}/{rel}" if rel else self.display_url

    def _scrub(self, text: str) -> str:
        for s in self._secrets:
            text = text.replace(s, "***")
        return redact_url(text)

    @contextlib.contextmanager
    def _errors(self, action: str, rel: str) -> Iterator[None]:
        """Translate backend exceptions into StorageError (FileNotFoundError passes)."""
        try:
            yield
        except (FileNotFoundError, FtkitError):
            raise  # not-found is the caller's to interpret; ours are already clear
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise StorageError(f"no space left on device while {action} {self.where(rel)}") from None
            if isinstance(e, PermissionError):
                raise StorageError(f"permission denied while {action} {self.where(rel)}") from None
            raise StorageError(self._scrub(f"{action} {self.where(rel)} failed: {_one_line(e)}")) from None
        except Exception as e:
            raise StorageError(self._scrub(f"{action} {self.where(rel)} failed: {_one_line(e)}")) from None

    # ------------------------------------------------------------------- reads
    def list_dir(self, rel: str = "") -> list[tuple[str, str]]:
        """(name, "file"|"directory") of the entries below `rel`; [] when it does not exist."""
        if self.is_local:  # the RAM tier lists at every commit: skip fsspec's per-entry info()
            with self._errors("listing", rel):
                try:
                    with os.scandir(self.path(rel)) as it:
                        return [(e.name, "directory" if e.is_dir() else "file") for e in it]
                except FileNotFoundError:
                    return []
        with self._errors("listing", rel):
            self.fs.invalidate_cache(self.path(rel))
            try:
                entries = self.fs.ls(self.path(rel), detail=True)
            except FileNotFoundError:
                return []
        base = self.path(rel).rstrip("/")
        out = []
        for e in entries:
            name = e["name"].rstrip("/").rsplit("/", 1)[-1]
            if e["name"].rstrip("/") == base:
                continue
            out.append((name, "directory" if e.get("type") == "directory" else "file"))
        return out

    def exists(self, rel: str) -> bool:
        with self._errors("checking", rel):
            if self.is_local:
                return os.path.exists(self.path(rel))
            return bool(self.fs.exists(self.path(rel)))

    def size(self, rel: str) -> int:
        with self._errors("reading size of", rel):
            return int(self.fs.size(self.path(rel)))

    def read_bytes(self, rel: str) -> bytes:
        with self._errors("reading", rel):
            return self.fs.cat_file(self.path(rel))

    @contextlib.contextmanager
    def open_read(self, rel: str) -> Iterator[Any]:
        with self._errors("reading", rel):
            if self.is_local:
                f = open(self.path(rel), "rb", buffering=0)
            else:
                f = self.fs.open(self.path(rel), "rb", block_size=8 * 2**20, cache_type="none")
            try:
                yield f
            finally:
                f.close()

    # ------------------------------------------------------------------ writes
    @contextlib.contextmanager
    def open_write(self, rel: str, *, recycle: bool = False) -> Iterator[Any]:
        """A file that appears at `rel` only if the block completes without error.

        recycle: a big data file; write it over one of `spares` when there is one."""
        full = self.path(rel)
        with self._errors("writing", rel):
            if self.is_local:
                os.makedirs(os.path.dirname(full), exist_ok=True)
                tmp = f"{full}.tmp-{uuid.uuid4().hex[:8]}"
                reused = recycle and self.spares is not None and self.spares.take(tmp)
                try:  # buffered so that many small tensors become few syscalls; big writes pass through
                    f = open(tmp, "r+b" if reused else "wb", buffering=8 * 2**20)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.remove(tmp)  # a spare already renamed to tmp
                    raise
                ok = False
                try:
                    yield f
                    f.flush()
                    if reused:
                        f.truncate()  # a spare may be longer than what was written
                    os.fsync(f.fileno())
                    ok = True
                finally:
                    if ok:
                        f.close()
                        os.replace(tmp, full)
                        _fsync_dir(os.path.dirname(full))
                    else:
                        # close() may fail again flushing its buffer (ENOSPC): still remove tmp.
                        with contextlib.suppress(OSError):
                            f.close()
                        with contextlib.suppress(OSError):
                            os.remove(tmp)
            else:
                f = self.fs.open(full, "wb", block_size=64 * 2**20)
                ok = False
                try:
                    yield f
                    ok = True
                finally:
                    if ok:
                        f.close()  # completes the (multipart) upload: the object appears now
                    else:
                        with contextlib.suppress(Exception):
                            (getattr(f, "discard", None) or f.close)()

    def write_bytes_atomic(self, rel: str, data: bytes) -> None:
        if self.is_local:
            with self.open_write(rel) as f:
                f.write(data)
            return
        with self._errors("writing", rel):
            self.fs.pipe_file(self.path(rel), data)

    def remove(self, rel: str, recursive: bool = False) -> None:
        with self._errors("removing", rel):
            try:
                if not self.is_local:
                    self.fs.rm(self.path(rel), recursive=recursive)
                elif recursive and os.path.isdir(self.path(rel)):
                    shutil.rmtree(self.path(rel))
                else:
                    os.remove(self.path(rel))
            except FileNotFoundError:
                pass

    def makedirs(self, rel: str) -> None:
        with self._errors("creating", rel):
            self.fs.makedirs(self.path(rel), exist_ok=True)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0][:240] if text else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__

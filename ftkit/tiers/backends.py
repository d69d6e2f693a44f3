"""Which fsspec backend serves a URL: its options (bounded S3 timeouts and a deadline on
each S3 call by default), the package to install when it is missing, and one-line errors
for an unknown protocol or bad options, with every credential from the options scrubbed."""

from __future__ import annotations

import asyncio
import functools
import os
from typing import Any

import fsspec
from fsspec.asyn import sync_wrapper

from ftkit.errors import StorageError, UnknownProtocolError, one_line
from ftkit.tiers.redact import redact_url

# Protocols whose fsspec backend lives in another package: the install hint.
INSTALL_HINTS = {
    **dict.fromkeys(("s3", "s3a"), "s3fs"),
    **dict.fromkeys(("gs", "gcs"), "gcsfs"),
    **dict.fromkeys(("az", "abfs", "abfss"), "adlfs"),
    **dict.fromkeys(("sftp", "ssh"), "paramiko"),
    "hf": "huggingface_hub",
}
# Bounded timeouts so an unreachable endpoint is an error in seconds, not minutes; upload parts
# of the file's block size (64 MiB), not of all that one write() gave (up to 5 GiB: a rank's whole
# image), so that S3_DEADLINE bounds each part and a retry resends 64 MiB.
S3_DEFAULTS: dict[str, Any] = {
    "config_kwargs": {"connect_timeout": 5, "read_timeout": 120, "retries": {"max_attempts": 3, "mode": "standard"}},
    "fixed_upload_size": True,
}
# Seconds one S3 call may take, its retries included (storage_options "deadline", ftkit's own;
# None: no limit). A call is a listing, a HEAD, a GET's answer or one 64 MiB part of an upload.
S3_DEADLINE = 300
# storage_options keys whose values are credentials, scrubbed from every message.
_SECRET_KEYS = frozenset(
    "key secret token password access_key secret_key aws_access_key_id aws_secret_access_key aws_session_token".split()
)


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


def scrub(text: str, secrets: list[str]) -> str:
    """`text` with every secret and any credential in a URL replaced."""
    for s in secrets:
        text = text.replace(s, "***")
    return redact_url(text)


def open_fs(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str, list[str]]:
    """(filesystem, root path, the secrets to scrub from messages) for `url`."""
    shown = redact_url(url)
    options = dict(storage_options or {})
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    deadline = None
    if protocol in ("s3", "s3a"):
        deadline = options.pop("deadline", S3_DEADLINE)
        # An instance of its own: fsspec would share one between tiers of the same options, and the
        # deadline is set on the instance (the last tier opened would set it for all of them).
        options = _merge(S3_DEFAULTS, options) | {"skip_instance_cache": True}
    secrets = _secrets_in(options) + _secrets_in({"key": os.environ.get("AWS_SECRET_ACCESS_KEY", "")})
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
        if deadline:
            _bound_s3_calls(fs, float(deadline))
    except ImportError:
        pkg = INSTALL_HINTS.get(protocol, "the fsspec backend for it")
        raise UnknownProtocolError(f"{shown}: protocol {protocol!r} needs {pkg}: pip install {pkg}") from None
    except ValueError as e:
        if "not known" in str(e):
            raise UnknownProtocolError(
                f"{shown}: unknown storage protocol {protocol!r} (not a protocol fsspec knows)"
            ) from None
        raise StorageError(scrub(f"{shown}: bad storage URL or options: {e}", secrets)) from None
    except Exception as e:
        raise StorageError(scrub(f"{shown}: cannot open storage: {one_line(e)}", secrets)) from None
    return fs, root, secrets


def _bound_s3_calls(fs: Any, seconds: float) -> None:
    """Make each call of s3fs's `_call_s3` (all its listings, reads and writes go through it) fail
    after `seconds`, botocore's and s3fs's retries included (3 x 5 attempts, each up to read_timeout:
    half an hour). Needed for writes above all: botocore waits for "100 Continue" before a PUT's body
    and aiohttp's read timeout starts once the body is sent, so a server that accepts a connection
    and never answers held a write forever. Per call, not per file: a slow big upload is not cut."""
    call = functools.partial(type(fs)._call_s3, fs)  # the class's: fsspec may hand back a cached fs bounded already

    async def bounded(*args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.wait_for(call(*args, **kwargs), seconds)
        except asyncio.TimeoutError:  # re-raised as an error s3fs does not retry: the deadline covers its retries
            raise ConnectionError(f"no answer within {seconds:g} s (storage_options 'deadline')") from None

    fs._call_s3 = bounded
    fs.call_s3 = sync_wrapper(bounded, obj=fs)  # (what its files call)

"""Which fsspec backend serves a URL: its options (bounded S3 timeouts by default), the
package to install when it is missing, and one-line errors for an unknown protocol or
bad options, with every credential from the options scrubbed from the text."""

from __future__ import annotations

import os
from typing import Any

import fsspec

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
# Bounded timeouts so an unreachable endpoint is an error in seconds, not minutes.
S3_DEFAULTS: dict[str, Any] = {
    "config_kwargs": {"connect_timeout": 5, "read_timeout": 120, "retries": {"max_attempts": 3, "mode": "standard"}},
}
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
    if protocol in ("s3", "s3a"):
        options = _merge(S3_DEFAULTS, options)
    secrets = _secrets_in(options) + _secrets_in({"key": os.environ.get("AWS_SECRET_ACCESS_KEY", "")})
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
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

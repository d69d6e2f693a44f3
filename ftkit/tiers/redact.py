"""The one function that makes a URL, or any text holding URLs, safe to show (logs, events,
stats, ``repr(Tier)``, errors, the RAM tier's identity record). A URL keeps its scheme, host
and path, and loses its user-info (``scheme://***@host``, also for passwords holding an
unescaped ``/`` or ``@``, as AWS secret keys may) and the values of credential-like query
parameters (presigned or SAS URLs).
"""

from __future__ import annotations

import re

# A URL inside any text: scheme://, then everything up to whitespace (or the next
# "://": text like "a://b://u:p@h" is taken as two URLs, each redacted).
_URL = re.compile(r"(?P<scheme>(?:[A-Za-z][A-Za-z0-9+.-]*)?://)(?P<rest>(?:(?!://)\S)*)")
# Query parameters whose value is a credential (matched on the lower-cased name).
_SECRET_PARAM = re.compile(r"(sig|signature|token|secret|pass|pwd|key|credential|auth)")
_QUERY_PAIR = re.compile(r"(?P<sep>[?&;])(?P<name>[^=&;#\s]+)=(?P<value>[^&;#\s]*)")


def redact_url(url: str) -> str:
    """`url` (or a text containing URLs) without credentials: user-info and secret query values."""
    return _URL.sub(_redact_one, url)


def _redact_one(m: re.Match) -> str:
    rest = m.group("rest")
    # User-info ends at the last "@" before the first "/" (a password's unescaped "@" comes
    # before it); not stopping at "?" or "#" may over-redact, never under-redact.
    end = rest.find("/")
    at = rest.rfind("@", 0, len(rest) if end == -1 else end)
    if at == -1:
        # A password with an unescaped "/" ("user:pa/ss@host/path"): a ":" before the "@"
        # marks user-info (over-redacting a path like "bucket/a:b@c" only hides a name).
        first_at = rest.find("@")
        if first_at != -1 and ":" in rest[:first_at] and "?" not in rest[:first_at]:
            at = first_at
    if at != -1:
        rest = "***" + rest[at:]
    if "?" in rest or ";" in rest:
        rest = _QUERY_PAIR.sub(_redact_pair, rest)
    return m.group("scheme") + rest


def _redact_pair(m: re.Match) -> str:
    if _SECRET_PARAM.search(m.group("name").lower()):
        return f"{m.group('sep')}{m.group('name')}=***"
    return m.group(0)

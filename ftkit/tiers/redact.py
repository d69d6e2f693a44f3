"""The one function that makes a URL (or a text holding URLs) safe to show.

Everything that takes a tier URL out of the process goes through
:func:`redact_url`: log lines, the events JSONL, ``Checkpointer.stats``,
``repr(Tier)``, error messages, the RAM tier's identity record. A URL keeps its
scheme, host and path (what an operator needs to tell tiers apart) and loses:

* the user-info part, ``scheme://user:password@host`` -> ``scheme://***@host``,
  including passwords that contain ``/`` or ``@`` unescaped (AWS secret keys
  often contain ``/``), where the naive "up to the first @" rule leaks a tail;
* the values of credential-like query parameters (``X-Amz-Signature``,
  ``X-Amz-Credential``, ``sig``, ``token``, ``password``, ``key``...), as in
  presigned or SAS URLs.

It accepts any text, not just one URL: error messages embed URLs, and
redacting the whole message is how callers scrub them.
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
    # A user-info part ends at the last "@" before the first "/" (an unescaped "@"
    # in a password comes before it). Not stopping at "?" or "#" over-redacts odd
    # hosts, never under-redacts: everything before that "@" goes.
    end = rest.find("/")
    at = rest.rfind("@", 0, len(rest) if end == -1 else end)
    if at == -1:
        # A password with an unescaped "/" pushes its "@" past the first "/":
        # "user:pa/ss@host/path". A ":" before that "@" marks it as user-info.
        # (Over-redacting a path like "bucket/a:b@c" only hides a display name.)
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

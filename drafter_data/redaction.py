"""Text made safe to print or log: URLs without their user:password and without secret-looking query values.

Each URL in a text is split by the standard URL parser: its userinfo is everything before the last `@` of its
authority (as HTTP clients read it, so a password holding `@` goes whole), and a query value is masked when its
name looks like a secret's (key, api-key, x-api-key, token, secret, password, passwd, auth, sig, ...).
"""
from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

_URL = re.compile(r"[a-z][a-z0-9+.-]*://[^\s'\"<>]+", re.I)
_SECRET_NAME = re.compile(r"key|token|secret|passw|pwd|auth|sig|credential|session|cookie", re.I)
_QUERY_PAIR = re.compile(r"(?P<name>[^&;=]*)=(?P<value>[^&;]*)")


def redact_url(text: str) -> str:
    """A URL (or any text holding URLs) without its user:password and with secret-looking query values masked."""
    return _URL.sub(lambda m: _redact_one(m.group(0)), str(text))


def _redact_one(url: str) -> str:
    try:
        parts = urlsplit(url)
    except ValueError:  # not a URL the parser takes (e.g. a broken IPv6 host): mask what may be userinfo
        scheme, _, rest = url.partition("://")
        return f"{scheme}://{rest.rpartition('@')[2]}"
    netloc = parts.netloc.rpartition("@")[2]
    query = _QUERY_PAIR.sub(_mask_pair, parts.query)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment)) if (netloc, query) != \
        (parts.netloc, parts.query) else url


def _mask_pair(pair: re.Match) -> str:
    name = pair.group("name")
    return f"{name}=***" if _SECRET_NAME.search(name) and pair.group("value") else pair.group(0)

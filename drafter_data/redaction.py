"""Text made safe to print or log: URLs without their user:password and without secret-looking query values."""
from __future__ import annotations

import re

_URL_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s'\"]+@", re.I)
_SECRET_QUERY = re.compile(r"(?P<name>[?&](?:[a-z_]*key|[a-z_]*token|secret|password|sig|signature)=)[^&\s'\"]+",
                           re.I)


def redact_url(text: str) -> str:
    """A URL (or any text holding URLs) without its user:password and with secret-looking query values masked."""
    return _SECRET_QUERY.sub(r"\g<name>***", _URL_USERINFO.sub(r"\g<scheme>", str(text)))

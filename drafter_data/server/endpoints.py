"""Where the servers are: the configured base URL(s), their root, and the API key from the environment."""
from __future__ import annotations

import os

from drafter_data.errors import StageError


def base_urls(server_cfg) -> list[str]:
    """server.base_url as a list (one URL or several), without trailing slashes."""
    urls = server_cfg.base_url
    urls = [urls] if isinstance(urls, str) else list(urls or [])
    if not urls:
        raise StageError("server.base_url is empty: give the server's OpenAI API URL, e.g. http://HOST:30000/v1")
    return [str(u).rstrip("/") for u in urls]


def api_root(base_url: str) -> str:
    """The server's root (where llama-server's /health, /props, /tokenize live) from its OpenAI base URL."""
    return base_url.rstrip("/").removesuffix("/v1")


def api_key(server_cfg) -> str:
    """The key from the environment variable *named* by server.api_key_env; never from config or logs."""
    name = server_cfg.get("api_key_env")
    return (os.environ.get(name) if name else None) or "EMPTY"

"""Where the servers are: the configured base URL(s), their root, and the API key from the environment (URLs are
made safe to print by drafter_data.redaction)."""
from __future__ import annotations

import os
import re

from drafter_data.errors import StageError

_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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


class ApiKey(str):
    """The API key, remembering the *name* of the environment variable it came from (for error messages; the value
    itself is never printed)."""

    env_name: str | None = None
    present: bool = False

    def __new__(cls, value: str, env_name: str | None, present: bool) -> ApiKey:
        key = super().__new__(cls, value)
        key.env_name, key.present = env_name, present
        return key


def api_key(server_cfg) -> ApiKey:
    """The key from the environment variable *named* by server.api_key_env; never from config or logs."""
    name = check_api_key_env(server_cfg)
    value = os.environ.get(name) if name else None
    return ApiKey(value or "EMPTY", name, bool(value))


def check_api_key_env(server_cfg) -> str | None:
    """server.api_key_env, refused (without echoing it) unless it looks like a variable name: a key pasted there
    would otherwise travel into params, logs and MLflow."""
    name = server_cfg.get("api_key_env")
    if name is None or name == "":
        return None
    name = str(name)
    if not _VARIABLE_NAME.fullmatch(name) or looks_like_a_key(name):
        raise StageError("server.api_key_env must be the NAME of an environment variable (letters, digits, _), "
                         "not the key itself, and this value is not one: export the key, e.g. "
                         "`export DRAFTER_API_KEY=...`, and set server.api_key_env=DRAFTER_API_KEY")
    return name


def looks_like_a_key(name: str) -> bool:
    """A valid identifier can still be a pasted key (sk_live_..., a long hex/base62 token)."""
    return name.startswith(("sk-", "sk_")) or (len(name) >= 32 and "_" not in name)

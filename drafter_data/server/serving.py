"""The servers a stage talks to for its duration: the configured ones (server.kind=remote), or the embedded
llama-server (server.kind=local), started unless one already answers and stopped afterwards."""
from __future__ import annotations

from contextlib import contextmanager

from drafter_data.server.endpoints import base_urls
from drafter_data.server.local import local_server


@contextmanager
def servers(server_cfg, log_path=None):
    """with servers(cfg.server) as urls: ...  (a list of OpenAI base URLs)"""
    if server_cfg.get("kind") != "local":
        yield base_urls(server_cfg)
        return
    with local_server(server_cfg, log_path) as url:
        yield [url]

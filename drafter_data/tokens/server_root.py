"""The server that tokenizes for target.tokenizer=server: tokenize and export start it (server=local) or find it."""
from contextlib import contextmanager


@contextmanager
def server_root(cfg):
    """The running server's root URL for target.tokenizer=server (started here when server=local), else None."""
    if cfg.target.tokenizer != "server":
        yield None
        return
    from drafter_data.server.endpoints import api_root  # only for this tokenizer: the others never load the client
    from drafter_data.server.serving import servers

    with servers(cfg.server) as urls:
        yield api_root(urls[0])

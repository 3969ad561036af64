"""What generate has to do: the request key of each input prompt, and the prompts without a completion yet."""
from __future__ import annotations

import hashlib
from pathlib import Path

from drafter_data.contract import iter_batches


def request_key(prompt_id: str, identity: bytes) -> str:
    """A completion's identity: the prompt (prompt_id is the content hash of its messages and tools) and everything
    else that determines the answer (RequestSpec.identity)."""
    return hashlib.blake2b(prompt_id.encode() + b"\0" + identity, digest_size=16).hexdigest()


def current_keys(paths: list[Path], identity: bytes) -> set[str]:
    """The request keys of every input prompt; reads the prompt_id column only (fast over millions)."""
    keys = set()
    for batch in iter_batches(paths, columns=["prompt_id"], batch_size=65536):
        keys.update(request_key(pid, identity) for pid in batch.column(0).to_pylist())
    return keys


def iter_todo(paths: list[Path], identity: bytes, done: set[str]):
    """The input prompts without a completion yet, in input order; Python rows are built only for those."""
    for batch in iter_batches(paths, columns=["prompt_id", "source", "messages", "tools"], batch_size=4096):
        keys = [request_key(pid, identity) for pid in batch.column(0).to_pylist()]
        todo = [i for i, k in enumerate(keys) if k not in done]
        if todo:
            for i, row in zip(todo, batch.take(todo).to_pylist()):
                row["request_key"] = keys[i]
                yield row

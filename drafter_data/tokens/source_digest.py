"""Which completions a tokens directory was made from: one digest of the completions' request keys and answers.

tokenize writes it in meta.json (`completions_request_keys_sha256`); export computes it again over the completions it
is given and refuses them when it differs, so the conversations and the card always describe the answers the token
rows hold. The digest is over the distinct rows (a copy of a row read once, as tokenize reads it), in any shard order
(generate's compaction reorders rows, and changes nothing). A request key alone would not do: generate run again from
nothing sends the same requests (the same keys) and gets other answers, so each row's answer is in it too.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import orjson
import pyarrow.parquet as pq

COLUMNS = ("prompt_id", "turn", "request_key", "finish_reason", "reasoning", "content", "tool_calls")
DIGEST_KEY = "completions_request_keys_sha256"


def completions_digest(paths: list[Path], batch_rows: int = 1024) -> str:
    """sha256 over the sorted, distinct 16-byte digests of each row's request key and answer (16 bytes a row held)."""
    digests = bytearray()
    for path in paths:
        file = pq.ParquetFile(path)
        names = set(file.schema_arrow.names)
        columns = [c for c in COLUMNS if c in names]
        for batch in file.iter_batches(batch_size=batch_rows, columns=columns, use_threads=False):
            values = [batch.column(c).to_pylist() if c in names else [None] * batch.num_rows for c in COLUMNS]
            for row in zip(*values):
                digests += hashlib.blake2b(orjson.dumps(row), digest_size=16).digest()
    if not digests:
        return hashlib.sha256(b"").hexdigest()
    unique = np.unique(np.frombuffer(bytes(digests), dtype="V16"))
    return hashlib.sha256(unique.tobytes()).hexdigest()


SHARDS_KEY = "token_shards_sha256"


def shard_digests(paths: list[Path]) -> dict[str, str]:
    """{file name: sha256} of a tokens directory's shards: tokenize writes it in meta.json, so export takes exactly
    the shards that meta.json describes (none copied in, missing or from another run)."""
    digests = {}
    for path in sorted(paths):
        sha = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                sha.update(block)
        digests[path.name] = sha.hexdigest()
    return digests

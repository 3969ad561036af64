"""The data between stages (../shared/contracts.md): Parquet schemas, and shard files that are either complete or
absent (write, fsync, rename)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])

PROMPTS = pa.schema([
    ("prompt_id", pa.string()),
    ("source", pa.string()),
    ("messages", pa.list_(MESSAGE)),
    ("tools", pa.string()),  # the prompt's tool declarations as an OpenAI JSON list, null when it has none
    ("message_extras", pa.string()),  # JSON list aligned with messages: fields beyond role/content, null when none
    # assistant turns generate makes: 1, or with prepare.turns=all the number of user turns in messages (each one
    # answered in turn by the target); null reads as 1
    ("turns", pa.int32()),
])

COMPLETIONS = pa.schema(list(PROMPTS) + [
    ("turn", pa.int32()),  # which assistant turn of the conversation this row answers, 0-based
    ("reasoning", pa.string()),
    ("content", pa.string()),
    ("finish_reason", pa.string()),
    ("prompt_tokens", pa.int64()),
    ("completion_tokens", pa.int64()),
    ("tool_calls", pa.string()),  # the answer's tool calls as the server returned them (OpenAI JSON list)
    ("prompt_token_ids", pa.list_(pa.int32())),  # the prompt as the server tokenized it, when it said
    ("completion_token_ids", pa.list_(pa.int32())),  # the sampled ids, when the server returned them
    ("token_ids_via", pa.string()),  # how the ids were asked for (a server.token_ids method), null: no ids
    ("length_stop_in", pa.string()),  # reasoning | content | null: where a finish_reason=length cut the answer
    ("request_key", pa.string()),  # hash of everything that determines the completion (resume identity)
    ("parent_key", pa.string()),  # the request key of the turn this one continues (null for turn 0)
    ("model", pa.string()),  # the model the answer named (null: it named none)
    ("chat_template_kwargs", pa.string()),  # the request's chat-template kwargs (sorted JSON), switch included
    ("thinking", pa.bool_()),
    ("target", pa.string()),
    ("latency_s", pa.float64()),
])

TOKENS = pa.schema([
    ("prompt_id", pa.string()),
    ("turn", pa.int32()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("num_tokens", pa.int32()),
    ("num_loss_tokens", pa.int32()),
])


def write_table_atomic(table: pa.Table, path: Path, **options) -> None:
    """A reader (or a resumed run) sees the whole file or none of it, whatever kills this process."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp, compression="zstd", **options)
    fsync(tmp)
    os.replace(tmp, path)
    fsync(path.parent)


def fsync(path: Path) -> None:
    """A file's or a directory's content (a directory's: its entries, e.g. a rename) on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def shard_paths(directory: Path, prefix: str = "") -> list[Path]:
    return sorted(p for p in Path(directory).glob(f"{prefix}*.parquet") if not p.name.startswith("."))


def iter_batches(paths: list[Path], columns: list[str] | None = None, batch_size: int = 8192) -> Iterator[pa.RecordBatch]:
    for path in paths:
        yield from pq.ParquetFile(path).iter_batches(batch_size=batch_size, columns=columns)

"""Completion batches (Arrow) -> Turn objects, cheaply: text columns as Python strings, id columns as numpy slices of
the Arrow buffers (a Python int per token would cost as much as the tokenizing)."""
from __future__ import annotations

import numpy as np
import orjson
import pyarrow as pa

from drafter_data.contract import COMPLETIONS
from drafter_data.tokens.turns import Turn

# The completions columns tokenize reads (older shards may lack the second wave's; they read as null).
COLUMNS = ("prompt_id", "turn", "messages", "message_extras", "tools", "reasoning", "content", "tool_calls",
           "finish_reason", "length_stop_in", "thinking", "prompt_token_ids", "completion_token_ids")
INPUT_SCHEMA = pa.schema([COMPLETIONS.field(name) for name in COLUMNS])
ID_COLUMNS = ("prompt_token_ids", "completion_token_ids")


def conform(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The batch with exactly INPUT_SCHEMA: missing columns as nulls, others cast (a column written all-null has
    Arrow type null)."""
    arrays = []
    for field in INPUT_SCHEMA:
        index = batch.schema.get_field_index(field.name)
        if index < 0:
            arrays.append(pa.nulls(batch.num_rows, field.type))
        else:
            column = batch.column(index)
            arrays.append(column if column.type == field.type else column.cast(field.type))
    return pa.RecordBatch.from_arrays(arrays, schema=INPUT_SCHEMA)


def id_arrays(column: pa.Array) -> list[np.ndarray | None]:
    """list<int32> -> one int32 numpy view per row (None where null), without a Python int per token."""
    if column.null_count == len(column):
        return [None] * len(column)
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    return [values[offsets[i]:offsets[i + 1]] if valid[i] else None for i in range(len(column))]


def sent_messages(messages: list[dict], extras_json: str | None) -> list[dict]:
    """The messages exactly as sent: role/content plus each message's extras (tool_calls, tool_call_id, name,
    reasoning_content, content parts)."""
    messages = [dict(m) for m in messages]
    if extras_json:
        for message, extra in zip(messages, orjson.loads(extras_json)):
            message.update(extra or {})
    return messages


def turns_from_batch(batch: pa.RecordBatch, default_thinking: bool) -> list[Turn]:
    batch = conform(batch)
    col = {name: batch.column(name) for name in COLUMNS if name not in ID_COLUMNS}
    py = {name: arr.to_pylist() for name, arr in col.items()}
    prompt_ids = id_arrays(batch.column("prompt_token_ids"))
    completion_ids = id_arrays(batch.column("completion_token_ids"))
    tools_cache: dict[str, list] = {}
    turns = []
    for i in range(batch.num_rows):
        tools_json = py["tools"][i]
        if tools_json and tools_json not in tools_cache:
            tools_cache[tools_json] = orjson.loads(tools_json)
        thinking = py["thinking"][i]
        turns.append(Turn(
            prompt_id=py["prompt_id"][i], turn=py["turn"][i] or 0,
            messages=sent_messages(py["messages"][i] or [], py["message_extras"][i]),
            tools=tools_cache.get(tools_json) if tools_json else None,
            thinking=default_thinking if thinking is None else bool(thinking),
            reasoning=py["reasoning"][i], content=py["content"][i] or "",
            tool_calls=orjson.loads(py["tool_calls"][i]) if py["tool_calls"][i] else None,
            finish_reason=py["finish_reason"][i] or "", length_stop_in=py["length_stop_in"][i],
            prompt_token_ids=prompt_ids[i], completion_token_ids=completion_ids[i]))
    return turns

"""Completion rows -> token rows, in worker processes: each worker loads the tokenizer once (`init_worker`), turns
one input batch into one output shard and writes it itself (`tokenize_task`); only counts travel back."""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
from omegaconf import OmegaConf

from drafter_data.contract import TOKENS, write_table_atomic
from drafter_data.tokens.conversation import ConversationTokenizer, final_assistant_message
from drafter_data.tokens.tokenizers import load_tokenizer

_worker = {}


def init_worker(settings: dict) -> None:
    """settings: target (plain dict), chat_kwargs, mask_token_id, escape_mask_text, max_length, overlength,
    on_length_finish, server_root (for the server tokenizer)."""
    target = OmegaConf.create(settings["target"])
    mask_id = settings["mask_token_id"]
    literal = frozenset([mask_id]) if settings["escape_mask_text"] and mask_id is not None else frozenset()
    tokenizer = load_tokenizer(target, settings.get("server_root"), literal)
    _worker["conv"] = ConversationTokenizer(target, tokenizer, settings["chat_kwargs"])
    _worker["settings"] = settings


def worker_conversation() -> ConversationTokenizer:
    return _worker["conv"]


def conversation(row: dict) -> list[dict]:
    """The messages to render: the prompt (with per-message extras such as tool_call_id, when prepare kept them)
    and the final assistant turn built from the row's reasoning, content and tool calls."""
    messages = [dict(m) for m in row["messages"]]
    extras = row.get("message_extras")
    if extras:
        for msg, extra in zip(messages, orjson.loads(extras)):
            msg.update(extra or {})
    messages.append(final_assistant_message(row["content"] or "", row.get("reasoning"), row.get("tool_calls")))
    return messages


def tokenize_batch(rows: list[dict]) -> tuple[dict, Counter, list[int]]:
    """Rows -> ({prompt_id, turn, input_ids (int32 arrays), mask_start}, counts by outcome, kept row lengths).
    Every row read is counted once as kept or under a `dropped.<reason>`; policies (length finish, over-long rows,
    mask-token text) are applied here."""
    conv, s = _worker["conv"], _worker["settings"]
    mask_id, max_len = s["mask_token_id"], s["max_length"]
    out = {"prompt_id": [], "turn": [], "input_ids": [], "mask_start": []}
    counts, lengths = Counter(), []
    for row in rows:
        counts["read"] += 1
        if row.get("finish_reason") == "length":
            counts["finish_length"] += 1
            if s["on_length_finish"] == "drop":
                counts["dropped.finish_length"] += 1
                continue
        tools = orjson.loads(row["tools"]) if row.get("tools") else None
        try:
            text, ids, start = conv.tokenize(conversation(row), tools)
        except Exception as exc:  # noqa: BLE001 - a template error on one row must not stop the run
            counts["dropped.render_error"] += 1
            print(f"warning: {row['prompt_id']}: cannot render: {exc}", file=sys.stderr)
            continue
        if conv.tokenizer.literal_specials and any(sp in text for sp in conv.tokenizer.literal_specials):
            counts["mask_text_escaped"] += 1
        if mask_id is not None and (ids == mask_id).any():
            counts["dropped.mask_token_in_text"] += 1
            continue
        if len(ids) > max_len:
            counts["over_max_length"] += 1
            if s["overlength"] == "drop" or start >= max_len:
                counts["dropped.over_max_length"] += 1
                continue
            counts["truncated"] += 1
            ids = ids[:max_len]
        out["prompt_id"].append(row["prompt_id"])
        out["turn"].append(row.get("turn") or 0)
        out["input_ids"].append(ids)
        out["mask_start"].append(start)
        lengths.append(len(ids))
        counts["kept"] += 1
        counts["tokens"] += len(ids)
        counts["loss_tokens"] += len(ids) - start
    return out, counts, lengths


def tokens_table(out: dict) -> pa.Table:
    """Flat numpy buffers, not Python lists of lists: the conversion would cost as much as the tokenizing."""
    lengths = np.fromiter((len(ids) for ids in out["input_ids"]), dtype=np.int32, count=len(out["input_ids"]))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.concatenate(out["input_ids"]) if len(lengths) else np.zeros(0, dtype=np.int32)
    mask = np.ones(len(ids), dtype=np.int8)
    starts = np.asarray(out["mask_start"], dtype=np.int64)
    for begin, start in zip(offsets[:-1], starts):
        mask[begin: begin + start] = 0
    pa_offsets = pa.array(offsets)
    return pa.table([pa.array(out["prompt_id"], pa.string()), pa.array(out["turn"], pa.int32()),
                     pa.ListArray.from_arrays(pa_offsets, pa.array(ids)),
                     pa.ListArray.from_arrays(pa_offsets, pa.array(mask)), pa.array(lengths),
                     pa.array((lengths - starts).astype(np.int32))], schema=TOKENS)


def tokenize_task(task: tuple[int, pa.RecordBatch, str]) -> tuple[Counter, list[int]]:
    """One input batch -> one output shard, written by the worker itself (results never travel back as lists)."""
    index, batch, out_dir = task
    out, counts, lengths = tokenize_batch(batch.to_pylist())
    if out["prompt_id"]:
        # token ids are near-unique per row: dictionary encoding and statistics cost 5x the write, gain nothing
        write_table_atomic(tokens_table(out), Path(out_dir) / f"tokens-{index:05d}.parquet", use_dictionary=False,
                           write_statistics=False)
    return counts, lengths

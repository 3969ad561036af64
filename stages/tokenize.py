"""tokenize: completions in; the exact token sequences the target saw, with loss masks, out (+ meta.json).

Each row's conversation (prompt + final assistant turn built from `reasoning` and `content`) is rendered by the
target's own chat template and tokenized by the target's own tokenizer; loss_mask is 1 after the final assistant
header. Rows are processed in batches across worker processes (local tokenizers) or threads (server tokenizer).
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from array import array
from collections import Counter
from contextlib import nullcontext
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from omegaconf import OmegaConf

from drafter_data.config import StageError, run_stage
from drafter_data.conversation_tokens import ConversationTokenizer, final_assistant_message
from drafter_data.parquet_io import TOKENS, iter_batches, shard_paths, write_table_atomic
from drafter_data.tokenizers import load_tokenizer
from drafter_data.tracking import preload, stage_run

_worker = {}


def _init_worker(settings: dict) -> None:
    target = OmegaConf.create(settings["target"])
    mask_id = settings["mask_token_id"]
    literal = frozenset([mask_id]) if settings["escape_mask_text"] and mask_id is not None else frozenset()
    tokenizer = load_tokenizer(target, settings.get("base_url"), literal)
    _worker["conv"] = ConversationTokenizer(target, tokenizer, settings["thinking"], settings["template_kwargs"])
    _worker["settings"] = settings


def _messages(row: dict) -> list[dict]:
    messages = [dict(m) for m in row["messages"]]
    extras = row.get("message_extras")
    if extras:  # richer per-message fields (tool_call_id, tool_calls, content parts, name) when a source has them
        for msg, extra in zip(messages, orjson.loads(extras)):
            msg.update(extra or {})
    messages.append(final_assistant_message(row["content"] or "", row.get("reasoning"), row.get("tool_calls")))
    return messages


def tokenize_batch(rows: list[dict]) -> tuple[dict, Counter, list[int]]:
    conv, s = _worker["conv"], _worker["settings"]
    mask_id, max_len = s["mask_token_id"], s["max_length"]
    out = {"prompt_id": [], "input_ids": [], "mask_start": []}
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
            text, ids, start = conv.tokenize(_messages(row), tools)
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
    return pa.table([pa.array(out["prompt_id"], pa.string()), pa.ListArray.from_arrays(pa_offsets, pa.array(ids)),
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


def _check_consistency(paths: list[Path], cfg) -> None:
    """Refuse completions made with another thinking mode or target than this run is configured for."""
    for path in paths:
        names = set(pq.read_schema(path).names)
        for column, expected, what in (("thinking", bool(cfg.generation.thinking), "generation.thinking"),
                                       ("target", cfg.target.name, "target")):
            if column not in names:
                continue
            seen = set(pc.unique(pq.read_table(path, columns=[column]).column(column)).to_pylist()) - {None}
            if seen - {expected}:
                raise StageError(f"completions in {cfg.tokenize.input} were generated with {column}={sorted(seen)}, "
                                 f"but this run has {what}={expected}; tokenize them with the same setting")


def _tasks(paths: list[Path], rows_per_shard: int, out_dir: Path):
    for index, batch in enumerate(iter_batches(paths, batch_size=rows_per_shard)):
        yield index, batch, str(out_dir)


def _windowed(map_fn, batches, window: int):
    """map_fn over batches, at most `window` batches in memory at once (pool maps read their input eagerly)."""
    chunk = []
    for batch in batches:
        chunk.append(batch)
        if len(chunk) >= window:
            yield from map_fn(tokenize_task, chunk)
            chunk = []
    if chunk:
        yield from map_fn(tokenize_task, chunk)


def _histogram_png(lengths: np.ndarray, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(lengths, bins=min(50, max(5, len(lengths) // 4 or 5)))
    ax.set_xlabel("tokens per row")
    ax.set_ylabel("rows")
    ax.set_title(f"{len(lengths)} rows, {int(lengths.sum()) if len(lengths) else 0} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(cfg) -> int:
    from drafter_data.local_server import local_server

    tcfg = cfg.tokenize
    in_paths = shard_paths(Path(tcfg.input))
    if not in_paths:
        raise StageError(f"no completion shards (*.parquet) in {Path(tcfg.input).resolve()}; run generate first")
    _check_consistency(in_paths, cfg)
    for key, allowed in (("overlength", ("drop", "truncate")), ("on_length_finish", ("keep", "drop")),
                         ("on_mask_token_text", ("escape", "drop"))):
        if tcfg[key] not in allowed:
            raise StageError(f"tokenize.{key}={tcfg[key]!r}: choose one of {', '.join(allowed)}")
    out_dir = Path(tcfg.output)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    settings = {
        "target": OmegaConf.to_container(cfg.target, resolve=True),
        "thinking": bool(cfg.generation.thinking),
        "template_kwargs": OmegaConf.to_container(tcfg.template_kwargs, resolve=True) or {},
        "mask_token_id": cfg.target.get("mask_token_id"),
        "escape_mask_text": tcfg.on_mask_token_text == "escape",
        "max_length": int(tcfg.max_length),
        "overlength": tcfg.overlength,
        "on_length_finish": tcfg.on_length_finish,
    }
    counts, lengths = Counter(read=0, kept=0), array("i")  # 4 bytes per row, for the length histogram
    rows_per_shard = int(tcfg.get("shard_rows") or 2000)

    def take(result):
        c, lens = result
        counts.update(c)
        lengths.extend(lens)

    server_kind = cfg.target.tokenizer == "server"
    with local_server(cfg.server) if server_kind else nullcontext(None) as base_url:
        settings["base_url"] = base_url if isinstance(base_url, str) else (base_url[0] if base_url else None)
        workers = max(1, int(tcfg.get("workers") or 1))
        # Built here first: a missing file fails once, clearly, before any worker starts (a pool would respawn).
        _init_worker(settings)
        tokenizer = _worker["conv"].tokenizer
        preload()
        if server_kind or workers == 1:
            with ThreadPoolExecutor(max_workers=workers * 2 if server_kind else 1) as pool:
                for result in _windowed(pool.map, _tasks(in_paths, rows_per_shard, out_dir), workers * 2):
                    take(result)
        else:
            with get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(settings,)) as pool:
                for result in _windowed(pool.imap, _tasks(in_paths, rows_per_shard, out_dir), workers * 2):
                    take(result)
        conv = _worker["conv"]
        meta = {
            "target": cfg.target.name,
            "tokenizer": {"kind": tokenizer.kind, "name": tokenizer.name, "files_sha256": tokenizer.files_sha256},
            "vocab_size": tokenizer.vocab_size,
            "special_ids": {"bos": tokenizer.bos_id, "eos": tokenizer.eos_id, "pad": tokenizer.pad_id,
                            "mask_token_id": settings["mask_token_id"]},
            # escape only where the tokenizer can encode the spelling as text; elsewhere such rows are dropped
            "mask_token_text_policy": "escape" if tokenizer.literal_specials else "drop",
            "chat_template_sha256": conv.template.sha256,
            "thinking": settings["thinking"],
            "template_kwargs": conv.kwargs,
            "assistant_header": conv.header,
            "max_length": settings["max_length"],
            "rows": {k: v for k, v in sorted(counts.items()) if k not in ("tokens", "loss_tokens")},
            "tokens": counts["tokens"],
            "loss_tokens": counts["loss_tokens"],
        }
    length_arr = np.asarray(lengths, dtype=np.int64)
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False))
    summary = ", ".join(f"{k}={v}" for k, v in meta["rows"].items())
    print(f"tokenized {counts['kept']} of {counts['read']} rows into {out_dir} ({meta['tokens']} tokens; {summary})",
          file=sys.stderr)
    with stage_run("tokenize", cfg) as run:
        run.metrics({**{f"rows.{k}": v for k, v in meta["rows"].items()}, "tokens": meta["tokens"],
                     "loss_tokens": meta["loss_tokens"],
                     "tokens_per_row_mean": float(length_arr.mean()) if len(length_arr) else 0.0})
        run.artifact(out_dir / "meta.json")
        if len(length_arr):
            with tempfile.TemporaryDirectory() as tmp:
                png = Path(tmp) / "token_lengths.png"
                _histogram_png(length_arr, png)
                run.artifact(png, "plots")
    return 0


if __name__ == "__main__":
    run_stage(main)

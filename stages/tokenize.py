"""tokenize: completions in; the exact token sequences the target saw, with loss masks, out (+ meta.json).

Each row's conversation (prompt + final assistant turn built from `reasoning` and `content`) is rendered by the
target's own chat template with the kwargs a request sends (the thinking switch and the template kwargs), and
tokenized by the target's own tokenizer; loss_mask is 1 after the final assistant header. Batches go to worker processes (local tokenizers) or threads
(the server tokenizer), which write their own shards.

    in:  tokenize.input (completion shards), the target's tokenizer (target.tokenizer_dir, or the running server)
    out: tokenize.output: tokens-*.parquet, meta.json
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from array import array
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
from omegaconf import OmegaConf

from drafter_data.config import run_stage
from drafter_data.contract import iter_batches, shard_paths
from drafter_data.errors import StageError
from drafter_data.plots import png_figure
from drafter_data.server.endpoints import api_root
from drafter_data.server.serving import servers
from drafter_data.tokens.chat_template import chat_template_kwargs
from drafter_data.tokens.rows import init_worker, tokenize_task, worker_conversation
from drafter_data.tracking import preload, stage_run

POLICIES = {"overlength": ("drop", "truncate"), "on_length_finish": ("keep", "drop"),
            "on_mask_token_text": ("escape", "drop")}


def main(cfg) -> int:
    tcfg = cfg.tokenize
    in_paths = input_shards(Path(tcfg.input))
    check_consistency(in_paths, cfg)
    check_policies(tcfg)
    out_dir = fresh_output(Path(tcfg.output))
    settings = worker_settings(cfg)
    server_kind = cfg.target.tokenizer == "server"
    with servers(cfg.server) if server_kind else nullcontext([None]) as urls:
        settings["server_root"] = api_root(urls[0]) if urls[0] else None
        counts, lengths = tokenize_all(in_paths, out_dir, settings, int(tcfg.get("workers") or 1), server_kind,
                                       int(tcfg.get("shard_rows") or 2000))
        meta = metadata(cfg, settings, counts)
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False))
    summary = ", ".join(f"{k}={v}" for k, v in meta["rows"].items())
    print(f"tokenized {counts['kept']} of {counts['read']} rows into {out_dir} ({meta['tokens']} tokens; {summary})",
          file=sys.stderr)
    log_run(cfg, meta, out_dir, np.asarray(lengths, dtype=np.int64))
    return 0


def input_shards(directory: Path) -> list[Path]:
    paths = shard_paths(directory)
    if not paths:
        raise StageError(f"no completion shards (*.parquet) in {directory.resolve()}; run generate first")
    return paths


def check_consistency(paths: list[Path], cfg) -> None:
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


def check_policies(tcfg) -> None:
    for key, allowed in POLICIES.items():
        if tcfg[key] not in allowed:
            raise StageError(f"tokenize.{key}={tcfg[key]!r}: choose one of {', '.join(allowed)}")


def fresh_output(out_dir: Path) -> Path:
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    return out_dir


def worker_settings(cfg) -> dict:
    """Everything a worker process needs, as plain data (workers are spawned)."""
    tcfg = cfg.tokenize
    thinking = bool(cfg.generation.thinking)
    template_kwargs = OmegaConf.to_container(tcfg.template_kwargs, resolve=True) if tcfg.template_kwargs else {}
    return {"target": OmegaConf.to_container(cfg.target, resolve=True), "thinking": thinking,
            "chat_kwargs": chat_template_kwargs(cfg.target.thinking_kwarg, thinking, template_kwargs),
            "mask_token_id": cfg.target.get("mask_token_id"),
            "escape_mask_text": tcfg.on_mask_token_text == "escape", "max_length": int(tcfg.max_length),
            "overlength": tcfg.overlength, "on_length_finish": tcfg.on_length_finish}


def tokenize_all(in_paths: list[Path], out_dir: Path, settings: dict, workers: int, server_kind: bool,
                 rows_per_shard: int) -> tuple[Counter, array]:
    """Every input batch through tokenize_task; returns the summed counts and the kept rows' lengths."""
    counts, lengths = Counter(read=0, kept=0), array("i")  # 4 bytes per row, for the length histogram
    # Built here first: a missing file fails once, clearly, before any worker starts (a pool would respawn).
    init_worker(settings)
    preload()
    tasks = ((i, batch, str(out_dir)) for i, batch in enumerate(iter_batches(in_paths, batch_size=rows_per_shard)))
    if server_kind or workers == 1:
        pool = ThreadPoolExecutor(max_workers=workers * 2 if server_kind else 1)
        imap = pool.map
    else:
        pool = get_context("spawn").Pool(workers, initializer=init_worker, initargs=(settings,))
        imap = pool.imap
    with pool:
        for c, lens in _windowed(imap, tasks, workers * 2):
            counts.update(c)
            lengths.extend(lens)
    return counts, lengths


def _windowed(map_fn, tasks, window: int):
    """map_fn over tasks, at most `window` batches in memory at once (pool maps read their input eagerly)."""
    chunk = []
    for task in tasks:
        chunk.append(task)
        if len(chunk) >= window:
            yield from map_fn(tokenize_task, chunk)
            chunk = []
    if chunk:
        yield from map_fn(tokenize_task, chunk)


def metadata(cfg, settings: dict, counts: Counter) -> dict:
    conv = worker_conversation()
    tokenizer = conv.tokenizer
    return {
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


def log_run(cfg, meta: dict, out_dir: Path, lengths: np.ndarray) -> None:
    with stage_run("tokenize", cfg) as run:
        run.metrics({**{f"rows.{k}": v for k, v in meta["rows"].items()}, "tokens": meta["tokens"],
                     "loss_tokens": meta["loss_tokens"],
                     "tokens_per_row_mean": float(lengths.mean()) if len(lengths) else 0.0})
        run.artifact(out_dir / "meta.json")
        if len(lengths):
            with tempfile.TemporaryDirectory() as tmp:
                png = Path(tmp) / "token_lengths.png"
                with png_figure(png) as ax:
                    ax.hist(lengths, bins=min(50, max(5, len(lengths) // 4 or 5)))
                    ax.set_xlabel("tokens per row")
                    ax.set_ylabel("rows")
                    ax.set_title(f"{len(lengths)} rows, {int(lengths.sum())} tokens")
                run.artifact(png, "plots")


if __name__ == "__main__":
    run_stage(main)

"""tokenize: completions in; the exact token sequences the target saw and produced, with loss masks, out (+ meta.json).

Each training row is a context exactly as the server was sent it (the prompt rendered by the target's own chat
template with add_generation_prompt=True, in the row's own thinking mode, tools included) and what the target
produced after it (loss_mask 1). With the server's ids those are its prompt_token_ids and sampled ids, and the text
is retokenized only to measure drift; without them both are the target's tokenizer on the rendered text.
tokenize.rows=per_turn makes one row per regenerated turn, conversation one row per conversation. Work goes to
worker processes (local tokenizers) or threads (the server tokenizer), which read their input and write their shards.

    in:  tokenize.input (completion shards), the target's tokenizer (target.tokenizer_dir, or the running server)
    out: tokenize.output: tokens-*.parquet, meta.json

The output directory is written whole: into `.<name>.partial-<pid>` beside it, renamed into place once complete
(outputs.StagedOutputDir), so a tokenize that fails or is stopped leaves the previous output as it was. A result that
crosses a threshold (checks.result_problems) is still put in place, with its problems in meta.json's `refused`, and
then the stage exits 1 naming that meta.json.
"""
from __future__ import annotations

import json
import shutil
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from omegaconf import OmegaConf

from drafter_data.config import run_stage
from drafter_data.contract import shard_paths
from drafter_data.errors import StageError
from drafter_data.outputs import StagedOutputDir
from drafter_data.tokens.duplicates import kept_mask, repeated_rows
from drafter_data.tokens.checks import (OUTPUT_MARKERS, check_consistency, check_output_dir, check_policies,
                                        render_kwargs, result_problems)
from drafter_data.tokens.lengths import LengthHistograms
from drafter_data.tokens.regroup import partition_by_conversation
from drafter_data.tokens.source_digest import DIGEST_KEY, SHARDS_KEY, completions_digest, shard_digests
from drafter_data.tokens.server_root import server_root
from drafter_data.tokens.report import log_run, metadata, summary_lines, throughput
from drafter_data.tokens.rows import (first_examples, init_worker, tokenize_task, worker_conversation,
                                      worker_settings_loaded)
from drafter_data.tracking import stage_run
from drafter_data.worker_processes import FORKED, worker_processes

REPO = Path(__file__).resolve().parents[1]


def main(cfg) -> int:
    tcfg = cfg.tokenize
    in_paths = input_shards(Path(tcfg.input))
    check_policies(tcfg)
    check_consistency(in_paths, cfg)
    skips = repeated_rows(in_paths)  # a row found twice is read once; two different ones are refused here
    source = {DIGEST_KEY: completions_digest(in_paths)}  # which completions these tokens are (export checks it)
    protected = protected_paths(cfg)
    check_output_dir(Path(tcfg.output), protected)  # a refused output fails here, before any work
    # everything is written into staged.path (the workers' shards, the .conversations scratch partition, meta.json),
    # which commit() renames to tokenize.output once complete; leaving the block without it deletes staged.path.
    # Forked workers inherit the block but never run its exit (StagedOutputDir checks the pid)
    with StagedOutputDir(Path(tcfg.output), "tokenize.output", {k: v for k, v in protected.items() if v is not None},
                         OUTPUT_MARKERS) as staged:
        settings = worker_settings(cfg, staged.path)
        with server_root(cfg) as root:
            settings["server_root"] = root
            init_worker(settings)  # here first: a missing file fails once, clearly, before any worker starts
            tasks = plan_tasks(in_paths, staged.path, settings, skips)
            # workers are forked before MLflow's thread starts (they start with the tokenizer loaded); MLflow's
            # start-up (~2.5 s of CPU) is then let finish before the tasks go out, so it does not take their cores
            with task_map(int(tcfg.get("workers") or 1), root is not None, len(tasks)) as map_tasks, \
                    stage_run("tokenize", cfg) as run:
                run.settle(max_s=10)
                counts, lengths, examples = tokenize_all(map_tasks, tasks, settings["max_length"])
                shutil.rmtree(staged.path / ".conversations", ignore_errors=True)
                finish(cfg, run, staged, {**metadata(cfg, settings, worker_conversation(), counts, examples),
                                          **source}, throughput(counts), lengths)
    warn_if_generate_did_not_finish(Path(tcfg.input))  # after the summary: an error or refusal stays one line
    return 0


def finish(cfg, run, staged: StagedOutputDir, meta: dict, speed: dict, lengths) -> None:
    """meta.json, the output put in place, the summary, MLflow (from the final directory); then a one-line refusal
    when the result crosses a threshold. A refused result is put in place too, its problems in meta.json's `refused`:
    the stage exits 1 (so DVC records nothing) and the message names a meta.json that exists, beside the rows it
    describes; the previous output is gone either way under `dvc repro`, which deletes it before the stage runs."""
    tcfg = cfg.tokenize
    problems = result_problems(meta, float(tcfg.max_drop_share), float(tcfg.max_drift_rate),
                               float(tcfg.max_prompt_mismatch_rate))
    if problems:
        meta = {**meta, "refused": problems}
    meta[SHARDS_KEY] = shard_digests(list(staged.path.glob("tokens-*.parquet")))
    (staged.path / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False))
    out_dir = staged.commit()
    print("\n".join(summary_lines(meta, speed, out_dir, float(tcfg.max_drift_rate),
                                  float(tcfg.max_prompt_mismatch_rate))), file=sys.stderr)
    log_run(run, meta, speed, out_dir, lengths,
            estimated_reasoning=getattr(worker_conversation().tokenizer, "think_end_id", None) is None)
    if problems:
        raise StageError("; ".join(problems) + f" (details in {out_dir / 'meta.json'})")


def warn_if_generate_did_not_finish(directory: Path) -> None:
    """Under DVC tokenize runs only after generate succeeded; run by hand it may be given the completions of a run
    that stopped or was killed: that is allowed (to look at a run in progress), never unnoticed."""
    try:
        summary = json.loads((directory / "run.json").read_text())
    except (OSError, ValueError):
        print(f"warning: {directory} has no readable run.json: the generate run that made it may not have finished "
              f"(stopped or killed); these tokens are then of part of the prompts", file=sys.stderr)
        return
    left, failed, why = summary.get("conversations_left"), summary.get("failed_total"), summary.get("stopped_reason")
    if why or left or failed:
        print(f"warning: the generate run in {directory} did not finish: {left or 0} conversations left undone, "
              f"{failed or 0} failed for good{f' (it stopped: {why})' if why else ''}; these tokens are of part of "
              f"the prompts (re-run generate to finish it)", file=sys.stderr)


def input_shards(directory: Path) -> list[Path]:
    paths = shard_paths(directory)
    if not paths:
        raise StageError(f"no completion shards (*.parquet) in {directory.resolve()}; run generate first")
    return paths


def protected_paths(cfg) -> dict:
    target = cfg.target
    return {"the input": Path(cfg.tokenize.input), "the repo": REPO, "the working directory": Path.cwd(),
            "the tokenizer directory": Path(target.tokenizer_dir) if target.get("tokenizer_dir") else None,
            "the chat template": Path(target.chat_template) if target.get("chat_template") else None}


def worker_settings(cfg, out_dir: Path) -> dict:
    """Everything a worker process needs, as plain data (where workers are spawned, not forked)."""
    tcfg = cfg.tokenize
    thinking = bool(cfg.generation.thinking)
    return {"target": OmegaConf.to_container(cfg.target, resolve=True), "thinking": thinking,
            "chat_kwargs": render_kwargs(cfg, thinking),
            "rows": tcfg.get("rows") or "per_turn", "mask_token_id": cfg.target.get("mask_token_id"),
            "escape_mask_text": tcfg.on_mask_token_text == "escape", "max_length": int(tcfg.max_length),
            "overlength": tcfg.overlength, "on_length_finish": tcfg.on_length_finish,
            "shard_rows": int(tcfg.get("shard_rows") or 2000), "out_dir": str(out_dir)}


def plan_tasks(in_paths: list[Path], out_dir: Path, settings: dict, skips: dict | None = None
               ) -> list[tuple[str, list]]:
    """Tasks of about shard_rows input rows: (name, [(path, row group or None for a whole file, the rows of it not to
    read or None), ...]). For conversation rows, the input is first partitioned so each task holds whole
    conversations. `skips`: repeated_rows' later copies, per shard."""
    skips = skips or {}
    if settings["rows"] == "conversation":
        parts = partition_by_conversation(in_paths, out_dir / ".conversations", settings["shard_rows"], skips)
        return [(f"{i:05d}", [(str(p), None, None)]) for i, p in enumerate(parts)]
    tasks, pieces, rows = [], [], 0
    for path in in_paths:
        meta, start = pq.ParquetFile(path).metadata, 0
        for rg in range(meta.num_row_groups):
            length = meta.row_group(rg).num_rows
            keep = kept_mask(skips.get(str(path)), start, length)
            pieces.append((str(path), rg, None if keep is None else np.flatnonzero(~keep)))
            start += length
            rows += length
            if rows >= settings["shard_rows"]:
                tasks.append((f"{len(tasks):05d}", pieces))
                pieces, rows = [], 0
    if pieces:
        tasks.append((f"{len(tasks):05d}", pieces))
    return tasks


def tokenize_all(map_tasks, tasks: list, max_length: int) -> tuple[Counter, LengthHistograms, dict]:
    """Every task through tokenize_task; returns the summed counts (with the tokenizing window and the workers'
    busy time, in ms), the length histograms and the first named rows of each comparison."""
    counts, lengths, examples = Counter(read=0, kept=0), LengthHistograms(max_length), {}
    first, last = float("inf"), 0.0
    for task_counts, task_lengths, (start, end), task_examples in map_tasks(tokenize_task, tasks):
        counts.update(task_counts)
        lengths.merge(task_lengths)
        for name, found in task_examples.items():
            examples[name] = first_examples([examples.get(name, []), found])
        first, last = min(first, start), max(last, end)
        counts["time.busy_ms"] += round((end - start) * 1000)
    counts["time.window_ms"] = round(max(0.0, last - first) * 1000)
    return counts, lengths, examples


@contextmanager
def task_map(workers: int, server_kind: bool, n_tasks: int):
    """Threads for the server tokenizer (the work is the server's) or a single worker; else worker processes,
    forked where the platform allows: they start with the tokenizer this process loaded (no imports, no second
    load). Enter it before any thread of ours starts."""
    if server_kind or workers == 1 or n_tasks == 1:
        with ThreadPoolExecutor(max_workers=workers * 2 if server_kind else 1) as pool:
            yield pool.map
        return
    # forked workers start with the tokenizer this process loaded
    with worker_processes(min(workers, n_tasks), None if FORKED else init_worker,
                          () if FORKED else (worker_settings_loaded(),)) as pool:
        yield pool.map

if __name__ == "__main__":
    run_stage(main)

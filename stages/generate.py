"""generate: prompts in; the target's own completions (reasoning + answer) out, exactly once per prompt.

Survives days of running: faults are retried with backoff (a server that goes away is waited for, not burned
through), shards are complete or absent after any kill, a re-run sends only what is missing, and a re-run with other
generation params moves the old rows aside instead of reusing them. Ctrl-C/SIGTERM: stop sending, give in-flight
requests a grace period, write what finished, exit non-zero.

    in:  generate.input (prompt shards), the server(s) at server.base_url
    out: generate.output: completions-*.parquet, errors.jsonl (requests that failed for good), run.json (summary)
"""
from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

from drafter_data.config import run_stage
from drafter_data.contract import shard_paths
from drafter_data.errors import StageError
from drafter_data.generation.progress import assessed_tokens_per_s
from drafter_data.generation.runner import Runner, RunSettings
from drafter_data.generation.store import CompletionStore, ErrorLog
from drafter_data.generation.work import current_keys, iter_todo
from drafter_data.server.client import make_client
from drafter_data.server.endpoints import api_key
from drafter_data.server.serving import servers
from drafter_data.server.pool import ServerPool, ServerState
from drafter_data.server.preflight import preflight
from drafter_data.server.request import RequestSpec
from drafter_data.tracking import stage_run


def main(cfg) -> int:
    spec = RequestSpec.from_config(cfg)
    with stage_run("generate", cfg) as run, servers(cfg.server) as urls:
        return asyncio.run(generate(cfg, spec, urls, run))


async def generate(cfg, spec: RequestSpec, urls: list[str], run) -> int:
    g = cfg.generate
    settings = RunSettings.from_config(cfg)
    prompts = input_shards(Path(g.input))
    identity = spec.identity(cfg.target.name)
    wanted = current_keys(prompts, identity)
    store = CompletionStore(Path(g.output))
    done = resume(store, wanted)
    pool = await connect(cfg, spec, urls, settings)
    errors = ErrorLog(Path(g.output) / "errors.jsonl")
    runner = Runner(spec, settings, pool, store, errors, run, assessed_tokens_per_s(g.get("assessment")))
    try:
        await runner.run_all(iter_todo(prompts, identity, done), len(wanted) - len(done))
    finally:
        await pool.close()
        summarize(runner, store, errors, done, wanted, Path(g.output), run)
    if runner.stopping.is_set():
        return 128 + int(runner.signal or signal.SIGINT)
    return 0


def input_shards(directory: Path) -> list[Path]:
    paths = shard_paths(directory)
    if not paths:
        raise StageError(f"no prompt shards (*.parquet) in {directory.resolve()}; run prepare first")
    return paths


def resume(store: CompletionStore, wanted: set[str]) -> set[str]:
    """The request keys already done; rows the current config would not produce are moved aside."""
    done = store.scan(wanted)
    if store.stale_rows:
        print(f"moved {store.stale_rows} completions made with other generation params or for prompts no longer in "
              f"the input to {store.stale_dir}", file=sys.stderr)
    print(f"{len(wanted)} prompts: {len(done)} already done, {len(wanted) - len(done)} to generate", file=sys.stderr)
    return done


async def connect(cfg, spec: RequestSpec, urls: list[str], settings: RunSettings) -> ServerPool:
    """A client per server, each checked by preflight before the first prompt is sent."""
    key = api_key(cfg.server)
    timeout = float(cfg.server.request_timeout_s)
    states = [ServerState(u, make_client(u, key, settings.concurrency, timeout)) for u in urls]
    for s in states:
        await preflight(s.client, s.url, spec, settings.stream)
    return ServerPool(states, float(cfg.generate.server_down_timeout_s))


def summarize(runner: Runner, store: CompletionStore, errors: ErrorLog, done_before: set[str], wanted: set[str],
              out_dir: Path, run) -> None:
    """Compacts the shards, settles errors.jsonl, writes run.json, logs the run and prints one line."""
    store.compact()  # keeps every row: what is done is what was done plus this run's completions
    all_done = done_before | runner.written_keys
    n_errors = errors.close(all_done)
    metrics = {**runner.progress.metrics(), "done_total": len(all_done), "failed_total": n_errors}
    summary = {**metrics, "elapsed_s": runner.progress.elapsed(), "prompts": len(wanted),
               "stale_moved": store.stale_rows}
    (out_dir / "run.json").write_text(json.dumps(summary, indent=2))
    run.artifact(out_dir / "run.json")
    run.artifact(out_dir / "errors.jsonl")
    run.metrics(metrics)
    c = runner.c
    print(f"generate: {c.done} completions this run ({len(all_done)}/{len(wanted)} done), {c.errors} failed for "
          f"good, {c.retries} retries, {metrics['output_tokens_per_s']:.1f} output tok/s", file=sys.stderr)


if __name__ == "__main__":
    run_stage(main)

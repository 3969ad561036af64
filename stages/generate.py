"""generate: prompts in; the target's own completions (reasoning + answer) out, exactly once per prompt and turn.

Survives days of running: faults are retried with backoff (a server that goes away is waited for, not burned
through; a fault that no request can get past stops the run), shards are complete or absent after any kill, a re-run
sends only what is missing, and a re-run with other generation params moves the old rows aside instead of reusing
them (and takes them back when the params return). Conversations (prepare.turns=all) are answered turn by turn, each
turn sent with the target's own earlier answers. Ctrl-C/SIGTERM: stop sending, let in-flight requests finish, write
what finished, exit non-zero.

    in:  generate.input (prompt shards), the server(s) at server.base_url
    out: generate.output: completions-*.parquet, errors.jsonl (requests that failed for good), run.json (summary)
"""
from __future__ import annotations

import asyncio
import json
import signal
import sys
import tempfile
from pathlib import Path

from drafter_data.config import run_stage
from drafter_data.contract import shard_paths
from drafter_data.errors import StageError
from drafter_data.generation.error_log import ErrorLog
from drafter_data.generation.keys import KeySet
from drafter_data.output_lock import OutputLock
from drafter_data.outputs import check_apart
from drafter_data.generation.concurrency import LevelController
from drafter_data.generation.progress import CLIENT_WAY_PAST, Assessment
from drafter_data.generation.runner import Runner, RunSettings
from drafter_data.generation.store import CompletionStore, ResumePlan
from drafter_data.generation.work import InputKeys, ThinkingModes, input_keys, iter_todo, not_started
from drafter_data.server.client import make_client
from drafter_data.redaction import redact_url
from drafter_data.server.endpoints import api_key, check_api_key_env
from drafter_data.server.pool import ServerPool, ServerState
from drafter_data.server.preflight import preflight
from drafter_data.server.request import RequestSpec
from drafter_data.server.serving import servers
from drafter_data.tracking import stage_run


def main(cfg) -> int:
    check_api_key_env(cfg.server)  # before anything is logged: a key pasted as the variable's name must not leak
    spec = RequestSpec.from_config(cfg)
    out = Path(cfg.generate.output)
    check_apart(out, "generate.output", {"generate.input": Path(cfg.generate.input)})
    with OutputLock(out / ".lock", "generate", out), stage_run("generate", cfg) as run, servers(cfg.server) as urls:
        return asyncio.run(generate(cfg, spec, urls, run))


async def generate(cfg, spec: RequestSpec, urls: list[str], run) -> int:
    g = cfg.generate
    settings = RunSettings.from_config(cfg)
    modes = ThinkingModes.from_config(cfg.generation)
    prompts = input_shards(Path(g.input))
    inputs = input_keys(prompts, spec, cfg.target.name, modes)
    store = CompletionStore(Path(g.output))
    wanted0 = KeySet(inputs.keys)
    plan = store.plan(wanted0, require_ids=spec.token_ids == "on", keep_reasoning=settings.keep_reasoning)
    assessed = Assessment.read(g.get("assessment"), {"model": spec.model, "kind": str(cfg.server.get("kind")),
                                                     "urls": [redact_url(u) for u in urls]})
    pool = await connect(cfg, spec, urls, settings, modes)
    if settings.auto:
        follow_each_server(pool, settings, assessed, str(cfg.server.get("kind")) == "local")
    plan = apply(store, plan, wanted0, spec.token_ids == "on", settings.keep_reasoning)
    del wanted0
    errors = ErrorLog(Path(g.output) / "errors.jsonl", plan.valid)
    fresh = not_started(inputs, plan)
    total = report_resume(inputs, fresh, plan)
    if not settings.auto:
        warn_above_slots(pool, settings.concurrency, total, float(cfg.server.request_timeout_s))
    runner = Runner(spec, settings, pool, store, errors, run, assessed)
    run.settle(max_s=10)  # MLflow's start-up, done before the request loop rather than inside it
    ended_by = None
    try:
        await runner.run_all(iter_todo(prompts, inputs, fresh, plan, settings.keep_reasoning), total)
    except BaseException as exc:
        ended_by = exc
        raise
    finally:
        await pool.close()
        try:
            summarize(runner, store, errors, plan, inputs, Path(g.output), run)
        except Exception as exc:  # the reason the run ended is the message; this one is a warning beside it
            if ended_by is None:
                raise
            print(f"warning: summarizing the run failed too ({type(exc).__name__}: {exc})", file=sys.stderr)
    if store.lost:  # found unreadable after the plan counted their rows: the output lacks them
        raise StageError(f"{len(store.lost)} completion shard(s) turned out unreadable during the run and were "
                         f"moved to {store.quarantine_dir} ({store.lost[0][0]}: {store.lost[0][1]}); their prompts "
                         f"are missing from {g.output}: re-run generate to make them again")
    if runner.signal is not None:
        run.stopped_by_signal = True
        return 128 + int(runner.signal or signal.SIGINT)
    if runner.c.errors and not runner.c.done:
        what = "the one request" if runner.c.errors == 1 else f"all {runner.c.errors} requests"
        raise StageError(f"{what} of this run failed for good and none was answered (reasons in {errors.path})")
    return 0


INPUT_KEY = "generate.input"


def input_shards(directory: Path) -> list[Path]:
    paths = shard_paths(directory)
    if not paths:
        raise StageError(f"no prompt shards (*.parquet) in {directory.resolve()}; run prepare first")
    return paths


async def connect(cfg, spec: RequestSpec, urls: list[str], settings: RunSettings, modes: ThinkingModes) -> ServerPool:
    """A client per server, each checked by preflight before the first prompt is sent, in every thinking mode the
    run uses (on: the server must return reasoning; off: none)."""
    key = api_key(cfg.server)
    timeout = float(cfg.server.request_timeout_s)
    states = [ServerState(u, make_client(u, key, settings.concurrency, timeout)) for u in urls]
    probe = spec if modes.ratio is None else spec.with_thinking(modes.ratio > 0)  # token ids asked with reasoning
    try:
        for s in states:
            features = await preflight(s.client, s.url, probe, settings.stream, settings.max_backoff_s,
                                       modes=modes.used())
            s.spec, s.engine, s.slots = spec.with_token_ids(features.token_ids), features.engine, features.slots
            slots = f", {slot_count(features.slots)}" if features.slots else ""
            print(f"{redact_url(s.url)}: {features.engine}{slots}, token ids: "
                  f"{features.token_ids or 'none offered' if spec.token_ids != 'off' else 'off'}", file=sys.stderr)
    except BaseException:
        for s in states:
            await s.client.close()
        raise
    return ServerPool(states, float(cfg.generate.server_down_timeout_s))


def slot_count(n: int) -> str:
    return f"{n} slot{'s' * (n > 1)}"


def warn_above_slots(pool: ServerPool, concurrency: int, conversations: int, timeout_s: float) -> None:
    """A fixed level that sends a server more than the slots it says it has: the rest wait in its queue, a wait that
    counts against the request timeout and makes no more tokens. The pool keeps the servers' requests even, so each
    gets about level / servers whatever its slots (the extra ones, counted here where they queue most); the level
    reached is at most the conversations to do (one request each at a time)."""
    slots = [s.slots for s in pool.states]
    if not all(slots):
        return
    n, level = len(slots), min(concurrency, conversations)
    shares = [level // n + (i < level % n) for i in range(n)]
    queued = sum(max(0, share - slot) for share, slot in zip(shares, sorted(slots)))
    if not queued:
        return
    wait = f"{queued} wait{'s' * (queued == 1)}"
    if n == 1:
        what = f"the server runs {slots[0]} at once (its slots): {wait} in its queue"
        fix = f"{slots[0]}"
    else:
        share = f"{level / n:.0f}" if level % n == 0 else f"{level / n:.1f}"
        what = (f"the pool sends each of the {n} servers about {share} and they run "
                f"{' + '.join(map(str, slots))} at once (their slots): up to {wait} in their queues")
        fix = f"{n * min(slots)} ({n} x the fewest slots)"
    print(f"warning: generation.concurrency={concurrency}, but {what}, where the wait counts against "
          f"server.request_timeout_s ({timeout_s:g} s); generation.concurrency={fix} or auto queues none",
          file=sys.stderr)


def follow_each_server(pool: ServerPool, settings: RunSettings, assessed: Assessment, local: bool) -> None:
    """concurrency=auto: a level controller per server; the server assess measured starts at its best level, any
    other climbs from the bottom. None climbs past the requests its engine says it runs at once (its slots): more
    only wait in its queue, and a search among levels that tie there follows noise."""
    for server in pool.states:
        start = assessed.concurrency if assessed.measured(redact_url(server.url), local) else None
        high = min(settings.concurrency, server.slots or settings.concurrency)
        low = min(settings.concurrency_min, high)
        server.controller = LevelController.starting_at(start, low, high)
        pool.set_limit(server, server.controller.level)
        how = "not assessed: climbing from there"
        if start:
            level = "" if start == server.controller.level else f" {start}"
            how = f"the assessed best level{level}"
        why = ""
        if high < settings.concurrency:
            lowered = ", concurrency_min lowered to them" if low < settings.concurrency_min else ""
            why = f" (the server's {slot_count(high)}{lowered})"
        print(f"concurrency: auto, {redact_url(server.url)} starts at {server.controller.level} ({how}), within "
              f"[{low}, {high}]{why}", file=sys.stderr)


def apply(store: CompletionStore, plan: ResumePlan, wanted0: KeySet, require_ids: bool, keep_reasoning: bool
          ) -> ResumePlan:
    """Moves what the plan says, saying so: unreadable shards, rows of other params, rows wanted again. A shard
    found unreadable only now (its key columns read, another column does not) is quarantined too, and the plan is
    made again without it. Returns the plan in force."""
    store.apply(plan)
    broken = [(path.name, reason) for path, reason in plan.broken]
    while store.lost:
        broken += store.lost
        store.lost = []
        plan = store.plan(wanted0, require_ids=require_ids, keep_reasoning=keep_reasoning)
        store.apply(plan)
        broken += [(path.name, reason) for path, reason in plan.broken]
    for name, reason in broken:
        print(f"moved unreadable shard {name} to {store.quarantine_dir} ({reason}); its prompts are "
              f"generated again", file=sys.stderr)
    if plan.stale_rows:
        print(f"moved {plan.stale_rows} completions made with other generation params or for prompts no longer in "
              f"the input to {store.stale_dir}", file=sys.stderr)
    if plan.restored_rows:
        print(f"restored {plan.restored_rows} completions from {store.stale_root}: the current config asks for them "
              f"again", file=sys.stderr)
    return plan


def report_resume(inputs: InputKeys, fresh, plan: ResumePlan) -> int:
    new, continuing = int(fresh.sum()), len(plan.continue_rows)
    prompts = len(inputs.keys) - inputs.repeated
    done = prompts - new - continuing
    more = f" ({continuing} conversations to continue)" if continuing else ""
    if inputs.repeated:
        print(f"{inputs.repeated} input prompts are copies of others (the same prompt twice in {INPUT_KEY}, e.g. a "
              f"shard copied): each is generated once", file=sys.stderr)
    print(f"{prompts} prompts: {done} already done, {new + continuing} to generate{more}", file=sys.stderr)
    return new + continuing


def summarize(runner: Runner, store: CompletionStore, errors: ErrorLog, plan: ResumePlan, inputs: InputKeys,
              out_dir: Path, run) -> None:
    """Compacts the shards, settles errors.jsonl, writes run.json, logs the run and prints one line. Runs after
    any ending, also a failed one: a step that fails here is reported and never hides why the run ended."""
    try:
        store.compact()  # keeps every row: what is done is what was done plus this run's completions
    except OSError as exc:
        print(f"warning: compacting {out_dir} failed ({exc}); the rows are safe in their small shards",
              file=sys.stderr)
    n_errors = errors.close()
    rows_total = len(plan.valid) + runner.saved  # what is on disk, not what was answered
    metrics = {**runner.progress.metrics(), "done_total": rows_total, "failed_total": n_errors}
    levels = {redact_url(sv.url): [[round(t - runner.progress.t0, 1), level, round(rate, 1)]
                                    for t, level, rate in sv.controller.history]
              for sv in runner.pool.states if sv.controller is not None}
    summary = {**metrics, "retry_reasons": dict(runner.c.retry_reasons.most_common()), "saved": runner.saved,
               "elapsed_s": runner.progress.elapsed(), "prompts": len(inputs.keys) - inputs.repeated,
               **({"concurrency_levels": levels} if levels else {}),
               "client_bound": runner.progress.client.ever_bound,
               **({"client_limit": CLIENT_WAY_PAST} if runner.progress.client.ever_bound else {}),
               "stale_moved": plan.stale_rows, "restored": plan.restored_rows,
               "quarantined_shards": len(plan.broken), "stopped_reason": runner.fatal,
               # conversations this run was to settle and did not (stopped, killed): tokenize warns of them
               "conversations_left": max(0, runner.progress.total - runner.c.conversations)}
    try:
        (out_dir / "run.json").write_text(json.dumps(summary, indent=2))
    except OSError as exc:
        print(f"warning: cannot write {out_dir / 'run.json'} ({exc})", file=sys.stderr)
    run.artifact(out_dir / "run.json")
    run.artifact(out_dir / "errors.jsonl")
    run.metrics({k: v for k, v in metrics.items() if v is not None})
    run.tags({"client_bound": str(runner.progress.client.ever_bound).lower(),
              **({"client_limit": CLIENT_WAY_PAST} if runner.progress.client.ever_bound else {})})
    with tempfile.TemporaryDirectory() as tmp:
        if runner.progress.plot(Path(tmp) / "throughput_over_time.png"):
            run.artifact(Path(tmp) / "throughput_over_time.png", "plots")
    c = runner.c
    ratio = metrics["throughput_vs_assessed"]
    steady, assessed = metrics["steady_output_tokens_per_s"], metrics["assessed_output_tokens_per_s"]
    check = ""
    if assessed and ratio is not None:
        check = f" ({steady:.1f} with every slot busy: {ratio:.2f}x the assessed {assessed:.1f})"
    elif assessed and c.done:
        check = (f" (no answer finished with every slot busy, so no steady rate to check against the assessed "
                 f"{assessed:.1f})")
    lost = f" ({c.done - runner.saved} more answered but not saved)" if c.done > runner.saved else ""
    if c.thinking_without_reasoning:
        print(f"warning: {c.thinking_without_reasoning} of {c.done} answers asked to think came back without "
              f"reasoning (kept; counted as thinking_without_reasoning in run.json): if that is most of them, the "
              f"server's reasoning parser may be off", file=sys.stderr)
    if c.unnamed_model:
        print(f"warning: {c.unnamed_model} of {c.done} answers named no model, so nothing checked that they came "
              f"from {runner.spec.model!r} (server.model)", file=sys.stderr)
    print(f"generate: {runner.saved} completions this run{lost} ({rows_total} rows in {out_dir}), {c.errors} failed "
          f"for good, {c.retries} retries, {metrics['output_tokens_per_s']:.1f} output tok/s{check}", file=sys.stderr)
    if runner.progress.client.ever_bound:
        print(f"generate: for {metrics['client_bound_share']:.0%} of the run (peak "
              f"{metrics['client_cpu_cores_peak']:.2f} of a core) {CLIENT_WAY_PAST}", file=sys.stderr)


if __name__ == "__main__":
    run_stage(main)

"""assess: measure the server's real throughput at several concurrency levels and project the whole job's time and
storage before anyone commits weeks of GPU time.

Each level runs unique prompts (repeats would hit the prefix cache and inflate throughput) through the same client
path and thinking switch as generate; rates are taken over a steady window, ramp-up and tail excluded.

    in:  the server at server.base_url; assess.input (prepare's prompts, optional: built-in prompts otherwise)
    out: assess.output: metrics.json, report.md, throughput.png, ttft.png
"""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import numpy as np

from drafter_data.assessment.measure import (answer_share, completion_bytes_per_token, measure_level,
                                             prompt_source, summarize)
from drafter_data.assessment.projection import caveat, project, what_if
from drafter_data.assessment.report import plot, report
from drafter_data.config import run_stage
from drafter_data.errors import StageError
from drafter_data.server.client import make_client
from drafter_data.redaction import redact_url
from drafter_data.server.endpoints import api_key, check_api_key_env
from drafter_data.server.serving import servers
from drafter_data.server.preflight import preflight
from drafter_data.server.request import RequestSpec
from drafter_data.tracking import stage_run


def main(cfg) -> int:
    a = cfg.assess
    out_dir = Path(a.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    check_api_key_env(cfg.server)  # before anything is logged: a key pasted as the variable's name must not leak
    # measured as generate streams (token ids are generate's business: asking for them can change how a request
    # is sent)
    spec = RequestSpec.from_config(cfg, max_tokens=a.get("max_tokens")).with_token_mode("off")
    with stage_run("assess", cfg) as run:
        with servers(cfg.server) as urls:
            metrics = asyncio.run(assess(cfg, spec, urls[0]))
        (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
        (out_dir / "report.md").write_text(report(metrics, spec.model, spec.thinking))
        pngs = plot(metrics["levels"], out_dir)
        print_projection(metrics["projection"], out_dir, metrics["caveat"])
        log_run(run, metrics, [out_dir / "metrics.json", out_dir / "report.md", *pngs])
    return 0


async def assess(cfg, spec: RequestSpec, url: str) -> dict:
    """Preflight, then each level in turn; the best level's rate projected onto the whole job."""
    a = cfg.assess
    levels = sorted({int(c) for c in a.concurrency})
    if not levels:
        raise StageError("assess.concurrency is empty: give the concurrency levels to measure, e.g. [1, 4, 16]")
    client = make_client(url, api_key(cfg.server), max(levels), float(cfg.server.request_timeout_s))
    try:
        await preflight(client, url, spec, stream=True)
        prompts = prompt_source(a.get("input"))
        results, all_samples = [], []
        for c in levels:
            samples, window, retries = await measure_level(client, spec, prompts, c,
                                                           max(int(a.requests_per_level), 3 * c))
            results.append({**summarize(c, samples, window), "retries": retries})
            all_samples += samples
            lv = results[-1]
            print(f"concurrency {c:>4}: {lv['output_tokens_per_s']:8.1f} tok/s  {lv['requests_per_s']:6.2f} req/s  "
                  f"TTFT p50 {lv['ttft_p50_s'] or 0:.2f} s", file=sys.stderr)
    finally:
        await client.close()
    best = max(results, key=lambda lv: lv["output_tokens_per_s"])
    kw = {"completion_bytes_per_token": completion_bytes_per_token(all_samples)}
    share = answer_share(all_samples)
    job = (best["output_tokens_per_s"], int(a.num_completions), float(a.completion_tokens))
    return {"levels": results, "best": best, "projection": project(*job, **kw), "what_if": what_if(*job, share, **kw),
            "measured": {"completion_tokens_mean": float(np.mean([s.tokens for s in all_samples])),
                         "completion_bytes_per_token": kw["completion_bytes_per_token"],
                         "answer_share": share, "thinking": spec.thinking},
            # which server this describes: generate compares its own rate with this one only for the same server
            "server": {"kind": str(cfg.server.get("kind")), "model": spec.model, "url": redact_url(url)},
            # None, or why these figures do not predict the real job (the embedded toy server, another model)
            "caveat": caveat(str(cfg.server.get("kind")), spec.model, str(cfg.target.name))}


def print_projection(p: dict, out_dir: Path, warning: str | None = None) -> None:
    print(f"projection: {p['completions']:,} x {p['tokens_per_completion']:,.0f} tokens at "
          f"{p['output_tokens_per_s']:.1f} tok/s = {p['hours']:,.1f} h ({p['days']:,.1f} days), "
          f"{p['storage_gb']:,.1f} GB; report in {out_dir / 'report.md'}", file=sys.stderr)
    if warning:
        print(f"NOT A PROJECTION OF THE REAL JOB: {warning}", file=sys.stderr)


def log_run(run, metrics: dict, artifacts: list[Path]) -> None:
    p = metrics["projection"]
    run.metrics({"best.output_tokens_per_s": metrics["best"]["output_tokens_per_s"],
                 "best.concurrency": metrics["best"]["concurrency"],
                 "projection.hours": p["hours"], "projection.days": p["days"],
                 "projection.storage_gb": p["storage_gb"]})
    for lv in metrics["levels"]:
        run.metrics({f"level.{k}": lv[k] for k in ("output_tokens_per_s", "requests_per_s", "ttft_p50_s",
                                                    "ttft_p99_s")}, step=lv["concurrency"])
    for path in artifacts:
        run.artifact(path)


if __name__ == "__main__":
    run_stage(main)

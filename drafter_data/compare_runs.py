"""Prints recent pipeline runs side by side: one column per `dvc repro` / `dvc exp run` (the stage runs that share a
`pipeline_run` tag), one row per figure a user compares between two configs (thinking on/off, two servers, ...).

    python -m drafter_data.compare_runs                         # the last 5 pipeline runs
    python -m drafter_data.compare_runs --last 2
    python -m drafter_data.compare_runs --pipeline-run ID --pipeline-run ID
    python -m drafter_data.compare_runs --stage generate --last 10   # single stage runs, newest first

A blank cell: that stage did not run in that invocation (DVC skipped it as unchanged) or did not log the figure.
"""
from __future__ import annotations

import argparse
import datetime as dt
from collections import defaultdict
from urllib.parse import urlsplit

from omegaconf import OmegaConf

from drafter_data.redaction import redact_url
from drafter_data.tracking import EXPERIMENT, STAGES, tracking_uri

SEARCH_LIMIT = 2000


def _metric(runs: dict, stage: str, key: str):
    run = runs.get(stage)
    return run.data.metrics.get(key) if run else None


def _ratio(numerator, denominator):
    return numerator / denominator if numerator is not None and denominator else None


def _server(runs: dict) -> str | None:
    for stage in ("generate", "assess", "tokenize"):
        run = runs.get(stage)
        if run and "server.base_url" in run.data.params:
            hosts = [urlsplit(u.strip(" '\"[]")).netloc for u in run.data.params["server.base_url"].split(",")]
            return f"{run.data.params.get('server.model', '?')} @ {' '.join(h for h in hosts if h)}"
    return None


def _real_vs_projected(runs: dict):
    """generate's steady rate over the assessed one, as it logged it (none when no answer finished with every slot
    busy: a whole-run rate here would not be the same measure)."""
    return _metric(runs, "generate", "throughput_vs_assessed")


def _length_cut_share(runs: dict):
    """Answers cut by max_tokens over answers: generate's own figure, else tokenize's rows."""
    share = _metric(runs, "generate", "length_cut_share")
    if share is None:
        share = _ratio(_metric(runs, "tokenize", "rows.finish_length"), _metric(runs, "tokenize", "rows.read"))
    return share


def _tag(runs: dict, key: str):
    return next((r.data.tags[key] for r in runs.values() if key in r.data.tags), None)


# (row label, figure of one pipeline run's {stage: run}, format)
FIGURES = [
    ("started", lambda r: min(x.info.start_time for x in r.values()), "time"),
    ("dvc exp", lambda r: _tag(r, "dvc_exp"), "s"),
    ("target", lambda r: _tag(r, "target"), "s"),
    ("thinking", lambda r: _tag(r, "thinking"), "s"),
    ("server", _server, "s"),
    ("stages run", lambda r: " ".join(s for s in STAGES if s in r), "s"),
    ("prompts kept", lambda r: _metric(r, "prepare", "kept"), "int"),
    ("assessed tok/s", lambda r: _metric(r, "assess", "best.output_tokens_per_s"), "1f"),
    ("projected days", lambda r: _metric(r, "assess", "projection.days"), "2f"),
    ("output tok/s", lambda r: _metric(r, "generate", "output_tokens_per_s"), "1f"),
    ("real/projected tok/s", _real_vs_projected, "2f"),
    ("completions", lambda r: _metric(r, "generate", "done_total"), "int"),
    ("failed", lambda r: _metric(r, "generate", "failed_total"), "int"),
    ("length-cut share", _length_cut_share, "pct"),
    ("tokens made", lambda r: _metric(r, "tokenize", "tokens"), "int"),
    ("loss tokens", lambda r: _metric(r, "tokenize", "loss_tokens"), "int"),
    ("drift rate", lambda r: _metric(r, "tokenize", "drift.rate"), "4f"),
]


def _format(value, kind: str) -> str:
    if value is None:
        return ""
    if kind == "time":
        return dt.datetime.fromtimestamp(value / 1000).strftime("%m-%d %H:%M")
    if kind == "int":
        return f"{value:,.0f}"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "s":
        return str(value)
    return f"{value:,.{kind[0]}f}"


def group_by_pipeline_run(runs: list) -> dict[str, dict]:
    """pipeline_run -> {stage: its newest run}, newest pipeline run first (runs come newest first)."""
    groups: dict[str, dict] = defaultdict(dict)
    for run in runs:
        pipeline_run = run.data.tags.get("pipeline_run") or f"run-{run.info.run_id[:8]}"
        groups[pipeline_run].setdefault(run.data.tags.get("stage", "?"), run)
    return dict(groups)


def side_by_side(groups: dict[str, dict]) -> str:
    columns = [[name] + [_format(fn(runs), kind) for _, fn, kind in FIGURES] for name, runs in groups.items()]
    labels = ["pipeline run"] + [label for label, _, _ in FIGURES]
    table = [labels] + columns
    widths = [max(len(cell) for cell in column) for column in table]
    lines = []
    for i in range(len(labels)):
        cells = [column[i].ljust(widths[0]) if c == 0 else column[i].rjust(widths[c]) for c, column in enumerate(table)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def stage_runs(runs: list, stage: str) -> str:
    lines = []
    for run in runs:
        metrics = ", ".join(f"{k}={v:,.4g}" for k, v in sorted(run.data.metrics.items())[:12])
        started = _format(run.info.start_time, "time")
        lines.append(f"{started}  {run.info.run_name}  [{run.data.tags.get('pipeline_run', '')}]  {metrics}")
    return "\n".join(lines) or f"no runs of stage {stage}"


def runs_table_url(uri: str, experiment_id: str) -> str:
    """The UI page of the runs table. MLflow 3.17 opens an experiment by the browser's workflow-type switch (default:
    GenAI), not by the experiment's kind tag; workflowType=machine_learning in the URL opens the runs table."""
    base = redact_url(uri).rstrip("/") if uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def main(argv=None) -> None:
    from mlflow.tracking import MlflowClient

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--last", type=int, default=5, help="how many pipeline runs (or stage runs with --stage)")
    parser.add_argument("--pipeline-run", action="append", default=[], help="these pipeline runs (repeatable)")
    parser.add_argument("--stage", help="list single runs of this stage instead")
    parser.add_argument("--experiment", default=EXPERIMENT)
    args = parser.parse_args(argv)
    uri = tracking_uri(OmegaConf.create({}))
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(args.experiment)
    if exp is None:
        print(f"no experiment {args.experiment!r} at {redact_url(uri)}")
        return
    stage = [f"tags.stage = '{args.stage}'"] if args.stage else []
    # MLflow's search has no IN for tags: one search per pipeline run asked for
    searches = [stage + [f"tags.pipeline_run = '{p}'"] for p in args.pipeline_run] or [stage]
    runs = sorted((run for filters in searches
                   for run in client.search_runs([exp.experiment_id], " AND ".join(filters), max_results=SEARCH_LIMIT,
                                                 order_by=["attributes.start_time DESC"])),
                  key=lambda run: run.info.start_time, reverse=True)
    if args.stage:
        print(stage_runs(runs[:args.last], args.stage))
        return
    newest = list(group_by_pipeline_run(runs).items())[:len(args.pipeline_run) or args.last]
    groups = dict(reversed(newest))  # oldest on the left: read left to right in the order they ran
    print(side_by_side(groups) if groups else f"no runs in experiment {args.experiment!r} at {redact_url(uri)}")
    ui = "" if uri.startswith(("http://", "https://")) else " (with `mlflow ui` on port 5000)"
    print(f"\nruns table in the MLflow UI{ui}: {runs_table_url(uri, exp.experiment_id)}")


if __name__ == "__main__":
    main()

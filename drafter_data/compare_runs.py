"""Prints the recent pipeline runs from MLflow side by side.

    python -m drafter_data.compare_runs                  # the last 20 runs of every stage
    python -m drafter_data.compare_runs --stage generate --last 5
"""
from __future__ import annotations

import argparse

from omegaconf import OmegaConf

from drafter_data.tracking import tracking_uri

COLUMNS = {
    "params.server.model": "model",
    "params.generation.thinking": "thinking",
    "params.generation.concurrency": "conc",
    "params.prepare.sample": "sample",
    "metrics.kept": "kept",
    "metrics.best.output_tokens_per_s": "assessed tok/s",
    "metrics.projection.days": "proj. days",
    "metrics.output_tokens_per_s": "gen tok/s",
    "metrics.done_total": "done",
    "metrics.failed_total": "failed",
    "metrics.tokens": "tokens",
}


def main(argv=None) -> None:
    import mlflow
    import pandas as pd

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", help="only runs of this stage (prepare, assess, generate, tokenize)")
    parser.add_argument("--last", type=int, default=20)
    parser.add_argument("--experiment", default="drafter-data")
    args = parser.parse_args(argv)
    mlflow.set_tracking_uri(tracking_uri(OmegaConf.create({})))
    runs = mlflow.search_runs(experiment_names=[args.experiment], max_results=args.last,
                              filter_string=f"tags.stage = '{args.stage}'" if args.stage else "",
                              order_by=["attributes.start_time DESC"])
    if runs.empty:
        print(f"no runs in experiment {args.experiment!r} at {mlflow.get_tracking_uri()}")
        return
    table = pd.DataFrame({"start": runs["start_time"].dt.strftime("%m-%d %H:%M"), "stage": runs["tags.stage"],
                          "commit": runs.get("tags.git_commit", pd.Series(dtype=str)).str[:8]})
    for column, name in COLUMNS.items():
        if column in runs and runs[column].notna().any():
            table[name] = runs[column].round(2) if runs[column].dtype.kind == "f" else runs[column]
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(table.astype(object).fillna("").to_string(index=False))


if __name__ == "__main__":
    main()

"""Benchmark of the prepare stage on a large ShareGPT-like JSONL input made from the prompt fixtures.

For each size (default 0.25M and 1M records) and each of --runs runs, it measures in the same run:
- parse-only x1: orjson over every line of the file, in one process;
- parse-only xW: the same over the file's line ranges in W processes (W = prepare.workers, the ranges prepare uses);
- the stage (`python -m stages.prepare`, MLflow logging included);
and prints the stage's wall time as a ratio to each baseline, its records/s and peak RSS, then the spread (min,
median, max) of the ratios over the runs. Goals: ratio to parse-only x1 <= 2.0; RSS flat from 0.25M to 1M, < 1 GB.
Also printed, as they are much less sensitive to other load on the machine: the stage's CPU time (its workers
included) over the parse-only CPU time, and the load average.

    .venv/bin/python bench/prepare.py [--sizes 250000 1000000] [--runs 3] [--workers 2]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

# run as a script, bench/ would be first on sys.path and bench/tokenize.py would shadow the stdlib module
sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench._common import REPO, SHARED, run_measured  # noqa: E402
from drafter_data.prompts.records import line_ranges  # noqa: E402

PARSE_ONLY = """
import sys, orjson
n = 0
with open(sys.argv[1], "rb") as fh:
    for line in fh:
        try:
            orjson.loads(line)
            n += 1
        except orjson.JSONDecodeError:
            pass
print(n)
"""

# the same over the line ranges prepare reads in parallel, in W spawned processes (as prepare's workers are)
PARSE_ONLY_PARALLEL = """
import json, sys, orjson
from multiprocessing import get_context

def parse(path, start, end):
    n = 0
    with open(path, "rb") as fh:
        fh.seek(start)
        remaining = float("inf") if end is None else end - start
        while remaining > 0:
            line = fh.readline()
            if not line:
                break
            remaining -= len(line)
            try:
                orjson.loads(line)
                n += 1
            except orjson.JSONDecodeError:
                pass
    return n

if __name__ == "__main__":
    path, workers, ranges = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    with get_context("spawn").Pool(workers) as pool:
        print(sum(pool.starmap(parse, [(path, a, b) for a, b in ranges], chunksize=1)))
"""


def seed_conversations() -> list[list[dict]]:
    """ShareGPT conversations from the fixtures (each cut to its first turns, values to 1,500 chars)."""
    prompts = SHARED / "fixtures" / "prompts"
    if not prompts.exists():
        sys.exit(f"missing {prompts}: the benchmark builds its input from ../shared's prompt fixtures")
    convs = [r["conversations"] for r in json.loads((prompts / "sharegpt_v3_sample.json").read_text())]
    convs += [json.loads(line)["conversations"] for line in
              (prompts / "numina_cot_sharegpt_data_1k.jsonl").read_text().splitlines()]
    convs += [r["conversations"] for r in json.loads((prompts / "glaive_toolcall_en_demo.json").read_text())]
    return [[{"from": t["from"], "value": t["value"][:1500]} for t in c[:4]] for c in convs if c]


def build_input(path: Path, n: int, seeds: list[list[dict]]) -> None:
    """n records: variations of the seeds (a numbered variant tag on every turn), ~8% exact duplicates of earlier
    records, 0.1% broken lines."""
    rng = random.Random(n)
    with open(path, "wb") as fh:
        recent = []
        for i in range(n):
            roll = rng.random()
            if roll < 0.001:
                fh.write(b'{"conversations": [{"from": "human", "value": "broken\n')
                continue
            if roll < 0.08 and recent:
                line = rng.choice(recent)
            else:
                conv = seeds[i % len(seeds)]
                tag = f" (variant {i})"
                line = json.dumps({"id": f"r{i}", "conversations": [{"from": t["from"], "value": t["value"] + tag}
                                                                   for t in conv]}, ensure_ascii=False).encode()
                if len(recent) < 1000:
                    recent.append(line)
                else:
                    recent[rng.randrange(1000)] = line
            fh.write(line + b"\n")


def measure(n: int, src: Path, out: Path, args, env: dict) -> dict:
    py = sys.executable
    one = run_measured([py, "-c", PARSE_ONLY, str(src)])
    parallel = out.parent / "parse_only_parallel.py"  # spawned workers import their function from a file
    parallel.write_text(PARSE_ONLY_PARALLEL)
    ranges = json.dumps(line_ranges(src, int(args.split_mb * 2**20)))
    many = run_measured([py, str(parallel), str(src), str(args.workers), ranges])
    stage = run_measured([py, "-m", "stages.prepare", f"prepare.output={out}",
                          f"prepare.sources=[{{name:bench,path:'{src}',format:sharegpt}}]",
                          "prepare.sample=100000", "prepare.max_prompt_chars=100000",
                          f"prepare.workers={args.workers}", f"prepare.split_mb={args.split_mb}"], env=env, cwd=REPO)
    stats = json.loads((out / "stats.json").read_text())["bench"]
    if not (int(one["stdout"]) == int(many["stdout"]) == stats["read"] - stats["dropped"].get("invalid_json", 0)):
        sys.exit(f"the baselines and the stage read different record counts: {one['stdout']}, {many['stdout']}, "
                 f"{stats}")
    return {"x1": stage["wall_s"] / one["wall_s"], "xW": stage["wall_s"] / many["wall_s"],
            "cpu": stage["cpu_s"] / one["cpu_s"], "one": one, "many": many, "stage": stage, "stats": stats,
            "load": os.getloadavg()[0]}


def report(n: int, size: int, run: int, r: dict, workers: int) -> None:
    one, many, stage = r["one"], r["many"], r["stage"]
    print(f"{n:>9,} records ({size / 1e6:,.0f} MB) run {run}: stage {stage['wall_s']:.1f} s "
          f"(cpu {stage['cpu_s']:.1f} s, {n / stage['wall_s']:,.0f} records/s, peak RSS {stage['peak_rss_mb']:.0f} MB)"
          f" | parse-only x1 {one['wall_s']:.1f} s -> ratio {r['x1']:.2f}"
          f" | parse-only x{workers} {many['wall_s']:.1f} s -> ratio {r['xW']:.2f}"
          f" | CPU time {stage['cpu_s']:.1f} s vs {one['cpu_s']:.1f} s -> {r['cpu']:.2f}"
          f" | load average {r['load']:.1f}", flush=True)


def spread(values: list[float]) -> str:
    return f"min {min(values):.2f}  median {statistics.median(values):.2f}  max {max(values):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[250_000, 1_000_000])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--split-mb", type=float, default=64)
    args = parser.parse_args()
    seeds = seed_conversations()
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        tmp = Path(tmp)
        env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"}
        # the tracking database exists in real use; creating one (~3 s of migrations) is not the stage's work
        run_measured([sys.executable, "-c", "import mlflow; mlflow.set_experiment('drafter-data')"], env=env)
        results = {}
        for n in args.sizes:
            src = tmp / f"input-{n}.jsonl"
            build_input(src, n, seeds)
            for run in range(1, args.runs + 1):
                r = measure(n, src, tmp / f"out-{n}", args, env)
                results.setdefault(n, []).append(r)
                report(n, src.stat().st_size, run, r, args.workers)
            src.unlink()
        print()
        for n, runs in results.items():
            s = runs[0]["stats"]
            print(f"{n:>9,} records, {len(runs)} runs: ratio to parse-only x1: {spread([r['x1'] for r in runs])}; "
                  f"to parse-only x{args.workers}: {spread([r['xW'] for r in runs])}; "
                  f"CPU-time ratio: {spread([r['cpu'] for r in runs])}; peak RSS "
                  f"{spread([r['stage']['peak_rss_mb'] for r in runs]).replace('.00', '')} MB; "
                  f"kept {s['kept']:,}, dropped {s['dropped']}")
        if len(results) > 1:
            (n0, r0), (n1, r1) = list(results.items())[0], list(results.items())[-1]
            rss0 = statistics.median(r["stage"]["peak_rss_mb"] for r in r0)
            rss1 = statistics.median(r["stage"]["peak_rss_mb"] for r in r1)
            print(f"peak RSS (median) {n1 / n0:.0f}x input: {rss0:.0f} MB -> {rss1:.0f} MB ({rss1 / rss0:.2f}x)")


if __name__ == "__main__":
    main()

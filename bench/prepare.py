"""Benchmark of the prepare stage on a large ShareGPT-like JSONL input made from the prompt fixtures.

Prints, for 0.25M and 1M records: records/s, peak RSS, and the ratio of the stage's time to a parse-only baseline
(orjson over the same file) measured in the same run. Goals: ratio <= 2.0; RSS flat from 0.25M to 1M.

    .venv/bin/python bench/prepare.py [--sizes 250000 1000000]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

# run as a script, bench/ would be first on sys.path and bench/tokenize.py would shadow the stdlib module
sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench._common import REPO, SHARED, run_measured  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[250_000, 1_000_000])
    args = parser.parse_args()
    seeds = seed_conversations()
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        tmp = Path(tmp)
        results = []
        env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"}
        # the tracking database exists in real use; creating one (~3 s of migrations) is not the stage's work
        run_measured([py, "-c", "import mlflow; mlflow.set_experiment('drafter-data')"], env=env)
        for n in args.sizes:
            src = tmp / f"input-{n}.jsonl"
            build_input(src, n, seeds)
            base = run_measured([py, "-c", PARSE_ONLY, str(src)])
            stage = run_measured([py, "-m", "stages.prepare", f"prepare.output={tmp / f'out-{n}'}",
                                  f"prepare.sources=[{{name:bench,path:'{src}',format:sharegpt}}]",
                                  "prepare.sample=100000", "prepare.max_prompt_chars=100000"],
                                 env=env, cwd=REPO)
            stats = json.loads((tmp / f"out-{n}" / "stats.json").read_text())["bench"]
            results.append((n, src.stat().st_size, base, stage, stats))
            print(f"{n:>9,} records ({src.stat().st_size / 1e6:,.0f} MB): parse-only {base['wall_s']:.1f} s, "
                  f"stage {stage['wall_s']:.1f} s -> ratio {stage['wall_s'] / base['wall_s']:.2f}; "
                  f"{n / stage['wall_s']:,.0f} records/s; peak RSS stage {stage['peak_rss_mb']:.0f} MB "
                  f"(parse-only {base['peak_rss_mb']:.0f} MB); kept {stats['kept']:,}, dropped {stats['dropped']}",
                  flush=True)
        if len(results) > 1:
            (n0, _, _, s0, _), (n1, _, _, s1, _) = results[0], results[-1]
            print(f"peak RSS {n1 / n0:.0f}x input: {s0['peak_rss_mb']:.0f} MB -> {s1['peak_rss_mb']:.0f} MB "
                  f"({s1['peak_rss_mb'] / s0['peak_rss_mb']:.2f}x)")


if __name__ == "__main__":
    main()

"""Benchmark of generation.concurrency=auto against the best fixed level, on a test server with a throughput knee the
stage does not know (tests/fake_openai_server.py `knee`: with more than N requests generating, every token gets
slower, so total tokens/s falls beyond N).

In one run, against the same server: the stage at each fixed level of a sweep, then with concurrency=auto starting
from a misleading assessment (the level assess would report from its default sweep) and from none, then auto again
while the knee moves mid-run (N -> 2N), compared with the best fixed level for the moved knee. Two figures per run:
the whole request phase (output tok/s in run.json: the climb included) and the steady state (tokens the server
produced from STEADY_FROM_S to STEADY_TO_S after the stage started, the same window for every run). Goals: auto
>= 0.95x the best fixed level; within 10% of it after the knee moved.

`--steep` runs instead the issue-30 server (64 slots, every token slower by (active / 24) ** 2 past 24 generating,
decode gains bending early, answers of 200-400 tokens) `--repeats` times (default 2): fixed 8, 24 and auto from
nothing, each over the first 45 s from its first token (goal: auto >= 0.9x the fixed 24).

`--llama` runs instead the stage against a real engine: the embedded llama-server (server=local, the small GGUF,
64 slots, streamed), at fixed levels 4 to 64 and with auto from nothing, `--prompts` each (default 200), `--repeats`
times (default 1); the figures are run.json's whole-run and steady (every slot busy) output tok/s.

`--repeats N` runs instead, N times over: the best fixed level (the knee), auto from the misleading assessment and
auto from nothing, each pair side by side, and prints the spread of each ratio (these machines are noisy). With more
`--prompts` the climb weighs less in the whole run, as in a real run of days.

    .venv/bin/python bench/concurrency.py [--knee 12] [--prompts 800] [--moved-only | --repeats 3 | --steep | --llama]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench._common import REPO, run_measured  # noqa: E402

SERVER = {"token_delay_s": 0.02, "reasoning_words": 20, "content_words": 20, "knee_penalty": 1.5}
STEADY_FROM_S, STEADY_TO_S = 25.0, 40.0
STEEP = {"token_delay_s": 0.000542, "knee": 24, "knee_penalty": 2.0, "bend": 3.8, "slots": 64, "reasoning_words": 0,
         "content_words_range": [200, 400]}
STEEP_WINDOW_S = 45.0


def start_server(config: dict) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.fake_openai_server", "--config", json.dumps(config)],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline().split()[1])
    return proc, f"http://127.0.0.1:{port}"


def post_config(root: str, values: dict) -> None:
    req = urllib.request.Request(f"{root}/config", data=json.dumps(values).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=10).read()


def tokens_between(root: str, t0: float, t1: float) -> float:
    with urllib.request.urlopen(f"{root}/stats?since={t0}&until={t1}", timeout=10) as resp:
        return json.loads(resp.read())["tokens_in_window"] / (t1 - t0)


def write_prompts(directory: Path, n: int, tag: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from drafter_data.contract import PROMPTS

    directory.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt_id": f"{tag}{i:028x}", "source": "bench", "messages": [{"role": "user", "content": f"{tag} {i}"}]}
            for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows, schema=PROMPTS), directory / "prompts-00000.parquet")


def run_stage(url: str, tmp: Path, name: str, n: int, *extra: str, max_tokens: int = 64) -> tuple[float, float]:
    """(output tok/s of the whole request phase, tok/s the server produced in the steady window)."""
    write_prompts(tmp / f"in-{name}", n, name)
    out = tmp / f"out-{name}"
    t0 = time.time()
    run_measured([sys.executable, "-m", "stages.generate", "server=remote", f"server.base_url={url}/v1",
                  "server.model=fake-model", "target=kimi-k2.6", f"generate.input={tmp / f'in-{name}'}",
                  f"generate.output={out}", f"generation.max_tokens={max_tokens}", "generation.token_ids=off", *extra],
                 env={"MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"})
    whole = json.loads((out / "run.json").read_text())["output_tokens_per_s"]
    return whole, tokens_between(url, t0 + STEADY_FROM_S, t0 + STEADY_TO_S)


def sweep(url: str, tmp: Path, levels: list[int], n: int, tag: str) -> dict[int, tuple[float, float]]:
    rates = {}
    for level in levels:
        rates[level] = run_stage(url, tmp, f"{tag}{level}", n, f"generation.concurrency={level}")
        print(f"  fixed {level:>3}: {rates[level][0]:7.1f} tok/s (steady {rates[level][1]:7.1f})", flush=True)
    return rates


def report(label: str, auto: tuple[float, float], fixed: dict[int, tuple[float, float]]) -> None:
    best_whole = max(fixed.items(), key=lambda kv: kv[1][0])
    best_steady = max(fixed.items(), key=lambda kv: kv[1][1])
    print(f"{label}: whole run {auto[0]:.1f} tok/s = {auto[0] / best_whole[1][0]:.2f}x the best fixed level "
          f"({best_whole[0]}: {best_whole[1][0]:.1f}); steady {auto[1]:.1f} = {auto[1] / best_steady[1][1]:.2f}x "
          f"({best_steady[0]}: {best_steady[1][1]:.1f})", flush=True)


def assessment(tmp: Path, url: str, level: int, rate: float) -> Path:
    path = tmp / "metrics.json"
    path.write_text(json.dumps({"best": {"concurrency": level, "output_tokens_per_s": rate},
                                "server": {"kind": "remote", "model": "fake-model", "url": f"{url}/v1"}}))
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--knee", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=None, help="prompts a run (800; --llama 200)")
    parser.add_argument("--moved-only", action="store_true", help="only the moved knee (about 6 minutes)")
    parser.add_argument("--repeats", type=int, default=0, help="auto against the knee's fixed level, N times")
    parser.add_argument("--steep", action="store_true", help="the issue-30 steep server: fixed 8, 24, auto over 45 s")
    parser.add_argument("--slower", type=float, default=1.0,
                        help="--steep with every delay this many times longer (the same curve's shape, fewer tok/s: "
                             "on a busy machine the fake server at 6,000 tok/s is CPU-bound and its knee is gone)")
    parser.add_argument("--llama", action="store_true", help="a real engine: the embedded llama-server")
    args = parser.parse_args()
    if args.llama:
        return llama(args.repeats or 1, args.prompts or 200)
    if args.steep:
        return steep(args.repeats or 2, args.slower)
    knee, n = args.knee, args.prompts or 800
    server, root = start_server({**SERVER, "knee": knee})
    try:
        with tempfile.TemporaryDirectory(prefix="bench-concurrency-") as tmp:
            tmp = Path(tmp)
            print(f"knee at {knee} in flight (unknown to the stage); {n} prompts per run", flush=True)
            if args.moved_only:
                return moved_knee(root, tmp, knee, n, assessment(tmp, root, 16 if knee < 16 else 4, 0.0))
            if args.repeats:
                return repeats(root, tmp, knee, n, args.repeats)
            fixed = sweep(root, tmp, [knee // 3, knee // 2, knee - 2, knee, knee + 2, 2 * knee], n, "k1-")
            # what assess's default sweep [1, 4, 16] would report as best: a level past the knee
            start = assessment(tmp, root, 16 if knee < 16 else 4, fixed[2 * knee][0])
            auto = run_stage(root, tmp, "auto", n, "generation.concurrency=auto", f"generate.assessment={start}")
            report("auto, starting at 16 (a misleading assessment)", auto, fixed)
            report("auto, no assessment (climbing from 4)",
                   run_stage(root, tmp, "cold", n, "generation.concurrency=auto", "generate.assessment=null"), fixed)
            moved_knee(root, tmp, knee, n, start)
    finally:
        server.kill()


def first_45s(root: str, tmp: Path, name: str, prompts: int, *extra: str) -> float:
    """tok/s the server produced over the 45 s from the run's first token (the stage's start-up left out)."""
    t0 = time.time()
    run_stage(root, tmp, name, prompts, "generation.thinking=false", *extra, max_tokens=512)
    with urllib.request.urlopen(f"{root}/stats?since={t0}", timeout=10) as resp:
        first = json.loads(resp.read())["first_token_since"]
    return tokens_between(root, first, first + STEEP_WINDOW_S)


def steep(runs: int, slower: float = 1.0) -> None:
    server, root = start_server({**STEEP, "token_delay_s": STEEP["token_delay_s"] * slower})
    prompts = max(300, int(1300 / slower))
    try:
        with tempfile.TemporaryDirectory(prefix="bench-steep-") as tmp:
            tmp = Path(tmp)
            for i in range(runs):
                fixed = {lv: first_45s(root, tmp, f"s{i}-{lv}", prompts, f"generation.concurrency={lv}")
                         for lv in (8, 24)}
                auto = first_45s(root, tmp, f"s{i}-auto", prompts, "generation.concurrency=auto",
                                 "generate.assessment=null")
                levels = next(iter(json.loads((tmp / f"out-s{i}-auto" / "run.json").read_text())
                                   ["concurrency_levels"].values()))
                print(f"steep server, run {i + 1}: fixed 8 {fixed[8]:.0f}, fixed 24 {fixed[24]:.0f}, auto "
                      f"{auto:.0f} tok/s over {STEEP_WINDOW_S:.0f} s from the first token = {auto / fixed[24]:.2f}x "
                      f"the fixed 24; auto's levels: {' '.join(str(lv) for _, lv, _ in levels)}", flush=True)
    finally:
        server.kill()


def llama(runs: int, prompts: int) -> None:
    """Fixed levels and auto from nothing against the embedded llama-server (each run starts its own)."""
    levels = (4, 8, 16, 32, 64)
    with tempfile.TemporaryDirectory(prefix="bench-llama-") as tmp:
        tmp = Path(tmp)
        for i in range(runs):
            rates = {}
            for level in (*levels, "auto"):
                name = f"l{i}-{level}"
                write_prompts(tmp / f"in-{name}", prompts, name)
                run_measured([sys.executable, "-m", "stages.generate", "server=local", "server.local.slots=64",
                              f"generate.input={tmp / f'in-{name}'}", f"generate.output={tmp / f'out-{name}'}",
                              "generation.token_ids=off", f"generation.concurrency={level}",
                              "generate.assessment=null"],
                             env={"MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"})
                summary = json.loads((tmp / f"out-{name}" / "run.json").read_text())
                rates[level] = (summary["output_tokens_per_s"], summary["steady_output_tokens_per_s"] or 0.0)
                print(f"  {level!s:>4}: {rates[level][0]:6.1f} tok/s whole, {rates[level][1]:6.1f} steady", flush=True)
            fixed = {lv: rates[lv] for lv in levels}
            report(f"llama-server, run {i + 1}, auto from nothing", rates["auto"], fixed)
            auto_levels = next(iter(summary["concurrency_levels"].values()))
            print("  auto's levels: " + " ".join(str(lv) for _, lv, _ in auto_levels), flush=True)


def repeats(root: str, tmp: Path, knee: int, n: int, runs: int) -> None:
    """`runs` rounds of: the fixed level at the knee, then auto from a misleading assessment and from nothing."""
    start = assessment(tmp, root, 16 if knee < 16 else 4, 0.0)
    ratios = {"from an assessment": [], "from nothing": []}
    for i in range(runs):
        fixed = sweep(root, tmp, [knee], n, f"r{i}-")
        for label, tag, extra in (("from an assessment", "assessed", f"generate.assessment={start}"),
                                  ("from nothing", "cold", "generate.assessment=null")):
            auto = run_stage(root, tmp, f"r{i}-{tag}", n, "generation.concurrency=auto", extra)
            report(f"  auto {label}", auto, fixed)
            ratios[label].append((auto[0] / fixed[knee][0], auto[1] / fixed[knee][1]))
    for label, pairs in ratios.items():
        whole, steady = (sorted(p[k] for p in pairs) for k in (0, 1))
        print(f"auto {label}, {runs} run{'s' if runs > 1 else ''} against the fixed {knee} beside each: whole run "
              f"{', '.join(f'{r:.2f}' for r in whole)} (median {whole[len(whole) // 2]:.2f}); steady "
              f"{', '.join(f'{r:.2f}' for r in steady)} (median {steady[len(steady) // 2]:.2f})", flush=True)


def moved_knee(root: str, tmp: Path, knee: int, n: int, start: Path) -> None:
    """auto while the knee moves from N to 2N 20 s in, against the best fixed level for 2N, measured from 10 s
    after the move."""
    post_config(root, {"knee": 2 * knee})
    fixed = {}
    for level in (2 * knee - 4, 2 * knee, 2 * knee + 4):
        t0 = time.time()
        run_stage(root, tmp, f"k2-{level}", 2 * n, f"generation.concurrency={level}")
        fixed[level] = tokens_between(root, t0 + 30, t0 + 50)
        print(f"  fixed {level:>3} (knee {2 * knee}): {fixed[level]:7.1f} tok/s", flush=True)
    post_config(root, {"knee": knee})
    marks = {}

    def move_knee_later():
        time.sleep(20)
        post_config(root, {"knee": 2 * knee})
        marks["moved"] = time.time()

    mover = threading.Thread(target=move_knee_later)
    mover.start()
    t0 = time.time()
    run_stage(root, tmp, "moving", 3 * n, "generation.concurrency=auto", f"generate.assessment={start}")
    mover.join()
    print(f"  the knee moved {marks['moved'] - t0:.0f} s after the stage started", flush=True)
    rate = tokens_between(root, marks["moved"] + 10, marks["moved"] + 30)
    best_level, best = max(fixed.items(), key=lambda kv: kv[1])
    print(f"knee moved {knee} -> {2 * knee} mid-run: auto {rate:.1f} tok/s from 10 to 30 s after the move = "
          f"{rate / best:.2f}x the best fixed level for the new knee ({best_level}: {best:.1f})", flush=True)
    summary = json.loads((tmp / "out-moving" / "run.json").read_text())
    for levels in summary.get("concurrency_levels", {}).values():  # [seconds into the request phase, level, tok/s]
        print("  levels measured (s, level, tok/s): " + ", ".join(f"{t:.0f}:{lv}:{r:.0f}" for t, lv, r in levels))


if __name__ == "__main__":
    main()

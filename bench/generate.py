"""Benchmark of the generate stage's client overhead against a bare AsyncOpenAI loop, and of resuming.

Against the same instant local test server (tests/fake_openai_server.py, streaming, thinking on), each side in its own
process at the same concurrency: requests/s of the stage and of a bare `AsyncOpenAI` streaming loop, their ratio (goal
>= 0.9), and the stage's CPU seconds per 1,000 completions; in `--pairs` pairs per level, alternating which side runs
first (one pair's ratio moved by 0.1 between runs on this machine), and their median. Then the time and peak RSS of
the stage resuming over N finished rows (nothing left to send): goals < 10 s at 1M, < 20 s and < 1 GB at 4.3M (the
seed's pool); the peak RSS at both sizes shows whether memory stays flat per prompt.

`--ceiling` measures instead the client's own ceiling: against an instant server (every answer written at once) with
2,000-token answers at 64 in flight, streamed and not, the stage's output tok/s and CPU seconds per 1,000 output
tokens, and what run.json says of it (the event loop's cores; client_bound). Whatever the servers can do, one generate
process makes no more than this: past it, generate.stream=false or more generate processes (shards).

    .venv/bin/python bench/generate.py [--requests 6000] [--concurrency 64 256] [--pairs 3]
                                       [--resume-rows 1000000 4300000]
    .venv/bin/python bench/generate.py --ceiling [--ceiling-requests 400]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# run as a script, bench/ would be first on sys.path and bench/tokenize.py would shadow the stdlib module
sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench._common import REPO, run_measured  # noqa: E402

BARE_LOOP = r"""
import asyncio, sys, time, httpx2, openai
url, n, conc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
async def main():
    client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=2, http_client=openai.DefaultAsyncHttpxClient(
        limits=httpx2.Limits(max_connections=conc + 8, max_keepalive_connections=conc + 8)))
    queue = asyncio.Queue()
    for i in range(n):
        queue.put_nowait([{"role": "user", "content": f"bench prompt {i}"}])
    done = 0
    async def worker():
        nonlocal done
        while not queue.empty():
            messages = queue.get_nowait()
            stream = await client.chat.completions.create(model="fake-model", messages=messages, max_tokens=64,
                stream=True, stream_options={"include_usage": True},
                extra_body={"chat_template_kwargs": {"thinking": True}})
            parts = []
            async for chunk in stream:
                for c in chunk.choices:
                    parts.append(getattr(c.delta, "reasoning_content", None) or c.delta.content or "")
            done += 1
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    print(done / (time.perf_counter() - t0))
asyncio.run(main())
"""


def start_server(config: dict) -> tuple[subprocess.Popen, str]:
    taskset = ["taskset", "-c", "1"] if shutil.which("taskset") else []
    proc = subprocess.Popen([*taskset, sys.executable, "-m", "tests.fake_openai_server", "--config",
                             json.dumps(config)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline().split()[1])
    return proc, f"http://127.0.0.1:{port}/v1"


def client_cmd(args: list[str]) -> list[str]:
    return (["taskset", "-c", "0"] if shutil.which("taskset") else []) + args


def write_prompts(directory: Path, n: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from drafter_data.contract import PROMPTS

    directory.mkdir(parents=True, exist_ok=True)
    for k in range(0, n, 200_000):
        rows = [{"prompt_id": f"{i:032x}", "source": "bench", "tools": None,
                 "messages": [{"role": "user", "content": f"bench prompt {i}"}]} for i in range(k, min(n, k + 200_000))]
        pq.write_table(pa.Table.from_pylist(rows, schema=PROMPTS), directory / f"prompts-{k // 200_000:05d}.parquet")


def stage_args(url: str, inp: Path, out: Path, conc: int) -> list[str]:
    return [sys.executable, "-m", "stages.generate", "server=remote", f"server.base_url={url}",
            "server.model=fake-model", "target=kimi-k2.6", f"generate.input={inp}", f"generate.output={out}",
            f"generation.concurrency={conc}", "generation.max_tokens=64"]


def measure_bare(url: str, requests: int, conc: int) -> tuple[float, dict]:
    """(requests/s, the process's measures) of the bare AsyncOpenAI loop."""
    bare = run_measured(client_cmd([sys.executable, "-c", BARE_LOOP, url, str(requests), str(conc)]))
    return float(bare["stdout"].split()[-1]), bare


def measure_stage(url: str, inp: Path, out: Path, conc: int, env: dict, *overrides: str) -> tuple[float, dict]:
    """(requests/s of the request phase, from run.json; the process's measures) of the stage."""
    stage = run_measured(client_cmd(stage_args(url, inp, out, conc) + list(overrides)), env=env)
    return json.loads((out / "run.json").read_text())["requests_per_s"], stage


def fake_finished(inp: Path, out: Path, url: str, conc: int) -> None:
    """Completion shards for every prompt, keyed exactly as the stage keys them (20k-row shards, as compacted)."""
    import pyarrow as pa

    from drafter_data.config import compose
    from drafter_data.contract import COMPLETIONS, iter_batches, shard_paths, write_table_atomic
    from drafter_data.generation.work import ThinkingModes, input_keys
    from drafter_data.server.request import RequestSpec

    cfg = compose(stage_args(url, inp, out, conc)[3:], root=REPO)
    paths = shard_paths(inp)
    keys = input_keys(paths, RequestSpec.from_config(cfg), cfg.target.name, ThinkingModes.from_config(cfg.generation))
    out.mkdir(parents=True, exist_ok=True)
    offset, shard = 0, 0
    for batch in iter_batches(paths, batch_size=20000):
        n = batch.num_rows
        hex_keys = [keys.keys[i: i + 1].tobytes().hex() for i in range(offset, offset + n)]
        columns = {f.name: pa.nulls(n, f.type) for f in COMPLETIONS}
        columns.update({name: batch.column(name) for name in ("prompt_id", "source", "messages")})
        columns.update({"request_key": pa.array(hex_keys), "turn": pa.array([0] * n, pa.int32()),
                        "reasoning": pa.array(["r"] * n), "content": pa.array(["c"] * n),
                        "finish_reason": pa.array(["stop"] * n), "completion_tokens": pa.array([12] * n, pa.int64()),
                        "prompt_tokens": pa.array([3] * n, pa.int64()), "thinking": pa.array([True] * n),
                        "target": pa.array(["kimi-k2.6"] * n), "model": pa.array(["fake-model"] * n)})
        write_table_atomic(pa.table([columns[f.name] for f in COMPLETIONS], schema=COMPLETIONS),
                           out / f"completions-bench-{shard:05d}.parquet")
        offset, shard = offset + n, shard + 1


def ceiling(requests: int, answer_tokens: int = 2000, conc: int = 64) -> None:
    """One generate process against an instant server: tok/s and CPU per 1,000 tokens, streamed and not."""
    server, url = start_server({"reasoning_words": 0, "content_words": answer_tokens})
    try:
        with tempfile.TemporaryDirectory(prefix="bench-ceiling-") as tmp:
            tmp = Path(tmp)
            env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"}
            write_prompts(tmp / "in", requests)
            for stream in (True, False):
                out = tmp / f"out-{stream}"
                stage = run_measured(client_cmd(stage_args(url, tmp / "in", out, conc) + [
                    f"generate.stream={str(stream).lower()}", f"generation.max_tokens={answer_tokens + 16}",
                    "generation.token_ids=off", "generation.thinking=false"]), env=env)
                summary = json.loads((out / "run.json").read_text())
                tokens = summary["output_tokens_per_s"] * summary["elapsed_s"]
                print(f"client ceiling, {'streamed' if stream else 'generate.stream=false'}: "
                      f"{summary['output_tokens_per_s']:,.0f} output tok/s, CPU {stage['cpu_s'] / tokens * 1000:.3f} s "
                      f"per 1,000 tokens (whole process; the event loop's thread in the request phase "
                      f"{summary['client_cpu_cores'] * summary['elapsed_s'] / tokens * 1000:.3f} s, so one core's "
                      f"ceiling ~{tokens / (summary['client_cpu_cores'] * summary['elapsed_s']):,.0f} tok/s); "
                      f"the event loop at {summary['client_cpu_cores']:.2f} of a core "
                      f"(peak {summary['client_cpu_cores_peak']:.2f}), client_bound {summary['client_bound']}; "
                      f"{requests} answers of {tokens / requests:.0f} tokens, {conc} in flight", flush=True)
    finally:
        server.kill()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--pairs", type=int, default=3, help="bare/stage pairs per level, alternating which goes first")
    parser.add_argument("--resume-rows", type=int, nargs="+", default=[1_000_000, 4_300_000])
    parser.add_argument("--ceiling", action="store_true", help="the client's ceiling only (streamed and not)")
    parser.add_argument("--ceiling-requests", type=int, default=400)
    args = parser.parse_args()
    if args.ceiling:
        return ceiling(args.ceiling_requests)
    server, url = start_server({"reasoning_words": 6, "content_words": 6})
    try:
        with tempfile.TemporaryDirectory(prefix="bench-generate-") as tmp:
            tmp = Path(tmp)
            env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"}
            write_prompts(tmp / "in", args.requests)
            for conc in args.concurrency:
                ratios = []
                for pair in range(args.pairs):
                    # alternate which side runs first: the server and the machine may drift between the two
                    if pair % 2 == 0:
                        bare_rps, bare = measure_bare(url, args.requests, conc)
                        stage_rps, stage = measure_stage(url, tmp / "in", tmp / f"out-{conc}-{pair}", conc, env)
                    else:
                        stage_rps, stage = measure_stage(url, tmp / "in", tmp / f"out-{conc}-{pair}", conc, env)
                        bare_rps, bare = measure_bare(url, args.requests, conc)
                    ratios.append(stage_rps / bare_rps)
                    print(f"concurrency {conc}, pair {pair + 1} ({'bare first' if pair % 2 == 0 else 'stage first'}): "
                          f"bare AsyncOpenAI {bare_rps:.0f} req/s, stage {stage_rps:.0f} req/s (request phase; "
                          f"{args.requests / stage['wall_s']:.0f} req/s over the whole process incl. start-up) -> "
                          f"ratio {ratios[-1]:.2f}; stage CPU {stage['cpu_s'] / args.requests * 1000:.1f} s per 1,000 "
                          f"completions (bare loop {bare['cpu_s'] / args.requests * 1000:.1f} s)", flush=True)
                print(f"concurrency {conc}: ratio {statistics.median(ratios):.2f} (median of {len(ratios)} pairs; "
                      f"{', '.join(f'{r:.2f}' for r in ratios)})", flush=True)
            conc = args.concurrency[0]
            plain_rps, plain = measure_stage(url, tmp / "in", tmp / "out-nostream", conc, env, "generate.stream=false")
            print(f"concurrency {conc}, generate.stream=false: stage {plain_rps:.0f} req/s, CPU "
                  f"{plain['cpu_s'] / args.requests * 1000:.1f} s per 1,000 completions (streaming costs a parse per "
                  f"chunk; it gives TTFT and lets a dropped stream be told from a slow one)", flush=True)
            for n in args.resume_rows:
                write_prompts(tmp / f"big{n}", n)
                fake_finished(tmp / f"big{n}", tmp / f"big{n}-out", url, 64)
                resume = run_measured(client_cmd(stage_args(url, tmp / f"big{n}", tmp / f"big{n}-out", 64)), env=env)
                assert f"{n} already done, 0 to generate" in resume["stderr"], resume["stderr"][-2000:]
                print(f"resume over {n:,} finished rows: {resume['wall_s']:.1f} s for the whole stage process, peak "
                      f"RSS {resume['peak_rss_mb']:.0f} MB ({resume['peak_rss_mb'] * 2**20 / n:.0f} bytes per "
                      f"prompt)", flush=True)
                shutil.rmtree(tmp / f"big{n}")
                shutil.rmtree(tmp / f"big{n}-out")
    finally:
        server.kill()


if __name__ == "__main__":
    main()

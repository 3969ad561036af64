"""Benchmark of the tokenize stage (Kimi K2.6 tokenizer, 2 worker processes) against raw tiktoken.

Builds completions of ~2,000 tokens from the prompt fixtures' real answers and runs the stage `--runs` times; the
baseline, raw tiktoken `encode_ordinary` on one thread over the same rendered texts, is measured before and after
each run (their mean is that run's baseline: a shared machine's speed drifts). Per run it prints two ratios against
the baseline, per core (the stage's tokens/s divided by its workers):
  * past start-up: tokens over the stage's own tokenizing window (first task start to last task end);
  * whole process: tokens over the wall time of `python -m stages.tokenize` (imports, workers, MLflow included);
and, less sensitive to other load, tokens per CPU-second of the whole stage (all its processes) against raw's.
Goal: >= 0.8 per core past start-up. Last, the limits of that figure on this machine: the encoding and the Parquet
writing alone (what no tokenize can skip) against raw, and raw tiktoken in two processes side by side. `--ids` gives
every row the server's prompt and sampled ids (as vLLM returns them): the stage keeps them and retokenizes the answer
to measure drift.

Seconds on a shared machine move by 10-20% from one minute to the next, raw's too. `--instructions` counts instead
(valgrind's callgrind; about 3 minutes): the instructions a worker executes per token (exactly a worker's work:
the stage's own task plan and task function, reading, rendering, tokenizing, writing shards) against raw
`encode_ordinary`'s per token, each the difference between a run over ROWS_LARGE and one over ROWS_SMALL rows, so
imports, loading and first calls cancel out. The same figure on every run to about 1%, whatever else the machine
does; what it cannot see is how fast each instruction runs (caches shared by two workers, the clock).

    .venv/bin/python bench/tokenize.py [--rows 20000] [--runs 3] [--ids]
    .venv/bin/python bench/tokenize.py --instructions
"""
from __future__ import annotations

import argparse
import json
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# run as a script, bench/ would be first on sys.path and bench/tokenize.py would shadow the stdlib module
sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench._common import REPO, SHARED, run_measured  # noqa: E402

KIMI = SHARED / "fixtures" / "kimi-k2-tokenizer"
WORKERS = 2
# The stage runs under this small launcher, which reports the stage's own peak RSS: a child's ru_maxrss starts from
# its parent's at fork, and this process holds every row (it would report its own size, however the stage does).
LAUNCHER = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
            "print(f'stage peak RSS kB: {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}', file=sys.stderr); "
            "sys.exit(code)")


def build_rows(n: int) -> list[dict]:
    prompts = SHARED / "fixtures" / "prompts"
    convs = [r["conversations"] for r in json.loads((prompts / "sharegpt_v3_sample.json").read_text())]
    convs += [json.loads(line)["conversations"] for line in
              (prompts / "numina_cot_sharegpt_data_1k.jsonl").read_text().splitlines()]
    pairs = [(c[i]["value"], c[i + 1]["value"]) for c in convs for i in range(len(c) - 1)
             if c[i]["from"] == "human" and c[i + 1]["from"] == "gpt" and c[i]["value"].strip()]
    answers = [a for _, a in pairs]
    rows = []
    for i in range(n):
        q, a = pairs[i % len(pairs)]
        # ~8,000 characters (~2,000 tokens) of real answer text: a reasoning part and an answer part
        text = a
        j = i
        while len(text) < 8000:
            j += 7
            text += "\n\n" + answers[j % len(answers)]
        rows.append({"prompt_id": f"p{i}", "source": "bench", "messages": [{"role": "user", "content": q[:2000]}],
                     "reasoning": text[:5000], "content": text[5000:8000], "finish_reason": "stop",
                     "prompt_tokens": 0, "completion_tokens": 0, "thinking": True})
    return rows


def conversation_tokenizer():
    from omegaconf import OmegaConf

    from drafter_data.tokens.conversation import ConversationTokenizer
    from drafter_data.tokens.tokenizers import KimiTokenizer

    target = OmegaConf.load(REPO / "conf/target/kimi-k2.6.yaml")
    target.tokenizer_dir = str(KIMI)
    return ConversationTokenizer(target, KimiTokenizer(KIMI), {"thinking": True, "preserve_thinking": True})


def rendered_texts(conv, rows: list[dict]) -> list[str]:
    from drafter_data.tokens.conversation import final_assistant_message

    return [conv.render(r["messages"] + [final_assistant_message(r["content"], r["reasoning"], None, True)])
            for r in rows]


def add_server_ids(conv, rows: list[dict]) -> None:
    """The ids a vLLM server returns: the prompt's, and the sampled reasoning, </think>, answer, <|im_end|>."""
    tok = conv.tokenizer
    for r in rows:
        r["prompt_token_ids"] = conv.prompt_ids(r["messages"])
        r["completion_token_ids"] = (tok.encode(r["reasoning"]) + [tok.specials["</think>"]] + tok.encode(r["content"])
                                     + [tok.specials["<|im_end|>"]])


def write_completions(rows: list[dict], directory: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from drafter_data.contract import COMPLETIONS

    directory.mkdir()
    for k in range(0, len(rows), 5000):
        table = pa.Table.from_pylist(rows[k:k + 5000])
        for name in ("prompt_token_ids", "completion_token_ids"):  # as generate stores them (not Python's int64)
            if name in table.column_names:
                table = table.set_column(table.schema.get_field_index(name), name,
                                         table[name].cast(COMPLETIONS.field(name).type))
        pq.write_table(table, directory / f"completions-{k // 5000:05d}.parquet")


def raw_tokens_per_s(conv, texts: list[str]) -> tuple[float, float]:
    """Raw tiktoken's tokens per second of wall time and per second of CPU time."""
    enc = conv.tokenizer._enc
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = sum(len(enc.encode_ordinary(t)) for t in texts)
    return tokens / (time.perf_counter() - t0), tokens / (time.process_time() - c0)


def floor_tokens_per_s(conv, texts: list[str]) -> float:
    """The least any tokenize must do, one thread: the rendered texts encoded as the stage encodes them (special
    tokens split out, ids as numpy) and written as tokens shards of 2,000 rows (to memory); no reading, rendering
    or bookkeeping."""
    import io

    import pyarrow.parquet as pq

    from drafter_data.tokens.rows import TOKENS_WRITE_OPTIONS, TokenRow, tokens_table

    tokens, t0 = 0, time.perf_counter()
    for k in range(0, len(texts), 2000):
        rows = [TokenRow("p", 0, True, conv.tokenizer.encode_chat_np(t), [(0, 1)], []) for t in texts[k:k + 2000]]
        tokens += sum(len(r.ids) for r in rows)
        pq.write_table(tokens_table(rows), io.BytesIO(), compression="zstd", **TOKENS_WRITE_OPTIONS)
    return tokens / (time.perf_counter() - t0)


def side_by_side(conv, texts: list[str]) -> float:
    """Raw tiktoken in WORKERS forked processes at once: each one's tokens/s over one alone's (what sharing the
    machine's cores and caches costs, before any work of the stage's)."""
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    start, rates = fork.Barrier(WORKERS), fork.Queue()

    def encode():
        start.wait()
        rates.put(raw_tokens_per_s(conv, texts)[0])

    alone = raw_tokens_per_s(conv, texts)[0]
    procs = [fork.Process(target=encode) for _ in range(WORKERS)]
    for proc in procs:
        proc.start()
    together = [rates.get() for _ in procs]
    for proc in procs:
        proc.join()
    return sum(together) / WORKERS / alone


def print_limits(conv, texts: list[str]) -> None:
    before = raw_tokens_per_s(conv, texts)[0]
    floor = floor_tokens_per_s(conv, texts)
    raw = (before + raw_tokens_per_s(conv, texts)[0]) / 2
    shared = side_by_side(conv, texts)
    print(f"limits: encoding + writing alone (one thread, no reading, rendering or bookkeeping) {floor / raw:.2f}x "
          f"raw; {WORKERS} raw processes side by side {shared:.2f}x one alone each; so per core past start-up cannot "
          f"pass about {floor / raw * shared:.2f}", flush=True)


def run_stage(tmp: Path, run: int, env: dict) -> dict:
    out = tmp / f"out{run}"
    stage = run_measured([sys.executable, "-c", LAUNCHER, sys.executable, "-m", "stages.tokenize", "target=kimi-k2.6",
                          f"target.tokenizer_dir={KIMI}",
                          f"tokenize.input={tmp / 'in'}", f"tokenize.output={out}", f"tokenize.workers={WORKERS}",
                          "tokenize.max_length=100000"], env=env)
    meta = json.loads((out / "meta.json").read_text())
    window, per_busy = re.search(r"throughput: .* over ([\d.]+) s of tokenizing, ([\d.]+) M per busy worker-second",
                                 stage["stderr"]).groups()
    peak_kb = float(re.search(r"stage peak RSS kB: (\d+)", stage["stderr"]).group(1))
    return {**stage, "tokens": meta["tokens"], "window_s": float(window), "per_busy": float(per_busy) * 1e6,
            "drift": meta["drift"], "peak_rss_mb": peak_kb / 1024}


ROWS_SMALL, ROWS_LARGE = 100, 400
# callgrind_annotate --inclusive lines: "  1,173,730,555 (23.23%)  ???:<tiktoken::CoreBPE>::__pymethod_encode..."
ANNOTATED = re.compile(r"^\s*([\d,]+) \(.*?\)\s+(.*)$", re.M)
PARTS = {"tiktoken": "<tiktoken::CoreBPE>::__pymethod_encode", "Parquet writing": "FileWriterImpl::WriteTable("}


def count_run(kind: str, directory: Path) -> None:
    """The process callgrind counts (--count): one worker's work over directory/in (worker), or raw
    encode_ordinary over the same rows' rendered texts (raw); prints the tokens."""
    if kind == "raw":
        enc = conversation_tokenizer().tokenizer._enc
        texts = pickle.loads((directory / "texts.pickle").read_bytes())  # a copy per text: cheaper than JSON
        print(sum(len(enc.encode_ordinary(t)) for t in texts))
        return
    from collections import Counter

    from drafter_data.config import compose
    from drafter_data.tokens.rows import init_worker, tokenize_task
    from stages.tokenize import input_shards, plan_tasks, worker_settings

    out = directory / "out"
    out.mkdir()
    cfg = compose(["target=kimi-k2.6", f"target.tokenizer_dir={KIMI}", f"tokenize.input={directory / 'in'}",
                   f"tokenize.output={out}", "tokenize.max_length=100000"])
    settings = worker_settings(cfg, out)
    init_worker(settings)
    counts = Counter()
    for task in plan_tasks(input_shards(directory / "in"), out, settings):
        counts.update(tokenize_task(task)[0])
    print(counts["tokens"])


def counted(kind: str, directory: Path) -> dict:
    """Instructions of one --count process under callgrind: in all, and inclusive in each of PARTS."""
    profile = directory / f"callgrind.{kind}"
    done = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={profile}", sys.executable,
                           __file__, "--count", kind, str(directory)], capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        sys.exit(f"callgrind run failed ({kind}, {directory}):\n{done.stderr[-3000:]}")
    total = int(re.search(r"Collected : (\d+)", done.stderr).group(1))
    # --threshold=100: every function, not only those above 1% (the small run's writing is below it)
    annotated = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(profile)],
                               capture_output=True, text=True).stdout
    parts = {}
    for name, mark in PARTS.items():
        found = [int(n.replace(",", "")) for n, symbol in ANNOTATED.findall(annotated) if mark in symbol]
        if not found and (kind == "worker" or name == "tiktoken"):
            sys.exit(f"no {mark!r} in the callgrind profile of the {kind} run ({profile}): renamed in this "
                     f"tiktoken/pyarrow version?")
        parts[name] = max(found, default=0)
    return {"instructions": total, "tokens": int(done.stdout.split()[-1]), **parts}


def instruction_counts() -> None:
    from concurrent.futures import ThreadPoolExecutor  # after sys.path's fix: it imports the stdlib tokenize

    if not shutil.which("valgrind"):
        sys.exit("--instructions needs valgrind (Debian: apt-get install valgrind)")
    conv = conversation_tokenizer()
    rows = build_rows(ROWS_LARGE)
    with tempfile.TemporaryDirectory(prefix="bench-tokenize-count-") as tmp:
        runs = []
        for n in (ROWS_SMALL, ROWS_LARGE):
            directory = Path(tmp) / str(n)
            directory.mkdir()
            write_completions(rows[:n], directory / "in")
            (directory / "texts.pickle").write_bytes(pickle.dumps(rendered_texts(conv, rows[:n])))
            runs += [("worker", directory), ("raw", directory)]
        print(f"counting instructions under callgrind: a worker and raw encode_ordinary over {ROWS_SMALL} and "
              f"{ROWS_LARGE} rows (about 3 minutes)", flush=True)
        with ThreadPoolExecutor(2) as pool:
            worker_small, raw_small, worker_large, raw_large = pool.map(lambda run: counted(*run), runs)

    def per_token(large: dict, small: dict, key: str = "instructions") -> float:
        return (large[key] - small[key]) / (large["tokens"] - small["tokens"])

    worker, raw = per_token(worker_large, worker_small), per_token(raw_large, raw_small)
    parts = ", ".join(f"{name} {per_token(worker_large, worker_small, name) / worker:.0%}" for name in PARTS)
    print(f"instructions per token, rows {ROWS_SMALL} -> {ROWS_LARGE}: worker {worker:,.0f} ({parts}), raw "
          f"encode_ordinary {raw:,.0f} (its tiktoken call {per_token(raw_large, raw_small, 'tiktoken'):,.0f}); "
          f"per core, in instructions: {raw / worker:.2f}x raw (repeatable to about 1%)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ids", action="store_true", help="rows carry the server's prompt and sampled ids")
    parser.add_argument("--instructions", action="store_true", help="count instructions (callgrind) instead")
    parser.add_argument("--count", nargs=2, metavar=("KIND", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not KIMI.exists():
        sys.exit(f"missing {KIMI}: the benchmark uses ../shared's Kimi tokenizer files")
    if args.count:
        count_run(args.count[0], Path(args.count[1]))
        return
    if args.instructions:
        instruction_counts()
        return
    conv = conversation_tokenizer()
    rows = build_rows(args.rows)
    if args.ids:
        add_server_ids(conv, rows)
    texts = rendered_texts(conv, rows)
    with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as tmp:
        tmp = Path(tmp)
        write_completions(rows, tmp / "in")
        del rows
        # the tracking database exists in real use; creating one (~3 s of migrations) is not the stage's work
        env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"}
        run_measured([sys.executable, "-c", "import mlflow; mlflow.set_experiment('drafter-data')"], env=env)
        sample = texts[:5000]
        raw_before = raw_tokens_per_s(conv, sample)
        print(f"{len(texts):,} rows ({sum(map(len, texts)) / 1e6:.1f} MB rendered)"
              f"{', with server ids' if args.ids else ''}; raw tiktoken encode_ordinary, 1 thread, measured around "
              f"each run (this machine's speed drifts): {raw_before[0] / 1e6:.2f} M tokens/s now")
        for run in range(args.runs):
            s = run_stage(tmp, run, env)
            raw_after = raw_tokens_per_s(conv, sample)
            raw, raw_cpu = ((a + b) / 2 for a, b in zip(raw_before, raw_after))
            raw_before = raw_after
            past, whole = s["tokens"] / s["window_s"] / WORKERS / raw, s["tokens"] / s["wall_s"] / WORKERS / raw
            cpu = s["tokens"] / s["cpu_s"] / raw_cpu
            print(f"run {run + 1}: per core past start-up {past:.2f} "
                  f"(per busy worker-second {s['per_busy'] / raw:.2f}), "
                  f"whole process {whole:.2f}, per CPU-second {cpu:.2f} "
                  f"({s['tokens']:,} tokens; raw {raw / 1e6:.2f} M/s; wall {s['wall_s']:.1f} s, tokenizing "
                  f"{s['window_s']:.1f} s, start-up and finish {s['wall_s'] - s['window_s']:.1f} s; peak RSS "
                  f"{s['peak_rss_mb']:.0f} MB, CPU {s['cpu_s']:.1f} s; drift rows compared {s['drift']['rows_compared']})")
        print_limits(conv, sample)


if __name__ == "__main__":
    main()

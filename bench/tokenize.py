"""Benchmark of the tokenize stage (Kimi K2.6 tokenizer, 2 worker processes) against raw tiktoken.

Builds completions of ~2,000 tokens from the prompt fixtures' real answers, renders them with K2.6's template, and
prints in one run: the stage's tokens/s (whole stage process: read, render, tokenize, mask, write), raw tiktoken
`encode_ordinary` tokens/s over the same rendered texts (one thread, in this process), and their ratio (goal >= 0.8).

    .venv/bin/python bench/tokenize.py [--rows 20000]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

# run as a script, bench/ would be first on sys.path and bench/tokenize.py would shadow the stdlib module
sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench._common import REPO, SHARED, run_measured  # noqa: E402

KIMI = SHARED / "fixtures" / "kimi-k2-tokenizer"


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
                     "prompt_tokens": 0, "completion_tokens": 0})
    return rows


def main() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from omegaconf import OmegaConf

    from drafter_data.conversation_tokens import ConversationTokenizer, final_assistant_message
    from drafter_data.tokenizers import KimiTokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=20000)
    args = parser.parse_args()
    if not KIMI.exists():
        sys.exit(f"missing {KIMI}: the benchmark uses ../shared's Kimi tokenizer files")
    rows = build_rows(args.rows)
    with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as tmp:
        tmp = Path(tmp)
        (tmp / "in").mkdir()
        for k in range(0, len(rows), 5000):
            pq.write_table(pa.Table.from_pylist(rows[k:k + 5000]), tmp / "in" / f"completions-{k // 5000:05d}.parquet")
        target = OmegaConf.load(REPO / "conf/target/kimi-k2.6.yaml")
        target.tokenizer_dir = str(KIMI)
        tok = KimiTokenizer(KIMI)
        conv = ConversationTokenizer(target, tok, True, {"preserve_thinking": True})
        texts = [conv.render(r["messages"] + [final_assistant_message(r["content"], r["reasoning"])]) for r in rows]
        enc = tok._enc
        t0 = time.perf_counter()
        raw_tokens = sum(len(enc.encode_ordinary(t)) for t in texts)
        raw_s = time.perf_counter() - t0
        # the tracking database exists in real use; creating one (~3 s of migrations) is not the stage's work
        env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"}
        run_measured([sys.executable, "-c", "import mlflow; mlflow.set_experiment('drafter-data')"], env=env)
        stage = run_measured([sys.executable, "-m", "stages.tokenize", "target=kimi-k2.6",
                              f"target.tokenizer_dir={KIMI}", f"tokenize.input={tmp / 'in'}",
                              f"tokenize.output={tmp / 'out'}", "tokenize.workers=2", "tokenize.max_length=100000"],
                             env=env)
        meta = json.loads((tmp / "out" / "meta.json").read_text())
        stage_tps = meta["tokens"] / stage["wall_s"]
        raw_tps = raw_tokens / raw_s
        print(f"{len(rows):,} rows, {meta['tokens']:,} tokens ({sum(map(len, texts)) / 1e6:.1f} MB rendered)")
        print(f"raw tiktoken encode_ordinary (1 thread): {raw_tps / 1e6:.2f} M tokens/s ({raw_s:.1f} s)")
        print(f"tokenize stage (2 workers, whole process): {stage_tps / 1e6:.2f} M tokens/s ({stage['wall_s']:.1f} s, "
              f"peak RSS {stage['peak_rss_mb']:.0f} MB, CPU {stage['cpu_s']:.1f} s)")
        print(f"ratio stage / raw: {stage_tps / raw_tps:.2f}")


if __name__ == "__main__":
    main()

"""The tokenize stage reproduces the official Kimi K2.6 tokenization (goldens made with the reference code)."""
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from omegaconf import OmegaConf

from drafter_data.tokens.conversation import ConversationTokenizer
from drafter_data.tokens.tokenizers import KimiTokenizer, may_be_cut, split_long_runs
from tests.conftest import KIMI_DIR, REPO, read_rows, require_shared


def goldens(name="golden.jsonl"):
    return [json.loads(line) for line in require_shared(KIMI_DIR / name).read_text().splitlines()]


def completion_row(case_id: str, messages: list[dict], **extra) -> dict:
    """A completions row as generate writes it; fields beyond role/content travel in message_extras."""
    *prompt, final = messages
    return {
        "prompt_id": case_id,
        "source": "golden",
        "messages": [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else ""}
                     for m in prompt],
        "message_extras": orjson.dumps([{k: v for k, v in m.items() if k not in ("role",)
                                         and not (k == "content" and isinstance(v, str))} for m in prompt]).decode(),
        "reasoning": final.get("reasoning_content"),
        "content": final["content"],
        "tool_calls": orjson.dumps(final["tool_calls"]).decode() if final.get("tool_calls") else None,
        "finish_reason": "stop",
        "prompt_tokens": 1,
        "completion_tokens": 1,
        **extra,
    }


def write_completions(directory: Path, rows: list[dict]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), directory / "completions-00000.parquet")
    return directory


def kimi_overrides(inp: Path, out: Path, thinking: bool = True, kwargs: str = "{preserve_thinking:true}"):
    """K2.6, rendering with `kwargs` on top of its own {preserve_thinking: true}; the goldens rendered without
    preserve_thinking ("{}") are rendered with it false, the template's default."""
    kwargs = "{preserve_thinking:false}" if kwargs == "{}" else kwargs
    return ["target=kimi-k2.6", f"target.tokenizer_dir={KIMI_DIR}", f"generation.thinking={str(thinking).lower()}",
            f"tokenize.template_kwargs={kwargs}", f"tokenize.input={inp}", f"tokenize.output={out}"]


def test_every_chat_golden_reproduces_through_the_stage(run_stage, tmp_path):
    groups = defaultdict(list)
    prompt_only = []
    for case in goldens():
        kwargs = {k: v for k, v in case["template_kwargs"].items() if k not in ("add_generation_prompt", "thinking")}
        if case["add_generation_prompt"]:
            prompt_only.append(case)
            continue
        thinking = True if case["thinking"] is None else case["thinking"]
        groups[(thinking, json.dumps(kwargs, sort_keys=True))].append(case)
    assert sum(map(len, groups.values())) == 14 and len(prompt_only) == 2
    for i, ((thinking, kwargs_json), cases) in enumerate(sorted(groups.items())):
        kwargs = json.loads(kwargs_json)
        inp = write_completions(tmp_path / f"in{i}", [completion_row(c["id"], c["messages"]) for c in cases])
        kw = "{" + ",".join(f"{k}:{str(v).lower()}" for k, v in kwargs.items()) + "}"
        run_stage("tokenize", *kimi_overrides(inp, tmp_path / f"out{i}", thinking, kw), "tokenize.workers=2")
        rows = {r["prompt_id"]: r for r in read_rows(tmp_path / f"out{i}")}
        for case in cases:
            row = rows[case["id"]]
            end = case["assistant_token_span"][1]
            # the loss starts where generation started: after the prompt rendered with add_generation_prompt=True
            assert case["prompt"]["is_token_prefix_of_full"], case["id"]
            start = len(case["prompt"]["input_ids"])
            assert row["input_ids"] == case["input_ids"], case["id"]
            assert end == len(case["input_ids"]) and row["input_ids"][:start] == case["prompt"]["input_ids"]
            assert row["loss_mask"] == [0] * start + [1] * (end - start), case["id"]
        meta = json.loads((tmp_path / f"out{i}" / "meta.json").read_text())
        assert meta["rows"] == {"read": len(cases), "kept": len(cases)}, meta["rows"]
        assert meta["drift"] == {"rows_compared": 0, "rows_differ": 0, "tokens_differ": 0, "rate": 0.0,
                                 "rows_text_cut_short": 0, "tokens_text_cut_short": 0, "first_rows_differ": []}
        assert meta["thinking"] is thinking and meta["special_ids"]["mask_token_id"] == 163837
        assert meta["vocab_size"] == 163840 and meta["special_ids"]["bos"] == 163584
        assert meta["tokenizer"]["files_sha256"]["tiktoken.model"].startswith("b6c497a7469b")


def test_prompt_renderings_match_the_goldens():
    target = OmegaConf.load(REPO / "conf/target/kimi-k2.6.yaml")
    target.tokenizer_dir = str(KIMI_DIR)
    tok = KimiTokenizer(KIMI_DIR)
    checked = 0
    for case in goldens():
        kwargs = {k: v for k, v in case["template_kwargs"].items() if k not in ("add_generation_prompt", "thinking")}
        thinking = True if case["thinking"] is None else case["thinking"]
        conv = ConversationTokenizer(target, tok, {"thinking": thinking, **kwargs})
        if case["add_generation_prompt"]:
            assert conv.render(case["messages"], add_generation_prompt=True) == case["rendered"]
            assert conv.prompt_ids(case["messages"]) == case["input_ids"]
            checked += 1
        if case.get("prompt"):
            assert conv.prompt_ids(case["messages"][:-1]) == case["prompt"]["input_ids"], case["id"]
            checked += 1
        assert tok.decode(case["input_ids"]) == case["rendered"]
    assert checked >= 10


def test_plain_encoding_goldens():
    tok = KimiTokenizer(KIMI_DIR)
    for case in goldens("encode_golden.jsonl"):
        assert tok.encode(case["text"], allow_special_tokens=False) == case["ids_special_disallowed"], case["id"]
        assert tok.encode(case["text"], allow_special_tokens=True) == case["ids_special_allowed"], case["id"]


def test_long_runs_are_cut_like_the_reference():
    """The reference's cut, written as the plain per-character loop it is, against the fast version."""

    def reference(s, limit=25_000):
        out, run, is_space, start = [], 0, s[0].isspace() if s else False, 0
        for i, ch in enumerate(s):
            if is_space ^ ch.isspace():
                run, is_space = 1, ch.isspace()
            else:
                run += 1
                if run > limit:
                    out.append(s[start:i])
                    start, run = i, 1
        out.append(s[start:])
        return out

    for text in ["a" * 60_001, " " * 25_001 + "b" * 50_000 + "\n" * 3, "x y " * 9000, "é" * 25_000,
                 "ab " + "\u3000" * 30_000 + "z" * 24_999]:
        assert split_long_runs(text) == reference(text)


def test_the_quick_cut_check_never_misses_a_cut():
    """may_be_cut decides whether one tiktoken call can replace the reference's chunked, run-cut encoding: when it
    says no, the reference's cut must leave the text whole."""
    import random

    rng = random.Random(7)
    texts = ["word " * 20_000, "x" * 24_999 + " " + "y" * 24_999, "x" * 25_001 + " tail", " " * 25_001 + "z",
             "a" * 400_001, ("b" * 12_499 + "\n") * 5]
    for _ in range(200):
        parts = [rng.choice(["a", " ", "\n", "\u4e2d", "\t"]) * rng.choice([1, 5, 3000, 12_500, 20_000, 25_001])
                 for _ in range(rng.randint(1, 8))]
        texts.append("".join(parts))
    said_no = 0
    for text in texts:
        if not may_be_cut(text):
            said_no += 1
            assert split_long_runs(text) == [text] and len(text) <= 400_000
    assert not may_be_cut("x" * 100) and may_be_cut("x" * 25_001) and may_be_cut("a" * 400_001)
    assert said_no > 20


def test_encode_chat_split_is_the_two_halves_encoded_apart():
    """One call over prompt + answer, cut after the prompt's final special token, gives exactly the prompt's and
    the answer's own ids; also when that token's spelling occurs earlier (a user writing <think>) and for text
    over 25k characters."""
    target = OmegaConf.load(REPO / "conf/target/kimi-k2.6.yaml")
    target.tokenizer_dir = str(KIMI_DIR)
    tok = KimiTokenizer(KIMI_DIR)
    conv = ConversationTokenizer(target, tok, {"thinking": True, "preserve_thinking": True})
    cases = [c["messages"] for c in goldens() if not c["add_generation_prompt"]]
    cases.append([{"role": "user", "content": "what does <think> do? <think></think>"},
                  {"role": "assistant", "content": "it opens <think> ... " * 3000, "reasoning_content": "hm " * 9000}])
    checked = 0
    for thinking in (True, False):
        for messages in cases:
            prompt = conv.render(messages[:-1], add_generation_prompt=True, thinking=thinking)
            full = conv.render(messages, thinking=thinking)
            if not full.startswith(prompt):  # thinking off, but the answer has reasoning: not a row tokenize keeps
                continue
            head, tail = tok.encode_chat_split(full, len(prompt))
            assert head.tolist() == tok.encode_chat(prompt) and tail.tolist() == tok.encode_chat(full[len(prompt):])
            checked += 1
    assert checked >= 16


def test_long_segment_between_special_tokens(run_stage, tmp_path):
    """A >25k run in content: the cut counts from the segment start, not from the start of the rendering."""
    tok = KimiTokenizer(KIMI_DIR)
    content = "y" * 30_000
    inp = write_completions(tmp_path / "in", [completion_row("long", [{"role": "user", "content": "hi"},
                                                                       {"role": "assistant", "content": content}])])
    run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out"), "tokenize.max_length=100000")
    (row,) = read_rows(tmp_path / "out")
    body = tok.encode("y" * 25_000) + tok.encode("y" * 5_000)
    assert row["input_ids"][-len(body) - 1:-1] == body and row["input_ids"][-1] == tok.specials["<|im_end|>"]


def test_mask_token_text_is_escaped_or_dropped(run_stage, tmp_path):
    spelled = "<|reserved_token_163837|>"
    rows = [completion_row("spells", [{"role": "user", "content": f"say {spelled}"},
                                      {"role": "assistant", "content": f"ok {spelled}"}]),
            completion_row("clean", [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}])]
    inp = write_completions(tmp_path / "in", rows)
    run_stage("tokenize", *kimi_overrides(inp, tmp_path / "esc"))
    out = {r["prompt_id"]: r for r in read_rows(tmp_path / "esc")}
    assert set(out) == {"spells", "clean"} and all(163837 not in r["input_ids"] for r in out.values())
    tok = KimiTokenizer(KIMI_DIR)
    assert tok.decode(out["spells"]["input_ids"]).count(spelled) == 2  # kept as the text it is
    assert json.loads((tmp_path / "esc" / "meta.json").read_text())["rows"]["mask_text_escaped"] == 1
    run_stage("tokenize", *kimi_overrides(inp, tmp_path / "drop"), "tokenize.on_mask_token_text=drop")
    assert [r["prompt_id"] for r in read_rows(tmp_path / "drop")] == ["clean"]
    assert json.loads((tmp_path / "drop" / "meta.json").read_text())["rows"]["dropped.mask_token_in_text"] == 1


def test_length_policies(run_stage, tmp_path):
    rows = [completion_row(f"r{i}", [{"role": "user", "content": "count"},
                                     {"role": "assistant", "content": " ".join(map(str, range(40 * i)))}],
                           finish_reason="length" if i == 3 else "stop") for i in (0, 2, 3)]
    inp = write_completions(tmp_path / "in", rows)
    run_stage("tokenize", *kimi_overrides(inp, tmp_path / "a"), "tokenize.max_length=60")
    a = {r["prompt_id"]: r for r in read_rows(tmp_path / "a")}
    meta = json.loads((tmp_path / "a" / "meta.json").read_text())
    assert set(a) == {"r0", "r2", "r3"} and all(len(r["input_ids"]) <= 60 for r in a.values())
    assert meta["rows"]["truncated"] == 2 and meta["rows"]["finish_length"] == 1
    run_stage("tokenize", *kimi_overrides(inp, tmp_path / "b"), "tokenize.max_length=60",
              "tokenize.overlength=drop", "tokenize.on_length_finish=drop")
    b = {r["prompt_id"]: r for r in read_rows(tmp_path / "b")}
    meta = json.loads((tmp_path / "b" / "meta.json").read_text())
    assert "r3" not in b and meta["rows"]["dropped.finish_length"] == 1
    assert all(len(r["input_ids"]) <= 60 for r in b.values())
    assert set(b) == {"r0"} and meta["rows"]["dropped.over_max_length"] == 1 and meta["rows"]["kept"] == 1


def test_refuses_completions_of_another_thinking_mode_or_target(run_stage, tmp_path):
    rows = [completion_row("x", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                           thinking=False, target="kimi-k2.6")]
    inp = write_completions(tmp_path / "in", rows)
    proc = run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out", thinking=True), check=False)
    assert proc.returncode == 1 and "thinking" in proc.stderr.strip().splitlines()[-1]
    rows[0].update(thinking=True, target="qwen3")
    inp = write_completions(tmp_path / "in2", rows)
    proc = run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out", thinking=True), check=False)
    assert proc.returncode == 1 and "target" in proc.stderr.strip().splitlines()[-1]


def test_missing_tokenizer_file_is_a_clear_error(run_stage, tmp_path):
    inp = write_completions(tmp_path / "in", [completion_row("x", [{"role": "user", "content": "q"},
                                                                   {"role": "assistant", "content": "a"}])])
    (tmp_path / "model").mkdir()
    args = kimi_overrides(inp, tmp_path / "out")
    args[1] = f"target.tokenizer_dir={tmp_path / 'model'}"
    proc = run_stage("tokenize", *args, check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "tiktoken.model not found" in last and str(tmp_path / "model") in last


def test_prepare_drops_prompts_over_max_prompt_tokens_for_the_target(run_stage, tmp_path):
    """The golden prompt-only case has a known length in K2.6 tokens: the limit keeps it at n, drops it at n-1."""
    case = next(c for c in goldens() if c["id"] == "kimi_08_prompt_only_default")
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"messages": case["messages"]}) + "\n" + json.dumps({"prompt": "short"}) + "\n")
    n = case["num_tokens"]
    for limit, kept in ((n, 2), (n - 1, 1)):
        out = tmp_path / f"out{limit}"
        run_stage("prepare", f"prepare.output={out}", f"prepare.sources=[{{name:p,path:'{src}',format:auto}}]",
                  "target=kimi-k2.6", f"target.tokenizer_dir={KIMI_DIR}", f"prepare.max_prompt_tokens={limit}")
        stats = json.loads((out / "stats.json").read_text())["p"]
        assert stats["kept"] == kept and stats["dropped"].get("too_many_tokens", 0) == 2 - kept


def test_the_stage_forks_its_workers_and_they_work_without_importing_pandas(tmp_path):
    """Workers are forked before anything imports pandas (MLflow does, after the fork), and pa.array would import it
    (0.3-0.5 s of CPU) in each worker, inside the tokenizing window; pq.read_table (pyarrow.dataset) would import it
    before the fork. Checked in a fresh process doing exactly what the stage does before forking, then a worker's
    work."""
    require_shared(KIMI_DIR)
    rows = [completion_row(f"p{i}", [{"role": "user", "content": f"question {i}"},
                                     {"role": "assistant", "content": f"answer {i}", "reasoning_content": "why " * i}],
                           target="kimi-k2.6", thinking=True)  # the columns check_consistency reads
            for i in range(5)]
    inp = write_completions(tmp_path / "in", rows)
    out = tmp_path / "out"
    out.mkdir()
    script = f"""
import json, sys
from collections import Counter
from drafter_data.config import compose
from drafter_data.tokens.checks import check_consistency, check_policies
from drafter_data.tokens.rows import init_worker, tokenize_task
from stages.tokenize import input_shards, plan_tasks, worker_settings
cfg = compose({kimi_overrides(inp, out)!r})
paths = input_shards(cfg.tokenize.input)
check_policies(cfg.tokenize)
check_consistency(paths, cfg)
settings = worker_settings(cfg, {str(out)!r})
init_worker(settings)
tasks = plan_tasks(paths, {str(out)!r}, settings)
before_fork = "pandas" in sys.modules
counts = sum((tokenize_task(task)[0] for task in tasks), start=Counter())
print(json.dumps({{"kept": counts["kept"], "before_fork": before_fork, "after_work": "pandas" in sys.modules}}))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"kept": 5, "before_fork": False, "after_work": False}
    assert len(read_rows(out)) == 5

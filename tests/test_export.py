"""The export stage on K2.6 rows (the fixtures' tokenizer): the pre-tokenized rows are the tokens' rows, the
conversations' `exact` flag is right on non-canonical splits, a length cut and a tool call, every row is counted once,
and what must never happen does not (an output put in place after SIGTERM, a row exported twice, completions that are
not the tokens' source, a green export of nothing, a traceback on a broken input)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from omegaconf import OmegaConf

from drafter_data.export import degenerate
from drafter_data.export.conversations import SystemDefault, with_system
from drafter_data.tokens.conversation import ConversationTokenizer
from drafter_data.tokens.tokenizers import KimiTokenizer
from tests.conftest import KIMI_DIR, REPO, read_rows
from tests.test_tokenize import completion_row, goldens, kimi_overrides, write_completions
from tests.test_tokenize_ids import CONTENT, REASONING, sampled, sid, split_one_token

LOOP = "I will check this again. " * 30


def kimi_conv():
    tok = KimiTokenizer(KIMI_DIR)
    target = OmegaConf.load(REPO / "conf/target/kimi-k2.6.yaml")
    target.tokenizer_dir = str(KIMI_DIR)
    return tok, ConversationTokenizer(target, tok, {"thinking": True, "preserve_thinking": True})


def question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Question {i}: what is the boiling point of water at sea level?"}]


def k26_rows() -> list[dict]:
    """Plain rows with the server's ids, one with a non-canonical split, one cut by max_tokens, a tool call (no ids:
    retokenized), a looping answer and an empty one (empty reasoning and empty answer: two kinds, one row)."""
    tok, conv = kimi_conv()
    rows = []
    for i in range(4):
        q = question(i)
        rows.append(completion_row(f"plain{i}", q + [{"role": "assistant", "content": CONTENT,
                                                      "reasoning_content": REASONING}],
                                   prompt_token_ids=conv.prompt_ids(q), completion_token_ids=sampled(tok, REASONING, CONTENT),
                                   thinking=True, source="alpha" if i % 2 else "beta"))
    q = question(10)
    rows.append(completion_row("split", q + [{"role": "assistant", "content": CONTENT, "reasoning_content": REASONING}],
                               prompt_token_ids=conv.prompt_ids(q),
                               completion_token_ids=split_one_token(tok, sampled(tok, REASONING, CONTENT)),
                               thinking=True, source="alpha"))
    q = question(11)
    rows.append(completion_row("cut", q + [{"role": "assistant", "content": CONTENT[:20],
                                            "reasoning_content": REASONING}],
                               prompt_token_ids=conv.prompt_ids(q), finish_reason="length", length_stop_in="content",
                               completion_token_ids=tok.encode(REASONING) + [sid(tok, "</think>")]
                               + tok.encode(CONTENT[:20]), thinking=True, source="beta"))
    case = next(c for c in goldens("tools_golden.jsonl") if c["id"] == "tools_01_simple_params")
    rows.append(completion_row("tool", case["messages"], tools=orjson.dumps(case["tools"]).decode(),
                               finish_reason="tool_calls", thinking=True, source="tools"))
    rows.append(completion_row("loop", question(12) + [{"role": "assistant", "content": LOOP,
                                                        "reasoning_content": "Short."}], thinking=True, source="beta"))
    rows.append(completion_row("empty", question(13) + [{"role": "assistant", "content": "",
                                                         "reasoning_content": ""}], thinking=True, source="beta"))
    keys = dict.fromkeys(k for row in rows for k in row)  # from_pylist takes the first row's keys: give all of them
    return [{k: row.get(k) for k in keys} for row in rows]


def export_overrides(tokens: Path, completions: Path, out: Path, *more: str) -> list[str]:
    return ["target=kimi-k2.6", f"target.tokenizer_dir={KIMI_DIR}", "generation.thinking=true",
            "tokenize.template_kwargs={preserve_thinking:true}", f"export.input={tokens}",
            f"export.completions={completions}", f"export.output={out}", *more]


def run(args: list[str], env: dict | None = None, stage: str = "export") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"stages.{stage}", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def made(tmp_path_factory, mlflow_uri):
    """K2.6 completions and their tokens (tokenize run once for the module)."""
    base = tmp_path_factory.mktemp("k26")
    completions = write_completions(base / "completions", k26_rows())
    env = {"MLFLOW_TRACKING_URI": mlflow_uri}
    proc = run([*kimi_overrides(completions, base / "tokens"), "tokenize.max_drift_rate=0.5"], env, "tokenize")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return base, completions, base / "tokens", env


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def last_line(proc) -> str:
    return proc.stderr.strip().splitlines()[-1]


def test_rows_conversations_exact_and_counts(made, tmp_path):
    base, completions, tokens, env = made
    out = tmp_path / "export"
    proc = run(export_overrides(tokens, completions, out), env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    token_rows = read_rows(tokens, "tokens-")
    pre = lines(out / "pretokenized.jsonl")
    # exactly the tokens' rows, in their order (eagle3 keeps every row with a supervised token)
    assert [(r["id"], r["input_ids"], r["loss_mask"]) for r in pre] == \
        [(f"{r['prompt_id']}#turn{r['turn']}", r["input_ids"], r["loss_mask"]) for r in token_rows]
    convs = {c["id"]: c for c in lines(out / "conversations.jsonl")}
    assert len(convs) == len(token_rows) == 9
    exact = {c["conversation_id"]: c["exact"] for c in convs.values()}
    assert exact == {"plain0": True, "plain1": True, "plain2": True, "plain3": True, "split": False, "cut": False,
                     "tool": True, "loop": True, "empty": True}
    tool = convs["tool#turn0"]
    answer = tool["messages"][-1]
    assert answer["role"] == "assistant" and answer["tool_calls"] and tool["tools"] and tool["messages"] == \
        tool["conversations"]
    cut = convs["cut#turn0"]["messages"][-1]
    assert cut["content"] == CONTENT[:20] and cut["reasoning_content"] == REASONING
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows_in"] == 9 and summary["rows_out"] == {"pretokenized.jsonl": 9, "conversations.jsonl": 9}
    assert summary["exact"] == {"rows": 9, "exact": 7, "share": 7 / 9}
    assert summary["degenerate"] == {"loop": 1, "empty_reasoning": 1, "empty_answer": 1}
    assert summary["filtered"] == {} and summary["would_drop"] == {"eagle3": {}, "dflash": {}}
    assert summary["finish_reasons"] == {"length (content)": 1, "stop": 7, "tool_calls": 1}
    assert summary["by_source"]["beta"]["rows"] == 5 and summary["by_source"]["tools"]["exact"] == 1
    meta = json.loads((tokens / "meta.json").read_text())
    assert summary["completions_request_keys_sha256"] == meta["completions_request_keys_sha256"]
    card = (out / "README.md").read_text()
    assert "77.8%" in card and meta["chat_template_sha256"] in card and "b6c497a7469b" in card
    for png in ("rows_per_source.png", "quality_per_source.png", "turns.png", "token_lengths.png",
                "finish_reasons.png", "loss_tokens.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG" and f"]({png})" in card


def test_card_header_is_a_dataset_card_that_finds_the_files(made, tmp_path):
    """The YAML header as `datasets` reads it: configs whose data_files name files that exist, and the pre-tokenized
    features naming exactly the keys of its lines."""
    base, completions, tokens, env = made
    out = tmp_path / "export"
    assert run(export_overrides(tokens, completions, out), env).returncode == 0
    text = (out / "README.md").read_text()
    assert text.startswith("---\n")
    header = yaml.safe_load(text.split("---\n")[1])
    configs = {c["config_name"]: c for c in header["configs"]}
    assert set(configs) == {"pretokenized", "conversations"} and configs["pretokenized"]["default"] is True
    for config in configs.values():
        for files in config["data_files"]:
            assert files["split"] == "train" and (out / files["path"]).is_file()
    info = {i["config_name"]: i for i in header["dataset_info"]}
    first = lines(out / "pretokenized.jsonl")[0]
    assert [f["name"] for f in info["pretokenized"]["features"]] == list(first)
    for config, name in (("pretokenized", "pretokenized.jsonl"), ("conversations", "conversations.jsonl")):
        assert info[config]["splits"] == [{"name": "train", "num_bytes": (out / name).stat().st_size,
                                           "num_examples": 9}]


def test_drops_are_counted_once_and_everything_adds_up(made, tmp_path):
    """export.drop leaves degenerate answers out (the empty row, of two kinds, once); the trainer's rules then apply
    to the rest; rows_in = rows out + sum(filtered)."""
    base, completions, tokens, env = made
    out = tmp_path / "export"
    proc = run(export_overrides(tokens, completions, out, "export.drop=[empty_reasoning,empty_answer,loop]",
                                "export.trainer=dflash"), env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["filtered"] == {"degenerate.empty_reasoning": 1, "degenerate.loop": 1}
    assert summary["degenerate"] == {"loop": 1, "empty_reasoning": 1, "empty_answer": 1}
    assert summary["rows_in"] == summary["rows_out"]["pretokenized.jsonl"] + sum(summary["filtered"].values()) == 9
    assert summary["rows_out"]["conversations.jsonl"] == 7
    ids = [r["id"] for r in lines(out / "pretokenized.jsonl")]
    assert "empty#turn0" not in ids and "loop#turn0" not in ids and len(ids) == len(set(ids)) == 7
    card = (out / "README.md").read_text()
    assert "| degenerate.empty_reasoning | 1 |" in card and "empty_answer" not in card.split("## Rows left out")[1] \
        .split("\n\n")[1]


def test_a_cut_that_leaves_no_row_exits_non_zero_and_puts_nothing_in_place(made, tmp_path):
    base, completions, tokens, env = made
    out = tmp_path / "export"
    out.mkdir()
    (out / "summary.json").write_text("{\"old\": true}")
    proc = run(export_overrides(tokens, completions, out, "export.max_length=5"), env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "left no pre-tokenized row of 9" in last_line(proc) and "eagle3.fewer_than_1_loss_token" in last_line(proc)
    assert json.loads((out / "summary.json").read_text()) == {"old": True}
    assert not list(tmp_path.glob(".export.partial-*"))


def test_duplicate_completions_are_read_once(made, tmp_path):
    """A completions shard copied (every row twice): each row is exported once, the copies counted; a second answer
    to one request is refused in one line."""
    base, completions, tokens, env = made
    copied = tmp_path / "completions"
    copied.mkdir()
    shard = next(completions.glob("*.parquet"))
    for name in ("completions-00000.parquet", "completions-00001.parquet"):
        (copied / name).write_bytes(shard.read_bytes())
    out = tmp_path / "export"
    proc = run(export_overrides(tokens, copied, out), env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(lines(out / "conversations.jsonl")) == len(lines(out / "pretokenized.jsonl")) == 9
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completions"] == {"rows": 9, "duplicates_read_once": 9, "without_a_row_of_their_own": 0}
    assert summary["by_source"]["beta"]["rows"] == 5


def test_completions_that_are_not_the_tokens_source_are_refused(made, tmp_path):
    base, completions, tokens, env = made
    table = pq.read_table(next(completions.glob("*.parquet")))
    content = table.column("content").to_pylist()
    content[0] = content[0] + " (answered again)"
    other = tmp_path / "other"
    other.mkdir()
    pq.write_table(table.set_column(table.schema.get_field_index("content"), "content", pa.array(content)),
                   other / "completions-00000.parquet")
    proc = run(export_overrides(tokens, other, tmp_path / "export"), env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "are not the ones the tokens" in last_line(proc) and "completions_request_keys_sha256" in last_line(proc)
    assert not (tmp_path / "export").exists()
    # tokens of an older tokenize (no digest): refused too, asking for tokenize again
    old = tmp_path / "old_tokens"
    old.mkdir()
    for path in tokens.iterdir():
        (old / path.name).write_bytes(path.read_bytes())
    meta = json.loads((old / "meta.json").read_text())
    del meta["completions_request_keys_sha256"]
    (old / "meta.json").write_text(json.dumps(meta))
    proc = run(export_overrides(old, completions, tmp_path / "export"), env)
    assert proc.returncode == 1 and "run tokenize again" in last_line(proc) and "Traceback" not in proc.stderr


@pytest.mark.parametrize("damage", ["truncated_tokens", "truncated_completions", "meta_not_json", "meta_keys",
                                    "tokens_refused"])
def test_a_broken_input_is_one_line(made, tmp_path, damage):
    base, completions, tokens, env = made
    tok_dir, comp_dir = tmp_path / "tokens", tmp_path / "completions"
    for src, dst in ((tokens, tok_dir), (completions, comp_dir)):
        dst.mkdir()
        for path in src.iterdir():
            (dst / path.name).write_bytes(path.read_bytes())
    shard = next(tok_dir.glob("tokens-*.parquet")) if damage == "truncated_tokens" else next(comp_dir.glob("*.parquet"))
    if damage.startswith("truncated"):
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    meta = json.loads((tok_dir / "meta.json").read_text())
    if damage == "meta_not_json":
        (tok_dir / "meta.json").write_text('{"target": "kimi-k2.6", ')
    elif damage == "meta_keys":
        (tok_dir / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "tokenizer"}))
    elif damage == "tokens_refused":
        (tok_dir / "meta.json").write_text(json.dumps({**meta, "refused": ["3 of 9 rows were dropped"]}))
    proc = run(export_overrides(tok_dir, comp_dir, tmp_path / "export"), env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stderr.strip().splitlines()[-1].startswith("error: ")
    expected = {"truncated_tokens": "cannot read the token shard", "truncated_completions": "cannot read the completions",
                "meta_not_json": "meta.json", "meta_keys": "lacks tokenizer", "tokens_refused": "tokenize refused"}
    assert expected[damage] in last_line(proc)
    assert not (tmp_path / "export").exists()


SIGTERM_DRIVER = r"""
import os, runpy, signal, sys
import drafter_data.export.card as card
real = card.lock_record
def lock_record(*args):
    if os.environ.get("SEND_SIGTERM"):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except SystemExit:
            pass  # something swallows the exit (a library's broad except): the stage must still not commit
    return real(*args)
card.lock_record = lock_record
sys.argv = ["stages.export", *sys.argv[1:]]
runpy.run_module("stages.export", run_name="__main__", alter_sys=True)
"""


def test_a_sigterm_whose_exit_was_swallowed_never_puts_the_output_in_place(made, tmp_path):
    base, completions, tokens, env = made
    out = tmp_path / "export"
    out.mkdir()
    (out / "summary.json").write_text("{\"old\": true}")
    args = [sys.executable, "-c", SIGTERM_DRIVER, *export_overrides(tokens, completions, out)]
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env, "SEND_SIGTERM": "1"})
    assert proc.returncode == 128 + 15, proc.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text()) == {"old": True}
    assert not list(tmp_path.glob(".export.partial-*"))
    # the same driver without the signal puts the export in place (the test sees a commit when there is one)
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["rows_in"] == 9


def test_config_keys_are_checked(made, tmp_path):
    base, completions, tokens, env = made
    proc = run(export_overrides(tokens, completions, tmp_path / "x", "export.drop=[loop,loud]"), env)
    assert proc.returncode == 1 and "export.drop" in last_line(proc) and "'loud'" in last_line(proc)
    proc = run(export_overrides(tokens, completions, tmp_path / "x", "export.trainer=medusa"), env)
    assert proc.returncode == 1 and "export.trainer" in last_line(proc)
    assert not (tmp_path / "x").exists()


def test_degenerate_kinds():
    from drafter_data.tokens.turns import Turn

    tok, _ = kimi_conv()

    def kinds(content, reasoning="Thinking it over.", thinking=True, finish="stop", calls=None):
        ids = np.array(tok.encode(f"{reasoning or ''}{content}"), dtype=np.int32)
        return degenerate.kinds(Turn("p", 0, [], None, thinking, reasoning, content, calls, finish), ids)

    assert kinds(LOOP) == ["loop"]
    assert kinds("<conclusion>\n" * 40) == ["loop"]  # a tag repeated: few words, many tokens
    assert kinds(" ".join(f"word{i}" for i in range(200))) == []
    assert kinds("Fine.", reasoning="") == ["empty_reasoning"]
    assert kinds("Fine.", reasoning=None, thinking=False) == []
    assert kinds("  ") == ["empty_answer"]
    assert kinds("", calls=[{"id": "1"}], finish="tool_calls") == []
    assert kinds("", finish="length") == []


def test_the_templates_default_system_message_is_written_out(tmp_path):
    """A template that adds a system message when a conversation has none: the line carries it, and rendering the
    line gives what the target was sent (a trainer adding its own default would not)."""
    template = tmp_path / "t.jinja"
    template.write_text("{%- if messages[0]['role'] != 'system' -%}<|im_system|>system<|im_middle|>You are Kimi."
                        "<|im_end|>{%- endif -%}{%- for m in messages -%}{%- if m['role'] == 'system' -%}<|im_system|>"
                        "{%- else -%}<|im_user|>{%- endif -%}{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>"
                        "{%- endfor -%}{%- if add_generation_prompt -%}<|im_assistant|>"
                        "assistant<|im_middle|>{%- endif -%}")
    tok = KimiTokenizer(KIMI_DIR)
    target = OmegaConf.create({"name": "t", "chat_template": str(template), "thinking_kwarg": "thinking",
                               "tool_declarations": None})
    conv = ConversationTokenizer(target, tok, {"thinking": True})
    system = SystemDefault(conv)
    assert system.text(True) == "You are Kimi."
    user = [{"role": "user", "content": "Hi"}]
    written = with_system(user, system.text(True))
    assert written[0] == {"role": "system", "content": "You are Kimi."}
    assert conv.render(written, add_generation_prompt=True) == conv.render(user, add_generation_prompt=True)
    # a conversation with its own system message keeps it; a template without a default writes none
    own = [{"role": "system", "content": "Be brief."}, *user]
    assert with_system(own, system.text(True)) == own
    _, kimi = kimi_conv()
    assert SystemDefault(kimi).text(True) is None


def test_the_completions_digest_is_of_the_rows_not_their_layout(made, tmp_path):
    """The same rows in other shards, another order, or with copies: the same digest; one answer changed, or the same
    request answered again with another answer (same request key): another digest."""
    from drafter_data.tokens.source_digest import completions_digest

    base, completions, tokens, env = made
    table = pq.read_table(next(completions.glob("*.parquet")))
    table = table.append_column("request_key", pa.array([f"key{i}" for i in range(table.num_rows)]))
    (tmp_path / "a").mkdir()
    pq.write_table(table, tmp_path / "a" / "c-0.parquet")
    digest = completions_digest([tmp_path / "a" / "c-0.parquet"])
    (tmp_path / "b").mkdir()
    pq.write_table(table.slice(5).take([3, 2, 1, 0]), tmp_path / "b" / "c-0.parquet")
    pq.write_table(table.slice(0, 6), tmp_path / "b" / "c-1.parquet")  # row 5 twice
    assert completions_digest(sorted((tmp_path / "b").glob("*.parquet"))) == digest
    content = table.column("content").to_pylist()
    content[2] = "Another answer to the same request."
    (tmp_path / "c").mkdir()
    pq.write_table(table.set_column(table.schema.get_field_index("content"), "content", pa.array(content)),
                   tmp_path / "c" / "c-0.parquet")
    assert completions_digest([tmp_path / "c" / "c-0.parquet"]) != digest
    assert json.loads((tokens / "meta.json").read_text())["completions_request_keys_sha256"] == \
        completions_digest([next(completions.glob("*.parquet"))])


def test_multi_turn_rows_per_turn_and_per_conversation(tmp_path, mlflow_uri):
    """Two conversations of two turns: per_turn gives a line per turn (turns per conversation counted), conversation
    rows (grouped by conversation, read out of the completions' order) a line per conversation, both exact."""
    rows = []
    for c in ("convA", "convB"):
        first = [{"role": "user", "content": f"{c}: name a colour."}]
        answer0 = {"role": "assistant", "content": "Blue.", "reasoning_content": "Any colour."}
        second = [*first, answer0, {"role": "user", "content": "And another one?"}]
        rows.append(completion_row(c, first + [answer0], turn=0, thinking=True, source="multi"))
        rows.append(completion_row(c, second + [{"role": "assistant", "content": "Red.",
                                                 "reasoning_content": "Another."}], turn=1, thinking=True,
                                   source="multi"))
    rows = rows[1::2] + rows[0::2]  # turn 1 rows first: the conversation rows' order is not the completions'
    completions = write_completions(tmp_path / "completions", rows)
    env = {"MLFLOW_TRACKING_URI": mlflow_uri}
    for mode in ("per_turn", "conversation"):
        tokens, out = tmp_path / f"tokens-{mode}", tmp_path / f"export-{mode}"
        proc = run([*kimi_overrides(completions, tokens), f"tokenize.rows={mode}"], env, "tokenize")
        assert proc.returncode == 0, proc.stderr[-2000:]
        proc = run(export_overrides(tokens, completions, out), env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        convs = lines(out / "conversations.jsonl")
        summary = json.loads((out / "summary.json").read_text())
        pre = lines(out / "pretokenized.jsonl")
        assert [r["input_ids"] for r in pre] == [r["input_ids"] for r in read_rows(tokens, "tokens-")]
        assert all(c["exact"] for c in convs), [c["id"] for c in convs if not c["exact"]]
        if mode == "per_turn":
            assert sorted(c["id"] for c in convs) == ["convA#turn0", "convA#turn1", "convB#turn0", "convB#turn1"]
            assert summary["turn_rows"] == {"0": 2, "1": 2}
        else:
            assert sorted(c["id"] for c in convs) == ["convA#turn1", "convB#turn1"]
            assert [m["role"] for m in convs[0]["messages"]] == ["user", "assistant", "user", "assistant"]
            assert summary["completions"]["without_a_row_of_their_own"] == 2


def test_the_cards_input_md5_is_dvcs(made, tmp_path):
    """The card names its inputs by the md5 DVC records for them (and takes generate's sampling params from
    dvc.lock only when dvc.lock records these very completions): the same md5 as `dvc add` computes."""
    from drafter_data.export.card import dvc_dir_md5

    base, completions, tokens, env = made
    copy = tmp_path / "tokens"
    copy.mkdir()
    for path in tokens.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    dvc = [str(Path(sys.executable).parent / "dvc")]
    assert subprocess.run([*dvc, "init", "--no-scm", "-q"], cwd=tmp_path).returncode == 0
    assert subprocess.run([*dvc, "add", "-q", "tokens"], cwd=tmp_path, capture_output=True).returncode == 0
    recorded = yaml.safe_load((tmp_path / "tokens.dvc").read_text())["outs"][0]["md5"]
    assert dvc_dir_md5(copy) == recorded and recorded.endswith(".dir")
    out = tmp_path / "export"
    assert run(export_overrides(tokens, completions, out), env).returncode == 0
    card = (out / "README.md").read_text()
    assert f"{dvc_dir_md5(tokens)} (not in dvc.lock)" in card and "not recorded for these completions" in card


def test_token_shards_that_are_not_the_ones_meta_json_describes_are_refused(made, tmp_path):
    """A shard copied in (every row exported twice), one missing (an export silently short) or one from another
    tokenize run (its rows described by this run's meta.json): each was exit 0; now one line, nothing in place."""
    import shutil

    base, completions, tokens, env = made
    split = tmp_path / "split"
    proc = run([*kimi_overrides(completions, split), "tokenize.max_drift_rate=0.5", "tokenize.shard_rows=3",
                "tokenize.workers=1"], env, "tokenize")
    assert proc.returncode == 0, proc.stderr[-2000:]
    shards = sorted(split.glob("tokens-*.parquet"))
    assert len(shards) >= 2
    other = tmp_path / "other"
    proc = run([*kimi_overrides(completions, other), "tokenize.max_drift_rate=0.5", "tokenize.max_length=40"], env,
               "tokenize")
    assert proc.returncode == 0, proc.stderr[-2000:]
    cases = {}
    for case in ("copied", "missing", "swapped"):
        damaged = tmp_path / case
        shutil.copytree(split, damaged)
        cases[case] = damaged
    shutil.copy(shards[0], cases["copied"] / "tokens-99999-0000.parquet")
    (cases["missing"] / shards[1].name).unlink()
    shutil.copy(next(other.glob("tokens-*.parquet")), cases["swapped"] / shards[0].name)
    ok = run(export_overrides(split, completions, tmp_path / "ok"), env)
    assert ok.returncode == 0, ok.stderr[-2000:]
    for case, damaged in cases.items():
        proc = run(export_overrides(damaged, completions, tmp_path / f"out-{case}"), env)
        assert proc.returncode == 1 and "are not the ones its meta.json describes" in last_line(proc), (case,
                                                                                                       proc.stderr)
        assert not (tmp_path / f"out-{case}").exists()

"""Rows per turn or per conversation, and mixed thinking: each row's context is exactly what its request sent, in
its own thinking mode; a conversation row is refused when the template rewrites the history each turn was sent."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from drafter_data.tokens.conversation import ConversationTokenizer
from drafter_data.tokens.tokenizers import KimiTokenizer
from tests.conftest import KIMI_DIR, REPO, read_rows
from tests.test_tokenize import completion_row, kimi_overrides, write_completions

USER1 = {"role": "user", "content": "Name a prime number."}
USER2 = {"role": "user", "content": "And another one?"}
R0, C0 = "Two is the smallest prime.", "2"
R1, C1 = "Three is prime as well.", "3"


@pytest.fixture(scope="module")
def conv():
    target = OmegaConf.load(REPO / "conf/target/kimi-k2.6.yaml")
    target.tokenizer_dir = str(KIMI_DIR)
    return ConversationTokenizer(target, KimiTokenizer(KIMI_DIR), {"thinking": True, "preserve_thinking": True})


def two_turns(keep_reasoning: bool) -> tuple[dict, dict]:
    """Turn 0 and turn 1 of one conversation as generate writes them; turn 1 was sent the target's own answer to
    turn 0, with its reasoning only when generation.history_reasoning=keep."""
    answer0 = {"role": "assistant", "content": C0, **({"reasoning_content": R0} if keep_reasoning else {})}
    turn0 = completion_row("conv", [USER1, {"role": "assistant", "content": C0, "reasoning_content": R0}], turn=0)
    turn1 = completion_row("conv", [USER1, answer0, USER2, {"role": "assistant", "content": C1,
                                                            "reasoning_content": R1}], turn=1)
    return turn0, turn1


def write_shards(directory, *shards: list[dict]):
    directory.mkdir(parents=True)
    for i, rows in enumerate(shards):
        pq.write_table(pa.Table.from_pylist(rows), directory / f"completions-{i:05d}.parquet")
    return directory


def meta_of(out) -> dict:
    return json.loads((out / "meta.json").read_text())


def test_per_turn_rows_train_each_turn_on_the_context_it_was_sent(run_stage, tmp_path, conv):
    inp = write_completions(tmp_path / "in", list(two_turns(keep_reasoning=False)))
    run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out"))
    rows = {r["turn"]: r for r in read_rows(tmp_path / "out")}
    assert sorted(rows) == [0, 1] and {r["prompt_id"] for r in rows.values()} == {"conv"}
    sent1 = [USER1, {"role": "assistant", "content": C0}, USER2]
    context = conv.prompt_ids(sent1)
    answer = conv.tokenizer.encode_chat(f"{R1}</think>{C1}<|im_end|>")
    assert rows[1]["input_ids"] == context + answer
    assert rows[1]["loss_mask"] == [0] * len(context) + [1] * len(answer)
    assert R0 not in conv.tokenizer.decode(rows[1]["input_ids"])  # turn 1 was sent no reasoning of turn 0
    meta = meta_of(tmp_path / "out")
    assert meta["rows"] == {"read": 2, "kept": 2} and meta["output_rows"] == 2 and meta["rows_per"] == "per_turn"


def test_conversation_row_has_every_turn_in_the_loss(run_stage, tmp_path, conv):
    turn0, turn1 = two_turns(keep_reasoning=True)
    inp = write_shards(tmp_path / "in", [turn1], [turn0])  # turns of one conversation in different shards
    run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out"), "tokenize.rows=conversation")
    (row,) = read_rows(tmp_path / "out")
    a0 = {"role": "assistant", "content": C0, "reasoning_content": R0}
    a1 = {"role": "assistant", "content": C1, "reasoning_content": R1}
    full = conv.tokenizer.encode_chat(conv.render([USER1, a0, USER2, a1]))
    p0, p0_a0 = conv.prompt_ids([USER1]), conv.tokenizer.encode_chat(conv.render([USER1, a0]))
    p1 = conv.prompt_ids([USER1, a0, USER2])
    assert row["input_ids"] == full and row["turn"] == 1
    expected = [0] * len(full)
    for start, end in ((len(p0), len(p0_a0)), (len(p1), len(full))):
        expected[start:end] = [1] * (end - start)
    assert row["loss_mask"] == expected and sum(expected) == len(full) - len(p1) + len(p0_a0) - len(p0)
    meta = meta_of(tmp_path / "out")
    assert meta["rows"] == {"read": 2, "kept": 2} and meta["output_rows"] == 1 and meta["rows_per"] == "conversation"
    assert not (tmp_path / "out" / ".conversations").exists()


def test_conversation_rows_are_refused_when_history_was_sent_otherwise(run_stage, tmp_path):
    inp = write_completions(tmp_path / "in", list(two_turns(keep_reasoning=False)))
    proc = run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out"), "tokenize.rows=conversation", check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "turn 0 of conv" in last and "tokenize.rows=per_turn" in last


def test_a_conversation_with_a_missing_turn_is_dropped_and_counted(run_stage, tmp_path):
    turn0, turn1 = two_turns(keep_reasoning=True)
    other = completion_row("other", [USER1, {"role": "assistant", "content": C0}], turn=0)
    inp = write_completions(tmp_path / "in", [turn1, other])
    run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out"), "tokenize.rows=conversation")
    assert [r["prompt_id"] for r in read_rows(tmp_path / "out")] == ["other"]
    assert meta_of(tmp_path / "out")["rows"] == {"read": 2, "kept": 1, "dropped.incomplete_conversation": 1}


def test_mixed_thinking_renders_each_row_in_its_own_mode(run_stage, tmp_path, conv):
    rows = [completion_row("on", [USER1, {"role": "assistant", "content": C0, "reasoning_content": R0}],
                           thinking=True),
            completion_row("off", [USER1, {"role": "assistant", "content": C0}], thinking=False)]
    inp = write_completions(tmp_path / "in", rows)
    proc = run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out"), "generation.thinking_ratio=0.5")
    out = {r["prompt_id"]: r for r in read_rows(tmp_path / "out")}
    think, end_think = conv.tokenizer.specials["<think>"], conv.tokenizer.specials["</think>"]
    for pid, thinking, prompt_end in (("on", True, [think]), ("off", False, [think, end_think])):
        start = out[pid]["loss_mask"].index(1)
        assert out[pid]["input_ids"][:start] == conv.prompt_ids([USER1], thinking=thinking)
        assert out[pid]["input_ids"][start - len(prompt_end):start] == prompt_end
    assert conv.tokenizer.decode(out["off"]["input_ids"][out["off"]["loss_mask"].index(1):]) == f"{C0}<|im_end|>"
    meta = meta_of(tmp_path / "out")
    assert meta["thinking"] == "mix" and meta["thinking_rows"] == {"on": 1, "off": 1}
    assert "thinking: on in 1 rows, off in 1" in proc.stderr
    proc = run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out2"), check=False)
    assert proc.returncode == 1 and "generation.thinking" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("rows_per", ["per_turn", "conversation"])
def test_the_turn_that_differs_is_named_in_both_row_modes(run_stage, tmp_path, conv, rows_per):
    """A conversation row holds every turn: the name is the turn whose ids differed, not the row's last turn."""
    from tests.test_tokenize_ids import sampled, split_one_token

    tok = conv.tokenizer
    drift_turn = {"c0": 0, "c1": 2, "c2": None, "c3": 1}
    prompt_turn = {"c0": None, "c1": None, "c2": 1, "c3": 2}
    rows = []
    for pid in drift_turn:
        history = []
        for t in range(3):
            sent = history + [{"role": "user", "content": f"{pid}, question {t}?"}]
            answer = {"role": "assistant", "content": f"Answer {t}.", "reasoning_content": f"Thinking {t}."}
            prompt_ids = conv.prompt_ids(sent) + ([12] if prompt_turn[pid] == t else [])
            ids = sampled(tok, answer["reasoning_content"], answer["content"])
            rows.append(completion_row(pid, sent + [answer], turn=t, thinking=True, prompt_token_ids=prompt_ids,
                                       completion_token_ids=split_one_token(tok, ids) if drift_turn[pid] == t
                                       else ids))
            history = sent + [answer]
    inp = write_shards(tmp_path / "in", rows[:5], rows[5:])
    run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out"), f"tokenize.rows={rows_per}", "tokenize.workers=2",
              "tokenize.max_drift_rate=1", "tokenize.max_prompt_mismatch_rate=1")
    meta = meta_of(tmp_path / "out")
    named = {name: [(r["prompt_id"], r["turn"]) for r in meta[name]["first_rows_differ"]]
             for name in ("drift", "prompt_ids")}
    assert named == {"drift": [("c0", 0), ("c1", 2), ("c3", 1)], "prompt_ids": [("c2", 1), ("c3", 2)]}
    assert (meta["drift"]["rows_differ"], meta["prompt_ids"]["rows_differ"]) == (3, 2)

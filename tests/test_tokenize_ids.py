"""The target's own tokens: rows with the server's ids keep them exactly (prompt and sampled), nothing is invented
inside the loss (length rows end where sampling stopped), and drift between the ids and the retokenized text is
measured and enforced."""
import json

import numpy as np
import pytest
from omegaconf import OmegaConf

from drafter_data.tokens.conversation import ConversationTokenizer
from drafter_data.tokens.tokenizers import KimiTokenizer
from drafter_data.tokens.turns import tokens_differ, with_end_of_turn
from tests.conftest import KIMI_DIR, REPO, read_rows
from tests.test_tokenize import completion_row, kimi_overrides, write_completions

QUESTION = [{"role": "user", "content": "What is the boiling point of water at sea level?"}]
REASONING = "The user asks about boiling. At sea level, pressure is one atmosphere, so water boils at 100 °C."
CONTENT = "Water boils at 100 °C (212 °F) at sea level."


@pytest.fixture(scope="module")
def kimi():
    tok = KimiTokenizer(KIMI_DIR)
    target = OmegaConf.load(REPO / "conf/target/kimi-k2.6.yaml")
    target.tokenizer_dir = str(KIMI_DIR)
    conv = ConversationTokenizer(target, tok, {"thinking": True, "preserve_thinking": True})
    return tok, conv


def sid(tok, name: str) -> int:
    return tok.specials[name]


def split_one_token(tok, ids: list[int]) -> list[int]:
    """The first multi-byte token sampled as two ids with the same bytes (a non-canonical split of one token)."""
    for pos, token in enumerate(ids):
        data = tok._enc.decode_single_token_bytes(token)
        if len(data) >= 2 and token < 163584:
            try:
                parts = [tok._enc.encode_single_token(data[:1]), tok._enc.encode_single_token(data[1:])]
            except KeyError:
                parts = [tok._enc.encode_single_token(bytes([b])) for b in data]
            return ids[:pos] + parts + ids[pos + 1:]
    raise AssertionError("no multi-byte token to split")


def sampled(tok, reasoning: str, content: str, end: bool = True) -> list[int]:
    """K2.6 with thinking on samples: reasoning, </think>, content, <|im_end|>."""
    ids = tok.encode(reasoning) + [sid(tok, "</think>")] + tok.encode(content)
    return ids + [sid(tok, "<|im_end|>")] if end else ids


def meta_of(out) -> dict:
    return json.loads((out / "meta.json").read_text())


def test_end_of_turn_is_added_only_when_the_engine_did_not_return_it():
    eot = np.array([7, 8], dtype=np.int32)
    assert with_end_of_turn(np.array([1, 2, 7, 8], np.int32), eot).tolist() == [1, 2, 7, 8]
    assert with_end_of_turn(np.array([1, 2, 7], np.int32), eot).tolist() == [1, 2, 7, 8]
    assert with_end_of_turn(np.array([1, 2, 8], np.int32), eot).tolist() == [1, 2, 8, 7, 8]
    assert with_end_of_turn(np.array([], np.int32), eot).tolist() == [7, 8]


def test_tokens_differ_counts_the_differing_stretch():
    a = np.array([1, 2, 3, 4, 5], np.int32)
    assert tokens_differ(a, a.copy()) == 0
    assert tokens_differ(np.array([1, 2, 30, 31, 4, 5], np.int32), a[[0, 1, 3, 4]]) == 2  # one token split in two
    assert tokens_differ(a, np.array([1, 2, 3, 4], np.int32)) == 1
    assert tokens_differ(a, np.array([9, 9], np.int32)) == 5


def test_sampled_ids_are_kept_with_a_non_canonical_split_and_drift_counts_them(run_stage, tmp_path, kimi):
    tok, conv = kimi
    rows, expected = [], {}
    for i in range(6):
        question = [{"role": "user", "content": f"Question {i}: {QUESTION[0]['content']}"}]
        prompt_ids = conv.prompt_ids(question)
        ids = sampled(tok, REASONING, CONTENT + f" ({i})")
        if i % 3 == 0:  # rows 0 and 3: one token sampled as two ids with the same bytes
            ids = split_one_token(tok, ids)
        if i % 2:  # the engine may or may not return the final <|im_end|>
            ids = ids[:-1]
        row = completion_row(f"r{i}", question + [{"role": "assistant", "content": CONTENT + f" ({i})",
                                                   "reasoning_content": REASONING}],
                             prompt_token_ids=prompt_ids, completion_token_ids=ids, thinking=True)
        rows.append(row)
        expected[f"r{i}"] = (prompt_ids, ids if ids[-1] == sid(tok, "<|im_end|>") else ids + [sid(tok, "<|im_end|>")])
    inp = write_completions(tmp_path / "in", rows)
    run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out"), "tokenize.max_drift_rate=0.5")
    out = {r["prompt_id"]: r for r in read_rows(tmp_path / "out")}
    for pid, (prompt_ids, answer_ids) in expected.items():
        assert out[pid]["input_ids"] == prompt_ids + answer_ids, pid
        assert out[pid]["loss_mask"] == [0] * len(prompt_ids) + [1] * len(answer_ids), pid
        assert out[pid]["input_ids"][len(prompt_ids):].count(sid(tok, "<|im_end|>")) == 1
    assert out["r0"]["input_ids"] != prompt_ids_of(conv, rows[0]) + sampled(tok, REASONING, CONTENT + " (0)")
    meta = meta_of(tmp_path / "out")
    assert meta["drift"]["rows_compared"] == 6 and meta["drift"]["rows_differ"] == 2
    assert meta["drift"]["tokens_differ"] == 4 and meta["drift"]["rate"] == pytest.approx(2 / 6)
    assert meta["drift"]["first_rows_differ"] == [{"prompt_id": "r0", "turn": 0}, {"prompt_id": "r3", "turn": 0}]
    assert meta["prompt_ids"] == {"rows_compared": 6, "rows_differ": 0, "rate": 0.0, "first_rows_differ": []}


def prompt_ids_of(conv, row) -> list[int]:
    return conv.prompt_ids([dict(m) for m in row["messages"]])


def test_drift_over_the_limit_exits_non_zero_after_writing_meta(run_stage, tmp_path, kimi):
    tok, conv = kimi
    rows = [completion_row(f"r{i}", QUESTION + [{"role": "assistant", "content": CONTENT,
                                                 "reasoning_content": REASONING}],
                           completion_token_ids=split_one_token(tok, sampled(tok, REASONING, CONTENT))
                           if i < 1 else sampled(tok, REASONING, CONTENT)) for i in range(10)]
    inp = write_completions(tmp_path / "in", rows)
    proc = run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out"), check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "drift" in last and "1 of 10" in last and "max_drift_rate=0.02" in last
    assert meta_of(tmp_path / "out")["drift"]["rows_differ"] == 1
    assert "drift: 1 of 10 rows" in proc.stderr
    run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out2"), "tokenize.max_drift_rate=0.1")


def test_the_first_drifting_rows_are_named_whatever_the_order_tasks_ran_in(run_stage, tmp_path, kimi):
    """Rows spread over tasks of 3 rows on 2 workers: meta.json names the first 10 drifting rows by (prompt_id,
    turn), the same on every run; the summary names the first 3."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok, _ = kimi
    drifting = {f"r{i:02d}" for i in range(30) if i % 3 != 1}  # 20 of 30, in every task
    rows = [completion_row(pid, QUESTION + [{"role": "assistant", "content": CONTENT, "reasoning_content": REASONING}],
                           completion_token_ids=split_one_token(tok, sampled(tok, REASONING, CONTENT))
                           if pid in drifting else sampled(tok, REASONING, CONTENT))
            for pid in reversed([f"r{i:02d}" for i in range(30)])]  # read last-first: the names are still sorted
    (tmp_path / "in").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in" / "completions-00000.parquet", row_group_size=3)
    first = [{"prompt_id": pid, "turn": 0} for pid in sorted(drifting)[:10]]
    for run in range(2):
        proc = run_stage("tokenize", *kimi_overrides(tmp_path / "in", tmp_path / f"out{run}"),
                         "tokenize.max_drift_rate=1", "tokenize.shard_rows=3", "tokenize.workers=2")
        drift = meta_of(tmp_path / f"out{run}")["drift"]
        assert drift["rows_differ"] == 20 and drift["first_rows_differ"] == first
        assert "first: r00 turn 0, r02 turn 0, r03 turn 0 (more in meta.json)" in proc.stderr


def test_prompt_ids_are_the_servers_and_a_mismatch_is_counted(run_stage, tmp_path, kimi):
    tok, conv = kimi
    prompt_ids = conv.prompt_ids(QUESTION)
    other = prompt_ids[:3] + [tok.encode(" x")[0]] + prompt_ids[3:]
    rows = [completion_row("same", QUESTION + [{"role": "assistant", "content": CONTENT}], prompt_token_ids=prompt_ids),
            completion_row("other", QUESTION + [{"role": "assistant", "content": CONTENT}], prompt_token_ids=other)]
    inp = write_completions(tmp_path / "in", rows)
    proc = run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out"), "tokenize.max_prompt_mismatch_rate=0.6")
    out = {r["prompt_id"]: r for r in read_rows(tmp_path / "out")}
    assert out["other"]["input_ids"][:len(other)] == other and out["other"]["loss_mask"].index(1) == len(other)
    assert out["same"]["input_ids"][:len(prompt_ids)] == prompt_ids
    assert meta_of(tmp_path / "out")["prompt_ids"] == {"rows_compared": 2, "rows_differ": 1, "rate": 0.5,
                                                      "first_rows_differ": [{"prompt_id": "other", "turn": 0}]}
    assert "prompt ids: 1 of 2 prompts render to other ids than the server's (rate 0.5000, limit 0.6); first: " \
           "other turn 0" in proc.stderr
    # rendering is not sampled: a target's looser drift limit (the embedded Gemma's) does not loosen this one
    proc = run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out2"), "tokenize.max_drift_rate=0.6", check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "prompt_token_ids" in last and "max_prompt_mismatch_rate=0.02" in last


@pytest.mark.parametrize("with_ids", [True, False])
def test_length_rows_mask_exactly_what_was_sampled(run_stage, tmp_path, kimi, with_ids):
    """Cut in the reasoning and cut in the answer: the loss ends at the cut, no </think> or <|im_end|> the target
    did not produce."""
    tok, conv = kimi
    reasoning_cut = REASONING[:40]
    cut_in_reasoning = tok.encode(reasoning_cut)
    cut_in_content = tok.encode(REASONING) + [sid(tok, "</think>")] + tok.encode(CONTENT[:20])
    rows = [completion_row("in_reasoning", QUESTION + [{"role": "assistant", "content": "",
                                                        "reasoning_content": reasoning_cut}],
                           finish_reason="length", length_stop_in="reasoning",
                           completion_token_ids=cut_in_reasoning if with_ids else None),
            completion_row("in_content", QUESTION + [{"role": "assistant", "content": CONTENT[:20],
                                                      "reasoning_content": REASONING}],
                           finish_reason="length", length_stop_in="content",
                           completion_token_ids=cut_in_content if with_ids else None)]
    inp = write_completions(tmp_path / "in", rows)
    run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out"))
    out = {r["prompt_id"]: r for r in read_rows(tmp_path / "out")}
    prompt = conv.prompt_ids(QUESTION)
    for pid, answer in (("in_reasoning", cut_in_reasoning), ("in_content", cut_in_content)):
        assert out[pid]["input_ids"] == prompt + answer, pid
        assert out[pid]["loss_mask"] == [0] * len(prompt) + [1] * len(answer), pid
    assert sid(tok, "</think>") not in out["in_reasoning"]["input_ids"][len(prompt):]
    assert sid(tok, "<|im_end|>") not in out["in_content"]["input_ids"][len(prompt):]
    meta = meta_of(tmp_path / "out")
    assert meta["rows"]["finish_length"] == 2 and meta["rows"]["kept"] == 2
    assert meta["drift"]["rows_compared"] == (2 if with_ids else 0) and meta["drift"]["rows_differ"] == 0


def test_a_length_rows_text_that_stops_before_its_ids_is_not_drift(run_stage, tmp_path, kimi):
    """llama-server keeps back the text of a trailing `<` (it may begin `</think>`) when the cut comes there: the
    ids hold one more token than the text. The row keeps every sampled id; it is reported, not counted as drift.
    The same extra token in a finished answer is drift."""
    tok, conv = kimi
    reasoning = "Counting the letters, one at a time:"
    extra = tok.encode(" <")
    cut = completion_row("cut", QUESTION + [{"role": "assistant", "content": "", "reasoning_content": reasoning}],
                         finish_reason="length", length_stop_in="reasoning",
                         completion_token_ids=tok.encode(reasoning) + extra)
    stop = completion_row("stop", QUESTION + [{"role": "assistant", "content": CONTENT,
                                               "reasoning_content": reasoning}],
                          completion_token_ids=sampled(tok, reasoning, CONTENT, end=False) + extra)
    inp = write_completions(tmp_path / "in", [cut, stop])
    proc = run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out"), "tokenize.max_drift_rate=0.5")
    out = {r["prompt_id"]: r for r in read_rows(tmp_path / "out")}
    prompt = conv.prompt_ids(QUESTION)
    assert out["cut"]["input_ids"] == prompt + tok.encode(reasoning) + extra
    drift = meta_of(tmp_path / "out")["drift"]
    assert (drift["rows_compared"], drift["rows_differ"], drift["rows_text_cut_short"]) == (2, 1, 1)
    assert drift["tokens_text_cut_short"] == len(extra) and "1 length rows' text stops" in proc.stderr


def test_named_rows_sort_with_a_null_prompt_id():
    from drafter_data.tokens.rows import first_examples

    assert first_examples([[("b", 0), (None, 1)], [("a", 2), ("b", 0)]]) == [(None, 1), ("a", 2), ("b", 0)]

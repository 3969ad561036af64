"""The default target (Gemma 3 270M) against the real llama-server: the context of every row is exactly the prompt
the server tokenized (BOS and the `<think>\\n` prefill included), and the loss is what the model produced after it."""
import json

from drafter_data.server.endpoints import api_root
from drafter_data.tokens.tokenizers import ServerTokenizer
from tests.conftest import read_rows, write_prompts
from tests.test_tokenize import completion_row, write_completions


def real_args(url, *extra):
    return ["server=remote", f"server.base_url={url}", "server.model=gemma-3-270m", "target=gemma3-270m", *extra]


def servers_prompt_ids(tok: ServerTokenizer, messages: list[dict]) -> list[int]:
    """The prompt as llama-server builds it for a chat request: its own template render, tokenized with BOS."""
    text = tok.apply_template(messages, enable_thinking=True)
    return tok._post("/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"]


def expected_answer(row: dict) -> str:
    """What the model produced after `<think>\\n`, in the template's form: reasoning, then (unless the cut came
    first) the close of the think block, the answer and, for a finished answer, the end of turn."""
    if row["finish_reason"] == "length" and not row["content"]:
        return row["reasoning"]
    answer = row["reasoning"] + "</think>\n" + row["content"].strip()
    return answer + ("<end_of_turn>\n" if row["finish_reason"] == "stop" else "")


def test_gemma_rows_start_the_loss_where_the_server_started_generating(run_stage, llama_server, tmp_path):
    prompts = write_prompts(tmp_path / "in", 6, words=4)
    run_stage("generate", *real_args(llama_server, f"generate.input={tmp_path / 'in'}",
                                     f"generate.output={tmp_path / 'c'}", "generation.max_tokens=24",
                                     "generation.concurrency=3"))
    completions = {r["prompt_id"]: r for r in read_rows(tmp_path / "c", "completions-")}
    run_stage("tokenize", *real_args(llama_server, f"tokenize.input={tmp_path / 'c'}",
                                     f"tokenize.output={tmp_path / 't'}", "tokenize.max_drift_rate=1"))
    tok = ServerTokenizer(api_root(llama_server))
    tokens = {r["prompt_id"]: r for r in read_rows(tmp_path / "t")}
    meta = json.loads((tmp_path / "t" / "meta.json").read_text())
    rows = meta["rows"]
    assert rows["read"] == len(prompts) == rows["kept"] + sum(v for k, v in rows.items() if k.startswith("dropped."))
    assert set(tokens) <= set(completions) and len(tokens) == rows["kept"] >= len(prompts) - 1
    for pid, t in tokens.items():
        row = completions[pid]
        start = t["loss_mask"].index(1)
        assert set(t["loss_mask"][start:]) == {1}
        context = servers_prompt_ids(tok, [dict(m) for m in row["messages"]])
        assert t["input_ids"][:start] == context and start == row["prompt_tokens"]
        assert t["input_ids"][0] == tok.bos_id and tok.decode(context).endswith("<start_of_turn>model\n<think>\n")
        answer = tok.decode(t["input_ids"][start:])
        if row["finish_reason"] == "length":
            # the loss is exactly what was sampled; at a cut the server may keep back the text of its last tokens
            # (a "<" that might begin "</think>"), so the sampled ids can run past the row's text
            assert t["input_ids"][start:] == row["completion_token_ids"] and answer.startswith(expected_answer(row))
        else:
            assert answer == expected_answer(row), pid


def test_gemma_empty_reasoning_is_dropped_not_reshaped(run_stage, llama_server, tmp_path):
    """The prompt ended `<think>\\n`, but the template writes no think block for an answer without reasoning: the
    render is not what the server was sent, so the row is dropped as prefix_mismatch, never trained with the
    `<think>\\n` moved into the loss or removed from the context."""
    qa = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]
    rows = [completion_row("empty", qa, reasoning=None, thinking=True),
            completion_row("thought", qa, reasoning="A greeting.", thinking=True)]
    inp = write_completions(tmp_path / "in", rows)
    run_stage("tokenize", *real_args(llama_server, f"tokenize.input={inp}", f"tokenize.output={tmp_path / 't'}"))
    assert [r["prompt_id"] for r in read_rows(tmp_path / "t")] == ["thought"]
    meta = json.loads((tmp_path / "t" / "meta.json").read_text())
    assert meta["rows"] == {"read": 2, "kept": 1, "dropped.prefix_mismatch": 1}

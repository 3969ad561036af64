"""Tool declarations and tool calls through the stage: every K2.6 tools golden exactly (ids and loss masks), tools
in the prompt length prepare counts, and tool calls returned inline in content (a server without a tool parser)."""
import json
from collections import defaultdict

import orjson
from omegaconf import OmegaConf

from drafter_data.tokens.conversation import prompt_token_counter
from tests.conftest import KIMI_DIR, REPO, read_rows
from tests.test_tokenize import completion_row, goldens, kimi_overrides, write_completions


def tool_row(case: dict, **extra) -> dict:
    final = case["messages"][-1]
    return completion_row(case["id"], case["messages"], tools=orjson.dumps(case["tools"]).decode(),
                          finish_reason="tool_calls" if final.get("tool_calls") else "stop",
                          thinking=case["thinking"], **extra)


def kwargs_override(case: dict) -> str:
    return f"{{preserve_thinking:{str(case['preserve_thinking']).lower()}}}"


def test_every_tools_golden_through_the_stage(run_stage, tmp_path):
    cases = goldens("tools_golden.jsonl")
    assert len(cases) == 10
    groups = defaultdict(list)
    for case in cases:
        groups[(case["thinking"], case["preserve_thinking"])].append(case)
    checked = dropped = 0
    for i, ((thinking, _), group) in enumerate(sorted(groups.items())):
        inp = write_completions(tmp_path / f"in{i}", [tool_row(c) for c in group])
        run_stage("tokenize", *kimi_overrides(inp, tmp_path / f"out{i}", thinking, kwargs_override(group[0])),
                  "tokenize.max_drop_share=1.0")
        rows = {r["prompt_id"]: r for r in read_rows(tmp_path / f"out{i}")}
        meta = json.loads((tmp_path / f"out{i}" / "meta.json").read_text())
        for case in group:
            if not case["prompt"]["is_token_prefix_of_full"]:
                # the final render moved an earlier tool-call turn (and its reasoning) into history: not what the
                # server was sent, so no row (preserve_thinking=true, the K2.6 default, keeps it)
                assert case["id"] not in rows and meta["rows"]["dropped.prefix_mismatch"] == 1
                dropped += 1
                continue
            start, end = len(case["prompt"]["input_ids"]), case["assistant_token_span"][1]
            assert rows[case["id"]]["input_ids"] == case["ids"], case["id"]
            assert rows[case["id"]]["loss_mask"] == [0] * start + [1] * (end - start), case["id"]
            checked += 1
    assert (checked, dropped) == (9, 1)


def test_tool_declarations_count_in_the_prompt_length():
    target = OmegaConf.load(REPO / "conf/target/kimi-k2.6.yaml")
    target.tokenizer_dir = str(KIMI_DIR)
    for case in goldens("tools_golden.jsonl"):
        count = prompt_token_counter(target, {"thinking": case["thinking"],
                                              "preserve_thinking": case["preserve_thinking"]})
        assert count(case["prompt"]["messages"], case["tools"]) == len(case["prompt"]["input_ids"]), case["id"]


def test_tool_calls_inline_in_content_give_the_same_tokens(run_stage, tmp_path):
    """A server without a tool parser returns the call section as text in content: rendered as given, its special
    spellings become the same ids, so the row equals the golden."""
    case = next(c for c in goldens("tools_golden.jsonl") if c["id"].startswith("tools_01"))
    final = case["messages"][-1]
    section = "<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>{c['id']}<|tool_call_argument_begin|>{c['function']['arguments']}<|tool_call_end|>"
        for c in final["tool_calls"]) + "<|tool_calls_section_end|>"
    inline = {**final, "content": final["content"] + section}
    del inline["tool_calls"]
    row = tool_row({**case, "messages": case["messages"][:-1] + [inline]})
    assert row["tool_calls"] is None and row["finish_reason"] == "stop"
    inp = write_completions(tmp_path / "in", [row])
    run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out", case["thinking"], kwargs_override(case)))
    (out,) = read_rows(tmp_path / "out")
    start = len(case["prompt"]["input_ids"])
    assert out["input_ids"] == case["ids"] and out["loss_mask"] == [0] * start + [1] * (len(case["ids"]) - start)

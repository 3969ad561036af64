"""prepare.turns (first | last | all), tool calls and tool declarations: what the prompts hold for generate."""
import json
from pathlib import Path


from tests.conftest import KIMI_DIR, PROMPT_FIXTURES, read_rows, require_shared

CONVERSATION = {"conversations": [
    {"from": "system", "value": "Be brief."},
    {"from": "human", "value": "A"}, {"from": "gpt", "value": "answer A"},
    {"from": "human", "value": "B"}, {"from": "human", "value": "C"}, {"from": "gpt", "value": "answer C"},
    {"from": "human", "value": "D"}, {"from": "gpt", "value": "answer D"}]}
SINGLE = {"conversations": [{"from": "human", "value": "only one question"}, {"from": "gpt", "value": "x"}]}
WEATHER_TOOL = {"name": "get_weather", "description": "Current weather of a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
GLAIVE = {"conversations": [
    {"from": "human", "value": "Weather in Oslo and Rome?"},
    {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})},
    {"from": "observation", "value": '{"temp": 3}'},
    {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Rome"}})},
    {"from": "observation", "value": '{"temp": 19}'},
    {"from": "gpt", "value": "Oslo 3, Rome 19."},
    {"from": "human", "value": "And Paris?"}], "tools": json.dumps([WEATHER_TOOL])}
OPENAI = {"messages": [
    {"role": "user", "content": "Weather in Lima?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Lima\"}"}}]},
    {"role": "tool", "tool_call_id": "call_7", "content": "{\"temp\": 22}"},
    {"role": "assistant", "content": "22 degrees."},
    {"role": "user", "content": "Thanks! And tomorrow?"}],
    "tools": [{"type": "function", "function": WEATHER_TOOL}]}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def prepare(run_stage, out: Path, src: Path, *extra: str):
    run_stage("prepare", f"prepare.output={out}", f"prepare.sources=[{{name:s,path:'{src}',format:auto}}]", *extra)
    stats = json.loads((out / "stats.json").read_text())["s"]
    assert stats["read"] == stats["kept"] + sum(stats["dropped"].values())
    rows = read_rows(out)
    for r in rows:
        extras = json.loads(r["message_extras"]) if r["message_extras"] else None
        assert extras is None or (len(extras) == len(r["messages"]) and any(extras))
        assert r["messages"][-1]["role"] == "user"
    return rows, stats


def contents(row) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in row["messages"]]


def test_turns_all_keeps_every_user_turn_and_drops_the_answers(run_stage, tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [CONVERSATION, SINGLE])
    rows, _ = prepare(run_stage, tmp_path / "all", src, "prepare.turns=all")
    conv, single = rows
    # B and C were adjacent in the source: one turn; A and D are separated from them by dropped answers
    assert contents(conv) == [("system", "Be brief."), ("user", "A"), ("user", "B\n\nC"), ("user", "D")]
    assert conv["turns"] == 3 and single["turns"] == 1
    first, _ = prepare(run_stage, tmp_path / "first", src, "prepare.turns=first")
    last, _ = prepare(run_stage, tmp_path / "last", src, "prepare.turns=last")
    assert [r["turns"] for r in first + last] == [1, 1, 1, 1]
    assert contents(first[0]) == [("system", "Be brief."), ("user", "A")]
    assert contents(last[0])[-3:] == [("user", "B\n\nC"), ("assistant", "answer C"), ("user", "D")]
    # the id is the content: the same single-turn prompt has one id in every mode, different prompts differ
    assert single["prompt_id"] == first[1]["prompt_id"] == last[1]["prompt_id"]
    assert len({conv["prompt_id"], first[0]["prompt_id"], last[0]["prompt_id"]}) == 3


def test_turns_all_on_prompt_only_records(run_stage, tmp_path):
    mt = require_shared(PROMPT_FIXTURES / "mt_bench_question.jsonl")
    rows, stats = prepare(run_stage, tmp_path / "out", mt, "prepare.turns=all")
    questions = [json.loads(line) for line in mt.read_text().splitlines()]
    assert stats["kept"] == 80 and all(r["turns"] == 2 for r in rows)
    assert [m["content"] for m in rows[0]["messages"]] == questions[0]["turns"]


def test_glaive_tool_calls_become_openai_tool_calls_with_matching_results(run_stage, tmp_path):
    rows, _ = prepare(run_stage, tmp_path / "out", write_jsonl(tmp_path / "g.jsonl", [GLAIVE]), "prepare.turns=last")
    (row,) = rows
    assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant", "tool", "assistant",
                                                    "user"]
    assert row["messages"][1]["content"] == "" and row["messages"][2]["content"] == '{"temp": 3}'
    extras = json.loads(row["message_extras"])
    assert extras[0] is None and extras[5] is None and extras[6] is None
    assert extras[1] == {"tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                                         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    assert extras[2] == {"tool_call_id": "functions.get_weather:0", "name": "get_weather"}
    assert extras[3]["tool_calls"][0]["id"] == "functions.get_weather:1"
    assert extras[4] == {"tool_call_id": "functions.get_weather:1", "name": "get_weather"}
    assert json.loads(row["tools"]) == [{"type": "function", "function": WEATHER_TOOL}]


def test_openai_tool_calls_and_wrapped_tools_are_kept_as_given(run_stage, tmp_path):
    rows, _ = prepare(run_stage, tmp_path / "out", write_jsonl(tmp_path / "o.jsonl", [OPENAI]), "prepare.turns=last")
    (row,) = rows
    extras = json.loads(row["message_extras"])
    assert extras[1] == {"tool_calls": OPENAI["messages"][1]["tool_calls"]}
    assert extras[2] == {"tool_call_id": "call_7", "name": "get_weather"}
    assert row["messages"][1]["content"] == ""
    assert json.loads(row["tools"]) == OPENAI["tools"]
    first, _ = prepare(run_stage, tmp_path / "first", tmp_path / "o.jsonl")
    assert first[0]["message_extras"] is None and first[0]["turns"] == 1 and first[0]["tools"] == row["tools"]


def test_malformed_tool_declarations_and_calls_are_rejected_with_a_reason(run_stage, tmp_path):
    bad = [
        {"prompt": "q1", "tools": [{"description": "no name"}]},
        {"prompt": "q2", "tools": [{"type": "retrieval", "function": {"name": "x"}}]},
        {"prompt": "q3", "tools": {"name": "not a list"}},
        {"prompt": "q4", "tools": "[{\"name\": \"f\", "},
        {"prompt": "q5", "tools": [{"name": "f", "parameters": "not a schema"}]},
        {"conversations": [{"from": "human", "value": "q6"}, {"from": "function_call", "value": "not json"},
                           {"from": "human", "value": "again"}]},
        {"prompt": "fine", "tools": "[]"},
    ]
    src = write_jsonl(tmp_path / "b.jsonl", bad)
    run_stage("prepare", f"prepare.output={tmp_path / 'out'}", f"prepare.sources=[{{name:s,path:'{src}',format:auto}}]",
              "prepare.turns=last")
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in rejects] == [(1, "invalid_tools"), (2, "invalid_tools"),
                                                          (3, "invalid_tools"), (4, "invalid_tools"),
                                                          (5, "invalid_tools"), (6, "invalid_tool_call")]
    assert all(r["detail"] for r in rejects)
    (row,) = read_rows(tmp_path / "out")
    assert row["tools"] is None  # an empty declaration is no declaration


def test_max_prompt_tokens_counts_the_tools_as_the_target_renders_them(run_stage, tmp_path):
    """K2.6's tools golden: the prompt with its tools has a known length in tokens; a bare declaration is wrapped
    first, so it is the same prompt (a duplicate) and counts the same."""
    golden = next(json.loads(line) for line in require_shared(KIMI_DIR / "tools_golden.jsonl").read_text().splitlines()
                  if json.loads(line)["id"] == "tools_01_simple_params")
    n = len(golden["prompt"]["input_ids"])
    wrapped = {"messages": golden["prompt"]["messages"], "tools": golden["tools"]}
    no_tools = {"messages": golden["prompt"]["messages"]}
    bare = {"messages": golden["prompt"]["messages"], "tools": json.dumps([t["function"] for t in golden["tools"]])}
    src, src_bare = write_jsonl(tmp_path / "t.jsonl", [wrapped, no_tools]), write_jsonl(tmp_path / "b.jsonl", [bare])
    for limit, kept in ((n, 2), (n - 1, 1)):
        out = tmp_path / f"out{limit}"
        run_stage("prepare", f"prepare.output={out}", "target=kimi-k2.6", f"target.tokenizer_dir={KIMI_DIR}",
                  f"prepare.sources=[{{name:s,path:'{src}',format:auto}},{{name:bare,path:'{src_bare}',format:auto}}]",
                  f"prepare.max_prompt_tokens={limit}")
        stats = json.loads((out / "stats.json").read_text())
        assert stats["s"]["kept"] == kept and stats["s"]["dropped"].get("too_many_tokens", 0) == 2 - kept
        assert stats["bare"]["dropped"] == ({"duplicate": 1} if kept == 2 else {"too_many_tokens": 1})

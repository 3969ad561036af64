"""generate regenerates whole conversations turn by turn with the target's own answers, exactly once per turn through
kills; tool calls, length cuts and failed turns end a conversation; thinking can be mixed per prompt (issue 12)."""
import json
import os
import signal
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq

from drafter_data.contract import PROMPTS
from tests.conftest import read_rows
from tests.fake_openai_server import expected
from tests.test_generate import gen_args
from tests.test_generate_reliability import start, wait_until

SYSTEM = {"role": "system", "content": "Answer briefly."}
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "The time in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def write_conversations(directory, n, turns=3, tools=None, start=0):
    rows = []
    for i in range(start, start + n):
        users = [{"role": "user", "content": f"conversation {i} question {k}"} for k in range(turns)]
        rows.append({"prompt_id": f"{i:032x}", "source": "test", "messages": [SYSTEM, *users],
                     "tools": json.dumps(tools) if tools else None, "turns": turns})
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=PROMPTS), directory / f"prompts-{start:05d}.parquet")
    return rows


def logged_requests(server) -> list[dict]:
    return [entry["body"] for entry in server.requests()]


def prompt_requests(server) -> list[dict]:
    """Chat requests for our conversations (preflight probes left out)."""
    return [b for b in logged_requests(server) if any("conversation " in str(m.get("content")) for m in b["messages"])]


def expected_turns(conv: dict, config=None, keep_reasoning=False) -> list[list[dict]]:
    """The messages of each turn's request, built from what the fake server answers to the previous one."""
    sent, out = [SYSTEM], []
    for user in conv["messages"][1:]:
        sent = sent + [user]
        out.append(sent)
        reasoning, content = expected(sent, config)
        reply = {"role": "assistant", "content": content}
        if keep_reasoning:
            reply["reasoning_content"] = reasoning
        sent = sent + [reply]
    return out


def test_every_turn_is_sent_with_the_targets_own_earlier_answers(run_stage, fake_server, tmp_path):
    server = fake_server()
    convs = write_conversations(tmp_path / "in", 6, turns=3)
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out"))
    rows = read_rows(tmp_path / "out", "completions-")
    assert Counter((r["prompt_id"], r["turn"]) for r in rows) == Counter((c["prompt_id"], k) for c in convs
                                                                         for k in range(3))
    sent = [b["messages"] for b in prompt_requests(server)]
    for conv in convs:
        for k, messages in enumerate(expected_turns(conv)):
            assert sent.count(messages) == 1  # the target's own answers, verbatim; sent once
            row = next(r for r in rows if r["prompt_id"] == conv["prompt_id"] and r["turn"] == k)
            assert row["messages"] == messages  # the row holds exactly what was sent
            assert row["content"] == expected(messages)[1] and row["turns"] == 3
    assert "18 completions this run" in proc.stderr


def test_history_keeps_reasoning_only_when_asked(run_stage, fake_server, tmp_path):
    server = fake_server()
    (conv,) = write_conversations(tmp_path / "in", 1, turns=2)
    run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out",
                                    "generation.history_reasoning=keep"))
    turn1 = expected_turns(conv, keep_reasoning=True)[1]
    assert [b["messages"] for b in prompt_requests(server)][-1] == turn1
    row = next(r for r in read_rows(tmp_path / "out", "completions-") if r["turn"] == 1)
    assert json.loads(row["message_extras"])[2] == {"reasoning_content": turn1[2]["reasoning_content"]}


def test_kill_9_midway_then_resume_sends_no_finished_turn_again(run_stage, fake_server, tmp_path, mlflow_uri):
    server = fake_server({"token_delay_s": 0.01})
    convs = write_conversations(tmp_path / "in", 40, turns=3)
    args = gen_args(server.url, tmp_path / "in", tmp_path / "out", "generate.shard_rows=4",
                    "generation.concurrency=6")
    proc = start(args, mlflow_uri)
    wait_until(lambda: len(list((tmp_path / "out").glob("completions-*.parquet"))) >= 6, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = read_rows(tmp_path / "out", "completions-")
    assert 0 < len(before) < 120 and any(r["turn"] > 0 for r in before)
    run_stage("generate", *args)
    rows = read_rows(tmp_path / "out", "completions-")
    assert Counter((r["prompt_id"], r["turn"]) for r in rows) == Counter((c["prompt_id"], k) for c in convs
                                                                         for k in range(3))
    sent = Counter(json.dumps(b["messages"]) for b in prompt_requests(server))
    for r in before:  # a turn finished before the kill was never sent again
        assert sent[json.dumps(r["messages"])] == 1
    for conv in convs:  # every turn was built on the answers actually stored for the turns before it
        mine = sorted((r for r in rows if r["prompt_id"] == conv["prompt_id"]), key=lambda r: r["turn"])
        assert [r["messages"] for r in mine] == expected_turns(conv)


def test_a_tool_call_a_length_cut_or_a_failed_turn_ends_the_conversation(run_stage, fake_server, tmp_path):
    server = fake_server({"tool_calls": True, "context_limit_words": 40})
    write_conversations(tmp_path / "in", 2, turns=3, tools=TOOLS)
    long = write_conversations(tmp_path / "in", 2, turns=3, start=10)
    for conv in long:  # a long first question: turn 1's context passes the server's limit
        conv["messages"][1]["content"] += " padding" * 25
    pq.write_table(pa.Table.from_pylist(long, schema=PROMPTS), tmp_path / "in" / "prompts-00010.parquet")
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out"))
    rows = read_rows(tmp_path / "out", "completions-")
    tool_rows = [r for r in rows if r["tools"]]
    assert len(tool_rows) == 2 and {r["turn"] for r in tool_rows} == {0}
    for r in tool_rows:
        assert r["finish_reason"] == "tool_calls" and json.loads(r["tool_calls"])[0]["function"]["name"] == "get_time"
    assert sorted(r["turn"] for r in rows if not r["tools"]) == [0, 0]  # turn 1 failed for good: no turn 2
    errors = [json.loads(line) for line in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()]
    assert [e["turn"] for e in errors] == [1, 1]
    summary = json.loads((tmp_path / "out" / "run.json").read_text())
    assert summary["stopped_at_tool_call"] == 2 and summary["stopped_by_error"] == 2
    run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "cut", "generation.max_tokens=4"))
    assert {r["turn"] for r in read_rows(tmp_path / "cut", "completions-")} == {0}
    assert json.loads((tmp_path / "cut" / "run.json").read_text())["stopped_at_length"] == 4
    assert "failed for good" in proc.stderr


def test_thinking_ratio_mixes_modes_by_prompt_the_same_way_every_run(run_stage, fake_server, tmp_path):
    server = fake_server()
    convs = write_conversations(tmp_path / "in", 100, turns=1)
    for out in ("a", "b"):
        run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / out, "generation.thinking_ratio=0.3"))
    a = {r["prompt_id"]: r["thinking"] for r in read_rows(tmp_path / "a", "completions-")}
    b = {r["prompt_id"]: r["thinking"] for r in read_rows(tmp_path / "b", "completions-")}
    assert a == b and len(a) == 100 and 20 <= sum(a.values()) <= 40
    for row in read_rows(tmp_path / "a", "completions-"):
        assert (row["reasoning"] is not None) == row["thinking"]
    by_prompt = {c["prompt_id"]: c["messages"] for c in convs}
    asked = {json.dumps(b["messages"]): b["chat_template_kwargs"]["thinking"] for b in prompt_requests(server)}
    for pid, thinking in a.items():
        assert asked[json.dumps(by_prompt[pid])] is thinking  # each request's switch matches its row


def test_a_resume_never_continues_after_a_tool_call_ended_with_stop(run_stage, fake_server, tmp_path):
    """Some servers end a tool call with finish_reason "stop": the live run ends the conversation there, and so must
    a resume (the plan reads tool_calls too)."""
    server = fake_server({"tool_calls": True})
    write_conversations(tmp_path / "in", 2, turns=3, tools=TOOLS)
    args = gen_args(server.url, tmp_path / "in", tmp_path / "out")
    run_stage("generate", *args)
    rows = read_rows(tmp_path / "out", "completions-")
    assert len(rows) == 2 and all(r["tool_calls"] for r in rows)
    sent = len(prompt_requests(server))
    for path in (tmp_path / "out").glob("completions-*.parquet"):  # as stored for such a server
        table = pq.read_table(path)
        i = table.schema.get_field_index("finish_reason")
        pq.write_table(table.set_column(i, "finish_reason", pa.array(["stop"] * table.num_rows, pa.string())), path)
    proc = run_stage("generate", *args)
    assert len(prompt_requests(server)) == sent and "2 already done, 0 to generate" in proc.stderr


def test_a_resume_with_another_history_setting_regenerates_the_turns_it_changes(run_stage, fake_server, tmp_path):
    """history_reasoning changes what turn k > 0 is sent: rows made with drop are not reused under keep (each later
    turn's key is derived again from its parent under the current config), they go to .stale/, and come back when
    drop returns. Today's main said '18 already done' and kept turns sent without their history's reasoning."""
    server = fake_server()
    convs = write_conversations(tmp_path / "in", 6, turns=3)
    args = gen_args(server.url, tmp_path / "in", tmp_path / "out")
    run_stage("generate", *args)  # drop, the default
    before = len(prompt_requests(server))
    proc = run_stage("generate", *args, "generation.history_reasoning=keep")
    resent = [b["messages"] for b in prompt_requests(server)[before:]]
    assert "6 conversations to continue" in proc.stderr and "moved 12 completions" in proc.stderr
    kept = [m for conv in convs for m in expected_turns(conv, keep_reasoning=True)[1:]]
    assert sorted(map(json.dumps, resent)) == sorted(map(json.dumps, kept))  # turns 1 and 2, each once, with keep
    rows = read_rows(tmp_path / "out", "completions-")
    assert Counter((r["prompt_id"], r["turn"]) for r in rows) == Counter((c["prompt_id"], k) for c in convs
                                                                         for k in range(3))
    for r in rows:  # every stored later turn was sent with its history's reasoning
        extras = json.loads(r["message_extras"] or "[]")
        assert sum(bool(e and e.get("reasoning_content")) for e in extras) == r["turn"]
    stale = [r for p in (tmp_path / "out.stale").rglob("completions-*.parquet") for r in pq.read_table(p).to_pylist()]
    assert sum(r["turn"] > 0 for r in stale) == 12  # kept aside (a moved shard keeps its valid rows too)
    sent = len(prompt_requests(server))
    back = run_stage("generate", *args)  # drop again: its rows come back from .stale, nothing is sent
    assert len(prompt_requests(server)) == sent and "restored 12 completions" in back.stderr

"""The prepare stage on the real prompt fixtures (../shared/fixtures/prompts), bad input, determinism, sampling."""
import json
from pathlib import Path

import orjson
import pytest

from tests.conftest import PROMPT_FIXTURES, read_rows, require_shared, sources_override

ROLES = {"system", "user", "assistant", "tool"}
FIXTURES = {
    "sharegpt_v3_sample.json": 363,
    "numina_cot_sharegpt_data_1k.jsonl": 1000,
    "glaive_toolcall_en_demo.json": 300,
    "alpaca_zh_demo.json": 1000,
    "toy_chat_fine_tuning.jsonl": 10,
    "mt_bench_question.jsonl": 80,
}


def fixture(name: str) -> Path:
    return require_shared(PROMPT_FIXTURES / name)


def prepare(run_stage, out: Path, *sources, extra=()):
    run_stage("prepare", f"prepare.output={out}", sources_override(*sources), *extra)
    stats = json.loads((out / "stats.json").read_text())
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    return read_rows(out), stats, rejects


def check_contract(rows, stats):
    for name, s in stats.items():
        assert s["read"] == s["kept"] + sum(s["dropped"].values()), name
    assert sum(s["kept"] for s in stats.values()) == len(rows)
    assert len({r["prompt_id"] for r in rows}) == len(rows)
    for r in rows:
        msgs = r["messages"]
        assert msgs and msgs[-1]["role"] == "user" and msgs[-1]["content"].strip()
        assert {m["role"] for m in msgs} <= ROLES
        assert next(m["role"] for m in msgs if m["role"] != "system") == "user", "prompt starts with the assistant"


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_every_fixture_file_is_read_and_accounted_for(run_stage, tmp_path, name):
    rows, stats, _ = prepare(run_stage, tmp_path / "out", (name.split(".")[0], fixture(name), "auto"))
    (s,) = stats.values()
    assert s["read"] == FIXTURES[name]
    check_contract(rows, stats)
    assert s["kept"] > 0


def test_sharegpt_messy_cases(run_stage, tmp_path):
    rows, stats, rejects = prepare(run_stage, tmp_path / "out", ("sg", fixture("sharegpt_v3_sample.json"), "sharegpt"))
    dropped = stats["sg"]["dropped"]
    assert dropped["empty_conversation"] == 8  # `"conversations": []`
    assert dropped["no_user_turn"] == 8  # non-empty records without any human turn
    assert dropped["duplicate"] >= 20
    texts = [r["messages"][-1]["content"] for r in rows]
    for dup in ("Please continue", "continue", "hi", "hello", "Explain quantum computing in simple terms"):
        assert texts.count(dup) == 1, dup
    # the mojibake record is kept as the data it is, and the longest (27,550-char) prompt is under the default limit
    assert any("DarontÃ©" in t for t in texts)
    assert max(len(t) for t in texts) == 27550
    # a record that starts with an empty human turn ends at that empty turn: dropped as empty_prompt, listed
    assert any(r["reason"] == "empty_prompt" and "IXmHCvM_0" in r["record"] for r in rejects)
    # ShareGPT's system banners are kept as system messages
    assert any(r["messages"][0]["role"] == "system" for r in rows)
    for r in rejects:
        assert r["source"] == "sg" and r["line"] >= 1 and r["index"] >= 1 and r["reason"]


def test_long_prompts_are_dropped_under_their_own_reason(run_stage, tmp_path):
    rows, stats, rejects = prepare(run_stage, tmp_path / "out", ("sg", fixture("sharegpt_v3_sample.json"), "auto"),
                                   extra=["prepare.max_prompt_chars=8000"])
    assert stats["sg"]["dropped"]["too_long"] >= 1
    assert all(sum(len(m["content"]) for m in r["messages"]) <= 8000 for r in rows)
    assert sum(r["reason"] == "too_long" for r in rejects) == stats["sg"]["dropped"]["too_long"]


def test_tool_records_keep_their_declaration_wrapped_in_openai_form(run_stage, tmp_path):
    rows, stats, _ = prepare(run_stage, tmp_path / "out", ("glaive", fixture("glaive_toolcall_en_demo.json"), "auto"))
    with_tools = [r for r in rows if r["tools"]]
    assert with_tools and len(with_tools) < len(rows)  # 109 records declare "[]": no tools column for those
    declared = {json.dumps(json.loads(r["tools"]), sort_keys=True)
                for r in json.loads(fixture("glaive_toolcall_en_demo.json").read_text()) if r["tools"] != "[]"}
    for r in with_tools:
        tools = orjson.loads(r["tools"])
        assert tools and all(t["type"] == "function" and t["function"]["name"] for t in tools)
        # glaive ships bare function schemas: each is wrapped as it was, nothing else changed
        assert json.dumps([t["function"] for t in tools], sort_keys=True) in declared


def test_multi_turn_prefix_option(run_stage, tmp_path):
    first, _, _ = prepare(run_stage, tmp_path / "a", ("mt", fixture("mt_bench_question.jsonl"), "jsonl"))
    last, _, _ = prepare(run_stage, tmp_path / "b", ("toy", fixture("toy_chat_fine_tuning.jsonl"), "jsonl"),
                         extra=["prepare.turns=last"])
    assert all(len(r["messages"]) == 1 for r in first)
    question = json.loads(fixture("mt_bench_question.jsonl").read_text().splitlines()[0])
    assert first[0]["messages"][0]["content"] == question["turns"][0]
    longest = max(last, key=lambda r: len(r["messages"]))
    assert [m["role"] for m in longest["messages"]] == ["system"] + ["user", "assistant"] * 3 + ["user"]


def test_alpaca_joins_instruction_and_input(run_stage, tmp_path):
    rows, stats, _ = prepare(run_stage, tmp_path / "out", ("zh", fixture("alpaca_zh_demo.json"), "auto"))
    assert stats["zh"]["dropped"] == {"duplicate": 8}
    records = json.loads(fixture("alpaca_zh_demo.json").read_text())
    with_input = next(r for r in records if r["input"])
    assert any(r["messages"][0]["content"] == f"{with_input['instruction']}\n\n{with_input['input']}" for r in rows)


def test_malformed_records_are_counted_listed_and_do_not_stop_the_run(run_stage, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\n".join([
        b'{"prompt": "good one"}',
        b'{"prompt": "broken json"',
        b'{"prompt": "bad utf8 \xff\xfe here"}',
        b'{"messages": "not a list"}',
        b'{"unrelated": 1}',
        b'[1, 2, 3]',
        b'{"conversations": [{"from": "alien", "value": "who?"}]}',
        b'{"conversations": [{"from": "human"}]}',
        b'{"prompt": "lone surrogate \\ud800"}',
        b'',
        b'{"prompt": "good two"}',
    ]) + b"\n")
    listed = tmp_path / "bad_list.json"
    listed.write_bytes(b'[{"prompt": "list one"},\n {"prompt": "bad \xff utf8"},\n {"prompt": "list three"}\n]')
    rows, stats, rejects = prepare(run_stage, tmp_path / "out", ("bad", bad, "auto"), ("lst", listed, "auto"))
    check_contract(rows, stats)
    assert sorted(r["messages"][0]["content"] for r in rows) == ["good one", "good two", "list one", "list three"]
    assert stats["bad"]["read"] == 10 and stats["bad"]["kept"] == 2
    by_line = {r["line"]: r["reason"] for r in rejects if r["source"] == "bad"}
    assert by_line == {2: "invalid_json", 3: "invalid_utf8", 4: "wrong_type", 5: "missing_field", 6: "wrong_type",
                       7: "unknown_role", 8: "missing_field", 9: "invalid_unicode"}
    assert [(r["line"], r["index"], r["reason"]) for r in rejects if r["source"] == "lst"] == [(2, 2, "invalid_utf8")]
    assert all(r["path"].endswith((".jsonl", ".json")) for r in rejects)


def test_a_syntax_error_in_a_json_list_sets_aside_only_what_cannot_be_read(run_stage, tmp_path):
    """A missing comma: the element after it is set aside (listed), and reading resumes at the next element."""
    listed = tmp_path / "broken.json"
    listed.write_text('[{"prompt": "a"}, {"prompt": "b"} {"prompt": "c"}, {"prompt": "d"}]')
    rows, stats, rejects = prepare(run_stage, tmp_path / "out", ("x", listed, "auto"))
    assert [r["messages"][0]["content"] for r in rows] == ["a", "b", "d"]
    assert stats["x"] == {"read": 4, "kept": 3, "dropped": {"invalid_json": 1}}
    assert len(rejects) == 1 and rejects[0]["reason"] == "invalid_json" and rejects[0]["index"] == 3
    assert rejects[0]["record"].startswith('{"prompt": "c"}') and '"d"' not in rejects[0]["record"]


def test_missing_file_is_a_clear_error(run_stage, tmp_path):
    proc = run_stage("prepare", f"prepare.output={tmp_path / 'out'}",
                     sources_override(("gone", tmp_path / "nope.jsonl", "auto")), check=False)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert "not found" in last and "nope.jsonl" in last


def test_dedupe_across_sources_first_wins_and_ids_are_order_independent(run_stage, tmp_path):
    a, b = fixture("toy_chat_fine_tuning.jsonl"), fixture("mt_bench_question.jsonl")
    rows1, stats1, _ = prepare(run_stage, tmp_path / "1", ("a", a, "auto"), ("b", b, "auto"), ("a2", a, "auto"))
    assert stats1["a2"]["kept"] == 0 and stats1["a2"]["dropped"]["duplicate"] == stats1["a2"]["read"] - 3
    rows2, _, _ = prepare(run_stage, tmp_path / "2", ("b", b, "auto"), ("a", a, "auto"))
    assert {r["prompt_id"] for r in rows1} == {r["prompt_id"] for r in rows2}
    assert {r["source"] for r in rows1} == {"a", "b"}


def test_sampling_is_deterministic_seeded_and_stable(run_stage, tmp_path):
    src = ("numina", fixture("numina_cot_sharegpt_data_1k.jsonl"), "auto")
    extra = ("zh", fixture("alpaca_zh_demo.json"), "auto")
    s1, st1, _ = prepare(run_stage, tmp_path / "1", src, extra=["prepare.sample=100", "prepare.seed=1"])
    s2, _, _ = prepare(run_stage, tmp_path / "2", src, extra=["prepare.sample=100", "prepare.seed=1"])
    s3, _, _ = prepare(run_stage, tmp_path / "3", src, extra=["prepare.sample=100", "prepare.seed=2"])
    grown, _, _ = prepare(run_stage, tmp_path / "4", src, extra, extra=["prepare.sample=100", "prepare.seed=1"])
    ids = lambda rows: [r["prompt_id"] for r in rows]  # noqa: E731
    assert len(s1) == 100 and st1["numina"]["dropped"]["not_sampled"] == 900
    assert ids(s1) == ids(s2)
    assert set(ids(s1)) != set(ids(s3))
    # adding unrelated records only ever displaces sampled prompts, never brings in other numina prompts
    assert {i for i, r in zip(ids(grown), grown) if r["source"] == "numina"} <= set(ids(s1))


def test_per_source_quota(run_stage, tmp_path):
    rows, stats, _ = prepare(run_stage, tmp_path / "out",
                             ("numina", fixture("numina_cot_sharegpt_data_1k.jsonl"), "auto"),
                             ("mt", fixture("mt_bench_question.jsonl"), "auto"),
                             )
    assert stats["numina"]["kept"] == 1000
    override = ("prepare.sources=[{name:numina,path:'%s',format:auto,quota:10},{name:mt,path:'%s',format:auto}]"
                % (fixture("numina_cot_sharegpt_data_1k.jsonl"), fixture("mt_bench_question.jsonl")))
    run_stage("prepare", f"prepare.output={tmp_path / 'q'}", override)
    stats = json.loads((tmp_path / "q" / "stats.json").read_text())
    assert stats["numina"]["kept"] == 10 and stats["numina"]["dropped"]["over_quota"] == 990
    assert stats["mt"]["kept"] == 80


def test_output_is_identical_across_runs(run_stage, tmp_path):
    src = ("sg", fixture("sharegpt_v3_sample.json"), "auto")
    r1, _, _ = prepare(run_stage, tmp_path / "1", src)
    r2, _, _ = prepare(run_stage, tmp_path / "2", src)
    assert r1 == r2


def test_field_mapping_reads_files_with_their_own_key_names(run_stage, tmp_path):
    src = tmp_path / "custom.jsonl"
    src.write_text('{"query_text": "first"}\n{"query_text": "second", "sys": "be kind"}\n')
    run_stage("prepare", f"prepare.output={tmp_path / 'out'}",
              f"prepare.sources=[{{name:c,path:'{src}',format:jsonl,fields:{{prompt:query_text,system:sys}}}}]")
    rows = read_rows(tmp_path / "out")
    assert [r["messages"] for r in rows] == [[{"role": "user", "content": "first"}],
                                             [{"role": "system", "content": "be kind"},
                                              {"role": "user", "content": "second"}]]


def test_parallel_ranges_give_the_same_output_lines_and_counts(run_stage, tmp_path):
    """A JSONL file cut into many ranges read by 2 processes: same rows, same order, same reject lines as one."""
    src = tmp_path / "many.jsonl"
    lines = []
    for i in range(400):
        if i % 37 == 5:
            lines.append('{"prompt": "broken')
        elif i % 50 == 7:
            lines.append("")
        else:
            lines.append(json.dumps({"prompt": f"question {i % 300}"}))
    src.write_text("\n".join(lines) + "\n")
    one, s1, r1 = prepare(run_stage, tmp_path / "one", ("m", src, "jsonl"), extra=["prepare.workers=1"])
    many, s2, r2 = prepare(run_stage, tmp_path / "many", ("m", src, "jsonl"),
                           extra=["prepare.workers=2", "prepare.split_mb=0.001"])
    assert one == many and s1 == s2 and r1 == r2
    assert [r["line"] for r in r2] == [i + 1 for i in range(400) if i % 37 == 5]
    assert s2["m"]["dropped"]["duplicate"] > 0


def test_a_prompt_is_never_altered_silently_images_and_object_values_are_rejected(run_stage, tmp_path):
    """An OpenAI image_url part was dropped and the prompt kept as text; a ShareGPT value that is an object became its
    JSON text. Each is rejected under its own reason, listed, counted."""
    src = tmp_path / "mixed.jsonl"
    records = [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is in it?"},
                                                   {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
        {"conversations": [{"from": "human", "value": {"question": "an object"}}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "only text parts"}]}]},
        {"prompt": "plain"},
    ]
    src.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    rows, stats, rejects = prepare(run_stage, tmp_path / "out", ("mixed", src, "auto"))
    check_contract(rows, stats)
    assert sorted(r["messages"][0]["content"] for r in rows) == ["only text parts", "plain"]
    assert stats["mixed"]["dropped"] == {"non_text_content": 1, "object_content": 1}
    assert {r["line"]: r["reason"] for r in rejects} == {1: "non_text_content", 2: "object_content"}

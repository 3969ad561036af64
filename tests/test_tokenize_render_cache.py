"""The render cache (drafter_data/tokens/render_cache.py) gives exactly the text of the full jinja render: on the
real prompt fixtures and crafted edge cases, every row pasted from the cache equals the same row rendered in full,
and a template that reads its contents is never served from the cache."""
import hashlib
import json
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from drafter_data.tokens import render_cache
from drafter_data.tokens import rows as token_rows
from drafter_data.tokens.chat_template import chat_template_kwargs
from drafter_data.tokens.conversation import SENTINEL, ConversationTokenizer
from drafter_data.tokens.tokenizers import KimiTokenizer
from drafter_data.tokens.turns import Turn, answer_message, turn_texts
from tests.conftest import KIMI_DIR, PROMPT_FIXTURES, REPO, require_shared

ROLES = {"human": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
         "system": "system", "observation": "tool", "function_call": "assistant"}
ODD_TEXTS = ["", " ", "\n", "<|im_end|>", "<|reserved_token_163837|> x", "<think>a</think>", " lead and trail \n",
             "naïve café 日本語 🙂", "\U000f0000 7 \U000f0001", "{{ x }} {% raw %}", SENTINEL]


def kimi_target(chat_template: Path | None = None):
    target = OmegaConf.load(REPO / "conf/target/kimi-k2.6.yaml")
    target.tokenizer_dir = str(require_shared(KIMI_DIR))
    if chat_template is not None:
        target.chat_template = str(chat_template)
    return target


def conversation_tokenizer(chat_template: Path | None = None, thinking: bool = True) -> ConversationTokenizer:
    target = kimi_target(chat_template)
    kwargs = chat_template_kwargs("thinking", thinking, {"preserve_thinking": True})
    return ConversationTokenizer(target, KimiTokenizer(KIMI_DIR, frozenset([163837])), kwargs)


def fixture_conversations() -> list[tuple[list[dict], list | None]]:
    """(messages, tools) from every chat-shaped fixture: ShareGPT (with tools and tool calls), OpenAI, Alpaca."""
    convs = []
    for name in ("sharegpt_v3_sample.json", "glaive_toolcall_en_demo.json"):
        for record in json.loads(require_shared(PROMPT_FIXTURES / name).read_text()):
            messages = [{"role": ROLES[m["from"]], "content": m["value"]} for m in record["conversations"]]
            tools = json.loads(record["tools"]) if record.get("tools") else None
            convs.append(([m for m in messages if m["role"] != "tool"] if tools is None else messages,
                          [{"type": "function", "function": t} for t in tools] if tools else None))
    for line in (PROMPT_FIXTURES / "numina_cot_sharegpt_data_1k.jsonl").read_text().splitlines()[:200]:
        convs.append(([{"role": ROLES[m["from"]], "content": m["value"]} for m in json.loads(line)["conversations"]],
                      None))
    for line in (PROMPT_FIXTURES / "toy_chat_fine_tuning.jsonl").read_text().splitlines():
        convs.append((json.loads(line)["messages"], None))
    for record in json.loads((PROMPT_FIXTURES / "alpaca_zh_demo.json").read_text())[:100]:
        convs.append(([{"role": "user", "content": record["instruction"] + record["input"]},
                       {"role": "assistant", "content": record["output"]}], None))
    return convs


def fixture_turns() -> list[Turn]:
    """Every assistant answer of every fixture conversation as a turn, in several modes and finish reasons."""
    turns = []
    for n, (messages, tools) in enumerate(fixture_conversations()):
        for k, answer in enumerate(messages):
            if answer["role"] != "assistant" or k == 0:
                continue
            thinking, reasoning = n % 3 != 0, [None, "", "step one\nthen two", answer["content"][:40]][n % 4]
            turns.append(Turn(f"p{n}", k, [dict(m) for m in messages[:k]], tools, thinking, reasoning,
                              answer["content"], None, ["stop", "length", "stop"][k % 3],
                              length_stop_in=["reasoning", "content", None][n % 3] if reasoning else None))
    return turns


def crafted_turns() -> list[Turn]:
    """Odd texts in every free-text place: contents, reasoning, names, tool calls and their results."""
    turns = []
    for i, text in enumerate(ODD_TEXTS * 3):
        call = {"id": f"functions.f:{i % 2}", "type": "function", "function": {"name": "f", "arguments": text or "{}"}}
        messages = [{"role": "system", "content": text}, {"role": "user", "content": text, "name": text},
                    {"role": "assistant", "content": text, "reasoning_content": text, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": text},
                    {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url"}]}]
        tools = [{"type": "function", "function": {"name": "f", "description": text, "parameters": {}}}]
        answer_calls = [dict(call, id=text or "x")] if i % 2 else None
        turns.append(Turn(f"c{i}", 2, messages[: 2 + i % 4], tools if i % 3 else None, bool(i % 2),
                          [None, "", text][i % 3], text, answer_calls, ["stop", "length"][i % 2]))
    return turns


def slow_texts(conv: ConversationTokenizer, turn: Turn) -> tuple[str, str]:
    answer = answer_message(turn)
    return (conv.render(turn.messages, turn.tools, add_generation_prompt=True, thinking=turn.thinking),
            conv.render(turn.messages + [answer], turn.tools, thinking=turn.thinking))


@pytest.mark.parametrize("thinking", [True, False])
def test_pasted_renders_equal_full_renders(thinking):
    conv = conversation_tokenizer(thinking=thinking)
    turns = fixture_turns() + crafted_turns()
    for _ in range(3):  # a shape's first row is rendered, its second learns the shape, later ones are pasted
        for turn in turns:
            answer = answer_message(turn)
            assert conv.prompt_and_full(turn.messages, answer, turn.tools, turn.thinking) == slow_texts(conv, turn)
    assert conv._renders.enabled
    assert conv._renders.pasted > len(turns)


def test_turn_texts_match_through_the_cache():
    cached, uncached = conversation_tokenizer(), conversation_tokenizer()
    uncached._renders.enabled = False
    for turn in fixture_turns()[:400] * 2:
        try:
            expected = turn_texts(uncached, turn)
        except Exception as exc:  # noqa: BLE001 - the same refusal is expected from the cached path
            with pytest.raises(type(exc)):
                turn_texts(cached, turn)
            continue
        assert turn_texts(cached, turn) == expected
    assert cached._renders.pasted > 0


CONTENT_READING = {
    "think_split": "{% for m in messages %}{% if '</think>' in m.content %}{{ m.content.split('</think>')[-1] }}"
                   "{% else %}{{ m.content }}{% endif %}|{% endfor %}",
    "trim": "{% for m in messages %}{{ m.content | trim }}|{% endfor %}",
    "json": "{% for m in messages %}{{ m.content | tojson }}|{% endfor %}",
    "starts_with_z": "{% for m in messages %}{% if m.content.startswith('Z') %}Z!{% endif %}{{ m.content }}|"
                     "{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(CONTENT_READING))
def test_templates_that_read_contents_are_rendered_in_full(name, tmp_path, monkeypatch):
    """The checks behind the allow-list, on templates let past it."""
    template = tmp_path / "chat_template.jinja"
    template.write_text(CONTENT_READING[name] + "{% if add_generation_prompt %}<|im_assistant|>{% endif %}")
    monkeypatch.setitem(render_cache.CHECKED_TEMPLATES, hashlib.sha256(template.read_bytes()).hexdigest(), name)
    conv = conversation_tokenizer(template)
    contents = ["a </think> b", "  padded  ", "Zebra", 'quote " and \\', "Zulu", "plain"]
    for text in contents * 3:
        turn = Turn("p", 0, [{"role": "user", "content": text}], None, True, None, text, None, "stop")
        answer = answer_message(turn)
        assert conv.prompt_and_full(turn.messages, answer, None, True) == slow_texts(conv, turn)


def test_a_template_that_reads_the_clock_is_never_cached(tmp_path):
    template = tmp_path / "chat_template.jinja"
    template.write_text("{{ strftime_now('%Y') }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not conversation_tokenizer(template)._renders.enabled


def test_stage_rows_are_identical_with_and_without_the_cache():
    """Whole worker output (ids, masks, counts) on fixture turns, with the cache against full renders only."""
    turns = fixture_turns()
    outputs = []
    for enabled in (True, False):
        with tempfile.TemporaryDirectory() as tmp:
            settings = {"target": OmegaConf.to_container(kimi_target()), "thinking": True,
                        "chat_kwargs": chat_template_kwargs("thinking", True, {"preserve_thinking": True}),
                        "rows": "per_turn", "mask_token_id": 163837, "escape_mask_text": True, "max_length": 100000,
                        "overlength": "truncate", "on_length_finish": "keep", "shard_rows": 100000, "out_dir": tmp}
            token_rows.init_worker(settings)
            token_rows.worker_conversation()._renders.enabled = enabled
            writer = token_rows.ShardWriter(Path(tmp), "x", settings)
            for turn in turns:
                writer.add(token_rows.build_row([turn], writer.counts))
            writer.flush()
            outputs.append((pq.read_table(Path(tmp) / "tokens-x-0000.parquet").to_pylist(), writer.counts))
    assert outputs[0] == outputs[1]
    assert outputs[0][1]["kept"] > 500


# Reads the checks cannot see: a macro's output (GLM-4.5's /nothink suffix) and a dict lookup by name.
UNSEEN_READS = {
    "macro_output": "{% macro visible(c) %}{{ c }}{% endmacro %}{% for m in messages %}{{ visible(m.content) }}"
                    "{{ '/nothink' if not visible(m.content).endswith('/nothink') else '' }}|{% endfor %}",
    "dict_key": "{% set vip = {'alice': 'VIP '} %}{% for m in messages %}{{ vip.get(m.name, '') }}{{ m.content }}|"
                "{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(UNSEEN_READS))
def test_a_template_not_checked_by_reading_is_always_rendered_in_full(name, tmp_path):
    """Only templates on the allow-list are cached: these read their texts in ways no check sees, and a later row
    taking another branch would be pasted wrong."""
    template = tmp_path / "chat_template.jinja"
    template.write_text(UNSEEN_READS[name] + "{% if add_generation_prompt %}<|im_assistant|>{% endif %}")
    conv = conversation_tokenizer(template)
    assert not conv._renders.enabled
    for text, who in [("a", "bob"), ("b", "carl"), ("c /nothink", "alice"), ("d", "alice")]:
        turn = Turn("p", 0, [{"role": "user", "content": text, "name": who}], None, True, None, text, None, "stop")
        assert conv.prompt_and_full(turn.messages, answer_message(turn), None, True) == slow_texts(conv, turn)
    assert conv._renders.pasted == 0


def test_the_k2_template_is_the_one_checked():
    """The allow-list names the template this project ships for (a changed template is rendered in full)."""
    source = (KIMI_DIR / "chat_template.jinja").read_bytes()
    assert hashlib.sha256(source).hexdigest() in render_cache.CHECKED_TEMPLATES
    assert conversation_tokenizer()._renders.enabled

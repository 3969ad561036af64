"""The fault-injecting test server itself, over real HTTP: the thinking switch, the request log, Kimi K2.6 token ids
(vLLM, SGLang and llama-server shapes, canonical and split; engine endpoints), tool calls, in-stream faults, run-wide
faults, live config, poison prompts and the throughput knee."""
import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import httpx2
import openai
import pytest

from drafter_data.tokens.chat_template import ChatTemplate
from drafter_data.tokens.tokenizers import KimiTokenizer
from tests.conftest import KIMI_DIR, require_shared
from tests.fake_openai_server import (expected, expected_ids, expected_prompt_ids, expected_tool_call, is_split,
                                      request_key, words_for)

MODEL = "fake-model"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"arg": {"type": "string"}}}}}]
ON, OFF = {"thinking": True}, {"thinking": False}


@pytest.fixture(scope="module")
def kimi():
    """The project's K2.6 tokenizer and template, loaded here independently of the server's copy."""
    directory = require_shared(KIMI_DIR)
    tok = KimiTokenizer(directory)
    template = ChatTemplate((directory / "chat_template.jinja").read_text(), tok.special_tokens_map)
    return tok, template


def client(server, key: str = "k") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=30)


def http(server, path: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict, dict]:
    """(status, json body, headers) of a GET (body None) or POST to the server root."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=data,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)


def chat(c, messages, stream=False, **extra):
    """A chat request; fields outside OpenAI's API go in extra_body."""
    known = {k: extra.pop(k) for k in ("tools", "max_tokens", "logprobs") if k in extra}
    return c.chat.completions.create(model=MODEL, messages=messages, stream=stream, extra_body=extra, **known)


def extra(obj, name):
    return (obj.model_extra or {}).get(name)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def k2_prompt_ids(kimi, messages, tools=None, **kwargs) -> list[int]:
    tok, template = kimi
    return tok.encode_chat(template.render(messages, add_generation_prompt=True, tools=tools, **kwargs))


def special(kimi, name: str) -> int:
    return kimi[0].specials[name]


# --- the plain behaviour and the thinking switch --------------------------------------------------------------------

def test_defaults_answer_the_expected_words_without_ids(fake_server):
    server = fake_server()
    c = client(server)
    messages = user("plain question here")
    reasoning, content = expected(messages)
    r = chat(c, messages, chat_template_kwargs=ON, return_token_ids=True)
    assert (r.choices[0].message.content, extra(r.choices[0].message, "reasoning_content")) == (content, reasoning)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, 12)
    assert extra(r, "prompt_token_ids") is None and extra(r.choices[0], "token_ids") is None
    parts = {"reasoning_content": "", "content": ""}
    for chunk in chat(c, messages, stream=True, chat_template_kwargs=ON, return_token_ids=True):
        assert extra(chunk, "prompt_token_ids") is None
        for choice in chunk.choices:
            assert extra(choice, "token_ids") is None
            parts["reasoning_content"] += extra(choice.delta, "reasoning_content") or ""
            parts["content"] += choice.delta.content or ""
    assert parts == {"reasoning_content": reasoning, "content": content}


@pytest.mark.parametrize("kwargs,thinking", [
    ({"thinking": False, "preserve_thinking": True}, False),
    ({"preserve_thinking": True, "thinking": True}, True),
    ({"enable_thinking": True}, True),
    ({"enable_thinking": False, "other": 1}, False),
    ({"preserve_thinking": True}, False),
    ({}, False),
])
def test_the_thinking_switch_is_the_named_kwarg(fake_server, kwargs, thinking):
    server = fake_server()
    messages = user("switch?")
    r = chat(client(server), messages, chat_template_kwargs=kwargs)
    reasoning = extra(r.choices[0].message, "reasoning_content")
    assert reasoning == (expected(messages)[0] if thinking else None)
    assert r.choices[0].message.content == expected(messages)[1]


def test_the_request_log_keeps_every_body(fake_server):
    server = fake_server({"tool_calls": True})
    c = client(server)
    t0 = time.time()
    chat(c, user("one"), chat_template_kwargs=ON)
    chat(c, user("two"), tools=TOOLS, chat_template_kwargs={"thinking": False, "preserve_thinking": True})
    chat(c, user("three"), logprobs=True, return_token_ids=True, max_tokens=5)
    status, log, _ = http(server, "/requests")
    assert status == 200 and [e["index"] for e in log] == [0, 1, 2]
    assert [e["body"]["messages"] for e in log] == [user("one"), user("two"), user("three")]
    assert log[0]["body"]["chat_template_kwargs"] == ON and "tools" not in log[0]["body"]
    assert log[1]["body"]["tools"] == TOOLS
    assert log[1]["body"]["chat_template_kwargs"] == {"thinking": False, "preserve_thinking": True}
    assert log[2]["body"]["logprobs"] is True and log[2]["body"]["return_token_ids"] is True
    assert log[2]["body"]["max_tokens"] == 5
    assert t0 <= log[0]["received"] <= log[1]["received"] <= log[2]["received"] <= time.time()
    assert [e["index"] for e in http(server, "/requests?since_index=2")[1]] == [2]


# --- token ids ------------------------------------------------------------------------------------------------------

MULTI = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Wie geht's? 你好 🙂"},
         {"role": "assistant", "content": "Gut."}, {"role": "user", "content": "And then?"}]


@pytest.mark.parametrize("kwargs", [ON, OFF])
def test_vllm_token_ids_non_streaming_are_the_k2_sequence(fake_server, kimi, kwargs):
    tok = kimi[0]
    server = fake_server({"token_ids": "vllm"})
    r = chat(client(server), MULTI, chat_template_kwargs=kwargs, return_token_ids=True)
    reasoning, content = expected(MULTI)
    prompt_ids, ids = extra(r, "prompt_token_ids"), extra(r.choices[0], "token_ids")
    assert prompt_ids == k2_prompt_ids(kimi, MULTI, **kwargs)
    message = r.choices[0].message
    assert message.content == content and r.choices[0].finish_reason == "stop"
    if kwargs["thinking"]:
        assert extra(message, "reasoning_content") == reasoning
        assert ids == tok.encode(reasoning) + [special(kimi, "</think>")] + tok.encode(content) + \
            [special(kimi, "<|im_end|>")]
        assert tok.decode(ids) == reasoning + "</think>" + content + "<|im_end|>"
    else:
        assert extra(message, "reasoning_content") is None
        assert ids == tok.encode(content) + [special(kimi, "<|im_end|>")]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids), len(ids))
    assert ids == expected_ids(MULTI, {}, chat_template_kwargs=kwargs)
    assert prompt_ids == expected_prompt_ids(MULTI, chat_template_kwargs=kwargs)


def check_chunk_ids(kimi, chunks) -> tuple[list[int], dict]:
    """Every chunk's ids decode to its delta's text (marker tokens: no text); returns all ids and the texts."""
    tok = kimi[0]
    markers = {special(kimi, "</think>"), special(kimi, "<|im_end|>")}
    ids, texts = [], {"reasoning_content": "", "content": ""}
    for chunk in chunks[1:]:
        for choice in chunk.choices:
            chunk_ids = extra(choice, "token_ids")
            text = (extra(choice.delta, "reasoning_content") or "") + (choice.delta.content or "")
            assert tok.decode(chunk_ids) == text or (not text and set(chunk_ids) <= markers)
            ids += chunk_ids
            texts["reasoning_content"] += extra(choice.delta, "reasoning_content") or ""
            texts["content"] += choice.delta.content or ""
    return ids, texts


def test_vllm_token_ids_streaming_per_chunk(fake_server, kimi):
    server = fake_server({"token_ids": "vllm", "token_delay_s": 0.001})
    chunks = list(chat(client(server), MULTI, stream=True, chat_template_kwargs=ON, return_token_ids=True,
                       stream_options={"include_usage": True}))
    reasoning, content = expected(MULTI)
    assert extra(chunks[0], "prompt_token_ids") == k2_prompt_ids(kimi, MULTI, **ON)
    assert all(extra(c, "prompt_token_ids") is None for c in chunks[1:])
    ids, texts = check_chunk_ids(kimi, chunks)
    assert texts == {"reasoning_content": reasoning, "content": content}
    assert kimi[0].decode(ids) == reasoning + "</think>" + content + "<|im_end|>"
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert final.choices[0].finish_reason == "stop"
    assert extra(final.choices[0], "token_ids") == [special(kimi, "<|im_end|>")] and final.choices[0].delta.content \
        is None
    assert chunks[-1].usage.completion_tokens == len(ids) == len(expected_ids(MULTI, chat_template_kwargs=ON))


@pytest.mark.parametrize("where", ["reasoning", "content"])
@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_cuts_the_ids_and_the_text_follows(fake_server, kimi, where, stream):
    tok = kimi[0]
    server = fake_server({"token_ids": "vllm"})
    messages = user("cut me")
    reasoning, content = expected(messages)
    n = 5 if where == "reasoning" else len(tok.encode(reasoning)) + 4
    if stream:
        chunks = list(chat(client(server), messages, stream=True, chat_template_kwargs=ON, return_token_ids=True,
                           max_tokens=n))
        ids, texts = check_chunk_ids(kimi, chunks)
        got_reasoning, got_content = texts["reasoning_content"], texts["content"]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        r = chat(client(server), messages, chat_template_kwargs=ON, return_token_ids=True, max_tokens=n)
        ids = extra(r.choices[0], "token_ids")
        got_reasoning, got_content = extra(r.choices[0].message, "reasoning_content"), r.choices[0].message.content
        finish = [r.choices[0].finish_reason]
        assert r.usage.completion_tokens == n
    assert finish == ["length"] and len(ids) == n and special(kimi, "<|im_end|>") not in ids
    end = special(kimi, "</think>")
    assert (end in ids) == (where == "content")
    head, tail = (ids[:ids.index(end)], ids[ids.index(end) + 1:]) if end in ids else (ids, [])
    assert got_reasoning == tok.decode(head) and reasoning.startswith(got_reasoning)
    assert (got_content or "") == tok.decode(tail) and content.startswith(got_content or "")
    assert ids == expected_ids(messages, chat_template_kwargs=ON, max_tokens=n)


@pytest.mark.parametrize("stream", [False, True])
def test_llama_logprobs_carry_the_ids(fake_server, kimi, stream):
    tok = kimi[0]
    server = fake_server({"token_ids": "llama"})
    reasoning, content = expected(MULTI)
    if stream:
        entries, text = [], ""
        for chunk in chat(client(server), MULTI, stream=True, chat_template_kwargs=ON, logprobs=True):
            assert extra(chunk, "prompt_token_ids") is None
            for choice in chunk.choices:
                chunk_entries = choice.logprobs.content if choice.logprobs else []
                delta_text = (extra(choice.delta, "reasoning_content") or "") + (choice.delta.content or "")
                assert "".join(e.token for e in chunk_entries) in (delta_text, "</think>", "<|im_end|>", "")
                entries += chunk_entries
                text += delta_text
        assert text == reasoning + content
    else:
        r = chat(client(server), MULTI, chat_template_kwargs=ON, logprobs=True, return_token_ids=True)
        assert extra(r, "prompt_token_ids") is None and extra(r.choices[0], "token_ids") is None
        entries = r.choices[0].logprobs.content
    ids = [extra(e, "id") for e in entries]
    assert tok.decode(ids) == reasoning + "</think>" + content + "<|im_end|>"
    assert ids == expected_ids(MULTI, chat_template_kwargs=ON)
    for e in entries:
        assert bytes(e.bytes) == tok._enc.decode_single_token_bytes(extra(e, "id")) and e.logprob < 0
        assert e.top_logprobs == []


def test_llama_verbose_tokens_unstreamed_and_empty_when_streamed(fake_server, kimi):
    server = fake_server({"token_ids": "llama"})
    r = chat(client(server), MULTI, chat_template_kwargs=ON, return_tokens=True, verbose=True)
    verbose = extra(r, "__verbose")
    assert verbose["tokens"] == expected_ids(MULTI, chat_template_kwargs=ON) and r.choices[0].logprobs is None
    assert len(verbose["tokens"]) == r.usage.completion_tokens and verbose["tokens_evaluated"] == r.usage.prompt_tokens
    chunks = list(chat(client(server), MULTI, stream=True, chat_template_kwargs=ON, return_tokens=True, verbose=True))
    streamed = [extra(c, "__verbose") for c in chunks if extra(c, "__verbose")]
    assert [v["tokens"] for v in streamed] == [[]]  # as llama-server: a streamed __verbose has no tokens
    assert streamed and chunks[[bool(extra(c, "__verbose")) for c in chunks].index(True)].choices[0].finish_reason


def test_llama_apply_template_and_tokenize_give_the_prompt_ids(fake_server, kimi):
    server = fake_server({"token_ids": "llama"})
    status, rendered, _ = http(server, "/apply-template", {"messages": MULTI, "chat_template_kwargs": ON})
    status2, tokens, _ = http(server, "/tokenize", {"content": rendered["prompt"], "add_special": True,
                                                   "parse_special": True})
    assert status == status2 == 200 and tokens["tokens"] == k2_prompt_ids(kimi, MULTI, **ON)
    r = chat(client(server), MULTI, chat_template_kwargs=ON)
    assert r.usage.prompt_tokens == len(tokens["tokens"])


@pytest.mark.parametrize("stream", [False, True])
def test_sglext_ids_as_sglang_sends_them(fake_server, kimi, stream):
    server = fake_server({"token_ids": "sglext"})
    asked = {"return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True}
    if stream:
        chunks = list(chat(client(server), MULTI, stream=True, chat_template_kwargs=ON,
                           stream_options={"include_usage": True}, **asked))
        sglext = [extra(c, "sglext") for c in chunks if extra(c, "sglext")]
        assert len(sglext) == 1 and not any(extra(ch, "token_ids") for c in chunks for ch in c.choices)
        ext, usage = sglext[0], chunks[-1].usage
        assert chunks[-2].choices == [] and extra(chunks[-2], "sglext")  # after the finish chunk, before usage
    else:
        r = chat(client(server), MULTI, chat_template_kwargs=ON, **asked)
        ext, usage = extra(r, "sglext"), r.usage
    assert ext["input_ids"] == k2_prompt_ids(kimi, MULTI, **ON)
    assert ext["output_ids"] == [expected_ids(MULTI, chat_template_kwargs=ON)]
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ext["input_ids"]), len(ext["output_ids"][0]))
    plain = chat(client(server), MULTI, chat_template_kwargs=ON)
    assert extra(plain, "sglext") is None  # only when asked


def test_sglang_return_token_ids_unstreamed_only(fake_server, kimi):
    server = fake_server({"token_ids": "sglang"})
    r = chat(client(server), MULTI, chat_template_kwargs=ON, return_token_ids=True)
    choice = r.choices[0]
    assert extra(choice, "prompt_token_ids") == k2_prompt_ids(kimi, MULTI, **ON)
    assert extra(choice, "response_token_ids") == expected_ids(MULTI, chat_template_kwargs=ON)
    assert extra(r, "prompt_token_ids") is None and extra(choice, "token_ids") is None
    with pytest.raises(openai.BadRequestError) as err:
        list(chat(client(server), MULTI, stream=True, chat_template_kwargs=ON, return_token_ids=True))
    assert "not supported with streaming" in err.value.body["message"]


@pytest.mark.parametrize("mode,asked", [("vllm", {"return_token_ids": True}),
                                        ("sglext", {"return_output_ids_in_sglext": True}),
                                        ("llama", {"return_tokens": True, "verbose": True})])
def test_drop_end_ids_leaves_the_stop_id_out_but_usage_counts_it(fake_server, kimi, mode, asked):
    server = fake_server({"token_ids": mode, "drop_end_ids": True})
    r = chat(client(server), MULTI, chat_template_kwargs=ON, **asked)
    ids = {"vllm": lambda: extra(r.choices[0], "token_ids"), "sglext": lambda: extra(r, "sglext")["output_ids"][0],
           "llama": lambda: extra(r, "__verbose")["tokens"]}[mode]()
    assert ids == expected_ids(MULTI, chat_template_kwargs=ON)[:-1] and r.usage.completion_tokens == len(ids) + 1


@pytest.mark.parametrize("engine,path,body", [("vllm", "/version", {"version": "0.32.0"}),
                                              ("sglang", "/server_info", {"version": "0.5.23"}),
                                              ("llama", "/props", {"build_info": "fake"})])
def test_engine_endpoints_answer_only_for_their_engine(fake_server, engine, path, body):
    server = fake_server({"engine": engine})
    status, found, _ = http(server, path)
    assert status == 200 and body.items() <= found.items()
    others = {"/version", "/server_info", "/props"} - {path}
    assert http(fake_server(), path)[0] == 404 and all(http(server, p)[0] == 404 for p in others)


def test_split_prompts_have_non_canonical_ids_with_the_same_text(fake_server, kimi):
    tok = kimi[0]
    config = {"token_ids": "vllm", "split_token_every": 3}
    server = fake_server(config)
    c = client(server)
    prompts = [user(f"question number {i}") for i in range(12)]
    predicted = {request_key(m) for m in prompts if is_split(m, config)}
    assert 0 < len(predicted) < len(prompts)
    for messages in prompts:
        r = chat(c, messages, chat_template_kwargs=OFF, return_token_ids=True)
        ids, content = extra(r.choices[0], "token_ids"), expected(messages)[1]
        canonical = tok.encode(content) + [special(kimi, "<|im_end|>")]
        assert r.choices[0].message.content == content and tok.decode(ids) == tok.decode(canonical)
        if request_key(messages) in predicted:
            assert ids != canonical and len(ids) > len(canonical)
            assert tok.encode(tok.decode(ids[:-1])) == canonical[:-1]
        else:
            assert ids == canonical
        assert ids == expected_ids(messages, config, chat_template_kwargs=OFF)
        assert r.usage.completion_tokens == len(ids)
    status, split, _ = http(server, "/split")
    assert split["count"] == len(predicted) and set(split["prompts"]) == predicted
    assert set(server.stats()["split_prompts"]) == predicted


# --- tool calls -----------------------------------------------------------------------------------------------------

def test_tool_call_non_streaming_in_k2_format(fake_server, kimi):
    tok, template = kimi
    server = fake_server({"token_ids": "vllm", "tool_calls": True})
    messages = user("weather in Paris?")
    r = chat(client(server), messages, tools=TOOLS, chat_template_kwargs=ON, return_token_ids=True)
    call = expected_tool_call(messages, TOOLS)
    assert call["id"] == "functions.get_weather:0" and json.loads(call["function"]["arguments"]) == \
        {"arg": words_for(messages, "a", 1)[0]}
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (got,) = choice.message.tool_calls
    assert (got.id, got.type, got.function.name, got.function.arguments) == \
        (call["id"], "function", "get_weather", call["function"]["arguments"])
    reasoning = expected(messages)[0]
    assert extra(choice.message, "reasoning_content") == reasoning
    ids = extra(choice, "token_ids")
    section = template.render([{"role": "assistant", "content": "", "tool_calls": [call]}])
    section = section[section.index("<|tool_calls_section_begin|>"):section.index("<|im_end|>")]
    assert tok.decode(ids) == reasoning + "</think>" + section + "<|im_end|>"
    assert section.startswith("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                              "<|tool_call_argument_begin|>{")
    assert extra(r, "prompt_token_ids") == k2_prompt_ids(kimi, messages, TOOLS, **ON)


@pytest.mark.parametrize("token_ids", ["none", "vllm"])
def test_tool_call_stream_accumulates_to_the_call(fake_server, token_ids):
    server = fake_server({"token_ids": token_ids, "tool_calls": True, "token_delay_s": 0.001})
    messages = user("weather in Rome?")
    call = expected_tool_call(messages, TOOLS)
    calls, finish, fragments, reasoning = {}, None, 0, ""
    for chunk in chat(client(server), messages, stream=True, tools=TOOLS, chat_template_kwargs=ON):
        for choice in chunk.choices:
            assert not choice.delta.content
            reasoning += extra(choice.delta, "reasoning_content") or ""
            for d in choice.delta.tool_calls or []:
                acc = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                acc["id"] = d.id or acc["id"]
                acc["name"] = (d.function.name if d.function else None) or acc["name"]
                acc["arguments"] += (d.function.arguments or "") if d.function else ""
                fragments += bool(d.function and d.function.arguments)
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and reasoning == expected(messages)[0]
    assert calls == {0: {"id": call["id"], "name": "get_weather", "arguments": call["function"]["arguments"]}}
    assert fragments > 1


def test_after_the_tool_result_the_answer_is_text(fake_server):
    server = fake_server({"tool_calls": True})
    c = client(server)
    first = user("weather in Oslo?")
    call = expected_tool_call(first, TOOLS)
    later = first + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    r = chat(c, later, tools=TOOLS, chat_template_kwargs=ON)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == expected(later)[1]
    again = later + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and Bergen?"}]
    assert chat(c, again, tools=TOOLS).choices[0].message.tool_calls[0].id == "functions.get_weather:1"
    assert not chat(c, first, chat_template_kwargs=ON).choices[0].message.tool_calls  # no tools, no call


# --- in-stream faults ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_abort_ends_with_finish_reason_abort_after_a_few_tokens(fake_server, stream):
    server = fake_server({"fault_rate": 1.0, "faults": ["abort"]})
    messages = user("abort me")
    few = " ".join(words_for(messages, "r", 3))
    if stream:
        chunks = list(chat(client(server), messages, stream=True, chat_template_kwargs=ON,
                           stream_options={"include_usage": True}))
        reasoning = "".join(extra(c.choices[0].delta, "reasoning_content") or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
    else:
        r = chat(client(server), messages, chat_template_kwargs=ON)
        reasoning, finish, usage = extra(r.choices[0].message, "reasoning_content"), [r.choices[0].finish_reason], \
            r.usage
    assert finish == ["abort"] and reasoning == few and usage.completion_tokens == 3
    stats = server.stats()
    assert stats["faults"] == {"abort": 1} and stats["completed"] == {}


def test_stream_error_event_after_a_few_tokens(fake_server):
    server = fake_server({"fault_rate": 1.0, "faults": ["stream_error"], "token_delay_s": 0.001})
    c = client(server)
    got = []
    with pytest.raises(openai.APIError) as err:
        for chunk in chat(c, user("break"), stream=True, chat_template_kwargs=ON):
            got.append(chunk)
    assert err.value.body == {"message": "Internal server error", "type": "InternalServerError", "param": None,
                              "code": 500}
    assert len(got) == 1 + 3 and all(not ch.choices[0].finish_reason for ch in got)
    with httpx2.stream("POST", f"{server.url}/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": user("raw"), "stream": True}) as resp:
        lines = [line for line in resp.iter_lines() if line]
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == 500 and lines[-1] == "data: [DONE]"
    with pytest.raises(openai.InternalServerError):
        chat(c, user("break"))
    assert server.stats()["completed"] == {}


def test_context_error_inside_a_stream(fake_server):
    server = fake_server({"context_limit_words": 5, "context_error_in_stream": True})
    c = client(server)
    long = user("one two three four five six seven")
    with httpx2.stream("POST", f"{server.url}/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": long, "stream": True}) as resp:
        lines = [line for line in resp.iter_lines() if line]
        assert resp.status_code == 200
    error = json.loads(lines[0].removeprefix("data: "))["error"]
    assert error["code"] == 400 and "maximum context length is 5 tokens" in error["message"]
    assert lines[1:] == ["data: [DONE]"]
    with pytest.raises(openai.APIError) as err:
        list(chat(c, long, stream=True))
    assert err.value.body["code"] == 400
    with pytest.raises(openai.BadRequestError):
        chat(c, long)
    assert chat(c, user("short"), chat_template_kwargs=ON).choices[0].message.content == expected(user("short"))[1]


# --- run-wide faults and live config --------------------------------------------------------------------------------

def test_api_key_is_checked_on_every_v1_endpoint(fake_server):
    server = fake_server({"api_key": "secret"})
    for key in ("wrong", "secret"):
        c = client(server, key)
        if key == "wrong":
            for call in (lambda: c.models.list(), lambda: chat(c, user("hi"))):
                with pytest.raises(openai.AuthenticationError) as err:
                    call()
                assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
                assert err.value.body["message"] == "Incorrect API key provided"
        else:
            assert [m.id for m in c.models.list()] == [MODEL] and chat(c, user("hi")).choices[0].message.content
    assert http(server, "/v1/models")[0] == 401  # no Authorization header at all
    assert http(server, "/stats")[0] == 200  # the test endpoints stay open


def test_unknown_model_gets_vllms_404(fake_server):
    server = fake_server({"check_model": True, "models": ["kimi-k2.6"]})
    c = client(server)
    with pytest.raises(openai.NotFoundError) as err:
        chat(c, user("hi"))
    assert err.value.body == {"message": "The model `fake-model` does not exist.", "type": "NotFoundError",
                              "param": "model", "code": 404}
    r = c.chat.completions.create(model="kimi-k2.6", messages=user("hi"))
    assert r.choices[0].message.content == expected(user("hi"))[1]
    assert chat(client(fake_server({"models": ["kimi-k2.6"]})), user("hi")).choices  # not checked by default


def test_post_config_changes_the_live_server(fake_server):
    server = fake_server()
    c = client(server)
    assert chat(c, user("before")).choices[0].finish_reason == "stop"
    status, cfg, _ = http(server, "/config", {"models": ["alias-b"], "check_model": True, "api_key": "k2"})
    assert status == 200 and cfg["models"] == ["alias-b"] and cfg["api_key"] == "k2" and cfg["reasoning_words"] == 6
    with pytest.raises(openai.AuthenticationError):
        chat(c, user("after"))
    c2 = client(server, "k2")
    assert [m.id for m in c2.models.list()] == ["alias-b"]
    with pytest.raises(openai.NotFoundError):
        chat(c2, user("after"))
    assert c2.chat.completions.create(model="alias-b", messages=user("after")).choices[0].finish_reason == "stop"
    http(server, "/config", {"api_key": None, "check_model": False, "fault_rate": 1.0, "faults": ["503"]})
    with pytest.raises(openai.InternalServerError) as err:
        chat(c, user("faulty"))
    assert err.value.status_code == 503 and server.stats()["faults"] == {"503": 1}


def test_retry_after_headers_of_injected_429s(fake_server):
    custom = fake_server({"fault_rate": 1.0, "faults": ["429"], "retry_after": "2", "retry_after_ms": "1500"})
    plain = fake_server({"fault_rate": 1.0, "faults": ["429"]})
    body = {"model": MODEL, "messages": user("hi")}
    status, _, headers = http(custom, "/v1/chat/completions", body)
    assert status == 429 and headers["Retry-After"] == "2" and headers["retry-after-ms"] == "1500"
    status, _, headers = http(plain, "/v1/chat/completions", body)
    assert status == 429 and headers["Retry-After"] == "0.05" and "retry-after-ms" not in headers


# --- poison prompts and throughput ----------------------------------------------------------------------------------

def _outcome(c, messages, stream: bool) -> str:
    try:
        if not stream:
            return chat(c, messages, chat_template_kwargs=ON).choices[0].finish_reason
        finish = None
        for chunk in chat(c, messages, stream=True, chat_template_kwargs=ON):
            finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
        return finish or "cut"
    except openai.APIConnectionError:
        return "cut"


def test_a_poison_prompt_drops_every_request_in_flight(fake_server):
    server = fake_server({"crash_on": "POISON", "token_delay_s": 0.05})  # 12 tokens: 0.6 s an answer
    c = client(server)
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _outcome(c, user(f"bystander {i}"),
                                                                                   stream=i % 2 == 0)))
               for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while server.stats()["inflight"] < 4:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    poison = user("this is POISON for the engine")
    assert _outcome(c, poison, stream=True) == "cut"
    for t in threads:
        t.join(10)
    assert results == {0: "cut", 1: "cut", 2: "cut", 3: "cut"}
    stats = server.stats()
    assert stats["crashes"] == 1 and stats["crash_counts"] == {request_key(poison): 1} and stats["completed"] == {}
    assert _outcome(c, user("after the restart"), stream=False) == "stop"  # it serves on
    assert _outcome(c, poison, stream=False) == "cut"
    stats = server.stats()
    assert stats["crash_counts"] == {request_key(poison): 2} and sum(stats["completed"].values()) == 1


class Load:
    """n streaming requests kept in flight from a background thread, bodies read and thrown away."""

    def __init__(self, server, n: int):
        self.server, self.n, self.stop = server, n, threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()))

    async def _run(self):
        body = {"model": MODEL, "messages": user("load"), "stream": True, "chat_template_kwargs": ON}
        async with httpx2.AsyncClient(timeout=30, limits=httpx2.Limits(max_connections=self.n + 4)) as http_client:
            async def worker():
                while not self.stop.is_set():
                    async with http_client.stream("POST", f"{self.server.url}/chat/completions", json=body) as resp:
                        async for _ in resp.aiter_bytes():
                            if self.stop.is_set():
                                return
            await asyncio.gather(*(worker() for _ in range(self.n)))

    def __enter__(self):
        self.thread.start()
        wait_for(lambda: self.server.stats()["inflight"] == self.n)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(10)
        wait_for(lambda: self.server.stats()["inflight"] == 0)

    def rate(self, seconds: float = 1.0) -> float:
        """Tokens per second the server served over the next window (after a short settling time)."""
        time.sleep(0.3)
        t0 = time.time()
        time.sleep(seconds)
        t1 = time.time()
        return self.server.stats(since=t0, until=t1)["tokens_in_window"] / (t1 - t0)


def wait_for(condition, timeout: float = 10):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_throughput_knee(fake_server):
    # 10 ms a token: 100 tokens/s per request up to 4 in flight; at 8 each token takes 10 ms * 2**2
    server = fake_server({"token_delay_s": 0.01, "knee": 4, "knee_penalty": 2.0, "reasoning_words": 2000})
    rates = {}
    for n in (2, 4):
        with Load(server, n) as load:
            rates[n] = load.rate()
    with Load(server, 8) as load:
        rates[8] = load.rate()
        http(server, "/config", {"knee": 8})
        rates["8, knee moved to 8"] = load.rate()
    assert rates[4] > 1.3 * rates[2], rates  # ideal 2x
    assert rates[8] < 0.75 * rates[4], rates  # ideal 0.5x
    assert rates["8, knee moved to 8"] > 1.3 * rates[8], rates  # ideal 4x
    assert server.stats()["inflight_peak"] == 8

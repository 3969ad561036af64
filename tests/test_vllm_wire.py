"""What a real vLLM 0.32 (CPU) says that the fake server did not, before issue 28 (seen in tests/test_vllm.py's runs
against the real server): each shape taught to the fake (`vllm_wire`) and our client's handling of it, fast.

 1. the first chunk's content is "" (the fake sent null)
 2. finish_reason "length" comes on the last token's chunk, with its id (the fake sent a separate empty chunk)
 3. a stop by EOS is a chunk of its own: content "", token_ids [EOS], stop_reason = the EOS id
 4. an answer that only thought has content null (unstreamed), and usage counts reasoning_tokens
 5. GET /v1/models gives root and max_model_len; max_tokens over it is a 400 (param max_tokens): preflight refuses
    max_tokens >= the context in one line before any request
 6. a prompt over the context is a 400 even when streamed (param input_tokens): that prompt fails for good, at once
 7. an unknown model's 404 says "Valid aliases": a run-wide fault naming server.model
 8. tools need a tool-call parser (--tool-call-parser): without one a request with tools is a 400, reported with the
    flags that fix it
 9. the text-based qwen3 reasoning parser drops `<think>` text the model samples inside its reasoning; the ids keep
    it: the row keeps both, and its drift is explained
"""
import json
import urllib.request

import pytest

from drafter_data.errors import StageError
from drafter_data.server.client import complete
from drafter_data.server.faults import classify
from drafter_data.server.preflight import preflight
from tests.fake_openai_server import expected_ids
from tests.test_server_client import ASK, ON, TOOLS, ids_config, run, spec

WIRE = {"vllm_wire": True, "engine": "vllm"}


def sse_chunks(server, **body) -> list[dict]:
    request = urllib.request.Request(f"{server.url}/chat/completions", method="POST",
                                     data=json.dumps({"model": "fake-model", "messages": ASK, "stream": True,
                                                      **body}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        lines = resp.read().decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def post(server, **body) -> tuple[int, dict]:
    request = urllib.request.Request(f"{server.url}/chat/completions", method="POST",
                                     data=json.dumps({"model": "fake-model", "messages": ASK, **body}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_1_the_first_chunk_content_is_empty_text_and_the_client_adds_nothing_for_it(fake_server):
    server = fake_server(ids_config("vllm", **WIRE))
    first = sse_chunks(server, return_token_ids=True, chat_template_kwargs=ON)[0]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""} and first["prompt_token_ids"]
    done = run(server, lambda c: complete(c, spec(token_ids_via="return_token_ids"), ASK))
    assert done.content == done.content.strip() and done.ttft_s is not None
    assert done.completion_token_ids == expected_ids(ASK, chat_template_kwargs=ON)


@pytest.mark.parametrize("stream", [True, False])
def test_2_a_length_cut_on_the_last_token_chunk_keeps_every_id(fake_server, stream):
    server = fake_server(ids_config("vllm", **WIRE))
    chunks = sse_chunks(server, return_token_ids=True, chat_template_kwargs=ON, max_tokens=5)
    last = [c for c in chunks if c["choices"]][-1]["choices"][0]
    assert last["finish_reason"] == "length" and last["stop_reason"] is None and len(last["token_ids"]) == 1
    done = run(server, lambda c: complete(c, spec(token_ids_via="return_token_ids", max_tokens=5), ASK,
                                          stream=stream))
    assert done.finish_reason == "length" and done.completion_tokens == 5
    assert done.completion_token_ids == expected_ids(ASK, chat_template_kwargs=ON, max_tokens=5)


@pytest.mark.parametrize("stream", [True, False])
def test_3_a_stop_by_eos_keeps_the_eos_id_and_not_its_text(fake_server, stream):
    server = fake_server(ids_config("vllm", **WIRE))
    end = [c for c in sse_chunks(server, return_token_ids=True, chat_template_kwargs=ON) if c["choices"]][-1]
    choice = end["choices"][0]
    assert choice["delta"] == {"content": ""} and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == choice["token_ids"][0] and len(choice["token_ids"]) == 1
    done = run(server, lambda c: complete(c, spec(token_ids_via="return_token_ids"), ASK, stream=stream))
    assert done.finish_reason == "stop" and done.completion_token_ids[-1] == choice["stop_reason"]
    assert "<|im_end|>" not in done.content and len(done.completion_token_ids) == done.completion_tokens


def test_4_an_answer_that_only_thought_has_null_content_and_counts_reasoning_tokens(fake_server):
    server = fake_server({**WIRE, "reasoning": "reasoning", "content_words": 6, "reasoning_words": 10})
    status, body = post(server, max_tokens=4, chat_template_kwargs=ON)
    assert status == 200 and body["choices"][0]["message"]["content"] is None
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}
    done = run(server, lambda c: complete(c, spec(max_tokens=4), ASK, stream=False))
    assert done.content == "" and done.reasoning and done.finish_reason == "length"
    assert done.length_stop_in == "reasoning"


def test_5_preflight_refuses_max_tokens_at_or_over_the_context_in_one_line(fake_server):
    server = fake_server({**WIRE, "max_model_len": 64})
    models = json.loads(urllib.request.urlopen(f"{server.url}/models", timeout=10).read())["data"][0]
    assert models["max_model_len"] == 64 and models["root"]
    status, body = post(server, max_tokens=100)
    assert status == 400 and body["error"]["param"] == "max_tokens"
    for max_tokens in (64, 100):
        with pytest.raises(StageError) as err:
            run(server, lambda c: preflight(c, server.url, spec(max_tokens=max_tokens), stream=True))
        assert "\n" not in str(err.value) and f"generation.max_tokens={max_tokens} does not fit" in str(err.value)
        assert "context of 64 tokens" in str(err.value)
    assert server.stats()["requests"] == 1, "preflight sent no chat request"


@pytest.mark.parametrize("stream", [True, False])
def test_6_a_prompt_over_the_context_is_a_400_even_streamed_and_fails_for_good(fake_server, stream):
    server = fake_server({**WIRE, "max_model_len": 8})
    long_ask = [{"role": "user", "content": " ".join(["word"] * 20)}]
    status, body = post(server, messages=long_ask, stream=True, max_tokens=4)
    assert status == 400 and body["error"]["param"] == "input_tokens"
    with pytest.raises(Exception) as err:
        run(server, lambda c: complete(c, spec(max_tokens=4), long_ask, stream=stream))
    fault = classify(err.value)
    assert fault.kind == "permanent" and "maximum context length is 8" in fault.reason
    # a prompt that fits is answered with the rest of the context, as vLLM does, not refused
    done = run(server, lambda c: complete(c, spec(max_tokens=6), ASK, stream=stream))
    assert done.finish_reason == "length" and done.completion_tokens == 8 - len(ASK[0]["content"].split())


def test_7_an_unknown_model_lists_valid_aliases_and_stops_the_run(fake_server):
    server = fake_server({**WIRE, "check_model": True})
    with pytest.raises(Exception) as err:
        run(server, lambda c: complete(c, spec(model="other"), ASK))
    fault = classify(err.value)
    assert fault.kind == "run_wide" and "Valid aliases: fake-model" in fault.reason
    assert "does not serve the model 'other'" in fault.reason


def test_8_tools_without_a_tool_call_parser_name_the_flags_that_fix_it(fake_server):
    server = fake_server({**WIRE, "tool_calls": True})
    with pytest.raises(Exception) as err:
        run(server, lambda c: complete(c, spec(), ASK, tools=TOOLS))
    fault = classify(err.value)
    assert fault.kind == "permanent" and "--enable-auto-tool-choice --tool-call-parser" in fault.reason
    fixed = fake_server({**WIRE, "tool_calls": True, "tool_call_parser": "hermes"})
    done = run(fixed, lambda c: complete(c, spec(), ASK, tools=TOOLS))
    assert done.finish_reason == "tool_calls" and done.tool_calls


@pytest.mark.parametrize("stream", [True, False])
def test_9_think_text_the_reasoning_parser_dropped_stays_in_the_ids_and_counts_as_drift(fake_server, stream):
    """vLLM's qwen3 reasoning parser removes `<think>` text the model samples inside its reasoning (the base Gemma
    does, often); the sampled ids keep it. The completion keeps both as the server gave them, so the ids (what the
    model really produced) go to training, and the row's text no longer tokenizes to them: drift, explained."""
    from drafter_data.tokens.tokenizers import KimiTokenizer
    from tests.conftest import KIMI_DIR

    server = fake_server(ids_config("vllm", **WIRE, reasoning="reasoning", think_in_reasoning=True))
    done = run(server, lambda c: complete(c, spec(token_ids_via="return_token_ids"), ASK, stream=stream))
    tok = KimiTokenizer(KIMI_DIR)
    think = tok.specials["<think>"]
    assert done.completion_token_ids.count(think) == 1 and "<think>" not in done.reasoning
    assert done.completion_token_ids == expected_ids(ASK, {"think_in_reasoning": True}, chat_template_kwargs=ON)
    # the stored text, re-encoded, is not the sampled ids: exactly the <think> is missing
    end_think = done.completion_token_ids.index(tok.specials["</think>"])
    assert tok.encode_chat(done.reasoning) == [i for i in done.completion_token_ids[:end_think] if i != think]

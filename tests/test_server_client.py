"""One completion through our client (drafter_data.server.client.complete) and preflight's findings, against the
fault-injecting test server over real HTTP: only real endings are completions, tool calls in OpenAI's form, and the
exact token ids of each engine's wire format, checked against usage."""
import asyncio

import pytest

from drafter_data.errors import StageError
from drafter_data.server.client import complete, make_client
from drafter_data.server.endpoints import ApiKey
from drafter_data.server.faults import IncompleteTokenIds, NotACompletion, classify
from drafter_data.server.preflight import ServerFeatures, preflight
from drafter_data.server.request import RequestSpec
from tests.conftest import KIMI_DIR, require_shared
from tests.fake_openai_server import expected, expected_ids, expected_prompt_ids, expected_tool_call, is_split

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"arg": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris today?"}]
ON = {"thinking": True}


def spec(token_ids: str = "auto", **changes) -> RequestSpec:
    base = RequestSpec(model="fake-model", max_tokens=256, temperature=0.0, top_p=1.0, seed=None, thinking=True,
                       thinking_kwarg="thinking", token_ids=token_ids)
    return RequestSpec(**{**base.__dict__, **changes})


def run(server, coro_fn):
    """coro_fn(client) run against server with a fresh client."""
    async def go():
        client = make_client(server.url, ApiKey("k", "DRAFTER_TEST_KEY", True), 4, 30)
        try:
            return await coro_fn(client)
        finally:
            await client.close()

    return asyncio.run(go())


def ids_config(mode: str, **more) -> dict:
    return {"token_ids": mode, "tokenizer_dir": str(require_shared(KIMI_DIR)), **more}


# --- 10.5: only stop, length and tool_calls are completions --------------------------------------------------------

@pytest.mark.parametrize("stream", [True, False])
def test_an_aborted_answer_is_not_a_completion(fake_server, stream):
    server = fake_server({"fault_rate": 1.0, "faults": ["abort"]})
    with pytest.raises(NotACompletion, match="'abort'") as err:
        run(server, lambda c: complete(c, spec(), ASK, stream=stream))
    fault = classify(err.value)
    assert fault.kind == "retry" and fault.answered


@pytest.mark.parametrize("stream", [True, False])
def test_stop_and_length_are_completions(fake_server, stream):
    server = fake_server()
    done = run(server, lambda c: complete(c, spec(), ASK, stream=stream))
    assert done.finish_reason == "stop" and (done.reasoning, done.content) == expected(ASK)
    cut = run(server, lambda c: complete(c, spec(max_tokens=3), ASK, stream=stream))
    assert cut.finish_reason == "length" and cut.length_stop_in == "reasoning"


# --- 12.3: tool calls in, tool calls out ---------------------------------------------------------------------------

@pytest.mark.parametrize("token_ids", ["none", "vllm"])
@pytest.mark.parametrize("stream", [True, False])
def test_tool_calls_come_back_in_openai_form(fake_server, stream, token_ids):
    config = {"tool_calls": True} if token_ids == "none" else ids_config(token_ids, tool_calls=True)
    server = fake_server(config)
    done = run(server, lambda c: complete(c, spec(), ASK, TOOLS, stream=stream))
    call = expected_tool_call(ASK, TOOLS)
    assert done.finish_reason == "tool_calls"
    assert done.tool_calls == [{"id": call["id"], "type": "function",
                                "function": {"name": "get_weather", "arguments": call["function"]["arguments"]}}]
    sent = server_requests(server)[-1]
    assert sent["tools"] == TOOLS


def test_answers_without_tool_calls_have_none(fake_server):
    server = fake_server({"reasoning": "inline"})
    done = run(server, lambda c: complete(c, spec(), ASK, TOOLS))
    assert done.tool_calls is None and done.content == expected(ASK)[1]


def server_requests(server) -> list[dict]:
    return [r["body"] for r in server.requests()]


# --- 11.1: token ids per engine ------------------------------------------------------------------------------------

ENGINES = [  # (fake config, engine preflight should name, method it should pick: streaming, not streaming)
    ({"token_ids": "vllm", "engine": "vllm"}, "vllm", ("return_token_ids", "return_token_ids")),
    ({"token_ids": "vllm"}, "unknown", ("return_token_ids", "return_token_ids")),  # a proxy forwarding only /v1
    ({"token_ids": "sglext", "engine": "sglang"}, "sglang", ("sglext", "sglext")),
    ({"token_ids": "sglang", "engine": "sglang"}, "sglang", ("return_token_ids_unstreamed",) * 2),
    ({"token_ids": "sglang"}, "unknown", ("return_token_ids_unstreamed", "return_token_ids")),
    ({"token_ids": "llama", "engine": "llama"}, "llama-server", ("llama_tokens", "llama_tokens")),
]


@pytest.mark.parametrize("config,engine,method", ENGINES)
@pytest.mark.parametrize("stream", [True, False])
def test_preflight_finds_each_engines_ids_and_they_are_exact(fake_server, config, engine, method, stream):
    config = dict(config)
    server = fake_server(ids_config(config.pop("token_ids"), **config))
    features = run(server, lambda c: preflight(c, server.url, spec("on"), stream))
    slots = 4 if engine == "llama-server" else None  # the fake llama-server's /props total_slots
    assert features == ServerFeatures(engine, method[0] if stream else method[1], slots)
    asking = spec().with_token_ids(features.token_ids)
    for messages in (ASK, [{"role": "user", "content": "Écris un poème — naïve café 東京"}]):
        done = run(server, lambda c: complete(c, asking, messages, stream=stream))
        assert done.completion_token_ids == expected_ids(messages, chat_template_kwargs=ON)
        assert done.prompt_token_ids == expected_prompt_ids(messages, chat_template_kwargs=ON)
        assert len(done.completion_token_ids) == done.completion_tokens
        assert len(done.prompt_token_ids) == done.prompt_tokens


@pytest.mark.parametrize("config,engine,method", [c for c in ENGINES if c[1] != "unknown"])
def test_a_connection_lost_while_asking_which_engine_is_retried(fake_server, config, engine, method):
    """llama-server closes a kept-alive connection now and then as it is reused: the engine's endpoint lost once
    must not make it "unknown", whose token-id methods it does not have (its run went on without ids)."""
    config = dict(config)
    server = fake_server(ids_config(config.pop("token_ids"), engine_drops=1, **config))
    features = run(server, lambda c: preflight(c, server.url, spec("on"), True))
    assert (features.engine, features.token_ids) == (engine, method[0])


def test_an_engine_endpoint_that_keeps_failing_is_given_up_after_three_tries(fake_server):
    """Sent again at once, twice at most: a gateway that holds or drops these paths costs seconds, not minutes."""
    for drops, engine in ((2, "llama-server"), (3, "unknown")):
        server = fake_server(ids_config("llama", engine="llama", engine_drops=drops))
        assert run(server, lambda c: preflight(c, server.url, spec("auto"), True)).engine == engine


@pytest.mark.parametrize("stream", [True, False])
def test_ids_of_a_split_prompt_are_the_servers_not_the_canonical_ones(fake_server, stream):
    config = ids_config("vllm", split_token_every=2)
    server = fake_server(config)
    prompts = [[{"role": "user", "content": f"question number {i} — naïve"}] for i in range(8)]
    split = [m for m in prompts if is_split(m, config)]
    assert split
    asking = spec().with_token_ids("return_token_ids")
    for messages in split:
        done = run(server, lambda c: complete(c, asking, messages, stream=stream))
        assert done.completion_token_ids == expected_ids(messages, config, chat_template_kwargs=ON)
        assert done.completion_token_ids != expected_ids(messages, chat_template_kwargs=ON)


@pytest.mark.parametrize("config", [{"token_ids": "vllm"}, {"token_ids": "sglext"}, {"token_ids": "llama",
                                                                                     "engine": "llama"}])
def test_ids_shorter_than_usage_are_refused_not_stored(fake_server, config):
    config = dict(config)
    mode = config.pop("token_ids")
    server = fake_server(ids_config(mode, drop_end_ids=True, content_words=1, **config))
    method = {"vllm": "return_token_ids", "sglext": "sglext", "llama": "llama_tokens"}[mode]
    with pytest.raises(IncompleteTokenIds, match="completion ids for"):
        run(server, lambda c: complete(c, spec().with_token_ids(method), ASK))
    # a short answer (thinking off, one word) ends within preflight's probe, so its missing stop id shows there
    with pytest.raises(StageError, match="token_ids=on.*completion ids for"):
        run(server, lambda c: preflight(c, server.url, spec("on", thinking=False), True))


def test_on_against_a_server_without_ids_fails_in_preflight_saying_what_was_tried(fake_server):
    server = fake_server()
    with pytest.raises(StageError) as err:
        run(server, lambda c: preflight(c, server.url, spec("on"), True))
    line = str(err.value)
    assert "generation.token_ids=on" in line and server.url in line and "(unknown)" in line
    assert "return_token_ids (vLLM" in line and "sglext" in line and "generation.token_ids=auto" in line
    assert "\n" not in line


def test_auto_without_ids_goes_on_without_them_and_off_does_not_ask(fake_server, capsys):
    server = fake_server()
    assert run(server, lambda c: preflight(c, server.url, spec("auto"), True)) == ServerFeatures("unknown", None)
    assert "stored without ids" in capsys.readouterr().err
    vllm = fake_server(ids_config("vllm"))
    before = len(server_requests(vllm))
    assert run(vllm, lambda c: preflight(c, vllm.url, spec("off"), True)).token_ids is None
    assert not any(b.get("return_token_ids") for b in server_requests(vllm)[before:])


def test_a_stream_refused_with_ids_moves_on_to_the_next_method(fake_server):
    server = fake_server(ids_config("sglang"))  # SGLang 0.5.19: return_token_ids + stream is a 400
    features = run(server, lambda c: preflight(c, server.url, spec("on"), True))
    assert features.token_ids == "return_token_ids_unstreamed"
    bodies = server_requests(server)
    assert any(b.get("return_token_ids") and b.get("stream") for b in bodies)  # tried streamed first
    done = run(server, lambda c: complete(c, spec().with_token_ids(features.token_ids), ASK, stream=True))
    assert done.completion_token_ids == expected_ids(ASK, chat_template_kwargs=ON)
    assert server_requests(server)[-1].get("stream") is False

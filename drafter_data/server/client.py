"""One chat completion from an OpenAI-compatible server, streamed or not: the reasoning read in all three
conventions (`reasoning_content`, `reasoning`, inline `<think>` tags), tool calls in OpenAI's form, and the exact
token ids when the spec asks for them (checked against the server's usage).

Only a real ending is a completion: `stop`, `length` or `tool_calls`. Anything else (an engine's `abort`, `error`,
no finish_reason at all) raises, so the caller retries instead of storing a cut answer; so does an answer that names
another model than the one asked for, or that thinks although its request switched thinking off.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx2
import openai
from openai import AsyncOpenAI

from drafter_data.server.faults import KEY_ENV_EXTENSION, NotACompletion, ThinkingIgnored, TruncatedStream, WrongModel
from drafter_data.server.request import RequestSpec
from drafter_data.server.token_ids import IdCollector, id_method

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REAL_ENDINGS = ("stop", "length", "tool_calls")


def make_client(base_url: str, key: str, concurrency: int, timeout_s: float) -> AsyncOpenAI:
    """key: from endpoints.api_key, which remembers its variable's name: a rejected key is then reported by that
    name (never by value)."""
    # The pool must allow `concurrency` connections, or it silently caps the requests in flight.
    limits = httpx2.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    http = openai.DefaultAsyncHttpxClient(limits=limits, timeout=httpx2.Timeout(timeout_s, connect=10.0),
                                          event_hooks={"request": [_key_source_tag(key)]})
    # Retries are ours (they must also cover truncated streams and count toward the run's statistics).
    return AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, http_client=http)


def _key_source_tag(key: str):
    name = getattr(key, "env_name", None)
    source = None if name is None else (name, bool(getattr(key, "present", False)))

    async def tag(request: httpx2.Request) -> None:
        if source is not None:
            request.extensions[KEY_ENV_EXTENSION] = source

    return tag


@dataclass
class Completion:
    reasoning: str | None
    content: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    length_stop_in: str | None
    ttft_s: float | None = None
    latency_s: float = 0.0
    chunks: int = 0
    token_times: list[float] | None = None  # arrival of each chunk with output (assess's steady-window rates)
    tool_calls: list[dict] | None = None  # OpenAI form: {"id", "type": "function", "function": {name, arguments}}
    prompt_token_ids: list[int] | None = None  # as the server tokenized the prompt, when asked for and whole
    completion_token_ids: list[int] | None = None  # the sampled ids, when asked for and whole
    model: str | None = None  # the model the answer names (None: it names none)


def split_inline_reasoning(content: str) -> tuple[str | None, str]:
    """Reasoning returned inside the content: '<think>r</think>a', or 'r</think>a' when the prompt opened <think>."""
    if THINK_CLOSE in content:
        reasoning, _, answer = content.partition(THINK_CLOSE)
        return reasoning.lstrip().removeprefix(THINK_OPEN), answer.lstrip("\n")
    if content.lstrip().startswith(THINK_OPEN):
        return content.lstrip().removeprefix(THINK_OPEN), ""  # cut inside the reasoning
    return None, content


def extra_field(obj, name: str):
    value = getattr(obj, name, None)
    if value is None and getattr(obj, "model_extra", None):
        value = obj.model_extra.get(name)
    return value


class ToolCalls:
    """Tool calls as they arrive: whole (a message's tool_calls) or as stream fragments merged by index."""

    def __init__(self):
        self.calls: dict[int, dict] = {}

    def add(self, fragments) -> None:
        for position, fragment in enumerate(fragments or []):
            index = getattr(fragment, "index", None)
            call = self.calls.setdefault(position if index is None else int(index),
                                         {"id": None, "type": "function", "function": {"name": None,
                                                                                       "arguments": ""}})
            call["id"] = call["id"] or getattr(fragment, "id", None)
            function = getattr(fragment, "function", None)
            if function is not None:
                call["function"]["name"] = call["function"]["name"] or getattr(function, "name", None)
                call["function"]["arguments"] += _arguments_text(getattr(function, "arguments", None))

    def as_list(self) -> list[dict] | None:
        return [self.calls[i] for i in sorted(self.calls)] or None


def _arguments_text(arguments) -> str:
    if arguments is None:
        return ""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


@dataclass
class Answer:
    """What has arrived of one answer, streamed or whole."""

    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    tool_calls: ToolCalls = field(default_factory=ToolCalls)
    finish_reason: str | None = None
    usage: object = None
    model: str | None = None
    ttft: float | None = None
    chunks: int = 0
    times: list[float] | None = None
    on_output: object = None  # called with each chunk that has output (generate's concurrency=auto counts them)

    def completion(self, thinking: bool, t0: float, streamed: bool) -> Completion:
        """The Completion, if this answer really ended (stop, length, tool_calls); else it raises."""
        if self.finish_reason is None:
            raise TruncatedStream("the stream ended without a finish_reason" if streamed else
                                  "the response has no finish_reason")
        if self.finish_reason not in REAL_ENDINGS:
            raise NotACompletion(f"the server ended the answer with finish_reason {self.finish_reason!r}, "
                                 f"not stop/length/tool_calls")
        reasoning = "".join(self.reasoning) if self.reasoning else None
        content = "".join(self.content)
        if reasoning is None and thinking:
            reasoning, content = split_inline_reasoning(content)
        if not thinking and (reasoning or THINK_CLOSE in content):
            raise ThinkingIgnored("the answer thinks although thinking was switched off for it")
        length_in = None
        if self.finish_reason == "length":
            length_in = "content" if content else ("reasoning" if reasoning else "content")
        return Completion(reasoning=reasoning, content=content, finish_reason=self.finish_reason,
                          prompt_tokens=int(getattr(self.usage, "prompt_tokens", 0) or 0),
                          completion_tokens=int(getattr(self.usage, "completion_tokens", 0) or 0),
                          length_stop_in=length_in, ttft_s=self.ttft, latency_s=time.monotonic() - t0,
                          chunks=self.chunks, token_times=self.times, tool_calls=self.tool_calls.as_list(),
                          model=self.model)


async def complete(client: AsyncOpenAI, spec: RequestSpec, messages: list[dict], tools: list | None = None,
                   thinking: bool | None = None, stream: bool = True, record_times: bool = False,
                   on_output=None) -> Completion:
    """One chat completion as `spec` describes it (thinking: this request's mode, the spec's unless given).
    record_times keeps the arrival time of each chunk with output (assess's steady-window rates); on_output is
    called as each arrives, the first with first_s (its seconds since the request was sent). When the spec asks
    for token ids by a method that cannot stream them whole, the request is sent unstreamed."""
    thinking = spec.thinking if thinking is None else thinking
    body = spec.body(messages, tools, thinking)
    method = id_method(spec.token_ids_via)
    ids = IdCollector(method) if method else None
    streamed = stream and (method is None or method.streams)
    t0 = time.monotonic()
    if streamed:
        answer = await _streamed(client, body, ids, t0, record_times, on_output)
    else:
        answer = await _unstreamed(client, body, ids)
    done = answer.completion(thinking, t0, streamed)
    if done.model and done.model != spec.model:
        raise WrongModel(f"the answer came from the model {done.model!r}, not {spec.model!r} (server.model): a "
                         f"router that falls back to another model? Only the target's own answers are stored")
    if ids is not None:
        await ids.fetch_prompt(client, body)
        done.prompt_token_ids, done.completion_token_ids = ids.checked(done.prompt_tokens, done.completion_tokens)
    return done


async def _unstreamed(client: AsyncOpenAI, body: dict, ids: IdCollector | None) -> Answer:
    resp = await client.chat.completions.create(stream=False, **body)
    if not resp.choices:
        raise TruncatedStream("the response has no choices")
    choice = resp.choices[0]
    msg = choice.message
    reasoning = extra_field(msg, "reasoning_content") or extra_field(msg, "reasoning")
    answer = Answer(reasoning=[reasoning] if reasoning else [], content=[msg.content or ""],
                    finish_reason=choice.finish_reason, usage=resp.usage, model=resp.model or None, chunks=1)
    answer.tool_calls.add(msg.tool_calls)
    if ids is not None:
        ids.add(resp)
    return answer


async def _streamed(client: AsyncOpenAI, body: dict, ids: IdCollector | None, t0: float,
                    record_times: bool, on_output=None) -> Answer:
    answer = Answer(times=[] if record_times else None, on_output=on_output)
    stream = await client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **body)
    async for chunk in stream:
        answer.chunks += 1
        if chunk.usage is not None:
            answer.usage = chunk.usage
        if chunk.model and chunk.model != answer.model:  # every chunk names it: a change mid-answer is kept
            answer.model = chunk.model if answer.model is None else f"{answer.model}+{chunk.model}"
        if ids is not None:
            ids.add(chunk)
        for choice in chunk.choices[:1]:
            _take_delta(answer, choice, t0)
    return answer


def _take_delta(answer: Answer, choice, t0: float) -> None:
    delta = choice.delta
    piece = extra_field(delta, "reasoning_content") or extra_field(delta, "reasoning")
    if piece:
        answer.reasoning.append(piece)
    if delta.content:
        answer.content.append(delta.content)
    if delta.tool_calls:
        answer.tool_calls.add(delta.tool_calls)
    if piece or delta.content or delta.tool_calls:
        first = answer.ttft is None
        if first:
            answer.ttft = time.monotonic() - t0
        if answer.times is not None:
            answer.times.append(time.monotonic())
        if answer.on_output is not None:
            answer.on_output(first_s=answer.ttft if first else None)
    if choice.finish_reason:
        answer.finish_reason = choice.finish_reason

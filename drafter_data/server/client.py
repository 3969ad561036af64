"""One chat completion from an OpenAI-compatible server, streamed or not, with the reasoning read in all three
conventions (`reasoning_content`, `reasoning`, inline `<think>` tags)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import httpx2
import openai
from openai import AsyncOpenAI

from drafter_data.server.faults import TruncatedStream
from drafter_data.server.request import RequestSpec

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def make_client(base_url: str, key: str, concurrency: int, timeout_s: float) -> AsyncOpenAI:
    # The pool must allow `concurrency` connections, or it silently caps the requests in flight.
    limits = httpx2.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    http = openai.DefaultAsyncHttpxClient(limits=limits, timeout=httpx2.Timeout(timeout_s, connect=10.0))
    # Retries are ours (they must also cover truncated streams and count toward the run's statistics).
    return AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, http_client=http)


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
    tool_calls: list[dict] | None = None  # OpenAI form, as the server returned them
    prompt_token_ids: list[int] | None = None  # as the server tokenized the prompt, when it says
    completion_token_ids: list[int] | None = None  # the sampled ids, when the server returns them


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


def _finish(reasoning_parts, content_parts, finish_reason, usage, thinking, t0, ttft, chunks,
            token_times=None) -> Completion:
    reasoning = "".join(reasoning_parts) if reasoning_parts else None
    content = "".join(content_parts)
    if reasoning is None and thinking:
        reasoning, content = split_inline_reasoning(content)
    length_in = None
    if finish_reason == "length":
        length_in = "content" if content else ("reasoning" if reasoning else "content")
    return Completion(reasoning=reasoning, content=content, finish_reason=finish_reason,
                      prompt_tokens=int(getattr(usage, "prompt_tokens", 0) or 0),
                      completion_tokens=int(getattr(usage, "completion_tokens", 0) or 0),
                      length_stop_in=length_in, ttft_s=ttft, latency_s=time.monotonic() - t0, chunks=chunks,
                      token_times=token_times)


async def complete(client: AsyncOpenAI, spec: RequestSpec, messages: list[dict], tools: list | None = None,
                   thinking: bool | None = None, stream: bool = True, record_times: bool = False) -> Completion:
    """One chat completion as `spec` describes it (thinking: this request's mode, the spec's unless given).
    record_times keeps the arrival time of each chunk with output (assess's steady-window rates)."""
    thinking = spec.thinking if thinking is None else thinking
    body = spec.body(messages, tools, thinking)
    t0 = time.monotonic()
    if not stream:
        resp = await client.chat.completions.create(stream=False, **body)
        if not resp.choices:
            raise TruncatedStream("the response has no choices")
        choice = resp.choices[0]
        msg = choice.message
        reasoning = extra_field(msg, "reasoning_content") or extra_field(msg, "reasoning")
        return _finish([reasoning] if reasoning else [], [msg.content or ""], choice.finish_reason, resp.usage,
                       thinking, t0, None, 1)
    reasoning_parts, content_parts = [], []
    finish_reason, usage, ttft, chunks = None, None, None, 0
    times = [] if record_times else None
    stream_resp = await client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **body)
    async for chunk in stream_resp:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            piece = extra_field(delta, "reasoning_content") or extra_field(delta, "reasoning")
            if piece:
                reasoning_parts.append(piece)
            if delta.content:
                content_parts.append(delta.content)
            if piece or delta.content:
                if ttft is None:
                    ttft = time.monotonic() - t0
                if times is not None:
                    times.append(time.monotonic())
            if choice.finish_reason:
                finish_reason = choice.finish_reason
    if finish_reason is None:
        raise TruncatedStream("the stream ended without a finish_reason")
    return _finish(reasoning_parts, content_parts, finish_reason, usage, thinking, t0, ttft, chunks, times)

"""The OpenAI-compatible server client shared by generate and assess: request building (thinking switch), reading
reasoning in all three conventions, fault classification, and preflight checks with messages that say what to do."""
from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field

import httpx2
import openai
from openai import AsyncOpenAI

from drafter_data.config import StageError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def api_key(server_cfg) -> str:
    """The key from the environment variable *named* by server.api_key_env; never from config or logs."""
    name = server_cfg.get("api_key_env")
    return (os.environ.get(name) if name else None) or "EMPTY"


def base_urls(server_cfg, override=None) -> list[str]:
    urls = override if override is not None else server_cfg.base_url
    urls = [urls] if isinstance(urls, str) else list(urls)
    if not urls:
        raise StageError("server.base_url is empty")
    return [u.rstrip("/") for u in urls]


def make_client(base_url: str, key: str, concurrency: int, timeout_s: float) -> AsyncOpenAI:
    # The pool must allow `concurrency` connections, or it silently caps the requests in flight.
    limits = httpx2.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    http = openai.DefaultAsyncHttpxClient(limits=limits, timeout=httpx2.Timeout(timeout_s, connect=10.0))
    # Retries are ours (they must also cover truncated streams and count toward the run's statistics).
    return AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, http_client=http)


def request_params(target, generation, model: str) -> dict:
    """What determines a completion besides the prompt; also the body fields sent with each request."""
    params = {
        "model": model,
        "max_tokens": int(generation.max_tokens),
        "temperature": float(generation.temperature),
        "top_p": float(generation.get("top_p", 1.0)),
        "extra_body": {"chat_template_kwargs": {target.thinking_kwarg: bool(generation.thinking)}},
    }
    if generation.get("seed") is not None:
        params["seed"] = int(generation.seed)
    return params


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


class TruncatedStream(Exception):
    """The stream ended without a finish_reason (a dropped connection or a server fault)."""


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


async def complete(client: AsyncOpenAI, messages: list[dict], params: dict, thinking: bool, stream: bool,
                   tools=None, record_times: bool = False) -> Completion:
    """One chat completion; reasoning from `reasoning_content`, `reasoning` or inline <think> tags."""
    t0 = time.monotonic()
    extra = {"tools": tools} if tools else {}
    if not stream:
        resp = await client.chat.completions.create(messages=messages, stream=False, **params, **extra)
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
    stream_resp = await client.chat.completions.create(messages=messages, stream=True,
                                                       stream_options={"include_usage": True}, **params, **extra)
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


# --- faults -------------------------------------------------------------------------------------------------------

@dataclass
class Fault:
    kind: str  # "server_down" (wait for the server), "retry" (count an attempt), "permanent" (to the errors file)
    reason: str
    retry_after_s: float | None = None


def classify(exc: BaseException) -> Fault:
    if isinstance(exc, openai.APITimeoutError):
        return Fault("retry", "timeout")
    if isinstance(exc, openai.APIConnectionError):
        return Fault("server_down", f"connection failed: {exc.__cause__ or exc}")
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        retry_after = _retry_after(exc.response)
        if status in (408, 409, 429) or status >= 500:
            return Fault("retry", f"HTTP {status}: {_message(exc)}", retry_after)
        return Fault("permanent", f"HTTP {status}: {_message(exc)}")
    if isinstance(exc, (TruncatedStream, openai.APIResponseValidationError, ValueError, httpx2.HTTPError)):
        return Fault("retry", f"{type(exc).__name__}: {exc}")
    return Fault("retry", f"{type(exc).__name__}: {exc}")


def _message(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:500]
    return str(exc.message)[:500]


def _retry_after(response) -> float | None:
    if response is None:
        return None
    headers = response.headers
    try:
        if headers.get("retry-after-ms"):
            return float(headers["retry-after-ms"]) / 1000
        if headers.get("retry-after"):
            return float(headers["retry-after"])
    except ValueError:
        return None
    return None


def backoff_s(attempt: int, base: float = 0.5, cap: float = 30.0, retry_after: float | None = None) -> float:
    """Exponential backoff with full jitter; a server's Retry-After wins when it asks for longer."""
    delay = random.uniform(0, min(cap, base * 2 ** attempt))
    return max(delay, retry_after or 0.0)


# --- preflight ----------------------------------------------------------------------------------------------------

@dataclass
class Preflight:
    served_models: list[str] = field(default_factory=list)


async def preflight(client: AsyncOpenAI, base_url: str, model: str, params: dict, thinking: bool,
                    stream: bool) -> Preflight:
    """Seconds, before the first prompt: the server answers, serves the model, does chat completions, and (thinking
    on) returns reasoning. Raises StageError with one line saying what was tried and what to do."""
    result = Preflight()
    try:
        models = await client.models.list()
        result.served_models = [m.id for m in models.data]
    except openai.APIConnectionError as exc:
        raise StageError(f"cannot reach the server at {base_url} (GET {base_url}/models: {exc.__cause__ or exc}); "
                         f"is it running, and is the host/port right?") from None
    except openai.NotFoundError:
        raise StageError(f"GET {base_url}/models answered 404: {base_url} is not an OpenAI-compatible API "
                         f"(does base_url end in /v1, and is this the inference server's port?)") from None
    except openai.APIStatusError as exc:
        raise StageError(f"GET {base_url}/models answered HTTP {exc.status_code}: {_message(exc)}") from None
    except (openai.APIResponseValidationError, ValueError) as exc:
        raise StageError(f"GET {base_url}/models did not return an OpenAI model list ({exc}); "
                         f"{base_url} is not an OpenAI-compatible API") from None
    if result.served_models and model not in result.served_models:
        raise StageError(f"model {model!r} is not served at {base_url}; it serves: {', '.join(result.served_models)} "
                         f"(set server.model)")
    probe = {**params, "max_tokens": 24}
    for attempt in range(1, 6):  # the server answered /models: a fault here may be passing (5xx, a dropped stream)
        try:
            done = await complete(client, [{"role": "user", "content": "Say hello."}], probe, thinking, stream)
            break
        except (openai.NotFoundError, openai.BadRequestError, openai.AuthenticationError,
                openai.PermissionDeniedError) as exc:
            raise _probe_error(base_url, exc, attempt) from None
        except Exception as exc:  # noqa: BLE001 - retried below, reported after the last attempt
            last = exc
            await asyncio.sleep(backoff_s(attempt, retry_after=classify(exc).retry_after_s))
    else:
        raise _probe_error(base_url, last, 5) from None
    if thinking and not done.reasoning:
        raise StageError(f"thinking is on, but {base_url} returned no reasoning (no reasoning_content/reasoning "
                         f"field, no <think> tags): the server may lack a reasoning parser (SGLang/vLLM: "
                         f"--reasoning-parser), or the model does not think; or run with generation.thinking=false")
    return result


def _probe_error(base_url: str, exc: BaseException, attempts: int) -> StageError:
    url = f"POST {base_url}/chat/completions"
    if isinstance(exc, openai.NotFoundError):
        return StageError(f"{url} answered 404: chat completions are not served there "
                          f"(a different service on this port, or a completions-only endpoint?)")
    if isinstance(exc, openai.APIStatusError):
        return StageError(f"{url} answered HTTP {exc.status_code}: {_message(exc)}")
    if isinstance(exc, (TruncatedStream, openai.APIResponseValidationError, ValueError)):
        return StageError(f"{url} did not return an OpenAI chat completion ({exc}) in {attempts} attempts; "
                          f"chat completions are not served there")
    return StageError(f"{url} failed {attempts} times: {classify(exc).reason}")

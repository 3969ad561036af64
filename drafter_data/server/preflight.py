"""Seconds before the first prompt: is this the server we need? Each failure is one line saying what was tried and
what to do (server down, wrong port, not an OpenAI API, wrong model name, no chat completions, no reasoning)."""
from __future__ import annotations

import openai
from openai import AsyncOpenAI

from drafter_data.errors import StageError
from drafter_data.server.client import complete
from drafter_data.server.faults import TruncatedStream, call_with_retries, classify, error_message
from drafter_data.server.request import RequestSpec

PROBE_ATTEMPTS = 5  # the server answered /models: a fault in the probe may be passing (5xx, a dropped stream)


async def preflight(client: AsyncOpenAI, base_url: str, spec: RequestSpec, stream: bool) -> None:
    """The server answers, serves the model, does chat completions, and (thinking on) returns reasoning.
    Raises StageError otherwise."""
    served = await _served_models(client, base_url)
    if served and spec.model not in served:
        raise StageError(f"model {spec.model!r} is not served at {base_url}; it serves: {', '.join(served)} "
                         f"(set server.model)")
    probe = spec.with_max_tokens(24)
    messages = [{"role": "user", "content": "Say hello."}]
    try:
        done = await call_with_retries(lambda: complete(client, probe, messages, stream=stream), PROBE_ATTEMPTS)
    except Exception as exc:  # noqa: BLE001 - explained in one line
        raise _probe_error(base_url, exc) from None
    if spec.thinking and not done.reasoning:
        raise StageError(f"thinking is on, but {base_url} returned no reasoning (no reasoning_content/reasoning "
                         f"field, no <think> tags): the server may lack a reasoning parser (SGLang/vLLM: "
                         f"--reasoning-parser), or the model does not think; or run with generation.thinking=false")


async def _served_models(client: AsyncOpenAI, base_url: str) -> list[str]:
    try:
        return [m.id for m in (await client.models.list()).data]
    except openai.APIConnectionError as exc:
        raise StageError(f"cannot reach the server at {base_url} (GET {base_url}/models: {exc.__cause__ or exc}); "
                         f"is it running, and is the host/port right?") from None
    except openai.NotFoundError:
        raise StageError(f"GET {base_url}/models answered 404: {base_url} is not an OpenAI-compatible API "
                         f"(does base_url end in /v1, and is this the inference server's port?)") from None
    except openai.APIStatusError as exc:
        raise StageError(f"GET {base_url}/models answered HTTP {exc.status_code}: {error_message(exc)}") from None
    except (openai.APIResponseValidationError, ValueError) as exc:
        raise StageError(f"GET {base_url}/models did not return an OpenAI model list ({exc}); "
                         f"{base_url} is not an OpenAI-compatible API") from None


def _probe_error(base_url: str, exc: BaseException) -> StageError:
    url = f"POST {base_url}/chat/completions"
    if isinstance(exc, openai.NotFoundError):
        return StageError(f"{url} answered 404: chat completions are not served there "
                          f"(a different service on this port, or a completions-only endpoint?)")
    if isinstance(exc, openai.APIStatusError):
        return StageError(f"{url} answered HTTP {exc.status_code}: {error_message(exc)}")
    if isinstance(exc, (TruncatedStream, openai.APIResponseValidationError, ValueError)):
        return StageError(f"{url} did not return an OpenAI chat completion ({exc}) in {PROBE_ATTEMPTS} attempts; "
                          f"chat completions are not served there")
    return StageError(f"{url} failed {PROBE_ATTEMPTS} times: {classify(exc).reason}")

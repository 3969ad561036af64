"""Seconds before the first prompt: is this the server we need, and what does it offer? Each failure is one line
saying what was tried and what to do (server down, wrong port, not an OpenAI API, wrong model name, max_tokens over
the context, rejected key, no chat completions, answers from another model, no reasoning or a thinking switch it
ignores, no token ids with generation.token_ids=on)."""
from __future__ import annotations

import sys
from dataclasses import dataclass

import openai
from openai import AsyncOpenAI

from drafter_data.errors import StageError
from drafter_data.server.client import complete
from drafter_data.redaction import redact_url
from drafter_data.server.engine import detect_engine
from drafter_data.server.faults import (IncompleteTokenIds, ThinkingIgnored, TruncatedStream, WrongModel,
                                       call_with_retries, classify, error_message)
from drafter_data.server.request import RequestSpec
from drafter_data.server.token_ids import CANDIDATES, METHODS

PROBE_ATTEMPTS = 5  # the server answered /models: a fault in the probe may be passing (5xx, a dropped stream)
ID_PROBE_TOKENS = 16  # enough for a short answer to end (and show its stop token), cheap when it does not
PROBE_MESSAGES = [{"role": "user", "content": "Say hello."}]


@dataclass(frozen=True)
class ServerFeatures:
    """What preflight found: the engine (llama-server, vllm, sglang, unknown) and how to ask it for token ids
    (a token_ids.METHODS name for spec.with_token_ids; None: no ids, by choice or because none are offered)."""

    engine: str
    token_ids: str | None
    slots: int | None = None  # the requests the engine runs at once, where it says (engine.Engine.slots)


async def preflight(client: AsyncOpenAI, base_url: str, spec: RequestSpec, stream: bool,
                    max_backoff_s: float = 5.0, modes: tuple[bool, ...] | None = None) -> ServerFeatures:
    """The server answers, serves the model (with room for max_tokens where it says its context), does chat
    completions, honours the thinking switch in each mode the run uses (`modes`: spec.thinking's unless given: on,
    it returns reasoning; off, none), answers as the model asked for, and (with spec.token_ids on) returns whole
    token ids. Raises StageError otherwise."""
    url = redact_url(base_url)
    served = await _served_models(client, url)
    if served and spec.model not in served:
        raise StageError(f"model {spec.model!r} is not served at {url}; it serves: {', '.join(served)} "
                         f"(set server.model)")
    context = served.get(spec.model)
    if context and spec.max_tokens >= context:
        raise StageError(f"generation.max_tokens={spec.max_tokens} does not fit: {url} serves {spec.model} with a "
                         f"context of {context} tokens, prompt included; set generation.max_tokens below it (or "
                         f"serve a longer context, e.g. vLLM --max-model-len)")
    done = None
    for thinking in (spec.thinking,) if modes is None else modes:
        done = await _probe_mode(client, url, spec.with_thinking(thinking), stream, max_backoff_s)
    engine = await detect_engine(client)
    via = await _token_id_method(client, url, spec, stream, engine.name, max_backoff_s)
    # generate's requests are sent as this probe was unless its token ids need them unstreamed (with their usage)
    sent_alike = not stream or via is None or METHODS[via].streams
    if sent_alike and (done.reasoning or done.content) and not done.completion_tokens:
        how = " in its stream (stream_options.include_usage ignored, e.g. by a proxy)" if stream else ""
        print(f"warning: {url} answered without its token counts (no usage{how}): generate will store "
              f"completion_tokens as 0 and report 0 output tok/s (concurrency=auto then follows requests/s)",
              file=sys.stderr)
    return ServerFeatures(engine.name, via, engine.slots)


WRONG_MODEL_PROBES = 3


async def _probe_mode(client: AsyncOpenAI, url: str, spec: RequestSpec, stream: bool, max_backoff_s: float):
    """One short answer in spec's thinking mode; StageError when the server cannot give one, names another model, or
    does not honour the thinking switch."""
    probe = spec.with_token_ids(None).with_max_tokens(24)
    switch = f"{spec.thinking_kwarg}={str(spec.thinking).lower()}"
    try:
        for probes in range(1, WRONG_MODEL_PROBES + 1):  # a router that falls back now and then: probe again
            try:
                done = await call_with_retries(lambda: complete(client, probe, PROBE_MESSAGES, stream=stream),
                                               PROBE_ATTEMPTS, max_backoff_s=max_backoff_s,
                                               give_up_on=(WrongModel, ThinkingIgnored))
                break
            except WrongModel as exc:
                if probes == WRONG_MODEL_PROBES:
                    raise StageError(f"POST {url}/chat/completions: {exc} ({probes} probes of {probes})") from None
    except ThinkingIgnored:
        raise StageError(f"{url} ignores the thinking switch: asked with chat_template_kwargs {switch}, it still "
                         f"thinks (its chat template does not read {spec.thinking_kwarg!r}: set "
                         f"target.thinking_kwarg to the kwarg it reads, or serve a template that has the switch)") \
            from None
    except StageError:
        raise
    except Exception as exc:  # noqa: BLE001 - explained in one line
        raise _probe_error(url, exc) from None
    if spec.thinking and not done.reasoning:
        raise StageError(f"thinking is on, but {url} returned no reasoning (no reasoning_content/reasoning "
                         f"field, no <think> tags; asked with {switch}): the server may lack a reasoning parser "
                         f"(SGLang/vLLM: --reasoning-parser), or the model does not think; or run with "
                         f"generation.thinking=false")
    return done


async def _token_id_method(client: AsyncOpenAI, url: str, spec: RequestSpec, stream: bool, engine: str,
                           max_backoff_s: float) -> str | None:
    """The first of the engine's methods whose probe returns whole ids; None (auto) or StageError (on) when none
    does."""
    if spec.token_ids == "off":
        return None
    tried = []
    for name in CANDIDATES[engine]:
        probe = spec.with_token_ids(name).with_max_tokens(ID_PROBE_TOKENS)
        try:
            # missing ids are not passing: one answer without them is enough to move on
            await call_with_retries(lambda: complete(client, probe, PROBE_MESSAGES, stream=stream),
                                    PROBE_ATTEMPTS, max_backoff_s=max_backoff_s, give_up_on=(IncompleteTokenIds,))
        except Exception as exc:  # noqa: BLE001 - the reason is reported
            tried.append(f"{METHODS[name].described}: {classify(exc).reason}")
            continue
        unstreamed = " (requests are sent unstreamed)" if stream and not METHODS[name].streams else ""
        print(f"token ids: {url} ({engine}) returns them via {METHODS[name].described}{unstreamed}",
              file=sys.stderr)
        return name
    what = f"{url} ({engine}) returned no whole token ids; tried {'; '.join(tried)}"
    if spec.token_ids == "on":
        raise StageError(f"generation.token_ids=on, but {what}. Serve the model with vLLM >= 0.10.2, SGLang >= "
                         f"0.5.20 or llama-server, or set generation.token_ids=auto (rows without ids) or off")
    print(f"token ids: {what}; completions are stored without ids (generation.token_ids=auto)", file=sys.stderr)
    return None


async def _served_models(client: AsyncOpenAI, url: str) -> dict[str, int | None]:
    """{model id: its context in tokens where the server says it (vLLM's max_model_len, llama-server's meta.n_ctx per
    slot), else None}."""
    try:
        return {m.id: _context_of(m) for m in (await client.models.list()).data}
    except openai.APIConnectionError as exc:
        raise StageError(f"cannot reach the server at {url} (GET {url}/models: "
                         f"{redact_url(str(exc.__cause__ or exc))}); is it running, and is the host/port right?") \
            from None
    except openai.NotFoundError:
        raise StageError(f"GET {url}/models answered 404: {url} is not an OpenAI-compatible API "
                         f"(does base_url end in /v1, and is this the inference server's port?)") from None
    except openai.APIStatusError as exc:
        raise StageError(f"GET {url}/models: {classify(exc).reason}") from None
    except (openai.APIResponseValidationError, ValueError) as exc:
        raise StageError(f"GET {url}/models did not return an OpenAI model list ({exc}); "
                         f"{url} is not an OpenAI-compatible API") from None


def _context_of(model) -> int | None:
    extra = getattr(model, "model_extra", None) or {}
    value = extra.get("max_model_len") or (extra.get("meta") or {}).get("n_ctx")
    return int(value) if isinstance(value, int) and value > 0 else None


def _probe_error(url: str, exc: BaseException) -> StageError:
    post = f"POST {url}/chat/completions"
    if isinstance(exc, openai.NotFoundError) and "model" not in error_message(exc).lower():
        return StageError(f"{post} answered 404: chat completions are not served there "
                          f"(a different service on this port, or a completions-only endpoint?)")
    if isinstance(exc, openai.APIStatusError):
        return StageError(f"{post}: {classify(exc).reason}")
    if isinstance(exc, (TruncatedStream, openai.APIResponseValidationError, ValueError)):
        return StageError(f"{post} did not return an OpenAI chat completion ({exc}) in {PROBE_ATTEMPTS} attempts; "
                          f"chat completions are not served there")
    return StageError(f"{post} failed {PROBE_ATTEMPTS} times: {classify(exc).reason}")

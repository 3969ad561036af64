"""What went wrong with a request, and what to do about it: wait for the server, try again, give up on the request,
or stop the run.

One retry policy serves every caller (generate, assess, preflight): exponential backoff with full jitter, a server's
Retry-After honoured when it asks for longer, every wait capped. An error is classified by its status code whether
it came as an HTTP status or as an error event inside a 200 stream.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

import httpx2
import openai
import orjson

from drafter_data.redaction import redact_url

# Sanity bound of a parsed Retry-After (every caller caps its waits lower: generate.max_backoff_s).
MAX_RETRY_AFTER_S = 3600.0
# Set on each request by make_client: the *name* of the key's environment variable, and whether it was set.
KEY_ENV_EXTENSION = "drafter_key_env"


class TruncatedStream(Exception):
    """The stream ended without a finish_reason (a dropped connection or a server fault)."""


class NotACompletion(Exception):
    """The answer ended in something other than stop, length or tool_calls (vLLM/SGLang `abort`, `error`, ...):
    the engine gave up on it, so it is not the model's answer."""


class WrongModel(Exception):
    """The answer names another model than the one asked for (a router that fell back to another model): not a
    completion of the target. Run-wide: a few in a row stop the run."""


class ThinkingIgnored(Exception):
    """The answer thinks although its request switched thinking off: the server ignores the switch (its template
    does not read target.thinking_kwarg), so it is not an answer in this row's mode."""


class IncompleteTokenIds(Exception):
    """Token ids were asked for, but the server returned none, or fewer/more than its usage counts."""


@dataclass
class Fault:
    """kind says what to do:
    - "unreachable": no connection at all: wait for a server (costs no attempt)
    - "dropped": the connection broke mid-request: counted per prompt separately (max_connection_failures), since a
      prompt that crashes the engine looks exactly like this
    - "retry": a passing fault of this request (429, 5xx, timeout, truncated or aborted stream): count an attempt
    - "permanent": this request cannot succeed (e.g. longer than the context): to the errors file at once
    - "run_wide": no request can succeed (a rejected key, an unknown model, a missing endpoint): a few in a row
      stop the run
    """

    kind: str
    reason: str
    retry_after_s: float | None = None
    answered: bool = False  # the server sent something (a status, part of a stream): it is up

    def at(self, url: str) -> Fault:
        """The same fault with the server named in its reason (for one-line messages)."""
        return Fault(self.kind, f"{self.reason} (server {redact_url(url)})", self.retry_after_s, self.answered)


def classify(exc: BaseException) -> Fault:
    if isinstance(exc, openai.APITimeoutError):
        return Fault("retry", "timeout")
    if isinstance(exc, openai.APIConnectionError):
        if _caused_by(exc, (httpx2.ConnectError, httpx2.ConnectTimeout)):
            return Fault("unreachable", redact_url(f"cannot connect: {exc.__cause__ or exc}"))
        return Fault("dropped", redact_url(f"connection lost: {exc.__cause__ or exc}"))
    if isinstance(exc, openai.APIStatusError):
        return by_status(exc.status_code, f"HTTP {exc.status_code}", exc, retry_after_s(exc.response))
    if isinstance(exc, openai.APIResponseValidationError):
        return Fault("retry", f"{type(exc).__name__}: {exc}", answered=True)
    if isinstance(exc, openai.APIError):  # an error event inside a 200 stream: `data: {"error": {...}}`
        status = _status_code(exc.body)
        return by_status(status, f"error in the stream (code {exc.code})", exc)
    if isinstance(exc, WrongModel):
        return Fault("run_wide", f"{exc}", answered=True)
    if isinstance(exc, (TruncatedStream, NotACompletion, IncompleteTokenIds, ThinkingIgnored, ValueError)):
        return Fault("retry", f"{type(exc).__name__}: {exc}", answered=True)
    return Fault("retry", redact_url(f"{type(exc).__name__}: {exc}"))


def by_status(status: int | None, what: str, exc: openai.APIError, retry_after: float | None = None) -> Fault:
    """An error the server answered, by its status code (HTTP, or the `code` of an in-stream error)."""
    message = error_message(exc)
    reason = f"{what}: {message}"
    if status == 400 and "--tool-call-parser" in message:  # vLLM started without a tool-call parser
        reason += ("; this prompt declares tools: start vLLM with --enable-auto-tool-choice --tool-call-parser <the "
                   "model's> (experiment=vllm-local: server.local.extra_args), or leave prompts with tools out")
    if status in (401, 403):
        return Fault("run_wide", rejected_key_reason(status, message, exc.request), answered=True)
    if status == 404:
        return Fault("run_wide", not_found_reason(message, exc), answered=True)
    if status is None or status in (408, 409, 429) or status >= 500:
        return Fault("retry", reason, retry_after, True)
    return Fault("permanent", reason, answered=True)


def rejected_key_reason(status: int, message: str, request: httpx2.Request | None) -> str:
    name, present = (_request_extensions(request).get(KEY_ENV_EXTENSION) or (None, False))
    if name is None:
        where = "no key is configured (server.api_key_env is empty)"
    elif present:
        where = f"the key in the environment variable {name} (server.api_key_env) was refused: check or renew it"
    else:
        where = f"no key was sent: the environment variable {name} (server.api_key_env) is not set: export it"
    return f"HTTP {status}: the server refused the request ({message}); {where}"


def not_found_reason(message: str, exc: openai.APIError) -> str:
    model = _sent_model(exc.request)
    if getattr(exc, "param", None) == "model" or "model" in message.lower():
        return (f"HTTP 404: the server does not serve the model {model!r} ({message}); it may have restarted under "
                f"another name: check server.model against GET /v1/models")
    path = exc.request.url.path if exc.request is not None else "?"
    return f"HTTP 404: {path} is not served there ({message}); is server.base_url the inference server's /v1 URL?"


def _status_code(body) -> int | None:
    """The HTTP-like status of an in-stream error body (`code`: 400, "400"; SGLang's string codes mapped)."""
    if not isinstance(body, dict):
        return None
    code = body.get("code")
    if isinstance(code, str) and not code.isdigit():
        return {"model_not_found": 404, "invalid_api_key": 401}.get(code)
    try:
        return int(code) if code is not None else None
    except (TypeError, ValueError):
        return None


def _request_extensions(request) -> dict:
    return getattr(request, "extensions", None) or {}


def _sent_model(request) -> str | None:
    try:
        return orjson.loads(request.content).get("model")
    except Exception:  # noqa: BLE001 - only for the message
        return None


def _caused_by(exc: BaseException, types: tuple) -> bool:
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, types):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def error_message(exc: openai.APIError) -> str:
    """The server's own words from an error body ({"error": {"message": ...}}, or flat), else the SDK's."""
    body = exc.body
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return redact_url(str(err["message"])[:500])
    return redact_url(str(exc.message)[:500])


def retry_after_s(response) -> float | None:
    """The server's wish from `retry-after-ms` or `Retry-After` (seconds or an HTTP date), at most
    MAX_RETRY_AFTER_S; None when absent or garbage (inf, nan, negative, text)."""
    if response is None:
        return None
    headers = response.headers
    wish = _seconds(headers.get("retry-after-ms"), per_second=1000.0)
    if wish is None:
        wish = _seconds(headers.get("retry-after"))
    if wish is None:
        wish = _seconds_until(headers.get("retry-after"))
    return None if wish is None else min(wish, MAX_RETRY_AFTER_S)


def _seconds(value: str | None, per_second: float = 1.0) -> float | None:
    try:
        number = float(value) / per_second
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) and number >= 0 else None


def _seconds_until(value: str | None) -> float | None:
    """An HTTP date (`Wed, 21 Oct 2015 07:28:00 GMT`) as seconds from now (0 when past)."""
    if not value:
        return None
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - time.time())


def backoff_s(attempt: int, base: float = 0.5, cap: float = 30.0, retry_after: float | None = None) -> float:
    """Exponential backoff with full jitter; a server's Retry-After wins when it asks for longer."""
    delay = random.uniform(0, min(cap, base * 2 ** min(attempt, 30)))
    return max(delay, retry_after or 0.0)


@dataclass
class RetryBudget:
    """One request's attempts: `next_wait` says how long to wait before trying again, or None to give up.
    Connection failures have their own bound (a real server restart costs each in-flight request one); every wait
    is capped at max_backoff_s, a server's Retry-After included."""

    max_attempts: int
    max_connection_failures: int = 6
    max_backoff_s: float = 60.0
    attempts: int = 0
    connection_failures: int = 0

    def next_wait(self, fault: Fault) -> float | None:
        if fault.kind == "unreachable":
            return self._capped(backoff_s(3))
        if fault.kind == "dropped":
            self.connection_failures += 1
            if self.connection_failures >= self.max_connection_failures:
                return None
            return self._capped(backoff_s(self.connection_failures))
        self.attempts += 1
        if fault.kind in ("permanent", "run_wide") or self.attempts >= self.max_attempts:
            return None
        return self._capped(backoff_s(self.attempts, retry_after=fault.retry_after_s))

    def _capped(self, seconds: float) -> float:
        return max(0.0, min(seconds, self.max_backoff_s))

    def gave_up(self, fault: Fault) -> str:
        """The reason written to errors.jsonl when next_wait returned None."""
        if fault.kind == "dropped":
            return f"the connection broke {self.connection_failures} times (does this prompt crash the server?): " \
                   f"{fault.reason}"
        if fault.kind in ("permanent", "run_wide"):
            return fault.reason
        return f"gave up after {self.attempts} attempts: {fault.reason}"


async def call_with_retries(call, max_attempts: int, on_retry=None, max_backoff_s: float = 60.0,
                            give_up_on: tuple = ()):
    """await call() until it succeeds; after a permanent or run-wide fault, an exception of `give_up_on`, or
    max_attempts, the last exception is raised. on_retry(fault) is told of each fault that is retried."""
    budget = RetryBudget(max_attempts, max_connection_failures=max_attempts, max_backoff_s=max_backoff_s)
    while True:
        try:
            return await call()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified; re-raised when given up
            fault = classify(exc)
            if fault.kind == "unreachable":  # here a server that stays away is an answer, not a wait: bounded
                fault = Fault("dropped", fault.reason, fault.retry_after_s, fault.answered)
            wait = budget.next_wait(fault)
            if wait is None or isinstance(exc, give_up_on):
                raise
            if on_retry is not None:
                on_retry(fault)
            await asyncio.sleep(wait)

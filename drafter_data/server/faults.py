"""What went wrong with a request, and what to do about it: wait for the server, try again, or give up.

One retry policy serves every caller (generate, assess, preflight): exponential backoff with full jitter, a server's
Retry-After honoured when it asks for longer, every wait capped.
"""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import httpx2
import openai


class TruncatedStream(Exception):
    """The stream ended without a finish_reason (a dropped connection or a server fault)."""


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
        if status in (408, 409, 429) or status >= 500:
            return Fault("retry", f"HTTP {status}: {error_message(exc)}", retry_after_s(exc.response))
        return Fault("permanent", f"HTTP {status}: {error_message(exc)}")
    if isinstance(exc, (TruncatedStream, openai.APIResponseValidationError, ValueError, httpx2.HTTPError)):
        return Fault("retry", f"{type(exc).__name__}: {exc}")
    return Fault("retry", f"{type(exc).__name__}: {exc}")


def error_message(exc: openai.APIStatusError) -> str:
    """The server's own words from an error body ({"error": {"message": ...}}), else the SDK's."""
    body = exc.body
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:500]
    return str(exc.message)[:500]


def retry_after_s(response) -> float | None:
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


@dataclass
class RetryBudget:
    """One request's attempts: `next_wait` says how long to wait before trying again, or None to give up."""

    max_attempts: int
    attempts: int = 0

    def next_wait(self, fault: Fault) -> float | None:
        self.attempts += 1
        if fault.kind == "permanent" or self.attempts >= self.max_attempts:
            return None
        return backoff_s(self.attempts, retry_after=fault.retry_after_s)


async def call_with_retries(call, max_attempts: int, on_retry=None):
    """await call() until it succeeds; after a permanent fault or max_attempts, the last exception is raised.
    on_retry(fault) is told of each fault that is retried."""
    budget = RetryBudget(max_attempts)
    while True:
        try:
            return await call()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified; re-raised when given up
            fault = classify(exc)
            wait = budget.next_wait(fault)
            if wait is None:
                raise
            if on_retry is not None:
                on_retry(fault)
            await asyncio.sleep(wait)

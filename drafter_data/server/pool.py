"""Several servers behind one queue: each request goes to the healthy server with the most room (fewest outstanding
requests for its limit); a failing one is set aside for a growing pause; when none has answered anything for
down_timeout_s, the run stops. A server's `limit` (requests in flight) is None for a fixed run-wide concurrency, or
the level its controller keeps (generation.concurrency=auto); a lower level can withdraw the youngest requests sent
at the level before it, to be sent again: past a steep knee, those left to finish could take minutes."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from drafter_data.errors import StageError
from drafter_data.redaction import redact_url

MAX_PAUSE_S = 10.0


@dataclass
class ServerState:
    url: str
    client: object
    spec: object = None  # the RequestSpec for this server (how it is asked for token ids), from preflight
    engine: str = "unknown"
    slots: int | None = None  # the requests the engine runs at once, where it says (preflight)
    outstanding: int = 0
    failures: int = 0
    down_until: float = 0.0
    limit: int | None = None
    controller: object = None  # a generation.concurrency.LevelController with concurrency=auto
    calls: dict = field(default_factory=dict)  # the requests in flight (asyncio tasks) -> when each was sent
    withdrawn: set = field(default_factory=set)  # ... those cancelled by a lower limit, to be sent again
    limit_since: float = 0.0  # when the limit was last set

    def room(self) -> float:
        return float("inf") if self.limit is None else self.limit - self.outstanding


class ServerPool:
    def __init__(self, states: list[ServerState], down_timeout_s: float):
        self.states = states
        self.down_timeout_s = down_timeout_s
        self.last_success = time.monotonic()
        self._freed = asyncio.Event()  # a request ended or a limit grew: waiters look again

    async def acquire(self) -> ServerState:
        """A server for one request (counted outstanding until `release`); waits while every server is down or
        full."""
        while True:
            now = time.monotonic()
            up = self.up(now)
            open_ = [s for s in up if s.room() > 0]
            if open_:
                chosen = max(open_, key=lambda s: (s.room() if s.limit else -s.outstanding))
                chosen.outstanding += 1
                return chosen
            give_up_at = self.last_success + self.down_timeout_s
            if not up and now > give_up_at:
                raise StageError(f"no server answered for {self.down_timeout_s:.0f} s "
                                 f"({', '.join(redact_url(s.url) for s in self.states)}); finished rows are saved, "
                                 f"re-run to resume")
            wake = min([s.down_until for s in self.states if s.down_until > now] + [give_up_at]) - now + 0.01
            self._freed.clear()
            await sleep_unless(self._freed, max(0.01, wake))

    def up(self, now: float | None = None) -> list[ServerState]:
        """The servers not set aside."""
        now = time.monotonic() if now is None else now
        return [s for s in self.states if s.down_until <= now]

    def release(self, s: ServerState, call: asyncio.Future | None = None) -> None:
        """A request to s (and its `call`, if it was sent) is over."""
        s.outstanding -= 1
        if call is not None:
            s.calls.pop(call, None)
            s.withdrawn.discard(call)
        self._freed.set()

    def send(self, s: ServerState, request) -> asyncio.Future:
        """Runs one request to s (a coroutine) as its own task, so that a lower limit can withdraw it."""
        call = asyncio.ensure_future(request)
        s.calls[call] = time.monotonic()
        return call

    @staticmethod
    def withdrew(s: ServerState, call: asyncio.Future) -> bool:
        """The cancelled `call` was withdrawn by a lower limit (to be sent again), not stopped with the run."""
        return call in s.withdrawn and not asyncio.current_task().cancelling()

    def set_limit(self, s: ServerState, limit: int, withdraw: bool = False) -> None:
        """A new limit for s; with `withdraw`, a lower one withdraws the youngest of the requests sent since the last
        change that are over it (the older ones may be nearly done)."""
        if withdraw and s.limit is not None and limit < s.outstanding:
            young = sorted((call for call, sent in s.calls.items()
                            if sent >= s.limit_since and call not in s.withdrawn), key=s.calls.get, reverse=True)
            for call in young[:max(0, s.outstanding - len(s.withdrawn) - limit)]:
                if call.cancel():
                    s.withdrawn.add(call)
        s.limit, s.limit_since = limit, time.monotonic()
        self._freed.set()

    def failed(self, s: ServerState, hard: bool) -> None:
        """A request to s failed: set s aside for a pause that doubles with each failure (hard: it cannot be
        reached; soft: after 3 in a row). Requests that were in flight together when it went away count once, and
        the pause stays short (MAX_PAUSE_S), so a server that comes back is used again within seconds."""
        now = time.monotonic()
        if now < s.down_until:
            return
        s.failures += 1
        if hard or s.failures >= 3:
            s.down_until = now + min(MAX_PAUSE_S, 0.5 * 2 ** min(s.failures, 6))

    def succeeded(self, s: ServerState) -> None:
        s.failures = 0
        s.down_until = 0.0
        self.last_success = time.monotonic()

    def answered(self, s: ServerState) -> None:
        """The server answered, if with an error: it is not down (the down timeout counts from here)."""
        self.last_success = time.monotonic()

    async def close(self) -> None:
        for s in self.states:
            await s.client.close()


async def sleep_unless(event: asyncio.Event, seconds: float) -> None:
    """Sleeps `seconds` or until `event` is set. (Not wait_for: on Python 3.11 it can lose a cancel that arrives
    together with its timeout, which once left a run hanging at its end.)"""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=max(0.0, seconds))
    finally:
        waiter.cancel()

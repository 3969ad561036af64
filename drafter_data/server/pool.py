"""Several servers behind one queue: each request goes to the healthy server with the fewest outstanding requests;
a failing one is set aside for a growing pause; when none has answered anything for down_timeout_s, the run stops."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from drafter_data.errors import StageError

MAX_PAUSE_S = 10.0


@dataclass
class ServerState:
    url: str
    client: object
    spec: object = None  # the RequestSpec for this server (how it is asked for token ids), from preflight
    engine: str = "unknown"
    outstanding: int = 0
    failures: int = 0
    down_until: float = 0.0


class ServerPool:
    def __init__(self, states: list[ServerState], down_timeout_s: float):
        self.states = states
        self.down_timeout_s = down_timeout_s
        self.last_success = time.monotonic()

    async def acquire(self) -> ServerState:
        while True:
            now = time.monotonic()
            up = [s for s in self.states if s.down_until <= now]
            if up:
                return min(up, key=lambda s: s.outstanding)
            give_up_at = self.last_success + self.down_timeout_s
            if now > give_up_at:
                raise StageError(f"no server answered for {self.down_timeout_s:.0f} s "
                                 f"({', '.join(s.url for s in self.states)}); finished rows are saved, re-run to resume")
            await asyncio.sleep(min(min(s.down_until for s in self.states), give_up_at) - now + 0.01)

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

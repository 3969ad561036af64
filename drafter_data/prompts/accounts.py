"""Per-source bookkeeping of prepare: read, kept and dropped (by reason) counts, and the rejects file.
read == kept + sum(dropped) by construction: kept is what is left."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson


class Accounts:
    def __init__(self, names: list[str], rejects_path: Path):
        self.read = Counter()
        self.dropped = {name: Counter() for name in names}
        self._rejects = open(rejects_path, "wb")

    def drop(self, source: str, reason: str, n: int = 1) -> None:
        if n:
            self.dropped[source][reason] += n

    def write_reject(self, entry: dict) -> None:
        self._rejects.write(orjson.dumps(entry) + b"\n")

    def close(self) -> None:
        self._rejects.close()

    def stats(self) -> dict:
        out = {}
        for name, dropped in self.dropped.items():
            read = self.read[name]
            out[name] = {"read": read, "kept": read - sum(dropped.values()), "dropped": dict(sorted(dropped.items()))}
        return out

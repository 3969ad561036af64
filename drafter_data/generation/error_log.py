"""errors.jsonl: the requests that failed for good, with the reason; one line per request that still has no
completion. Entries are appended live (flushed per line, so a kill keeps them); at the end the file is rewritten to
the latest entry of each request still not done."""
from __future__ import annotations

import os
from pathlib import Path

import orjson

from drafter_data.generation.keys import KeySet, hex_column


class ErrorLog:
    def __init__(self, path: Path, done: KeySet):
        """done: the request keys already completed; their old entries are dropped."""
        self.path = Path(path)
        self.entries: dict[str, dict] = {}
        if self.path.exists():
            for line in self.path.read_bytes().splitlines():
                try:
                    entry = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue  # a line cut by a kill
                if isinstance(entry, dict) and isinstance(entry.get("request_key"), str):
                    self.entries[entry["request_key"]] = entry
        if self.entries:
            keys = list(self.entries)
            for key, is_done in zip(keys, done.contains(hex_column(keys))):
                if is_done:
                    del self.entries[key]
        self._fh = open(self.path, "ab")

    def add(self, entry: dict) -> None:
        self.entries[entry["request_key"]] = entry
        self._fh.write(orjson.dumps(entry) + b"\n")
        self._fh.flush()

    def resolved(self, key_hex: str) -> None:
        """A request that failed in an earlier run has a completion now."""
        self.entries.pop(key_hex, None)

    def close(self) -> int:
        self._fh.close()
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in self.entries.values()))
        os.replace(tmp, self.path)
        return len(self.entries)

"""The generate stage's output directory as a crash-safe store of completions, keyed by request identity.

Shards are written whole or not at all (write, fsync, rename). On start, `scan` makes the directory consistent
after any kill: leftover temp files are removed, a request that appears twice (a kill during compaction) is kept
once, and rows that the current config would not produce (other generation params, prompts no longer in the input)
are moved out to a sibling `<output>.stale/` directory: kept, because they cost GPU time, but never reused silently.
"""
from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from drafter_data.contract import COMPLETIONS, shard_paths, write_table_atomic

SHARD_PREFIX = "completions-"


class CompletionStore:
    def __init__(self, out_dir: Path, compact_rows: int = 20000):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        # unique per store: a new shard never takes the name of an existing one (which scan may be moving)
        self.run_tag = time.strftime("%Y%m%dT%H%M%S") + f"-{uuid.uuid4().hex[:8]}"
        self.compact_rows = compact_rows
        self._seq = 0
        self.stale_rows = 0
        self.duplicate_rows = 0

    @property
    def stale_dir(self) -> Path:
        return self.dir.with_name(self.dir.name + ".stale") / self.run_tag

    def _next_path(self, kind: str = "") -> Path:
        self._seq += 1
        return self.dir / f"{SHARD_PREFIX}{self.run_tag}{kind}-{self._seq:06d}.parquet"

    def shards(self) -> list[Path]:
        return shard_paths(self.dir, SHARD_PREFIX)

    def scan(self, current_keys: set[str]) -> set[str]:
        """Returns the request keys already done for the current config; repairs the directory on the way."""
        for leftover in self.dir.glob(".*.tmp-*"):
            leftover.unlink()
        done: set[str] = set()
        for path in self.shards():
            keys = pq.read_table(path, columns=["request_key"]).column("request_key").to_pylist()
            fresh = [k in current_keys and k not in done for k in keys]
            is_stale = [k not in current_keys for k in keys]
            if all(fresh):
                done.update(keys)
                continue
            table = pq.read_table(path)
            good = table.filter(pa.array(fresh))
            if good.num_rows:
                write_table_atomic(good, self._next_path())
                done.update(good.column("request_key").to_pylist())
            n_stale = sum(is_stale)
            self.stale_rows += n_stale
            self.duplicate_rows += len(keys) - good.num_rows - n_stale
            if n_stale:
                self.stale_dir.mkdir(parents=True, exist_ok=True)
                shutil.move(str(path), self.stale_dir / path.name)
            else:
                path.unlink()
        return done

    def write(self, rows: list[dict]) -> Path | None:
        if not rows:
            return None
        path = self._next_path()
        write_table_atomic(pa.Table.from_pylist(rows, schema=COMPLETIONS), path)
        return path

    def compact(self) -> None:
        """Merges small shards into shards of about compact_rows: few files for DVC to hash and a fast resume. New
        shards are written before the old ones are removed; a kill in between leaves duplicates that scan drops."""
        small = [p for p in self.shards() if pq.ParquetFile(p).metadata.num_rows < self.compact_rows]
        if len(small) < 2:
            return
        batch, rows = [], 0
        merged_from: list[Path] = []
        for path in small:
            batch.append(pq.read_table(path))
            merged_from.append(path)
            rows += batch[-1].num_rows
            if rows >= self.compact_rows:
                write_table_atomic(pa.concat_tables(batch), self._next_path("c"))
                for p in merged_from:
                    p.unlink()
                batch, rows, merged_from = [], 0, []
        if len(merged_from) > 1:
            write_table_atomic(pa.concat_tables(batch), self._next_path("c"))
            for p in merged_from:
                p.unlink()


class ErrorLog:
    """errors.jsonl: requests that failed for good, with the reason. Appended live (one line per failure, flushed);
    rewritten at the end of a run to the latest entry of each request that still has no completion."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fh = open(self.path, "ab")

    def add(self, entry: dict) -> None:
        self._fh.write(orjson.dumps(entry) + b"\n")
        self._fh.flush()

    def close(self, done_keys: set[str]) -> int:
        self._fh.close()
        latest = {}
        for line in self.path.read_bytes().splitlines():
            try:
                entry = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue  # a line cut by a kill
            if entry.get("request_key") not in done_keys:
                latest[entry.get("request_key")] = entry
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in latest.values()))
        os.replace(tmp, self.path)
        return len(latest)


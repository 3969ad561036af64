"""What export reads, checked before any work: tokenize's meta.json and shards, and the completions the tokens were
made from (the same ones, by meta.json's digest), each problem one line naming the file.

The completions are looked up by (prompt_id, turn) through a sorted index of 8-byte key hashes (16 bytes a row with
its position), a batch at a time: export follows the tokens' order, which for tokenize.rows=per_turn is the
completions' own order, so each batch is read once and one is held.
"""
from __future__ import annotations

import hashlib
import json
from array import array
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from drafter_data.contract import shard_paths
from drafter_data.errors import StageError
from drafter_data.tokens.columns import turns_from_batch
from drafter_data.tokens.duplicates import repeated_rows
from drafter_data.tokens.source_digest import DIGEST_KEY, SHARDS_KEY, completions_digest, shard_digests

META_KEYS = ("target", "tokenizer", "chat_template_sha256", "template_kwargs", "thinking_kwarg", "special_ids",
             "rows_per", "max_length", "output_rows")
TOKEN_COLUMNS = ("prompt_id", "turn", "input_ids", "loss_mask")
# completions columns beyond the ones tokenize reads (tokens.columns.COLUMNS), for the conversations and the card
EXTRA_COLUMNS = ("source", "model", "token_ids_via", "chat_template_kwargs", "completion_tokens", "request_key")


@contextmanager
def reading(path: Path, what: str):
    """A file that cannot be read (cut short, not Parquet, gone) as one line naming it, never a traceback."""
    try:
        yield
    except (pa.ArrowException, OSError, ValueError) as exc:
        text = " ".join(str(exc).split())[:300]
        raise StageError(f"cannot read {what} {path}: {text}; run the stage that makes it again") from None


def read_meta(tokens_dir: Path) -> dict:
    path = tokens_dir / "meta.json"
    if not path.is_file():
        raise StageError(f"no meta.json in {tokens_dir.resolve()}; run tokenize first")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StageError(f"cannot read {path}: {' '.join(str(exc).split())}; run tokenize again") from None
    if not isinstance(meta, dict):
        raise StageError(f"{path} is not a JSON object; run tokenize again")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise StageError(f"{path} lacks {', '.join(missing)} (made by an older or another tool); run tokenize again")
    if meta.get("refused"):
        raise StageError(f"tokenize refused these rows ({'; '.join(meta['refused'])[:300]}); export only exports "
                         f"tokens tokenize accepted")
    return meta


def token_shards(tokens_dir: Path) -> list[Path]:
    paths = shard_paths(tokens_dir, "tokens-")
    if not paths:
        raise StageError(f"no token shards (tokens-*.parquet) in {tokens_dir.resolve()}; run tokenize first")
    for path in paths:
        with reading(path, "the token shard"):
            names = pq.ParquetFile(path).schema_arrow.names
        missing = [c for c in TOKEN_COLUMNS if c not in names]
        if missing:
            raise StageError(f"the token shard {path} lacks {', '.join(missing)}; run tokenize again")
    return paths


def check_shards(meta: dict, paths: list[Path], tokens_dir: Path) -> None:
    """The shards are exactly the ones tokenize wrote with this meta.json: a shard copied in, missing, or taken from
    another tokenize run would export rows twice, lose some, or describe them with another run's settings."""
    recorded = meta.get(SHARDS_KEY)
    if not isinstance(recorded, dict):
        raise StageError(f"{tokens_dir / 'meta.json'} does not list its token shards (made by an older tokenize); "
                         f"run tokenize again")
    found = shard_digests(paths)
    extra, absent = sorted(set(found) - set(recorded)), sorted(set(recorded) - set(found))
    changed = sorted(name for name in set(found) & set(recorded) if found[name] != recorded[name])
    if extra or absent or changed:
        what = "; ".join(f"{label}: {', '.join(names[:3])}" for label, names in
                         (("not written by this tokenize run", extra), ("missing", absent),
                          ("changed since", changed)) if names)
        raise StageError(f"the token shards in {tokens_dir} are not the ones its meta.json describes ({what}); "
                         f"run tokenize again")


def token_batches(paths: list[Path], batch_rows: int):
    """The token rows in order, a batch at a time; a shard that breaks while being read is one line."""
    for path in paths:
        with reading(path, "the token shard"):
            file = pq.ParquetFile(path)
            yield from file.iter_batches(batch_size=batch_rows, columns=list(TOKEN_COLUMNS), use_threads=False)


def completion_shards(directory: Path) -> list[Path]:
    paths = shard_paths(directory)
    if not paths:
        raise StageError(f"no completion shards (*.parquet) in {directory.resolve()}; run generate first")
    for path in paths:
        with reading(path, "the completions shard"):
            pq.ParquetFile(path)
    return paths


def check_source(meta: dict, paths: list[Path], tokens_dir: Path, completions_dir: Path) -> str:
    """The completions must be the ones the tokens were made from (meta.json's digest of their request keys and
    answers); returns the digest."""
    want = meta.get(DIGEST_KEY)
    if not want:
        raise StageError(f"{tokens_dir / 'meta.json'} does not say which completions the tokens were made from (no "
                         f"{DIGEST_KEY}: tokenize of an older release); run tokenize again")
    with reading(completions_dir, "the completions in"):
        got = completions_digest(paths)
    if got != want:
        raise StageError(f"the completions in {completions_dir} are not the ones the tokens in {tokens_dir} were made "
                         f"from ({DIGEST_KEY} {got[:12]} != {want[:12]}); run tokenize on them again, or point "
                         f"export.completions at the completions tokenize read")
    return got


def key_hash(prompt_id: str, turn: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{prompt_id}\0{turn}".encode(), digest_size=8).digest(), "little")


class Completion:
    """One completions row: the tokens' Turn (messages as sent, answer, ids) and the columns the card reads."""

    __slots__ = ("turn", "extra")

    def __init__(self, turn, extra: dict):
        self.turn, self.extra = turn, extra


class CompletionIndex:
    """(prompt_id, turn) -> its completions row. Copies of a row are read once (the first, as tokenize reads them);
    two different rows for one (prompt_id, turn) are refused (repeated_rows).

    Rows are read a batch of `batch_rows` at a time through one cursor: lookups in the completions' order (the tokens'
    order with tokenize.rows=per_turn) read each batch once and hold one; a lookup behind the cursor (rows=conversation,
    whose tokens are grouped by conversation) reads its file again from the start up to that row."""

    def __init__(self, paths: list[Path], default_thinking: bool, batch_rows: int = 1024):
        self.paths, self.default_thinking, self.batch_rows = paths, default_thinking, batch_rows
        with reading(paths[0].parent, "the completions in"):
            skips = repeated_rows(paths, "export.completions")
        self.duplicates = sum(len(s) for s in skips.values())
        hashes, where = array("Q"), array("i")  # 16 bytes a row, not a Python object
        for n, path in enumerate(paths):
            with reading(path, "the completions shard"):
                file = pq.ParquetFile(path)
                turn_col = "turn" in file.schema_arrow.names
                skip = set(skips.get(str(path), np.empty(0, np.int64)).tolist())
                row = 0
                for batch in file.iter_batches(batch_size=65536, columns=["prompt_id", *(["turn"] * turn_col)],
                                               use_threads=False):
                    ids = batch.column("prompt_id").to_pylist()
                    turns = batch.column("turn").to_pylist() if turn_col else [0] * len(ids)
                    for i, (pid, turn) in enumerate(zip(ids, turns)):
                        if row + i not in skip:
                            hashes.append(key_hash(pid, turn or 0))
                            where.extend((n, row + i))
                    row += len(ids)
        self.rows = len(hashes)
        keys = np.frombuffer(hashes, dtype=np.uint64) if hashes else np.empty(0, np.uint64)
        order = np.argsort(keys, kind="stable")
        self.hashes = keys[order]
        self.where = (np.frombuffer(where, dtype=np.int32) if where else np.empty(0, np.int32)).reshape(-1, 2)[order]
        self.used = 0
        self.restarts = 0  # lookups behind the cursor (each reads a file again up to the row)
        self._file, self._batches, self._start, self._end, self._rows = -1, None, 0, 0, None

    def get(self, prompt_id: str, turn: int) -> Completion:
        h = np.uint64(key_hash(prompt_id, turn))
        at = int(np.searchsorted(self.hashes, h))
        while at < len(self.hashes) and self.hashes[at] == h:
            n, row = (int(x) for x in self.where[at])
            found = self.row(n, row)
            if found.turn.prompt_id == prompt_id and found.turn.turn == turn:
                self.used += 1
                return found
            at += 1
        raise StageError(f"the tokens hold prompt {prompt_id} turn {turn}, which the completions in "
                         f"{self.paths[0].parent} lack; run tokenize on them again")

    def row(self, n: int, row: int) -> Completion:
        path = self.paths[n]
        with reading(path, "the completions shard"):
            if n != self._file or row < self._start:
                if n == self._file:
                    self.restarts += 1
                self._file, self._start, self._end, self._rows = n, 0, 0, None
                self._batches = pq.ParquetFile(path).iter_batches(batch_size=self.batch_rows, use_threads=False)
            while row >= self._end:
                batch = next(self._batches)
                self._start, self._end, self._batch, self._rows = self._end, self._end + batch.num_rows, batch, None
            if self._rows is None:
                self._rows = self.completions(self._batch)
        return self._rows[row - self._start]

    def completions(self, batch: pa.RecordBatch) -> list[Completion]:
        turns = turns_from_batch(batch, self.default_thinking)
        names = batch.schema.names
        extras = {c: batch.column(c).to_pylist() if c in names else [None] * batch.num_rows
                  for c in EXTRA_COLUMNS + ("finish_reason", "length_stop_in")}
        return [Completion(t, {c: extras[c][i] for c in extras}) for i, t in enumerate(turns)]

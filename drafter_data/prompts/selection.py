"""Which normalized prompts are kept: exact dedupe (first occurrence in source order wins), per-source quotas, then a
global sample by bottom-k of a seeded hash (deterministic on every machine, and stable: adding unrelated records only
ever displaces members of the sample). Pass 2 copies the chosen rows into the output shards."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterator

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.ipc  # noqa: F401  (pa.ipc)

from drafter_data.arrow_columns import bool_array
from drafter_data.contract import PROMPTS, write_table_atomic
from drafter_data.prompts.accounts import Accounts

BATCH = 8192
# Pass 1's temporary shards: uncompressed Arrow IPC, the cheapest to write and to read back (Parquet with zstd took
# most of pass 2's time). They take at most about the inputs' size on disk (the prompts' text, unescaped).
PASS1_OPTIONS = pa.ipc.IpcWriteOptions(compression=None)


def write_pass1_shard(table: pa.Table, path: Path) -> None:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, PROMPTS, options=PASS1_OPTIONS) as writer:
        writer.write_table(table)


def pass1_batches(tmp_dir: Path) -> Iterator[pa.RecordBatch]:
    """Pass 1's rows in the order they were written (shard names sort in unit order)."""
    for path in sorted(tmp_dir.glob("pass1-*.arrow")):
        with pa.memory_map(str(path)) as source:
            reader = pa.ipc.open_file(source)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)


def prompt_digest(messages: list[dict], tools: str | None = None, extras: str | None = None) -> bytes:
    """The prompt's identity: a hash of its normalized messages (and of its tools and message extras, when it has
    any; a prompt with neither hashes exactly as before they existed)."""
    if extras is not None:
        payload = orjson.dumps([messages, tools, extras])
    else:
        payload = orjson.dumps(messages) if tools is None else orjson.dumps([messages, tools])
    return hashlib.blake2b(payload, digest_size=16).digest()


def sample_keys(digests: np.ndarray, seed: int) -> np.ndarray:
    """A seeded, machine-independent pseudo-random key per prompt (splitmix64 over the digest's first 8 bytes)."""
    x = digests.view("<u8")[::2].copy() if digests.size else np.zeros(0, dtype="<u8")
    with np.errstate(over="ignore"):
        x ^= np.uint64((seed * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def choose(digests: np.ndarray, source_of: np.ndarray, sources: list[dict], sample, seed: int,
           acc: Accounts) -> np.ndarray:
    """Dedupe, per-source quotas, then the global sample; returns the keep mask (drops counted in acc)."""
    keep = first_occurrences(digests)
    for i, src in enumerate(sources):
        acc.drop(src["name"], "duplicate", int(np.count_nonzero(~keep & (source_of == i))))
    keys = sample_keys(digests, seed)

    def bottom_k(candidates: np.ndarray, k: int, reason: str):
        if len(candidates) <= k:
            return
        dropped = candidates[~smallest(keys[candidates], k)]
        keep[dropped] = False
        for i, src in enumerate(sources):
            acc.drop(src["name"], reason, int(np.count_nonzero(source_of[dropped] == i)))

    for i, src in enumerate(sources):
        if src.get("quota") is not None:
            bottom_k(np.flatnonzero(keep & (source_of == i)), int(src["quota"]), "over_quota")
    if sample is not None:
        bottom_k(np.flatnonzero(keep), int(sample), "not_sampled")
    return keep


def first_occurrences(digests: np.ndarray) -> np.ndarray:
    """Mask of the first occurrence of each digest (S16). Sorts 8-byte integers, not 16-byte strings (3x quicker):
    only digests whose first 8 bytes are shared, almost all of them true duplicates, are compared whole."""
    n = len(digests)
    keep = np.ones(n, dtype=bool)
    if n < 2:
        return keep
    head = digests.view("<u8")[::2]
    order = np.argsort(head, kind="stable")
    equal_next = head[order[1:]] == head[order[:-1]]
    shared = np.zeros(n, dtype=bool)
    shared[1:] |= equal_next
    shared[:-1] |= equal_next
    members = np.sort(order[shared])  # positions of every digest whose head is not unique, in input order
    keep[members] = False
    _, first = np.unique(digests[members], return_index=True)  # stable: the earliest position of each
    keep[members[first]] = True
    return keep


def smallest(keys: np.ndarray, k: int) -> np.ndarray:
    """Mask of the k smallest keys, ties broken by position (as a stable sort would take them)."""
    kth = np.partition(keys, k - 1)[k - 1]
    chosen = keys < kth
    ties = np.flatnonzero(keys == kth)
    chosen[ties[: k - int(np.count_nonzero(chosen))]] = True
    return chosen


def write_chosen(tmp_dir: Path, keep: np.ndarray, out_dir: Path, shard_rows: int) -> int:
    """Pass 2: copy the kept rows, in input order, into shards of at most shard_rows; returns the shard count."""
    pending, pending_rows, shard, offset = [], 0, 0, 0

    def flush():
        nonlocal pending, pending_rows, shard
        if pending:
            write_table_atomic(pa.Table.from_batches(pending, schema=PROMPTS), out_dir / f"prompts-{shard:05d}.parquet")
            shard += 1
            pending, pending_rows = [], 0

    for batch in pass1_batches(tmp_dir):
        mask = keep[offset: offset + batch.num_rows]
        offset += batch.num_rows
        chosen = batch.filter(bool_array(mask))
        while chosen.num_rows:
            take = min(chosen.num_rows, shard_rows - pending_rows)
            pending.append(chosen.slice(0, take))
            pending_rows += take
            chosen = chosen.slice(take)
            if pending_rows >= shard_rows:
                flush()
    flush()
    return shard

"""Which normalized prompts are kept: exact dedupe (first occurrence in source order wins), per-source quotas, then a
global sample by bottom-k of a seeded hash (deterministic on every machine, and stable: adding unrelated records only
ever displaces members of the sample). Pass 2 copies the chosen rows into the output shards."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa

from drafter_data.contract import PROMPTS, iter_batches, shard_paths, write_table_atomic
from drafter_data.prompts.accounts import Accounts

BATCH = 8192


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
    keep = np.zeros(len(digests), dtype=bool)
    if len(digests):
        _, first = np.unique(digests, return_index=True)
        keep[first] = True
    for i, src in enumerate(sources):
        acc.drop(src["name"], "duplicate", int(np.count_nonzero(~keep & (source_of == i))))
    keys = sample_keys(digests, seed)

    def bottom_k(candidates: np.ndarray, k: int, reason: str):
        if len(candidates) <= k:
            return
        order = np.lexsort((candidates, keys[candidates]))  # ties broken by position: fully deterministic
        dropped = candidates[order[k:]]
        keep[dropped] = False
        for i, src in enumerate(sources):
            acc.drop(src["name"], reason, int(np.count_nonzero(source_of[dropped] == i)))

    for i, src in enumerate(sources):
        if src.get("quota") is not None:
            bottom_k(np.flatnonzero(keep & (source_of == i)), int(src["quota"]), "over_quota")
    if sample is not None:
        bottom_k(np.flatnonzero(keep), int(sample), "not_sampled")
    return keep


def write_chosen(tmp_dir: Path, keep: np.ndarray, out_dir: Path, shard_rows: int) -> int:
    """Pass 2: copy the kept rows, in input order, into shards of at most shard_rows; returns the shard count."""
    pending, pending_rows, shard, offset = [], 0, 0, 0

    def flush():
        nonlocal pending, pending_rows, shard
        if pending:
            write_table_atomic(pa.Table.from_batches(pending, schema=PROMPTS), out_dir / f"prompts-{shard:05d}.parquet")
            shard += 1
            pending, pending_rows = [], 0

    for batch in iter_batches(shard_paths(tmp_dir, "pass1-"), batch_size=BATCH):
        mask = keep[offset: offset + batch.num_rows]
        offset += batch.num_rows
        chosen = batch.filter(pa.array(mask))
        while chosen.num_rows:
            take = min(chosen.num_rows, shard_rows - pending_rows)
            pending.append(chosen.slice(0, take))
            pending_rows += take
            chosen = chosen.slice(take)
            if pending_rows >= shard_rows:
                flush()
    flush()
    return shard

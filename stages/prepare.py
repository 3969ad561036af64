"""prepare: real prompt files in; clean, deduplicated, sampled prompts out (Parquet shards + stats.json + rejects).

Two streaming passes keep memory flat: pass 1 normalizes every record into temporary shards and keeps only a
16-byte digest and a source index per candidate; dedupe (first occurrence in source order wins) and sampling
(bottom-k of a seeded hash, so a sample stays stable when unrelated records are added) run on those arrays;
pass 2 copies the chosen rows into the output shards.
"""
from __future__ import annotations

import hashlib
import shutil
import sys
from array import array
from collections import Counter
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from drafter_data import chat_formats
from drafter_data.config import StageError, run_stage
from drafter_data.parquet_io import MESSAGE, PROMPTS, iter_batches, shard_paths, write_table_atomic
from drafter_data.record_reader import BadRecord, read_records
from drafter_data.tracking import stage_run

BATCH = 8192


def prompt_digest(messages: list[dict], tools: str | None) -> bytes:
    """The prompt's identity: a hash of its normalized messages (and tools, when it declares any)."""
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


class Accounts:
    """Per-source read/kept/dropped counts and the rejects file; read == kept + sum(dropped) by construction."""

    def __init__(self, names: list[str], rejects_path: Path):
        self.read = Counter()
        self.dropped = {name: Counter() for name in names}
        self._rejects = open(rejects_path, "wb")

    def drop(self, source: str, reason: str, n: int = 1) -> None:
        if n:
            self.dropped[source][reason] += n

    def reject(self, source: str, path: Path, line: int, index: int, reason: str, detail: str, raw: str | None) -> None:
        self.drop(source, reason)
        self._rejects.write(orjson.dumps({"source": source, "path": str(path), "line": line, "index": index,
                                          "reason": reason, "detail": detail, "record": raw}) + b"\n")

    def close(self) -> None:
        self._rejects.close()

    def stats(self) -> dict:
        out = {}
        for name, dropped in self.dropped.items():
            read = self.read[name]
            out[name] = {"read": read, "kept": read - sum(dropped.values()), "dropped": dict(sorted(dropped.items()))}
        return out


def _check_sources(sources) -> list[dict]:
    if not sources:
        raise StageError("no prompt sources configured: set prepare.sources (a list of {name, path, format})")
    checked, names = [], set()
    for i, src in enumerate(sources):
        if not src or not src.get("name") or not src.get("path"):
            raise StageError(f"prepare.sources[{i}] needs a name and a path, got {dict(src or {})}")
        if src["name"] in names:
            raise StageError(f"prepare.sources: the name {src['name']!r} is used twice")
        fmt = src.get("format") or "auto"
        if fmt not in chat_formats.FORMATS:
            raise StageError(f"prepare.sources[{i}].format {fmt!r} is not one of {', '.join(chat_formats.FORMATS)}")
        path = Path(src["path"])
        if not path.is_file():
            raise StageError(f"prompt file of source {src['name']!r} not found: {path.resolve()}")
        names.add(src["name"])
        fields = dict(src.get("fields") or {})
        checked.append({"name": src["name"], "path": path, "format": fmt, "quota": src.get("quota"), "fields": fields})
    return checked


def normalize_sources(sources: list[dict], cfg, tmp_dir: Path, acc: Accounts, token_counter=None):
    """Pass 1. Returns (digests as S16 array, source index per candidate) for the rows in tmp_dir, in order."""
    turns_mode = cfg.get("turns", "first")
    max_chars = cfg.get("max_prompt_chars")
    max_tokens = cfg.get("max_prompt_tokens")
    digests = bytearray()
    source_of = array("H")
    ids, srcs, tools_col, offsets, roles, contents = [], [], [], [0], [], []
    shard = 0

    def flush():
        nonlocal shard, ids, srcs, tools_col, offsets, roles, contents
        if ids:
            # built from flat columns: much faster than converting a list of lists of dicts
            messages = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.StructArray.from_arrays(
                [pa.array(roles, pa.string()), pa.array(contents, pa.string())], fields=list(MESSAGE)))
            table = pa.table([pa.array(ids, pa.string()), pa.array(srcs, pa.string()), messages,
                              pa.array(tools_col, pa.string())], schema=PROMPTS)
            pq.write_table(table, tmp_dir / f"pass1-{shard:05d}.parquet", compression="zstd")
            shard += 1
            ids, srcs, tools_col, offsets, roles, contents = [], [], [], [0], [], []

    for src_index, src in enumerate(sources):
        name, path, fmt = src["name"], src["path"], src["format"]
        for item in read_records(path):
            acc.read[name] += 1
            if isinstance(item, BadRecord):
                acc.reject(name, path, item.line, item.index, item.reason, item.detail, item.raw)
                continue
            line, index, record = item
            if src["fields"] and isinstance(record, dict):  # e.g. {prompt: query_text}: the file's own key names
                record = {**record, **{ours: record[theirs] for ours, theirs in src["fields"].items() if theirs in record}}
            try:
                turns = chat_formats.to_turns(record, fmt, first_only=turns_mode == "first")
                tools = chat_formats.tools_of(record)
            except chat_formats.Malformed as exc:
                acc.reject(name, path, line, index, exc.args[0], exc.args[1], _raw(record))
                continue
            reason = None
            messages = chat_formats.to_prompt(turns, turns_mode)
            if not turns:
                reason = "empty_conversation"
            elif not messages:
                reason = "no_user_turn"
            elif not messages[-1]["content"].strip():
                reason = "empty_prompt"
            elif max_chars and sum(len(m["content"]) for m in messages) > max_chars:
                reason = "too_long"
            if reason is None:
                try:
                    digest = prompt_digest(messages, tools)
                except orjson.JSONEncodeError:
                    acc.reject(name, path, line, index, "invalid_unicode", "lone surrogate in a text field", None)
                    continue
                if max_tokens and token_counter is not None and token_counter(messages) > max_tokens:
                    reason = "too_many_tokens"
            if reason is not None:
                acc.reject(name, path, line, index, reason, "", _raw(record))
                continue
            digests += digest
            source_of.append(src_index)
            ids.append(digest.hex())
            srcs.append(name)
            tools_col.append(tools)
            for m in messages:
                roles.append(m["role"])
                contents.append(m["content"])
            offsets.append(len(roles))
            if len(ids) >= BATCH:
                flush()
    flush()
    return np.frombuffer(bytes(digests), dtype="S16"), np.frombuffer(source_of.tobytes(), dtype=np.uint16)


def _raw(record) -> str:
    text = orjson.dumps(record, option=orjson.OPT_NON_STR_KEYS).decode() if record is not None else ""
    return text if len(text) <= 4096 else text[:4096] + f"... [{len(text) - 4096} more chars]"


def choose(digests: np.ndarray, source_of: np.ndarray, sources: list[dict], sample, seed: int, acc: Accounts):
    """Dedupe (first occurrence wins), per-source quotas, then a global sample; returns the keep mask."""
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
    """Pass 2: copy the kept rows, in input order, into shards of at most shard_rows."""
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


def print_summary(stats: dict, out_dir: Path, rejects: Path) -> None:
    print(f"{'source':<28}{'read':>10}{'kept':>10}  dropped", file=sys.stderr)
    for name, s in stats.items():
        dropped = ", ".join(f"{r}={n}" for r, n in s["dropped"].items() if n) or "-"
        print(f"{name:<28}{s['read']:>10}{s['kept']:>10}  {dropped}", file=sys.stderr)
    total_kept = sum(s["kept"] for s in stats.values())
    print(f"kept {total_kept} prompts in {out_dir}; rejected records listed in {rejects}", file=sys.stderr)


def main(cfg) -> int:
    pcfg = cfg.prepare
    sources = _check_sources(pcfg.sources)
    out_dir = Path(pcfg.output)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp_dir = out_dir / ".pass1"
    tmp_dir.mkdir(parents=True)
    rejects = out_dir / "rejects.jsonl"
    acc = Accounts([s["name"] for s in sources], rejects)
    token_counter = None
    if pcfg.get("max_prompt_tokens"):
        from drafter_data.prompt_length import prompt_token_counter

        token_counter = prompt_token_counter(cfg)
    try:
        digests, source_of = normalize_sources(sources, pcfg, tmp_dir, acc, token_counter)
        keep = choose(digests, source_of, sources, pcfg.get("sample"), int(pcfg.get("seed") or 0), acc)
        write_chosen(tmp_dir, keep, out_dir, int(pcfg.get("shard_rows") or 100000))
    finally:
        acc.close()
        shutil.rmtree(tmp_dir, ignore_errors=True)
    stats = acc.stats()
    (out_dir / "stats.json").write_bytes(orjson.dumps(stats, option=orjson.OPT_INDENT_2))
    print_summary(stats, out_dir, rejects)
    with stage_run("prepare", cfg) as run:
        metrics = {"kept": sum(s["kept"] for s in stats.values()), "read": sum(s["read"] for s in stats.values())}
        for name, s in stats.items():
            metrics[f"{name}.read"] = s["read"]
            metrics[f"{name}.kept"] = s["kept"]
            metrics.update({f"{name}.dropped.{r}": n for r, n in s["dropped"].items()})
        run.metrics(metrics)
        run.artifact(out_dir / "stats.json")
    return 0


if __name__ == "__main__":
    run_stage(main)

"""prepare: real prompt files in; clean, deduplicated, sampled prompts out (Parquet shards + stats.json + rejects).

Two streaming passes keep memory flat: pass 1 normalizes every record into temporary shards and keeps only a
16-byte digest and a source index per candidate; dedupe (first occurrence in source order wins) and sampling
(bottom-k of a seeded hash, so a sample stays stable when unrelated records are added) run on those arrays;
pass 2 copies the chosen rows into the output shards. Pass 1 runs in `prepare.workers` processes over line ranges
of about `prepare.split_mb` of each large JSONL file (a JSON list is read by one), merged back in source order.
"""
from __future__ import annotations

import hashlib
import shutil
import sys
from collections import Counter
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from omegaconf import OmegaConf

from drafter_data import chat_formats
from drafter_data.config import StageError, run_stage
from drafter_data.parquet_io import MESSAGE, PROMPTS, iter_batches, shard_paths, write_table_atomic
from drafter_data.record_reader import BadRecord, is_json_list, line_ranges, read_records
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


def plan_units(sources: list[dict], split_bytes: int) -> list[dict]:
    """Pass 1's units of work, in source order: a JSON list is one unit, a large JSONL file several line ranges."""
    units = []
    for src_index, src in enumerate(sources):
        ranges = [(0, None)] if is_json_list(src["path"]) else line_ranges(src["path"], split_bytes)
        for start, end in ranges:
            units.append({"unit": len(units), "source_index": src_index, **src, "path": str(src["path"]),
                          "start": start, "end": end})
    return units


_token_counter = {}


def normalize_unit(unit: dict, pcfg: dict, tmp_dir: str, cfg_for_tokens: dict | None) -> dict:
    """Pass 1 over one unit: normalized candidates into tmp_dir shards (named to sort in unit order), rejects into a
    part file with lines and indexes relative to the unit's start; returns the digests and the unit's counts."""
    turns_mode = pcfg.get("turns", "first")
    max_chars = pcfg.get("max_prompt_chars")
    max_tokens = pcfg.get("max_prompt_tokens")
    if max_tokens and "counter" not in _token_counter:
        from omegaconf import OmegaConf

        from drafter_data.prompt_length import prompt_token_counter

        _token_counter["counter"] = prompt_token_counter(OmegaConf.create(cfg_for_tokens))
    token_counter = _token_counter.get("counter")
    name, path, fmt, fields, n = unit["name"], Path(unit["path"]), unit["format"], unit["fields"], unit["unit"]
    tmp = Path(tmp_dir)
    digests = bytearray()
    dropped: Counter = Counter()
    read = 0
    ids, tools_col, offsets, roles, contents = [], [], [0], [], []
    shard = 0
    rejects = open(tmp / f"rejects-{n:05d}.jsonl", "wb")

    def reject(line, index, reason, detail, raw):
        dropped[reason] += 1
        rejects.write(orjson.dumps({"source": name, "path": str(path), "line": line, "index": index,
                                    "reason": reason, "detail": detail, "record": raw}) + b"\n")

    def flush():
        nonlocal shard, ids, tools_col, offsets, roles, contents
        if ids:
            # built from flat columns: much faster than converting a list of lists of dicts
            messages = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.StructArray.from_arrays(
                [pa.array(roles, pa.string()), pa.array(contents, pa.string())], fields=list(MESSAGE)))
            table = pa.table([pa.array(ids, pa.string()), pa.array([name] * len(ids), pa.string()), messages,
                              pa.array(tools_col, pa.string())], schema=PROMPTS)
            pq.write_table(table, tmp / f"pass1-{n:05d}-{shard:05d}.parquet", compression="zstd")
            shard += 1
            ids, tools_col, offsets, roles, contents = [], [], [0], [], []

    reader_stats: dict = {}
    with rejects:
        for item in read_records(path, unit["start"], unit["end"], reader_stats):
            read += 1
            if isinstance(item, BadRecord):
                reject(item.line, item.index, item.reason, item.detail, item.raw)
                continue
            line, index, record = item
            if fields and isinstance(record, dict):  # e.g. {prompt: query_text}: the file's own key names
                record = {**record, **{ours: record[theirs] for ours, theirs in fields.items() if theirs in record}}
            try:
                turns = chat_formats.to_turns(record, fmt, first_only=turns_mode == "first")
                tools = chat_formats.tools_of(record)
            except chat_formats.Malformed as exc:
                reject(line, index, exc.args[0], exc.args[1], _raw(record))
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
                    reject(line, index, "invalid_unicode", "lone surrogate in a text field", None)
                    continue
                if max_tokens and token_counter(messages) > max_tokens:
                    reason = "too_many_tokens"
            if reason is not None:
                reject(line, index, reason, "", _raw(record))
                continue
            digests += digest
            ids.append(digest.hex())
            tools_col.append(tools)
            for m in messages:
                roles.append(m["role"])
                contents.append(m["content"])
            offsets.append(len(roles))
            if len(ids) >= BATCH:
                flush()
        flush()
    return {"unit": n, "digests": bytes(digests), "read": read, "dropped": dropped,
            "lines": reader_stats.get("lines", 0), "records": reader_stats.get("records", 0)}


def normalize_sources(sources: list[dict], cfg, tmp_dir: Path, acc: Accounts):
    """Pass 1 over every source, in `prepare.workers` processes when there is more than one unit of work.
    Returns (digests as S16 array, source index per candidate) for the rows in tmp_dir, in source order."""
    pcfg = cfg.prepare
    units = plan_units(sources, max(1, int(float(pcfg.get("split_mb") or 64) * 2**20)))
    plain = OmegaConf.to_container(pcfg, resolve=True)
    cfg_for_tokens = OmegaConf.to_container(cfg, resolve=True) if pcfg.get("max_prompt_tokens") else None
    args = [(u, plain, str(tmp_dir), cfg_for_tokens) for u in units]
    workers = min(int(pcfg.get("workers") or 1), len(units))
    if workers > 1:
        with get_context("spawn").Pool(workers) as pool:
            results = pool.starmap(normalize_unit, args, chunksize=1)
    else:
        results = [normalize_unit(*a) for a in args]
    digests, source_of = [], []
    line_offset, index_offset = Counter(), Counter()
    for unit, result in zip(units, results):
        name = unit["name"]
        acc.read[name] += result["read"]
        for reason, count in result["dropped"].items():
            acc.drop(name, reason, count)
        part = tmp_dir / f"rejects-{unit['unit']:05d}.jsonl"
        for line in part.read_bytes().splitlines():  # lines and indexes were counted from the unit's start
            entry = orjson.loads(line)
            entry["line"] += line_offset[name]
            entry["index"] += index_offset[name]
            acc.write_reject(entry)
        line_offset[name] += result["lines"]
        index_offset[name] += result["records"]
        digests.append(result["digests"])
        source_of.append(np.full(len(result["digests"]) // 16, unit["source_index"], dtype=np.uint16))
    return (np.frombuffer(b"".join(digests), dtype="S16"),
            np.concatenate(source_of) if source_of else np.zeros(0, dtype=np.uint16))


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
    try:
        digests, source_of = normalize_sources(sources, cfg, tmp_dir, acc)
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

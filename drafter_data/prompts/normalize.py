"""Pass 1 of prepare: every record of every source normalized into the contract's messages, written to temporary
shards, with only a 16-byte digest per candidate kept in memory.

The work is cut into units (a JSON list is one unit, a large JSONL file several line ranges) that run in
`prepare.workers` spawned processes; their results are merged back in source order, with reject lines and indexes
made relative to the whole file again.
"""
from __future__ import annotations

from collections import Counter
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
from omegaconf import OmegaConf

from drafter_data.contract import MESSAGE, PROMPTS
from drafter_data.errors import StageError
from drafter_data.prompts.accounts import Accounts
from drafter_data.prompts.candidate import SHAREGPT_FORMATS, normalize_record, plain_first_turn, plain_prompt_digest
from drafter_data.prompts.columns import int32_array, repeated_string, string_array
from drafter_data.prompts.malformed import Malformed
from drafter_data.prompts.items import BadRecord, raw_text
from drafter_data.prompts.records import DEFAULT_MAX_RECORD_BYTES, is_json_list, line_ranges, read_records
from drafter_data.prompts.selection import BATCH, write_pass1_shard

FLUSH_CHARS = 8 << 20  # a unit's buffered prompt text is written out at this size (or every BATCH rows)
IN_PROCESS_MAX_BYTES = 64 << 20  # from this input size on, pass 1 always runs in worker processes
_token_counter = {}  # per worker process: the target's tokenizer, loaded once when max_prompt_tokens is set


def plan_units(sources: list[dict], split_bytes: int, max_record_bytes: int) -> list[dict]:
    """Pass 1's units of work, in source order: a JSON list is one unit, a large JSONL file several line ranges."""
    units = []
    for src_index, src in enumerate(sources):
        json_list = is_json_list(src["path"], max_record_bytes)
        ranges = [(0, None)] if json_list else line_ranges(src["path"], split_bytes)
        for start, end in ranges:
            units.append({"unit": len(units), "source_index": src_index, **src, "path": str(src["path"]),
                          "start": start, "end": end})
    return units


def normalize_sources(sources: list[dict], cfg, tmp_dir: Path, acc: Accounts) -> tuple[np.ndarray, np.ndarray]:
    """Pass 1 over every source. Returns (digests as an S16 array, source index per candidate) for the rows written
    to tmp_dir, in source order; counts and rejects go to acc."""
    pcfg = cfg.prepare
    units = plan_units(sources, max(1, int(float(pcfg.get("split_mb") or 64) * 2**20)), max_record_bytes(pcfg))
    plain = OmegaConf.to_container(pcfg, resolve=True)
    target = OmegaConf.to_container(cfg.target, resolve=True) if pcfg.get("max_prompt_tokens") else None
    args = [(u, plain, str(tmp_dir), target) for u in units]
    workers = int(pcfg.get("workers") or 1)
    # a large input is read in a worker process even when it is one unit (a JSON list): the main process then has a
    # core for MLflow's warm-up instead of taking turns with it
    big = sum(Path(s["path"]).stat().st_size for s in sources) >= IN_PROCESS_MAX_BYTES
    if workers > 1 and (len(units) > 1 or big):
        with get_context("spawn").Pool(min(workers, len(units))) as pool:
            results = pool.starmap(normalize_unit, args, chunksize=1)
    else:
        results = [normalize_unit(*a) for a in args]
    return _merge(units, results, tmp_dir, acc)


def _merge(units: list[dict], results: list[dict], tmp_dir: Path, acc: Accounts) -> tuple[np.ndarray, np.ndarray]:
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


def max_record_bytes(pcfg) -> int:
    return int(pcfg.get("max_record_bytes") or DEFAULT_MAX_RECORD_BYTES)


def normalize_unit(unit: dict, pcfg: dict, tmp_dir: str, target: dict | None) -> dict:
    """Pass 1 over one unit (runs in a worker): candidates into tmp_dir shards named to sort in unit order, rejects
    into a part file with lines and indexes relative to the unit's start. Returns the digests and the counts."""
    out = UnitOutput(unit, Path(tmp_dir))
    counter = _prompt_token_counter(target) if pcfg.get("max_prompt_tokens") else None
    reader_stats: dict = {}
    plain = (pcfg.get("turns") or "first") == "first" and unit["format"] in SHAREGPT_FORMATS and not unit["fields"]
    max_chars, max_tokens = pcfg.get("max_prompt_chars"), pcfg.get("max_prompt_tokens")
    records = read_records(Path(unit["path"]), unit["start"], unit["end"], reader_stats, max_record_bytes(pcfg))
    with out:
        for item in records:
            if type(item) is BadRecord:
                out.reject(item.line, item.index, item.reason, item.detail, item.raw)
                continue
            line, index, record, raw = item
            try:
                text = plain_first_turn(record) if plain else None
                if text is not None:  # the common case, without building what the general path needs
                    out.add_user_prompt(plain_prompt_digest(text, max_chars, counter, max_tokens), text)
                else:
                    out.add(*normalize_record(record, raw, unit, pcfg, counter))
            except Malformed as exc:
                out.reject(line, index, exc.args[0], exc.args[1], raw_text(raw.rstrip(b"\r\n")))
            except StageError:
                raise
            except Exception as exc:  # noqa: BLE001 - a record must never stop the run; counted and listed
                out.reject(line, index, "unexpected_error", f"{type(exc).__name__}: {exc}",
                           raw_text(raw.rstrip(b"\r\n")))
    read = reader_stats.get("records", 0)  # every record the reader yielded, good or not
    if read != len(out.digests) // 16 + sum(out.dropped.values()):  # kept is derived from read: it must add up
        raise StageError(f"{unit['path']}: {read} records read but {len(out.digests) // 16} kept and "
                         f"{sum(out.dropped.values())} rejected (a bug in prepare; please report it)")
    return {"unit": unit["unit"], "digests": bytes(out.digests), "read": read, "dropped": out.dropped,
            "lines": reader_stats.get("lines", 0), "records": read}


class UnitOutput:
    """One unit's candidates (buffered as flat Arrow columns, flushed every BATCH rows or FLUSH_CHARS of text) and
    rejects."""

    def __init__(self, unit: dict, tmp: Path):
        self.name, self.path, self.n, self.tmp = unit["name"], unit["path"], unit["unit"], tmp
        self.digests = bytearray()
        self.dropped: Counter = Counter()
        self.shard = 0
        self._reset()
        self._rejects = open(tmp / f"rejects-{self.n:05d}.jsonl", "wb")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.flush()
        self._rejects.close()

    def _reset(self) -> None:
        self.tools, self.extras, self.turns = [], [], []
        self.offsets, self.roles, self.contents, self.chars = [0], [], [], 0

    def reject(self, line: int, index: int, reason: str, detail: str, raw: str) -> None:
        self.dropped[reason] += 1
        entry = {"source": self.name, "path": str(self.path), "line": line, "index": index, "reason": reason,
                 "detail": detail, "record": raw}
        try:
            self._rejects.write(orjson.dumps(entry) + b"\n")
        except orjson.JSONEncodeError:  # a detail quoting text that is not valid Unicode: escape it
            safe = {k: v.encode("utf-8", "backslashreplace").decode() if isinstance(v, str) else v
                    for k, v in entry.items()}
            self._rejects.write(orjson.dumps(safe) + b"\n")

    def add(self, digest: bytes, messages: list[dict], tools: str | None, extras: str | None, turns: int) -> None:
        self.digests += digest
        self.tools.append(tools)
        self.extras.append(extras)
        self.turns.append(turns)
        for m in messages:
            self.roles.append(m["role"])
            self.contents.append(m["content"])
            self.chars += len(m["content"])
        self.offsets.append(len(self.roles))
        if len(self.tools) >= BATCH or self.chars >= FLUSH_CHARS:
            self.flush()

    def add_user_prompt(self, digest: bytes, text: str) -> None:
        """add(digest, [{"role": "user", "content": text}], None, None, 1), quicker."""
        self.digests += digest
        self.tools.append(None)
        self.extras.append(None)
        self.turns.append(1)
        self.roles.append("user")
        self.contents.append(text)
        self.chars += len(text)
        self.offsets.append(len(self.roles))
        if len(self.tools) >= BATCH or self.chars >= FLUSH_CHARS:
            self.flush()

    def flush(self) -> None:
        n = len(self.tools)
        if not n:
            return
        ids = self.digests[len(self.digests) - 16 * n:].hex()
        id_offsets = np.arange(0, 32 * (n + 1), 32, dtype=np.int32)
        # built from flat columns and buffers: much faster than converting a list of lists of dicts
        messages = pa.ListArray.from_arrays(int32_array(self.offsets), pa.StructArray.from_arrays(
            [string_array(self.roles), string_array(self.contents)], fields=list(MESSAGE)))
        table = pa.Table.from_arrays([
            pa.StringArray.from_buffers(n, pa.py_buffer(id_offsets), pa.py_buffer(ids.encode("ascii"))),
            repeated_string(self.name, n), messages, string_array(self.tools), string_array(self.extras),
            int32_array(self.turns)], schema=PROMPTS)
        write_pass1_shard(table, self.tmp / f"pass1-{self.n:05d}-{self.shard:05d}.arrow")
        self.shard += 1
        self._reset()


def _prompt_token_counter(target: dict):
    """The target's prompt length in tokens, loaded once per worker process. Counted with thinking on: the
    generation prompt the target is asked with (its length differs between modes by a token at most)."""
    if "counter" not in _token_counter:
        from drafter_data.tokens.chat_template import chat_template_kwargs
        from drafter_data.tokens.conversation import prompt_token_counter

        kwargs = chat_template_kwargs(target["thinking_kwarg"], True, target.get("template_kwargs"))
        _token_counter["counter"] = prompt_token_counter(OmegaConf.create(target), kwargs)
    return _token_counter["counter"]

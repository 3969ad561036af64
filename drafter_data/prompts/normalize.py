"""Pass 1 of prepare: every record of every source normalized into the contract's messages, written to temporary
shards, with only a 16-byte digest per candidate kept in memory.

The work is cut into units (a JSON list is one unit, a large JSONL file several line ranges) that run in
`prepare.workers` worker processes (forked where the platform allows); their results are merged back in source
order, with reject lines and indexes made relative to the whole file again.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
from omegaconf import OmegaConf

from drafter_data.contract import MESSAGE, PROMPTS
from drafter_data.errors import StageError
from drafter_data.prompts.accounts import Accounts
from drafter_data.prompts.candidate import (PLAIN_DIGEST_TAIL, SHAREGPT_FORMATS, normalize_record,
                                            plain_digest_hasher, plain_first_turn, plain_prompt_digest)
from drafter_data.arrow_columns import repeated_string, string_array
from drafter_data.prompts.malformed import Malformed
from drafter_data.prompts.items import BadRecord, parse_error, raw_text
from drafter_data.prompts.records import (DEFAULT_MAX_RECORD_BYTES, is_json_list, jsonl_blocks, line_ranges,
                                          open_source, read_records)
from drafter_data.prompts.selection import BATCH, write_pass1_shard
from drafter_data.worker_processes import worker_processes

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
                          "start": start, "end": end, "jsonl": not json_list})
    return units


def pass1_units(sources: list[dict], pcfg) -> list[dict]:
    return plan_units(sources, max(1, int(float(pcfg.get("split_mb") or 64) * 2**20)), max_record_bytes(pcfg))


@contextmanager
def pass1_pool(sources: list[dict], units: list[dict], pcfg):
    """The worker processes of pass 1 (see worker_processes; enter it before any thread of the stage starts), or
    None where it runs in this process. A large input is read in a worker even when it is one unit (a JSON list):
    this process then has a core for MLflow's warm-up instead of taking turns with it."""
    workers = int(pcfg.get("workers") or 1)
    big = sum(Path(s["path"]).stat().st_size for s in sources) >= IN_PROCESS_MAX_BYTES
    if workers <= 1 or (len(units) <= 1 and not big):
        yield None
        return
    with worker_processes(min(workers, len(units))) as pool:
        yield pool


def normalize_sources(units: list[dict], pool, cfg, tmp_dir: Path, acc: Accounts) -> tuple[np.ndarray, np.ndarray]:
    """Pass 1 over every unit (pass1_units), in `pool` (pass1_pool) or here. Returns (digests as an S16 array, source
    index per candidate) for the rows written to tmp_dir, in source order; counts and rejects go to acc."""
    pcfg = cfg.prepare
    plain = OmegaConf.to_container(pcfg, resolve=True)
    target = OmegaConf.to_container(cfg.target, resolve=True) if pcfg.get("max_prompt_tokens") else None
    args = [(u, plain, str(tmp_dir), target) for u in units]
    if pool is not None:
        results = list(pool.map(normalize_unit, *zip(*args)))
        pool.shutdown()  # the workers' part is done
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
    into a part file with lines and indexes relative to the unit's start. Returns the digests and the counts.

    A JSONL range is read a block of lines at a time and its plainest records (see candidate.plain_first_turn) are
    turned into rows inline; every other line goes through the same per-record steps as a JSON list's elements
    (prepare.fast_path=false reads every unit that way: same rows, rejects and counts, only slower)."""
    out = UnitOutput(unit, Path(tmp_dir))
    counter = _prompt_token_counter(target) if pcfg.get("max_prompt_tokens") else None
    handle = RecordHandler(unit, pcfg, out, counter)
    with out:
        if pcfg.get("fast_path", True) and unit["jsonl"]:
            lines, read = _fast_jsonl(unit, pcfg, out, handle)
        else:
            reader_stats: dict = {}
            for item in read_records(Path(unit["path"]), unit["start"], unit["end"], reader_stats,
                                     max_record_bytes(pcfg)):
                handle(item)
                out.maybe_flush()
            lines, read = reader_stats.get("lines", 0), reader_stats.get("records", 0)
    kept = len(out.digests) // 16
    if read != kept + sum(out.dropped.values()):  # kept is derived from read: it must add up
        raise StageError(f"{unit['path']}: {read} records read but {kept} kept and {sum(out.dropped.values())} "
                         f"rejected (a bug in prepare; please report it)")
    return {"unit": unit["unit"], "digests": bytes(out.digests), "read": read, "dropped": out.dropped,
            "lines": lines, "records": read}


class RecordHandler:
    """The per-record path: one item of a reader (a parsed record, or a BadRecord) into a candidate row or a reject."""

    def __init__(self, unit: dict, pcfg: dict, out: "UnitOutput", counter):
        self.unit, self.pcfg, self.out, self.counter = unit, pcfg, out, counter
        self.plain = (pcfg.get("turns") or "first") == "first" and unit["format"] in SHAREGPT_FORMATS \
            and not unit["fields"]
        self.max_chars, self.max_tokens = pcfg.get("max_prompt_chars"), pcfg.get("max_prompt_tokens")

    def __call__(self, item) -> None:
        out = self.out
        if type(item) is BadRecord:
            out.reject(item.line, item.index, item.reason, item.detail, item.raw)
            return
        line, index, record, raw = item
        try:
            text = plain_first_turn(record) if self.plain else None
            if text is not None:  # the common case, without building what the general path needs
                out.add_user_prompt(plain_prompt_digest(text, self.max_chars, self.counter, self.max_tokens), text)
            else:
                out.add(*normalize_record(record, raw, self.unit, self.pcfg, self.counter))
        except Malformed as exc:
            out.reject(line, index, exc.args[0], exc.args[1], raw_text(raw.rstrip(b"\r\n")))
        except StageError:
            raise
        except Exception as exc:  # noqa: BLE001 - a record must never stop the run; counted and listed
            out.reject(line, index, "unexpected_error", f"{type(exc).__name__}: {exc}", raw_text(raw.rstrip(b"\r\n")))


def _fast_jsonl(unit: dict, pcfg: dict, out: "UnitOutput", handle: RecordHandler) -> tuple[int, int]:
    """A JSONL range, a block of lines at a time (records.jsonl_blocks). A line whose record is the plainest case
    (candidate.plain_first_turn; with prepare.max_prompt_tokens unset) becomes its row right here: the digest and row
    that plain_prompt_digest and add_user_prompt give. Any other line is handed, as the item jsonl_records would yield
    for it (same line, index and bytes), to the per-record path. Returns (lines, records) read."""
    loads, dumps, decode_error = orjson.loads, orjson.dumps, orjson.JSONDecodeError
    plain = handle.plain and handle.counter is None
    max_chars = handle.max_chars or 0
    first_turn = plain_first_turn
    copy_hasher = plain_digest_hasher().copy
    tail = PLAIN_DIGEST_TAIL
    digests, contents = out.digests, out.contents
    line_no = index = 0
    with open_source(Path(unit["path"])) as fh:
        fh.seek(unit["start"])
        length = None if unit["end"] is None else unit["end"] - unit["start"]
        for block, end in jsonl_blocks(fh, length, max_record_bytes(pcfg)):
            if block is None:  # a line read alone (at a BOM, too long for a block, without a line break at the end)
                line_no += 1
                if end is not None:  # the item
                    index += 1
                    if type(end) is BadRecord:
                        end.line, end.index = line_no, index
                        handle(end)
                    else:
                        handle((line_no, index, end[2], end[3]))
                    out.maybe_flush()
                continue
            view, find = memoryview(block), block.find
            pos, chars = 0, 0
            while pos < end:
                cut = find(b"\n", pos) + 1
                line = view[pos:cut]  # with its line break, as jsonl_records reads it
                pos = cut
                line_no += 1
                try:
                    record = loads(line)
                except decode_error as exc:
                    raw = bytes(line)
                    if not raw.strip():
                        continue
                    index += 1
                    reason, detail = parse_error(raw, exc)
                    handle(BadRecord(line_no, index, reason, detail, raw_text(raw.rstrip(b"\r\n"))))
                    continue
                index += 1
                text = first_turn(record) if plain else None
                if text and not text.isspace() and not (max_chars and len(text) > max_chars):
                    h = copy_hasher()  # plain_prompt_digest(text, ...)
                    h.update(dumps(text))
                    h.update(tail)
                    digests += h.digest()
                    contents.append(text)
                    chars += len(text)
                    continue
                handle((line_no, index, record, bytes(line)))
            out.chars += chars
            out.maybe_flush()
    return line_no, index


class UnitOutput:
    """One unit's candidates and rejects. Rows are buffered as their digests (16 bytes a row, kept for the whole unit)
    and their messages' contents; a row that is not one plain user message also keeps its roles, tools, extras and
    turns aside. The buffer becomes an Arrow batch (maybe_flush: from BATCH rows or FLUSH_CHARS of text on) built
    column by column, the plain rows' columns without a step per row."""

    def __init__(self, unit: dict, tmp: Path):
        self.name, self.path, self.n, self.tmp = unit["name"], unit["path"], unit["unit"], tmp
        self.digests = bytearray()
        self.contents: list[str] = []  # cleared in place: the fast path holds on to it
        self.general: list[tuple] = []  # (row in the batch, roles, tools, extras, turns)
        self.batch_start = 0  # where the batch's digests start in self.digests
        self.chars = 0
        self.dropped: Counter = Counter()
        self.shard = 0
        self._rejects = open(tmp / f"rejects-{self.n:05d}.jsonl", "wb")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.flush()
        self._rejects.close()

    def rows(self) -> int:
        return (len(self.digests) - self.batch_start) >> 4

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
        self.general.append((self.rows(), [m["role"] for m in messages], tools, extras, turns))
        self.digests += digest
        for m in messages:
            self.contents.append(m["content"])
            self.chars += len(m["content"])

    def add_user_prompt(self, digest: bytes, text: str) -> None:
        """add(digest, [{"role": "user", "content": text}], None, None, 1), quicker."""
        self.digests += digest
        self.contents.append(text)
        self.chars += len(text)

    def maybe_flush(self) -> None:
        if self.rows() >= BATCH or self.chars >= FLUSH_CHARS:
            self.flush()

    def flush(self) -> None:
        n = self.rows()
        if not n:
            return
        ids = self.digests[self.batch_start:].hex()
        id_offsets = np.arange(0, 32 * (n + 1), 32, dtype=np.int32)
        turns = np.ones(n, dtype=np.int32)
        if self.general:
            counts = np.ones(n, dtype=np.int32)
            tools, extras = [None] * n, [None] * n
            for row, roles, tools[row], extras[row], turns[row] in self.general:
                counts[row] = len(roles)
            offsets = np.zeros(n + 1, dtype=np.int32)
            np.cumsum(counts, out=offsets[1:])
            roles = _roles_column(self.general, offsets, len(self.contents))
            tools, extras = string_array(tools), string_array(extras)
        else:  # one user message a row: every column but the contents follows from n
            offsets = np.arange(n + 1, dtype=np.int32)
            roles = repeated_string("user", n)
            tools = extras = pa.nulls(n, pa.string())
        # built from flat columns and buffers: much faster than converting a list of lists of dicts
        messages = pa.ListArray.from_arrays(_int32(offsets), pa.StructArray.from_arrays(
            [roles, string_array(self.contents)], fields=list(MESSAGE)))
        table = pa.Table.from_arrays([
            pa.StringArray.from_buffers(n, pa.py_buffer(id_offsets), pa.py_buffer(ids.encode("ascii"))),
            repeated_string(self.name, n), messages, tools, extras, _int32(turns)], schema=PROMPTS)
        write_pass1_shard(table, self.tmp / f"pass1-{self.n:05d}-{self.shard:05d}.arrow")
        self.shard += 1
        self.contents.clear()
        self.general.clear()
        self.batch_start, self.chars = len(self.digests), 0


_ROLES = ("user", "system", "assistant", "tool")
_ROLE_CODES = {role: code for code, role in enumerate(_ROLES)}


def _int32(values: np.ndarray) -> pa.Array:
    return pa.Array.from_buffers(pa.int32(), len(values), [None, pa.py_buffer(values)])


def _roles_column(general: list[tuple], offsets: np.ndarray, total: int) -> pa.Array:
    """The messages' roles: "user", but where the general rows say otherwise."""
    if any(role not in _ROLE_CODES for _, roles, *_ in general for role in roles):  # not from normalize_record
        names = ["user"] * total
        for row, roles, *_ in general:
            names[offsets[row]: offsets[row] + len(roles)] = roles
        return string_array(names)
    codes = np.zeros(total, dtype=np.int8)
    for row, roles, *_ in general:
        codes[offsets[row]: offsets[row] + len(roles)] = [_ROLE_CODES[role] for role in roles]
    return string_array(list(_ROLES)).take(pa.Array.from_buffers(pa.int8(), total, [None, pa.py_buffer(codes)]))


def _prompt_token_counter(target: dict):
    """The target's prompt length in tokens, loaded once per worker process. Counted with thinking on: the
    generation prompt the target is asked with (its length differs between modes by a token at most)."""
    if "counter" not in _token_counter:
        from drafter_data.tokens.chat_template import chat_template_kwargs
        from drafter_data.tokens.conversation import prompt_token_counter

        kwargs = chat_template_kwargs(target["thinking_kwarg"], True, target.get("template_kwargs"))
        _token_counter["counter"] = prompt_token_counter(OmegaConf.create(target), kwargs)
    return _token_counter["counter"]

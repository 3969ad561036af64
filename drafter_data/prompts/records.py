"""Streams raw records out of prompt files, one at a time, with where each came from: JSONL, or JSON lists (one or
several, possibly followed by JSONL lines).

A record that cannot be read is yielded as a `BadRecord` (line, index, reason) instead of raising, so one broken line
never stops a multi-million-record run; no record is ever held beyond `max_record_bytes`. A file that cannot be
opened raises `StageError` naming the file.

Which container a file is: JSONL, unless its first non-blank line starts with `[` and is not itself a complete JSON
value followed by more lines (a JSONL file whose first record is an array stays JSONL).
"""
from __future__ import annotations

from pathlib import Path
from typing import BinaryIO, Iterator

import orjson

from drafter_data.errors import StageError
from drafter_data.prompts.items import BOM, BadRecord, Item, parse_error, raw_text, too_large
from drafter_data.prompts.jsonlist import read_lists

DEFAULT_MAX_RECORD_BYTES = 16 << 20
_SKIP_CHUNK = 1 << 20
_MAX_BLANK_LINES_SNIFFED = 10_000
BLOCK_BYTES = 1 << 20  # what jsonl_blocks reads at a time


def open_source(path: Path) -> BinaryIO:
    try:
        return open(path, "rb", buffering=_SKIP_CHUNK)  # large reads: fewer system calls than the default 8 KiB
    except OSError as exc:
        raise StageError(f"cannot open prompt file {path}: {exc.strerror}") from exc


def is_json_list(path: Path, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> bool:
    with open_source(path) as fh:
        return _sniff_json_list(fh, max_record_bytes)


def _sniff_json_list(fh: BinaryIO, max_record_bytes: int) -> bool:
    first = fh.readline(max_record_bytes + 1)
    if first.startswith(BOM):
        first = first[len(BOM):]
    for _ in range(_MAX_BLANK_LINES_SNIFFED):
        if first.strip() or not first:
            break
        first = fh.readline(max_record_bytes + 1)
    if not first.lstrip().startswith(b"["):
        return False
    if len(first) > max_record_bytes or not first.endswith(b"\n"):
        return True  # a whole file on one line, or a first line too long to be one record
    try:
        orjson.loads(first)
    except orjson.JSONDecodeError:
        return True  # `[` opens a list that goes on over the next lines
    return not _more_content(fh)  # a one-line list is the whole file; with more lines, it is JSONL


def _more_content(fh: BinaryIO) -> bool:
    while chunk := fh.read(_SKIP_CHUNK):
        if chunk.strip():
            return True
    return False


def line_ranges(path: Path, split_bytes: int) -> list[tuple[int, int | None]]:
    """A JSONL file cut into byte ranges of about split_bytes that start at line starts (for parallel reading)."""
    size = path.stat().st_size
    bounds = [0]
    with open_source(path) as fh:
        while bounds[-1] + split_bytes < size:
            fh.seek(bounds[-1] + split_bytes)
            _skip_line(fh)
            if fh.tell() >= size:
                break
            bounds.append(fh.tell())
    return [(a, b) for a, b in zip(bounds, bounds[1:])] + [(bounds[-1], None)]


def _skip_line(fh: BinaryIO) -> int:
    """Reads to the end of the current line without holding it; returns the bytes skipped."""
    skipped = 0
    while chunk := fh.readline(_SKIP_CHUNK):
        skipped += len(chunk)
        if chunk.endswith(b"\n"):
            break
    return skipped


def read_records(path: Path, start: int = 0, end: int | None = None, stats: dict | None = None,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Iterator[Item]:
    """Yields (line, index, record, raw) or BadRecord. Lines and indexes count from 1 (from `start`, for a JSONL
    range). `stats`, if given, receives the number of lines and records read."""
    stats = stats if stats is not None else {}
    with open_source(path) as fh:
        if start == 0 and end is None and _sniff_json_list(fh, max_record_bytes):
            fh.seek(0)
            tail = yield from read_lists(fh, max_record_bytes, stats)
            if tail is None:
                return
            offset, line, index = tail  # content after the last list's `]`: read as JSONL from there
            fh.seek(offset)
            yield from jsonl_records(fh, None, max_record_bytes, stats, line - 1, index)
        else:
            fh.seek(start)
            yield from jsonl_records(fh, None if end is None else end - start, max_record_bytes, stats)


def jsonl_blocks(fh: BinaryIO, length: int | None, max_record_bytes: int,
                 block_bytes: int | None = None) -> Iterator[tuple]:
    """The lines jsonl_records reads (same range, same lines), a block at a time, unparsed: yields (block, end) where
    block[:end] is whole lines, each ending with a line break. A line that is not wholly inside a block read (longer
    than a block, the range's last line without a line break) and the file's first line when it starts with a BOM
    are read by jsonl_records itself, alone: yielded as (None, its item), with line and index 1 (the caller numbers
    lines and records), or (None, None) when the line is blank. No line inside a block is too large: a block is at
    most max_record_bytes long."""
    block_bytes = max(1, min(block_bytes or BLOCK_BYTES, max_record_bytes))
    pos = fh.tell()
    end = None if length is None else pos + length
    while end is None or pos < end:
        want = block_bytes if end is None else min(block_bytes, end - pos)
        buf = fh.read(want)
        if not buf:
            break
        cut = buf.rfind(b"\n") + 1
        if not cut or (pos == 0 and buf.startswith(BOM)):
            fh.seek(pos)  # one line, read as jsonl_records reads it (skipped without being held when too large)
            items = list(jsonl_records(fh, 1, max_record_bytes, {}))
            pos = fh.tell()
            yield None, items[0] if items else None
            continue
        yield buf, cut
        pos += cut
        if cut < len(buf):
            fh.seek(pos)  # the cut line is read again, whole, with the next block


def jsonl_records(fh: BinaryIO, length: int | None, max_record_bytes: int, stats: dict, line_no: int = 0,
                  index: int = 0) -> Iterator[Item]:
    """One record per line from fh's position, for `length` bytes (None: to the end); blank lines are skipped.
    A UTF-8 BOM is dropped from the file's first line; a line over max_record_bytes is skipped without being held."""
    loads, readline, decode_error = orjson.loads, fh.readline, orjson.JSONDecodeError
    remaining = float("inf") if length is None else length
    at_file_start = fh.tell() == 0
    limit = max_record_bytes + 1
    while remaining > 0:
        raw = readline(limit)
        if not raw:
            break
        remaining -= len(raw)
        line_no += 1
        if at_file_start:
            at_file_start = False
            raw = raw.removeprefix(BOM)
        if len(raw) == limit and raw[-1] != 10:  # over the limit: skip the rest of the line, never hold it
            index += 1
            skipped = _skip_line(fh)
            remaining -= skipped
            yield too_large(line_no, index, raw, len(raw) + skipped, max_record_bytes)
            continue
        try:
            record = loads(raw)
        except decode_error as exc:
            if not raw.strip():
                continue
            index += 1
            reason, detail = parse_error(raw, exc)
            yield BadRecord(line_no, index, reason, detail, raw_text(raw.rstrip(b"\r\n")))
            continue
        index += 1
        yield line_no, index, record, raw
    stats["lines"], stats["records"] = line_no, index

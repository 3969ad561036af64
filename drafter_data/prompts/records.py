"""Streams raw records out of prompt files (JSONL, or one JSON list), one at a time, with where each came from.

A record that cannot be parsed is yielded as a `BadRecord` (with line and reason) instead of raising, so one broken
line never stops a multi-million-record run. A file that cannot be opened raises `StageError` naming the file.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import orjson

from drafter_data.errors import StageError

_READ_CHUNK = 1 << 20


@dataclass(slots=True)
class BadRecord:
    line: int
    index: int
    reason: str
    detail: str
    raw: str


RAW_LIMIT = 4096  # characters of a rejected record kept in the rejects file


def clip(text: str, limit: int = RAW_LIMIT) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more chars]"


def _raw_text(raw: bytes) -> str:
    return clip(raw.decode("utf-8", errors="backslashreplace"))


def _parse_error(raw: bytes, exc: Exception) -> tuple[str, str]:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return "invalid_utf8", f"invalid UTF-8 at byte {err.start}"
    if "surrogate" in str(exc):
        return "invalid_unicode", str(exc)
    return "invalid_json", str(exc)


def is_json_list(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")
    except OSError as exc:
        raise StageError(f"cannot open prompt file {path}: {exc.strerror}") from exc


def line_ranges(path: Path, split_bytes: int) -> list[tuple[int, int | None]]:
    """A JSONL file cut into byte ranges of about split_bytes that start at line starts (for parallel reading)."""
    size = path.stat().st_size
    bounds = [0]
    with open(path, "rb") as fh:
        while bounds[-1] + split_bytes < size:
            fh.seek(bounds[-1] + split_bytes)
            fh.readline()
            if fh.tell() >= size:
                break
            bounds.append(fh.tell())
    return [(a, b) for a, b in zip(bounds, bounds[1:])] + [(bounds[-1], None)]


def read_records(path: Path, start: int = 0, end: int | None = None,
                 stats: dict | None = None) -> Iterator[tuple[int, int, object] | BadRecord]:
    """Yields (line, index, record) or BadRecord. Lines and indexes count from 1 (from `start`, for a JSONL range).
    `stats`, if given, receives the number of lines and records read."""
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise StageError(f"cannot open prompt file {path}: {exc.strerror}") from exc
    with fh:
        if start == 0 and end is None and is_json_list(path):
            yield from _json_list_records(fh, path)
        else:
            fh.seek(start)
            yield from _jsonl_records(fh, end, stats if stats is not None else {})


def _jsonl_records(fh, end: int | None, stats: dict) -> Iterator[tuple[int, int, object] | BadRecord]:
    index = line_no = 0
    loads = orjson.loads
    lines = fh if end is None else _lines_until(fh, end)
    for line_no, raw in enumerate(lines, 1):
        stats["lines"], stats["records"] = line_no, index
        if not raw.strip():
            continue
        index += 1
        stats["records"] = index
        try:
            yield line_no, index, loads(raw)
        except orjson.JSONDecodeError as exc:
            reason, detail = _parse_error(raw, exc)
            yield BadRecord(line_no, index, reason, detail, _raw_text(raw.rstrip(b"\r\n")))


def _lines_until(fh, end: int):
    while fh.tell() < end:
        line = fh.readline()
        if not line:
            return
        yield line


def _json_list_records(fh, path: Path) -> Iterator[tuple[int, int, object] | BadRecord]:
    """Incremental parse of `[rec, rec, ...]` so a multi-GB list never sits in memory at once.

    Bytes are decoded with surrogateescape: invalid UTF-8 inside one element rejects that element only.
    """
    decoder = json.JSONDecoder()
    buf = ""
    pos = 0
    line = 1
    index = 0
    eof = False
    started = False

    def fill() -> bool:
        nonlocal buf, pos, eof
        chunk = fh.read(_READ_CHUNK)
        if not chunk:
            eof = True
            return False
        buf = buf[pos:] + chunk.decode("utf-8", errors="surrogateescape")
        pos = 0
        return True

    def skip(chars: str) -> None:
        nonlocal pos, line
        while True:
            start = pos
            n = len(buf)
            while pos < n and buf[pos] in chars:
                pos += 1
            line += buf.count("\n", start, pos)
            if pos < n or eof or not fill():
                return

    fill()
    skip("\ufeff \t\r\n")
    if not buf.startswith("[", pos):
        raise StageError(f"{path}: expected a JSON list")
    pos += 1
    while True:
        skip(" \t\r\n")
        if pos >= len(buf):
            raise StageError(f"{path}: the JSON list ends without ']' (truncated file?) at line {line}")
        if buf[pos] == "]":
            return
        if started:
            if buf[pos] != ",":
                yield _rest_of_list(buf, pos, fh, line, index + 1, "expected ',' between list elements")
                return
            pos += 1
            skip(" \t\r\n")
        started = True
        index += 1
        while True:
            try:
                record, end = decoder.raw_decode(buf, pos)
                break
            except json.JSONDecodeError as exc:
                # An element cut by the chunk boundary: read more and try again; a real error only at EOF.
                if not eof and fill():
                    continue
                yield _rest_of_list(buf, pos, fh, line, index, f"invalid JSON: {exc.msg}")
                return
        element_line = line
        line += buf.count("\n", pos, end)
        text = buf[pos:end]
        pos = end
        if _has_surrogates(text):
            raw = text.encode("utf-8", errors="surrogateescape")
            yield BadRecord(element_line, index, "invalid_utf8", "invalid UTF-8 bytes in this element", _raw_text(raw))
            continue
        yield element_line, index, record


def _has_surrogates(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _rest_of_list(buf: str, pos: int, fh, line: int, index: int, reason: str) -> BadRecord:
    """After a syntax error the rest of a JSON list cannot be split reliably: it is set aside as one reject."""
    rest = buf[pos:] + fh.read().decode("utf-8", errors="surrogateescape")
    raw = rest.encode("utf-8", errors="surrogateescape")
    return BadRecord(line, index, "invalid_json", f"{reason}; the rest of the list ({len(raw)} bytes) is set aside",
                     _raw_text(raw))

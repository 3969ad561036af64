"""The elements of the JSON lists in a file, read with bounded memory and without trusting the file's syntax.

Elements are delimited by bracket matching over the bytes (strings skipped whole, each bracket checked against the
one it closes), then parsed one at a time with orjson. So:
- an element that does not parse is rejected alone, and the next one is read;
- after a syntax error that bracket matching cannot place (a bracket that closes the wrong thing, something other than
  ',' or ']' after an element) the reader resynchronises at the next element start: the next place where an element
  opens the way earlier elements opened (e.g. `{"id"`, indentation inside the brace included), confirmed by a good
  element there. Everything in between is one reject;
- an element over max_record_bytes is scanned to its end without being held, and rejected as too_large;
- a list cut short is a `truncated` reject, wherever the cut (at an element boundary: an empty one);
- after a list's `]` a further list is read the same way; other content is handed back to be read as JSONL.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import BinaryIO, Generator, Iterator

import orjson

from drafter_data.prompts.items import BOM, RAW_LIMIT, BadRecord, Item, parse_error, raw_text, too_large

_BLOCK = 1 << 20
_HEAD = RAW_LIMIT * 4  # bytes of a rejected element kept for the rejects file
_WS = re.compile(rb"[ \t\r\n]*")
# runs of bytes that are neither brackets nor quotes, and whole strings (possessive: no backtracking state is kept)
_SKIP = re.compile(rb'(?:[^"\[\]{}]++|"[^"\\]*+(?:\\.[^"\\]*+)*+")*+', re.S)
_STRING_REST = re.compile(rb'[^"\\]*+(?:\\.[^"\\]*+)*+', re.S)
_SCALAR = re.compile(rb'[^\s,\[\]{}"]*')
_OPENING = re.compile(rb'\{\s*"(?:[^"\\\n]|\\.){0,64}"', re.S)  # an object's start up to its first key
# where an element may start when no opening was learnt: an object at a line start (lists written one element per
# line or indented), or any object (a list on one line)
_OBJECT_AT_LINE_START = re.compile(rb"\n[ \t]*\{")
_ANY_OBJECT = re.compile(rb"\{")
_PAIR = {ord("]"): ord("["), ord("}"): ord("{")}
_COMMA, _OPEN_LIST, _CLOSE_LIST = b",", b"[", b"]"
_MAX_SIGNATURES = 8
_LEARN_FROM = 1000  # the first elements, whose openings are learnt as resynchronisation points
TRUNCATED = "the JSON list ends without ']' (the file is cut short?)"


@dataclass(slots=True)
class Element:
    outcome: str  # ok | too_large | truncated (the file ends inside it) | mismatch (a bracket closes the wrong thing)
    start: int  # file offset
    line: int
    data: bytes  # the element (ok), or its head
    size: int
    line_start: bool = True  # only blanks between the line start and the element


@dataclass(slots=True)
class Region:
    """Bytes set aside after a syntax error, up to the next element start: one reject."""
    start: int
    line: int
    head: bytes
    why: str
    line_start: bool


class Scanner:
    """A window over the file: `buf` holds the bytes from file offset `base`; `pos` is where reading is."""

    def __init__(self, fh: BinaryIO, max_record_bytes: int):
        self.fh, self.cap = fh, max_record_bytes
        self.buf, self.base, self.pos, self.eof = b"", 0, 0, False
        self._lpos, self._lno = 0, 1  # the line number at buf position _lpos
        self.signatures: list[bytes] = []
        self._signature_re: re.Pattern | None = None
        self.learnt = 0

    def line_at(self, p: int) -> int:
        """The line of buf position p (positions are asked in increasing order)."""
        if p > self._lpos:
            self._lno += self.buf.count(b"\n", self._lpos, p)
            self._lpos = p
        return self._lno

    def fill(self, keep_from: int) -> bool:
        """Drops the bytes before keep_from (a buf position), reads the next block; False at the end of the file."""
        if self.eof:
            return False
        self.line_at(keep_from)
        chunk = self.fh.read(max(_BLOCK, len(self.buf) - keep_from))  # grows with what is kept: no quadratic copy
        self.buf = self.buf[keep_from:] + chunk
        self.base += keep_from
        self.pos -= keep_from
        self._lpos -= keep_from
        self.eof = not chunk
        return bool(chunk)

    def peek(self) -> bytes:
        """The next byte that is not whitespace (pos moved to it), b"" at the end of the file."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos: self.pos + 1]
            if not self.fill(self.pos):
                return b""

    def element(self) -> Element:
        """Scans the element at pos to its end (pos left after it, or on the offending bracket)."""
        start_abs, line = self.base + self.pos, self.line_at(self.pos)
        first = self.buf[self.pos]
        if first not in b'[{"':
            return self._scalar(start_abs, line)
        line_start = self._at_line_start(self.pos)
        stack, in_string, head = bytearray(), first == 34, None
        if not in_string:
            stack.append(first)
        self.pos += 1
        while stack or in_string:
            buf, pos = self.buf, self.pos
            if in_string:
                pos = _STRING_REST.match(buf, pos).end()
                in_string = pos == len(buf) or buf[pos] != 34
                need_more = in_string
                pos += not in_string
            else:
                pos = _SKIP.match(buf, pos).end()
                need_more = pos == len(buf)
                if not need_more:
                    c = buf[pos]
                    if c == 34:
                        in_string = True
                    elif c in b"[{":
                        stack.append(c)
                    elif stack.pop() != _PAIR[c]:
                        self.pos = pos
                        held = head or buf[start_abs - self.base: pos][:_HEAD]
                        return Element("mismatch", start_abs, line, held, 0, line_start)
                    pos += 1
            self.pos = pos
            if need_more:
                if head is None and self.base + pos - start_abs > self.cap:
                    head = buf[start_abs - self.base:][:_HEAD]  # over the limit: only scanned from here on
                keep = start_abs - self.base if head is None else min(pos, len(buf) - 1)
                if not self.fill(keep):
                    data = head if head is not None else self.buf[start_abs - self.base:]
                    return Element("truncated", start_abs, line, data, self.base + len(self.buf) - start_abs)
        el = self._finished(start_abs, line, head)
        el.line_start = line_start
        return el

    def _at_line_start(self, p: int) -> bool:
        before = self.buf[max(0, p - 256): p].rstrip(b" \t")
        return not before or before.endswith(b"\n")

    def _finished(self, start_abs: int, line: int, head: bytes | None) -> Element:
        size = self.base + self.pos - start_abs
        if head is not None or size > self.cap:
            return Element("too_large", start_abs, line, head or self.buf[self.pos - size:][:_HEAD], size)
        return Element("ok", start_abs, line, self.buf[self.pos - size: self.pos], size)

    def _scalar(self, start_abs: int, line: int) -> Element:
        """A number, true/false/null or stray text: up to the next delimiter; a stray '}' is a mismatch."""
        head = None
        while True:
            self.pos = _SCALAR.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                break
            if head is None and self.base + self.pos - start_abs > self.cap:
                head = self.buf[start_abs - self.base:][:_HEAD]
            if not self.fill(start_abs - self.base if head is None else self.pos):
                break
        if self.base + self.pos == start_abs:
            return Element("mismatch", start_abs, line, b"", 0)
        return self._finished(start_abs, line, head)

    def learn(self, element: bytes) -> None:
        """Remembers how a good element opens (`{` up to its first key), as a place to resynchronise at."""
        self.learnt += 1
        if self.learnt > _LEARN_FROM or len(self.signatures) >= _MAX_SIGNATURES:
            return
        m = _OPENING.match(element)
        if m and m.group() not in self.signatures:
            self.signatures.append(m.group())
            self._signature_re = re.compile(b"|".join(re.escape(s) for s in self.signatures))

    def resync(self, from_abs: int, line_start: bool) -> bool:
        """Moves pos to the next place at or after from_abs where an element may start: where an element opens the
        way learnt ones did, else an object (at a line start if the lost element was); False at the end of file."""
        pattern = self._signature_re or (_OBJECT_AT_LINE_START if line_start else _ANY_OBJECT)
        overlap = max((len(s) for s in self.signatures), default=258) - 1
        pos = max(from_abs - self.base, 0)
        while True:
            m = pattern.search(self.buf, pos)
            if m:
                self.pos = m.start()
                return True
            pos = max(pos, len(self.buf) - overlap)
            self.pos = pos
            if not self.fill(pos):
                self.pos = len(self.buf)
                return False
            pos = self.pos


def read_lists(fh: BinaryIO, max_record_bytes: int, stats: dict) -> Generator[Item, None, tuple | None]:
    """Yields the records of the JSON lists at the start of fh; returns (offset, line, index) where other content
    follows the last list's `]`, or None at the end of the file."""
    scanner = Scanner(fh, max_record_bytes)
    scanner.fill(0)
    if scanner.buf.startswith(BOM):
        scanner.pos = len(BOM)
    reader, tail, lists = _ListBody(scanner), None, 0
    while first := scanner.peek():
        if first == _OPEN_LIST:
            scanner.pos += 1
        elif lists and first in b",]}":  # that `]` was not the list's end: reading had lost its place
            if not (yield from reader.stray_bytes("an element start")):
                break
        else:
            tail = scanner.base + scanner.pos, scanner.line_at(scanner.pos), reader.index
            break
        yield from reader.elements()
        lists += 1
    stats["lines"], stats["records"] = scanner.line_at(len(scanner.buf)), reader.index
    return tail


class _ListBody:
    """Reads a list's elements after its `[` up to its `]` (consumed) or the end of the file, counting records in
    `index` across the file's lists."""

    def __init__(self, sc: Scanner):
        self.sc, self.index = sc, 0
        self.region: Region | None = None  # bytes being set aside after a syntax error

    def elements(self) -> Iterator[Item]:
        sc = self.sc
        while True:
            first = sc.peek()
            if first in (b"", _CLOSE_LIST):
                if self.region is not None:
                    yield self._region_reject(sc.base + sc.pos, "up to the end of the list")
                elif not first:
                    yield BadRecord(sc.line_at(sc.pos), self._next(), "truncated", TRUNCATED, "")
                sc.pos += first == _CLOSE_LIST
                return
            el = sc.element()
            record, error = _parse(el) if el.outcome == "ok" else (None, None)
            sep = sc.peek() if el.outcome in ("ok", "too_large") else None
            delimited = sep in (_COMMA, _CLOSE_LIST, b"")
            after_region = self.region is not None
            if after_region:  # after a syntax error, only a good element ends what is set aside
                if delimited and error is None and el.outcome in ("ok", "too_large"):
                    yield self._region_reject(el.start, f"up to the next element (line {el.line})")
                elif not (yield from self._resync(el.start + 1, el.outcome == "truncated")):
                    return
                else:
                    continue
            if el.outcome == "mismatch" or (not delimited and error is not None):
                if not self.sc.signatures:
                    self.sc.learn(el.data)  # the first element shows how elements open, even when broken
                held = sc.buf[el.start - sc.base:][:_HEAD] if el.start >= sc.base else el.data
                self.region = Region(el.start, el.line, held, _why(sc, el), el.line_start)
                if not (yield from self._resync(sc.base + sc.pos + (el.outcome != "mismatch"))):
                    return
                continue
            if el.outcome == "truncated":
                yield BadRecord(el.line, self._next(), "truncated", f"{TRUNCATED}: inside this element",
                                raw_text(el.data, el.size))
                return
            yield self._item(el, record, error, learn=not after_region)  # a place found by guessing: not a model
            if not delimited:
                if not (yield from self.stray_bytes(f"',' or ']' after the element at line {el.line}", el.line_start)):
                    return
            sc.pos += sep == _COMMA

    def _item(self, el: Element, record, error, learn: bool) -> Item:
        index = self._next()
        if el.outcome == "too_large":
            return too_large(el.line, index, el.data, el.size, self.sc.cap)
        if error is not None:
            return BadRecord(el.line, index, *error, raw_text(el.data))
        if learn:
            self.sc.learn(el.data)
        return el.line, index, record, el.data

    def stray_bytes(self, expected: str, line_start: bool = True) -> Generator[Item, None, bool]:
        """Sets aside the bytes at pos (where `expected` should be) up to the next element start."""
        sc = self.sc
        self.region = Region(sc.base + sc.pos, sc.line_at(sc.pos), sc.buf[sc.pos: sc.pos + _HEAD],
                             f"expected {expected}", line_start)
        return (yield from self._resync(self.region.start + 1))

    def _resync(self, from_abs: int, at_end: bool = False) -> Generator[Item, None, bool]:
        """Moves to the next element start; False (the region reported) when the file ends first."""
        if not at_end and self.sc.resync(from_abs, self.region.line_start):
            return True
        yield self._region_reject(self.sc.base + len(self.sc.buf), "to the end of the file")
        return False

    def _region_reject(self, end: int, upto: str) -> BadRecord:
        region, self.region = self.region, None
        size = end - region.start
        return BadRecord(region.line, self._next(), "invalid_json", f"{region.why}; {size} bytes set aside {upto}",
                         raw_text(region.head[:size], size))

    def _next(self) -> int:
        self.index += 1
        return self.index


def _parse(el: Element) -> tuple[object, tuple[str, str] | None]:
    try:
        return orjson.loads(el.data), None
    except orjson.JSONDecodeError as exc:
        return None, parse_error(el.data, exc)


def _why(sc: Scanner, el: Element) -> str:
    if el.outcome == "mismatch":
        return f"a bracket closes the wrong thing at line {sc.line_at(sc.pos)}"
    return f"invalid JSON, and no ',' or ']' after it at line {sc.line_at(sc.pos)}"

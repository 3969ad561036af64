"""What the prompt-file readers yield: a record with where it came from, or a BadRecord saying why it could not be
read; and how a rejected record is quoted in the rejects file."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

BOM = b"\xef\xbb\xbf"
RAW_LIMIT = 4096  # characters of a rejected record kept in the rejects file


@dataclass(slots=True)
class BadRecord:
    line: int
    index: int
    reason: str
    detail: str
    raw: str


# (line, index, parsed record, the record's bytes), or a BadRecord
Item = Union[tuple[int, int, object, bytes], BadRecord]


def clip(text: str, limit: int = RAW_LIMIT) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more chars]"


def raw_text(raw: bytes, total: int | None = None) -> str:
    """A record's bytes for the rejects file: clipped, invalid UTF-8 shown as escapes; `total` when only a head was
    kept."""
    text = clip(raw[: RAW_LIMIT * 4].decode("utf-8", errors="backslashreplace"))
    if total is not None and total > len(raw):
        text += f"... [{total} bytes in all]"
    return text


def parse_error(raw: bytes, exc: Exception) -> tuple[str, str]:
    """(reason, detail) for bytes orjson could not parse."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return "invalid_utf8", f"invalid UTF-8 at byte {err.start}"
    message = str(exc)
    if "surrogate" in message:
        return "invalid_unicode", message
    return "invalid_json", message


def too_large(line: int, index: int, head: bytes, size: int, max_record_bytes: int) -> BadRecord:
    return BadRecord(line, index, "too_large", f"the record has {size} bytes, over prepare.max_record_bytes="
                     f"{max_record_bytes}", raw_text(head, size))

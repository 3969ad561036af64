"""Request keys: a completion's identity, as 16-byte digests kept in compact numpy arrays (millions of prompts cost
16 bytes each, not a Python object each).

Turn 0 of a prompt is keyed by its prompt_id (the content hash of its messages and tools) and everything else that
determines the answer (RequestSpec.identity). Turn k > 0 is keyed by the key of turn k-1 and the answer the target
gave there, so a resumed run never redoes a finished turn and never builds turn k on a different turn k-1.
"""
from __future__ import annotations

import binascii
import hashlib

import numpy as np
import orjson
import pyarrow as pa

CHUNK = 1 << 20  # keys looked up at a time
KEY_DTYPE = "S16"  # compares and sorts as raw bytes; read a key out as arr[i:i+1].tobytes() (an item drops
# trailing zero bytes)


def request_keys(prompt_ids: list[str], identity: bytes) -> bytes:
    """The turn-0 key of each prompt, concatenated (one tight loop: it runs over every input prompt at each start)."""
    suffix, blake2b = b"\0" + identity, hashlib.blake2b
    return b"".join([blake2b(pid.encode() + suffix, digest_size=16).digest() for pid in prompt_ids])


def turn_key(parent: bytes, turn: int, answer: dict, keep_reasoning: bool) -> bytes:
    """The key of turn `turn`, which continues the conversation after `answer` (the previous turn's reasoning,
    content and tool calls as the target gave them), sent back with or without its reasoning."""
    payload = orjson.dumps([turn, answer.get("reasoning"), answer.get("content"), answer.get("tool_calls"),
                            keep_reasoning])
    return hashlib.blake2b(parent + b"\1" + payload, digest_size=16).digest()


def thinking_share(prompt_id: str, seed: int) -> float:
    """A seeded, machine-independent number in [0, 1) per prompt: prompts below generation.thinking_ratio think."""
    digest = hashlib.blake2b(f"thinking\0{seed}\0{prompt_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def hex_column(values) -> np.ndarray:
    """A column of 32-character hex keys (None where absent) as an S16 array (absent: 16 zero bytes)."""
    values = list(values)
    joined = b"".join((v.encode() if v else b"0" * 32) for v in values)
    return np.frombuffer(binascii.unhexlify(joined), dtype=KEY_DTYPE) if values else np.zeros(0, KEY_DTYPE)


def hex_keys(column: pa.ChunkedArray) -> np.ndarray:
    """hex_column of an Arrow string column, straight from its buffers when every value is a 32-character key."""
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if array.null_count == 0 and pa.types.is_string(array.type) and len(array):
        offsets = np.frombuffer(array.buffers()[1], dtype=np.int32)[array.offset: array.offset + len(array) + 1]
        if (np.diff(offsets) == 32).all():
            data = np.frombuffer(array.buffers()[2], dtype=np.uint8)[offsets[0]: offsets[-1]]
            return np.frombuffer(binascii.unhexlify(data.tobytes()), dtype=KEY_DTYPE)
    return hex_column(column.to_pylist())


def _halves(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A key array as two native uint64 arrays (its first and last 8 bytes, big-endian: the same order as the
    bytes). numpy sorts and searches these many times faster than 16-byte strings."""
    pairs = np.ascontiguousarray(keys).view(">u8").reshape(-1, 2)
    return pairs[:, 0].astype(np.uint64), pairs[:, 1].astype(np.uint64)


def _distinct(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the index of the first occurrence of each distinct key, in key order; those keys' halves, sorted)."""
    if not len(keys):
        return np.zeros(0, dtype=np.intp), np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    hi, lo = _halves(keys)
    order = np.argsort(hi)
    hi = hi[order]
    # first halves are 64 random bits, so equal ones are nearly always copies of one key: only those few are sorted
    # again, by whole key and then position (the first copy wins)
    tied = np.flatnonzero(hi[1:] == hi[:-1])
    if len(tied):
        span = np.union1d(tied, tied + 1)
        group = order[span]
        order[span] = group[np.lexsort((group, lo[group], hi[span]))]
    lo = lo[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])
    return order[first], hi[first], lo[first]


def first_of_each(keys: np.ndarray) -> np.ndarray:
    """The index of the first occurrence of each distinct key, in key order."""
    return _distinct(keys)[0]


class KeySet:
    """A set of keys as its sorted, unique halves (binary search, vectorized): 16 bytes per key."""

    def __init__(self, keys: np.ndarray | None = None):
        keys = np.zeros(0, KEY_DTYPE) if keys is None else keys
        _, self._hi, self._lo = _distinct(keys)

    @classmethod
    def of_distinct(cls, keys: np.ndarray, first: np.ndarray) -> KeySet:
        """The set of keys[first], where `first` is first_of_each(keys) (or a subset of it, in its order): sorts
        nothing again."""
        s = cls.__new__(cls)
        s._hi, s._lo = _halves(keys[first])
        return s

    def __len__(self) -> int:
        return len(self._hi)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        found = np.zeros(len(keys), dtype=bool)
        if len(self._hi):
            for start in range(0, len(keys), CHUNK):  # bounded temporaries, however many keys are asked about
                found[start: start + CHUNK] = self._contains(keys[start: start + CHUNK])
        return found

    def _contains(self, keys: np.ndarray) -> np.ndarray:
        found = np.zeros(len(keys), dtype=bool)
        hi, lo = _halves(keys)
        n = len(self._hi)
        order = np.argsort(hi)  # needles in order: the binary search then runs near memory speed
        pos = np.empty(len(keys), dtype=np.intp)
        pos[order] = np.searchsorted(self._hi, hi[order])
        del order
        todo = np.arange(len(keys))
        while len(todo):  # more than one pass only where first halves are equal and the second ones differ
            at = np.minimum(pos[todo], n - 1)
            same_hi = (pos[todo] < n) & (self._hi[at] == hi[todo])
            match = same_hi & (self._lo[at] == lo[todo])
            found[todo[match]] = True
            todo = todo[same_hi & ~match]
            pos[todo] += 1
        return found

    def __contains__(self, key: bytes) -> bool:
        return bool(self.contains(np.array([key], dtype=KEY_DTYPE))[0])

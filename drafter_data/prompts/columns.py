"""Arrow columns built from Python lists through their buffers.

`pa.array(list)` makes pyarrow import pandas (when installed: it asks whether the list is a DataFrame), about 0.5 s
of CPU in every pass-1 worker, and converts element by element; building the buffers directly needs neither.
"""
from __future__ import annotations


import numpy as np
import pyarrow as pa


def string_array(values: list) -> pa.Array:
    """Strings, None for null."""
    n = len(values)
    present = [v for v in values if v is not None]
    if not present:
        return pa.nulls(n, pa.string())
    if len(present) == n and all(map(str.isascii, present)):  # the usual case: one join, lengths as they are
        data, lengths = "".join(present).encode("ascii"), np.fromiter(map(len, present), np.int64, n)
    else:
        encoded = [v.encode() for v in present]
        data, lengths = b"".join(encoded), np.fromiter(map(len, encoded), np.int64, len(encoded))
    if data and len(data) >= 2**31:
        raise ValueError("a batch of more than 2 GiB of text")  # flushes happen long before that
    offsets = np.zeros(n + 1, np.int32)
    if len(present) == n:
        np.cumsum(lengths, out=offsets[1:])
        return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data))
    valid = np.fromiter((v is not None for v in values), np.bool_, n)
    full = np.zeros(n, np.int64)
    full[valid] = lengths
    np.cumsum(full, out=offsets[1:])
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data), bitmap, n - len(present))


def repeated_string(value: str, n: int) -> pa.Array:
    data = value.encode()
    offsets = np.arange(0, len(data) * (n + 1), len(data) or 1, dtype=np.int32)[: n + 1] if data else \
        np.zeros(n + 1, np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data * n))

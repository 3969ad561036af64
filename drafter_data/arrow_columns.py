"""Arrow columns built through their buffers, for prepare's and tokenize's worker processes.

`pa.array(...)` on a list or a numpy array makes pyarrow import pandas (when installed: it asks whether the values
are a DataFrame), about 0.3-0.5 s of CPU in a process that has not imported it yet (a worker forked before its stage
imported pandas, or a spawned one), and converts a list element by element; building the buffers directly needs
neither.
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


NUMPY_TYPES = {pa.int8(): np.int8, pa.int32(): np.int32, pa.int64(): np.int64}


def numpy_array(values: np.ndarray, type_: pa.DataType) -> pa.Array:
    """A 1-d numpy array as an Arrow array of an integer type (zero-copy where the dtype is already that type)."""
    values = np.ascontiguousarray(values, dtype=NUMPY_TYPES[type_])
    _one_dimension(values)
    return pa.Array.from_buffers(type_, len(values), [None, pa.py_buffer(values)])


def bool_array(mask: np.ndarray) -> pa.Array:
    """A 1-d numpy bool array as an Arrow boolean array (a bitmap)."""
    _one_dimension(mask)
    return pa.Array.from_buffers(pa.bool_(), len(mask), [None, pa.py_buffer(np.packbits(mask, bitorder="little"))])


def _one_dimension(values: np.ndarray) -> None:
    # from_buffers takes a length and a buffer: a 2-d array would silently become its first rows' worth of values
    if values.ndim != 1:
        raise ValueError(f"a column needs a 1-d array, not one of shape {values.shape}")


def repeated_string(value: str, n: int) -> pa.Array:
    data = value.encode()
    offsets = np.arange(0, len(data) * (n + 1), len(data) or 1, dtype=np.int32)[: n + 1] if data else \
        np.zeros(n + 1, np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data * n))

"""Completions found twice: one (prompt_id, turn) must never become two training rows.

Generate keeps one copy of each request, but an input made otherwise (a shard copied by hand, a generate killed while
compacting on an older release) may hold two. Copies that are identical in every column are read once (the first, in
shard order); two rows for one (prompt_id, turn) that differ are two answers to one request, and tokenize refuses
them: which one the target "said" is not ours to guess.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from drafter_data.arrow_columns import numpy_array
from drafter_data.errors import StageError

Skips = dict[str, np.ndarray]  # shard path -> sorted row numbers (within the file) not to read


def repeated_rows(paths: list[Path], input_key: str = "tokenize.input") -> Skips:
    """The later copies of rows found more than once, per shard; StageError when two copies differ. Reads the
    prompt_id and turn columns of every shard (all columns only of the few repeated rows). Compute kernels and
    numpy only: pa.array would import pandas before tokenize forks its workers (arrow_columns)."""
    keys, files, rows = [], [], []
    for n, path in enumerate(paths):
        file = pq.ParquetFile(path)
        turn = ["turn"] if "turn" in file.schema_arrow.names else []
        table = file.read(columns=["prompt_id", *turn], use_threads=False)
        turns = pc.cast(table.column("turn").fill_null(0), pa.string()) if turn else "0"
        keys.append(pc.binary_join_element_wise(table.column("prompt_id"), turns, "\0"))
        files.append(np.full(table.num_rows, n, np.int64))
        rows.append(np.arange(table.num_rows, dtype=np.int64))
    if not keys:
        return {}
    keys = pa.chunked_array([k.combine_chunks() if isinstance(k, pa.ChunkedArray) else k for k in keys])
    counts = pc.value_counts(keys)
    twice = counts.field("values").filter(pc.greater(counts.field("counts"), 1))
    if not len(twice):
        return {}
    at = np.flatnonzero(pc.is_in(keys, value_set=twice).to_numpy(zero_copy_only=False))
    files, rows = np.concatenate(files)[at], np.concatenate(rows)[at]
    names = keys.take(numpy_array(at, pa.int64())).to_pylist()
    records = _records(paths, files, rows)
    skips: dict[str, list[int]] = {}
    first: dict[str, dict] = {}
    for name, n, row, record in zip(names, files, rows, records):  # in shard order: the first copy is kept
        if name not in first:
            first[name] = record
            continue
        if record != first[name]:
            prompt_id, turn = name.split("\0")
            raise StageError(f"{input_key} holds two different completions for prompt {prompt_id} turn {turn} "
                             f"(one in {paths[n].name}): two answers to one request; run generate on it again, "
                             f"which keeps the first copy of each request, or remove one")
        skips.setdefault(str(paths[n]), []).append(int(row))
    return {path: np.array(sorted(found), dtype=np.int64) for path, found in skips.items()}


def _records(paths: list[Path], files: np.ndarray, rows: np.ndarray) -> list[dict]:
    """Every column of the rows (file, row) lists, in its order."""
    out: list[dict | None] = [None] * len(rows)
    for n in np.unique(files):
        at = np.flatnonzero(files == n)
        table = pq.ParquetFile(paths[n]).read(use_threads=False).take(numpy_array(rows[at], pa.int64()))
        for i, record in zip(at, table.to_pylist()):
            out[i] = record
    return out


def kept_mask(skip: np.ndarray | None, start: int, length: int) -> np.ndarray | None:
    """Rows start..start+length of a shard that are read (None: all of them)."""
    if skip is None or not len(skip):
        return None
    inside = skip[(skip >= start) & (skip < start + length)] - start
    if not len(inside):
        return None
    keep = np.ones(length, dtype=bool)
    keep[inside] = False
    return keep

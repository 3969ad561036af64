"""For tokenize.rows=conversation: the turns of one conversation may sit in any completions shards (generate writes
them as they finish). One streaming pass writes every row into one of N partition files by a hash of its prompt_id,
so each partition holds whole conversations and is tokenized on its own, in memory about 1/N of the input."""
from __future__ import annotations

import zlib
from math import ceil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from drafter_data.contract import iter_batches
from drafter_data.tokens.columns import COLUMNS, INPUT_SCHEMA, conform
from drafter_data.tokens.duplicates import kept_mask

MAX_PARTITIONS = 512  # files open at once while partitioning


def partition_count(paths: list[Path], rows_per_partition: int) -> int:
    total = sum(pq.ParquetFile(p).metadata.num_rows for p in paths)
    return max(1, min(MAX_PARTITIONS, ceil(total / max(1, rows_per_partition))))


def partition_by_conversation(paths: list[Path], work_dir: Path, rows_per_partition: int,
                              skips: dict | None = None) -> list[Path]:
    """Every row of `paths` (less the later copies `skips` lists per shard: duplicates.repeated_rows) into
    work_dir/part-NNNNN.parquet by crc32(prompt_id); returns the non-empty ones."""
    parts = partition_count(paths, rows_per_partition)
    work_dir.mkdir(parents=True)
    writers: dict[int, pq.ParquetWriter] = {}
    try:
        for path in paths:
            columns = [c for c in COLUMNS if c in pq.ParquetFile(path).schema_arrow.names]
            start = 0
            for batch in iter_batches([path], columns=columns):
                keep = kept_mask((skips or {}).get(str(path)), start, batch.num_rows)
                start += batch.num_rows
                batch = conform(batch if keep is None else batch.filter(pa.array(keep)))
                keys = np.fromiter((zlib.crc32(pid.encode()) % parts for pid in batch.column("prompt_id").to_pylist()),
                                   dtype=np.int64, count=batch.num_rows)
                for part in np.unique(keys):
                    if int(part) not in writers:
                        writers[int(part)] = pq.ParquetWriter(work_dir / f"part-{int(part):05d}.parquet", INPUT_SCHEMA)
                    writers[int(part)].write_batch(batch.filter(pa.array(keys == part)))
    finally:
        for writer in writers.values():
            writer.close()
    return [work_dir / f"part-{part:05d}.parquet" for part in sorted(writers)]

"""Runs a stage with a fault injected at a boundary the stage does not control (the disk, MLflow), for tests:

    python -m tests.inject FAULT -- stages.generate override ...

FAULT is one of
  disk_full_while=<path>   every Parquet write fails with ENOSPC while <path> exists (the test creates/removes it)
  mlflow_slow=<seconds>    every MLflow metrics batch takes that long (a slow or locked tracking store)
  mlflow_fails             every MLflow metrics batch fails ("database is locked")
  compact_slow=<seconds>   generate's compaction of its shards takes that long longer (a slow disk)
The stage then runs exactly as `python -m <stage>` would (same argv, __main__).
"""
from __future__ import annotations

import errno
import os
import runpy
import sys
import time


def disk_full_while(path: str) -> None:
    import pyarrow.parquet as pq

    real = pq.write_table

    def write_table(*args, **kwargs):
        if os.path.exists(path):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(*args, **kwargs)

    pq.write_table = write_table


def mlflow_slow(seconds: str) -> None:
    from mlflow.tracking import MlflowClient

    real = MlflowClient.log_batch

    def log_batch(self, *args, **kwargs):
        time.sleep(float(seconds))
        return real(self, *args, **kwargs)

    MlflowClient.log_batch = log_batch


def mlflow_fails(_: str = "") -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    def log_batch(self, *args, **kwargs):
        raise MlflowException("(sqlite3.OperationalError) database is locked")

    MlflowClient.log_batch = log_batch


def compact_slow(seconds: str) -> None:
    from drafter_data.generation.store import CompletionStore

    real = CompletionStore.compact

    def compact(self, *args, **kwargs):
        print(f"injected: compaction delayed {seconds} s", file=sys.stderr)
        time.sleep(float(seconds))
        return real(self, *args, **kwargs)

    CompletionStore.compact = compact


FAULTS = {"disk_full_while": disk_full_while, "mlflow_slow": mlflow_slow, "mlflow_fails": mlflow_fails,
          "compact_slow": compact_slow}

if __name__ == "__main__":
    fault, _, value = sys.argv[1].partition("=")
    assert sys.argv[2] == "--", "usage: python -m tests.inject FAULT -- stages.<name> overrides..."
    FAULTS[fault](value)
    module = sys.argv[3]
    sys.argv = [module, *sys.argv[4:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
